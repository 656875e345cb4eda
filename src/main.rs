//! The `kiln` command line.

use anyhow::Result;
use clap::{Parser, Subcommand};

use kiln::engine::Device;

#[derive(Parser)]
#[command(name = "kiln", version, about = "Mixed-precision training on any GPU")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List compute adapters and what they can do.
    Devices {
        /// Print JSON (one object per adapter) instead of a table.
        #[arg(long)]
        json: bool,
    },
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Devices { json } => devices(json),
    }
}

fn devices(json: bool) -> Result<()> {
    let mut rows = kiln::wgpu::adapters();
    let cpu = kiln::cpu::CpuDevice::new();
    if json {
        let mut list: Vec<serde_json::Value> = rows
            .iter()
            .map(|a| {
                let mut v = serde_json::to_value(a).expect("plain data serializes");
                v["spec"] = a.index.to_string().into();
                v
            })
            .collect();
        let mut c = serde_json::to_value(cpu.caps())?;
        c["spec"] = "cpu".into();
        list.push(c);
        println!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(());
    }
    if rows.is_empty() {
        eprintln!("No GPU adapter found. {}", kiln::wgpu::NO_ADAPTER_HINT);
    }
    rows.sort_by_key(|a| a.index);
    let mib = |b: u64| format!("{} MiB", b >> 20);
    let header = [
        "spec",
        "backend",
        "type",
        "name",
        "f16",
        "subgroups",
        "timestamps",
        "max binding",
        "max buffer",
    ];
    let mut table: Vec<Vec<String>> = vec![header.iter().map(|s| s.to_string()).collect()];
    let caps = rows
        .iter()
        .map(|a| (a.index.to_string(), &a.caps))
        .chain(std::iter::once(("cpu".to_string(), cpu.caps())));
    for (spec, c) in caps {
        table.push(vec![
            spec,
            c.backend.clone(),
            c.device_type.clone(),
            c.name.clone(),
            if c.f16_arithmetic { "native" } else { "packed" }.into(),
            c.subgroup_sizes.map_or("-".into(), |(a, b)| {
                if a == b {
                    a.to_string()
                } else {
                    format!("{a}-{b}")
                }
            }),
            if c.timestamp_queries { "yes" } else { "no" }.into(),
            if c.backend == "cpu" {
                "-".into()
            } else {
                mib(c.max_storage_binding)
            },
            if c.backend == "cpu" {
                "-".into()
            } else {
                mib(c.max_buffer)
            },
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|i| table.iter().map(|r| r[i].len()).max().unwrap_or(0))
        .collect();
    for row in table {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("{}", line.join("  ").trim_end());
    }
    Ok(())
}
