//! The models: GPT-2 (`gpt`) and a small MLP classifier (`mlp`), each written once as a
//! forward pass on the graph.

pub mod gpt;
pub(crate) mod gpt_graph;
pub mod mlp;
