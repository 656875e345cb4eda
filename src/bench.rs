//! `kiln bench matmul`: GEMM throughput per adapter, dtype and shape, with a CPU sgemm
//! reference and the naive kernel measured in the same run.

use kiln_engine::kernels::{self, AttentionBackward, Softmax, SoftmaxBackward};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;

use crate::engine::models::{host_memory_available, MAX_TENSOR_ELEMENTS};
use crate::engine::{Buffer, Capabilities, DType, Device, HostData, Kernel, Matmul};
use crate::wgpu::{MatmulVariant, SpirvGemm, SpirvMatmul, SpirvTile, WgpuDevice};

/// One GEMM shape: `C(m×n) = op(A)·op(B)` with op given by the transposes.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub label: &'static str,
}

impl Shape {
    pub const fn square(s: usize) -> Shape {
        Shape {
            m: s,
            n: s,
            k: s,
            trans_a: false,
            trans_b: false,
            label: "square",
        }
    }

    /// Elements of A, B and C.
    fn operands(&self) -> [usize; 3] {
        // Checked by `check` before any other use.
        [
            self.m.saturating_mul(self.k),
            self.k.saturating_mul(self.n),
            self.m.saturating_mul(self.n),
        ]
    }

    /// Refuses, before anything is allocated, a shape that cannot run: a zero
    /// dimension (no work: the rates would be NaN), an operand over what a kernel
    /// indexes or over an adapter's largest buffer in the widest of `dtypes`, or more
    /// host memory than is available (`host_available`) for the CPU reference, the
    /// uploads, and the buffers of CPU adapters, which live in host memory.
    pub fn check(
        &self,
        devices: &[&Capabilities],
        dtypes: &[DType],
        host_available: Option<u64>,
    ) -> Result<()> {
        let dims = format!("{}x{}x{}", self.m, self.n, self.k);
        if self.m == 0 || self.n == 0 || self.k == 0 {
            anyhow::bail!(
                "matmul {dims}: every dimension must be at least 1 (a product of nothing has \
                 no rate to measure)"
            );
        }
        let sizes = [
            self.m.checked_mul(self.k),
            self.k.checked_mul(self.n),
            self.m.checked_mul(self.n),
        ];
        let largest = sizes
            .iter()
            .map(|n| n.unwrap_or(usize::MAX))
            .max()
            .unwrap_or(0);
        if largest > MAX_TENSOR_ELEMENTS {
            anyhow::bail!(
                "matmul {dims}: an operand of {largest} elements is over the \
                 {MAX_TENSOR_ELEMENTS} a kernel indexes; use smaller sizes"
            );
        }
        let width = dtypes.iter().map(|d| d.size()).max().unwrap_or(4) as u64;
        let bytes = |n: usize| n as u64 * width;
        for caps in devices {
            if bytes(largest) > caps.max_buffer {
                anyhow::bail!(
                    "matmul {dims}: an operand of {} MiB is over `{}`'s largest buffer of {} \
                     MiB; use smaller sizes",
                    bytes(largest) >> 20,
                    caps.name,
                    caps.max_buffer >> 20
                );
            }
        }
        let [a, b, c] = self.operands();
        // The CPU reference holds A, B and C in f32; a GPU row holds its operands on a
        // CPU adapter, plus the f32 fill of the largest input and its rounded copy.
        let reference = 4 * (a + b + c) as u64;
        let on_host = devices.iter().filter(|c| c.device_type == "cpu").count() as u64;
        let gpu = on_host.min(1) * bytes(a + b + c) + 8 * a.max(b) as u64;
        let need = reference.max(gpu);
        if let Some(avail) = host_available.filter(|&h| need > h) {
            anyhow::bail!(
                "matmul {dims}: needs {} MiB of host memory (the CPU reference's f32 operands, \
                 or the uploads and a CPU adapter's buffers), over the {} MiB available; use \
                 smaller sizes",
                need >> 20,
                avail >> 20
            );
        }
        Ok(())
    }

    pub fn op(&self) -> &'static str {
        match (self.trans_a, self.trans_b) {
            (false, false) => "NN",
            (false, true) => "NT",
            (true, false) => "TN",
            (true, true) => "TT",
        }
    }
}

/// Square sizes, then the three products of a GPT-2 small MLP layer at B·T = 1024
/// tokens, C = 768: forward (NN), input gradient (NT), weight gradient (TN).
pub fn default_shapes() -> Vec<Shape> {
    let mut v: Vec<Shape> = [256, 512, 1024, 2048]
        .into_iter()
        .map(Shape::square)
        .collect();
    v.push(Shape {
        m: 1024,
        n: 3072,
        k: 768,
        trans_a: false,
        trans_b: false,
        label: "gpt fc fwd",
    });
    v.push(Shape {
        m: 1024,
        n: 768,
        k: 3072,
        trans_a: false,
        trans_b: true,
        label: "gpt fc dX",
    });
    v.push(Shape {
        m: 768,
        n: 3072,
        k: 1024,
        trans_a: true,
        trans_b: false,
        label: "gpt fc dW",
    });
    v
}

#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub adapter: String,
    pub backend: String,
    pub dtype: String,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub op: String,
    pub shape: String,
    pub variant: String,
    pub ms: f64,
    pub gflops: f64,
    pub cpu_gflops: f64,
    /// gflops / cpu_gflops.
    pub ratio: f64,
}

/// Runs `warm_up` until every pipeline queued since `before` (a
/// `compiling::snapshot()` taken before the work was built) is built and has run, and a
/// run has started no new build, at least once and for at most 300 s, saying so (as
/// `what`) when the bound is hit. A
/// plan compiles its pipelines ahead of its first run, and on a software driver its big
/// GEMM blocks build in the background behind smaller stand-ins (`Device::prepare`),
/// counted done at their first run: timing before that measures the stand-ins while a
/// build takes a core.
pub(crate) fn warm_until_built<E>(
    what: &str,
    before: (usize, usize),
    mut warm_up: impl FnMut() -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let building = || {
        let (done, queued) = crate::engine::device::compiling::snapshot();
        done - before.0 < queued - before.1
    };
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        // Done once a run starts no build (a launch may ask for one: the measured
        // selection's candidates) and none is left.
        let queued = crate::engine::device::compiling::snapshot().1;
        warm_up()?;
        if !building() && crate::engine::device::compiling::snapshot().1 == queued {
            return Ok(());
        }
        if Instant::now() > deadline {
            eprintln!(
                "{what}: pipelines still building after 300 s of warm-up; measuring anyway \
                 (the figures may be low)"
            );
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Runs `f` once to warm up, then until `budget` has passed (at least `min_reps`
/// times); returns the mean seconds per run.
pub(crate) fn time_it(
    budget: Duration,
    min_reps: u32,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    f()?;
    let start = Instant::now();
    let mut reps = 0;
    while reps < min_reps || start.elapsed() < budget {
        f()?;
        reps += 1;
    }
    Ok(start.elapsed().as_secs_f64() / reps as f64)
}

/// CPU sgemm (matrixmultiply, all cores) on the same shape, in GFLOP/s.
pub fn cpu_sgemm_gflops(s: &Shape, budget: Duration) -> Result<f64> {
    let a = vec![0.5f32; s.m * s.k];
    let b = vec![0.25f32; s.k * s.n];
    let mut c = vec![0f32; s.m * s.n];
    // Row-major strides, transposes expressed as swapped strides.
    let (rsa, csa) = if s.trans_a {
        (1, s.m as isize)
    } else {
        (s.k as isize, 1)
    };
    let (rsb, csb) = if s.trans_b {
        (1, s.k as isize)
    } else {
        (s.n as isize, 1)
    };
    let secs = time_it(budget, 2, || {
        // SAFETY: the pointers cover m*k, k*n and m*n elements with the strides above.
        unsafe {
            matrixmultiply::sgemm(
                s.m,
                s.k,
                s.n,
                1.0,
                a.as_ptr(),
                rsa,
                csa,
                b.as_ptr(),
                rsb,
                csb,
                0.0,
                c.as_mut_ptr(),
                s.n as isize,
                1,
            );
        }
        Ok(())
    })?;
    Ok(2.0 * s.m as f64 * s.n as f64 * s.k as f64 / secs / 1e9)
}

/// A, B and C of shape `s` on `dev` (A and B filled with small exact values), as the
/// product to time; free them with `mm.buffers()`.
fn operands(dev: &dyn Device, s: &Shape, dtype: DType) -> Result<Matmul> {
    let fill = |len: usize| {
        let v: Vec<f32> = (0..len).map(|i| ((i % 17) as f32 - 8.0) / 16.0).collect();
        HostData::from_f32(dtype, &v)
    };
    let a = dev.alloc(dtype, s.m * s.k)?;
    let b = dev.alloc(dtype, s.k * s.n)?;
    let c = dev.alloc(dtype, s.m * s.n)?;
    dev.upload(a, &fill(s.m * s.k))?;
    dev.upload(b, &fill(s.k * s.n))?;
    Ok(Matmul::new(a, b, c, s.m, s.n, s.k).transpose(s.trans_a, s.trans_b))
}

/// Times one GEMM on `dev`, end to end per launch (record, submit, wait).
pub fn gpu_gflops(
    dev: &WgpuDevice,
    s: &Shape,
    dtype: DType,
    variant: Option<MatmulVariant>,
    budget: Duration,
) -> Result<(f64, String)> {
    let mm = operands(dev, s, dtype)?;
    let mut name = String::new();
    let secs = time_it(budget, 2, || {
        let plan = dev.launch_matmul(&mm, variant)?;
        name = plan.variant.name();
        if plan.splits > 1 {
            name += &format!("/k{}", plan.splits);
        }
        dev.submit()?;
        dev.wait()?;
        Ok(())
    });
    for buf in mm.buffers() {
        dev.free(buf)?;
    }
    Ok((mm.flops() / secs? / 1e9, name))
}

/// Times the SPIR-V GEMM the same way as [`gpu_gflops`]: one product per submission,
/// waited for.
pub fn spirv_gflops(
    gemm: &SpirvMatmul,
    s: &Shape,
    dtype: DType,
    budget: Duration,
) -> Result<(f64, String)> {
    let g = SpirvGemm {
        batch: 1,
        m: s.m,
        n: s.n,
        k: s.k,
        trans_a: s.trans_a,
        trans_b: s.trans_b,
        alpha: 1.0,
        beta: 0.0,
        tile: SpirvTile::for_shape(1, s.m, s.n, s.k),
    };
    let secs = gemm.time(&g, dtype, budget)?;
    Ok((g.flops() / secs / 1e9, g.tile.name()))
}

/// What [`matmul_table`] runs beside the planner's choice.
pub struct Runs<'a> {
    /// The naive kernel, on shapes up to this size.
    pub naive_up_to: usize,
    /// These WGSL variants.
    pub extra: &'a [MatmulVariant],
    /// The SPIR-V GEMM on the adapters named (Vulkan ones; f32 and f16).
    pub spirv: &'a [(String, SpirvMatmul)],
    /// The raw Vulkan backend's devices (`vk:N`), timed through the `Device` trait:
    /// the planner's kernel and each of `extra` pinned, run as the hand-written SPIR-V
    /// GEMMs where vk's route gives them that (the row's variant then reads
    /// `spirv <kernel>`, `spirv <kernel> texel` where A and B were read as texels,
    /// which is followed by the same kernel's row with storage loads).
    pub vk: &'a [crate::vulkan::VkDevice],
}

/// The whole table for `devices` × `dtypes` × `shapes`; `naive_up_to` bounds the
/// sizes the (slow) baseline kernel runs on.
pub fn matmul_table(
    devices: &[WgpuDevice],
    dtypes: &[DType],
    shapes: &[Shape],
    budget: Duration,
    runs: &Runs,
    mut progress: impl FnMut(&Row),
) -> Result<Vec<Row>> {
    let Runs {
        naive_up_to,
        extra,
        spirv,
        vk,
    } = runs;
    let naive_up_to = *naive_up_to;
    let caps: Vec<&Capabilities> = devices
        .iter()
        .map(|d| d.caps())
        .chain(vk.iter().map(|d| d.caps()))
        .collect();
    let host = host_memory_available();
    for s in shapes {
        s.check(&caps, dtypes, host)?;
    }
    let mut rows = vec![];
    for s in shapes {
        let cpu = cpu_sgemm_gflops(s, budget).context("CPU sgemm reference")?;
        for dev in devices {
            let caps = dev.caps().clone();
            for &dtype in dtypes {
                let mut variants = vec![None];
                variants.extend(extra.iter().copied().map(Some));
                if s.m.max(s.n).max(s.k) <= naive_up_to {
                    variants.push(Some(MatmulVariant::Naive));
                }
                let mut runs: Vec<Option<Option<MatmulVariant>>> =
                    variants.into_iter().map(Some).collect();
                // The SPIR-V GEMM on this adapter, where it stores this dtype.
                let twin = spirv.iter().find(|(name, _)| *name == caps.name);
                if twin.is_some() && matches!(dtype, DType::F32 | DType::F16) {
                    runs.push(None);
                }
                for run in runs {
                    let (gflops, variant) = match (run, twin) {
                        (Some(v), _) => gpu_gflops(dev, s, dtype, v, budget),
                        (None, Some((_, gemm))) => spirv_gflops(gemm, s, dtype, budget),
                        (None, None) => unreachable!("SPIR-V runs only where a twin exists"),
                    }
                    .with_context(|| format!("{} {dtype} {}x{}x{}", caps.name, s.m, s.n, s.k))?;
                    let row = Row::new(&caps, dtype, s, variant, gflops, cpu);
                    progress(&row);
                    rows.push(row);
                }
                // What training runs, beside the table's pick.
                let (gflops, variant) = selected_gflops(dev, s, dtype, budget)
                    .with_context(|| format!("{} {dtype} {}x{}x{}", caps.name, s.m, s.n, s.k))?;
                let row = Row::new(&caps, dtype, s, variant, gflops, cpu);
                progress(&row);
                rows.push(row);
            }
        }
        for dev in vk.iter() {
            let caps = dev.caps().clone();
            for &dtype in dtypes {
                for pin in std::iter::once(None).chain(extra.iter().copied().map(Some)) {
                    let (gflops, variant) =
                        vk_gflops(dev, s, dtype, pin, budget).with_context(|| {
                            format!("{} {dtype} {}x{}x{}", caps.name, s.m, s.n, s.k)
                        })?;
                    let texel = variant.ends_with(" texel");
                    let row = Row::new(&caps, dtype, s, variant, gflops, cpu);
                    progress(&row);
                    rows.push(row);
                    // The same kernel with storage loads, where it read A and B as
                    // texels: what the texel views are worth on this host.
                    if texel {
                        dev.use_texel_gemm(false);
                        let timed = vk_gflops(dev, s, dtype, pin, budget);
                        dev.use_texel_gemm(true);
                        let (gflops, variant) = timed.with_context(|| {
                            format!("{} {dtype} {}x{}x{}", caps.name, s.m, s.n, s.k)
                        })?;
                        let row = Row::new(&caps, dtype, s, variant, gflops, cpu);
                        progress(&row);
                        rows.push(row);
                    }
                }
            }
        }
    }
    Ok(rows)
}

impl Row {
    fn new(
        caps: &Capabilities,
        dtype: DType,
        s: &Shape,
        variant: String,
        gflops: f64,
        cpu: f64,
    ) -> Row {
        Row {
            adapter: caps.name.clone(),
            backend: caps.backend.clone(),
            dtype: dtype.to_string(),
            m: s.m,
            n: s.n,
            k: s.k,
            op: s.op().into(),
            shape: s.label.into(),
            variant,
            ms: 2.0 * s.m as f64 * s.n as f64 * s.k as f64 / gflops / 1e6,
            gflops,
            cpu_gflops: cpu,
            ratio: gflops / cpu,
        }
    }
}

/// Times one GEMM on any device through the `Device` trait (the planner's kernel),
/// end to end per launch as [`gpu_gflops`] does, once every pipeline its launches
/// started building is built; the variant is the planner's choice for these
/// capabilities.
pub fn device_gflops(
    dev: &dyn Device,
    s: &Shape,
    dtype: DType,
    budget: Duration,
) -> Result<(f64, String)> {
    let before = crate::engine::device::compiling::snapshot();
    let mm = operands(dev, s, dtype)?;
    let plan = crate::wgpu::plan_matmul(&mm, dev.caps(), None)?;
    let kernel = Kernel::Matmul(mm.clone());
    let run = || -> Result<()> {
        dev.launch(&kernel)?;
        dev.submit()?;
        dev.wait()?;
        Ok(())
    };
    // A big block that builds in the background (vk's primer) is timed, not the
    // stand-in that runs meanwhile.
    let what = format!("{} {dtype} {}x{}x{}", dev.caps().name, s.m, s.n, s.k);
    let secs = warm_until_built(&what, before, run).and_then(|()| time_it(budget, 2, run));
    for buf in mm.buffers() {
        dev.free(buf)?;
    }
    Ok((mm.flops() / secs? / 1e9, plan.variant.name()))
}

/// [`device_gflops`] on a wgpu device: the product goes through `Kernel::Matmul` as in
/// training, so on a CPU-class adapter the block is the one measured at the shape's
/// first launch, not the table's. The variant reads `selected <block>`, or `table
/// <block> (why)` where nothing was measured.
pub(crate) fn selected_gflops(
    dev: &WgpuDevice,
    s: &Shape,
    dtype: DType,
    budget: Duration,
) -> Result<(f64, String)> {
    // The first launch times the candidates (and builds them); that is a one-off
    // cost, not a step's, so it runs, with any builds it starts, before the timing.
    let mm = operands(dev, s, dtype)?;
    let kernel = Kernel::Matmul(mm.clone());
    let primed = (|| -> Result<()> {
        for _ in 0..2 {
            dev.launch(&kernel)?;
            dev.submit()?;
            dev.wait()?;
            dev.wait_for_builds();
        }
        Ok(())
    })();
    let selected = dev.gemm_selected(&mm);
    for buf in mm.buffers() {
        dev.free(buf)?;
    }
    primed?;
    let (gflops, table) = device_gflops(dev, s, dtype, budget)?;
    let work = (s.m * s.n * s.k) as u64;
    let name = match selected {
        Some(v) => format!("selected {}", v.name()),
        None if !dev.gemm_selection_on() => format!("table {table} (--no-tune)"),
        None if work < crate::wgpu::gemm_select::MIN_WORK => {
            format!("table {table} (too small to measure)")
        }
        None => format!("table {table} (not measured: no built rival, or budget spent)"),
    };
    Ok((gflops, name))
}

/// [`device_gflops`] on a `vk:N` device, the variant named `spirv <kernel>` where the
/// product runs as a hand-written SPIR-V GEMM (as the wgpu passthrough's rows are),
/// and `coopmat <tile>` where it runs on the cooperative-matrix GEMM. With `pin`, the
/// SPIR-V route runs that kernel instead of the planner's (the naga path keeps the
/// planner's, and the row says so).
pub(crate) fn vk_gflops(
    dev: &crate::vulkan::VkDevice,
    s: &Shape,
    dtype: DType,
    pin: Option<MatmulVariant>,
    budget: Duration,
) -> Result<(f64, String)> {
    let (spirv, _) = dev.gemm_launches();
    let coop = dev.coopmat_launches();
    let texel = dev.texel_gemm_launches();
    dev.force_gemm_variant(pin);
    let timed = device_gflops(dev, s, dtype, budget);
    dev.force_gemm_variant(None);
    let (gflops, planned) = timed?;
    // The block the measured selection picked for the shape, where it picked one.
    let shaped = |len| crate::engine::Buffer { id: 0, dtype, len };
    let probe = Matmul::new(
        shaped(s.m * s.k),
        shaped(s.k * s.n),
        shaped(s.m * s.n),
        s.m,
        s.n,
        s.k,
    )
    .transpose(s.trans_a, s.trans_b);
    let variant = match pin {
        Some(v) if dev.gemm_launches().0 > spirv => v.name(),
        Some(v) => format!("{planned} (pinned {} is not on the SPIR-V route)", v.name()),
        None => match dev.gemm_selected(&probe) {
            Some(w) => format!("selected {}", w.name()),
            None => planned,
        },
    };
    let ran_spirv = dev.gemm_launches().0 > spirv;
    let ran_coop = dev.coopmat_launches() > coop;
    let ran_texel = dev.texel_gemm_launches() > texel;
    Ok((
        gflops,
        match dev.cooperative_matrix() {
            Ok(c) if ran_coop => format!("coopmat {}", c.shape),
            _ if ran_texel => format!("spirv {variant} texel"),
            _ if ran_spirv => format!("spirv {variant}"),
            _ => variant,
        },
    ))
}

/// Formats rows as an aligned text table.
pub fn format_table(rows: &[Row]) -> String {
    let header = [
        "adapter",
        "dtype",
        "shape",
        "op",
        "m",
        "n",
        "k",
        "variant",
        "ms",
        "GFLOP/s",
        "cpu GFLOP/s",
        "ratio",
    ];
    let mut table: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for r in rows {
        table.push(vec![
            format!("{} ({})", r.adapter, r.backend),
            r.dtype.clone(),
            r.shape.clone(),
            r.op.clone(),
            r.m.to_string(),
            r.n.to_string(),
            r.k.to_string(),
            r.variant.clone(),
            format!("{:.2}", r.ms),
            format!("{:.2}", r.gflops),
            format!("{:.1}", r.cpu_gflops),
            format!("{:.3}", r.ratio),
        ]);
    }
    align(&table)
}

/// One row of `kiln bench attention`: causal attention forward + backward, fused
/// kernels against the straightforward version (GEMMs through a T x T score matrix).
#[derive(Clone, Debug, Serialize)]
pub struct AttentionRow {
    pub adapter: String,
    pub backend: String,
    pub dtype: String,
    /// B * H.
    pub heads: usize,
    pub seq: usize,
    pub dim: usize,
    pub fused_ms: f64,
    /// `None` where the straightforward version's T x T scores exceed the adapter's
    /// per-binding limit, so it cannot run at all.
    pub straight_ms: Option<f64>,
    /// straight_ms / fused_ms: above 1, the fused version is faster.
    pub speedup: Option<f64>,
    /// Device bytes each version allocates beyond the shared q, k, v and dout
    /// (`allocated_bytes()` before and after; the fused backward's per-row f32 scratch,
    /// 4 bytes a row, lives in the device's reusable scratch and is not counted).
    pub fused_bytes: u64,
    pub straight_bytes: Option<u64>,
}

/// The buffers of one attention version and how to launch its forward and backward.
struct AttnRun {
    bufs: Vec<Buffer>,
    launches: Vec<Kernel>,
}

/// Fused: out, lse, dq, dk, dv.
fn fused_attention(
    dev: &dyn Device,
    [q, k, v, dout]: [Buffer; 4],
    (heads, seq, dim): (usize, usize, usize),
    dtype: DType,
) -> Result<AttnRun> {
    let n = heads * seq * dim;
    let out = dev.alloc(dtype, n)?;
    let lse = dev.alloc(DType::F32, heads * seq)?;
    let [dq, dk, dv] = [
        dev.alloc(dtype, n)?,
        dev.alloc(dtype, n)?,
        dev.alloc(dtype, n)?,
    ];
    let scale = 1.0 / (dim as f32).sqrt();
    Ok(AttnRun {
        bufs: vec![out, lse, dq, dk, dv],
        launches: vec![
            Kernel::Attention(kernels::Attention {
                q,
                k,
                v,
                out,
                lse,
                batch_heads: heads,
                group: 1,
                seq,
                dim,
                scale,
                causal: true,
                documents: None,
            }),
            Kernel::AttentionBackward(AttentionBackward {
                q,
                k,
                v,
                out,
                dout,
                lse,
                dq,
                dk,
                dv,
                batch_heads: heads,
                group: 1,
                seq,
                dim,
                scale,
                causal: true,
                documents: None,
            }),
        ],
    })
}

/// Straightforward, as the GPT did before fusing: scores = q k^T * scale (GEMM), causal
/// softmax, out = att v; backward datt = dout v^T, dv = att^T dout, softmax backward,
/// dq = dscores k, dk = dscores^T q.
fn straight_attention(
    dev: &dyn Device,
    [q, k, v, dout]: [Buffer; 4],
    (heads, seq, dim): (usize, usize, usize),
    dtype: DType,
) -> Result<AttnRun> {
    let (n, tt, t, d) = (heads * seq * dim, heads * seq * seq, seq, dim);
    let scores = dev.alloc(dtype, tt)?;
    let att = dev.alloc(dtype, tt)?;
    let datt = dev.alloc(dtype, tt)?;
    let stats = dev.alloc(DType::F32, 2 * heads * seq)?;
    let out = dev.alloc(dtype, n)?;
    let [dq, dk, dv] = [
        dev.alloc(dtype, n)?,
        dev.alloc(dtype, n)?,
        dev.alloc(dtype, n)?,
    ];
    let scale = 1.0 / (dim as f32).sqrt();
    let launches = vec![
        Kernel::Matmul(
            Matmul::new(q, k, scores, t, t, d)
                .transpose(false, true)
                .batched(heads, t * d, t * d, t * t)
                .scaled(scale, 0.0),
        ),
        Kernel::Softmax(Softmax {
            x: scores,
            out: att,
            stats,
            cols: t,
            scale: 1.0,
            causal: true,
        }),
        Kernel::Matmul(Matmul::new(att, v, out, t, d, t).batched(heads, t * t, t * d, t * d)),
        Kernel::Matmul(
            Matmul::new(dout, v, datt, t, t, d)
                .transpose(false, true)
                .batched(heads, t * d, t * d, t * t),
        ),
        Kernel::Matmul(
            Matmul::new(att, dout, dv, t, d, t)
                .transpose(true, false)
                .batched(heads, t * t, t * d, t * d),
        ),
        Kernel::SoftmaxBackward(SoftmaxBackward {
            p: att,
            dout: datt,
            dx: scores,
            stats,
            cols: t,
            scale,
        }),
        Kernel::Matmul(Matmul::new(scores, k, dq, t, d, t).batched(heads, t * t, t * d, t * d)),
        Kernel::Matmul(
            Matmul::new(scores, q, dk, t, d, t)
                .transpose(true, false)
                .batched(heads, t * t, t * d, t * d),
        ),
    ];
    Ok(AttnRun {
        bufs: vec![scores, att, datt, stats, out, dq, dk, dv],
        launches,
    })
}

type AttnBuilder = fn(&dyn Device, [Buffer; 4], (usize, usize, usize), DType) -> Result<AttnRun>;

/// Times forward + backward of one version (record, submit, wait), once every pipeline
/// its launches started building is built, with the device memory its buffers took;
/// frees them after.
fn time_attention(
    dev: &dyn Device,
    inputs: [Buffer; 4],
    shape: (usize, usize, usize),
    dtype: DType,
    build: AttnBuilder,
    budget: Duration,
) -> Result<(f64, u64)> {
    let compiled = crate::engine::device::compiling::snapshot();
    let before = dev.allocated_bytes();
    let run = build(dev, inputs, shape, dtype)?;
    let bytes = dev.allocated_bytes() - before;
    let once = || -> Result<()> {
        for k in &run.launches {
            dev.launch(k)?;
        }
        dev.submit()?;
        dev.wait()?;
        Ok(())
    };
    // Passes primed in the background (vk's attention with several rows per lane) are
    // timed, not the stand-ins that run meanwhile.
    let (heads, seq, dim) = shape;
    let what = format!("{} attention {heads}x{seq}x{dim} {dtype}", dev.caps().name);
    let secs = warm_until_built(&what, compiled, once).and_then(|()| time_it(budget, 2, once));
    for b in run.bufs {
        dev.free(b)?;
    }
    Ok((secs? * 1e3, bytes))
}

/// Refuses, before anything is allocated, an attention shape that cannot run on
/// `caps`: a zero size, q/k/v over what a kernel indexes or over the largest buffer,
/// or more host memory than `host_available` (the f32 fills of the inputs and, on a
/// CPU adapter, the device buffers, which live in host memory).
pub fn check_attention(
    caps: &Capabilities,
    dtype: DType,
    (heads, seq, dim): (usize, usize, usize),
    host_available: Option<u64>,
) -> Result<()> {
    let what = format!("attention B*H={heads} T={seq} d={dim}");
    if heads == 0 || seq == 0 || dim == 0 {
        anyhow::bail!("{what}: heads, sequence length and dim must all be at least 1");
    }
    let n = heads
        .checked_mul(seq)
        .and_then(|x| x.checked_mul(dim))
        .filter(|&n| n <= MAX_TENSOR_ELEMENTS)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{what}: q, k and v would each be over the {MAX_TENSOR_ELEMENTS} elements a \
                 kernel indexes; use a shorter sequence or fewer heads"
            )
        })?;
    let bytes = dtype.padded_bytes(n);
    if bytes > caps.max_buffer {
        anyhow::bail!(
            "{what}: q, k and v would each take {} MiB, over `{}`'s largest buffer of {} MiB; \
             use a shorter sequence or fewer heads",
            bytes >> 20,
            caps.name,
            caps.max_buffer >> 20
        );
    }
    // The straightforward version runs only where its T x T scores fit one binding.
    let scores = heads
        .checked_mul(seq)
        .and_then(|x| x.checked_mul(seq))
        .map_or(u64::MAX, |t| dtype.padded_bytes(t));
    let straight = if scores <= caps.max_storage_binding {
        3 * scores
    } else {
        0
    };
    let fill = 8 * n as u64;
    let device = if caps.device_type == "cpu" {
        8 * bytes + straight
    } else {
        0
    };
    if let Some(avail) = host_available.filter(|&h| fill + device > h) {
        anyhow::bail!(
            "{what}: needs {} MiB of host memory (the inputs' f32 fills{}), over the {} MiB \
             available; use a shorter sequence or fewer heads",
            (fill + device) >> 20,
            if device > 0 {
                " and the CPU adapter's buffers"
            } else {
                ""
            },
            avail >> 20
        );
    }
    Ok(())
}

/// Fused against straightforward attention on `dev` for each sequence length.
pub fn attention_table(
    dev: &dyn Device,
    dtype: DType,
    heads: usize,
    dim: usize,
    seqs: &[usize],
    budget: Duration,
    mut progress: impl FnMut(&AttentionRow),
) -> Result<Vec<AttentionRow>> {
    let caps = dev.caps().clone();
    for &seq in seqs {
        check_attention(&caps, dtype, (heads, seq, dim), host_memory_available())?;
    }
    let mut rows = vec![];
    for &seq in seqs {
        let n = heads * seq * dim;
        let fill = |salt: usize| {
            let v: Vec<f32> = (0..n)
                .map(|i| (((i * 7 + salt) % 23) as f32 - 11.0) / 16.0)
                .collect();
            HostData::from_f32(dtype, &v)
        };
        let mut inputs = vec![];
        for salt in 0..4 {
            let b = dev.alloc(dtype, n)?;
            dev.upload(b, &fill(salt))?;
            inputs.push(b);
        }
        let inputs: [Buffer; 4] = inputs.try_into().expect("four inputs");
        let shape = (heads, seq, dim);
        let what = || format!("{} attention T={seq} d={dim}", caps.name);
        let (fused_ms, fused_bytes) =
            time_attention(dev, inputs, shape, dtype, fused_attention, budget)
                .with_context(|| format!("{}: fused", what()))?;
        // The straightforward version's T x T scores must fit one binding; past that
        // only the fused version runs (and the row says so).
        let scores = dtype.padded_bytes(heads * seq * seq);
        let straight = if scores > caps.max_storage_binding {
            None
        } else {
            Some(
                time_attention(dev, inputs, shape, dtype, straight_attention, budget)
                    .with_context(|| format!("{}: straightforward", what()))?,
            )
        };
        for b in inputs {
            dev.free(b)?;
        }
        let row = AttentionRow {
            adapter: caps.name.clone(),
            backend: caps.backend.clone(),
            dtype: dtype.to_string(),
            heads,
            seq,
            dim,
            fused_ms,
            straight_ms: straight.map(|s| s.0),
            speedup: straight.map(|s| s.0 / fused_ms),
            fused_bytes,
            straight_bytes: straight.map(|s| s.1),
        };
        progress(&row);
        rows.push(row);
    }
    Ok(rows)
}

/// Formats attention rows as an aligned text table.
pub fn format_attention(rows: &[AttentionRow]) -> String {
    let header = [
        "adapter",
        "dtype",
        "B*H",
        "T",
        "d",
        "fused ms",
        "straight ms",
        "speedup",
        "fused MiB",
        "straight MiB",
    ];
    let mib = |b: u64| format!("{:.2}", b as f64 / (1u64 << 20) as f64);
    let mut table: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for r in rows {
        table.push(vec![
            format!("{} ({})", r.adapter, r.backend),
            r.dtype.clone(),
            r.heads.to_string(),
            r.seq.to_string(),
            r.dim.to_string(),
            format!("{:.2}", r.fused_ms),
            r.straight_ms
                .map_or("over binding limit".into(), |m| format!("{m:.2}")),
            r.speedup.map_or("-".into(), |x| format!("{x:.2}x")),
            mib(r.fused_bytes),
            r.straight_bytes.map_or("-".into(), mib),
        ]);
    }
    align(&table)
}

/// Rows of cells as text columns, each as wide as its widest cell.
pub fn align(table: &[Vec<String>]) -> String {
    let columns = table.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..columns)
        .map(|i| table.iter().map(|r| r[i].len()).max().unwrap_or(0))
        .collect();
    table
        .iter()
        .map(|row| {
            row.iter()
                .zip(&widths)
                .map(|(c, w)| format!("{c:<w$}"))
                .collect::<Vec<_>>()
                .join("  ")
                .trim_end()
                .to_string()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Writes rows as pretty JSON to `path` (`-`: stdout), for `--json`.
pub fn write_json<T: Serialize>(rows: &[T], path: &str) -> Result<()> {
    let text = serde_json::to_string_pretty(rows)?;
    if path == "-" {
        // A reader that went away (`| head`) wants no more; any other failure is an error.
        use std::io::Write as _;
        match writeln!(std::io::stdout().lock(), "{text}") {
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                return Err(anyhow::Error::new(e).context("writing the JSON to stdout"));
            }
            _ => {}
        }
    } else {
        std::fs::write(path, text).with_context(|| format!("writing {path}"))?;
    }
    Ok(())
}
