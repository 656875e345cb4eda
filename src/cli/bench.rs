//! `kiln bench`: kernel throughput (matmul, attention), data-parallel and pipeline
//! scaling, generation, a training step and the device's peak.

use anyhow::{bail, Result};

use kiln::engine::Device;

use super::args::{
    AttentionArgs, BenchSampleArgs, DpArgs, MatmulArgs, PeakArgs, PipelineBenchArgs, ReportArgs,
    TrainBenchArgs,
};

pub(crate) fn bench_pipeline(a: PipelineBenchArgs) -> Result<()> {
    use kiln::bench_pipeline::{format_rows, measure, GpuBox};
    // Every argument is checked before anything compiles or runs.
    let model = kiln::bench_train::bench_model(&a.model, a.micro_batch)?;
    let gpus = GpuBox {
        gpu_speedup: a.gpu_speedup,
        link_gbps: a.link_gbps,
        latency_us: a.link_latency_us,
    };
    gpus.check()?;
    let spec: kiln::DeviceSpec = a.device.parse()?;
    let Some(adapter) = spec.adapter_index()? else {
        anyhow::bail!(
            "--device {}: the stages run on a GPU adapter (`kiln devices`), not the CPU reference",
            a.device
        );
    };
    if a.stages.is_empty() || a.stages.contains(&0) {
        anyhow::bail!("--stages: give stage counts of 1 or more, e.g. 1,2,4");
    }
    if a.micro_batches.contains(&0) {
        anyhow::bail!("--micro-batches: a step needs at least one micro-batch");
    }
    let mut runs = vec![];
    for &p in &a.stages {
        let ms = if a.micro_batches.is_empty() {
            let mut v = vec![p, 4 * p];
            v.dedup();
            v
        } else {
            a.micro_batches.clone()
        };
        runs.extend(ms.into_iter().map(|m| (p, m)));
    }
    let mut rows = vec![];
    for (p, m) in runs {
        errln!(
            "kiln bench pipeline: {} in {p} stage(s), {m} micro-batch(es) per step",
            model.name
        );
        if p > 1 && m < 4 * p {
            errln!(
                "  m = {m} < 4p = {}: the schedule idles {:.0}% of each stage's step",
                4 * p,
                100.0 * kiln::engine::parallel::pipeline_schedule::theoretical_bubble(p, m)
            );
        }
        rows.push(measure(adapter, &model, p, m, a.steps, &gpus)?);
    }
    if let Some(r) = rows.first() {
        outln!(
            "{} on {} (each stage its own device on this adapter), fp32, micro-batch {}",
            r.model,
            r.adapter,
            model.micro_batch
        );
    }
    outln!("{}", format_rows(&rows));
    outln!(
        "model: one GPU per stage computing the measured forward + backward (split 1 : 2) \
         {} times faster, 1F1B, copies staged through the host over {} GB/s links \
         ({} µs each), overlapping compute; the optimizer step not included",
        gpus.gpu_speedup,
        gpus.link_gbps,
        gpus.latency_us
    );
    if let Some(path) = a.json {
        kiln::bench::write_json(&rows, &path)?;
    }
    Ok(())
}

pub(crate) fn bench_dp(a: DpArgs) -> Result<()> {
    use kiln::bench_dp::{check_bandwidth, dp_table, modelled_efficiency};
    use kiln::engine::models::gpt::{Gpt, GptConfig};
    // Before minutes of measuring: the model's inputs.
    if a.offload && a.zero == 0 {
        bail!(
            "--offload keeps each rank's shard of the optimizer state in host memory: add \
             --zero 1, 2 or 3"
        );
    }
    if a.offload_param && a.zero != 3 {
        bail!(
            "--offload-param offloads stage 3's parameter copies: add --zero 3 (below it every \
             device holds every weight it computes with)"
        );
    }
    check_bandwidth("pcie-gbps", a.pcie_gbps)?;
    check_bandwidth("host-gbps", a.host_gbps)?;
    let model: GptConfig = match &a.model {
        Some(p) => {
            let text = kiln::train::read_json_input(p, "the model config")?;
            match kiln::engine::models::ModelConfig::parse(&text) {
                Ok(kiln::engine::models::ModelConfig::Gpt2(c)) => c,
                Ok(_) => bail!("{}: bench dp measures GPT-2 models", p.display()),
                Err(e) => bail!("{}: {e}", p.display()),
            }
        }
        None => GptConfig {
            n_layer: 4,
            n_head: 4,
            n_embd: 128,
            block_size: 64,
            vocab_size: 512,
            padded_vocab_size: None,
        },
    };
    let spec: kiln::DeviceSpec = a.device.parse()?;
    let adapter = spec
        .adapter_index()?
        .ok_or_else(|| anyhow::anyhow!("bench dp groups devices of a GPU adapter, not `cpu`"))?;
    #[cfg(feature = "mpi")]
    if kiln::engine::parallel::collective::launched_by_mpirun() {
        return bench_dp_mpi(&a, adapter, &model);
    }
    let zero = kiln::bench_dp::Zero {
        stage: a.zero,
        offload: a.offload,
        offload_param: a.offload_param,
        persistence_threshold: a.persistence_threshold,
    };
    let rows = dp_table(
        adapter,
        &model,
        a.micro,
        &a.counts,
        (a.steps, !a.no_overlap),
        zero,
    )?;
    outln!(
        "kiln bench dp: GPT {} layers {} embd T {} vocab {}, Ψ = {}, fp16, micro-batch {} per \
         device, ZeRO stage {}{}",
        model.n_layer,
        model.n_embd,
        model.block_size,
        model.vocab_size,
        model.parameter_count(),
        a.micro,
        a.zero,
        match (a.offload, a.offload_param) {
            (true, false) => ", optimizer state offloaded to host memory",
            (true, true) => ", optimizer state and parameter copies offloaded to host memory",
            (false, true) => ", parameter copies offloaded to host memory",
            (false, false) => "",
        }
    );
    outln!(
        "{:<34} {:>7} {:>9} {:>9} {:>8} {:>10} {:>10} {:>10} {:>10} {:>16} {:>18}",
        "adapter",
        "devices",
        "step ms",
        "comm ms",
        "overlap",
        "MB/step",
        "samples/s",
        "vs 1 dev",
        "device MB",
        "host step ms",
        "weight loads ms"
    );
    let base = rows.first().map_or(1.0, |r| r.samples_per_s);
    for r in &rows {
        outln!(
            "{:<34} {:>7} {:>9.1} {:>9.1} {:>7.0}% {:>10.2} {:>10.1} {:>9.2}x {:>10.2} {:>16} {:>18}",
            r.adapter,
            r.devices,
            r.step_ms,
            r.comm_ms,
            r.overlap * 100.0,
            r.bytes_per_step as f64 / 1e6,
            r.samples_per_s,
            r.samples_per_s / base,
            r.device_bytes as f64 / 1e6,
            if a.offload {
                format!("{:.1} ({:.1} exp.)", r.offload_ms, r.offload_exposed_ms)
            } else {
                "-".into()
            },
            if a.zero == 3 {
                format!("{:.1} ({:.0}% hid.)", r.gather_ms, r.gather_hidden * 100.0)
            } else {
                "-".into()
            }
        );
    }
    // All devices here share one adapter (and on lavapipe its CPU cores), so these rows
    // measure overhead, not scaling; the model below is what separate GPUs would see.
    let compute_ms = rows
        .iter()
        .find(|r| r.devices == 1)
        .map_or(rows[0].step_ms - rows[0].comm_ms, |r| r.step_ms);
    let overlap = rows
        .iter()
        .filter(|r| r.devices > 1)
        .map(|r| r.overlap)
        .fold(0.0, f64::max);
    let gpt = Gpt::new(model.clone(), model.block_size);
    let grads =
        kiln::estimate::network_memory(&gpt, a.micro, kiln::engine::DType::F16)?.gradients as f64;
    outln!(
        "modelled for separate GPUs: compute {compute_ms:.1} ms/step (measured, 1 device), \
         {:.2} MB of gradients per GPU, PCIe {} GB/s each way, host adds at {} GB/s, \
         overlap {:.0}% (measured)",
        grads / 1e6,
        a.pcie_gbps,
        a.host_gbps,
        overlap * 100.0
    );
    for n in [2, 4, 8] {
        outln!(
            "  {n} GPUs: scaling efficiency {:.1}%",
            100.0 * modelled_efficiency(n, compute_ms, grads, a.pcie_gbps, a.host_gbps, overlap)
        );
    }
    Ok(())
}

/// `kiln bench dp` under mpirun: every process drives `--counts` devices (one number)
/// of the adapter; process 0 prints the job's step, its exchange between processes,
/// and the scaling modelled for a network from the measured compute time.
#[cfg(feature = "mpi")]
fn bench_dp_mpi(
    a: &DpArgs,
    adapter: usize,
    model: &kiln::engine::models::gpt::GptConfig,
) -> Result<()> {
    use kiln::bench_dp::{check_bandwidth, dp_processes, modelled_network_efficiency};
    use kiln::engine::parallel::collective::Processes;
    check_bandwidth("net-gbps", a.net_gbps)?;
    if !(a.net_latency_us.is_finite() && a.net_latency_us >= 0.0) {
        bail!(
            "--net-latency-us {}: a latency is a number of µs, 0 or more",
            a.net_latency_us
        );
    }
    let [local] = a.counts[..] else {
        bail!(
            "under mpirun --counts is the number of devices each process drives (one number, \
             e.g. --counts 1); the job's size is mpirun's -np"
        );
    };
    let session = kiln::engine::parallel::mpi::MpiSession::init()?;
    let comm = session.collective();
    let rank = comm.rank();
    let run = || -> Result<()> {
        let procs = Processes::new(comm.clone(), local)?;
        let p = procs.devices.len();
        let overlap = !a.no_overlap;
        let zero = kiln::bench_dp::Zero {
            stage: a.zero,
            offload: a.offload,
            offload_param: a.offload_param,
            persistence_threshold: a.persistence_threshold,
        };
        let r = dp_processes(
            adapter,
            model,
            a.micro,
            local,
            (a.steps, overlap, zero),
            a.bucket,
            procs,
        )?;
        if rank != 0 {
            return Ok(());
        }
        outln!(
            "kiln bench dp (MPI): GPT {} layers {} embd T {} vocab {}, Ψ = {}, fp16, micro-batch \
             {} per device, {p} processes × {local} device(s) of {}",
            model.n_layer,
            model.n_embd,
            model.block_size,
            model.vocab_size,
            model.parameter_count(),
            a.micro,
            r.adapter
        );
        outln!(
            "step {:.1} ms, exchange {:.1} ms exposed, {:.0}% of the processes' exchange \
             overlapped with backward, {:.2} MB/step between processes (process 0), {:.1} \
             samples/s",
            r.step_ms,
            r.comm_ms,
            r.overlap * 100.0,
            r.process_bytes_per_step as f64 / 1e6,
            r.samples_per_s
        );
        // The f32 gradients the processes sum, and the compute one GPU per process
        // would do: the measured step less its exposed exchange.
        let grads = 4.0 * model.parameter_count() as f64;
        let compute_ms = (r.step_ms - r.comm_ms).max(0.0);
        let bucket = a.bucket as f64 * 4.0;
        outln!(
            "modelled for one GPU per process on a network of {} GB/s and {} µs per message: \
             compute {compute_ms:.1} ms/step (measured), {:.2} MB of f32 gradients in buckets \
             of {} elements, overlap {:.0}% (measured)",
            a.net_gbps,
            a.net_latency_us,
            grads / 1e6,
            a.bucket,
            r.overlap * 100.0
        );
        for n in [2, 4, 8, 16, 64] {
            outln!(
                "  {n} processes: scaling efficiency {:.1}%",
                100.0
                    * modelled_network_efficiency(
                        n,
                        compute_ms,
                        grads,
                        bucket,
                        a.net_gbps,
                        a.net_latency_us,
                        r.overlap
                    )
            );
        }
        Ok(())
    };
    match run() {
        Ok(()) => {
            drop(session);
            Ok(())
        }
        Err(e) => {
            errln!("error (process {rank}): {e:#}");
            comm.abort(1);
            Err(e)
        }
    }
}

/// The adapters `--devices` names (default: all), opened.
fn bench_devices(
    devices: &[String],
    options: &kiln::wgpu::DeviceOptions,
) -> Result<Vec<kiln::wgpu::WgpuDevice>> {
    let indices: Vec<usize> = if devices.is_empty() {
        kiln::wgpu::adapters().iter().map(|a| a.index).collect()
    } else {
        devices
            .iter()
            .map(|d| {
                let spec: kiln::DeviceSpec = d.parse()?;
                spec.adapter_index()?.ok_or_else(|| {
                    anyhow::anyhow!("`cpu` is the reference backend, not a benchmarked device")
                })
            })
            .collect::<Result<_>>()?
    };
    if indices.is_empty() {
        anyhow::bail!("no GPU adapter found. {}", kiln::wgpu::NO_ADAPTER_HINT);
    }
    Ok(indices
        .iter()
        .map(|&i| kiln::wgpu::WgpuDevice::open(i, options))
        .collect::<Result<Vec<_>, _>>()?)
}

/// The devices `--devices` names (default: every wgpu adapter), opened: wgpu adapters
/// and the raw Vulkan backend's `vk:N`, in the order given, for the benches that run
/// through the `Device` trait alone and so compare both backends side by side.
fn bench_any_devices(
    devices: &[String],
    options: &kiln::wgpu::DeviceOptions,
) -> Result<Vec<Box<dyn kiln::engine::Device>>> {
    if devices.is_empty() {
        return Ok(bench_devices(devices, options)?
            .into_iter()
            .map(|d| Box::new(d) as Box<dyn kiln::engine::Device>)
            .collect());
    }
    devices
        .iter()
        .map(|d| match d.parse::<kiln::DeviceSpec>()? {
            kiln::DeviceSpec::Vk(n) => Ok(Box::new(kiln::vulkan::VkDevice::open(n, options)?)
                as Box<dyn kiln::engine::Device>),
            _ => Ok(
                Box::new(bench_devices(std::slice::from_ref(d), options)?.remove(0))
                    as Box<dyn kiln::engine::Device>,
            ),
        })
        .collect()
}

pub(crate) fn bench_peak(args: PeakArgs) -> Result<()> {
    use kiln::profile::{format_peaks, measure_peak, store_peaks};
    let devs = bench_devices(&args.devices, &Default::default())?;
    let mut rows = vec![];
    for dev in &devs {
        errln!("kiln bench peak: {}", dev.caps().name);
        rows.push(measure_peak(dev)?);
    }
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        out!("{}", format_peaks(&rows));
    }
    let path = store_peaks(&rows)?;
    errln!("cached in {}", path.display());
    Ok(())
}

pub(crate) fn bench_report(a: ReportArgs) -> Result<()> {
    let models = match (a.models.is_empty(), a.quick) {
        (false, _) => a.models,
        (true, true) => vec!["demo".into()],
        (true, false) => ["demo", "small", "smollm2-135m"].map(String::from).to_vec(),
    };
    let opts = kiln::bench_report::ReportOptions {
        devices: a.devices,
        budget: std::time::Duration::from_millis(a.budget_ms),
        quick: a.quick,
        models,
        out: a.out,
        command: std::env::args().collect::<Vec<_>>().join(" "),
    };
    let r = kiln::bench_report::run(&opts, |line| errln!("kiln bench report: {line}"))?;
    out!("{}", kiln::bench_report::markdown(&r));
    errln!(
        "wrote {0}/report.md, {0}/report.json and {0}/report.svg",
        opts.out.display()
    );
    Ok(())
}

pub(crate) fn bench_train(a: TrainBenchArgs) -> Result<()> {
    use kiln::bench_train::{bench_model, format_table, measure, precision_config};
    // Every argument is checked before anything compiles or runs.
    let models = a
        .model
        .iter()
        .map(|m| bench_model(m, a.micro_batch))
        .collect::<Result<Vec<_>>>()?;
    for p in &a.precision {
        precision_config(p)?;
    }
    if let Some(t) = a.peak_tflops.filter(|t| !(t.is_finite() && *t > 0.0)) {
        anyhow::bail!("--peak-tflops {t}: give the device's peak as a positive number");
    }
    let variants = kiln::bench_train::variants(&a.variants, a.activation_checkpointing)?;
    let lora = kiln::engine::models::lora::LoraConfig::parse_flag(&a.lora)?;
    let options = kiln::wgpu::DeviceOptions {
        memory_limit: a
            .memory_limit
            .as_deref()
            .map(|s| kiln::estimate::parse_size("--memory-limit", s))
            .transpose()?,
        ..Default::default()
    };
    let devs = bench_any_devices(&a.devices, &options)?;
    let mut opts = kiln::bench_train::TrainBenchOptions {
        variant: variants[0],
        lora,
        steps: a.steps,
        gemm_budget: std::time::Duration::from_millis(a.gemm_budget_ms),
        peak_tflops: a.peak_tflops,
    };
    let mut rows = vec![];
    for model in &models {
        for dev in &devs {
            for p in &a.precision {
                for &variant in &variants {
                    errln!(
                        "kiln bench train: {} on {} ({}) at {p}, {}",
                        model.name,
                        dev.caps().name,
                        dev.caps().backend,
                        variant.name()
                    );
                    opts.variant = variant;
                    rows.push(measure(dev.as_ref(), model, p, &opts)?);
                }
            }
        }
    }
    if rows.iter().any(|r| r.mfu.is_none()) {
        errln!("MFU needs the adapter's peak: run `kiln bench peak` once, or pass --peak-tflops");
    }
    match &a.json {
        Some(path) => kiln::bench::write_json(&rows, path)?,
        None => outln!("{}", format_table(&rows)),
    }
    Ok(())
}

pub(crate) fn bench_sample(args: BenchSampleArgs) -> Result<()> {
    use kiln::bench_sample::{format_sample, measure, model_by_name};
    let dtype: kiln::engine::DType = args.dtype.parse()?;
    if !dtype.is_float() {
        anyhow::bail!("generation takes f32, f16 or bf16, not {dtype}");
    }
    if args.prompt == 0 || args.tokens == 0 {
        anyhow::bail!(
            "--prompt {} --tokens {}: both must be at least 1 (there is no rate of nothing)",
            args.prompt,
            args.tokens
        );
    }
    let models = args
        .models
        .iter()
        .map(|m| {
            let mut cfg = model_by_name(m)?;
            cfg.n_layer = args.layers.unwrap_or(cfg.n_layer);
            Ok((m.as_str(), cfg))
        })
        .collect::<Result<Vec<_>>>()?;
    let options = kiln::wgpu::DeviceOptions {
        disable_f16: args.no_f16,
        ..Default::default()
    };
    let devs = bench_any_devices(&args.devices, &options)?;
    let mut rows = vec![];
    for dev in &devs {
        for (name, cfg) in &models {
            // A short block (the addition demo's 9: a 6-token problem `47+85=` and its
            // 3-token answer) gives a third to decoding and the rest to the prompt.
            let decode = args.tokens.min(cfg.block_size / 3).max(1);
            let prompt = args.prompt.min(cfg.block_size - decode).max(1);
            errln!(
                "kiln bench sample: {} on {}, {dtype}, {prompt} prompt + {decode} decoded tokens",
                name,
                dev.caps().name
            );
            match measure(dev.as_ref(), name, cfg, dtype, prompt, decode) {
                Ok(r) => {
                    errln!(
                        "  prompt {:.1} tok/s, decode {:.1} tok/s (setup {:.1} s)",
                        r.prompt_tok_s,
                        r.decode_tok_s,
                        r.setup_s
                    );
                    rows.push(r);
                }
                Err(e) => errln!("  cannot run: {e}"),
            }
        }
    }
    outln!("{}", format_sample(&rows));
    if let Some(path) = args.json {
        kiln::bench::write_json(&rows, &path)?;
    }
    Ok(())
}

pub(crate) fn bench_attention(args: AttentionArgs) -> Result<()> {
    use kiln::bench::{attention_table, format_attention};
    let dtype: kiln::engine::DType = args.dtype.parse()?;
    if !dtype.is_float() {
        anyhow::bail!("attention takes f32, f16 or bf16, not {dtype}");
    }
    let options = kiln::wgpu::DeviceOptions {
        disable_f16: args.no_f16,
        ..Default::default()
    };
    let devs = bench_any_devices(&args.devices, &options)?;
    errln!(
        "kiln bench attention: {} device(s), causal, B*H = {}, d = {}, {dtype}, T = {:?}",
        devs.len(),
        args.heads,
        args.dim,
        args.seqs
    );
    let mut rows = vec![];
    for dev in &devs {
        rows.extend(attention_table(
            dev.as_ref(),
            dtype,
            args.heads,
            args.dim,
            &args.seqs,
            std::time::Duration::from_millis(args.budget_ms),
            |r| {
                let straight = match (r.straight_ms, r.speedup, r.straight_bytes) {
                    (Some(ms), Some(x), Some(b)) => format!("{ms:.2} ms ({x:.2}x), {b} bytes"),
                    _ => "cannot run: its T x T scores exceed the binding limit".into(),
                };
                errln!(
                    "  {} ({}) T={}: fused {:.2} ms, {} bytes; straightforward {straight}",
                    r.adapter,
                    r.backend,
                    r.seq,
                    r.fused_ms,
                    r.fused_bytes
                )
            },
        )?);
    }
    outln!("{}", format_attention(&rows));
    if let Some(path) = args.json {
        kiln::bench::write_json(&rows, &path)?;
    }
    Ok(())
}

pub(crate) fn bench_matmul(args: MatmulArgs) -> Result<()> {
    let MatmulArgs {
        devices,
        dtypes,
        sizes,
        budget_ms,
        naive_up_to,
        no_f16,
        variants,
        spirv,
        json,
    } = args;
    use kiln::bench::{default_shapes, format_table, matmul_table, Shape};
    use kiln::engine::DType;
    use kiln::wgpu::{DeviceOptions, WgpuDevice};

    let options = DeviceOptions {
        disable_f16: no_f16,
        ..Default::default()
    };
    // wgpu adapters, and raw Vulkan devices (`vk:N`: the planner's WGSL GEMM as naga
    // SPIR-V, timed through the Device trait).
    let (mut indices, mut vk_indices) = (vec![], vec![]);
    if devices.is_empty() {
        indices = kiln::wgpu::adapters().iter().map(|a| a.index).collect();
    }
    for d in &devices {
        match d.parse::<kiln::DeviceSpec>()? {
            kiln::DeviceSpec::Vk(n) => vk_indices.push(n),
            spec => indices.push(spec.adapter_index()?.ok_or_else(|| {
                anyhow::anyhow!("`cpu` is the reference, not a benchmarked device; it is measured as `cpu GFLOP/s` in every row")
            })?),
        }
    }
    if indices.is_empty() && vk_indices.is_empty() {
        anyhow::bail!("no GPU adapter found. {}", kiln::wgpu::NO_ADAPTER_HINT);
    }
    let vk_devs = vk_indices
        .iter()
        .map(|&n| Ok(kiln::vulkan::VkDevice::open(n, &options)?))
        .collect::<Result<Vec<_>>>()?;
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
    let spirv_devs = if spirv {
        let vulkan: Vec<(usize, &WgpuDevice)> = indices
            .iter()
            .copied()
            .zip(&devs)
            .filter(|(_, d)| d.caps().backend == "vulkan")
            .collect();
        if vulkan.is_empty() {
            anyhow::bail!("--spirv runs the SPIR-V GEMM on Vulkan devices, and none is benchmarked (add --devices vulkan)");
        }
        vulkan
            .into_iter()
            .map(|(i, d)| Ok((d.caps().name.clone(), kiln::wgpu::SpirvMatmul::open(i)?)))
            .collect::<Result<Vec<_>>>()?
    } else {
        vec![]
    };
    let extra = variants
        .iter()
        .map(|v| v.parse::<kiln::wgpu::MatmulVariant>())
        .collect::<Result<Vec<_>, _>>()?;
    let shapes = if sizes.is_empty() {
        default_shapes()
    } else {
        sizes.into_iter().map(Shape::square).collect()
    };
    errln!(
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
        &kiln::bench::Runs {
            naive_up_to,
            extra: &extra,
            spirv: &spirv_devs,
            vk: &vk_devs,
        },
        |r| {
            errln!(
                "  {} {} {}x{}x{} {} {}: {:.2} GFLOP/s (cpu {:.1}, ratio {:.3})",
                r.backend,
                r.dtype,
                r.m,
                r.n,
                r.k,
                r.op,
                r.variant,
                r.gflops,
                r.cpu_gflops,
                r.ratio
            )
        },
    )?;
    outln!("{}", format_table(&rows));
    if let Some(path) = json {
        kiln::bench::write_json(&rows, &path)?;
    }
    Ok(())
}
