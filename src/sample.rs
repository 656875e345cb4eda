//! `kiln sample`: text from a trained model. A [`Source`] (loaded by the engine,
//! `kiln_engine::train::source`) is a model as `kiln train` left it (a run directory's
//! latest checkpoint, or one checkpoint directory) with the sizes, precision and
//! tokenizer of its run, or weights imported from a file; [`generate`] feeds a prompt
//! and draws new tokens one at a time through a [`Decoder`], streaming each as it comes.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};

use kiln_engine::data::Tokenizer;
use kiln_engine::models::generate::Generator;
use kiln_engine::models::sample::TokenSampler;
use kiln_engine::models::{MicroBatch, Network};
use kiln_engine::{DType, Device, IGNORE_TARGET};

pub use kiln_engine::data::text_codec::{TextCodec, TextStream};
pub use kiln_engine::train::source::{hf_codec, Source, IMPORT_CONTEXT, IMPORT_DTYPE};

/// What produces next-token logits: fed a prompt, then one token at a time.
pub trait Decoder {
    /// The most tokens it can hold (the model's block_size).
    fn context(&self) -> usize;
    /// Starts a sequence with `prompt`; the logits after its last token.
    fn prefill(&mut self, dev: &dyn Device, prompt: &[u32]) -> Result<Vec<f32>>;
    /// Appends `token`; the logits after it.
    fn step(&mut self, dev: &dyn Device, token: u32) -> Result<Vec<f32>>;
}

/// The reference decoder: every token runs the whole sequence through the training
/// network again (O(T²) work per token). Tests compare faster decoders with it; it is
/// not how `kiln sample` should generate.
pub struct Recompute {
    net: Network,
    tokens: Vec<u32>,
}

impl Recompute {
    /// `net` must run micro-batches of one sequence.
    pub fn new(net: Network) -> Result<Recompute> {
        if net.options().batch != 1 {
            bail!("the reference decoder runs one sequence at a time (batch 1)");
        }
        Ok(Recompute {
            net,
            tokens: vec![],
        })
    }

    fn logits(&self, dev: &dyn Device) -> Result<Vec<f32>> {
        let t = self.context();
        let n = self.tokens.len();
        // Positions after the sequence are filled with token 0: attention is causal,
        // so they change nothing before them; none is scored.
        let mut tok = self.tokens.clone();
        tok.resize(t, 0);
        let tgt = vec![IGNORE_TARGET; t];
        self.net.loss(dev, &MicroBatch::tokens(&tok, &tgt))?;
        let buf = self
            .net
            .output(self.net.prediction())
            .expect("the prediction is a graph output");
        let all = dev.download(buf)?.to_f32();
        let v = all.len() / t;
        Ok(all[(n - 1) * v..n * v].to_vec())
    }
}

impl Decoder for Recompute {
    fn context(&self) -> usize {
        self.net.graph().shape(self.net.prediction())[1]
    }

    fn prefill(&mut self, dev: &dyn Device, prompt: &[u32]) -> Result<Vec<f32>> {
        if prompt.is_empty() || prompt.len() > self.context() {
            bail!(
                "a prompt of {} tokens: the model takes 1 to {}",
                prompt.len(),
                self.context()
            );
        }
        self.tokens = prompt.to_vec();
        self.logits(dev)
    }

    fn step(&mut self, dev: &dyn Device, token: u32) -> Result<Vec<f32>> {
        if self.tokens.len() >= self.context() {
            bail!(
                "the sequence already fills the model's {} positions",
                self.context()
            );
        }
        self.tokens.push(token);
        self.logits(dev)
    }
}

/// The decoder `kiln sample` uses: the prompt runs once, then each new token runs
/// only its own position against the keys and values cached on the device.
pub struct Cached(pub Generator);

impl Decoder for Cached {
    fn context(&self) -> usize {
        self.0.max_len()
    }

    fn prefill(&mut self, dev: &dyn Device, prompt: &[u32]) -> Result<Vec<f32>> {
        self.0.reset();
        Ok(self.0.prefill(dev, prompt)?)
    }

    fn step(&mut self, dev: &dyn Device, token: u32) -> Result<Vec<f32>> {
        Ok(self.0.step(dev, token)?)
    }
}

/// How long a generation took, prompt and new tokens apart.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timing {
    pub prompt_tokens: usize,
    pub prompt_s: f64,
    pub new_tokens: usize,
    /// Drawing the new tokens and feeding each back.
    pub decode_s: f64,
}

impl Timing {
    pub fn prompt_rate(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_s.max(1e-9)
    }

    pub fn decode_rate(&self) -> f64 {
        self.new_tokens as f64 / self.decode_s.max(1e-9)
    }
}

/// Checks that a prompt of `prompt` tokens and `new` more fit `context` positions.
/// The last new token is predicted, never fed, so a sequence may reach `context + 1`
/// tokens. Kiln stops at the context rather than sliding a window over it: a window
/// would change what the model sees without saying so.
pub fn check_length(prompt: usize, new: usize, context: usize) -> Result<()> {
    if prompt == 0 {
        bail!("the prompt is empty: give the model some text to continue (--prompt TEXT)");
    }
    if prompt > context {
        bail!(
            "the prompt is {prompt} tokens, longer than the model's context of {context} \
             (its block_size): shorten it"
        );
    }
    if prompt + new > context + 1 {
        bail!(
            "--tokens {new}: after the prompt's {prompt} tokens the model's context of {context} \
             (its block_size) has room for at most {} new tokens (the last one is predicted, \
             not fed back); kiln sample stops at the context rather than sliding a window",
            context + 1 - prompt
        );
    }
    Ok(())
}

/// Feeds `prompt` and draws `new` tokens, handing each to `emit` as it comes; a token
/// of `stop` (the model's end of text) ends it early and is not handed on.
pub fn generate(
    decoder: &mut dyn Decoder,
    dev: &dyn Device,
    prompt: &[u32],
    new: usize,
    sampler: &mut TokenSampler,
    stop: &[u32],
    emit: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<Timing> {
    check_length(prompt.len(), new, decoder.context())?;
    let t0 = Instant::now();
    let mut logits = decoder.prefill(dev, prompt)?;
    let t1 = Instant::now();
    let mut made = 0;
    for i in 0..new {
        let id = sampler.sample(&logits)?;
        // The model's end of text: drawn, not shown or counted.
        if stop.contains(&id) {
            break;
        }
        made += 1;
        emit(id)?;
        if i + 1 < new {
            logits = decoder.step(dev, id)?;
        }
    }
    Ok(Timing {
        prompt_tokens: prompt.len(),
        prompt_s: (t1 - t0).as_secs_f64(),
        new_tokens: made,
        decode_s: t1.elapsed().as_secs_f64(),
    })
}

/// Writes `text` to stdout at once (each token is seen as it comes); a reader that
/// went away (`| head`) ends the output quietly.
pub fn write_now(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::Error::new(e).context("writing the output"))
        }
        _ => Ok(()),
    }
}

/// The one device `--devices` names (default: the best adapter, as `kiln train`).
pub fn open_one_device(devices: &[String]) -> Result<Box<dyn Device>> {
    let specs = if devices.is_empty() {
        vec![crate::devices::default_device()?]
    } else {
        crate::devices::parse_devices(devices)?
    };
    if specs.len() != 1 {
        bail!(
            "--devices {}: names {} devices, and this runs on one; name one (`kiln devices` \
             lists them)",
            devices.join(","),
            specs.len()
        );
    }
    Ok(crate::devices::open_device(
        &specs[0],
        &kiln_wgpu::DeviceOptions::default(),
    )?)
}

/// What `kiln sample` is told.
#[derive(Clone, Debug)]
pub struct SampleOptions {
    /// A run directory or a checkpoint directory.
    pub source: PathBuf,
    /// A LoRA adapter (PEFT's format) merged into the source's weights first.
    pub adapter: Option<PathBuf>,
    /// The text to continue.
    pub prompt: Option<String>,
    /// A file of prompts, one per line, each continued in turn.
    pub prompts: Option<PathBuf>,
    /// New tokens per prompt; `None`: as many as the context holds, at most 256.
    pub tokens: Option<usize>,
    pub sampling: kiln_engine::models::sample::SamplingOptions,
    pub seed: u64,
    pub devices: Vec<String>,
    /// Run in this dtype; `None`: the checkpoint's own (16-bit for imported files).
    pub dtype: Option<DType>,
    /// Each prompt is a user's message, put in the model's chat template (an instruct
    /// model's Hugging Face tokenizer has one); the model answers it.
    pub chat: bool,
}

/// New tokens when `--tokens` is not given, if the context has room for them.
const DEFAULT_NEW_TOKENS: usize = 256;

/// Reads the prompts and checks every one (vocabulary, length) before any device opens.
fn prompts(opts: &SampleOptions, source: &Source) -> Result<Vec<(String, Vec<u32>, usize)>> {
    let texts: Vec<String> = match (&opts.prompt, &opts.prompts) {
        (Some(_), Some(_)) => bail!("pass --prompt TEXT or --prompts FILE, not both"),
        (Some(p), None) => vec![p.clone()],
        (None, Some(file)) => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("reading the prompts file {}", file.display()))?;
            let lines: Vec<String> = text
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_string)
                .collect();
            if lines.is_empty() {
                bail!("{}: no prompt in it (one per line)", file.display());
            }
            lines
        }
        (None, None) => bail!("no prompt: pass --prompt TEXT (or --prompts FILE, one per line)"),
    };
    let context = source.block_size();
    let codec = source.text_codec()?;
    if opts.tokens == Some(0) {
        bail!(
            "--tokens 0 asks for no new token: pass 1 to {context} (this model's context), or \
             leave it out for as many as the context holds, at most {DEFAULT_NEW_TOKENS}"
        );
    }
    let chat = match (&codec, opts.chat) {
        (_, false) => None,
        (TextCodec::Tokens(Tokenizer::Hf(t)), true) => Some(t.clone()),
        (other, true) => bail!(
            "--chat needs a Hugging Face tokenizer with a chat template, and this model's \
             tokenizer is {}",
            other.name()
        ),
    };
    texts
        .into_iter()
        .map(|text| {
            let (text, ids) = match &chat {
                // The template marks its own special tokens (BOS included): none added.
                Some(t) => {
                    let rendered = t.chat(&[("user", &text)], true)?;
                    let ids = t.encode(&rendered, false, Path::new("the chat prompt"))?;
                    (format!("{text}\n"), ids)
                }
                None => {
                    let ids = codec.encode(&text)?;
                    (text, ids)
                }
            };
            let room = (context + 1).saturating_sub(ids.len());
            let new = opts.tokens.unwrap_or(DEFAULT_NEW_TOKENS.min(room));
            check_length(ids.len(), new, context).with_context(|| format!("prompt {text:?}"))?;
            Ok((text, ids, new))
        })
        .collect()
}

/// Continues each prompt, streaming the text to stdout; returns the time taken.
pub fn sample(opts: &SampleOptions) -> Result<Timing> {
    let mut source = Source::open(&opts.source, opts.dtype)?;
    if let Some(dir) = &opts.adapter {
        source = source.with_adapter(dir)?;
    }
    for note in &source.notes {
        crate::say::say(format!("note: {note}"));
    }
    let codec = source.text_codec()?;
    let mut sampler = TokenSampler::new(opts.sampling, codec.vocab_size(), opts.seed)?;
    let work = prompts(opts, &source)?;
    let dev = open_one_device(&opts.devices)?;
    let dev: &dyn Device = dev.as_ref();
    let mut decoder = Cached(source.generator(dev)?);
    // A Hugging Face model's end-of-text tokens end a continuation early.
    let stop = match &codec {
        TextCodec::Tokens(Tokenizer::Hf(t)) => t.eos.clone(),
        _ => vec![],
    };
    let mut total = Timing::default();
    for (text, ids, new) in work {
        write_now(&text)?;
        let mut stream = TextStream::new(codec.clone()).after(&ids)?;
        let mut last = text.chars().last();
        let timing = generate(
            &mut decoder,
            dev,
            &ids,
            new,
            &mut sampler,
            &stop,
            &mut |id| {
                let piece = stream.push(id)?;
                if let Some(c) = piece.chars().last() {
                    last = Some(c);
                }
                write_now(&piece)
            },
        )?;
        let rest = stream.finish();
        if let Some(c) = rest.chars().last() {
            last = Some(c);
        }
        write_now(&rest)?;
        if last != Some('\n') {
            write_now("\n")?;
        }
        total.prompt_tokens += timing.prompt_tokens;
        total.prompt_s += timing.prompt_s;
        total.new_tokens += timing.new_tokens;
        total.decode_s += timing.decode_s;
    }
    crate::say::say(format!(
        "prompt: {} tokens in {:.1} ms ({:.1} tokens/s); decode: {} tokens in {:.1} ms ({:.1} \
         tokens/s); {} on {} ({})",
        total.prompt_tokens,
        total.prompt_s * 1e3,
        total.prompt_rate(),
        total.new_tokens,
        total.decode_s * 1e3,
        total.decode_rate(),
        source.dtype,
        dev.caps().name,
        dev.caps().backend
    ));
    Ok(total)
}
