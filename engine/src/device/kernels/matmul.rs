//! The GEMM launch: `C = epilogue(alpha · op(A) · op(B) + beta · C)`, batched.
//!
//! Layouts are row-major. `op(A)` is `M×K`: A is stored `M×K`, or `K×M` when
//! `trans_a`. `op(B)` is `K×N`: B is stored `K×N`, or `N×K` when `trans_b`. C is `M×N`.
//! Training needs NN (forward), NT (input gradient) and TN (weight gradient).

use super::{KernelSpec, Operand};
use crate::device::cost::{bytes_of, KernelCost};
use crate::{Buffer, DType, Error, Result};

#[derive(Clone, Debug, PartialEq)]
pub struct Matmul {
    pub a: Buffer,
    pub b: Buffer,
    pub c: Buffer,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    /// Matrices in the batch; each operand advances by its stride (0 reuses one matrix).
    pub batch: usize,
    pub stride_a: usize,
    pub stride_b: usize,
    pub stride_c: usize,
    pub alpha: f32,
    /// 0 means C is not read (so it may hold anything, NaN included).
    pub beta: f32,
    /// Added to every row: `n` elements of any float dtype.
    pub bias: Option<Buffer>,
    /// GELU, tanh form, applied last.
    pub gelu: bool,
    /// Also store the f32 result before it is rounded to C's dtype.
    pub c_f32: Option<Buffer>,
}

impl Matmul {
    /// `C = A · B` for one `M×K` by `K×N` product, no transposes.
    pub fn new(a: Buffer, b: Buffer, c: Buffer, m: usize, n: usize, k: usize) -> Matmul {
        Matmul {
            a,
            b,
            c,
            m,
            n,
            k,
            trans_a: false,
            trans_b: false,
            batch: 1,
            stride_a: m * k,
            stride_b: k * n,
            stride_c: m * n,
            alpha: 1.0,
            beta: 0.0,
            bias: None,
            gelu: false,
            c_f32: None,
        }
    }

    pub fn transpose(mut self, trans_a: bool, trans_b: bool) -> Matmul {
        self.trans_a = trans_a;
        self.trans_b = trans_b;
        self
    }

    pub fn batched(
        mut self,
        batch: usize,
        stride_a: usize,
        stride_b: usize,
        stride_c: usize,
    ) -> Matmul {
        self.batch = batch;
        self.stride_a = stride_a;
        self.stride_b = stride_b;
        self.stride_c = stride_c;
        self
    }

    pub fn scaled(mut self, alpha: f32, beta: f32) -> Matmul {
        self.alpha = alpha;
        self.beta = beta;
        self
    }

    pub fn with_bias(mut self, bias: Buffer) -> Matmul {
        self.bias = Some(bias);
        self
    }

    pub fn with_gelu(mut self) -> Matmul {
        self.gelu = true;
        self
    }

    pub fn with_f32_copy(mut self, c_f32: Buffer) -> Matmul {
        self.c_f32 = Some(c_f32);
        self
    }

    /// Floating-point operations, counting a multiply-add as two.
    pub fn flops(&self) -> f64 {
        2.0 * self.batch as f64 * self.m as f64 * self.n as f64 * self.k as f64
    }

    /// Every buffer the launch touches.
    pub fn buffers(&self) -> Vec<Buffer> {
        let mut v = vec![self.a, self.b, self.c];
        v.extend(self.bias);
        v.extend(self.c_f32);
        v
    }

    /// Element index of `op(A)[i][k]` in matrix `g` of the batch.
    pub fn a_index(&self, g: usize, i: usize, k: usize) -> usize {
        g * self.stride_a
            + if self.trans_a {
                k * self.m + i
            } else {
                i * self.k + k
            }
    }

    /// Element index of `op(B)[k][j]` in matrix `g` of the batch.
    pub fn b_index(&self, g: usize, k: usize, j: usize) -> usize {
        g * self.stride_b
            + if self.trans_b {
                j * self.k + k
            } else {
                k * self.n + j
            }
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::InvalidArgument(format!("matmul: {msg}")));
        for (name, b) in [("a", self.a), ("b", self.b), ("c", self.c)] {
            if !b.dtype.is_float() {
                return bad(format!(
                    "`{name}` is {}, but matmul takes f32, f16 or bf16",
                    b.dtype
                ));
            }
        }
        if !self.alpha.is_finite() || !self.beta.is_finite() {
            return bad(format!(
                "alpha ({}) and beta ({}) must be finite",
                self.alpha, self.beta
            ));
        }
        if self.batch == 0 {
            return bad("batch is 0; use 1 for a single product".into());
        }
        // Checked: a wrapped size would pass these checks and send kernels that skip
        // bounds checks far outside the buffer.
        let overflow = || {
            Error::InvalidArgument(format!(
                "matmul: {}x{}x{} with batch {} and strides ({}, {}, {}) overflows the index range",
                self.m, self.n, self.k, self.batch, self.stride_a, self.stride_b, self.stride_c
            ))
        };
        let need = |stride: usize, one: usize| -> Result<usize> {
            (self.batch - 1)
                .checked_mul(stride)
                .and_then(|s| s.checked_add(one))
                .ok_or_else(overflow)
        };
        let product = |a: usize, b: usize| a.checked_mul(b).ok_or_else(overflow);
        let (mk, kn, mn) = (
            product(self.m, self.k)?,
            product(self.k, self.n)?,
            product(self.m, self.n)?,
        );
        for (name, buf, stride, one, shape) in [
            (
                "a",
                self.a,
                self.stride_a,
                mk,
                if self.trans_a {
                    (self.k, self.m)
                } else {
                    (self.m, self.k)
                },
            ),
            (
                "b",
                self.b,
                self.stride_b,
                kn,
                if self.trans_b {
                    (self.n, self.k)
                } else {
                    (self.k, self.n)
                },
            ),
            ("c", self.c, self.stride_c, mn, (self.m, self.n)),
        ] {
            let n = need(stride, one)?;
            if buf.len < n {
                return bad(format!(
                    "`{name}` (buffer #{}) has {} elements but {} matrices of {}x{} with stride {stride} need {n}",
                    buf.id, buf.len, self.batch, shape.0, shape.1
                ));
            }
            if n > u32::MAX as usize {
                return bad(format!(
                    "`{name}` spans {n} elements; kernels index with 32 bits, split the batch"
                ));
            }
        }
        if self.batch > 1 && self.stride_c < mn {
            return bad(format!(
                "stride_c {} is smaller than one {}x{} output: results would overlap",
                self.stride_c, self.m, self.n
            ));
        }
        if let Some(bias) = self.bias {
            if !bias.dtype.is_float() || bias.len != self.n {
                return bad(format!(
                    "bias (buffer #{}) must be {} float elements, one per output column; it is {} x {}",
                    bias.id, self.n, bias.len, bias.dtype
                ));
            }
        }
        if let Some(cf) = self.c_f32 {
            if cf.dtype != DType::F32 || cf.len < need(self.stride_c, mn)? {
                return bad(format!(
                    "c_f32 (buffer #{}) must be f32 with at least as many elements as C needs; it is {} x {}",
                    cf.id, cf.len, cf.dtype
                ));
            }
        }
        Ok(())
    }
}

/// GELU, tanh approximation, in f64: the reference form.
pub fn gelu_f64(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

/// d gelu / dx for the tanh form, in f64.
pub fn gelu_grad_f64(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let t = (c * (x + 0.044715 * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)
}

impl KernelSpec for Matmul {
    fn name(&self) -> &'static str {
        "matmul"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        let mm = self;
        [
            Operand::read_split(&mut mm.a),
            Operand::read_split(&mut mm.b),
            Operand::write_split(&mut mm.c),
        ]
        .into_iter()
        .chain(mm.bias.as_mut().map(Operand::read_split))
        .chain(mm.c_f32.as_mut().map(Operand::write_split))
        .collect()
    }

    fn check(&self) -> Result<()> {
        self.validate()
    }

    fn flops_per_element(&self) -> f64 {
        0.0
    }

    fn cost(&self) -> KernelCost {
        let mm = self;
        let (m, n, k, b) = (mm.m as f64, mm.n as f64, mm.k as f64, mm.batch as f64);
        let a_size = mm.a.dtype.size() as f64;
        let b_size = mm.b.dtype.size() as f64;
        let c_size = mm.c.dtype.size() as f64;
        let reads_c = mm.beta != 0.0;
        let mut flops = 2.0 * m * n * k;
        let mut bytes = m * k * a_size + k * n * b_size + m * n * c_size;
        if reads_c {
            flops += 2.0 * m * n;
            bytes += m * n * c_size;
        }
        if mm.bias.is_some() {
            flops += m * n;
        }
        if mm.gelu {
            flops += 8.0 * m * n;
        }
        if mm.c_f32.is_some() {
            bytes += m * n * 4.0;
        }
        bytes *= b;
        // The bias is one row shared by the batch.
        bytes += mm.bias.as_ref().map_or(0.0, bytes_of);
        let layout = format!(
            "{}{}",
            if mm.trans_a { 'T' } else { 'N' },
            if mm.trans_b { 'T' } else { 'N' }
        );
        let batch = if mm.batch > 1 {
            format!(" x{}", mm.batch)
        } else {
            String::new()
        };
        let label = format!(
            "matmul {}x{}x{} {layout}{batch} {}",
            mm.m, mm.n, mm.k, mm.c.dtype
        );
        KernelCost {
            kind: self.name(),
            label,
            flops: flops * b,
            bytes,
        }
    }
}
