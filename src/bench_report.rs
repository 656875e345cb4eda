//! `kiln bench report`: every adapter and backend on this host measured on the same
//! work — GEMM at GPT shapes and squares in f32/f16/bf16, fused attention forward +
//! backward, training steps — each beside the adapter's measured peak, written as
//! `report.md`, `report.json` and `report.svg` side by side, with the host, the drivers
//! and Kiln's commit. What could not be measured is listed with the reason, never
//! left out silently.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::bench::{attention_table, cpu_sgemm_gflops, device_gflops, Shape};
use crate::bench_train::{bench_model, TrainBenchOptions, Variant};
use crate::engine::{Capabilities, DType, Device};
use crate::wgpu::{DeviceOptions, WgpuDevice};
use crate::DeviceSpec;

/// Kiln's commit as built (`git rev-parse --short HEAD`, `+dirty` with uncommitted
/// changes), or `unknown` outside a git checkout.
pub const COMMIT: &str = env!("KILN_COMMIT");

/// What `kiln bench report` measures.
pub struct ReportOptions {
    /// Device specs (`kiln devices`); empty: every wgpu adapter, every `vk:N` and the
    /// CPU reference.
    pub devices: Vec<String>,
    /// Time each measurement for about this long.
    pub budget: Duration,
    /// Small shapes, one short sequence and one model (the CI check).
    pub quick: bool,
    /// Models trained a few steps each (`kiln bench train` names).
    pub models: Vec<String>,
    /// Where report.md, report.json and report.svg go.
    pub out: PathBuf,
    /// The command line, written into the report.
    pub command: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Host {
    pub cpu: String,
    pub os: String,
    pub kiln_version: String,
    pub kiln_commit: String,
    pub command: String,
    /// Seconds since the Unix epoch when the report was started.
    pub started: u64,
    pub seconds: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct DeviceEntry {
    pub spec: String,
    pub name: String,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
    /// Native f16 arithmetic (else f16 stored, computed in f32: the packed path).
    pub f16: bool,
    pub memory_heap: Option<u64>,
    /// f32 FMA GFLOP/s and copy GB/s (`kiln bench peak`), where measurable (wgpu
    /// adapters; a `vk:N` takes the wgpu Vulkan adapter of the same name's).
    pub peak_gflops: Option<f64>,
    pub peak_gbps: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct GemmEntry {
    pub spec: String,
    pub shape: String,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub op: String,
    pub dtype: String,
    pub gflops: f64,
    /// gflops ÷ the device's f32 FMA peak.
    pub pct_of_peak: Option<f64>,
    /// gflops ÷ this host's CPU sgemm on the same shape, same run.
    pub vs_cpu_sgemm: f64,
    /// The kernel the planner ran.
    pub kernel: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct AttentionEntry {
    pub spec: String,
    pub dtype: String,
    /// Batch × heads.
    pub heads: usize,
    pub seq: usize,
    pub dim: usize,
    /// Forward + backward of the fused kernels.
    pub fused_ms: f64,
    /// Causal forward 2·T²·D and backward 5·T²·D per head (the score and
    /// probability products of each, the masked half not counted), ÷ fused_ms.
    pub gflops: f64,
    pub pct_of_peak: Option<f64>,
    /// The same through GEMMs and a T × T score matrix, where it fits a binding.
    pub straight_ms: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct TrainEntry {
    pub spec: String,
    pub model: String,
    pub parameters: usize,
    pub precision: String,
    pub micro_batch: usize,
    pub seq: usize,
    pub first_step_s: f64,
    pub step_ms: f64,
    pub tokens_per_s: f64,
    pub achieved_gflops: f64,
    pub mfu: Option<f64>,
    pub memory_bytes: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub host: Host,
    pub devices: Vec<DeviceEntry>,
    /// This host's CPU sgemm per GEMM shape (the reference of `vs_cpu_sgemm`).
    pub cpu_sgemm: Vec<(String, f64)>,
    pub gemm: Vec<GemmEntry>,
    pub attention: Vec<AttentionEntry>,
    pub train: Vec<TrainEntry>,
    /// What could not be measured, and why.
    pub not_measured: Vec<String>,
}

/// The GEMM shapes: a GPT-2 small MLP layer's three products at 1024 tokens and the
/// squares 1024³ and 2048³; quick: the same kinds at a quarter of the size.
pub fn gemm_shapes(quick: bool) -> Vec<Shape> {
    let q = if quick { 4 } else { 1 };
    let shape = |m: usize, n: usize, k: usize, trans: (bool, bool), label| Shape {
        m: m / q,
        n: n / q,
        k: k / q,
        trans_a: trans.0,
        trans_b: trans.1,
        label,
    };
    let mut v = vec![
        shape(1024, 3072, 768, (false, false), "gpt fc fwd"),
        shape(1024, 768, 3072, (false, true), "gpt fc dX"),
        shape(768, 3072, 1024, (true, false), "gpt fc dW"),
        shape(1024, 1024, 1024, (false, false), "square"),
    ];
    if !quick {
        v.push(Shape::square(2048));
    }
    v
}

/// (batch × heads, head dim, sequence lengths) of the attention section.
pub fn attention_shapes(quick: bool) -> (usize, usize, Vec<usize>) {
    match quick {
        true => (2, 32, vec![64]),
        false => (12, 64, vec![512, 1024, 2048]),
    }
}

/// A device under measurement, kept typed: a wgpu adapter's peak and GEMM block
/// selection, and vk's kernel route, are asked of the backend itself.
enum Opened {
    Wgpu(Box<WgpuDevice>),
    Vk(Box<crate::vulkan::VkDevice>),
    Cpu(Box<dyn Device>),
}

impl Opened {
    fn dev(&self) -> &dyn Device {
        match self {
            Opened::Wgpu(d) => d.as_ref(),
            Opened::Vk(d) => d.as_ref(),
            Opened::Cpu(d) => d.as_ref(),
        }
    }

    /// One GEMM's GFLOP/s as training runs it, and the kernel that ran: the block
    /// measured at the shape's first use on a wgpu adapter, the SPIR-V or naga route
    /// on vk, the reference loop on the CPU backend.
    fn gemm(&self, s: &Shape, dtype: DType, budget: Duration) -> Result<(f64, String)> {
        match self {
            Opened::Wgpu(d) => crate::bench::selected_gflops(d, s, dtype, budget),
            Opened::Vk(d) => crate::bench::vk_gflops(d, s, dtype, None, budget),
            Opened::Cpu(d) => {
                device_gflops(d.as_ref(), s, dtype, budget).map(|(g, _)| (g, "reference".into()))
            }
        }
    }
}

/// Every device the report measures, with its spec as `kiln devices` writes it; one
/// that does not open is listed in `failed` with the reason.
fn open_all(specs: &[String], failed: &mut Vec<String>) -> Result<Vec<(String, Opened)>> {
    let options = DeviceOptions::default();
    let specs: Vec<DeviceSpec> = if specs.is_empty() {
        let mut all: Vec<DeviceSpec> = crate::wgpu::adapters()
            .iter()
            .map(|a| DeviceSpec::Index(a.index))
            .collect();
        all.extend(
            crate::vulkan::physical_devices()
                .iter()
                .map(|d| DeviceSpec::Vk(d.index)),
        );
        all.push(DeviceSpec::Cpu);
        all
    } else {
        crate::devices::parse_devices(specs)?
    };
    let mut out = vec![];
    for spec in specs {
        let name = spec.to_string();
        let opened = match &spec {
            DeviceSpec::Vk(n) => {
                crate::vulkan::VkDevice::open(*n, &options).map(|d| Opened::Vk(Box::new(d)))
            }
            DeviceSpec::Cpu => crate::open_device(&spec, &options).map(Opened::Cpu),
            _ => spec.adapter_index().and_then(|i| {
                let i = i.expect("a wgpu spec names an adapter");
                WgpuDevice::open(i, &options).map(|d| Opened::Wgpu(Box::new(d)))
            }),
        };
        match opened {
            Ok(o) => out.push((name, o)),
            Err(e) => failed.push(format!("{name}: not opened ({e})")),
        }
    }
    if out.is_empty() {
        anyhow::bail!(
            "no device to measure{}. {}",
            match failed.is_empty() {
                true => String::new(),
                false => format!(" ({})", failed.join("; ")),
            },
            crate::wgpu::NO_ADAPTER_HINT
        );
    }
    Ok(out)
}

/// The peak of a wgpu adapter, measured now, and cached for `kiln train --profile`
/// (a cache that cannot be written is said in `notes`, the peak kept).
fn peak(dev: &WgpuDevice, notes: &mut Vec<String>) -> Result<crate::profile::PeakRecord> {
    let record = crate::profile::measure_peak(dev)?;
    if let Err(e) = crate::profile::store_peaks(std::slice::from_ref(&record)) {
        notes.push(format!(
            "{}: its peak was measured but not cached ({e:#})",
            record.adapter
        ));
    }
    Ok(record)
}

fn entry(spec: &str, caps: &Capabilities) -> DeviceEntry {
    DeviceEntry {
        spec: spec.into(),
        name: caps.name.clone(),
        backend: caps.backend.clone(),
        device_type: caps.device_type.clone(),
        driver: caps.driver.clone(),
        f16: caps.f16_arithmetic,
        memory_heap: caps.memory_heap,
        peak_gflops: None,
        peak_gbps: None,
    }
}

/// Measures everything `opts` names and writes the three files; returns the report.
/// `progress` hears each line as it is measured.
pub fn run(opts: &ReportOptions, mut progress: impl FnMut(&str)) -> Result<Report> {
    let started = std::time::Instant::now();
    if opts.budget.is_zero() {
        anyhow::bail!("--budget-ms 0: give each measurement at least 1 ms");
    }
    let models: Vec<_> = opts
        .models
        .iter()
        .map(|m| bench_model(m, None))
        .collect::<Result<_>>()?;
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("creating {}", opts.out.display()))?;
    let mut failed = vec![];
    let opened = open_all(&opts.devices, &mut failed)?;
    let mut report = Report {
        host: Host {
            cpu: crate::engine::fsutil::host_cpu(),
            os: os(),
            kiln_version: env!("CARGO_PKG_VERSION").into(),
            kiln_commit: COMMIT.into(),
            command: opts.command.clone(),
            started: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            seconds: 0.0,
        },
        devices: vec![],
        cpu_sgemm: vec![],
        gemm: vec![],
        attention: vec![],
        train: vec![],
        not_measured: failed,
    };

    // Peaks: wgpu adapters measured; a vk:N device is the wgpu Vulkan adapter of its
    // name (the same hardware and driver).
    for (spec, o) in &opened {
        let mut e = entry(spec, o.dev().caps());
        if let Opened::Wgpu(d) = o {
            match peak(d, &mut report.not_measured) {
                Ok(p) => {
                    e.peak_gflops = Some(p.gflops);
                    e.peak_gbps = Some(p.gbps);
                }
                Err(err) => report
                    .not_measured
                    .push(format!("{spec}: the peak ({err:#})")),
            }
        }
        report.devices.push(e);
    }
    for i in 0..report.devices.len() {
        if report.devices[i].backend == "vk" && report.devices[i].peak_gflops.is_none() {
            let twin = report
                .devices
                .iter()
                .find(|d| d.backend == "vulkan" && d.name == report.devices[i].name)
                .and_then(|d| d.peak_gflops.zip(d.peak_gbps));
            let twin = match twin {
                Some(t) => Ok(t),
                None => vulkan_twin_peak(&report.devices[i].name, &mut report.not_measured),
            };
            match twin {
                Ok((g, b)) => {
                    report.devices[i].peak_gflops = Some(g);
                    report.devices[i].peak_gbps = Some(b);
                }
                Err(e) => {
                    let spec = report.devices[i].spec.clone();
                    report
                        .not_measured
                        .push(format!("{spec}: the peak ({e:#})"));
                }
            }
        }
    }
    for e in &report.devices {
        progress(&format!(
            "{}: {} ({}), peak {}",
            e.spec,
            e.name,
            e.backend,
            e.peak_gflops.map_or("not measured".into(), |g| format!(
                "{g:.1} GFLOP/s{}",
                match e.backend.as_str() {
                    "vk" => " (its wgpu Vulkan twin's)",
                    _ => "",
                }
            ))
        ));
    }
    let peak_of = |spec: &str, devices: &[DeviceEntry]| {
        devices
            .iter()
            .find(|d| d.spec == spec)
            .and_then(|d| d.peak_gflops)
    };

    // GEMM.
    let dtypes = [DType::F32, DType::F16, DType::BF16];
    let shapes = gemm_shapes(opts.quick);
    for s in &shapes {
        let what = format!("{} {}x{}x{} {}", s.label, s.m, s.n, s.k, s.op());
        let cpu = cpu_sgemm_gflops(s, opts.budget).context("CPU sgemm reference")?;
        progress(&format!("gemm {what}: CPU sgemm {cpu:.1} GFLOP/s"));
        report.cpu_sgemm.push((what.clone(), cpu));
        for (spec, o) in &opened {
            for dtype in dtypes {
                match o.gemm(s, dtype, opts.budget) {
                    Ok((gflops, kernel)) => {
                        let peak = peak_of(spec, &report.devices);
                        progress(&format!(
                            "gemm {what} {dtype} on {spec}: {gflops:.1} GFLOP/s"
                        ));
                        report.gemm.push(GemmEntry {
                            spec: spec.clone(),
                            shape: s.label.into(),
                            m: s.m,
                            n: s.n,
                            k: s.k,
                            op: s.op().into(),
                            dtype: dtype.to_string(),
                            gflops,
                            pct_of_peak: peak.map(|p| 100.0 * gflops / p),
                            vs_cpu_sgemm: gflops / cpu,
                            kernel,
                        });
                    }
                    Err(e) => report
                        .not_measured
                        .push(format!("{spec}: GEMM {what} {dtype} ({e:#})")),
                }
            }
        }
    }

    // Fused attention, forward + backward, in the 16-bit type training stores.
    let (heads, dim, seqs) = attention_shapes(opts.quick);
    for (spec, o) in &opened {
        let dtype = DType::F16;
        for &seq in &seqs {
            match attention_table(o.dev(), dtype, heads, dim, &[seq], opts.budget, |_| {}) {
                Ok(rows) => {
                    for r in rows {
                        let flops = 7.0 * (r.seq * r.seq * r.dim * r.heads) as f64;
                        let gflops = flops / (r.fused_ms * 1e-3) / 1e9;
                        progress(&format!(
                            "attention T {} {dtype} on {spec}: {:.2} ms fwd+bwd",
                            r.seq, r.fused_ms
                        ));
                        report.attention.push(AttentionEntry {
                            spec: spec.clone(),
                            dtype: dtype.to_string(),
                            heads: r.heads,
                            seq: r.seq,
                            dim: r.dim,
                            fused_ms: r.fused_ms,
                            gflops,
                            pct_of_peak: peak_of(spec, &report.devices).map(|p| 100.0 * gflops / p),
                            straight_ms: r.straight_ms,
                        });
                    }
                }
                Err(e) => report
                    .not_measured
                    .push(format!("{spec}: attention T {seq} {dtype} ({e:#})")),
            }
        }
    }

    // Training steps, fp16 with fp32 master weights.
    let precision = "fp16";
    for model in &models {
        for (spec, o) in &opened {
            let train = TrainBenchOptions {
                variant: Variant {
                    lora: false,
                    checkpointing: false,
                },
                lora: crate::engine::models::lora::LoraConfig::parse_flag("r=16,alpha=32")?,
                steps: if opts.quick { 1 } else { 3 },
                gemm_budget: opts.budget,
                peak_tflops: peak_of(spec, &report.devices).map(|g| g / 1000.0),
            };
            match crate::bench_train::measure(o.dev(), model, precision, &train) {
                Ok(r) => {
                    progress(&format!(
                        "train {} {precision} on {spec}: {:.0} tokens/s",
                        r.model, r.tokens_per_s
                    ));
                    report.train.push(TrainEntry {
                        spec: spec.clone(),
                        model: r.model,
                        parameters: r.parameters,
                        precision: precision.into(),
                        micro_batch: r.micro_batch,
                        seq: r.seq,
                        first_step_s: r.first_step_s,
                        step_ms: r.step_ms,
                        tokens_per_s: r.tokens_per_s,
                        achieved_gflops: r.achieved_gflops,
                        mfu: r.mfu,
                        memory_bytes: r.memory_bytes,
                    });
                }
                Err(e) => report.not_measured.push(format!(
                    "{spec}: training {} {precision} ({e:#})",
                    model.name
                )),
            }
        }
    }

    report.host.seconds = started.elapsed().as_secs_f64();
    write(&report, &opts.out)?;
    Ok(report)
}

/// The peak of the wgpu Vulkan adapter named `name` (a `vk:N` device's hardware and
/// driver), from the cache or measured.
fn vulkan_twin_peak(name: &str, notes: &mut Vec<String>) -> Result<(f64, f64)> {
    let a = crate::wgpu::adapters()
        .into_iter()
        .find(|a| a.caps.backend == "vulkan" && a.caps.name == name)
        .ok_or_else(|| anyhow::anyhow!("no wgpu Vulkan adapter named `{name}` to measure it on"))?;
    if let Some(p) = crate::profile::cached_peak(&a.caps) {
        return Ok((p.gflops, p.gbps));
    }
    let dev = WgpuDevice::open(a.index, &DeviceOptions::default())?;
    let p = peak(&dev, notes)?;
    Ok((p.gflops, p.gbps))
}

fn os() -> String {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let pretty = std::fs::read_to_string("/etc/os-release")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map(|v| v.trim_matches('"').to_string());
    match (pretty, release.trim()) {
        (Some(p), r) if !r.is_empty() => format!("{p}, Linux {r}"),
        (Some(p), _) => p,
        (None, _) => format!("{} {}", std::env::consts::OS, std::env::consts::ARCH),
    }
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("—".into(), |v| format!("{v:.digits$}"))
}

/// The Markdown of `report`: one table per section, the host and command first.
pub fn markdown(r: &Report) -> String {
    let mut s = String::new();
    let h = &r.host;
    let _ = writeln!(s, "# Kiln bench report\n");
    let _ = writeln!(s, "## Host\n");
    let _ = writeln!(
        s,
        "- CPU: {}\n- OS: {}\n- Kiln {} (commit {})\n- Command: `{}`\n- Took {:.0} s\n",
        h.cpu, h.os, h.kiln_version, h.kiln_commit, h.command, h.seconds
    );
    let _ = writeln!(s, "## Devices\n");
    let _ = writeln!(
        s,
        "| spec | name | backend | type | driver | f16 | memory heap | peak f32 GFLOP/s | peak copy GB/s |\n|---|---|---|---|---|---|---|---|---|"
    );
    for d in &r.devices {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            d.spec,
            d.name,
            d.backend,
            d.device_type,
            if d.driver.is_empty() {
                "—"
            } else {
                &d.driver
            },
            if d.f16 { "native" } else { "packed" },
            d.memory_heap.map_or("—".into(), |b| format!(
                "{:.1} GiB",
                b as f64 / (1u64 << 30) as f64
            )),
            opt(d.peak_gflops, 1),
            opt(d.peak_gbps, 1)
        );
    }
    let _ = writeln!(s, "\n## GEMM\n");
    let _ = writeln!(
        s,
        "GFLOP/s of one product end to end per launch, as training launches it; % of the \
         device's f32 FMA peak (16-bit products on matrix units can pass 100 %); × this \
         host's CPU sgemm on the same shape in the same run ({}). The CPU reference backend \
         has no peak measure.\n",
        r.cpu_sgemm
            .iter()
            .map(|(w, g)| format!("{w}: {g:.1} GFLOP/s"))
            .collect::<Vec<_>>()
            .join("; ")
    );
    let _ = writeln!(
        s,
        "| device | shape | m×n×k | op | dtype | GFLOP/s | % of peak | × CPU sgemm | kernel |\n|---|---|---|---|---|---|---|---|---|"
    );
    for g in &r.gemm {
        let _ = writeln!(
            s,
            "| {} | {} | {}×{}×{} | {} | {} | {:.1} | {} | {:.2} | {} |",
            g.spec,
            g.shape,
            g.m,
            g.n,
            g.k,
            g.op,
            g.dtype,
            g.gflops,
            opt(g.pct_of_peak, 1),
            g.vs_cpu_sgemm,
            g.kernel
        );
    }
    let _ = writeln!(s, "\n## Attention\n");
    let _ = writeln!(
        s,
        "Causal fused attention, forward + backward; GFLOP/s count 7·T²·D per head (forward \
         2, backward 5; the masked half not counted). `straight`: the same through GEMMs and \
         a T × T score matrix (— where it is over the per-binding limit).\n"
    );
    let _ = writeln!(
        s,
        "| device | dtype | B×H | T | D | fused ms | GFLOP/s | % of peak | straight ms |\n|---|---|---|---|---|---|---|---|---|"
    );
    for a in &r.attention {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {:.2} | {:.1} | {} | {} |",
            a.spec,
            a.dtype,
            a.heads,
            a.seq,
            a.dim,
            a.fused_ms,
            a.gflops,
            opt(a.pct_of_peak, 1),
            opt(a.straight_ms, 2)
        );
    }
    let _ = writeln!(s, "\n## Training\n");
    let _ = writeln!(
        s,
        "| device | model | parameters | precision | micro-batch × T | first step s | step ms | tokens/s | GFLOP/s | MFU | memory MiB |\n|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for t in &r.train {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} × {} | {:.1} | {:.1} | {:.0} | {:.1} | {} | {:.1} |",
            t.spec,
            t.model,
            t.parameters,
            t.precision,
            t.micro_batch,
            t.seq,
            t.first_step_s,
            t.step_ms,
            t.tokens_per_s,
            t.achieved_gflops,
            t.mfu.map_or("—".into(), |m| format!("{:.1} %", 100.0 * m)),
            t.memory_bytes as f64 / (1u64 << 20) as f64
        );
    }
    let _ = writeln!(s, "\n## Not measured\n");
    if r.not_measured.is_empty() {
        let _ = writeln!(s, "Everything named above was measured.");
    }
    for n in &r.not_measured {
        let _ = writeln!(s, "- {n}");
    }
    let _ = writeln!(s, "\nChart: report.svg; every number: report.json.");
    s
}

/// The chart: GEMM GFLOP/s of every device and dtype at the largest square measured,
/// one bar each, with its % of peak.
pub fn svg(r: &Report) -> Result<String> {
    use plotters::prelude::*;
    let side = r
        .gemm
        .iter()
        .filter(|g| g.shape == "square")
        .map(|g| g.m)
        .max();
    let bars: Vec<&GemmEntry> = r
        .gemm
        .iter()
        .filter(|g| g.shape == "square" && Some(g.m) == side)
        .collect();
    let (w, row) = (960u32, 28u32);
    let h = 80 + row * bars.len().max(1) as u32;
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
        let title = match side {
            Some(n) => format!("GEMM {n}×{n}×{n}, GFLOP/s (Kiln {})", r.host.kiln_commit),
            None => "GEMM: nothing measured".into(),
        };
        let font = ("sans-serif", 18).into_font();
        root.draw(&Text::new(title, (20, 20), font))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let most = bars.iter().map(|g| g.gflops).fold(0.0, f64::max).max(1e-9);
        let (left, right) = (330i32, w as i32 - 140);
        let label = ("sans-serif", 13).into_font();
        let palette = [
            RGBColor(66, 133, 244),
            RGBColor(219, 68, 55),
            RGBColor(15, 157, 88),
        ];
        for (i, g) in bars.iter().enumerate() {
            let y = 60 + (i as u32 * row) as i32;
            let len = ((right - left) as f64 * g.gflops / most).round() as i32;
            let color = match g.dtype.as_str() {
                "f32" => palette[0],
                "f16" => palette[1],
                _ => palette[2],
            };
            let name = r
                .devices
                .iter()
                .find(|d| d.spec == g.spec)
                .map_or(g.spec.clone(), |d| {
                    format!("{} {} ({})", d.spec, d.backend, g.dtype)
                });
            root.draw(&Text::new(name, (20, y + 4), label.clone()))
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            root.draw(&Rectangle::new(
                [(left, y), (left + len.max(1), y + row as i32 - 8)],
                color.filled(),
            ))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
            let value = match g.pct_of_peak {
                Some(p) => format!("{:.1} ({p:.0} % of peak)", g.gflops),
                None => format!("{:.1}", g.gflops),
            };
            root.draw(&Text::new(value, (left + len + 6, y + 4), label.clone()))
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    Ok(out)
}

/// Writes report.md, report.json and report.svg into `dir`, each whole or not at all.
pub fn write(r: &Report, dir: &Path) -> Result<()> {
    let files = [
        ("report.md", markdown(r)),
        ("report.json", serde_json::to_string_pretty(r)?),
        ("report.svg", svg(r)?),
    ];
    for (name, text) in files {
        let path = dir.join(name);
        crate::engine::fsutil::replace_file(&path, text.as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
