//! The `kiln` command line.

use anyhow::Result;
use clap::Parser;

// println! and print! for a command's output: a reader that went away (`kiln runs |
// head -1`) only means nobody wants the rest, not a panic (exit 101); any other failed
// write (a full disk behind `> file`) is the command's error.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        $crate::written(writeln!(std::io::stdout().lock(), $($arg)*))?
    }};
}
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        $crate::written(write!(std::io::stdout().lock(), $($arg)*))?
    }};
}
// eprintln! for progress and diagnostics, which must never panic or stop the work.
macro_rules! errln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

/// The result of writing a command's output; see `outln!`.
fn written(r: std::io::Result<()>) -> Result<()> {
    match r {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::Error::new(e).context("writing the output"))
        }
        _ => Ok(()),
    }
}

mod cli;

use cli::args::{BenchWhat, Cli, Command};
use cli::bench::{
    bench_attention, bench_dp, bench_matmul, bench_peak, bench_pipeline, bench_sample, bench_train,
};
use cli::inspect::{config, devices, estimate, runs};
use cli::train::{eval, train};

fn main() {
    kiln::devices::quiet_device_select();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        errln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    if cli.no_tune {
        // Every device this process opens reads it, whichever command opens them.
        std::env::set_var("KILN_GEMM_TUNE", "0");
    }
    match cli.command {
        Command::Devices { json } => devices(json),
        Command::Train(args) => train(*args),
        Command::Sample(a) => {
            kiln::sample::sample(&kiln::sample::SampleOptions {
                source: a.source,
                prompt: a.prompt,
                prompts: a.prompts,
                tokens: a.tokens,
                sampling: kiln::engine::models::sample::SamplingOptions {
                    temperature: a.temperature,
                    top_k: a.top_k,
                    top_p: a.top_p,
                },
                seed: a.seed,
                devices: a.devices,
                dtype: a.dtype.map(|d| d.parse()).transpose()?,
                chat: a.chat,
                adapter: a.adapter,
            })?;
            Ok(())
        }
        Command::Eval(a) => eval(a),
        Command::Export {
            source,
            format,
            out,
            adapter,
            merge,
        } => {
            let e = kiln::export::export_with(&source, &format, &out, adapter.as_deref(), merge)?;
            outln!(
                "{}: a Hugging Face {} model{}",
                e.dir.display(),
                e.model_type,
                if e.tokenizer_files.is_empty() {
                    " (no tokenizer: the model has none Kiln knows of)".to_string()
                } else {
                    format!(" with its tokenizer ({} files)", e.tokenizer_files.len())
                }
            );
            Ok(())
        }
        Command::Config { what } => config(what),
        Command::Prepare(a) => cli::prepare::prepare(a),
        Command::Template {
            dir,
            messages,
            add_generation_prompt,
            date,
            json,
            chat_template,
        } => {
            let report = kiln::template::template(&kiln::template::TemplateOptions {
                dir,
                row: messages,
                add_generation_prompt,
                date,
                json,
                chat_template,
            })?;
            out!("{}", report.output);
            for note in report.notes {
                errln!("{note}");
            }
            Ok(())
        }
        Command::Runs { what, root } => runs(what, &root),
        Command::Estimate {
            model,
            devices,
            config,
            seq,
            pipeline_stages,
            partition,
            lora,
            activation_checkpointing,
            fits,
            memory_limit,
        } => {
            let adapters = (lora.as_deref(), activation_checkpointing);
            if fits.is_empty() {
                estimate(
                    &model,
                    (&devices, memory_limit.as_deref()),
                    config.as_deref(),
                    seq,
                    (pipeline_stages, partition.as_deref()),
                    adapters,
                )
            } else {
                if memory_limit.is_some() {
                    anyhow::bail!(
                        "--memory-limit checks a run on the --devices given; --fits takes the \
                         device sizes to compare itself"
                    );
                }
                cli::inspect::estimate_fits(
                    &model,
                    &fits,
                    config.as_deref(),
                    seq,
                    (&devices, pipeline_stages, partition.as_deref()),
                    adapters,
                )
            }
        }
        Command::Bench {
            what: BenchWhat::Matmul(args),
        } => bench_matmul(args),
        Command::Bench {
            what: BenchWhat::Dp(args),
        } => bench_dp(args),
        Command::Bench {
            what: BenchWhat::Attention(args),
        } => bench_attention(args),
        Command::Bench {
            what: BenchWhat::Sample(args),
        } => bench_sample(args),
        Command::Bench {
            what: BenchWhat::Peak(args),
        } => bench_peak(args),
        Command::Bench {
            what: BenchWhat::Train(args),
        } => bench_train(args),
        Command::Bench {
            what: BenchWhat::Pipeline(args),
        } => bench_pipeline(args),
        Command::Bench {
            what: BenchWhat::Report(args),
        } => cli::bench::bench_report(args),
    }
}
