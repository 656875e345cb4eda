//! Choosing generated tokens: greedy, temperature, top-k, top-p, seeds, the padded
//! vocabulary, and the refusals of settings with no meaning.

use kiln::engine::models::sample::{argmax, SamplingOptions, TokenSampler};

const LOGITS: [f32; 8] = [2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2];

fn options(temperature: f32, top_k: Option<usize>, top_p: Option<f32>) -> SamplingOptions {
    SamplingOptions {
        temperature,
        top_k,
        top_p,
    }
}

/// softmax(logits / t) in f64: the reference the draws are compared with.
fn softmax(logits: &[f32], t: f64) -> Vec<f64> {
    let top = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let e: Vec<f64> = logits
        .iter()
        .map(|&x| ((x as f64 - top) / t).exp())
        .collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

fn counts(sampler: &mut TokenSampler, logits: &[f32], draws: usize) -> Vec<u64> {
    let mut c = vec![0u64; logits.len()];
    for _ in 0..draws {
        c[sampler.sample(logits).unwrap() as usize] += 1;
    }
    c
}

/// Pearson's statistic of observed counts against expected probabilities, over the
/// categories with a nonzero expectation (a draw outside them is an outright failure).
fn chi_square(observed: &[u64], expected: &[f64], n: usize) -> f64 {
    observed
        .iter()
        .zip(expected)
        .map(|(&o, &p)| {
            if p == 0.0 {
                assert_eq!(o, 0, "a token of probability 0 was drawn");
                return 0.0;
            }
            let e = p * n as f64;
            (o as f64 - e).powi(2) / e
        })
        .sum()
}

#[test]
fn temperature_zero_and_top_k_one_are_greedy() {
    let mut logits = LOGITS.to_vec();
    // A tie with the maximum later on: the first maximum wins, as evaluation takes it.
    logits.push(2.0);
    for (opts, seed) in [
        (options(0.0, None, None), 1),
        (options(0.0, Some(5), Some(0.5)), 2),
        (options(1.0, Some(1), None), 3),
        (options(5.0, Some(1), Some(0.9)), 4),
    ] {
        let mut s = TokenSampler::new(opts, logits.len(), seed).unwrap();
        for _ in 0..50 {
            assert_eq!(s.sample(&logits).unwrap(), 0, "{opts:?}");
        }
        assert_eq!(s.distribution(&logits).unwrap(), vec![(0, 1.0)]);
    }
    assert_eq!(argmax(&logits), 0);
    assert_eq!(argmax(&[0.0, 3.0, -1.0, 3.0]), 1);
}

#[test]
fn a_fixed_seed_reproduces_the_draws_and_another_seed_does_not() {
    let draw = |seed: u64| {
        let mut s = TokenSampler::new(options(1.0, None, None), LOGITS.len(), seed).unwrap();
        (0..200)
            .map(|_| s.sample(&LOGITS).unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(draw(7), draw(7));
    assert_ne!(draw(7), draw(8));
}

#[test]
fn top_p_keeps_the_smallest_set_with_mass_at_least_p() {
    // Probabilities 0.5, 0.3, 0.15, 0.05 (as logits: their logarithms).
    let probs = [0.5f32, 0.3, 0.15, 0.05];
    let logits: Vec<f32> = probs.iter().map(|p| p.ln()).collect();
    let kept = |p: f32| -> Vec<u32> {
        let s = TokenSampler::new(options(1.0, None, Some(p)), 4, 1).unwrap();
        s.distribution(&logits)
            .unwrap()
            .iter()
            .map(|c| c.0)
            .collect()
    };
    assert_eq!(kept(0.4), vec![0], "0.5 alone reaches 0.4");
    assert_eq!(kept(0.55), vec![0, 1]);
    assert_eq!(kept(0.75), vec![0, 1]);
    assert_eq!(kept(0.85), vec![0, 1, 2]);
    assert_eq!(kept(0.96), vec![0, 1, 2, 3]);
    assert_eq!(kept(1.0), vec![0, 1, 2, 3]);
    // Equal logits give probabilities exact in binary (1/4 each), so the boundary is
    // exact too: a mass equal to p is enough, ties keep the lower ids.
    let even = TokenSampler::new(options(1.0, None, Some(0.5)), 4, 1).unwrap();
    let d = even.distribution(&[3.0; 4]).unwrap();
    assert_eq!(d, vec![(0, 0.5), (1, 0.5)]);
    // The kept probabilities are renormalised, and only kept tokens are ever drawn.
    let s = TokenSampler::new(options(1.0, None, Some(0.75)), 4, 1).unwrap();
    let d = s.distribution(&logits).unwrap();
    assert!(
        (d[0].1 - 0.625).abs() < 1e-6 && (d[1].1 - 0.375).abs() < 1e-6,
        "{d:?}"
    );
    let mut s = s;
    let c = counts(&mut s, &logits, 2000);
    assert_eq!(c[2] + c[3], 0, "{c:?}");
    assert!(c[0] > 0 && c[1] > 0, "{c:?}");
}

#[test]
fn top_k_keeps_the_k_likeliest() {
    let s = TokenSampler::new(options(1.0, Some(3), None), LOGITS.len(), 1).unwrap();
    let ids: Vec<u32> = s
        .distribution(&LOGITS)
        .unwrap()
        .iter()
        .map(|c| c.0)
        .collect();
    assert_eq!(ids, vec![0, 6, 1]);
}

/// 10 000 draws at temperature 1 against softmax(logits) by Pearson's chi-square test:
/// 8 tokens, so 7 degrees of freedom, whose 0.999 quantile is 24.32 (a correct sampler
/// exceeds it for one seed in a thousand). The seed is fixed, so the draws, and the
/// statistic, are the same on every run: the test cannot flake; it either holds for
/// this seed or the sampler is wrong. Five seeds are checked, so a seed that happened
/// to land in the 0.1% tail would have shown when the test was written. The smallest
/// expected count is 10 000 × 0.019 = 190, far above the 5 the test needs. The same
/// draws compared with softmax(logits / 2) — what a sampler that got the temperature
/// wrong would be measured against — fail the bound by far, so the test can see such
/// a mistake.
#[test]
fn ten_thousand_draws_follow_the_softmax_by_chi_square() {
    const N: usize = 10_000;
    const BOUND_7_DF: f64 = 24.32;
    let want = softmax(&LOGITS, 1.0);
    let wrong = softmax(&LOGITS, 2.0);
    for seed in 1..=5 {
        let mut s = TokenSampler::new(options(1.0, None, None), LOGITS.len(), seed).unwrap();
        let c = counts(&mut s, &LOGITS, N);
        let x2 = chi_square(&c, &want, N);
        assert!(
            x2 < BOUND_7_DF,
            "seed {seed}: chi-square {x2:.2} >= {BOUND_7_DF} (7 df, p 0.001): {c:?}"
        );
        let off = chi_square(&c, &wrong, N);
        assert!(off > 10.0 * BOUND_7_DF, "seed {seed}: {off:.1}");
    }
}

/// Temperature and top-k together: 4 tokens kept, softmax(logits / 0.7) over them,
/// 3 degrees of freedom, 0.999 quantile 16.27 (fixed seed, as above).
#[test]
fn temperature_and_top_k_draws_follow_the_cut_softmax() {
    const N: usize = 10_000;
    const BOUND_3_DF: f64 = 16.27;
    let kept = [0usize, 6, 1, 2];
    let sub: Vec<f32> = kept.iter().map(|&i| LOGITS[i]).collect();
    let sub_p = softmax(&sub, 0.7);
    let mut want = vec![0.0; LOGITS.len()];
    for (&i, &p) in kept.iter().zip(&sub_p) {
        want[i] = p;
    }
    let mut s = TokenSampler::new(options(0.7, Some(4), None), LOGITS.len(), 11).unwrap();
    let c = counts(&mut s, &LOGITS, N);
    let x2 = chi_square(&c, &want, N);
    assert!(x2 < BOUND_3_DF, "chi-square {x2:.2}: {c:?}");
}

#[test]
fn padded_vocabulary_rows_are_never_drawn() {
    // Ids 8.. stand for no token (a vocabulary padded for speed), with the largest logits.
    let mut logits = LOGITS.to_vec();
    logits.extend([50.0, 60.0, 70.0]);
    let mut greedy = TokenSampler::new(options(0.0, None, None), 8, 1).unwrap();
    assert_eq!(greedy.sample(&logits).unwrap(), 0);
    let mut s = TokenSampler::new(options(3.0, None, None), 8, 1).unwrap();
    let c = counts(&mut s, &logits, 3000);
    assert_eq!(c[8..], [0, 0, 0]);
    // Fewer logits than the vocabulary: a model smaller than its tokenizer.
    let e = s.sample(&LOGITS[..5]).unwrap_err().to_string();
    assert!(e.contains("5 logits for a vocabulary of 8"), "{e}");
}

#[test]
fn meaningless_settings_and_logits_are_refused_with_the_setting_named() {
    let bad = |o: SamplingOptions, want: &str| {
        let e = TokenSampler::new(o, 8, 1).unwrap_err().to_string();
        assert!(e.contains(want), "{o:?}: {e}");
    };
    bad(options(-0.5, None, None), "temperature -0.5");
    bad(options(f32::NAN, None, None), "temperature NaN");
    bad(options(f32::INFINITY, None, None), "finite number >= 0");
    bad(options(1.0, Some(0), None), "top-k 0");
    bad(
        options(1.0, None, Some(0.0)),
        "top-p 0: it must be in (0, 1]",
    );
    bad(options(1.0, None, Some(1.5)), "top-p 1.5");
    bad(options(1.0, None, Some(f32::NAN)), "top-p NaN");
    let e = TokenSampler::new(options(1.0, None, None), 0, 1).unwrap_err();
    assert!(e.to_string().contains("at least one token"), "{e}");

    let mut s = TokenSampler::new(options(1.0, None, None), 3, 1).unwrap();
    let e = s.sample(&[0.0, f32::NAN, 1.0]).unwrap_err().to_string();
    assert!(
        e.contains("token 1 is NaN") && e.contains("earlier checkpoint"),
        "{e}"
    );
    let e = s.sample(&[f32::NEG_INFINITY; 3]).unwrap_err().to_string();
    assert!(e.contains("every logit is -infinity"), "{e}");
    // A temperature too small to divide by is greedy, not NaN.
    let mut tiny = TokenSampler::new(options(1e-45, None, None), 3, 1).unwrap();
    assert_eq!(tiny.sample(&[0.0, 2.0, 2.0]).unwrap(), 1);
}

mod demo_run;
use demo_run::{kiln, stderr};

fn sample(run: &std::path::Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["sample", run.to_str().unwrap(), "--devices", "cpu"];
    args.extend_from_slice(extra);
    kiln(&args)
}

#[test]
fn kiln_sample_greedy_answers_the_demo_prompt_as_network_predict_does() {
    let (run, _) = demo_run::run("sample");
    let args = ["--prompt", "47+85=", "--temperature", "0", "--tokens", "4"];
    let a = sample(run, &args);
    assert!(a.status.success(), "{}", stderr(&a));
    let b = sample(run, &args);
    assert_eq!(a.stdout, b.stdout, "two greedy runs differ");
    let dev = kiln::cpu::CpuDevice::new();
    let net = demo_run::network(run, &dev);
    let answer = demo_run::greedy(&net, &dev, "47+85=", 4);
    let mut want = format!("47+85={answer}");
    if !want.ends_with('\n') {
        want.push('\n');
    }
    assert_eq!(String::from_utf8_lossy(&a.stdout), want);
    // Prompt and decode throughput, apart, on stderr.
    let err = stderr(&a);
    assert!(
        err.contains("prompt: 6 tokens in") && err.contains("decode: 4 tokens in"),
        "{err}"
    );
    // A checkpoint directory is a source too, with the same weights.
    let ck = kiln::engine::train::checkpoint::load_latest(run)
        .unwrap()
        .dir;
    let c = sample(&ck, &args);
    assert_eq!(c.stdout, a.stdout, "{}", stderr(&c));
}

#[test]
fn kiln_sample_with_a_seed_repeats_its_text() {
    let (run, _) = demo_run::run("sample");
    let args = ["--prompt", "12+34=", "--temperature", "1.5", "--seed", "9"];
    let a = sample(run, &args);
    assert!(a.status.success(), "{}", stderr(&a));
    assert_eq!(a.stdout, sample(run, &args).stdout);
    // Without --tokens: as many as the context holds (9 fed + 1 predicted = 10).
    let text = String::from_utf8_lossy(&a.stdout).into_owned();
    let ids = kiln::engine::data::Addition::encode(text.trim_end_matches('\n'))
        .unwrap_or_else(|| panic!("{text:?}"));
    assert!(ids.len() >= 9, "{text:?}");
}

#[test]
fn kiln_sample_refuses_bad_input_with_the_fix() {
    let (run, _) = demo_run::run("sample");
    let cases: [(&[&str], &str); 7] = [
        (&["--prompt", ""], "the prompt is empty"),
        (
            &["--prompt", "1+1=", "--tokens", "0"],
            "--tokens 0 asks for no new token: pass 1 to 9",
        ),
        (
            &["--prompt", "47x85="],
            "holds 'x', which the addition model's vocabulary lacks",
        ),
        (
            &["--prompt", "47+85=", "--tokens", "5"],
            "room for at most 4 new tokens",
        ),
        (
            &["--prompt", "1234567890", "--tokens", "1"],
            "the prompt is 10 tokens, longer than the model's context of 9",
        ),
        (
            &["--prompt", "1+1=", "--temperature", "-1"],
            "temperature -1",
        ),
        (
            &["--prompt", "1+1=", "--top-p", "2"],
            "top-p 2: it must be in (0, 1]",
        ),
    ];
    for (args, want) in cases {
        let o = sample(run, args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        assert!(stderr(&o).contains(want), "{args:?}: {}", stderr(&o));
        assert!(o.stdout.is_empty(), "{args:?}");
    }
    let o = kiln(&["sample", "/nonexistent/run", "--prompt", "1+1="]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("/nonexistent/run: does not exist") && e.contains("pass a run directory"),
        "{e}"
    );
    let o = kiln(&[
        "sample",
        run.parent().unwrap().to_str().unwrap(),
        "--prompt",
        "1",
    ]);
    assert!(stderr(&o).contains("holds neither a run"), "{}", stderr(&o));
}

/// The cached decoder `kiln sample` uses against the reference that recomputes the
/// whole sequence per token, on the demo checkpoint (f16 weights and activations):
/// the same greedy tokens over the whole context, and logits within f16 rounding.
#[test]
fn cached_decoding_matches_full_recomputation_on_the_demo_checkpoint() {
    use kiln::sample::{Cached, Decoder, Recompute, Source};
    let (run, _) = demo_run::run("sample");
    let dev = kiln::cpu::CpuDevice::new();
    let source = Source::open(run, None).unwrap();
    let mut cached = Cached(source.generator(&dev).unwrap());
    let mut reference = Recompute::new(source.network(&dev, 1, false).unwrap()).unwrap();
    for prompt in ["47+85=", "0", "99+99=19"] {
        let ids = kiln::engine::data::Addition::encode(prompt).unwrap();
        let mut a = cached.prefill(&dev, &ids).unwrap();
        let mut b = reference.prefill(&dev, &ids).unwrap();
        for pos in ids.len()..=demo_run::T {
            let worst = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            let scale = b.iter().fold(1.0f32, |m, x| m.max(x.abs()));
            assert!(
                worst <= 2e-2 * scale,
                "{prompt:?} at {pos}: {worst} ({a:?} vs {b:?})"
            );
            let (ta, tb) = (argmax(&a), argmax(&b));
            assert_eq!(ta, tb, "{prompt:?} at {pos}");
            if pos == demo_run::T {
                break;
            }
            a = cached.step(&dev, ta).unwrap();
            b = reference.step(&dev, tb).unwrap();
        }
    }
}

#[test]
fn streamed_text_waits_for_whole_characters() {
    use kiln::engine::data::Tokenizer;
    use kiln::sample::{TextCodec, TextStream};
    let text = "naïve 日本語 — ok";
    for tok in [Tokenizer::Bytes, Tokenizer::Gpt2] {
        let codec = TextCodec::Tokens(tok.clone());
        let ids = codec.encode(text).unwrap();
        let mut s = TextStream::new(codec);
        let pieces: Vec<String> = ids.iter().map(|&id| s.push(id).unwrap()).collect();
        assert_eq!(pieces.concat() + &s.finish(), text, "{tok:?}");
        // Never half a character: every piece is whole text on its own.
        if tok == Tokenizer::Bytes {
            assert!(pieces.iter().any(|p| p.is_empty()), "{pieces:?}");
        }
    }
    // A byte that can never start a character is shown as U+FFFD, and the stream goes on.
    let mut s = TextStream::new(TextCodec::Tokens(Tokenizer::Bytes));
    assert_eq!(s.push(0xFF).unwrap(), "\u{FFFD}");
    assert_eq!(s.push(b'a' as u32).unwrap(), "a");
    // An incomplete character at the end.
    assert_eq!(s.push(0xE6).unwrap(), "");
    assert_eq!(s.finish(), "\u{FFFD}");
}

#[test]
fn kiln_sample_decodes_a_byte_run_and_refuses_a_mismatched_length() {
    let (run, _) = demo_run::text_run("sample");
    let o = sample(
        run,
        &["--prompt", "the ", "--temperature", "0", "--tokens", "5"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(out.starts_with("the "), "{out:?}");
    // "日" is 3 bytes, so 4 of them are 12 tokens: more than the context of 9.
    let o = sample(run, &["--prompt", "日本語日", "--tokens", "1"]);
    assert!(
        stderr(&o).contains("the prompt is 12 tokens, longer than the model's context of 9"),
        "{}",
        stderr(&o)
    );
}

/// The byte run's weights exported as a Hugging Face directory and an llm.c `.bin`:
/// both import as SOURCE, and greedy text in the run's dtype equals the run's own.
#[test]
fn kiln_sample_and_eval_take_imported_hugging_face_and_llm_c_files() {
    use kiln::engine::models::{gpt::GptConfig, import};
    let (run, _) = demo_run::text_run("sample");
    let dir = run.parent().unwrap();
    let ck = kiln::engine::train::checkpoint::load_latest(run).unwrap();
    let weights = &ck.file("model.safetensors").unwrap().tensors;
    let cfg = GptConfig {
        vocab_size: 256,
        ..demo_run::model_config()
    };
    let hf = dir.join("hf");
    import::write_hf(&hf, &cfg, weights).unwrap();
    let llmc = dir.join("model.bin");
    import::write_llmc(&llmc, &cfg, weights, kiln::engine::DType::BF16).unwrap();
    let args = ["--prompt", "the ", "--temperature", "0", "--tokens", "5"];
    let own = sample(run, &args);
    assert!(own.status.success(), "{}", stderr(&own));
    for src in [&hf, &llmc] {
        let mut with_dtype = args.to_vec();
        with_dtype.extend(["--dtype", "bf16"]);
        let o = sample(src, &with_dtype);
        assert!(o.status.success(), "{}: {}", src.display(), stderr(&o));
        assert_eq!(o.stdout, own.stdout, "{}", src.display());
    }
    // An imported model has no run data: kiln eval needs --data.
    let o = kiln(&["eval", hf.to_str().unwrap(), "--devices", "cpu"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("pass --data FILE"), "{}", stderr(&o));
    let text = dir.join("text.txt");
    let o = kiln(&[
        "eval",
        hf.to_str().unwrap(),
        "--devices",
        "cpu",
        "--dtype",
        "bf16",
        "--micro-batch",
        "4",
        "--data",
        text.to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let r = kiln::eval::eval(&kiln::eval::EvalOptions {
        source: run.clone(),
        data: Some(text),
        devices: vec!["cpu".into()],
        ..Default::default()
    })
    .unwrap();
    assert_eq!(j["loss"].as_f64().unwrap() as f32, r.loss);
    assert!(j["step"].is_null());
}

/// A model whose vocabulary no Kiln tokenizer has (250: the byte run's weights with the
/// last 6 embedding rows cut) scores a token file, which needs no tokenizer; only
/// sampling, which does, is refused, saying what works instead. With the head tied to
/// the embedding, its logits are the first 250 of the 256-token model's, so on ids below
/// 250 its loss is below that model's by the log of the cut rows' share of the softmax:
/// strictly lower, never higher.
#[test]
fn kiln_eval_scores_token_ids_of_a_vocabulary_no_tokenizer_has() {
    use kiln::engine::models::{gpt::GptConfig, import};
    let (run, _) = demo_run::text_run("sample");
    let dir = run.parent().unwrap().join("vocab250");
    std::fs::create_dir_all(&dir).unwrap();
    let ck = kiln::engine::train::checkpoint::load_latest(run).unwrap();
    let mut weights = ck.file("model.safetensors").unwrap().tensors.clone();
    let wte = weights
        .iter_mut()
        .find(|t| t.name == "transformer.wte.weight")
        .unwrap();
    let c = wte.shape[1];
    let cut: Vec<f32> = wte.data.to_f32()[..250 * c].to_vec();
    wte.shape = vec![250, c];
    wte.data = kiln::engine::HostData::from_f32(wte.data.dtype(), &cut);
    let cfg = GptConfig {
        vocab_size: 250,
        ..demo_run::model_config()
    };
    let model = dir.join("model250.bin");
    import::write_llmc(&model, &cfg, &weights, kiln::engine::DType::F32).unwrap();
    // The run's text as raw u16 ids (every byte below 250), no sidecar: a file another
    // tool wrote.
    let text = std::fs::read(run.parent().unwrap().join("text.txt")).unwrap();
    assert!(text.iter().all(|&b| b < 250));
    let ids: Vec<u8> = text
        .iter()
        .flat_map(|&b| (b as u16).to_le_bytes())
        .collect();
    let tokens = dir.join("ids.bin");
    std::fs::write(&tokens, ids).unwrap();
    let eval = |source: &std::path::Path| {
        let o = kiln(&[
            "eval",
            source.to_str().unwrap(),
            "--devices",
            "cpu",
            "--dtype",
            "f32",
            "--micro-batch",
            "4",
            "--data",
            tokens.to_str().unwrap(),
            "--json",
        ]);
        assert!(o.status.success(), "{}: {}", source.display(), stderr(&o));
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        j["loss"].as_f64().unwrap()
    };
    let (cut_loss, full_loss) = (eval(&model), eval(run));
    eprintln!("loss with vocabulary 250: {cut_loss}, 256: {full_loss}");
    assert!(
        cut_loss.is_finite() && cut_loss > 0.0 && cut_loss < full_loss,
        "vocabulary 250: {cut_loss}, 256: {full_loss}"
    );
    let o = sample(&model, &["--prompt", "the "]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("a vocabulary of 250 is neither") && e.contains("--data FILE.bin"),
        "{e}"
    );
    assert!(o.stdout.is_empty());
}

/// A padded vocabulary end to end: the byte run's weights with 64 padding rows (as
/// llm.c pads GPT-2's 50257 to 50304), each three times a real row (ids 64-127, the
/// letters among them), so that as candidates they would outscore the letters they copy.
/// Greedy and sampled text equal the unpadded model's: the padding is never drawn.
#[test]
fn padding_rows_of_an_imported_vocabulary_are_never_sampled() {
    use kiln::engine::models::{gpt::GptConfig, import};
    use kiln::engine::HostData;
    let (run, _) = demo_run::text_run("sample");
    let dir = run.parent().unwrap();
    let ck = kiln::engine::train::checkpoint::load_latest(run).unwrap();
    let mut weights = ck.file("model.safetensors").unwrap().tensors.clone();
    let plain = GptConfig {
        vocab_size: 256,
        ..demo_run::model_config()
    };
    let padded = GptConfig {
        padded_vocab_size: Some(320),
        ..plain.clone()
    };
    let plain_bin = dir.join("plain.bin");
    import::write_llmc(&plain_bin, &plain, &weights, kiln::engine::DType::BF16).unwrap();
    let wte = weights
        .iter_mut()
        .find(|t| t.name == "transformer.wte.weight")
        .unwrap();
    let mut values = wte.data.to_f32();
    let copies: Vec<f32> = values[64 * 16..128 * 16].iter().map(|x| 3.0 * x).collect();
    values.extend(copies);
    wte.data = HostData::from_f32(kiln::engine::DType::BF16, &values);
    wte.shape = vec![320, 16];
    let padded_bin = dir.join("padded.bin");
    import::write_llmc(&padded_bin, &padded, &weights, kiln::engine::DType::BF16).unwrap();
    for args in [
        &["--prompt", "the ", "--temperature", "0", "--tokens", "5"][..],
        &["--prompt", "fox", "--temperature", "1", "--seed", "4"][..],
    ] {
        let mut with_dtype = args.to_vec();
        with_dtype.extend(["--dtype", "bf16"]);
        let want = sample(&plain_bin, &with_dtype);
        assert!(want.status.success(), "{}", stderr(&want));
        let got = sample(&padded_bin, &with_dtype);
        assert!(got.status.success(), "{}", stderr(&got));
        assert_eq!(got.stdout, want.stdout, "{args:?}");
    }
}

/// A Llama run samples through its own cached decoder (RoPE at each token's position,
/// grouped-query heads over the cache) and answers as Network::predict's argmax does.
#[test]
fn kiln_sample_decodes_a_llama_run_as_network_predict_does() {
    use kiln::engine::models::llama::{Llama, LlamaConfig};
    use kiln::train::{train, TrainOptions};

    const T: usize = demo_run::T;
    let sizes = format!(
        r#""n_layer": 1, "n_head": 4, "n_kv_head": 2, "n_embd": 16, "block_size": {T}, "vocab_size": 13"#
    );
    let model_json = format!(r#"{{"architecture": "llama", {sizes}}}"#);
    let dir = std::env::temp_dir().join(format!("kiln-sample-llama-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("model.json");
    std::fs::write(&model, &model_json).unwrap();
    let config = dir.join("ds_config.json");
    std::fs::write(
        &config,
        r#"{"train_micro_batch_size_per_gpu": 32, "fp16": {"enabled": true, "initial_scale_power": 12},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}"#,
    )
    .unwrap();
    let run = dir.join("run");
    train(&TrainOptions {
        config: Some(config),
        model: Some(model),
        devices: vec!["cpu".into()],
        out: Some(run.clone()),
        steps: Some(6),
        eval_every: Some(0),
        checkpoint_every: Some(0),
        progress: false,
        ..TrainOptions::default()
    })
    .unwrap();
    let out = sample(
        &run,
        &["--prompt", "47+85=", "--temperature", "0", "--tokens", "4"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    // The reference: the checkpoint in the training graph, greedy by recomputation.
    let cfg: LlamaConfig = serde_json::from_str(&format!("{{{sizes}}}")).unwrap();
    let dev = kiln::cpu::CpuDevice::new();
    let net = demo_run::network_of(&run, &dev, std::sync::Arc::new(Llama::new(cfg, T)));
    let mut want = format!("47+85={}", demo_run::greedy(&net, &dev, "47+85=", 4));
    if !want.ends_with('\n') {
        want.push('\n');
    }
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(String::from_utf8_lossy(&out.stdout), want);
}
