//! `kiln train` with pipeline stages: the config's `pipeline` section and the flags,
//! the same losses as one device, checkpoints that resume on another number of stages,
//! the bubble warning and metrics, and what is refused.
//!
//! Runs on CPU devices (`cpux2`): the pipeline's arithmetic is the backends', and the
//! CLI's part (config, loop, checkpoints) is what is tested here.

use kiln::engine::kernels::NonFinite;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kiln::engine::train::checkpoint;
use kiln::engine::train::runs::{self, StepRecord};
use kiln::engine::{
    Buffer, Capabilities, DType, Device, Error as EngineError, HostData, Kernel, PendingDownload,
    Result as EngineResult,
};
use kiln::train::{bubble_warning, train, TrainOptions};

/// Relative tolerance of the fp32 losses between topologies: the tied embedding's two
/// gradients (first and last stage) are summed after each stage's backward, where one
/// device accumulates them within its backward, so the sums round differently in the
/// last bits (the library's equivalence tests hold the same 1e-5).
const FP32_REL: f32 = 1e-5;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-pipeline-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A 2-block GPT and an fp32 config of micro-batch 4 × 4 micro-batches (m = 4), with
/// `extra` top-level keys.
fn files(dir: &Path, extra: &str) -> (PathBuf, PathBuf) {
    let model = dir.join("model.json");
    std::fs::write(
        &model,
        r#"{"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 13}"#,
    )
    .unwrap();
    let config = dir.join("ds_config.json");
    std::fs::write(
        &config,
        format!(
            r#"{{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
                "optimizer": {{"type": "AdamW", "params": {{"lr": 0.003, "weight_decay": 0.01}}}}
                {extra}}}"#
        ),
    )
    .unwrap();
    (config, model)
}

fn options(dir: &Path, out: &str, devices: &str, stages: Option<usize>) -> TrainOptions {
    let (config, model) = files(dir, "");
    TrainOptions {
        config: Some(config),
        model: Some(model),
        devices: vec![devices.into()],
        out: Some(dir.join(out)),
        steps: Some(6),
        eval_every: Some(0),
        checkpoint_every: Some(3),
        keep_checkpoints: Some(0),
        pipeline_stages: stages,
        ..TrainOptions::default()
    }
}

fn records(run: &Path) -> Vec<StepRecord> {
    runs::read_metrics(run).unwrap()
}

fn close(a: f32, b: f32) -> bool {
    (a - b).abs() <= FP32_REL * b.abs().max(1e-6)
}

fn assert_losses_match(what: &str, got: &[StepRecord], want: &[StepRecord]) {
    assert_eq!(got.len(), want.len(), "{what}: steps");
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.step, w.step);
        assert!(
            close(g.loss, w.loss),
            "{what}: step {} loss {} vs one device {}",
            g.step,
            g.loss,
            w.loss
        );
    }
}

/// Two stages train the model one device trains: the same losses step by step and the
/// same held-out loss, with the bubble and the bytes between stages in the metrics.
#[test]
fn two_stages_train_like_one_device_with_pipeline_metrics() {
    let dir = scratch("equal");
    let one = train(&options(&dir, "one", "cpu", None)).unwrap();
    let two = train(&options(&dir, "two", "cpux2", Some(2))).unwrap();
    let (a, b) = (records(&one.dir), records(&two.dir));
    assert_losses_match("2 stages", &b, &a);
    let (ea, eb) = (
        a.last().unwrap().eval_loss.unwrap(),
        b.last().unwrap().eval_loss.unwrap(),
    );
    assert!(close(eb, ea), "eval loss {eb} vs one device {ea}");
    assert_eq!(
        a.last().unwrap().eval_accuracy.is_some(),
        b.last().unwrap().eval_accuracy.is_some()
    );
    for r in &b {
        // (p - 1) / (m + p - 1) for p = 2, m = 4.
        assert_eq!(r.pipeline_bubble_theory, Some(0.2));
        let bubble = r.pipeline_bubble.unwrap();
        assert!((0.0..1.0).contains(&bubble), "{bubble}");
        // Each micro-batch's activations forward and their gradients back: 4 rows of
        // 16 positions of 32 f32 values, twice per micro-batch, 4 micro-batches.
        assert_eq!(r.pipeline_bytes, Some(2 * 4 * 4 * 16 * 32 * 4));
    }
    assert!(a.iter().all(|r| r.pipeline_bubble.is_none()));
    // The same checkpoint format: the same tensors under the same names.
    let names = |run: &Path| {
        let ck = checkpoint::load_latest(run).unwrap();
        let mut n: Vec<(String, Vec<usize>)> = [checkpoint::MODEL_FILE, checkpoint::OPTIMIZER_FILE]
            .iter()
            .flat_map(|f| ck.file(f).unwrap().tensors.clone())
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect();
        n.sort();
        n
    };
    assert_eq!(names(&one.dir), names(&two.dir));
}

/// A checkpoint of 2 stages resumes on 1 device and one of 1 device on 2 stages, and
/// either continues with the losses of the run that was never interrupted.
#[test]
fn checkpoints_resume_on_another_number_of_stages() {
    let dir = scratch("resume");
    let whole = records(&train(&options(&dir, "whole", "cpu", None)).unwrap().dir);
    for (name, first, then) in [
        ("pp2-then-pp1", ("cpux2", Some(2)), ("cpu", None)),
        ("pp1-then-pp2", ("cpu", None), ("cpux2", Some(2))),
    ] {
        let mut o = options(&dir, name, first.0, first.1);
        o.steps = Some(3);
        train(&o).unwrap();
        let mut o = options(&dir, name, then.0, then.1);
        o.resume = true;
        let r = train(&o).unwrap();
        assert_eq!(r.steps, 6);
        assert_losses_match(name, &records(&r.dir), &whole);
    }
}

/// The config's `pipeline.stages` trains a pipeline; `--pipeline-stages` replaces it.
#[test]
fn config_stages_apply_and_the_flag_wins() {
    let dir = scratch("config");
    let (config, model) = files(
        &dir,
        r#", "pipeline": {"stages": 2, "partition": "uniform"}"#,
    );
    let base = TrainOptions {
        config: Some(config),
        model: Some(model),
        steps: Some(1),
        eval_every: Some(0),
        checkpoint_every: Some(0),
        ..TrainOptions::default()
    };
    let r = train(&TrainOptions {
        devices: vec!["cpux2".into()],
        out: Some(dir.join("from-config")),
        ..base.clone()
    })
    .unwrap();
    assert!(records(&r.dir)[0].pipeline_bubble.is_some());
    let r = train(&TrainOptions {
        devices: vec!["cpu".into()],
        out: Some(dir.join("flag")),
        pipeline_stages: Some(1),
        ..base.clone()
    })
    .unwrap();
    assert!(records(&r.dir)[0].pipeline_bubble.is_none());
}

/// Ctrl-C / SIGTERM (the interrupt flag) stops a pipeline after its step with a
/// checkpoint, as it stops the data-parallel loop.
#[test]
fn an_interrupt_stops_a_pipeline_with_a_checkpoint() {
    let dir = scratch("interrupt");
    let mut o = options(&dir, "run", "cpux2", Some(2));
    o.checkpoint_every = Some(0);
    o.interrupt = Some(Arc::new(AtomicBool::new(true)));
    let r = train(&o).unwrap();
    assert!(r.interrupted);
    assert_eq!(r.steps, 1);
    assert_eq!(checkpoint::load_latest(&r.dir).unwrap().step(), 1);
}

fn train_err(o: &TrainOptions) -> String {
    format!("{:#}", train(o).unwrap_err())
}

/// 4 devices in 2 stages are 2 replicas of the pipeline: they train like 2 devices
/// data-parallel on the same global batch (the config resolved for 2 ranks in both),
/// with ZeRO 1 sharding each stage's optimizer state over its replicas; the run
/// reports the exposed transfer time, and its checkpoint resumes data-parallel.
#[test]
fn two_stages_times_two_replicas_train_like_two_devices_data_parallel() {
    let dir = scratch("pp-dp");
    let dp = records(&train(&options(&dir, "dp", "cpux2", None)).unwrap().dir);
    let both = train(&options(&dir, "pp-dp", "cpux4", Some(2))).unwrap();
    let got = records(&both.dir);
    assert_losses_match("2 stages x 2 replicas", &got, &dp);
    // The held-out loss comes through the stages of one replica.
    let (want, eval) = (
        dp.last().unwrap().eval_loss.unwrap(),
        got.last().unwrap().eval_loss.unwrap(),
    );
    assert!(
        close(eval, want),
        "eval loss {eval} vs data-parallel {want}"
    );
    for r in &got {
        assert_eq!(r.pipeline_bubble_theory, Some(0.2));
        let exposed = r.pipeline_exposed_ms.unwrap();
        assert!(
            exposed >= 0.0 && exposed <= r.step_ms,
            "{exposed} of {}",
            r.step_ms
        );
        // Both replicas send their micro-batches: twice one pipeline's bytes.
        assert_eq!(r.pipeline_bytes, Some(2 * 2 * 4 * 4 * 16 * 32 * 4));
    }
    let mut o = options(&dir, "zero1", "cpux4", Some(2));
    let (config, _) = files(&dir, r#", "zero_optimization": {"stage": 1}"#);
    o.config = Some(config);
    assert_losses_match("ZeRO 1", &records(&train(&o).unwrap().dir), &dp);
    // pp 2 x dp 2 for 3 steps, then data-parallel on 2 devices.
    let mut o = options(&dir, "then-dp", "cpux4", Some(2));
    o.steps = Some(3);
    train(&o).unwrap();
    let mut o = options(&dir, "then-dp", "cpux2", None);
    o.resume = true;
    let r = train(&o).unwrap();
    assert_eq!(r.steps, 6);
    assert_losses_match("pp 2 x dp 2, resumed on dp 2", &records(&r.dir), &dp);
}

#[test]
fn what_pipelines_do_not_run_is_refused_before_anything_is_written() {
    let dir = scratch("refused");
    let e = train_err(&options(&dir, "odd", "cpux3", Some(2)));
    assert!(
        e.contains("2 pipeline stages do not divide the 3 device(s)"),
        "{e}"
    );
    let mut o = options(&dir, "partition", "cpu", None);
    o.partition = Some("uniform".into());
    let e = train_err(&o);
    assert!(
        e.contains("--partition cuts a model into pipeline stages"),
        "{e}"
    );
    let mut o = options(&dir, "blocks", "cpux2", Some(2));
    o.partition = Some("1,1,1".into());
    let e = train_err(&o);
    assert!(
        e.contains("3 block counts") && e.contains("2 pipeline stages"),
        "{e}"
    );
    for out in ["odd", "partition", "blocks"] {
        assert!(!dir.join(out).exists(), "{out} was created");
    }
}

#[test]
fn few_micro_batches_per_stage_are_warned_about_with_the_bubble_and_the_fix() {
    let w = bubble_warning(2, 4).unwrap();
    assert!(
        w.contains("gradient_accumulation_steps 4 with 2 pipeline stages")
            && w.contains("idle for 20%")
            && w.contains("at least 8")
            && w.contains("11% or less"),
        "{w}"
    );
    assert_eq!(bubble_warning(2, 8), None);
    assert_eq!(bubble_warning(1, 1), None);
    // Once, at start, on the command line, beside the pipeline's per-step figures.
    let dir = scratch("warning");
    let (config, model) = files(&dir, "");
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["train", "--config", config.to_str().unwrap()])
        .args(["--model", model.to_str().unwrap(), "--devices", "cpux2"])
        .args([
            "--pipeline-stages",
            "2",
            "--steps",
            "2",
            "--eval-every",
            "0",
        ])
        .args(["--out", dir.join("run").to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(
        err.matches("warning: gradient_accumulation_steps 4")
            .count(),
        1,
        "{err}"
    );
    assert!(
        err.contains("pipeline bubble") && err.contains("(theory 20%)"),
        "{err}"
    );
    assert!(err.contains("stage 1: model states"), "{err}");
}

#[test]
fn config_explain_shows_the_pipeline() {
    let dir = scratch("explain");
    let (config, _) = files(&dir, r#", "pipeline": {"stages": 2, "partition": [1, 1]}"#);
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["config", "explain", config.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("pipeline.stages = 2 (file)")
            && text.contains("pipeline.partition = 1,1 (file)"),
        "{text}"
    );
    // `--world` is the data-parallel world: each replica takes a device per stage.
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["config", "check", config.to_str().unwrap(), "--world", "2"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("× world 2; 2 pipeline stages, partition 1,1: 4 devices)"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `kiln estimate` sizes a pipeline per stage for its p, dp and m: the config's batch
/// sizes are per replica (dp = devices / p), so m follows from them and dp.
#[test]
fn estimate_reports_stages_replicas_and_micro_batches() {
    let dir = scratch("estimate");
    let model = dir.join("model.json");
    std::fs::write(
        &model,
        r#"{"n_layer": 4, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 64}"#,
    )
    .unwrap();
    let config = dir.join("ds.json");
    // 32 = 4 per micro-batch x m x dp 2: m = 4 (it would be 2 over all 4 devices).
    std::fs::write(
        &config,
        r#"{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}"#,
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["estimate", "--model", model.to_str().unwrap()])
        .args(["--config", config.to_str().unwrap()])
        .args(["--devices", "4", "--pipeline-stages", "2"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in [
        "2 pipeline stage(s) x 2 data-parallel replica(s)",
        "m = 4 micro-batches per step",
        "(p-1)/(m+p-1) = 20% of each step at m = 4",
        "m = 8 (4 x stages) brings it to 11%",
        "device s x 2 + r is stage s of replica r",
    ] {
        assert!(text.contains(want), "no {want:?} in:\n{text}");
    }
}

/// With ZeRO 1 or 2 in the config, each replica holds a 1/dp shard of its stage's
/// master weights and moments: the estimate's column halves over 2 replicas. Under 2
/// the stage's gradients also shrink to one block's (plus those outside blocks).
#[test]
fn estimate_shards_each_stages_optimizer_state_over_its_replicas_under_zero() {
    let dir = scratch("estimate-zero");
    let model = dir.join("model.json");
    std::fs::write(
        &model,
        r#"{"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 16, "vocab_size": 4096}"#,
    )
    .unwrap();
    // (gradients, master+Adam) MiB of stage 0.
    let stage0_mib = |zero: u8| {
        let config = dir.join(format!("ds{zero}.json"));
        std::fs::write(
            &config,
            format!(
                r#"{{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
                    "zero_optimization": {{"stage": {zero}}}}}"#
            ),
        )
        .unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["estimate", "--model", model.to_str().unwrap()])
            .args(["--config", config.to_str().unwrap()])
            .args(["--devices", "4", "--pipeline-stages", "2"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            text.contains("ZeRO stage 1: master+Adam sharded over the 2 replicas"),
            zero == 1,
            "{text}"
        );
        assert_eq!(
            text.contains(
                "ZeRO stage 2: master+Adam sharded over the 2 replicas, each stage's \
                 alike blocks share one block's gradients"
            ),
            zero == 2,
            "{text}"
        );
        // "0  0..2  w MiB  g MiB  optimizer MiB ...": stage 0's gradients, master+Adam.
        let row = text.lines().find(|l| l.starts_with("0 ")).unwrap();
        let column = |k: usize| {
            row.split_whitespace()
                .nth(k)
                .unwrap()
                .parse::<f64>()
                .unwrap()
        };
        (column(4), column(6))
    };
    let ((grads, whole), (grads1, shard)) = (stage0_mib(0), stage0_mib(1));
    assert!(whole > 10.0, "{whole} MiB");
    // A rank's half of the stage's elements (whole / 12: f32 master and two moments),
    // each with f32 master, moments and reduced gradient and its updated f32 copy, as
    // zero.rs allocates them: master+Adam and the copy in the optimizer's column, the
    // reduced gradient in the gradients'.
    let half = whole / 12.0 / 2.0;
    assert!(
        (shard - 16.0 * half).abs() <= 0.1,
        "{shard} vs 16 bytes x half of {whole} / 12"
    );
    assert!(
        (grads1 - grads - 4.0 * half).abs() <= 0.1,
        "{grads1} vs {grads} + the shard's reduced gradient"
    );
    // Stage 2: the same shard, and stage 0's second block writes its gradients into the
    // first's buffers: one GPT block's f32 gradients (12C² + 13C elements) fewer.
    let (grads2, shard2) = stage0_mib(2);
    assert_eq!(shard2, shard);
    let block = (12 * 256 * 256 + 13 * 256) as f64 * 4.0 / (1 << 20) as f64;
    assert!(
        (grads1 - grads2 - block).abs() <= 0.1,
        "ZeRO-2 stage 0 gradients {grads2} MiB vs ZeRO-1's {grads1} MiB less one block's {block}"
    );
}

/// Without `--pipeline-stages`, `kiln estimate` takes the stages (and the partition)
/// from the config as `kiln train` does: `pipeline.stages`, else
/// `kiln.pipeline_stages`; the flags win over it.
#[test]
fn estimate_takes_the_pipeline_from_the_config() {
    let dir = scratch("estimate-config");
    let model = dir.join("model.json");
    std::fs::write(
        &model,
        r#"{"n_layer": 4, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 64}"#,
    )
    .unwrap();
    let estimate = |config: &str, flags: &[&str]| {
        let path = dir.join("ds.json");
        std::fs::write(&path, config).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["estimate", "--model", model.to_str().unwrap()])
            .args(["--config", path.to_str().unwrap(), "--devices", "4"])
            .args(flags)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{config} {flags:?}: {err}");
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let deepspeed = r#"{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
        "pipeline": {"stages": 2, "partition": "uniform"}}"#;
    let text = estimate(deepspeed, &[]);
    for want in [
        "2 pipeline stage(s) x 2 data-parallel replica(s)",
        "m = 4 micro-batches per step, partition uniform",
    ] {
        assert!(text.contains(want), "no {want:?} in:\n{text}");
    }
    let kiln = r#"{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
        "kiln": {"pipeline_stages": 4}}"#;
    let text = estimate(kiln, &[]);
    for want in [
        "4 pipeline stage(s) x 1 data-parallel replica(s)",
        "m = 4 micro-batches per step, partition parameters",
    ] {
        assert!(text.contains(want), "no {want:?} in:\n{text}");
    }
    // The flags win: one stage is the ZeRO table over all 4 devices, and a partition
    // given on the command line replaces the config's.
    let text = estimate(deepspeed, &["--pipeline-stages", "1"]);
    assert!(!text.contains("pipeline stage(s)"), "{text}");
    let text = estimate(deepspeed, &["--partition", "1,3"]);
    assert!(text.contains("partition blocks [1, 3]"), "{text}");
    // The config's stages must divide the devices too, named before its batch sizes
    // are resolved for a world that would not exist.
    let path = dir.join("ds.json");
    std::fs::write(&path, deepspeed).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["estimate", "--model", model.to_str().unwrap()])
        .args(["--config", path.to_str().unwrap(), "--devices", "3"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("2 pipeline stages (--pipeline-stages, else the config's pipeline.stages) do not divide the 3 device(s)"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A CPU device that fails every launch once `lost` is set, as if the adapter went
/// away mid-run (the CLI opens its devices itself, so the failure is driven through
/// the engine `kiln train` uses).
struct Losable {
    inner: kiln::cpu::CpuDevice,
    lost: Arc<AtomicBool>,
    /// Every overflow check finds an infinity in the first gradient it checks (as if
    /// backward overflowed).
    poison: Arc<AtomicBool>,
}

impl Device for Losable {
    fn caps(&self) -> &Capabilities {
        self.inner.caps()
    }
    fn alloc(&self, dtype: DType, len: usize) -> EngineResult<Buffer> {
        self.inner.alloc(dtype, len)
    }
    fn free(&self, buf: Buffer) -> EngineResult<()> {
        self.inner.free(buf)
    }
    fn view(&self, parent: Buffer, offset: usize, len: usize) -> EngineResult<Buffer> {
        self.inner.view(parent, offset, len)
    }
    fn upload(&self, buf: Buffer, data: &HostData) -> EngineResult<()> {
        self.inner.upload(buf, data)
    }
    fn begin_download(&self, buf: Buffer) -> EngineResult<PendingDownload> {
        self.inner.begin_download(buf)
    }
    fn finish_download(&self, pending: PendingDownload) -> EngineResult<HostData> {
        self.inner.finish_download(pending)
    }
    fn launch(&self, kernel: &Kernel) -> EngineResult<()> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(EngineError::InvalidArgument(
                "simulated device loss (the adapter went away)".into(),
            ));
        }
        if let Kernel::NonFinite(NonFinite { srcs, .. }) = kernel {
            if self.poison.load(Ordering::SeqCst) {
                let grad = srcs[0];
                let mut values = self.inner.download(grad)?.to_f32();
                values[0] = f32::INFINITY;
                self.inner
                    .upload(grad, &HostData::from_f32(grad.dtype, &values))?;
            }
        }
        self.inner.launch(kernel)
    }
    fn submit(&self) -> EngineResult<()> {
        self.inner.submit()
    }
    fn wait(&self) -> EngineResult<()> {
        self.inner.wait()
    }
    fn allocated_bytes(&self) -> u64 {
        self.inner.allocated_bytes()
    }
}

/// A stage whose device fails mid-run: the step's error names the stage, and the
/// checkpoint written before it loads, on one device and on another pipeline, with the
/// weights the pipeline had when it was written.
#[test]
fn a_failing_stage_is_named_and_the_last_checkpoint_still_loads() {
    use kiln::engine::models::gpt::{Gpt, GptConfig};
    use kiln::engine::models::{MicroBatch, Model};
    use kiln::engine::parallel::pipeline_partition::PartitionMethod;
    use kiln::engine::train::pipeline_trainer::PipelineTrainer;
    use kiln::engine::train::trainer::Trainer;

    let dir = scratch("fault");
    let (b, t, vocab) = (2, 8, 13u32);
    let model: Arc<dyn Model> = Arc::new(Gpt::new(
        GptConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            block_size: t,
            vocab_size: vocab as usize,
            padded_vocab_size: None,
        },
        t,
    ));
    let config = kiln::engine::config::parse(
        r#"{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}"#,
        1,
    )
    .unwrap();
    let micro = |step: u32| -> Vec<MicroBatch> {
        (0..2)
            .map(|i| {
                let tokens: Vec<u32> = (0..(b * t) as u32)
                    .map(|k| (k * 3 + step + i) % vocab)
                    .collect();
                let targets: Vec<u32> = tokens.iter().map(|&x| (x + 1) % vocab).collect();
                MicroBatch::tokens(&tokens, &targets)
            })
            .collect()
    };
    let lost = Arc::new(AtomicBool::new(false));
    let devs: Vec<Box<dyn Device>> = vec![
        Box::new(kiln::cpu::CpuDevice::new()),
        Box::new(Losable {
            inner: kiln::cpu::CpuDevice::new(),
            lost: lost.clone(),
            poison: Arc::default(),
        }),
    ];
    let method = PartitionMethod::Uniform;
    let mut pipe =
        PipelineTrainer::new(devs, model.clone(), config.clone(), 3, &method, 2).unwrap();
    pipe.step(&micro(0)).unwrap();
    pipe.save_checkpoint(&dir, 1, Default::default(), 0)
        .unwrap();
    let saved = pipe.param_states().unwrap();
    lost.store(true, Ordering::SeqCst);
    let e = pipe.step(&micro(1)).unwrap_err().to_string();
    assert!(
        e.contains("stage 1: invalid argument: simulated device loss")
            && e.contains("so no stage updated"),
        "{e}"
    );
    let ck = checkpoint::load_latest(&dir).unwrap();
    assert_eq!(ck.step(), 1);
    let cpu = kiln::cpu::CpuDevice::new();
    let mut one = Trainer::new(&cpu, model.clone(), config.clone(), 3).unwrap();
    one.load_checkpoint(&[&cpu], &ck).unwrap();
    assert_eq!(one.param_states(&[&cpu]).unwrap(), saved);
    assert_eq!(one.state(), pipe.state());
    let devs: Vec<Box<dyn Device>> = (0..2)
        .map(|_| Box::new(kiln::cpu::CpuDevice::new()) as Box<dyn Device>)
        .collect();
    let mut again = PipelineTrainer::new(devs, model, config, 3, &method, 2).unwrap();
    again.load_checkpoint(&ck).unwrap();
    assert_eq!(again.param_states().unwrap(), saved);
    // It trains on from there.
    again.step(&micro(1)).unwrap();
}

/// Without loss scaling nothing changes after a skipped step: a pipeline whose gradients
/// keep overflowing stops after kiln.max_consecutive_skips, as the Trainer does, and
/// its checkpoints count the skips.
#[test]
fn a_pipeline_whose_gradients_stay_non_finite_stops_like_the_trainer() {
    use kiln::engine::models::gpt::{Gpt, GptConfig};
    use kiln::engine::models::{MicroBatch, Model};
    use kiln::engine::parallel::pipeline_partition::PartitionMethod;
    use kiln::engine::train::pipeline_trainer::PipelineTrainer;

    let (b, t, vocab) = (2, 8, 13u32);
    let model: Arc<dyn Model> = Arc::new(Gpt::new(
        GptConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            block_size: t,
            vocab_size: vocab as usize,
            padded_vocab_size: None,
        },
        t,
    ));
    let config = kiln::engine::config::parse(
        r#"{"train_micro_batch_size_per_gpu": 2, "kiln": {"max_consecutive_skips": 2}}"#,
        1,
    )
    .unwrap();
    let tokens: Vec<u32> = (0..(b * t) as u32).map(|k| k % vocab).collect();
    let targets: Vec<u32> = tokens.iter().map(|&x| (x + 1) % vocab).collect();
    let micro = vec![MicroBatch::tokens(&tokens, &targets)];
    let poison = Arc::new(AtomicBool::new(true));
    let devs: Vec<Box<dyn Device>> = vec![
        Box::new(kiln::cpu::CpuDevice::new()),
        Box::new(Losable {
            inner: kiln::cpu::CpuDevice::new(),
            lost: Arc::default(),
            poison: poison.clone(),
        }),
    ];
    let mut pipe =
        PipelineTrainer::new(devs, model, config, 3, &PartitionMethod::Uniform, 2).unwrap();
    let s = pipe.step(&micro).unwrap();
    assert!(s.skipped);
    assert_eq!(pipe.consecutive_skips(), 1);
    assert_eq!(pipe.state().consecutive_skips, 1);
    let e = pipe.step(&micro).unwrap_err().to_string();
    assert!(
        e.contains("not finite") && e.contains("kiln.max_consecutive_skips = 2"),
        "{e}"
    );
}
