//! `kiln bench sample`: generation speed with the K/V cache, prompt (prefill) and
//! decode tokens per second measured apart, on a GPT-2-shaped model with random weights.

use std::time::{Duration, Instant};

use kiln_engine::device::compiling;
use kiln_engine::models::gpt::{Gpt, GptConfig};
use kiln_engine::models::{Generator, Model};
use kiln_engine::{DType, Device, Error, Result};
use serde::Serialize;

/// One measured (device, model, dtype).
#[derive(Clone, Debug, Serialize)]
pub struct SampleRow {
    pub adapter: String,
    pub model: String,
    pub dtype: String,
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    /// Building the generator (weights uploaded, first pass recorded), seconds.
    pub setup_s: f64,
    /// Prompt tokens per second: one prefill of `prompt_tokens`, its logits downloaded.
    pub prompt_tok_s: f64,
    /// Decoded tokens per second: one step per token, each one's logits downloaded
    /// (what a sampler needs before it can choose the next).
    pub decode_tok_s: f64,
}

/// The models `kiln bench sample` knows by name.
pub fn model_by_name(name: &str) -> Result<GptConfig> {
    match name {
        "addition" => Ok(GptConfig {
            n_layer: 2,
            n_head: 4,
            n_embd: 64,
            block_size: 9,
            vocab_size: 13,
            padded_vocab_size: None,
        }),
        "gpt2-124m" => Ok(GptConfig {
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            block_size: 1024,
            vocab_size: 50257,
            padded_vocab_size: None,
        }),
        other => Err(Error::InvalidArgument(format!(
            "bench sample: unknown model `{other}`; use addition or gpt2-124m"
        ))),
    }
}

/// Random weights (uniform, GPT-2's 0.02 scale; speed does not depend on the values),
/// drawn with a fixed xorshift so runs are comparable.
fn random_weights(model: &Gpt) -> Vec<(String, Vec<f32>)> {
    let mut s: u64 = 0x9E37_79B9_7F4A_7C15;
    model
        .parameters()
        .into_iter()
        .map(|spec| {
            let values = (0..spec.len())
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.07
                })
                .collect();
            (spec.name, values)
        })
        .collect()
}

/// Measures one model on one device: a warm-up pass (prefill and a few steps: pipeline
/// compilation), then `prompt` tokens of prefill and `decode` steps, timed apart, over
/// as many sequences as fit about a second.
pub fn measure(
    dev: &dyn Device,
    name: &str,
    cfg: &GptConfig,
    dtype: DType,
    prompt: usize,
    decode: usize,
) -> Result<SampleRow> {
    let max_len = prompt + decode;
    if prompt == 0 || decode == 0 || max_len > cfg.block_size {
        return Err(Error::InvalidArgument(format!(
            "bench sample: {prompt} prompt + {decode} decoded tokens must both be positive \
             and fit the {name} model's block_size {}",
            cfg.block_size
        )));
    }
    let model = Gpt::new(cfg.clone(), 1);
    let started = Instant::now();
    let before = compiling::snapshot();
    let mut gen = Generator::new(dev, &model, &random_weights(&model), dtype, max_len)?;
    let vocab = cfg.vocab_size as u32;
    let tokens: Vec<u32> = (0..prompt as u32).map(|i| (i * 7 + 3) % vocab).collect();
    // Warm-up: every pass the measured run uses, so no compilation is timed.
    let run = |gen: &mut Generator, steps: usize| -> Result<(Duration, Duration)> {
        gen.reset();
        let t0 = Instant::now();
        let mut logits = gen.prefill(dev, &tokens)?;
        let t1 = Instant::now();
        for _ in 0..steps {
            let next = argmax(&logits);
            logits = gen.step(dev, next)?;
        }
        Ok((t1 - t0, t1.elapsed()))
    };
    crate::bench::warm_until_built(&format!("bench sample: {name}"), before, || {
        run(&mut gen, decode.min(2)).map(drop)
    })?;
    let setup_s = started.elapsed().as_secs_f64();
    // Whole sequences until about a second has gone (at least 3): tiny models take
    // milliseconds per sequence, where one run would be mostly noise.
    let (mut prefill, mut steps, mut reps) = (Duration::ZERO, Duration::ZERO, 0u32);
    while reps < 3 || prefill + steps < Duration::from_secs(1) {
        let (p, s) = run(&mut gen, decode)?;
        prefill += p;
        steps += s;
        reps += 1;
    }
    gen.free(dev)?;
    Ok(SampleRow {
        adapter: format!("{} ({})", dev.caps().name, dev.caps().backend),
        model: name.to_string(),
        dtype: dtype.to_string(),
        prompt_tokens: prompt,
        decode_tokens: decode,
        setup_s,
        prompt_tok_s: (reps as usize * prompt) as f64 / prefill.as_secs_f64(),
        decode_tok_s: (reps as usize * decode) as f64 / steps.as_secs_f64(),
    })
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// The rows as aligned text columns.
pub fn format_sample(rows: &[SampleRow]) -> String {
    let mut table = vec![[
        "adapter",
        "model",
        "dtype",
        "prompt",
        "decoded",
        "setup s",
        "prompt tok/s",
        "decode tok/s",
    ]
    .map(String::from)
    .to_vec()];
    for r in rows {
        table.push(vec![
            r.adapter.clone(),
            r.model.clone(),
            r.dtype.clone(),
            r.prompt_tokens.to_string(),
            r.decode_tokens.to_string(),
            format!("{:.1}", r.setup_s),
            format!("{:.1}", r.prompt_tok_s),
            format!("{:.1}", r.decode_tok_s),
        ]);
    }
    crate::bench::align(&table)
}
