//! Models and the contract they meet: a [`Model`] declares its parameters, records its
//! forward pass and loss on the graph, and names its blocks; a [`Network`] is a model
//! on a device (parameters in flat buffers, a compiled plan: `network`; what is
//! decided before a device is touched in `network_build`, its bytes in
//! `network_memory`, its weights and checkpoint state in `network_state`). GPT-2
//! (`gpt`), a Llama-style model (`llama`) and an MLP classifier (`mlp`) are three
//! implementations; `sample` chooses generated tokens from a language model's logits.

pub mod checkpointed;
mod config;
pub mod generate;
pub mod gpt;
pub mod import;
pub mod import_llama;
pub mod llama;
pub mod lora;
pub mod mlp;
mod network;
mod network_build;
mod network_memory;
mod network_state;
pub mod sample;

pub use config::ModelConfig;
pub use generate::Generator;
pub(crate) use network::{
    batch_input, best_per_row, check_documents, check_ids, one_document_per_row, random_key,
};
pub use network::{MicroBatch, Network, Ready};
pub(crate) use network_build::{
    check_sharing, check_specs, declare_params, draw_initial, hand_over_groups, record,
    shared_gradients,
};
pub use network_build::{NetworkOptions, Partition};
pub use network_memory::{
    host_memory_available, host_peak_resident, human, ModelStateBytes, NetworkMemory, ShardBytes,
};
pub use network_state::ParamState;
pub(crate) use network_state::{in_file, match_frozen, weight_copies};

use crate::graph::{Graph, Tensor};
use crate::{DType, Error, Result};

/// Layers a model may have. GPT-3 has 96 and the largest Llama 126: a config asking for
/// more than 4096 is taken as a mistake, refused before per-layer tables are built
/// (their time and memory grow with it).
pub const MAX_LAYERS: usize = 4096;

/// Elements one tensor may hold: the GPU kernels index elements with 32-bit integers,
/// so a larger tensor would be silently cut short there.
pub const MAX_TENSOR_ELEMENTS: usize = u32::MAX as usize;

/// Parameter elements a model may have in all (4.4 trillion, 70 TB of training state):
/// far past any device or host, and small enough that every byte count computed from it
/// fits a u64.
pub const MAX_PARAMETERS: usize = 1 << 42;

/// The product of `dims`, or an error naming `what` when it overflows or exceeds
/// [`MAX_TENSOR_ELEMENTS`]: how models check their shapes before building them.
pub fn tensor_elements(what: &str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|&n| n <= MAX_TENSOR_ELEMENTS)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{what} would be a tensor of {} elements, over the {MAX_TENSOR_ELEMENTS} one \
                 tensor may hold (GPU kernels index elements with 32-bit integers); make one of \
                 those sizes smaller",
                dims.iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(" × ")
            ))
        })
}

/// How a parameter's values start.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Every element this value (norm weights 1, biases 0).
    Const(f32),
    /// Uniform with this standard deviation (bound std·√3), drawn in parameter order
    /// from the network's seed.
    Uniform(f32),
    /// Normal with mean 0 and this standard deviation (GPT-2's initialisation), drawn
    /// on the host in parameter order from the network's seed: the same values on
    /// every device and backend.
    Normal(f32),
}

/// One parameter as a model declares it.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    /// The checkpoint name (a model's own convention: GPT-2's `transformer.h.0.…`,
    /// Hugging Face Llama's `model.layers.0.…`).
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
    /// The gradient is f32 whatever the precision: embedding tables and norm weights,
    /// whose kernels accumulate their gradients in f32. Otherwise the storage dtype.
    pub f32_grad: bool,
    /// Weight decay applies (matrices; not biases, norms or, by GPT-2's convention,
    /// embeddings). Parameters with the same `f32_grad` and `decay` form one optimizer
    /// group: one flat buffer, updated by one launch.
    pub decay: bool,
    /// A second name this tensor is known by where it is tied: a language model whose
    /// head reads the token embedding stores one tensor, `name`, that other tools also
    /// call `lm_head.weight`. Loading accepts either name.
    pub tied: Option<String>,
    /// Not trained (a LoRA run's base weights): held once in the storage dtype, with
    /// no gradient, master copy or optimizer moments. Frozen parameters come after
    /// every trained one in [`Model::parameters`], and blocks name trained ones only.
    pub frozen: bool,
}

impl ParamSpec {
    /// A parameter with no tie.
    pub fn new(name: impl Into<String>, shape: &[usize], init: Init) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
            init,
            f32_grad: false,
            decay: false,
            tied: None,
            frozen: false,
        }
    }

    /// Not trained (see [`ParamSpec::frozen`]).
    pub fn frozen(mut self) -> ParamSpec {
        self.frozen = true;
        self
    }

    /// Decayed by the optimizer (a weight matrix).
    pub fn decayed(mut self) -> ParamSpec {
        self.decay = true;
        self
    }

    /// Its gradient is f32 (an embedding table or a norm weight).
    pub fn f32_grad(mut self) -> ParamSpec {
        self.f32_grad = true;
        self
    }

    /// Also known as `other` (tied).
    pub fn tied(mut self, other: impl Into<String>) -> ParamSpec {
        self.tied = Some(other.into());
        self
    }

    /// Elements (the shape's product). Only for a checked spec: [`ParamSpec::checked_len`]
    /// is the one that cannot overflow.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Elements, or `None` where the shape's product overflows.
    pub fn checked_len(&self) -> Option<usize> {
        self.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What a model's recorded forward pass hands back.
#[derive(Clone, Debug)]
pub struct Forward {
    /// The data each micro-batch uploads, in the order a [`MicroBatch`] lists it
    /// (e.g. tokens, then targets).
    pub inputs: Vec<Tensor>,
    /// The tensor evaluation reads (the logits): its rows' argmax are the predictions.
    pub prediction: Tensor,
}

/// A trainable model: what the trainer, data parallelism, ZeRO and checkpoints need to
/// know of it, and nothing more. Object-safe, so a trainer holds any model as
/// `Arc<dyn Model>`.
pub trait Model: Send + Sync {
    /// One line for logs, e.g. `GPT-2 (2 layers, 64 embd, 4 heads, T 9, vocab 13)`.
    fn describe(&self) -> String;

    /// Checks the sizes before [`Model::parameters`] builds its tables: a model whose
    /// parameter list would be unbounded (absurd layer counts) or whose shapes overflow
    /// says so here, as an error naming the setting. A [`Network`] calls it first. The
    /// default: nothing to check (the network still checks every declared shape).
    fn check_sizes(&self) -> Result<()> {
        Ok(())
    }

    /// Every parameter, in the order [`Model::forward`] receives them.
    fn parameters(&self) -> Vec<ParamSpec>;

    /// Records the forward pass and the loss (one cross-entropy or mean-squared error)
    /// for a micro-batch of `batch` examples with activations stored as `dtype`.
    /// `params` are the declared parameters' tensors, in order.
    fn forward(
        &self,
        g: &mut Graph,
        params: &[Tensor],
        batch: usize,
        dtype: DType,
    ) -> Result<Forward>;

    /// The blocks: groups of parameter indices whose gradients become final together
    /// during backward (a transformer's layers). A data-parallel exchange starts on a
    /// block as soon as backward is done with it; under ZeRO stage 2 the blocks that
    /// look alike (same shapes in the same order) share one set of gradient buffers;
    /// pipeline stages cut between blocks. Parameters in no block (embeddings, final
    /// norm) form one more group. The default: no blocks.
    fn blocks(&self) -> Vec<Vec<usize>> {
        vec![]
    }
}

/// A language model that generates ([`Generator`]): its forward, recorded on a
/// decoding graph ([`Graph::decoding`]), is its generation too, so all a model adds is
/// how far it may generate and a copy of itself for a pass of other length.
pub trait Decoder: Model {
    /// Refuses generating `max_len` positions past what the model has weights or
    /// training for (GPT-2's position table, a Llama's context or sliding window),
    /// naming the limit.
    fn check_context(&self, max_len: usize) -> Result<()>;

    /// The same model recording sequences of `seq` tokens: a decode pass of `seq` new
    /// rows.
    fn with_seq(&self, seq: usize) -> Box<dyn Decoder>;
}

/// Refuses generating `max_len` positions outside `1..=block_size`, saying what the
/// model has for those positions (`why`): the check every [`Decoder`] starts with.
pub(crate) fn check_block_size(max_len: usize, block_size: usize, why: &str) -> Result<()> {
    if max_len == 0 || max_len > block_size {
        return Err(Error::InvalidArgument(format!(
            "generate: max_len {max_len} must be 1..={block_size} (the model's block_size: \
             {why})"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::ModelConfig;

    #[test]
    fn model_files_name_their_architecture_and_are_read_strictly() {
        let gpt = r#"{"n_layer": 1, "n_head": 2, "n_embd": 8, "block_size": 4, "vocab_size": 5}"#;
        assert!(matches!(ModelConfig::parse(gpt), Ok(ModelConfig::Gpt2(_))));
        let bom = format!("\u{feff}{gpt}");
        assert!(matches!(ModelConfig::parse(&bom), Ok(ModelConfig::Gpt2(_))));
        let llama = r#"{"architecture": "llama", "n_layer": 1, "n_head": 4, "n_kv_head": 2,
            "n_embd": 16, "block_size": 4, "vocab_size": 5}"#;
        let Ok(ModelConfig::Llama(c)) = ModelConfig::parse(llama) else {
            panic!("not a llama");
        };
        assert_eq!(
            (c.kv_heads(), c.intermediate(), c.rope_theta),
            (2, 48, 10000.0)
        );
        let e = ModelConfig::parse(r#"{"architecture": "mamba"}"#).unwrap_err();
        assert!(
            e.contains("unknown architecture `mamba`") && e.contains("gpt2, llama"),
            "{e}"
        );
        let e = ModelConfig::parse(&gpt.replace("n_head", "n_heads")).unwrap_err();
        assert!(e.contains("n_heads") && e.contains("gpt2 model"), "{e}");
        let e = ModelConfig::parse(&llama.replace("n_kv_head", "kv_heads")).unwrap_err();
        assert!(e.contains("kv_heads") && e.contains("n_kv_head"), "{e}");
    }

    #[test]
    fn a_padded_vocabulary_is_read_checked_and_recorded() {
        let text = r#"{"n_layer": 1, "n_head": 2, "n_embd": 8, "block_size": 4,
            "vocab_size": 50257, "padded_vocab_size": 50304}"#;
        let Ok(ModelConfig::Gpt2(c)) = ModelConfig::parse(text) else {
            panic!("not a gpt");
        };
        assert_eq!((c.vocab_size, c.padded_vocab()), (50257, 50304));
        c.check().unwrap();
        assert_eq!(
            ModelConfig::Gpt2(c.clone()).record()["padded_vocab_size"],
            50304
        );
        // The embedding has the padded rows; the parameter count counts them.
        let unpadded = super::gpt::GptConfig {
            padded_vocab_size: None,
            ..c.clone()
        };
        assert_eq!(
            c.parameter_count() - unpadded.parameter_count(),
            (50304 - 50257) * 8
        );
        assert!(ModelConfig::Gpt2(unpadded)
            .record()
            .get("padded_vocab_size")
            .is_none());
        let below = super::gpt::GptConfig {
            padded_vocab_size: Some(50000),
            ..c
        };
        let e = below.check().unwrap_err().to_string();
        assert!(
            e.contains("padded_vocab_size 50000 is below vocab_size 50257"),
            "{e}"
        );
    }

    #[test]
    fn heads_the_fused_kernels_cannot_take_are_refused_in_the_models_terms() {
        use super::{gpt, llama, Model, Network, NetworkOptions};
        use crate::graph::Attention;
        let options = NetworkOptions {
            batch: 1,
            dtype: crate::DType::F32,
            optimizer: crate::Optimizer::adamw(1e-3, 0.0),
            seed: 0,
            packed: false,
        };
        let cfg = gpt::GptConfig {
            n_layer: 1,
            n_head: 1,
            n_embd: 256,
            block_size: 4,
            vocab_size: 5,
            padded_vocab_size: None,
        };
        let models: [Box<dyn Model>; 2] = [
            Box::new(gpt::Gpt::new(cfg, 4).with_attention(Attention::Fused)),
            Box::new(
                llama::Llama::new(
                    serde_json::from_str(
                        r#"{"n_layer": 1, "n_head": 1, "n_embd": 256, "block_size": 4, "vocab_size": 5}"#,
                    )
                    .unwrap(),
                    4,
                )
                .with_attention(Attention::Fused),
            ),
        ];
        for (model, name) in models.iter().zip(["gpt", "llama"]) {
            let e = Network::memory(model.as_ref(), &options)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!(
                    "{name}: fused attention takes head dims up to 128"
                )),
                "{e}"
            );
            assert!(e.contains("not 256"), "{e}");
        }
    }
}
