//! `kiln bench matmul`: GEMM throughput per adapter, dtype and shape, with a CPU sgemm
//! reference and the naive kernel measured in the same run.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;

use crate::engine::{DType, Device, HostData, Matmul};
use crate::wgpu::{MatmulVariant, WgpuDevice};

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

/// Runs `f` once to warm up, then until `budget` has passed (at least `min_reps`
/// times); returns the mean seconds per run.
fn time_it(budget: Duration, min_reps: u32, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
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
    Ok(2.0 * (s.m * s.n * s.k) as f64 / secs / 1e9)
}

/// Times one GEMM on `dev`, end to end per launch (record, submit, wait).
pub fn gpu_gflops(
    dev: &WgpuDevice,
    s: &Shape,
    dtype: DType,
    variant: Option<MatmulVariant>,
    budget: Duration,
) -> Result<(f64, String)> {
    let fill = |len: usize| {
        let v: Vec<f32> = (0..len).map(|i| ((i % 17) as f32 - 8.0) / 16.0).collect();
        HostData::from_f32(dtype, &v)
    };
    let a = dev.alloc(dtype, s.m * s.k)?;
    let b = dev.alloc(dtype, s.k * s.n)?;
    let c = dev.alloc(dtype, s.m * s.n)?;
    dev.upload(a, &fill(s.m * s.k))?;
    dev.upload(b, &fill(s.k * s.n))?;
    let mm = Matmul::new(a, b, c, s.m, s.n, s.k).transpose(s.trans_a, s.trans_b);
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
    for buf in [a, b, c] {
        dev.free(buf)?;
    }
    Ok((mm.flops() / secs? / 1e9, name))
}

/// The whole table for `devices` × `dtypes` × `shapes`; `naive_up_to` bounds the
/// sizes the (slow) baseline kernel runs on.
pub fn matmul_table(
    devices: &[WgpuDevice],
    dtypes: &[DType],
    shapes: &[Shape],
    budget: Duration,
    naive_up_to: usize,
    extra: &[MatmulVariant],
    mut progress: impl FnMut(&Row),
) -> Result<Vec<Row>> {
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
                for v in variants {
                    let (gflops, variant) =
                        gpu_gflops(dev, s, dtype, v, budget).with_context(|| {
                            format!("{} {dtype} {}x{}x{}", caps.name, s.m, s.n, s.k)
                        })?;
                    let row = Row {
                        adapter: caps.name.clone(),
                        backend: caps.backend.clone(),
                        dtype: dtype.to_string(),
                        m: s.m,
                        n: s.n,
                        k: s.k,
                        op: s.op().into(),
                        shape: s.label.into(),
                        variant,
                        ms: 2.0 * (s.m * s.n * s.k) as f64 / gflops / 1e6,
                        gflops,
                        cpu_gflops: cpu,
                        ratio: gflops / cpu,
                    };
                    progress(&row);
                    rows.push(row);
                }
            }
        }
    }
    Ok(rows)
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
    let widths: Vec<usize> = (0..header.len())
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
