//! GPT-2's byte-level BPE: tiktoken's `r50k_base` as the `tiktoken-rs` crate packages
//! it (its merge table compiled into the binary; nothing is downloaded). Behind the
//! `tokenizers` feature: a build without it refuses the `gpt2` tokenizer by name.

use super::{DataError, Result};

/// The ids of `text`, encoded as ordinary text (a literal `<|endoftext|>` is not the
/// special token).
#[cfg(feature = "tokenizers")]
pub(crate) fn encode(text: &str) -> Result<Vec<u32>> {
    Ok(tiktoken_rs::r50k_base_singleton().encode_ordinary(text))
}

/// The bytes `ids` stand for.
#[cfg(feature = "tokenizers")]
pub(crate) fn decode_bytes(ids: &[u32]) -> Result<Vec<u8>> {
    tiktoken_rs::r50k_base_singleton()
        .decode_bytes(ids)
        .map_err(|e| DataError::InvalidArgument(format!("gpt2 tokenizer: {e:?}")))
}

#[cfg(not(feature = "tokenizers"))]
pub(crate) fn encode(_: &str) -> Result<Vec<u32>> {
    Err(absent())
}

#[cfg(not(feature = "tokenizers"))]
pub(crate) fn decode_bytes(_: &[u32]) -> Result<Vec<u8>> {
    Err(absent())
}

/// The error of a build without the GPT-2 BPE.
pub(crate) fn absent() -> DataError {
    DataError::InvalidArgument(
        "this build of kiln-engine has no GPT-2 tokenizer; build it with the `tokenizers` \
         feature (on by default), or use the bytes tokenizer"
            .into(),
    )
}
