//! DeepSpeed config reading: batch inference, strict key checking, schedules, provenance.

use kiln_engine::config::{
    load, parse, BatchConfig, ConfigError, KilnSettings, LossScaling, Optimizer, Precision,
    Problem, Provenance, Schedule, TrainConfig, WarmupType,
};
use kiln_engine::DynamicScaling;

const WORLD: usize = 2;

fn ok(text: &str) -> TrainConfig {
    parse(text, WORLD).unwrap_or_else(|e| panic!("expected a valid config, got: {e}"))
}

fn err(text: &str) -> ConfigError {
    match parse(text, WORLD) {
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

fn assert_lr(got: f32, want: f64) {
    let tol = 2e-6 * want.abs() + 1e-12;
    assert!(
        (got as f64 - want).abs() <= tol,
        "lr {got} differs from the expected {want}"
    );
}

/// A config holding only the given batch keys (and nothing else).
fn batch_json(b: Option<u64>, m: Option<u64>, g: Option<u64>) -> String {
    let mut keys = Vec::new();
    if let Some(b) = b {
        keys.push(format!("\"train_batch_size\": {b}"));
    }
    if let Some(m) = m {
        keys.push(format!("\"train_micro_batch_size_per_gpu\": {m}"));
    }
    if let Some(g) = g {
        keys.push(format!("\"gradient_accumulation_steps\": {g}"));
    }
    format!("{{{}}}", keys.join(", "))
}

fn batch(b: Option<u64>, m: Option<u64>, g: Option<u64>) -> Result<BatchConfig, ConfigError> {
    parse(&batch_json(b, m, g), WORLD).map(|c| c.batch)
}

fn geometry(train_batch_size: usize, micro_batch: usize, grad_accum: usize) -> BatchConfig {
    BatchConfig {
        train_batch_size,
        micro_batch,
        grad_accum,
        world: WORLD,
    }
}

// ------------------------------------------------------------------------------------
// Batch sizes (DeepSpeed's TestBatchConfig cases, world 2)
// ------------------------------------------------------------------------------------

#[test]
fn all_three_consistent_pass() {
    assert_eq!(
        batch(Some(32), Some(16), Some(1)).unwrap(),
        geometry(32, 16, 1)
    );
    assert_eq!(
        batch(Some(32), Some(8), Some(2)).unwrap(),
        geometry(32, 8, 2)
    );
}

#[test]
fn all_three_inconsistent_show_the_arithmetic() {
    let e = batch(Some(33), Some(17), Some(2)).unwrap_err();
    let p = problem(&e, "train_batch_size");
    assert!(
        p.message.contains(
            "train_batch_size 33 != train_micro_batch_size_per_gpu 17 × \
             gradient_accumulation_steps 2 × world size 2 = 68"
        ),
        "{}",
        p.message
    );
    assert!(p.fix.contains("set train_batch_size to 68"), "{}", p.fix);

    let e = batch(Some(32), Some(18), Some(1)).unwrap_err();
    let p = problem(&e, "train_batch_size");
    assert!(p.message.contains("× world size 2 = 36"), "{}", p.message);
    // 32 = 16 × 1 × 2, so changing the micro-batch is offered too.
    assert!(p.fix.contains("set train_batch_size to 36"), "{}", p.fix);
    assert!(
        p.fix.contains("set train_micro_batch_size_per_gpu to 16"),
        "{}",
        p.fix
    );
}

#[test]
fn two_of_three_infer_the_third() {
    // batch + micro: gas = 32 / 8 / 2 = 2.
    let c = ok(&batch_json(Some(32), Some(8), None));
    assert_eq!(c.batch, geometry(32, 8, 2));
    assert!(matches!(
        c.provenance["gradient_accumulation_steps"],
        Provenance::Inferred(_)
    ));
    assert_eq!(c.provenance["train_batch_size"], Provenance::File);
    // batch + gas: micro = 32 / 2 / 2 = 8.
    let c = ok(&batch_json(Some(32), None, Some(2)));
    assert_eq!(c.batch, geometry(32, 8, 2));
    assert!(matches!(
        c.provenance["train_micro_batch_size_per_gpu"],
        Provenance::Inferred(_)
    ));
    // micro + gas: batch = 8 × 2 × 2 = 32.
    let c = ok(&batch_json(None, Some(8), Some(2)));
    assert_eq!(c.batch, geometry(32, 8, 2));
    assert!(matches!(
        c.provenance["train_batch_size"],
        Provenance::Inferred(_)
    ));
}

#[test]
fn one_of_three() {
    // Only batch: gas 1, micro = 32 / 2 = 16.
    assert_eq!(batch(Some(32), None, None).unwrap(), geometry(32, 16, 1));
    // Only micro: gas 1, batch = 8 × 2 = 16.
    assert_eq!(batch(None, Some(8), None).unwrap(), geometry(16, 8, 1));
    // Only gas, or nothing: the batch size is unknown.
    for e in [
        batch(None, None, Some(4)).unwrap_err(),
        batch(None, None, None).unwrap_err(),
    ] {
        let p = problem(&e, "train_batch_size");
        assert!(p.message.contains("neither"), "{}", p.message);
        assert!(
            p.fix.contains("train_micro_batch_size_per_gpu"),
            "{}",
            p.fix
        );
    }
}

#[test]
fn inference_that_would_drop_samples_is_rejected() {
    // 33 / (8 × 2) = 2 rounded down: 1 sample of 33 lost per step.
    let e = batch(Some(33), Some(8), None).unwrap_err();
    let p = problem(&e, "train_batch_size");
    assert!(p.message.contains("not a multiple of"), "{}", p.message);
    assert!(p.message.contains("dropping 1 sample"), "{}", p.message);
    assert!(p.fix.contains("32 or 48"), "{}", p.fix);
    // 33 / (2 × 2) for the micro-batch.
    let e = batch(Some(33), None, Some(2)).unwrap_err();
    assert!(problem(&e, "train_batch_size").message.contains("= 4"));
    // 33 / 2 with only the batch given.
    assert!(batch(Some(33), None, None).is_err());
    // 8 / (8 × 2) = 0.
    let e = batch(Some(8), Some(8), None).unwrap_err();
    let p = problem(&e, "train_batch_size");
    assert!(
        p.message.contains("gradient_accumulation_steps would be 0"),
        "{}",
        p.message
    );
    assert!(p.fix.contains("such as 16"), "{}", p.fix);
}

#[test]
fn zero_world_is_an_error() {
    let e = parse(&batch_json(None, Some(8), None), 0).unwrap_err();
    problem(&e, "world_size");
}

// ------------------------------------------------------------------------------------
// Unknown keys, types, "auto"
// ------------------------------------------------------------------------------------

#[test]
fn top_level_typo_gets_a_suggestion() {
    // The typo from DeepSpeed's own test suite, which DeepSpeed silently ignores.
    let e = err(r#"{"train_batch_size": 32, "grandient_accumulation_steps": 2}"#);
    let p = problem(&e, "grandient_accumulation_steps");
    assert!(p.message.contains("unknown key"), "{}", p.message);
    assert_eq!(p.fix, "did you mean \"gradient_accumulation_steps\"?");
}

#[test]
fn nested_typos_are_all_reported_at_once() {
    let e = err(r#"{
        "train_micro_batch_size_per_gpu": 8,
        "fp16": {"enabled": true, "loss_scale_windw": 500},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decy": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}},
        "zero_optimization": {"stage": 2, "reduce_bucket_sise": 5e8}
    }"#);
    let cases = [
        ("fp16.loss_scale_windw", "loss_scale_window"),
        ("optimizer.params.weight_decy", "weight_decay"),
        ("scheduler.params.warmup_num_step", "warmup_num_steps"),
        ("zero_optimization.reduce_bucket_sise", "reduce_bucket_size"),
    ];
    assert_eq!(e.problems.len(), cases.len(), "{e}");
    for (path, want) in cases {
        assert_eq!(
            problem(&e, path).fix,
            format!("did you mean \"{want}\"?"),
            "at {path}"
        );
    }
    // Display lists every problem.
    let text = e.to_string();
    assert!(text.starts_with("training config: 4 problems"), "{text}");
    assert!(text.contains("4. "), "{text}");
}

#[test]
fn unknown_key_without_close_match_lists_the_keys() {
    let e = err(r#"{"train_batch_size": 32, "bf16": {"enabled": true, "xyzzy": 1}}"#);
    let p = problem(&e, "bf16.xyzzy");
    assert!(p.fix.contains("are: enabled"), "{}", p.fix);
}

#[test]
fn misplaced_key_points_to_its_section() {
    let e = err(r#"{"train_batch_size": 32, "lr": 0.1}"#);
    assert!(problem(&e, "lr").fix.contains("\"optimizer\""));
}

#[test]
fn wrong_types_name_the_path_expectation_and_value() {
    let e = err(r#"{
        "train_micro_batch_size_per_gpu": "8",
        "gradient_clipping": -1.0,
        "fp16": {"enabled": "true", "loss_scale_window": 1.5},
        "zero_optimization": {"stage": 1.5},
        "steps_per_print": 0
    }"#);
    let p = problem(&e, "train_micro_batch_size_per_gpu");
    assert_eq!(
        p.message,
        "expected an integer from 1 to 4294967295, found the string \"8\""
    );
    assert_eq!(p.fix, "remove the quotes: write 8 rather than \"8\"");

    let p = problem(&e, "gradient_clipping");
    assert_eq!(p.message, "expected a number >= 0, found the number -1.0");
    assert!(p.fix.contains("default 0.0"), "{}", p.fix);

    let p = problem(&e, "fp16.enabled");
    assert_eq!(
        p.message,
        "expected true or false, found the string \"true\""
    );

    let p = problem(&e, "fp16.loss_scale_window");
    assert_eq!(
        p.message,
        "expected an integer from 1 to 9223372036854775807, found the number 1.5 (not a whole number)"
    );
    assert!(p.fix.contains("default 1000"), "{}", p.fix);

    let p = problem(&e, "zero_optimization.stage");
    assert!(
        p.message.contains("an integer from 0 to 3"),
        "{}",
        p.message
    );
    assert!(p.message.contains("not a whole number"), "{}", p.message);

    problem(&e, "steps_per_print");
    assert_eq!(e.problems.len(), 6, "{e}");
}

#[test]
fn zero_and_negative_batch_sizes_are_rejected() {
    let e = err(r#"{"train_batch_size": 0, "train_micro_batch_size_per_gpu": -4}"#);
    assert!(problem(&e, "train_batch_size")
        .message
        .contains("from 1 to 4294967295"));
    assert!(problem(&e, "train_micro_batch_size_per_gpu")
        .message
        .contains("-4"));
}

#[test]
fn integral_floats_are_integers() {
    let c = ok(r#"{
        "train_batch_size": 32.0,
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "allgather_bucket_size": 2e8}
    }"#);
    assert_eq!(c.batch.train_batch_size, 32);
    assert_eq!(c.zero.reduce_bucket_size, 500_000_000);
    assert_eq!(c.zero.allgather_bucket_size, 200_000_000);
}

#[test]
fn auto_is_filled_in_or_asked_for_once() {
    // train_batch_size follows from the micro-batch and gradient_clipping takes the
    // Trainer's default; the precision and the learning rate come from a command line
    // Kiln never saw, so they are asked for, together.
    let e = err(r#"{
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}
    }"#);
    assert_eq!(e.problems.len(), 1, "{e}");
    let p = problem(&e, "fp16.enabled, optimizer.params.lr");
    assert!(p.message.contains("Hugging Face Trainer"), "{}", p.message);
    assert!(p.fix.contains("fp16.enabled: true or false"), "{}", p.fix);
}

#[test]
fn invalid_json_reports_line_and_column() {
    let e = err("{\n  \"train_batch_size\": 32,\n}");
    assert_eq!(e.problems.len(), 1);
    assert_eq!(
        e.problems[0].message,
        "invalid JSON at line 3, column 1: trailing comma"
    );

    let e = err(r#"{"train_batch_size": 32, "train_batch_size": 64}"#);
    assert!(e.problems[0].message.contains("duplicate key"), "{e}");

    let e = err("[1, 2]");
    assert!(
        e.problems[0].message.contains("expected a JSON object"),
        "{e}"
    );
}

#[test]
fn null_means_not_set() {
    let c = ok(
        r#"{"train_batch_size": 32, "train_micro_batch_size_per_gpu": null,
                  "gradient_accumulation_steps": 2}"#,
    );
    assert_eq!(c.batch, geometry(32, 8, 2));
}

// ------------------------------------------------------------------------------------
// Unsupported and ignored sections
// ------------------------------------------------------------------------------------

#[test]
fn training_changing_sections_are_errors_unless_off() {
    let e = err(r#"{
        "train_batch_size": 32,
        "activation_checkpointing": {"partition_activations": true},
        "prescale_gradients": true,
        "curriculum_learning": {"enabled": true}
    }"#);
    for path in [
        "activation_checkpointing.partition_activations",
        "prescale_gradients",
        "curriculum_learning",
    ] {
        let p = problem(&e, path);
        assert!(p.message.contains("not supported by Kiln"), "{}", p.message);
    }
    // Switched off, they ask for nothing and are accepted silently.
    let c = ok(r#"{
        "train_batch_size": 32,
        "amp": {"enabled": false},
        "prescale_gradients": false,
        "gradient_predivide_factor": 1.0,
        "communication_data_type": null
    }"#);
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
}

#[test]
fn activation_checkpointing_and_lora_are_read_strictly() {
    let c = ok(r#"{"train_batch_size": 32}"#);
    assert_eq!(
        (c.activation_checkpointing, c.kiln.lora.clone()),
        (None, None)
    );
    let c = ok(r#"{"train_batch_size": 32, "activation_checkpointing": {
        "contiguous_memory_optimization": true, "number_checkpoints": 4,
        "synchronize_checkpoint_boundary": false, "profile": true}}"#);
    assert_eq!(c.activation_checkpointing, Some(1));
    let c = ok(r#"{"train_batch_size": 32, "kiln": {"activation_checkpointing": "blocks"}}"#);
    assert_eq!(c.activation_checkpointing, Some(1));
    let c = ok(r#"{"train_batch_size": 32, "kiln": {"activation_checkpointing": 3}}"#);
    assert_eq!(c.activation_checkpointing, Some(3));
    let e = err(r#"{"train_batch_size": 32, "kiln": {"activation_checkpointing": "every"}}"#);
    assert!(problem(&e, "kiln.activation_checkpointing")
        .message
        .contains("\"blocks\""));
    let e =
        err(r#"{"train_batch_size": 32, "activation_checkpointing": {"cpu_checkpointing": true}}"#);
    assert!(problem(&e, "activation_checkpointing.cpu_checkpointing")
        .message
        .contains("host memory"));

    let c = ok(
        r#"{"train_batch_size": 32, "kiln": {"lora": {"r": 16, "lora_alpha": 32,
        "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}}}"#,
    );
    let l = c.kiln.lora.unwrap();
    assert_eq!((l.r, l.alpha, l.dropout), (16, 32.0, 0.05));
    assert_eq!(
        l.target_modules,
        Some(vec!["q_proj".to_string(), "v_proj".to_string()])
    );
    let c = ok(
        r#"{"train_batch_size": 32, "kiln": {"lora": {"r": 8, "target_modules": "all-linear"}}}"#,
    );
    assert_eq!(c.kiln.lora.unwrap().target_modules, None);
    for (lora, path, want) in [
        (r#"{"alpha": 8}"#, "kiln.lora.r", "missing"),
        (r#"{"r": 0}"#, "kiln.lora.r", "from 1"),
        (r#"{"r": 4, "dropout": 1.5}"#, "kiln.lora.dropout", "[0, 1)"),
        (
            r#"{"r": 4, "target_modules": []}"#,
            "kiln.lora.target_modules",
            "all-linear",
        ),
        (
            r#"{"r": 4, "alpha": 8, "lora_alpha": 8}"#,
            "kiln.lora.lora_alpha",
            "both",
        ),
        (r#"{"r": 4, "rank": 8}"#, "kiln.lora.rank", ""),
    ] {
        let e = err(&format!(
            r#"{{"train_batch_size": 32, "kiln": {{"lora": {lora}}}}}"#
        ));
        let p = problem(&e, path);
        assert!(p.message.contains(want), "{lora}: {}", p.message);
    }
}

#[test]
fn logging_sections_are_ignored_with_a_warning() {
    let c = ok(r#"{
        "train_batch_size": 32,
        "tensorboard": {"enabled": true, "output_path": "runs/"},
        "wandb": {"enabled": false}
    }"#);
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    assert!(c.warnings[0].starts_with("ignored by Kiln: tensorboard"));
}

#[test]
fn flops_profiler_is_honoured_and_checked_like_any_section() {
    let c = ok(r#"{
        "train_batch_size": 32,
        "wall_clock_breakdown": true,
        "flops_profiler": {"enabled": true, "profile_step": 5, "module_depth": -1, "detailed": true}
    }"#);
    assert!(c.wall_clock_breakdown);
    assert!(c.flops_profiler.enabled);
    assert_eq!(c.flops_profiler.profile_step, 5);
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    assert!(
        c.notes
            .iter()
            .any(|n| n.contains("flops_profiler.detailed")),
        "{:?}",
        c.notes
    );
    // Off by default, from step 2 (step 1 compiles the kernels).
    let c = ok(r#"{"train_batch_size": 32}"#);
    assert!(!c.flops_profiler.enabled);
    assert_eq!(c.flops_profiler.profile_step, 2);

    let e = err(
        r#"{"train_batch_size": 32, "flops_profiler": {"enabled": "yes", "profile_stp": 2, "profile_step": 0}}"#,
    );
    let enabled = problem(&e, "flops_profiler.enabled");
    assert!(enabled.message.contains("\"yes\""), "{}", enabled.message);
    let typo = problem(&e, "flops_profiler.profile_stp");
    assert!(typo.fix.contains("profile_step"), "{}", typo.fix);
    problem(&e, "flops_profiler.profile_step");

    let e = err(
        r#"{"train_batch_size": 32, "flops_profiler": {"enabled": true, "output_file": "p.txt"}}"#,
    );
    let p = problem(&e, "flops_profiler.output_file");
    assert!(p.message.contains("trace.json"), "{}", p.message);
}

/// Stage 3 with DeepSpeed's keys: `stage3_param_persistence_threshold` (or its short
/// name) sets which tensors stay whole on the devices, 100 000 elements by default as in
/// DeepSpeed; the fetch tuning keys are accepted with a note saying why they change
/// nothing; the two spellings disagreeing is a problem.
#[test]
fn zero_stage_3_takes_deepspeeds_keys() {
    let zero = |body: &str| format!(r#"{{"train_batch_size": 32, "zero_optimization": {body}}}"#);
    let c = ok(&zero(r#"{"stage": 3}"#));
    assert_eq!(
        (c.zero.stage, c.zero.param_persistence_threshold),
        (3, 100_000)
    );
    let c = ok(&zero(
        r#"{"stage": 3, "stage3_param_persistence_threshold": 4096,
            "stage3_prefetch_bucket_size": 5e7, "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": true,
            "offload_optimizer": {"device": "cpu"}}"#,
    ));
    assert_eq!(c.zero.param_persistence_threshold, 4096);
    assert!(c.zero.offload_optimizer);
    let text = c.explain();
    for key in [
        "stage3_prefetch_bucket_size",
        "stage3_max_live_parameters",
        "stage3_gather_16bit_weights_on_model_save",
    ] {
        assert!(
            text.contains(&format!("note: zero_optimization.{key} ")),
            "{key}:\n{text}"
        );
    }
    let c = ok(&zero(r#"{"stage": 3, "param_persistence_threshold": 7}"#));
    assert_eq!(c.zero.param_persistence_threshold, 7);
    // Hugging Face's ZeRO-3 template: "auto" keeps DeepSpeed's default, with a note.
    let c = ok(&zero(
        r#"{"stage": 3, "stage3_param_persistence_threshold": "auto"}"#,
    ));
    assert_eq!(c.zero.param_persistence_threshold, 100_000);
    let e = err(&zero(
        r#"{"stage": 3, "param_persistence_threshold": 7,
            "stage3_param_persistence_threshold": 8}"#,
    ));
    let p = problem(&e, "zero_optimization.param_persistence_threshold");
    assert!(p.fix.contains("keep one"), "{}", p.fix);
}

/// `offload_optimizer` with DeepSpeed's keys: `"cpu"` offloads (so does the old
/// `cpu_offload: true`), `"none"` and absence do not; NVMe, a partial ratio, stage 0
/// and parameter offload below stage 3 are refused, each naming the fix; the NVMe-only
/// and pinning keys are accepted with a note saying they change nothing here.
#[test]
fn offload_optimizer_takes_deepspeeds_keys() {
    let zero = |body: &str| format!(r#"{{"train_batch_size": 32, "zero_optimization": {body}}}"#);
    let c = ok(&zero(
        r#"{"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": true,
            "buffer_count": 4, "fast_init": false, "ratio": 1.0}}"#,
    ));
    assert!(c.zero.offload_optimizer && c.zero.stage == 2);
    let text = c.explain();
    for key in [
        "offload_optimizer.pin_memory",
        "offload_optimizer.buffer_count",
    ] {
        assert!(
            text.contains(&format!("note: zero_optimization.{key} ")),
            "{key}:\n{text}"
        );
    }
    assert!(
        ok(&zero(r#"{"stage": 1, "cpu_offload": true}"#))
            .zero
            .offload_optimizer
    );
    // The old and the new key disagreeing is a problem, not a silent choice.
    let e = err(&zero(
        r#"{"stage": 1, "cpu_offload": true, "offload_optimizer": {"device": "none"}}"#,
    ));
    let p = problem(&e, "zero_optimization.cpu_offload");
    assert!(p.fix.contains("remove cpu_offload"), "{}", p.fix);
    for off in [
        r#"{"stage": 1, "offload_optimizer": {"device": "none"}}"#,
        r#"{"stage": 1, "offload_optimizer": {}}"#,
        r#"{"stage": 1}"#,
    ] {
        let c = ok(&zero(off));
        assert!(!c.zero.offload_optimizer, "{off}");
        assert!(c.zero.contiguous_gradients && c.zero.reduce_scatter && !c.zero.overlap_comm);
    }
    for (body, path, says, fix) in [
        (
            r#"{"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}"#,
            "zero_optimization.offload_optimizer.device",
            "NVMe",
            "\"cpu\"",
        ),
        (
            r#"{"stage": 2, "offload_optimizer": {"device": "gpu"}}"#,
            "zero_optimization.offload_optimizer.device",
            "\"gpu\"",
            "\"none\"",
        ),
        (
            r#"{"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}"#,
            "zero_optimization.offload_optimizer.ratio",
            "part of the optimizer state",
            "remove the key or set it to 1",
        ),
        (
            r#"{"stage": 0, "offload_optimizer": {"device": "cpu"}}"#,
            "zero_optimization.offload_optimizer",
            "stage 1, 2 or 3",
            "stage to 1, 2 or 3",
        ),
        (
            r#"{"stage": 2, "offload_param": {"device": "cpu"}}"#,
            "zero_optimization.offload_param",
            "needs ZeRO stage 3",
            "stage to 3",
        ),
    ] {
        let e = err(&zero(body));
        let p = problem(&e, path);
        assert!(p.message.contains(says), "{body}: {}", p.message);
        assert!(p.fix.contains(fix), "{body}: {}", p.fix);
    }
}

/// `offload_param` with DeepSpeed's keys (stage 3 only, as in DeepSpeed): `"cpu"` (or
/// the old `cpu_offload_params: true`) offloads, `"none"` does not, NVMe and a disagreeing
/// old key are refused naming the fix; the NVMe-only and pinning keys get a note.
#[test]
fn offload_param_takes_deepspeeds_keys() {
    let zero = |body: &str| format!(r#"{{"train_batch_size": 32, "zero_optimization": {body}}}"#);
    let c = ok(&zero(
        r#"{"stage": 3, "offload_param": {"device": "cpu", "pin_memory": true,
            "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
            "offload_optimizer": {"device": "cpu"}}"#,
    ));
    assert!(c.zero.offload_param && c.zero.offload_optimizer);
    let text = c.explain();
    assert!(
        text.contains("zero_optimization.offload_param.device"),
        "{text}"
    );
    for key in ["pin_memory", "buffer_count", "buffer_size", "max_in_cpu"] {
        assert!(
            text.contains(&format!("note: zero_optimization.offload_param.{key} ")),
            "{key}:\n{text}"
        );
    }
    assert!(
        ok(&zero(r#"{"stage": 3, "cpu_offload_params": true}"#))
            .zero
            .offload_param
    );
    for off in [
        r#"{"stage": 3, "offload_param": {"device": "none"}}"#,
        r#"{"stage": 2, "offload_param": {"device": "none"}}"#,
        r#"{"stage": 3}"#,
    ] {
        assert!(!ok(&zero(off)).zero.offload_param, "{off}");
    }
    for (body, path, says, fix) in [
        (
            r#"{"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}"#,
            "zero_optimization.offload_param.device",
            "the 16-bit parameters to NVMe",
            "\"cpu\"",
        ),
        (
            r#"{"stage": 3, "cpu_offload_params": true, "offload_param": {"device": "none"}}"#,
            "zero_optimization.cpu_offload_params",
            "turns off",
            "remove cpu_offload_params",
        ),
        (
            r#"{"stage": 1, "cpu_offload_params": true}"#,
            "zero_optimization.offload_param",
            "needs ZeRO stage 3",
            "stage to 3",
        ),
    ] {
        let e = err(&zero(body));
        let p = problem(&e, path);
        assert!(p.message.contains(says), "{body}: {}", p.message);
        assert!(p.fix.contains(fix), "{body}: {}", p.fix);
    }
}

// ------------------------------------------------------------------------------------
// Precision
// ------------------------------------------------------------------------------------

#[test]
fn fp16_and_bf16_together_is_an_error() {
    let e =
        err(r#"{"train_batch_size": 32, "fp16": {"enabled": true}, "bf16": {"enabled": true}}"#);
    assert!(problem(&e, "fp16.enabled").message.contains("both enabled"));
}

#[test]
fn bf16_and_its_old_name() {
    let c = ok(r#"{"train_batch_size": 32, "bfloat16": {"enabled": true}}"#);
    assert_eq!(c.precision, Precision::Bf16);
    assert_eq!(c.provenance["bf16.enabled"], Provenance::File);
    let c = ok(r#"{"train_batch_size": 32, "bf16": {"enabled": true}}"#);
    assert_eq!(c.precision, Precision::Bf16);
    let e = err(
        r#"{"train_batch_size": 32, "bf16": {"enabled": true}, "bfloat16": {"enabled": true}}"#,
    );
    problem(&e, "bfloat16");
    let c = ok(r#"{"train_batch_size": 32, "bf16": {"enabled": false}}"#);
    assert_eq!(c.precision, Precision::Fp32);
}

#[test]
fn dynamic_loss_scale_defaults_and_overrides() {
    let c = ok(r#"{"train_batch_size": 32, "fp16": {"enabled": true}}"#);
    let want = DynamicScaling {
        initial_scale_power: 16,
        window: 1000,
        hysteresis: 2,
        consecutive_hysteresis: false,
        min_scale: 1.0,
    };
    assert_eq!(
        c.precision,
        Precision::Fp16 {
            loss_scaling: LossScaling::Dynamic(want),
            auto_cast: false
        }
    );
    let c = ok(
        r#"{"train_batch_size": 32, "fp16": {"enabled": true, "loss_scale": 0,
                  "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 4,
                  "consecutive_hysteresis": true, "min_loss_scale": 0.5, "auto_cast": true}}"#,
    );
    let want = DynamicScaling {
        initial_scale_power: 12,
        window: 500,
        hysteresis: 4,
        consecutive_hysteresis: true,
        min_scale: 0.5,
    };
    assert_eq!(
        c.precision,
        Precision::Fp16 {
            loss_scaling: LossScaling::Dynamic(want),
            auto_cast: true
        }
    );
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
}

#[test]
fn static_loss_scale() {
    let c = ok(r#"{"train_batch_size": 32, "fp16": {"enabled": true, "loss_scale": 128}}"#);
    assert_eq!(
        c.precision,
        Precision::Fp16 {
            loss_scaling: LossScaling::Static(128.0),
            auto_cast: false
        }
    );
    // Dynamic settings next to a static scale do nothing: say so.
    let c = ok(r#"{"train_batch_size": 32,
                  "fp16": {"enabled": true, "loss_scale": 1024, "initial_scale_power": 20}}"#);
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    assert!(c.warnings[0].contains("fp16.initial_scale_power"));
}

#[test]
fn bad_loss_scale_settings() {
    let e = err(
        r#"{"train_batch_size": 32, "fp16": {"enabled": true, "initial_scale_power": 200,
                   "hysteresis": 0, "loss_scale": -1}}"#,
    );
    problem(&e, "fp16.initial_scale_power");
    problem(&e, "fp16.hysteresis");
    problem(&e, "fp16.loss_scale");
    let e = err(
        r#"{"train_batch_size": 32, "fp16": {"enabled": true, "initial_scale_power": 4,
                   "min_loss_scale": 32}}"#,
    );
    assert!(problem(&e, "fp16.min_loss_scale")
        .message
        .contains("above the initial scale 2^4 = 16"));
}

#[test]
fn bare_fp16_under_zero_warns_about_deepspeeds_initial_scale() {
    let c = ok(r#"{"train_batch_size": 32, "fp16": {"enabled": true},
                  "zero_optimization": {"stage": 2}}"#);
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    assert!(c.warnings[0].contains("2^32"));
}

// ------------------------------------------------------------------------------------
// Optimizer
// ------------------------------------------------------------------------------------

#[test]
fn optimizer_types_and_defaults() {
    // Case-insensitive like DeepSpeed; AdamW's decay defaults to DeepSpeed's 0.
    let c = ok(r#"{"train_batch_size": 32, "optimizer": {"type": "adamw"}}"#);
    assert_eq!(
        c.optimizer,
        Optimizer::Adam {
            lr: 1e-3,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: true
        }
    );
    // Adam: decoupled by default (adam_w_mode true), no decay.
    let c =
        ok(r#"{"train_batch_size": 32, "optimizer": {"type": "Adam", "params": {"lr": 3e-4}}}"#);
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
    let c = ok(r#"{"train_batch_size": 32, "optimizer": {"type": "Adam",
                  "params": {"adam_w_mode": false, "weight_decay": 0.1, "betas": [0.8, 0.99]}}}"#);
    assert_eq!(
        c.optimizer,
        Optimizer::Adam {
            lr: 1e-3,
            betas: [0.8, 0.99],
            eps: 1e-8,
            weight_decay: 0.1,
            decoupled: false
        }
    );
    let c = ok(r#"{"train_batch_size": 32, "optimizer": {"type": "SGD",
                  "params": {"lr": 0.1, "momentum": 0.9}}}"#);
    assert_eq!(
        c.optimizer,
        Optimizer::Sgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0
        }
    );
}

#[test]
fn unsupported_optimizers_and_params() {
    let e =
        err(r#"{"train_batch_size": 32, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}"#);
    let p = problem(&e, "optimizer.type");
    assert!(
        p.message
            .contains("not supported by Kiln; supported: Adam, AdamW, SGD"),
        "{}",
        p.message
    );
    let e = err(r#"{"train_batch_size": 32, "optimizer": {"type": "AdamWW"}}"#);
    assert_eq!(problem(&e, "optimizer.type").fix, "did you mean \"AdamW\"?");

    let e = err(r#"{"train_batch_size": 32, "optimizer": {"type": "AdamW",
                   "params": {"amsgrad": true, "adam_w_mode": false, "betas": [0.9, 1.5]}}}"#);
    problem(&e, "optimizer.params.amsgrad");
    problem(&e, "optimizer.params.adam_w_mode");
    problem(&e, "optimizer.params.betas");
    assert_eq!(e.problems.len(), 3, "{e}");

    let e = err(r#"{"train_batch_size": 32, "optimizer": {"params": {"lr": 1e-3}}}"#);
    problem(&e, "optimizer.type");
}

#[test]
fn noop_adam_params_are_noted() {
    let c = ok(r#"{"train_batch_size": 32, "optimizer": {"type": "Adam",
                  "params": {"torch_adam": true, "amsgrad": false, "bias_correction": true}}}"#);
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    assert!(c.warnings[0].contains("optimizer.params.torch_adam"));
    assert!(c.warnings[0].contains("no-op"));
}

// ------------------------------------------------------------------------------------
// Schedules (s = optimizer steps applied so far; N = max(2, warmup_num_steps))
// ------------------------------------------------------------------------------------

fn schedule(json_scheduler: &str) -> Schedule {
    let text = format!(
        r#"{{"train_batch_size": 32, "optimizer": {{"type": "AdamW", "params": {{"lr": 0.1}}}},
            "scheduler": {json_scheduler}}}"#
    );
    ok(&text).schedule
}

#[test]
fn no_scheduler_is_constant() {
    let c = ok(r#"{"train_batch_size": 32, "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}"#);
    assert_eq!(c.schedule, Schedule::Constant { lr: 0.05 });
    for s in [0, 1, 1_000_000] {
        assert_lr(c.schedule.lr_at(s), 0.05);
    }
}

#[test]
fn warmup_lr_log() {
    let s = schedule(
        r#"{"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
            "warmup_num_steps": 100}}"#,
    );
    assert_eq!(
        s,
        Schedule::WarmupLr {
            min_lr: 0.0,
            max_lr: 0.01,
            warmup_steps: 100,
            warmup_type: WarmupType::Log
        }
    );
    // lr = 0.01 × ln(s + 1) / ln(100) during the warmup.
    assert_lr(s.lr_at(0), 0.0); // ln 1 = 0
                                // ln 2 / ln 100 = 0.693147 / 4.605170 = 0.150515, so lr = 0.00150515
    assert_lr(s.lr_at(1), 0.01 * std::f64::consts::LN_2 / 100f64.ln());
    assert_lr(s.lr_at(9), 0.005); // ln 10 / ln 100 = 1/2
    assert_lr(s.lr_at(99), 0.01); // ln 100 / ln 100 = 1
    assert_lr(s.lr_at(100), 0.01); // warmup over
    assert_lr(s.lr_at(1_000_000), 0.01); // stays at max
}

#[test]
fn warmup_lr_linear_and_defaults() {
    let s = schedule(
        r#"{"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.011,
            "warmup_num_steps": 10, "warmup_type": "linear"}}"#,
    );
    // lr = 0.001 + 0.01 × s / 10.
    assert_lr(s.lr_at(0), 0.001);
    assert_lr(s.lr_at(1), 0.002);
    assert_lr(s.lr_at(5), 0.006);
    assert_lr(s.lr_at(9), 0.010);
    assert_lr(s.lr_at(10), 0.011);
    assert_lr(s.lr_at(500), 0.011);

    // Defaults: 0 -> 0.001 over 1000 log steps.
    let s = schedule(r#"{"type": "WarmupLR"}"#);
    assert_lr(s.lr_at(0), 0.0);
    assert_lr(s.lr_at(99), 0.001 * 2.0 / 3.0); // ln 100 / ln 1000 = 2/3
    assert_lr(s.lr_at(999), 0.001);

    // warmup_num_steps 0 counts as 2: s=0 at min, s=1 at ln 2 / ln 2 = 1.
    let text = r#"{"train_batch_size": 32, "scheduler": {"type": "WarmupLR",
                   "params": {"warmup_num_steps": 0, "warmup_max_lr": 0.5}}}"#;
    let c = ok(text);
    assert_lr(c.schedule.lr_at(0), 0.0);
    assert_lr(c.schedule.lr_at(1), 0.5);
    assert!(c.warnings[0].contains("counts as 2"), "{:?}", c.warnings);
}

#[test]
fn warmup_decay_lr() {
    let s = schedule(
        r#"{"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1,
            "warmup_num_steps": 10, "warmup_type": "linear", "total_num_steps": 110}}"#,
    );
    // Warmup: 0.01 + 0.09 × s / 10. Decay: gamma = (110 - s) / (110 - 10).
    assert_lr(s.lr_at(0), 0.01);
    assert_lr(s.lr_at(1), 0.019); // 0.01 + 0.09 × 0.1
    assert_lr(s.lr_at(5), 0.055); // 0.01 + 0.09 × 0.5
    assert_lr(s.lr_at(9), 0.091); // 0.01 + 0.09 × 0.9
    assert_lr(s.lr_at(10), 0.1); // gamma = 100 / 100
    assert_lr(s.lr_at(60), 0.055); // gamma = 50 / 100
    assert_lr(s.lr_at(109), 0.0109); // 0.01 + 0.09 × 1/100
    assert_lr(s.lr_at(110), 0.01); // gamma = 0
    assert_lr(s.lr_at(200), 0.01); // max(0, -90/100) = 0
}

#[test]
fn warmup_cosine_lr() {
    // Optimizer lr 0.1; ratio warms 0.1 -> 1 over 10 linear steps, then cosine to 0.01.
    let s = schedule(
        r#"{"type": "WarmupCosineLR", "params": {"total_num_steps": 110, "warmup_num_steps": 10,
            "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01, "warmup_type": "linear"}}"#,
    );
    assert_lr(s.lr_at(0), 0.01); // 0.1 × (0.1 + 0 × 0.9)
    assert_lr(s.lr_at(5), 0.055); // 0.1 × (0.1 + 0.5 × 0.9)
    assert_lr(s.lr_at(9), 0.091); // 0.1 × (0.1 + 0.9 × 0.9)
                                  // s = 10: x = (10 - 10 + 1) / 100; cos(pi/100) = 0.9995065603657316
                                  // ratio = 0.01 + 0.99 × (1 + 0.9995065603657316) / 2 = 0.9997557473810371
    assert_lr(s.lr_at(10), 0.099_975_574_738_103_71);
    // s = 59: x = 50/100, cos(pi/2) = 0, ratio = 0.01 + 0.99 × 0.5 = 0.505
    assert_lr(s.lr_at(59), 0.0505);
    // s = 109: x = 1, cos(pi) = -1, ratio = 0.01
    assert_lr(s.lr_at(109), 0.001);
    // Past the end Kiln stays at the floor.
    assert_lr(s.lr_at(110), 0.001);
    assert_lr(s.lr_at(10_000), 0.001);

    // Log warmup: s = 1 -> gamma = ln 2 / ln 10 = 0.30102999566398120
    // ratio = 0 + 0.30103 × 1 (warmup_min_ratio defaults to 0)
    let s = schedule(
        r#"{"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}}"#,
    );
    assert_lr(s.lr_at(0), 0.0);
    assert_lr(s.lr_at(1), 0.1 * std::f64::consts::LOG10_2); // 0.1 × 0.30103
}

#[test]
fn scheduler_errors() {
    let e = err(
        r#"{"train_batch_size": 32, "scheduler": {"type": "WarmupDecayLR",
                   "params": {"warmup_num_steps": 100}}}"#,
    );
    assert!(problem(&e, "scheduler.params.total_num_steps")
        .message
        .contains("needs total_num_steps"));
    let e = err(
        r#"{"train_batch_size": 32, "scheduler": {"type": "WarmupCosineLR",
                   "params": {"warmup_num_steps": 100, "total_num_steps": 50, "warmup_max_lr": 1}}}"#,
    );
    problem(&e, "scheduler.params.total_num_steps");
    assert!(problem(&e, "scheduler.params.warmup_max_lr")
        .fix
        .contains("optimizer.params.lr"));
    let e = err(r#"{"train_batch_size": 32, "scheduler": {"type": "warmuplr"}}"#);
    assert_eq!(
        problem(&e, "scheduler.type").fix,
        "did you mean \"WarmupLR\"?"
    );
    let e = err(r#"{"train_batch_size": 32, "scheduler": {"type": "OneCycle"}}"#);
    assert!(problem(&e, "scheduler.type")
        .message
        .contains("not supported by Kiln"));
    let e = err(
        r#"{"train_batch_size": 32, "scheduler": {"type": "WarmupLR",
                   "params": {"warmup_type": "cosine", "warmup_min_lr": 0.1, "warmup_max_lr": 0.01}}}"#,
    );
    problem(&e, "scheduler.params.warmup_type");
    problem(&e, "scheduler.params.warmup_min_lr");
}

#[test]
fn warmup_lr_overriding_the_optimizer_lr_warns() {
    // #7303: optimizer lr 3e-4 silently replaced by the default warmup_max_lr 1e-3.
    let c = ok(r#"{"train_batch_size": 32,
                  "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
                  "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}"#);
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    assert!(c.warnings[0].contains("optimizer.params.lr 0.0003 is overridden"));
    assert!(c.warnings[0].contains("0.001 (its default)"));
    assert_lr(c.schedule.lr_at(100), 0.001); // DeepSpeed's semantics kept
                                             // Same peak, or no explicit optimizer lr: nothing to warn about.
    let c = ok(r#"{"train_batch_size": 32,
                  "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
                  "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 3e-4,
                                "total_num_steps": 5000}}}"#);
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    let c = ok(r#"{"train_batch_size": 32, "optimizer": {"type": "AdamW"},
                  "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01}}}"#);
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
}

// ------------------------------------------------------------------------------------
// Provenance, defaults, files, a real config
// ------------------------------------------------------------------------------------

#[test]
fn explain_marks_file_default_and_inferred() {
    let c = ok(
        r#"{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8,
                  "optimizer": {"type": "Adam", "params": {"lr": 2e-4}},
                  "tensorboard": {"enabled": true},
                  "zero_optimization": {"stage": 1, "reduce_bucket_size": 2e8}}"#,
    );
    let text = c.explain();
    let lines: Vec<&str> = text.lines().collect();
    for want in [
        "world_size = 2 (caller)",
        "train_batch_size = 32 (file)",
        "train_micro_batch_size_per_gpu = 8 (file)",
        "gradient_accumulation_steps = 2 (inferred: train_batch_size / \
         (train_micro_batch_size_per_gpu × world size) = 32 / (8 × 2))",
        "fp16.enabled = false (default)",
        "optimizer.params.lr = 0.0002 (file)",
        "optimizer.params.weight_decay = 0.0 (default)",
        "optimizer.params.adam_w_mode = true (default)",
        "scheduler.type = none (constant lr 0.0002) (inferred: no scheduler section)",
        "gradient_clipping = 0.0 (default)",
        "zero_optimization.stage = 1 (file)",
        "zero_optimization.reduce_bucket_size = 200000000 (file)",
        "zero_optimization.allgather_bucket_size = 500000000 (default)",
    ] {
        assert!(lines.contains(&want), "missing `{want}` in:\n{text}");
    }
    assert!(text.contains("optimizer.type = AdamW (inferred: type Adam with adam_w_mode true"));
    let last = lines.last().unwrap();
    assert!(
        last.starts_with("warning: ignored by Kiln: tensorboard"),
        "{text}"
    );
    // Every line is `key = value (origin)` or a warning.
    for l in &lines {
        assert!(
            l.starts_with("warning: ") || (l.contains(" = ") && l.ends_with(')')),
            "{l}"
        );
    }
}

#[test]
fn defaults_without_a_config() {
    let c = TrainConfig::default_for(4);
    assert_eq!(
        c.batch,
        BatchConfig {
            train_batch_size: 32,
            micro_batch: 8,
            grad_accum: 1,
            world: 4
        }
    );
    assert_eq!(c.precision, Precision::Fp32);
    assert_lr(c.schedule.lr_at(0), 1e-3);
    assert_eq!(c.optimizer.lr(), 1e-3);
    assert_eq!(c.zero.stage, 0);
    assert!(c.warnings.is_empty());
    let text = c.explain();
    assert!(
        text.contains("train_micro_batch_size_per_gpu = 8 (default)"),
        "{text}"
    );
    assert!(text.contains("train_batch_size = 32 (inferred:"), "{text}");
    // The defaults agree with what parsing the same settings gives.
    let parsed = parse(r#"{"train_micro_batch_size_per_gpu": 8}"#, 4).unwrap();
    assert_eq!(parsed.batch, c.batch);
    assert_eq!(parsed.optimizer, c.optimizer);
    assert_eq!(parsed.schedule, c.schedule);
    assert_eq!(parsed.zero, c.zero);
    assert_eq!(parsed.gradient_clipping, c.gradient_clipping);
    assert_eq!(parsed.steps_per_print, c.steps_per_print);
}

#[test]
fn load_names_the_file() {
    let dir = std::env::temp_dir().join(format!("kiln-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("ds_config.json");
    std::fs::write(&good, r#"{"train_micro_batch_size_per_gpu": 4}"#).unwrap();
    assert_eq!(load(&good, 2).unwrap().batch.train_batch_size, 8);

    let bad = dir.join("bad.json");
    std::fs::write(&bad, r#"{"train_micro_batch_size_per_gpu": 4, "fp61": {}}"#).unwrap();
    let e = load(&bad, 2).unwrap_err();
    assert_eq!(e.file.as_deref(), Some(bad.as_path()));
    assert!(e.to_string().starts_with(&bad.display().to_string()), "{e}");
    assert_eq!(problem(&e, "fp61").fix, "did you mean \"fp16\"?");

    let missing = dir.join("missing.json");
    let e = load(&missing, 2).unwrap_err();
    assert!(e.to_string().contains("missing.json"), "{e}");
    assert!(e.problems[0].message.contains("cannot read"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn realistic_deepspeed_config_parses() {
    // The shape DeepSpeed users write for a GPT-style run on 2 GPUs.
    let c = ok(r#"{
      "train_batch_size": 256,
      "train_micro_batch_size_per_gpu": 16,
      "gradient_accumulation_steps": 8,
      "steps_per_print": 100,
      "optimizer": {
        "type": "AdamW",
        "params": {
          "lr": 3e-4,
          "betas": [0.9, 0.95],
          "eps": 1e-8,
          "weight_decay": 0.1
        }
      },
      "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
          "warmup_min_lr": 0,
          "warmup_max_lr": 3e-4,
          "warmup_num_steps": 2000,
          "total_num_steps": 100000,
          "warmup_type": "linear"
        }
      },
      "gradient_clipping": 1.0,
      "fp16": {
        "enabled": true,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1
      },
      "zero_optimization": {
        "stage": 2,
        "allgather_partitions": true,
        "allgather_bucket_size": 2e8,
        "overlap_comm": true,
        "reduce_scatter": true,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": true
      },
      "tensorboard": {
        "enabled": true,
        "output_path": "logs/tensorboard/",
        "job_name": "gpt2_small"
      },
      "wall_clock_breakdown": false
    }"#);
    assert_eq!(c.batch, geometry(256, 16, 8));
    assert_eq!(c.gradient_clipping, 1.0);
    assert_eq!(c.steps_per_print, 100);
    assert!(matches!(
        c.precision,
        Precision::Fp16 {
            loss_scaling: LossScaling::Dynamic(_),
            ..
        }
    ));
    assert_eq!(
        c.optimizer,
        Optimizer::Adam {
            lr: 3e-4,
            betas: [0.9, 0.95],
            eps: 1e-8,
            weight_decay: 0.1,
            decoupled: true
        }
    );
    assert_eq!(
        c.schedule,
        Schedule::WarmupDecayLr {
            min_lr: 0.0,
            max_lr: 3e-4,
            warmup_steps: 2000,
            total_steps: 100_000,
            warmup_type: WarmupType::Linear
        }
    );
    // Halfway through the warmup: 3e-4 × 1000 / 2000.
    assert_lr(c.schedule.lr_at(1000), 1.5e-4);
    assert_eq!(c.zero.stage, 2);
    assert!(c.zero.overlap_comm);
    assert_eq!(c.zero.reduce_bucket_size, 200_000_000);
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    assert!(c.warnings[0].contains("tensorboard"));
}

#[test]
fn the_kiln_section_holds_our_own_settings_strictly() {
    let c = ok(r#"{"train_batch_size": 8,
        "kiln": {"devices": ["vulkan:0"], "data_workers": 3, "steps": 500,
                 "eval_every": 0, "checkpoint_every": 100, "keep_checkpoints": 0, "seed": 7}}"#);
    let k = &c.kiln;
    assert_eq!(k.devices, ["vulkan:0"]);
    assert_eq!((k.data_workers, k.prefetch_depth), (3, 4));
    assert_eq!(k.steps, Some(500));
    assert_eq!(
        (k.eval_every, k.checkpoint_every, k.keep_checkpoints, k.seed),
        (0, 100, 0, 7)
    );
    assert!(c.explain().contains("kiln.prefetch_depth = 4 (default)"));
    assert!(
        c.explain().contains("kiln.seed = 7 (file)"),
        "{}",
        c.explain()
    );
    // A comma-separated string works as well as a list.
    assert_eq!(
        ok(r#"{"train_batch_size": 8, "kiln": {"devices": "vulkan:0, gl"}}"#)
            .kiln
            .devices,
        ["vulkan:0", "gl"]
    );
    assert_eq!(
        ok(r#"{"train_batch_size": 8}"#).kiln,
        KilnSettings::default()
    );

    let e = err(r#"{"train_batch_size": 8,
        "kiln": {"checkpoint_evry": 10, "data_workers": 0, "devices": 3, "steps": 0}}"#);
    assert!(problem(&e, "kiln.checkpoint_evry")
        .fix
        .contains("checkpoint_every"));
    assert!(problem(&e, "kiln.data_workers")
        .message
        .contains("from 1 to 1024"));
    assert!(problem(&e, "kiln.devices")
        .message
        .contains("list of device names"));
    assert!(problem(&e, "kiln.steps").message.contains(">= 1"));
    assert_eq!(e.problems.len(), 4, "{e}");
}

// ------------------------------------------------------------------------------------
// Pipeline
// ------------------------------------------------------------------------------------

#[test]
fn pipeline_section_sets_stages_and_partition() {
    use kiln_engine::config::PartitionMethod;
    let c = ok(r#"{"train_batch_size": 32, "pipeline": {"stages": 2, "partition": "uniform"}}"#);
    assert_eq!(c.pipeline.stages, 2);
    assert_eq!(c.pipeline.partition, PartitionMethod::Uniform);
    let text = c.explain();
    assert!(text.contains("pipeline.stages = 2 (file)"), "{text}");
    assert!(
        text.contains("pipeline.partition = uniform (file)"),
        "{text}"
    );
    // No section: one stage, DeepSpeed's default method.
    let c = ok(r#"{"train_batch_size": 32}"#);
    assert_eq!(c.pipeline.stages, 1);
    assert_eq!(c.pipeline.partition, PartitionMethod::Parameters);
    // Block counts, under the PipelineModule's spelling; DeepSpeed's section defaults.
    let c = ok(r#"{"train_batch_size": 32, "pipeline": {"stages": 2,
        "partition_method": [1, 3], "seed_layers": false, "pipe_partitioned": true,
        "grad_partitioned": true, "activation_checkpoint_interval": 0}}"#);
    assert_eq!(c.pipeline.partition, PartitionMethod::Blocks(vec![1, 3]));
    assert!(
        c.notes
            .iter()
            .any(|n| n.contains("pipe_partitioned") && n.contains("tensor parallelism")),
        "{:?}",
        c.notes
    );
    // DeepSpeed's own defaults ("auto", "best") are read as Kiln's.
    let c = ok(r#"{"train_batch_size": 32, "pipeline": {"stages": "auto", "partition": "best"}}"#);
    assert_eq!(c.pipeline.stages, 1);
    assert_eq!(c.pipeline.partition, PartitionMethod::Parameters);
    assert!(c.explain().contains("\"best\""), "{}", c.explain());
}

#[test]
fn kiln_pipeline_stages_is_pipeline_stages() {
    let c = ok(r#"{"train_batch_size": 32, "kiln": {"pipeline_stages": 3}}"#);
    assert_eq!(c.pipeline.stages, 3);
    assert!(
        c.explain()
            .contains("pipeline.stages = 3 (inferred: kiln.pipeline_stages)"),
        "{}",
        c.explain()
    );
    let e = err(r#"{"train_batch_size": 32, "pipeline": {"stages": 2},
        "kiln": {"pipeline_stages": 4}}"#);
    let p = problem(&e, "pipeline.stages");
    assert!(
        p.message.contains("kiln.pipeline_stages says 4") && p.fix.contains("make them equal"),
        "{p:?}"
    );
}

#[test]
fn pipeline_settings_kiln_lacks_are_refused_with_what_to_do() {
    // DeepSpeed's checkpoint interval is activation checkpointing of ranges of N blocks.
    let c = ok(r#"{"train_batch_size": 32, "pipeline": {"stages": 2,
        "activation_checkpoint_interval": 2}}"#);
    assert_eq!(c.activation_checkpointing, Some(2));
    let e = err(r#"{"train_batch_size": 32, "pipeline": {"stages": 2,
        "activation_checkpoint_interval": -1}}"#);
    problem(&e, "pipeline.activation_checkpoint_interval");
    let e = err(r#"{"train_batch_size": 32, "pipeline": {"stages": 2,
        "partition": "type:TransformerLayer"}}"#);
    let p = problem(&e, "pipeline.partition");
    assert!(p.fix.contains("\"uniform\""), "{p:?}");
    let e = err(r#"{"train_batch_size": 32, "pipeline": {"stages": 2, "partition": "even"}}"#);
    let p = problem(&e, "pipeline.partition");
    assert!(p.message.contains("unknown partition method"), "{p:?}");
    let e = err(r#"{"train_batch_size": 32, "pipeline": {"stages": 2, "partition": [1, 2, 3]}}"#);
    let p = problem(&e, "pipeline.partition");
    assert!(
        p.message.contains("3 block counts for 2 pipeline stages"),
        "{p:?}"
    );
    let e = err(r#"{"train_batch_size": 32, "pipeline": {"stages": 0}}"#);
    problem(&e, "pipeline.stages");
    let e = err(r#"{"train_batch_size": 32, "pipeline": {"stagse": 2}}"#);
    let p = problem(&e, "pipeline.stagse");
    assert!(p.fix.contains("did you mean \"stages\""), "{p:?}");
    let e = err(
        r#"{"train_batch_size": 32, "pipeline": {"partition": "uniform",
        "partition_method": "uniform"}}"#,
    );
    problem(&e, "pipeline.partition_method");
}
