//! The kernels a device can launch, described as plain data.
//!
//! Describing launches as an enum keeps the device trait small and object-safe:
//! a backend matches on it and records the matching pipeline. Argument checks
//! ([`Kernel::validate`]) live in `kernel_validate.rs`, once, so every backend rejects
//! the same bad launches with the same words.

use crate::{AdamStep, Buffer, Matmul, RopeFreqs, SgdStep};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Mul,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Max,
    /// Sum of squares (for gradient norms).
    SumSquares,
}

/// The target id that marks a position as not trained on (PyTorch's `ignore_index`):
/// cross-entropy gives it loss 0 and zero gradient.
pub const IGNORE_TARGET: u32 = u32::MAX;

/// An elementwise activation of [`Kernel::Activation`] (GELU, which the GPT uses, has
/// kernels of its own).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `max(x, 0)`; its derivative at 0 is taken as 0 (as PyTorch does).
    Relu,
    Tanh,
    /// `x * sigmoid(x)` (swish).
    Silu,
}

impl Activation {
    pub const ALL: [Activation; 3] = [Activation::Relu, Activation::Tanh, Activation::Silu];

    pub fn name(self) -> &'static str {
        match self {
            Activation::Relu => "relu",
            Activation::Tanh => "tanh",
            Activation::Silu => "silu",
        }
    }
}

/// The 32-bit hash that decides dropout's mask: element `i` of a launch with `seed` is
/// kept iff `dropout_hash(seed, i) >= dropout_threshold(p)`. Counter-based (no state, no
/// mask buffer: backward recomputes it) and only u32 wrapping arithmetic, so the CPU and
/// every GPU path give the same bits. Two rounds of xorshift-multiply, the seed's low
/// word mixed in before the first and its high word before the second: a change to
/// either word reshuffles the whole mask rather than shifting or permuting it in a
/// simple way. (Multipliers: the fractional bits of sqrt 2 and sqrt 3, odd.)
pub fn dropout_hash(seed: u64, i: u32) -> u32 {
    fn round(mut h: u32) -> u32 {
        h ^= h >> 16;
        h = h.wrapping_mul(0x6A09_E667);
        h ^= h >> 15;
        h = h.wrapping_mul(0xBB67_AE85);
        h ^ (h >> 16)
    }
    round(round(i ^ seed as u32) ^ (seed >> 32) as u32)
}

/// Dropout drops element `i` when its hash is below this: `p * 2^32`, rounded, so that
/// an element is kept with probability `1 - p` to within 2^-33.
pub fn dropout_threshold(p: f32) -> u32 {
    (p as f64 * 4_294_967_296.0).round().min(u32::MAX as f64) as u32
}

/// The factor kept elements are multiplied by, `1 / (1 - p)` rounded to f32 once (the
/// product is then one f32 multiplication, the same on every device).
pub fn dropout_scale(p: f32) -> f32 {
    1.0 / (1.0 - p)
}

/// The seed of the dropout op at graph op index `op` under a plan's random state `key`
/// ([`crate::graph::Plan::set_random_state`]): both mixed through a 64-bit
/// xorshift-multiply so that nearby keys or ops give unrelated seeds.
pub fn dropout_seed(key: u64, op: usize) -> u64 {
    fn mix(mut x: u64) -> u64 {
        x ^= x >> 32;
        x = x.wrapping_mul(0x6A09_E667_F3BC_C909);
        x ^= x >> 29;
        x = x.wrapping_mul(0xBB67_AE85_84CA_A73B);
        x ^ (x >> 32)
    }
    mix(mix(key) ^ (op as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// The factor of [`Kernel::MseBackward`]: `2 * scale / cols`, rounded to f32 once.
pub fn mse_grad_factor(scale: f32, cols: usize) -> f32 {
    (2.0 * scale as f64 / cols as f64) as f32
}

/// One kernel launch. Float operands may each have their own dtype (f32, f16, bf16):
/// values are widened to f32, computed in f32 and rounded to nearest-even on store.
#[derive(Clone, Debug, PartialEq)]
pub enum Kernel {
    /// `dst[i] = value` (rounded to `dst`'s dtype; must be an exact integer for u32).
    Fill { dst: Buffer, value: f64 },
    /// `dst = src`, bit for bit; same dtype and length.
    Copy { src: Buffer, dst: Buffer },
    /// `dst[i] = src[i]` converted between float dtypes with round-to-nearest-even.
    Cast { src: Buffer, dst: Buffer },
    /// `out[i] = a[i] op b[i]`.
    Binary {
        op: BinaryOp,
        a: Buffer,
        b: Buffer,
        out: Buffer,
    },
    /// `out[i] = alpha * x[i]`.
    Scale { alpha: f32, x: Buffer, out: Buffer },
    /// `y[i] = alpha * x[i] + y[i]`.
    Axpy { alpha: f32, x: Buffer, y: Buffer },
    /// `dst[0] = op over src`, accumulated in f32; `dst` is a 1-element f32 buffer.
    /// The sum of an empty buffer is 0, its max is -inf. Inputs are expected to be
    /// finite: check with [`Kernel::NonFinite`] first (the max of a NaN is unspecified).
    Reduce {
        op: ReduceOp,
        src: Buffer,
        dst: Buffer,
    },
    /// `flag[0] = 1` if any element of any `srcs` is inf or NaN, else 0.
    /// `flag` is a 1-element u32 buffer; one launch checks all of `srcs`.
    NonFinite { srcs: Vec<Buffer>, flag: Buffer },
    /// A batched GEMM with optional fused epilogue; see [`Matmul`].
    Matmul(Matmul),
    /// `out[0] = 1 / combined scale` from the gradients' sum of squares `sum_squares[0]`
    /// (both 1-element f32); see [`crate::device::optim::grad_scale_reference`].
    GradScale {
        sum_squares: Buffer,
        out: Buffer,
        loss_scale: f32,
        clip: f32,
    },
    /// One Adam/AdamW step over flat buffers; see [`AdamStep`].
    Adam(AdamStep),
    /// One SGD-with-momentum step over flat buffers; see [`SgdStep`].
    Sgd(SgdStep),
    /// `out = gelu(x)`, tanh form, elementwise.
    Gelu { x: Buffer, out: Buffer },
    /// `dx = dout * gelu'(x)`, elementwise.
    GeluBackward { x: Buffer, dout: Buffer, dx: Buffer },
    /// `out = f(x)` elementwise for the activation `kind`, in f32.
    Activation {
        kind: Activation,
        x: Buffer,
        out: Buffer,
    },
    /// `dx = dout * f'(x)`, elementwise, from the forward's input `x`.
    ActivationBackward {
        kind: Activation,
        x: Buffer,
        dout: Buffer,
        dx: Buffer,
    },
    /// Inverted dropout: `out[i] = x[i] * dropout_scale(p)` where element `i` is kept
    /// (see [`dropout_hash`]), else 0. `0 <= p < 1`; the mask depends only on `seed`,
    /// `p` and `i`, so it is the same on every device.
    Dropout {
        x: Buffer,
        out: Buffer,
        p: f32,
        seed: u64,
    },
    /// `dx[i] = dout[i] * dropout_scale(p)` where the forward with the same `p` and
    /// `seed` kept element `i`, else 0: the mask is recomputed, not stored.
    DropoutBackward {
        dout: Buffer,
        dx: Buffer,
        p: f32,
        seed: u64,
    },
    /// Mean squared error per row of `cols`: `losses[r] = sum_j (pred - target)^2 / cols`
    /// over row r, accumulated in f32; `target` may have any float dtype.
    MseLoss {
        pred: Buffer,
        target: Buffer,
        losses: Buffer,
        cols: usize,
    },
    /// `dpred = (pred - target) * mse_grad_factor(scale, cols)`, i.e.
    /// `2 (pred - target) / cols * scale` (scale: d loss / d losses_r times the loss
    /// scale, as [`Kernel::CrossEntropyBackward`]'s).
    MseBackward {
        pred: Buffer,
        target: Buffer,
        dpred: Buffer,
        cols: usize,
        scale: f32,
    },
    /// Layer norm over rows of `cols` elements: `out = (x - mean) * rstd * weight + bias`.
    /// Saves each row's `mean` and `rstd` (f32, one per row) for the backward pass.
    LayerNorm {
        x: Buffer,
        weight: Buffer,
        bias: Buffer,
        out: Buffer,
        mean: Buffer,
        rstd: Buffer,
        cols: usize,
        eps: f32,
    },
    /// Row softmax of `scale * x` over rows of `cols`, statistics in f32. With `causal`,
    /// row r sees only columns `j <= r % cols` (rows are stacked T x T score matrices)
    /// and the masked entries are 0. `stats` (f32, 2 per row: max and sum) is scratch
    /// that the pass writes.
    Softmax {
        x: Buffer,
        out: Buffer,
        stats: Buffer,
        cols: usize,
        scale: f32,
        causal: bool,
    },
    /// `dx = scale * p * (dout - sum_j p_j dout_j)` per row, from the softmax output `p`;
    /// `stats` (f32, 2 per row) is scratch.
    SoftmaxBackward {
        p: Buffer,
        dout: Buffer,
        dx: Buffer,
        stats: Buffer,
        cols: usize,
        scale: f32,
    },
    /// Fused scaled-dot-product attention over `batch_heads` query heads:
    /// `out = softmax(q k^T * scale [+ causal mask]) v` row by row, q and out
    /// `(batch_heads, seq, dim)`, k and v `(batch_heads / group, seq, dim)`, in any float
    /// dtype. Query head `h` reads K/V head `h / group` (grouped-query attention: with
    /// heads ordered (batch, head), that is K/V head `head / group` of its batch; `group`
    /// 1 is multi-head attention). Computed tile by tile with the online-softmax
    /// recurrence (running max and sum in f32): no `seq x seq` buffer. With `causal`,
    /// query row `i` sees keys `j <= i`. Saves `lse` (f32, one per `(head, row)`): the
    /// natural log of the row's softmax denominator, including the max, which
    /// [`Kernel::AttentionBackward`] recomputes the probabilities from. `dim` is
    /// 1..=128, and even when `out` is 16-bit.
    Attention {
        q: Buffer,
        k: Buffer,
        v: Buffer,
        out: Buffer,
        lse: Buffer,
        batch_heads: usize,
        /// Query heads per K/V head (1: every query head has its own).
        group: usize,
        seq: usize,
        dim: usize,
        scale: f32,
        causal: bool,
    },
    /// Gradients of [`Kernel::Attention`]: `dq`, `dk`, `dv` (overwritten) from `dout`, the
    /// forward's `out` and `lse`, recomputing the probabilities from q and k; no
    /// `seq x seq` buffer. Uses `rowsum(dout * out)` per row (f32, kept in the device's
    /// scratch). `dq` is shaped as q, `dk` and `dv` as k and v: K/V head `j` gets the
    /// sum over its query heads `j * group .. (j + 1) * group`, in f32 and in that
    /// order. `dim` must be even when a gradient is 16-bit.
    AttentionBackward {
        q: Buffer,
        k: Buffer,
        v: Buffer,
        out: Buffer,
        dout: Buffer,
        lse: Buffer,
        dq: Buffer,
        dk: Buffer,
        dv: Buffer,
        batch_heads: usize,
        /// Query heads per K/V head, as in [`Kernel::Attention`].
        group: usize,
        seq: usize,
        dim: usize,
        scale: f32,
        causal: bool,
    },
    /// Attention heads out of rows: `src` holds `rows = batch * seq` rows of `width`
    /// elements; columns `offset + h * dim + i` of row `(b, t)` go to `dst[b][h][t][i]`
    /// (`dst` is `batch * heads * seq * dim`, `dim = dst.len / (rows * heads)`).
    SplitHeads {
        src: Buffer,
        dst: Buffer,
        seq: usize,
        heads: usize,
        width: usize,
        offset: usize,
    },
    /// The inverse: `src[b][h][t][i]` to column `offset + h * dim + i` of row `(b, t)` of
    /// `dst`; other columns of `dst` are left as they are. `heads * dim`, `width` and
    /// `offset` must be even, so that no 16-bit word is shared with a column outside.
    MergeHeads {
        src: Buffer,
        dst: Buffer,
        seq: usize,
        heads: usize,
        width: usize,
        offset: usize,
    },
    /// Fused softmax + cross-entropy over rows of `vocab` logits: `losses[r] =
    /// logsumexp(logits[r]) - logits[r][targets[r]]`, statistics in f32; saves `lse` per
    /// row for the backward pass. A target of [`IGNORE_TARGET`] gives loss 0 (a position
    /// that is not trained on: padding, prompts); any other target outside the
    /// vocabulary gives a NaN loss. Only the first `classes` columns are classes: the
    /// rest pad the row (a vocabulary padded to a multiple of 64 for faster matmuls) and
    /// are left out of the logsumexp, and a target among them gives a NaN loss.
    CrossEntropy {
        logits: Buffer,
        targets: Buffer,
        losses: Buffer,
        lse: Buffer,
        vocab: usize,
        classes: usize,
    },
    /// `dlogits = (softmax(logits) - onehot(target)) * scale` (scale: d loss / d loss_r,
    /// e.g. loss scale / rows), from the saved `lse`; rows whose target is
    /// [`IGNORE_TARGET`] get zero gradient, and so do the padding columns from `classes`
    /// on (they took no part in the softmax).
    CrossEntropyBackward {
        logits: Buffer,
        targets: Buffer,
        lse: Buffer,
        dlogits: Buffer,
        vocab: usize,
        classes: usize,
        scale: f32,
    },
    /// `out[i] = table[tokens[i]]`, rows of `dim` elements. A token outside the table
    /// gives NaN rows (so an overflow check catches it).
    Embedding {
        tokens: Buffer,
        table: Buffer,
        out: Buffer,
        dim: usize,
    },
    /// `dtable[tokens[i]] += dout[i]` (f32 `dtable`, accumulated), deterministic: each
    /// column is summed over the tokens in order.
    EmbeddingBackward {
        tokens: Buffer,
        dout: Buffer,
        dtable: Buffer,
        dim: usize,
    },
    /// Layer-norm backward: `dx` is overwritten; `dweight` and `dbias` (f32, `cols`)
    /// are accumulated into (`+=`), as gradients over micro-batches are.
    LayerNormBackward {
        x: Buffer,
        weight: Buffer,
        mean: Buffer,
        rstd: Buffer,
        dout: Buffer,
        dx: Buffer,
        dweight: Buffer,
        dbias: Buffer,
        cols: usize,
    },
    /// RMS norm over rows of `cols` elements (Llama's): `out = x * rstd * weight` with
    /// `rstd = 1 / sqrt(mean(x^2) + eps)`, the mean of squares in f32. Saves each row's
    /// `rstd` (f32, one per row) for the backward pass.
    RmsNorm {
        x: Buffer,
        weight: Buffer,
        out: Buffer,
        rstd: Buffer,
        cols: usize,
        eps: f32,
    },
    /// RMS-norm backward from the saved `rstd`, with `xhat = x * rstd`:
    /// `dx = rstd * (dy * w - xhat * mean(dy * w * xhat))` is overwritten; `dweight`
    /// (f32, `cols`) is accumulated into (`+= sum over rows of dy * xhat`).
    RmsNormBackward {
        x: Buffer,
        weight: Buffer,
        rstd: Buffer,
        dout: Buffer,
        dx: Buffer,
        dweight: Buffer,
        cols: usize,
    },
    /// Rotary position embedding, the "rotate half" form of Hugging Face's Llama: `x`
    /// holds rows of `cols` = heads x `dim` elements, row `r` at position
    /// `t = r % seq`. Each head's `dim` (even) values split into halves; for
    /// `i < dim / 2` and `a = t * f_i` (`f_i = theta^(-2i / dim)`, rescaled per band
    /// where `freqs` has a scaling: [`RopeFreqs`]):
    /// `out[i] = x[i] cos a - x[i + dim/2] sin a`,
    /// `out[i + dim/2] = x[i + dim/2] cos a + x[i] sin a`.
    /// With `inverse`, the rotation by `-a`: the backward pass (`dx` from `dout`).
    /// GPUs compute the angle in f32, as Hugging Face's f32 path does: the inverse
    /// frequency to a few f32 ulps and one rounding of the product, so the angle's error
    /// is a few f32 epsilons times `|a|` (under 2e-3 rad for angles up to 4096 rad: the
    /// f32 convention's own limit; frequency 1's angle, `t`, is exact). It is then
    /// reduced modulo 2 pi in exact-product parts (within 3e-7 rad at any position), so
    /// `sin` and `cos` never see a large argument. The CPU reference is exact (f64).
    Rope {
        x: Buffer,
        out: Buffer,
        cols: usize,
        dim: usize,
        seq: usize,
        freqs: RopeFreqs,
        inverse: bool,
    },
    /// SwiGLU's gate (Llama's MLP): `out = silu(gate) * up` elementwise, with
    /// `silu(g) = g * sigmoid(g)` in f32.
    SwiGlu {
        gate: Buffer,
        up: Buffer,
        out: Buffer,
    },
    /// Its backward in one pass: `dgate = dout * up * silu'(gate)` and
    /// `dup = dout * silu(gate)`, both overwritten.
    SwiGluBackward {
        gate: Buffer,
        up: Buffer,
        dout: Buffer,
        dgate: Buffer,
        dup: Buffer,
    },
    /// [`Kernel::Rope`] (forward) with each row's position read from the device: row `r`
    /// of `x` (rows of `cols` = heads x `dim`) turns by its angles at position
    /// `positions[r]`, so one recorded launch serves every generation step. Same angle
    /// computation and accuracy as [`Kernel::Rope`].
    RopeAt {
        x: Buffer,
        out: Buffer,
        /// u32, one per row of `x`.
        positions: Buffer,
        cols: usize,
        dim: usize,
        freqs: RopeFreqs,
    },
    /// Appends new K or V rows to a generation cache at positions read from the device,
    /// so that one recorded launch serves every step. `src` holds `rows` rows of `width`
    /// elements (the new tokens, `rows / batch` per sequence, in sequence order); the
    /// cache is `(batch, heads, max_len, dim)` with
    /// `batch = cache.len / (heads * max_len * dim)`. Row `r` (sequence
    /// `b = r / (rows / batch)`) goes to
    /// `cache[b][h][positions[r]][i] = src[r][offset + h * dim + i]`. A position at or past
    /// `max_len` writes nothing. `dim` must be even when the cache is 16-bit (rows that
    ///   share no 32-bit word).
    CacheWrite {
        src: Buffer,
        cache: Buffer,
        /// u32, one per row of `src`.
        positions: Buffer,
        heads: usize,
        dim: usize,
        width: usize,
        offset: usize,
        max_len: usize,
    },
    /// Attention of new query rows over a generation cache (what decoding runs instead
    /// of [`Kernel::Attention`]): `q` holds rows of `width` elements with query head `h`
    /// at columns `offset + h * dim`; row `r` (sequence `b`, as in [`Kernel::CacheWrite`])
    /// attends K/V head `h / group` of its sequence over cache rows `0..=positions[r]`:
    /// `out[r][h * dim + i] = softmax_j(q . k_j * scale) v_j[i]`, `out` rows of
    /// `heads * dim`. Scores, the running max and sum and the accumulators are f32 (the
    /// online-softmax recurrence, stable for any scores). A position at or past `max_len`
    /// gives NaN rows. `dim` is 1..=[`ATTENTION_MAX_DIM`], even when `out` is 16-bit.
    CachedAttention {
        q: Buffer,
        k_cache: Buffer,
        v_cache: Buffer,
        /// u32, one per query row.
        positions: Buffer,
        out: Buffer,
        /// Query heads.
        heads: usize,
        /// Query heads per K/V head (1: multi-head attention).
        group: usize,
        dim: usize,
        width: usize,
        offset: usize,
        max_len: usize,
        scale: f32,
    },
}

/// The geometry of a [`Kernel::CacheWrite`] or [`Kernel::CachedAttention`] launch,
/// worked out once for validation and for every backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheLayout {
    /// New rows (tokens) in the launch, over all sequences.
    pub rows: usize,
    /// Sequences (the cache's first dimension).
    pub batch: usize,
    /// K/V heads in the cache.
    pub kv_heads: usize,
    pub max_len: usize,
    pub dim: usize,
}

impl CacheLayout {
    /// The sequence row `r` belongs to.
    pub fn sequence(&self, r: usize) -> usize {
        r / (self.rows / self.batch).max(1)
    }

    /// Cache index of element `i` of K/V head `h` at position `t` of sequence `b`.
    pub fn index(&self, b: usize, h: usize, t: usize, i: usize) -> usize {
        ((b * self.kv_heads + h) * self.max_len + t) * self.dim + i
    }
}

/// The most positions a [`Kernel::Rope`] sequence may have: every position is then an
/// exact f32.
pub const ROPE_MAX_SEQ: usize = 1 << 24;

/// The geometry of a [`Kernel::SplitHeads`] or [`Kernel::MergeHeads`] launch, worked
/// out once for validation and for every backend.
#[derive(Clone, Copy, Debug)]
pub struct HeadsLayout {
    /// Rows to heads (split) or heads to rows (merge).
    pub split: bool,
    /// The buffer in row layout (`rows x width`) and the one in head layout.
    pub rows_buf: Buffer,
    pub heads_buf: Buffer,
    pub rows: usize,
    pub seq: usize,
    pub heads: usize,
    pub dim: usize,
    pub width: usize,
    pub offset: usize,
}

impl HeadsLayout {
    /// Row-layout index of element `e` of the head layout `(b, h, t, i)`.
    pub fn row_index(&self, e: usize) -> usize {
        let (d, t, h) = (self.dim, self.seq, self.heads);
        let (i, ti, hi, b) = (e % d, (e / d) % t, (e / (d * t)) % h, e / (d * t * h));
        (b * t + ti) * self.width + self.offset + hi * d + i
    }
}

impl Kernel {
    /// The geometry of a head split or merge (`None` for other kernels). Sizes are only
    /// meaningful once [`Kernel::validate`] has passed.
    pub fn heads_layout(&self) -> Option<HeadsLayout> {
        let (split, src, dst, seq, heads, width, offset) = match *self {
            Kernel::SplitHeads {
                src,
                dst,
                seq,
                heads,
                width,
                offset,
            } => (true, src, dst, seq, heads, width, offset),
            Kernel::MergeHeads {
                src,
                dst,
                seq,
                heads,
                width,
                offset,
            } => (false, src, dst, seq, heads, width, offset),
            _ => return None,
        };
        let (rows_buf, heads_buf) = if split { (src, dst) } else { (dst, src) };
        let rows = rows_buf.len / width.max(1);
        let dim = if rows == 0 || heads == 0 {
            0
        } else {
            heads_buf.len / (rows * heads)
        };
        Some(HeadsLayout {
            split,
            rows_buf,
            heads_buf,
            rows,
            seq,
            heads,
            dim,
            width,
            offset,
        })
    }

    /// The geometry of a cache write or cached attention (`None` for other kernels).
    /// Sizes are only meaningful once [`Kernel::validate`] has passed.
    pub fn cache_layout(&self) -> Option<CacheLayout> {
        let (src, cache, kv_heads, dim, width, max_len) = match *self {
            Kernel::CacheWrite {
                src,
                cache,
                heads,
                dim,
                width,
                max_len,
                ..
            } => (src, cache, heads, dim, width, max_len),
            Kernel::CachedAttention {
                q,
                k_cache,
                heads,
                group,
                dim,
                width,
                max_len,
                ..
            } => (q, k_cache, heads / group.max(1), dim, width, max_len),
            _ => return None,
        };
        let per_sequence = kv_heads * max_len * dim;
        Some(CacheLayout {
            rows: src.len / width.max(1),
            batch: cache.len / per_sequence.max(1),
            kv_heads,
            max_len,
            dim,
        })
    }

    /// Short name for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Kernel::Fill { .. } => "fill",
            Kernel::Copy { .. } => "copy",
            Kernel::Cast { .. } => "cast",
            Kernel::Binary {
                op: BinaryOp::Add, ..
            } => "add",
            Kernel::Binary {
                op: BinaryOp::Mul, ..
            } => "mul",
            Kernel::Scale { .. } => "scale",
            Kernel::Axpy { .. } => "axpy",
            Kernel::Reduce {
                op: ReduceOp::Sum, ..
            } => "sum",
            Kernel::Reduce {
                op: ReduceOp::Max, ..
            } => "max",
            Kernel::Reduce {
                op: ReduceOp::SumSquares,
                ..
            } => "sumsq",
            Kernel::NonFinite { .. } => "nonfinite",
            Kernel::Matmul(_) => "matmul",
            Kernel::GradScale { .. } => "grad_scale",
            Kernel::Adam(_) => "adam",
            Kernel::Sgd(_) => "sgd",
            Kernel::Gelu { .. } => "gelu",
            Kernel::GeluBackward { .. } => "gelu_backward",
            Kernel::Activation { kind, .. } => kind.name(),
            Kernel::ActivationBackward { kind, .. } => match kind {
                Activation::Relu => "relu_backward",
                Activation::Tanh => "tanh_backward",
                Activation::Silu => "silu_backward",
            },
            Kernel::Dropout { .. } => "dropout",
            Kernel::DropoutBackward { .. } => "dropout_backward",
            Kernel::MseLoss { .. } => "mse_loss",
            Kernel::MseBackward { .. } => "mse_backward",
            Kernel::LayerNorm { .. } => "layernorm",
            Kernel::LayerNormBackward { .. } => "layernorm_backward",
            Kernel::SplitHeads { .. } => "split_heads",
            Kernel::MergeHeads { .. } => "merge_heads",
            Kernel::Softmax { .. } => "softmax",
            Kernel::SoftmaxBackward { .. } => "softmax_backward",
            Kernel::Attention { .. } => "attention",
            Kernel::AttentionBackward { .. } => "attention_backward",
            Kernel::CrossEntropy { .. } => "cross_entropy",
            Kernel::CrossEntropyBackward { .. } => "cross_entropy_backward",
            Kernel::Embedding { .. } => "embedding",
            Kernel::EmbeddingBackward { .. } => "embedding_backward",
            Kernel::RmsNorm { .. } => "rmsnorm",
            Kernel::RmsNormBackward { .. } => "rmsnorm_backward",
            Kernel::Rope { inverse: false, .. } => "rope",
            Kernel::Rope { inverse: true, .. } => "rope_backward",
            Kernel::SwiGlu { .. } => "swiglu",
            Kernel::SwiGluBackward { .. } => "swiglu_backward",
            Kernel::RopeAt { .. } => "rope_at",
            Kernel::CacheWrite { .. } => "cache_write",
            Kernel::CachedAttention { .. } => "cached_attention",
        }
    }

    /// Every buffer the launch touches.
    pub fn buffers(&self) -> Vec<Buffer> {
        self.clone()
            .operands_mut()
            .into_iter()
            .map(|o| *o.buf)
            .collect()
    }

    /// The buffers a backend must bind whole, so each must fit one storage binding
    /// ([`crate::Capabilities::max_storage_binding`]). Backends split the rest at that
    /// limit: a GEMM's operands, elementwise kernels, reductions, the overflow check,
    /// the optimizer steps over flat buffers, the embedding backward's table. The
    /// model's memory check refuses, before anything is allocated, a buffer here over
    /// the limit.
    pub fn bound_whole(&self) -> Vec<Buffer> {
        let mut k = self.clone();
        let ops = k.operands_mut();
        ops.into_iter()
            .filter(|o| o.whole)
            .map(|o| *o.buf)
            .collect()
    }

    /// Every buffer field of the launch, mutably, in the order of [`Kernel::buffers`]: a
    /// plan records launches over placeholders and rewrites them to device buffers.
    pub fn buffers_mut(&mut self) -> Vec<&mut Buffer> {
        self.operands_mut().into_iter().map(|o| o.buf).collect()
    }

    /// Buffers the launch writes (an accumulating kernel's destination included).
    pub fn written(&self) -> Vec<Buffer> {
        let mut k = self.clone();
        let ops = k.operands_mut();
        ops.into_iter()
            .filter(|o| o.written)
            .map(|o| *o.buf)
            .collect()
    }

    /// Each kernel's buffers in one table: every buffer field, in a fixed order, with
    /// whether the launch writes it and whether a backend binds it whole (else it may
    /// split it at the binding limit). [`Kernel::buffers`], [`Kernel::buffers_mut`],
    /// [`Kernel::written`] and [`Kernel::bound_whole`] all read it.
    pub fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        // r/w: read or written, bound whole; rs/ws: the same, split where too large.
        let (r, w) = (Operand::read, Operand::write);
        let (rs, ws) = (Operand::read_split, Operand::write_split);
        match self {
            Kernel::Fill { dst, .. } => vec![ws(dst)],
            Kernel::Copy { src, dst } | Kernel::Cast { src, dst } => vec![rs(src), ws(dst)],
            Kernel::Binary { a, b, out, .. } => vec![rs(a), rs(b), ws(out)],
            Kernel::Scale { x, out, .. } => vec![rs(x), ws(out)],
            Kernel::Axpy { x, y, .. } => vec![rs(x), ws(y)],
            Kernel::Reduce { src, dst, .. } => vec![rs(src), ws(dst)],
            Kernel::NonFinite { srcs, flag } => srcs.iter_mut().map(rs).chain([ws(flag)]).collect(),
            Kernel::Matmul(mm) => [rs(&mut mm.a), rs(&mut mm.b), ws(&mut mm.c)]
                .into_iter()
                .chain(mm.bias.as_mut().map(rs))
                .chain(mm.c_f32.as_mut().map(ws))
                .collect(),
            Kernel::GradScale {
                sum_squares, out, ..
            } => vec![r(sum_squares), w(out)],
            Kernel::Adam(a) => [ws(&mut a.master), rs(&mut a.grads)]
                .into_iter()
                .chain([ws(&mut a.m), ws(&mut a.v), rs(&mut a.grad_scale)])
                .chain(a.params.as_mut().map(ws))
                .collect(),
            Kernel::Sgd(s) => [ws(&mut s.master), rs(&mut s.grads)]
                .into_iter()
                .chain([ws(&mut s.momentum_buf), rs(&mut s.grad_scale)])
                .chain(s.params.as_mut().map(ws))
                .collect(),
            Kernel::Gelu { x, out } => vec![rs(x), ws(out)],
            Kernel::GeluBackward { x, dout, dx } => vec![rs(x), rs(dout), ws(dx)],
            Kernel::Activation { x, out, .. } => vec![rs(x), ws(out)],
            Kernel::ActivationBackward { x, dout, dx, .. } => vec![rs(x), rs(dout), ws(dx)],
            Kernel::Dropout { x, out, .. } => vec![r(x), w(out)],
            Kernel::DropoutBackward { dout, dx, .. } => vec![r(dout), w(dx)],
            Kernel::MseLoss {
                pred,
                target,
                losses,
                ..
            } => vec![r(pred), r(target), w(losses)],
            Kernel::MseBackward {
                pred,
                target,
                dpred,
                ..
            } => vec![rs(pred), rs(target), ws(dpred)],
            Kernel::LayerNorm {
                x,
                weight,
                bias,
                out,
                mean,
                rstd,
                ..
            } => vec![r(x), r(weight), r(bias), w(out), w(mean), w(rstd)],
            Kernel::LayerNormBackward {
                x,
                weight,
                mean,
                rstd,
                dout,
                dx,
                dweight,
                dbias,
                ..
            } => vec![
                r(x),
                r(weight),
                r(mean),
                r(rstd),
                r(dout),
                w(dx),
                w(dweight),
                w(dbias),
            ],
            Kernel::SplitHeads { src, dst, .. } | Kernel::MergeHeads { src, dst, .. } => {
                vec![r(src), w(dst)]
            }
            Kernel::Softmax { x, out, stats, .. } => vec![r(x), w(out), w(stats)],
            Kernel::SoftmaxBackward {
                p, dout, dx, stats, ..
            } => vec![r(p), r(dout), w(dx), w(stats)],
            Kernel::Attention {
                q, k, v, out, lse, ..
            } => vec![r(q), r(k), r(v), w(out), w(lse)],
            Kernel::AttentionBackward {
                q,
                k,
                v,
                out,
                dout,
                lse,
                dq,
                dk,
                dv,
                ..
            } => vec![
                r(q),
                r(k),
                r(v),
                r(out),
                r(dout),
                r(lse),
                w(dq),
                w(dk),
                w(dv),
            ],
            Kernel::CrossEntropy {
                logits,
                targets,
                losses,
                lse,
                ..
            } => vec![r(logits), r(targets), w(losses), w(lse)],
            Kernel::CrossEntropyBackward {
                logits,
                targets,
                lse,
                dlogits,
                ..
            } => vec![r(logits), r(targets), r(lse), w(dlogits)],
            Kernel::Embedding {
                tokens, table, out, ..
            } => vec![r(tokens), r(table), w(out)],
            Kernel::EmbeddingBackward {
                tokens,
                dout,
                dtable,
                ..
            } => vec![r(tokens), r(dout), ws(dtable)],
            Kernel::RmsNorm {
                x,
                weight,
                out,
                rstd,
                ..
            } => vec![r(x), r(weight), w(out), w(rstd)],
            Kernel::RmsNormBackward {
                x,
                weight,
                rstd,
                dout,
                dx,
                dweight,
                ..
            } => vec![r(x), r(weight), r(rstd), r(dout), w(dx), w(dweight)],
            Kernel::Rope { x, out, .. } => vec![r(x), w(out)],
            Kernel::SwiGlu { gate, up, out } => vec![rs(gate), rs(up), ws(out)],
            Kernel::SwiGluBackward {
                gate,
                up,
                dout,
                dgate,
                dup,
            } => vec![rs(gate), rs(up), rs(dout), ws(dgate), ws(dup)],
            Kernel::RopeAt {
                x, out, positions, ..
            } => vec![r(x), w(out), r(positions)],
            Kernel::CacheWrite {
                src,
                cache,
                positions,
                ..
            } => vec![r(src), w(cache), r(positions)],
            Kernel::CachedAttention {
                q,
                k_cache,
                v_cache,
                positions,
                out,
                ..
            } => vec![r(q), r(k_cache), r(v_cache), r(positions), w(out)],
        }
    }
}

/// One buffer of a launch, as [`Kernel::operands_mut`] lists it.
#[derive(Debug)]
pub struct Operand<'a> {
    pub buf: &'a mut Buffer,
    /// The launch writes it (wholly, or adds into it).
    pub written: bool,
    /// A backend binds it whole: it must fit one storage binding.
    pub whole: bool,
}

impl<'a> Operand<'a> {
    fn read(buf: &'a mut Buffer) -> Operand<'a> {
        Operand {
            buf,
            written: false,
            whole: true,
        }
    }

    fn write(buf: &'a mut Buffer) -> Operand<'a> {
        Operand {
            buf,
            written: true,
            whole: true,
        }
    }

    fn read_split(buf: &'a mut Buffer) -> Operand<'a> {
        Operand {
            buf,
            written: false,
            whole: false,
        }
    }

    fn write_split(buf: &'a mut Buffer) -> Operand<'a> {
        Operand {
            buf,
            written: true,
            whole: false,
        }
    }
}

/// The largest head dim the fused attention kernels take (their rows live in registers).
pub const ATTENTION_MAX_DIM: usize = 128;
