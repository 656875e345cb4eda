//! `"auto"`: the placeholder the Hugging Face Trainer writes in DeepSpeed configs and
//! replaces, before DeepSpeed reads them, with values from its TrainingArguments.
//!
//! Kiln reads the file itself, so it fills in what it can the way the Trainer's
//! integration does: values that follow from the rest of the file (the batch sizes from
//! each other and the world size, `warmup_max_lr` from the optimizer's `lr`,
//! `warmup_min_lr` 0, `total_num_steps` from `kiln.steps`), values that do not change the
//! result (bucket sizes), and the optimizer's betas, eps and weight decay and the gradient
//! clipping from the Trainer's defaults (one warning lists those, since a run may have
//! changed them). What is
//! left (the learning rate, the precision, the warmup...) depends on the user's command
//! line, which Kiln cannot see: one problem lists every such key with where the Trainer
//! takes it from.

use super::reader::Reader;

/// Where the Hugging Face Trainer takes the value it writes over each `"auto"`.
const SOURCES: &[(&str, &str)] = &[
    (
        "train_micro_batch_size_per_gpu",
        "--per_device_train_batch_size",
    ),
    (
        "train_batch_size",
        "world size × --per_device_train_batch_size × --gradient_accumulation_steps; or set \
         train_micro_batch_size_per_gpu and let Kiln infer it",
    ),
    (
        "gradient_accumulation_steps",
        "--gradient_accumulation_steps",
    ),
    ("gradient_clipping", "--max_grad_norm"),
    ("fp16.enabled", "--fp16"),
    ("bf16.enabled", "--bf16"),
    ("bfloat16.enabled", "--bf16"),
    ("optimizer.params.lr", "--learning_rate"),
    ("optimizer.params.weight_decay", "--weight_decay"),
    ("scheduler.params.warmup_max_lr", "--learning_rate"),
    (
        "scheduler.params.warmup_num_steps",
        "--warmup_steps, or --warmup_ratio × the run's steps",
    ),
    (
        "scheduler.params.total_num_steps",
        "the run's optimizer steps (--max_steps); or set kiln.steps and keep \"auto\"",
    ),
];

impl Reader {
    /// Records `path` as filled from a Trainer default, described by `flag_default`
    /// (`"--max_grad_norm 1.0"`), to `value`.
    pub(super) fn hf_guess(&mut self, path: &str, flag_default: &str, value: &str) {
        self.resolved_auto(
            path,
            format!("the Hugging Face Trainer's default {flag_default}"),
        );
        self.auto_guesses
            .push(format!("{path} {value} ({flag_default})"));
    }

    /// Turns the `"auto"` values left open into one problem and the guesses into one
    /// warning. Called once, after every section is read.
    pub(super) fn finish_autos(&mut self) {
        if !self.auto_guesses.is_empty() {
            self.warnings.push(format!(
                "\"auto\" filled in with the Hugging Face Trainer's defaults: {}; write the \
                 values if your run changed them",
                self.auto_guesses.join(", ")
            ));
        }
        if self.autos.is_empty() {
            return;
        }
        let autos = std::mem::take(&mut self.autos);
        let n = autos.len();
        let paths: Vec<&str> = autos.iter().map(|(p, _)| p.as_str()).collect();
        let wanted: Vec<String> = autos
            .iter()
            .map(|(path, expected)| {
                let source = SOURCES.iter().find(|(p, _)| p == path).map_or(
                    "the Trainer does not fill this key".to_string(),
                    |(_, s)| format!("Hugging Face: {s}"),
                );
                format!("{path}: {expected} ({source})")
            })
            .collect();
        let these = if n == 1 { "this value" } else { "these values" };
        self.problem(
            &paths.join(", "),
            format!(
                "\"auto\" in {n} place{}: a placeholder the Hugging Face Trainer replaces with \
                 values from its command line before DeepSpeed reads the config; Kiln reads \
                 the file itself, and nothing else in it determines {these}",
                if n == 1 { "" } else { "s" }
            ),
            format!(
                "write the values you train with in place of \"auto\": {}",
                wanted.join("; ")
            ),
        );
    }
}
