//! Shared test helpers: the GPU paths every kernel must pass on, the CPU oracle,
//! deterministic random data and comparisons with stated tolerances.
#![allow(dead_code)]

use half::{bf16, f16};
use kiln::engine::kernels::{self, AttentionBackward};
use kiln::engine::{Buffer, DType, Device, HostData, Kernel};
use kiln::wgpu::{find_adapter, DeviceOptions, WgpuDevice};

/// A GPU device under test, named for failure messages.
pub struct Path {
    pub name: &'static str,
    pub dev: Box<dyn Device>,
}

/// The environment variables that point the GPU tests at another device than the
/// first of each backend (on a machine with a real GPU beside lavapipe; see
/// scripts/gpu-check.sh): `KILN_TEST_VULKAN`, a wgpu Vulkan adapter as `--devices`
/// names it (`vulkan:1`, or an index from `kiln devices`), and `KILN_TEST_VK`, a raw
/// Vulkan device (`vk:1`).
pub const TEST_VULKAN: &str = "KILN_TEST_VULKAN";
pub const TEST_VK: &str = "KILN_TEST_VK";

/// The wgpu adapter index the tests use for `backend`: for `vulkan`, the one
/// `KILN_TEST_VULKAN` names, if set; otherwise the backend's first.
pub fn adapter_index(backend: &str) -> usize {
    if let Some(spec) = std::env::var(TEST_VULKAN)
        .ok()
        .filter(|_| backend == "vulkan")
    {
        let parsed: kiln::DeviceSpec = spec
            .parse()
            .unwrap_or_else(|e| panic!("{TEST_VULKAN}={spec}: {e}"));
        let index = parsed
            .adapter_index()
            .unwrap_or_else(|e| panic!("{TEST_VULKAN}={spec}: {e}"));
        return index.unwrap_or_else(|| {
            panic!("{TEST_VULKAN}={spec}: name a wgpu Vulkan adapter (e.g. vulkan:1), not cpu")
        });
    }
    find_adapter(backend).unwrap_or_else(|e| panic!("{e}"))
}

/// N of the raw Vulkan device `vk:N` the tests use: `KILN_TEST_VK`'s, else 0.
pub fn vk_index() -> usize {
    let Ok(spec) = std::env::var(TEST_VK) else {
        return 0;
    };
    match spec.parse::<kiln::DeviceSpec>() {
        Ok(kiln::DeviceSpec::Vk(n)) => n,
        _ => panic!("{TEST_VK}={spec}: name a raw Vulkan device as `vk:N` (see `kiln devices`)"),
    }
}

/// Opens a device on the first adapter of `backend` (or the one the environment
/// names, see [`adapter_index`]). No adapter is a test failure, never a skip: a GPU
/// test that silently passes without a GPU proves nothing.
pub fn gpu(backend: &str, disable_f16: bool) -> Box<dyn Device> {
    let index = adapter_index(backend);
    Box::new(
        WgpuDevice::open(
            index,
            &DeviceOptions {
                disable_f16,
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("opening {backend}: {e}")),
    )
}

/// Opens `vk:0`, the first device of the raw Vulkan backend (kiln-vulkan), or the one
/// `KILN_TEST_VK` names. No device is a test failure, never a skip.
pub fn vk(disable_f16: bool) -> Box<dyn Device> {
    Box::new(vk_device(disable_f16))
}

/// [`vk`] as its concrete type (for its GEMM route and counters).
pub fn vk_device(disable_f16: bool) -> kiln::vulkan::VkDevice {
    let n = vk_index();
    kiln::vulkan::VkDevice::open(
        n,
        &DeviceOptions {
            disable_f16,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("opening vk:{n}: {e}"))
}

/// Both f16 paths: Vulkan with native f16, the same adapter with f16 forced off, the
/// GL adapter, which has no SHADER_F16 at all, and the same Vulkan device through
/// the raw Vulkan backend (`vk:0`: the same WGSL kernels as naga's SPIR-V).
pub fn gpu_paths() -> Vec<Path> {
    (0..4).map(gpu_path).collect()
}

/// One of [`gpu_paths`], opened alone. A test that runs long GL work should open only
/// what it uses: every GL device of the adapter shares one context, so GL work of
/// parallel tests takes turns (kiln-wgpu's `context.rs`).
pub fn gpu_path(index: usize) -> Path {
    match index {
        0 => {
            let dev = gpu("vulkan", false);
            assert!(
                dev.caps().f16_arithmetic,
                "the Vulkan adapter `{}` has no native f16; lavapipe should (it needs F16C)",
                dev.caps().name
            );
            Path {
                name: "vulkan (native f16)",
                dev,
            }
        }
        1 => {
            let dev = gpu("vulkan", true);
            assert!(!dev.caps().f16_arithmetic);
            Path {
                name: "vulkan (packed f16)",
                dev,
            }
        }
        2 => {
            let dev = gpu("gl", false);
            assert!(!dev.caps().f16_arithmetic);
            Path {
                name: "gl (packed f16)",
                dev,
            }
        }
        _ => {
            let dev = vk(false);
            assert!(
                dev.caps().f16_arithmetic,
                "the Vulkan device `{}` has no native f16 through kiln-vulkan; lavapipe should",
                dev.caps().name
            );
            Path {
                name: "vk (raw Vulkan, native f16)",
                dev,
            }
        }
    }
}

/// Small deterministic generator (xorshift64*), so failures reproduce.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }
    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32)
    }
    /// f32 with random sign, mantissa bits and a binary exponent in [lo, hi]: every
    /// rounding case of a 16-bit conversion, ties included, shows up often.
    pub fn wide(&mut self, lo: i32, hi: i32) -> f32 {
        let e = lo + (self.next_u32() % (hi - lo + 1) as u32) as i32;
        let bits = ((e + 127) as u32) << 23 | (self.next_u32() & 0x807f_ffff);
        f32::from_bits(bits)
    }
}

/// Values every 16-bit conversion must get right: signed zeros, the f16 limits, the
/// round-to-infinity edge, subnormals of both types, ties, and non-finite values.
pub fn edge_values() -> Vec<f32> {
    vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        65504.0,
        65519.996,
        65520.0,
        -65536.0,
        6.1035156e-5,
        5.9604645e-8,
        2.9802322e-8,
        2.9802326e-8,
        8.940697e-8,
        1.0e-10,
        // Exact ties for f16 (1 + 2^-11, 1 + 3*2^-11) and bf16 (1 + 2^-8, 1 + 3*2^-8).
        f32::from_bits(0x3f80_1000),
        f32::from_bits(0x3f80_3000),
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::MIN_POSITIVE,
        f32::MAX,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ]
}

/// Data of `len` elements: the edge values first (when `edges`), then wide-range values.
pub fn data(dtype: DType, len: usize, seed: u64, edges: bool) -> HostData {
    let mut rng = Rng::new(seed);
    let mut v: Vec<f32> = if edges { edge_values() } else { vec![] };
    v.truncate(len);
    while v.len() < len {
        v.push(rng.wide(-26, 17));
    }
    match dtype {
        DType::U32 => HostData::U32((0..len).map(|_| rng.next_u32()).collect()),
        _ => HostData::from_f32(dtype, &v),
    }
}

/// Finite data in [-2, 2) for arithmetic kernels.
pub fn finite(dtype: DType, len: usize, seed: u64) -> HostData {
    let mut rng = Rng::new(seed);
    let v: Vec<f32> = (0..len).map(|_| rng.uniform(-2.0, 2.0)).collect();
    HostData::from_f32(dtype, &v)
}

/// Allocates and fills a buffer.
pub fn put(dev: &dyn Device, data: &HostData) -> Buffer {
    let b = dev.alloc(data.dtype(), data.len()).expect("alloc");
    dev.upload(b, data).expect("upload");
    b
}

/// C of `m x n x k` (transposes `trans`, all operands `dtype`, C first NaN) on `dev`,
/// with the planner's kernel (`None`) or a pinned one: what the GEMM selection tests
/// compare, block against block and tile against tile.
pub fn pinned_product(
    dev: &WgpuDevice,
    (m, n, k): (usize, usize, usize),
    trans: (bool, bool),
    dtype: DType,
    variant: Option<kiln::wgpu::MatmulVariant>,
) -> HostData {
    let a = put(dev, &finite(dtype, m * k, 1 + m as u64));
    let b = put(dev, &finite(dtype, k * n, 2 + n as u64));
    let c = put(dev, &HostData::from_f32(dtype, &vec![f32::NAN; m * n]));
    let mm = kiln::engine::Matmul::new(a, b, c, m, n, k).transpose(trans.0, trans.1);
    dev.launch_matmul(&mm, variant)
        .unwrap_or_else(|e| panic!("{m}x{n}x{k} {variant:?}: {e}"));
    dev.submit().unwrap();
    let out = dev.download(c).unwrap();
    for buf in [a, b, c] {
        dev.free(buf).unwrap();
    }
    out
}

/// Each of `variants` pinned against the planner's kernel on one case, bit for bit
/// (`pack`: `dev` runs f16 packed, for the message).
pub fn assert_variants_give_the_plan_bits(
    dev: &WgpuDevice,
    (dims, trans, dtype, pack): ((usize, usize, usize), (bool, bool), DType, bool),
    variants: &[kiln::wgpu::MatmulVariant],
) {
    let want = pinned_product(dev, dims, trans, dtype, None);
    for &v in variants {
        let got = pinned_product(dev, dims, trans, dtype, Some(v));
        let what = format!(
            "{} on {dims:?} {trans:?} {dtype:?} (packed f16: {pack})",
            v.name()
        );
        assert_bits_eq(&what, &got, &want);
    }
}

/// Bit-exact equality, except that any NaN matches any NaN (payloads may differ
/// between a native conversion and ours).
pub fn assert_bits_eq(what: &str, got: &HostData, want: &HostData) {
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (g, w) = (got.to_f32(), want.to_f32());
    let (gb, wb) = (got.bits(), want.bits());
    for i in 0..g.len() {
        if g[i].is_nan() && w[i].is_nan() {
            continue;
        }
        assert_eq!(
            gb[i],
            wb[i],
            "{what}: element {i} of {} is {} ({:#x}), expected {} ({:#x})",
            g.len(),
            g[i],
            gb[i],
            w[i],
            wb[i]
        );
    }
}

/// Distance in units in the last place of `dtype` between two finite values of it.
fn ulps(dtype: DType, a: f32, b: f32) -> u64 {
    // Map sign-magnitude bits onto a monotonic integer line.
    let key = |x: f32| -> i64 {
        let (bits, top) = match dtype {
            DType::F16 => (f16::from_f32(x).to_bits() as i64, 1i64 << 15),
            DType::BF16 => (bf16::from_f32(x).to_bits() as i64, 1i64 << 15),
            _ => (x.to_bits() as i64, 1i64 << 31),
        };
        if bits >= top {
            top - bits
        } else {
            bits
        }
    };
    (key(a) - key(b)).unsigned_abs()
}

/// Each element within `max_ulps` units in the last place of the output dtype.
///
/// Elementwise kernels compute in f32 and round once, as the CPU does, so results are
/// usually bit-identical; one ulp is allowed because a GPU compiler may contract
/// `alpha * x + y` into a fused multiply-add, which rounds once where the CPU rounds twice.
pub fn assert_ulps(what: &str, got: &HostData, want: &HostData, max_ulps: u64) {
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (g, w) = (got.to_f32(), want.to_f32());
    for i in 0..g.len() {
        let d = ulps(got.dtype(), g[i], w[i]);
        assert!(
            d <= max_ulps,
            "{what}: element {i} of {} is {} but the CPU gives {} ({d} ulps apart, {max_ulps} allowed)",
            g.len(),
            g[i],
            w[i]
        );
    }
}

/// Runs one launch on a GPU device and on the CPU oracle with the same inputs and
/// returns the contents of `outputs` from both, (gpu, cpu) per output.
pub fn run_both(
    gpu: &dyn Device,
    inputs: &[HostData],
    make: impl Fn(&[Buffer]) -> (Kernel, Vec<usize>),
) -> Vec<(HostData, HostData)> {
    let cpu = kiln::cpu::CpuDevice::new();
    let run = |dev: &dyn Device| -> Vec<HostData> {
        let bufs: Vec<Buffer> = inputs.iter().map(|d| put(dev, d)).collect();
        let (kernel, outs) = make(&bufs);
        dev.launch(&kernel).expect("launch");
        dev.submit().expect("submit");
        let res = outs
            .iter()
            .map(|&i| dev.download(bufs[i]).expect("download"))
            .collect();
        for b in bufs {
            dev.free(b).expect("free");
        }
        res
    };
    let g = run(gpu);
    let c = run(&cpu);
    g.into_iter().zip(c).collect()
}

use kiln::engine::graph::Attention;
use kiln::engine::models::gpt::{Gpt, GptConfig};
use kiln::engine::models::{Network, NetworkOptions};
use kiln::engine::train::trainer::Trainer;
use kiln::engine::{Optimizer, TrainConfig};

/// The tests' usual optimizer: AdamW, lr 1e-2, betas (0.9, 0.95), no weight decay.
pub fn adamw() -> Optimizer {
    Optimizer::adamw(1e-2, 0.0)
}

/// A DeepSpeed config for tests: `adamw()` as DeepSpeed's JSON, the precision of
/// `dtype` (fp16 with its default dynamic scaling), no schedule, no clipping.
pub fn ds_config(micro: usize, accum: usize, dtype: DType, world: usize) -> TrainConfig {
    let precision = match dtype {
        DType::F16 => r#""fp16": {"enabled": true},"#,
        DType::BF16 => r#""bf16": {"enabled": true},"#,
        _ => "",
    };
    kiln::engine::config::parse(
        &format!(
            r#"{{"train_micro_batch_size_per_gpu": {micro}, "gradient_accumulation_steps": {accum},
                {precision} "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01,
                "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}}}}}}"#
        ),
        world,
    )
    .unwrap()
}

/// GPT-2 on sequences of `seq`, attention pinned.
pub fn gpt_model(cfg: &GptConfig, seq: usize, attention: Attention) -> std::sync::Arc<Gpt> {
    std::sync::Arc::new(Gpt::new(cfg.clone(), seq).with_attention(attention))
}

/// A GPT network of micro-batch `b` × `t` in `dtype` with `adamw()`, fused attention
/// and seed 5.
pub fn gpt_network(
    dev: &dyn Device,
    cfg: &GptConfig,
    (b, t): (usize, usize),
    dtype: DType,
) -> Network {
    let options = NetworkOptions {
        batch: b,
        dtype,
        optimizer: adamw(),
        seed: 5,
        packed: false,
    };
    Network::new(dev, gpt_model(cfg, t, Attention::Fused), &options).unwrap()
}

/// A one-device trainer of the same GPT network (`ds_config`'s precision and optimizer,
/// seed 5), `accum` micro-batches of `b` × `t` per step.
pub fn gpt_trainer(
    dev: &dyn Device,
    cfg: &GptConfig,
    (b, t): (usize, usize),
    dtype: DType,
    accum: usize,
) -> Trainer {
    let model = gpt_model(cfg, t, Attention::Fused);
    Trainer::new(dev, model, ds_config(b, accum, dtype, 1), 5).unwrap()
}

/// Every gradient element of every parameter of `g` (bound to `params`, f32 storage)
/// against central differences of `plan`'s forward loss (its per-row losses times
/// `weight`), step 1e-2. The losses are f32 of logits up to ~20 (rounding ~2e-6 each),
/// so over 2h a difference carries ~1e-4 of noise, and O(h^2) curvature stays under 1%
/// at unit-scale values: tolerance 2e-4 + 1% of the difference. `plan` must hold the
/// gradients of one backward at loss scale 1.
pub fn check_finite_differences(
    dev: &dyn Device,
    g: &kiln::engine::graph::Graph,
    params: &[kiln::engine::device::optim::ParamBuffers],
    plan: &kiln::engine::graph::Plan,
    weight: f32,
) {
    let loss = || -> f64 {
        plan.forward(dev).unwrap();
        plan.loss_sum(dev).unwrap() * weight as f64
    };
    let grads: Vec<Vec<f32>> = params
        .iter()
        .map(|p| dev.download(p.grad).unwrap().to_f32())
        .collect();
    let h = 1e-2f32;
    let (mut bad, mut checked) = (vec![], 0);
    for ((decl, p), grad) in g.params().iter().zip(params).zip(&grads) {
        let w = dev.download(p.value).unwrap().to_f32();
        for e in 0..w.len() {
            let mut x = w.clone();
            x[e] = w[e] + h;
            dev.upload(p.value, &HostData::F32(x.clone())).unwrap();
            let up = loss();
            x[e] = w[e] - h;
            dev.upload(p.value, &HostData::F32(x)).unwrap();
            let down = loss();
            dev.upload(p.value, &HostData::F32(w.clone())).unwrap();
            let fd = (up - down) / (2.0 * h as f64);
            if (fd - grad[e] as f64).abs() > 2e-4 + 0.01 * fd.abs() {
                bad.push(format!(
                    "{}[{e}]: finite difference {fd:e}, backward {:e}",
                    decl.name, grad[e]
                ));
            }
            checked += 1;
        }
    }
    assert!(checked > 0);
    assert!(
        bad.is_empty(),
        "{} of {checked} gradients disagree:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

/// Shares a device so the test can reach it while the pipeline owns it.
pub struct Shared<D: Device>(pub std::sync::Arc<D>);

impl<D: Device> Device for Shared<D> {
    fn caps(&self) -> &kiln::engine::Capabilities {
        self.0.caps()
    }
    fn alloc(&self, dtype: DType, len: usize) -> kiln::engine::Result<Buffer> {
        self.0.alloc(dtype, len)
    }
    fn free(&self, buf: Buffer) -> kiln::engine::Result<()> {
        self.0.free(buf)
    }
    fn view(&self, parent: Buffer, offset: usize, len: usize) -> kiln::engine::Result<Buffer> {
        self.0.view(parent, offset, len)
    }
    fn upload(&self, buf: Buffer, data: &HostData) -> kiln::engine::Result<()> {
        self.0.upload(buf, data)
    }
    fn begin_download(&self, buf: Buffer) -> kiln::engine::Result<kiln::engine::PendingDownload> {
        self.0.begin_download(buf)
    }
    fn finish_download(
        &self,
        pending: kiln::engine::PendingDownload,
    ) -> kiln::engine::Result<HostData> {
        self.0.finish_download(pending)
    }
    fn launch(&self, kernel: &Kernel) -> kiln::engine::Result<()> {
        self.0.launch(kernel)
    }
    fn submit(&self) -> kiln::engine::Result<()> {
        self.0.submit()
    }
    fn wait(&self) -> kiln::engine::Result<()> {
        self.0.wait()
    }
    fn allocated_bytes(&self) -> u64 {
        self.0.allocated_bytes()
    }
}

/// A fresh, empty directory under the temp dir for test `prefix`'s `name`.
pub fn scratch_dir(prefix: &str, name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-{prefix}-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Compiled shaders in Mesa's shader cache at `dir` (its index file aside): lavapipe
/// writes one per shader it compiles.
pub fn mesa_cache_entries(dir: &std::path::Path) -> usize {
    let mut n = 0;
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else if p.file_name().is_some_and(|f| f != "index") {
                n += 1;
            }
        }
    }
    n
}

/// Mesa writes its entries from a thread of its own: the count once it stops moving.
pub fn settled_mesa_entries(dir: &std::path::Path) -> usize {
    let mut last = mesa_cache_entries(dir);
    let start = std::time::Instant::now();
    loop {
        std::thread::sleep(std::time::Duration::from_millis(500));
        let now = mesa_cache_entries(dir);
        if now == last || start.elapsed() > std::time::Duration::from_secs(20) {
            return now;
        }
        last = now;
    }
}

/// An f32 GEMM of `m x n x k` on `dev` over finite data, and its output.
pub fn f32_gemm(dev: &dyn Device, (m, n, k): (usize, usize, usize)) -> (Kernel, Buffer) {
    let a = put(dev, &finite(DType::F32, m * k, 1));
    let b = put(dev, &finite(DType::F32, k * n, 2));
    let c = dev.alloc(DType::F32, m * n).unwrap();
    (
        Kernel::Matmul(kiln::engine::Matmul::new(a, b, c, m, n, k)),
        c,
    )
}

/// A causal f32 attention forward and its backward over `heads` heads of `seq` rows of
/// `dim` (inputs from seeds 1-4, scale 1/sqrt(dim)), and their outputs: out, lse, dq,
/// dk, dv.
pub fn causal_attention(
    dev: &dyn Device,
    (heads, seq, dim): (usize, usize, usize),
) -> (Kernel, Kernel, Vec<Buffer>) {
    let len = heads * seq * dim;
    let [q, k, v, dout] = [1, 2, 3, 4].map(|seed| put(dev, &finite(DType::F32, len, seed)));
    let out = dev.alloc(DType::F32, len).unwrap();
    let lse = dev.alloc(DType::F32, heads * seq).unwrap();
    let [dq, dk, dv] = [0; 3].map(|_| dev.alloc(DType::F32, len).unwrap());
    let (scale, causal, group) = (1.0 / (dim as f32).sqrt(), true, 1);
    let fwd = Kernel::Attention(kernels::Attention {
        q,
        k,
        v,
        out,
        lse,
        batch_heads: heads,
        group,
        seq,
        dim,
        scale,
        causal,
        documents: None,
    });
    let bwd = Kernel::AttentionBackward(AttentionBackward {
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
        group,
        seq,
        dim,
        scale,
        causal,
        documents: None,
    });
    (fwd, bwd, vec![out, lse, dq, dk, dv])
}
