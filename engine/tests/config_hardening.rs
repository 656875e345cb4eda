//! DeepSpeed config reading under bad input: integer ranges the engine can hold, configs
//! with huge numbers of unknown keys, DeepSpeed's full key set, Hugging Face's "auto",
//! DeepSpeed's defaults, a byte-order mark, and errors that name the bad array element.

use std::time::{Duration, Instant};

use kiln_engine::config::{load, parse, ConfigError, Optimizer, Precision, Problem, TrainConfig};

fn ok(text: &str, world: usize) -> TrainConfig {
    parse(text, world).unwrap_or_else(|e| panic!("expected a valid config, got: {e}"))
}

fn err(text: &str, world: usize) -> ConfigError {
    match parse(text, world) {
        Ok(c) => panic!("expected an error, got {c:?}"),
        Err(e) => e,
    }
}

fn problem<'a>(e: &'a ConfigError, path: &str) -> &'a Problem {
    e.problems
        .iter()
        .find(|p| p.path == path)
        .unwrap_or_else(|| panic!("no problem reported at `{path}`; got: {e}"))
}

// ------------------------------------------------------------------------------------
// Integer ranges: what the engine can hold
// ------------------------------------------------------------------------------------

#[test]
fn a_micro_batch_of_u64_max_is_out_of_range() {
    // At world 1 the product fits a u64, so nothing but the range check catches it.
    let e = err(
        r#"{"train_micro_batch_size_per_gpu": 18446744073709551615}"#,
        1,
    );
    let p = problem(&e, "train_micro_batch_size_per_gpu");
    assert!(
        p.message.contains("an integer from 1 to 4294967295"),
        "{}",
        p.message
    );
    assert!(p.message.contains("18446744073709551615"), "{}", p.message);
    assert_eq!(e.problems.len(), 1, "{e}");
    for key in ["train_batch_size", "gradient_accumulation_steps"] {
        let e = err(
            &format!(r#"{{"train_micro_batch_size_per_gpu": 1, "{key}": 4294967296}}"#),
            1,
        );
        assert!(
            problem(&e, key).message.contains("from 1 to 4294967295"),
            "{e}"
        );
    }
}

#[test]
fn the_product_of_batch_factors_is_checked() {
    // Each factor is in range, the product is not.
    let e = err(
        r#"{"train_micro_batch_size_per_gpu": 65536, "gradient_accumulation_steps": 65536}"#,
        2,
    );
    let p = problem(&e, "train_batch_size");
    assert!(
        p.message
            .contains("gradient_accumulation_steps 65536 × world size 2 = 8589934592"),
        "{}",
        p.message
    );
    assert!(p.message.contains("4294967295"), "{}", p.message);
    assert!(p.fix.contains("smaller"), "{}", p.fix);
}

#[test]
fn steps_times_the_batch_must_fit_the_sample_counter() {
    let e = err(
        r#"{"train_micro_batch_size_per_gpu": 8, "kiln": {"steps": 18446744073709551615}}"#,
        1,
    );
    let p = problem(&e, "kiln.steps");
    assert!(p.message.contains("64-bit"), "{}", p.message);
    // u64::MAX / 8
    assert!(p.fix.contains("2305843009213693951"), "{}", p.fix);
    // The same for the scheduler's run length, which sets the step count when kiln.steps
    // is absent.
    let e = err(
        r#"{"train_micro_batch_size_per_gpu": 8, "scheduler": {"type": "WarmupDecayLR",
            "params": {"total_num_steps": 18446744073709551615}}}"#,
        1,
    );
    problem(&e, "scheduler.params.total_num_steps");
}

#[test]
fn the_loss_scale_window_fits_the_scaler() {
    let e = err(
        r#"{"train_batch_size": 8, "fp16": {"enabled": true,
            "loss_scale_window": 9223372036854775808}}"#,
        1,
    );
    assert!(
        problem(&e, "fp16.loss_scale_window")
            .message
            .contains("from 1 to 9223372036854775807"),
        "{e}"
    );
}

// ------------------------------------------------------------------------------------
// Bounded work for huge numbers of unknown keys
// ------------------------------------------------------------------------------------

#[test]
fn two_hundred_thousand_unknown_keys_are_reported_quickly_and_briefly() {
    let n = 200_000;
    let mut text = String::from(r#"{"train_batch_size": 8"#);
    for i in 0..n {
        text.push_str(&format!(r#", "trian_batch_size_{i}": 1"#));
    }
    // One key of a megabyte: no suggestion search over it, and no megabyte in the message.
    text.push_str(&format!(r#", "{}": 1}}"#, "x".repeat(1 << 20)));
    let started = Instant::now();
    let e = err(&text, 1);
    let shown = e.to_string();
    let took = started.elapsed();
    // Listing 200k problems with a suggestion each took minutes at a million keys.
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert_eq!(e.problems.len(), 50, "the list is capped");
    assert!(
        shown.starts_with(&format!("training config: {} problems", n + 1)),
        "{}",
        &shown[..200]
    );
    assert!(
        shown.ends_with(&format!("… and {} more problems not listed", n + 1 - 50)),
        "{}",
        &shown[shown.len() - 300..]
    );
    assert!(shown.len() < 50 * 400, "{} bytes", shown.len());
    // The first ones still get their suggestion.
    assert_eq!(
        problem(&e, "trian_batch_size_0").fix,
        "did you mean \"train_batch_size\"?"
    );
}

#[test]
fn a_long_unknown_key_is_shortened_in_the_message() {
    let long = "y".repeat(100_000);
    let e = err(&format!(r#"{{"train_batch_size": 8, "{long}": 1}}"#), 1);
    let p = &e.problems[0];
    assert!(p.message.len() < 300, "{}", p.message.len());
    assert!(p.path.len() < 300, "{}", p.path.len());
    assert!(p.message.contains("100000 characters"), "{}", p.message);
}

// ------------------------------------------------------------------------------------
// DeepSpeed's documented keys
// ------------------------------------------------------------------------------------

#[test]
fn real_deepspeed_keys_are_known() {
    let c = ok(
        r#"{
        "train_batch_size": 8,
        "disable_allgather": false,
        "checkpoint": {"tag_validation": "Warn", "load_universal": false},
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1},
        "data_types": {"grad_accum_dtype": null},
        "timers": {"throughput": {"enabled": true, "synchronized": true}},
        "nebula": {"enabled": false},
        "dataloader_drop_last": false,
        "graph_harvesting": false,
        "zero_force_ds_cpu_optimizer": true,
        "cuda_visible_devices": "0,1",
        "vocabulary_size": 50257,
        "comet": {"enabled": false},
        "hybrid_engine": {"enabled": false},
        "torch_autocast": {"enabled": false},
        "prescale_gradients": false
    }"#,
        1,
    );
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    let text = c.explain();
    for key in [
        "disable_allgather",
        "checkpoint",
        "aio",
        "data_types",
        "timers",
        "nebula",
        "dataloader_drop_last",
        "graph_harvesting",
        "zero_force_ds_cpu_optimizer",
        "cuda_visible_devices",
        "vocabulary_size",
        "comet",
        "hybrid_engine",
        "torch_autocast",
        "prescale_gradients",
    ] {
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("note: {key} "))),
            "no note for {key} in:\n{text}"
        );
    }
}

#[test]
fn deepspeed_keys_asking_for_what_kiln_lacks_are_not_implemented() {
    let e = err(
        r#"{
        "train_batch_size": 8,
        "hybrid_engine": {"enabled": true},
        "data_types": {"grad_accum_dtype": "fp32"},
        "torch_autocast": {"enabled": true},
        "tensor_parallel": {"autotp_size": 2},
        "fp16": {"enabled": true, "fp16_master_weights_and_grads": true}
    }"#,
        1,
    );
    for path in [
        "hybrid_engine",
        "data_types",
        "torch_autocast",
        "tensor_parallel",
        "fp16.fp16_master_weights_and_grads",
    ] {
        let p = problem(&e, path);
        assert!(p.message.contains("not supported by Kiln"), "{}", p.message);
    }
    assert_eq!(e.problems.len(), 5, "{e}");
    // Keys that change nothing about the numbers, switched on: warnings, not errors.
    let c = ok(
        r#"{"train_batch_size": 8, "disable_allgather": true, "graph_harvesting": true,
            "nebula": {"enabled": true}}"#,
        1,
    );
    assert_eq!(c.warnings.len(), 3, "{:?}", c.warnings);
    assert!(c
        .warnings
        .iter()
        .all(|w| w.starts_with("ignored by Kiln: ")));
}

#[test]
fn nested_deepspeed_keys_are_known() {
    let c = ok(
        r#"{"train_batch_size": 8,
        "optimizer": {"type": "AdamW", "legacy_fusion": false, "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "use_multi_rank_bucket_allreduce": true,
            "cpu_offload_use_pin_memory": false, "memory_efficient_linear": true,
            "mics_hierarchical_params_gather": false, "prefetch_bucket_size": 5e7}}"#,
        1,
    );
    let text = c.explain();
    for key in [
        "optimizer.legacy_fusion",
        "zero_optimization.use_multi_rank_bucket_allreduce",
        "zero_optimization.cpu_offload_use_pin_memory",
        "zero_optimization.memory_efficient_linear",
        "zero_optimization.mics_hierarchical_params_gather",
    ] {
        assert!(
            text.contains(&format!("note: {key} ")),
            "no note for {key}:\n{text}"
        );
    }
    let e = err(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW",
            "params": {"lr": 1e-3, "max_grad_norm": 1.0}}}"#,
        1,
    );
    assert!(problem(&e, "optimizer.params.max_grad_norm")
        .fix
        .contains("gradient_clipping"));
}

// ------------------------------------------------------------------------------------
// Hugging Face's "auto"
// ------------------------------------------------------------------------------------

/// The shape of the Hugging Face Trainer's ZeRO-2 template.
const HF_TEMPLATE: &str = r#"{
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                             "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "allgather_partitions": true, "allgather_bucket_size": 2e8,
                          "overlap_comm": true, "reduce_scatter": true,
                          "reduce_bucket_size": "auto", "contiguous_gradients": true},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}"#;

#[test]
fn auto_values_kiln_cannot_know_are_one_problem_naming_their_sources() {
    let e = err(HF_TEMPLATE, 2);
    assert_eq!(e.problems.len(), 1, "{e}");
    let p = &e.problems[0];
    for (key, source) in [
        (
            "train_micro_batch_size_per_gpu",
            "--per_device_train_batch_size",
        ),
        ("fp16.enabled", "--fp16"),
        ("bf16.enabled", "--bf16"),
        ("optimizer.params.lr", "--learning_rate"),
        ("scheduler.params.warmup_num_steps", "--warmup_steps"),
        ("scheduler.params.total_num_steps", "kiln.steps"),
    ] {
        assert!(p.path.contains(key), "{key} not in {}", p.path);
        assert!(p.fix.contains(source), "{source} not in {}", p.fix);
    }
    // Values that follow from others are not asked for.
    let asked: Vec<&str> = p.path.split(", ").collect();
    for key in [
        "train_batch_size",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "optimizer.params.betas",
        "optimizer.params.eps",
        "optimizer.params.weight_decay",
        "scheduler.params.warmup_max_lr",
        "scheduler.params.warmup_min_lr",
        "zero_optimization.reduce_bucket_size",
    ] {
        assert!(
            !asked.iter().any(|a| a.ends_with(key)),
            "{key} in {}",
            p.path
        );
    }
    assert!(p.message.contains("Hugging Face"), "{}", p.message);
}

#[test]
fn auto_values_are_resolved_as_the_hugging_face_integration_does() {
    let text = HF_TEMPLATE
        .replace(
            r#""train_micro_batch_size_per_gpu": "auto""#,
            r#""train_micro_batch_size_per_gpu": 4"#,
        )
        .replace(
            r#""fp16": {"enabled": "auto""#,
            r#""fp16": {"enabled": true"#,
        )
        .replace(
            r#""bf16": {"enabled": "auto"}"#,
            r#""bf16": {"enabled": false}"#,
        )
        .replace(r#""lr": "auto""#, r#""lr": 3e-4"#)
        .replace(r#""warmup_num_steps": "auto""#, r#""warmup_num_steps": 10"#)
        .replace(
            r#""wall_clock_breakdown": false"#,
            r#""wall_clock_breakdown": false, "kiln": {"steps": 500}"#,
        );
    let c = ok(&text, 2);
    assert_eq!(
        (
            c.batch.train_batch_size,
            c.batch.micro_batch,
            c.batch.grad_accum
        ),
        (8, 4, 1)
    );
    assert!(matches!(c.precision, Precision::Fp16 { .. }));
    assert_eq!(c.gradient_clipping, 1.0);
    assert_eq!(
        c.optimizer,
        Optimizer::Adam {
            lr: 3e-4,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: true
        }
    );
    assert_eq!(
        c.schedule,
        kiln_engine::config::Schedule::WarmupDecayLr {
            min_lr: 0.0,
            max_lr: 3e-4,
            warmup_steps: 10,
            total_steps: 500,
            warmup_type: kiln_engine::config::WarmupType::Log
        }
    );
    assert_eq!(c.zero.reduce_bucket_size, 500_000_000);
    let explain = c.explain();
    for line in [
        "gradient_accumulation_steps = 1 (inferred: \"auto\":",
        "train_batch_size = 8 (inferred: \"auto\":",
        "gradient_clipping = 1.0 (inferred: \"auto\":",
        "scheduler.params.warmup_max_lr = 0.0003 (inferred: \"auto\": optimizer.params.lr",
        "scheduler.params.total_num_steps = 500 (inferred: \"auto\": kiln.steps",
    ] {
        assert!(explain.contains(line), "missing `{line}` in:\n{explain}");
    }
    // The guesses made from Hugging Face's defaults are said once, where users look.
    let guessed: Vec<_> = c
        .warnings
        .iter()
        .filter(|w| w.contains("\"auto\""))
        .collect();
    assert_eq!(guessed.len(), 1, "{:?}", c.warnings);
    assert!(guessed[0].contains("gradient_clipping 1"), "{}", guessed[0]);
}

// ------------------------------------------------------------------------------------
// DeepSpeed's defaults
// ------------------------------------------------------------------------------------

#[test]
fn adamw_weight_decay_defaults_to_deepspeeds_zero() {
    let c = ok(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW"}}"#,
        1,
    );
    let Optimizer::Adam { weight_decay, .. } = c.optimizer else {
        panic!("{:?}", c.optimizer)
    };
    assert_eq!(weight_decay, 0.0);
    let text = c.explain();
    assert!(
        text.contains("optimizer.params.weight_decay = 0.0 (default)"),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("note: optimizer.params.weight_decay")
                && l.contains("DeepSpeed")
                && l.contains("0.01")),
        "{text}"
    );
    // The demo still decays its weights: it sets weight_decay itself.
    let demo = ok(include_str!("../../demos/addition.ds_config.json"), 1);
    let Optimizer::Adam { weight_decay, .. } = demo.optimizer else {
        panic!("{:?}", demo.optimizer)
    };
    assert_eq!(weight_decay, 0.01);
}

// ------------------------------------------------------------------------------------
// Byte-order mark, array elements
// ------------------------------------------------------------------------------------

#[test]
fn a_utf8_byte_order_mark_is_accepted() {
    let c = ok("\u{feff}{\"train_batch_size\": 8}", 1);
    assert_eq!(c.batch.train_batch_size, 8);
    let dir = std::env::temp_dir().join(format!("kiln-config-bom-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ds.json");
    let mut bytes = vec![0xEF, 0xBB, 0xBF];
    bytes.extend_from_slice(br#"{"train_micro_batch_size_per_gpu": 2}"#);
    std::fs::write(&path, bytes).unwrap();
    assert_eq!(load(&path, 2).unwrap().batch.train_batch_size, 4);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_bad_beta_is_named_with_its_range() {
    let e = err(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW",
            "params": {"betas": [1.5, 0.999]}}}"#,
        1,
    );
    let p = problem(&e, "optimizer.params.betas");
    assert!(p.message.contains("betas[0]"), "{}", p.message);
    assert!(p.message.contains("1.5"), "{}", p.message);
    assert!(p.message.contains("[0, 1)"), "{}", p.message);
    assert!(!p.message.contains("array of 2"), "{}", p.message);

    let e = err(
        r#"{"train_batch_size": 8, "optimizer": {"type": "Adam",
            "params": {"betas": [0.9, "0.999"]}}}"#,
        1,
    );
    let p = problem(&e, "optimizer.params.betas");
    assert!(p.message.contains("betas[1]"), "{}", p.message);
    assert!(p.message.contains("the string \"0.999\""), "{}", p.message);

    let e = err(
        r#"{"train_batch_size": 8, "optimizer": {"type": "Adam",
            "params": {"betas": [0.9, 0.99, 0.999]}}}"#,
        1,
    );
    let p = problem(&e, "optimizer.params.betas");
    assert!(p.message.contains("3 elements"), "{}", p.message);
}

#[test]
fn floats_are_checked_as_the_f32_they_become() {
    // eps 1e-50 is > 0 but stored as 0.0: Adam would divide by zero.
    let e = err(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW",
            "params": {"eps": 1e-50, "betas": [0.9, 0.99999999999]}}}"#,
        1,
    );
    let p = problem(&e, "optimizer.params.eps");
    assert!(p.message.contains("becomes 0e0"), "{}", p.message);
    assert!(p.message.contains("> 0"), "{}", p.message);
    let p = problem(&e, "optimizer.params.betas");
    assert!(p.message.contains("betas[1]"), "{}", p.message);
    assert!(p.message.contains("becomes 1"), "{}", p.message);
    // Too big for an f32: the message says so rather than "expected a number >= 0".
    let e = err(r#"{"train_batch_size": 8, "gradient_clipping": 1e39}"#, 1);
    let p = problem(&e, "gradient_clipping");
    assert!(p.message.contains("largest 32-bit float"), "{}", p.message);
}

#[test]
fn a_bad_device_name_is_named() {
    let e = err(
        r#"{"train_batch_size": 8, "kiln": {"devices": ["vulkan:0", 3]}}"#,
        1,
    );
    let p = problem(&e, "kiln.devices");
    assert!(p.message.contains("devices[1]"), "{}", p.message);
    assert!(p.message.contains("the number 3"), "{}", p.message);
}
