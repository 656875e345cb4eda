//! GPT-2 on the graph (written below).
