//! The `kiln` command line.

use anyhow::{Context, Result};
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
    /// Measure kernel throughput.
    Bench {
        #[command(subcommand)]
        what: BenchWhat,
    },
}

#[derive(Subcommand)]
enum BenchWhat {
    /// GEMM GFLOP/s per adapter, dtype and shape, against CPU sgemm in the same run.
    Matmul(MatmulArgs),
}

#[derive(clap::Args)]
struct MatmulArgs {
    /// Devices to measure (`kiln devices` lists them); default: every adapter.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<String>,
    /// Storage dtypes.
    #[arg(long, value_delimiter = ',', default_value = "f32,f16,bf16")]
    dtypes: Vec<String>,
    /// Square sizes to run instead of the default set (256..2048 and GPT shapes).
    #[arg(long, value_delimiter = ',')]
    sizes: Vec<usize>,
    /// Measure each row for about this many milliseconds.
    #[arg(long, default_value_t = 400)]
    budget_ms: u64,
    /// Largest dimension the naive baseline kernel is run at (it is slow).
    #[arg(long, default_value_t = 1024)]
    naive_up_to: usize,
    /// Turn native f16 off on every device (measures the packed path).
    #[arg(long)]
    no_f16: bool,
    /// Also measure these kernel variants (e.g. `cpu24x8,tiled64`) beside the planner's choice.
    #[arg(long, value_delimiter = ',')]
    variants: Vec<String>,
    /// Write the rows as JSON to this file (`-` for stdout) as well.
    #[arg(long)]
    json: Option<String>,
}

fn main() {
    kiln::devices::quiet_device_select();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Devices { json } => devices(json),
        Command::Bench {
            what: BenchWhat::Matmul(args),
        } => bench_matmul(args),
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

fn bench_matmul(args: MatmulArgs) -> Result<()> {
    let MatmulArgs {
        devices,
        dtypes,
        sizes,
        budget_ms,
        naive_up_to,
        no_f16,
        variants,
        json,
    } = args;
    use kiln::bench::{default_shapes, format_table, matmul_table, Shape};
    use kiln::engine::DType;
    use kiln::wgpu::{DeviceOptions, WgpuDevice};

    let options = DeviceOptions {
        disable_f16: no_f16,
    };
    let indices: Vec<usize> = if devices.is_empty() {
        kiln::wgpu::adapters().iter().map(|a| a.index).collect()
    } else {
        devices
            .iter()
            .map(|d| {
                let spec: kiln::DeviceSpec = d.parse()?;
                spec.adapter_index()?
                    .ok_or_else(|| anyhow::anyhow!("`cpu` is the reference, not a benchmarked device; it is measured as `cpu GFLOP/s` in every row"))
            })
            .collect::<Result<_>>()?
    };
    if indices.is_empty() {
        anyhow::bail!("no GPU adapter found. {}", kiln::wgpu::NO_ADAPTER_HINT);
    }
    let devs = indices
        .iter()
        .map(|&i| WgpuDevice::open(i, &options))
        .collect::<Result<Vec<_>, _>>()?;
    let dtypes = dtypes
        .iter()
        .map(|d| d.parse::<DType>())
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(bad) = dtypes.iter().find(|d| !d.is_float()) {
        anyhow::bail!("matmul takes f32, f16 or bf16, not {bad}");
    }
    let extra = variants
        .iter()
        .map(|v| v.parse::<kiln::wgpu::MatmulVariant>())
        .collect::<Result<Vec<_>, _>>()?;
    let shapes = if sizes.is_empty() {
        default_shapes()
    } else {
        sizes.into_iter().map(Shape::square).collect()
    };
    eprintln!(
        "kiln bench matmul: {} device(s), {} dtype(s), {} shape(s); CPU reference: matrixmultiply sgemm, {} threads",
        devs.len(),
        dtypes.len(),
        shapes.len(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let rows = matmul_table(
        &devs,
        &dtypes,
        &shapes,
        std::time::Duration::from_millis(budget_ms),
        naive_up_to,
        &extra,
        |r| {
            eprintln!(
                "  {} {} {}x{}x{} {} {}: {:.2} GFLOP/s (cpu {:.1}, ratio {:.3})",
                r.backend, r.dtype, r.m, r.n, r.k, r.op, r.variant, r.gflops, r.cpu_gflops, r.ratio
            )
        },
    )?;
    println!("{}", format_table(&rows));
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&rows)?;
        if path == "-" {
            println!("{text}");
        } else {
            std::fs::write(&path, text).with_context(|| format!("writing {path}"))?;
        }
    }
    Ok(())
}
