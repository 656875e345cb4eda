//! [`TrainConfig::explain`]: every resolved value with where it came from, as
//! `kiln config explain` prints it.

use std::fmt::Write as _;

use super::precision::{LossScaling, Precision};
use super::provenance::Provenance;
use super::scheduler::{Schedule, WarmupType};
use super::TrainConfig;
use crate::device::optim::Optimizer;

impl TrainConfig {
    /// Every resolved setting, one per line as `key.path = value (origin)`, where origin
    /// is `(default)`, `(file)`, `(caller)` or `(inferred: how)`; then one `note: ...`
    /// line per note and one `warning: ...` line per warning. Meant to be printed at start-up so users can see
    /// what DeepSpeed's implicit rules made of their file.
    pub fn explain(&self) -> String {
        let mut out = String::new();
        let mut line = |key: &str, value: String| {
            let origin = self
                .provenance
                .get(key)
                .cloned()
                .unwrap_or(Provenance::Default);
            let _ = writeln!(out, "{key} = {value} {origin}");
        };
        let b = &self.batch;
        line("world_size", b.world.to_string());
        line("train_batch_size", b.train_batch_size.to_string());
        line("train_micro_batch_size_per_gpu", b.micro_batch.to_string());
        line("gradient_accumulation_steps", b.grad_accum.to_string());

        let (fp16, bf16) = match self.precision {
            Precision::Fp32 => (false, false),
            Precision::Fp16 { .. } => (true, false),
            Precision::Bf16 => (false, true),
        };
        line("fp16.enabled", fp16.to_string());
        line("bf16.enabled", bf16.to_string());
        if let Precision::Fp16 {
            loss_scaling,
            auto_cast,
        } = &self.precision
        {
            line("fp16.auto_cast", auto_cast.to_string());
            match loss_scaling {
                LossScaling::Static(scale) => line("fp16.loss_scale", format!("{scale:?}")),
                LossScaling::Dynamic(d) => {
                    line("fp16.loss_scale", "0 (dynamic)".to_string());
                    line(
                        "fp16.initial_scale_power",
                        d.initial_scale_power.to_string(),
                    );
                    line("fp16.loss_scale_window", d.window.to_string());
                    line("fp16.hysteresis", d.hysteresis.to_string());
                    line(
                        "fp16.consecutive_hysteresis",
                        d.consecutive_hysteresis.to_string(),
                    );
                    line("fp16.min_loss_scale", format!("{:?}", d.min_scale));
                }
            }
        }

        match &self.optimizer {
            Optimizer::Adam {
                lr,
                betas,
                eps,
                weight_decay,
                decoupled,
            } => {
                let name = if *decoupled { "AdamW" } else { "Adam" };
                line("optimizer.type", name.to_string());
                line("optimizer.params.lr", format!("{lr:?}"));
                line(
                    "optimizer.params.betas",
                    format!("[{:?}, {:?}]", betas[0], betas[1]),
                );
                line("optimizer.params.eps", format!("{eps:?}"));
                line("optimizer.params.weight_decay", format!("{weight_decay:?}"));
                line("optimizer.params.adam_w_mode", decoupled.to_string());
            }
            Optimizer::Sgd {
                lr,
                momentum,
                weight_decay,
            } => {
                line("optimizer.type", "SGD".to_string());
                line("optimizer.params.lr", format!("{lr:?}"));
                line("optimizer.params.momentum", format!("{momentum:?}"));
                line("optimizer.params.weight_decay", format!("{weight_decay:?}"));
            }
        }

        let p = "scheduler.params.";
        let wt = |t: &WarmupType| match t {
            WarmupType::Log => "log".to_string(),
            WarmupType::Linear => "linear".to_string(),
        };
        match &self.schedule {
            Schedule::Constant { lr } => {
                line("scheduler.type", format!("none (constant lr {lr:?})"));
            }
            Schedule::WarmupLr {
                min_lr,
                max_lr,
                warmup_steps,
                warmup_type,
            } => {
                line("scheduler.type", "WarmupLR".to_string());
                line(&format!("{p}warmup_min_lr"), format!("{min_lr:?}"));
                line(&format!("{p}warmup_max_lr"), format!("{max_lr:?}"));
                line(&format!("{p}warmup_num_steps"), warmup_steps.to_string());
                line(&format!("{p}warmup_type"), wt(warmup_type));
            }
            Schedule::WarmupDecayLr {
                min_lr,
                max_lr,
                warmup_steps,
                total_steps,
                warmup_type,
            } => {
                line("scheduler.type", "WarmupDecayLR".to_string());
                line(&format!("{p}warmup_min_lr"), format!("{min_lr:?}"));
                line(&format!("{p}warmup_max_lr"), format!("{max_lr:?}"));
                line(&format!("{p}warmup_num_steps"), warmup_steps.to_string());
                line(&format!("{p}total_num_steps"), total_steps.to_string());
                line(&format!("{p}warmup_type"), wt(warmup_type));
            }
            Schedule::WarmupCosineLr {
                base_lr: _,
                warmup_min_ratio,
                warmup_steps,
                total_steps,
                cos_min_ratio,
                warmup_type,
            } => {
                line("scheduler.type", "WarmupCosineLR".to_string());
                line(
                    &format!("{p}warmup_min_ratio"),
                    format!("{warmup_min_ratio:?}"),
                );
                line(&format!("{p}warmup_num_steps"), warmup_steps.to_string());
                line(&format!("{p}total_num_steps"), total_steps.to_string());
                line(&format!("{p}cos_min_ratio"), format!("{cos_min_ratio:?}"));
                line(&format!("{p}warmup_type"), wt(warmup_type));
            }
        }

        line("gradient_clipping", format!("{:?}", self.gradient_clipping));
        line("steps_per_print", self.steps_per_print.to_string());
        line(
            "wall_clock_breakdown",
            self.wall_clock_breakdown.to_string(),
        );
        line(
            "flops_profiler.enabled",
            self.flops_profiler.enabled.to_string(),
        );
        line(
            "flops_profiler.profile_step",
            self.flops_profiler.profile_step.to_string(),
        );
        line("memory_breakdown", self.memory_breakdown.to_string());
        line("dump_state", self.dump_state.to_string());

        let z = &self.zero;
        let zp = "zero_optimization.";
        line(&format!("{zp}stage"), z.stage.to_string());
        line(
            &format!("{zp}contiguous_gradients"),
            z.contiguous_gradients.to_string(),
        );
        line(&format!("{zp}reduce_scatter"), z.reduce_scatter.to_string());
        line(
            &format!("{zp}reduce_bucket_size"),
            z.reduce_bucket_size.to_string(),
        );
        line(
            &format!("{zp}allgather_partitions"),
            z.allgather_partitions.to_string(),
        );
        line(
            &format!("{zp}allgather_bucket_size"),
            z.allgather_bucket_size.to_string(),
        );
        line(&format!("{zp}overlap_comm"), z.overlap_comm.to_string());
        line(
            &format!("{zp}round_robin_gradients"),
            z.round_robin_gradients.to_string(),
        );
        line(
            &format!("{zp}offload_optimizer.device"),
            if z.offload_optimizer { "cpu" } else { "none" }.to_string(),
        );
        line(
            &format!("{zp}offload_param.device"),
            if z.offload_param { "cpu" } else { "none" }.to_string(),
        );

        line("pipeline.stages", self.pipeline.stages.to_string());
        line("pipeline.partition", self.pipeline.partition.spelled());

        let k = &self.kiln;
        line("kiln.devices", format!("{:?}", k.devices));
        line("kiln.data_workers", k.data_workers.to_string());
        line("kiln.prefetch_depth", k.prefetch_depth.to_string());
        line(
            "kiln.steps",
            k.steps
                .map_or("(scheduler total_num_steps, else 1000)".into(), |n| {
                    n.to_string()
                }),
        );
        line("kiln.eval_every", k.eval_every.to_string());
        line("kiln.checkpoint_every", k.checkpoint_every.to_string());
        line("kiln.keep_checkpoints", k.keep_checkpoints.to_string());
        line("kiln.seed", k.seed.to_string());
        line("kiln.packing", k.packing.to_string());
        line(
            "kiln.max_consecutive_skips",
            k.max_consecutive_skips.to_string(),
        );
        line(
            "kiln.collective_timeout_s",
            k.collective_timeout_s.to_string(),
        );
        if let Some(n) = k.pipeline_stages {
            line("kiln.pipeline_stages", n.to_string());
        }

        for n in &self.notes {
            let _ = writeln!(out, "note: {n}");
        }
        for w in &self.warnings {
            let _ = writeln!(out, "warning: {w}");
        }
        out
    }
}
