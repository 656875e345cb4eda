//! The commands that look before and after training: `kiln devices`, `kiln config`,
//! `kiln runs` and `kiln estimate`.

use anyhow::{bail, Result};

use kiln::engine::parallel::zero::Offload;
use kiln::engine::Device;

use super::args::{ConfigWhat, RunsWhat};

pub(crate) fn estimate(
    model: &std::path::Path,
    (devices, memory_limit): (&[String], Option<&str>),
    config: Option<&std::path::Path>,
    seq: Option<usize>,
    (stages, partition): (Option<usize>, Option<&str>),
    (lora, checkpointing): (Option<&str>, Option<usize>),
) -> Result<()> {
    use kiln::engine::DType;
    // Bad settings are named before anything is read.
    let lora_flag = kiln::estimate::lora_settings(lora, None)?;
    let memory_limit = memory_limit
        .map(|s| kiln::estimate::parse_size("--memory-limit", s))
        .transpose()?;
    // The flag, else the config's (as `kiln train` reads them); an unreadable config
    // is reported when it is loaded below.
    let stages = stages.unwrap_or_else(|| {
        config
            .and_then(|p| std::fs::read_to_string(p).ok())
            .map_or(1, |text| kiln::train::configured_stages(&text))
    });
    if stages <= 1 && partition.is_some() {
        bail!(
            "--partition cuts a model into pipeline stages: give --pipeline-stages 2 or more \
             (or pipeline.stages in the config)"
        );
    }
    let mut method =
        kiln::engine::partition::PartitionMethod::parse(partition.unwrap_or("parameters"))
            .map_err(anyhow::Error::msg)?;
    let m = at_seq(read_model(model)?, seq)?;
    let (world, adapters) = match devices {
        [n] if n.parse::<usize>().is_ok() && memory_limit.is_some() => bail!(
            "--memory-limit checks a run against devices named by spec: add --devices \
             vulkan:0 (or another from `kiln devices`){}",
            match n.as_str() {
                "1" => String::new(),
                n => format!(" instead of the count {n}"),
            }
        ),
        [n] if n.parse::<usize>().is_ok() => (n.parse::<usize>()?.max(1), vec![]),
        specs => {
            let specs = kiln::devices::parse_devices(specs)?;
            let all = kiln::wgpu::adapters();
            let cpu = kiln::cpu::CpuDevice::new();
            // One entry per device, as training would open them.
            let mut caps = vec![];
            for s in &specs {
                if let kiln::DeviceSpec::Vk(n) = s {
                    let vk = kiln::vulkan::physical_devices();
                    let d = vk.get(*n).ok_or_else(|| {
                        anyhow::anyhow!("no Vulkan device vk:{n}: see `kiln devices`")
                    })?;
                    caps.push(d.caps.clone());
                    continue;
                }
                match s.adapter_index()? {
                    None => caps.push(cpu.caps().clone()),
                    Some(i) => caps.push(
                        all.iter()
                            .find(|a| a.index == i)
                            .map(|a| a.caps.clone())
                            .ok_or_else(|| anyhow::anyhow!("no adapter {i}: see `kiln devices`"))?,
                    ),
                }
            }
            let caps = caps
                .into_iter()
                .map(|c| c.with_memory_limit(memory_limit))
                .collect();
            (specs.len(), caps)
        }
    };
    // A pipeline's data-parallel world is its replicas: the config's batch sizes are
    // per replica's step. Checked before the config is read, whose batch sizes would
    // otherwise be resolved for a world that does not exist.
    if stages > 1 && !world.is_multiple_of(stages) {
        bail!(
            "{stages} pipeline stages (--pipeline-stages, else the config's pipeline.stages) \
             do not divide the {world} device(s): a pipeline of p stages takes p devices per \
             data-parallel replica; give a multiple of {stages} devices or another stage count"
        );
    }
    let dp = if stages > 1 { world / stages } else { world };
    let (micro, dtype, accum, zero, lora, checkpointing) = match config {
        Some(path) => {
            let c = kiln::engine::config::load(path, dp)?;
            let checkpointing = checkpointing.or(c.activation_checkpointing);
            if partition.is_none() && stages > 1 {
                method = c.pipeline.partition.clone();
            }
            let offload = Offload {
                optimizer: c.zero.offload_optimizer,
                params: c.zero.offload_param,
            };
            let zero = (c.zero.stage, offload, c.zero.param_persistence_threshold);
            (
                c.batch.micro_batch,
                c.precision.dtype(),
                c.batch.grad_accum,
                zero,
                match lora_flag {
                    Some(l) => Some(l),
                    None => kiln::estimate::lora_settings(None, c.kiln.lora.as_ref())?,
                },
                checkpointing,
            )
        }
        None => {
            let threshold = kiln::engine::config::ZeroConfig::default().param_persistence_threshold;
            (
                1,
                DType::F16,
                1,
                (0, Offload::default(), threshold),
                lora_flag,
                checkpointing,
            )
        }
    };
    if lora.is_some() && stages > 1 {
        bail!(
            "LoRA with pipeline stages is not estimated per stage yet (kiln train trains \
             it): estimate the adapters without --pipeline-stages"
        );
    }
    if checkpointing.is_some() && stages > 1 {
        bail!(
            "activation checkpointing with pipeline stages is not estimated per stage yet \
             (kiln train trains it): estimate it without --pipeline-stages"
        );
    }
    let model = kiln::estimate::adapt(m.build(m.block_size()), lora)?;
    let model: std::sync::Arc<dyn kiln::engine::models::Model> = match checkpointing {
        Some(every) => std::sync::Arc::new(kiln::engine::models::checkpointed::Checkpointed::new(
            model, every,
        )?),
        None => model,
    };
    if stages > 1 {
        out!(
            "{}",
            kiln::estimate::pipeline_report(
                model.as_ref(),
                micro,
                dtype,
                (stages, world, accum),
                &method,
                (zero.0, zero.1.optimizer)
            )?
        );
        return Ok(());
    }
    out!(
        "{}",
        kiln::estimate::report(model.as_ref(), micro, dtype, world, &adapters, zero)?
    );
    Ok(())
}

/// The model at `--seq` as `kiln train --seq` builds it: its block_size becomes the
/// sequence length (a GPT's position table with it), checked the same way.
fn at_seq(
    mut m: kiln::engine::models::ModelConfig,
    seq: Option<usize>,
) -> Result<kiln::engine::models::ModelConfig> {
    if let Some(seq) = seq {
        m.set_seq(seq)?;
    }
    Ok(m)
}

/// The model config `--model` names, read and checked.
fn read_model(model: &std::path::Path) -> Result<kiln::engine::models::ModelConfig> {
    let text = kiln::train::read_json_input(model, "the model config")?;
    let m = kiln::engine::models::ModelConfig::parse(&text)
        .map_err(|e| anyhow::anyhow!("{}: {e}", model.display()))?;
    m.check()
        .map_err(|e| anyhow::anyhow!("{}: {e}", model.display()))?;
    Ok(m)
}

/// `kiln estimate --fits 8GiB,16GiB`: which ways of training the model (full, LoRA,
/// each with activation checkpointing, on 1 device or with ZeRO-2 across 2 and 4) fit
/// devices of those sizes, and the cheapest for each.
pub(crate) fn estimate_fits(
    model: &std::path::Path,
    sizes: &[String],
    config: Option<&std::path::Path>,
    seq: Option<usize>,
    (devices, stages, partition): (&[String], Option<usize>, Option<&str>),
    (lora, checkpointing): (Option<&str>, Option<usize>),
) -> Result<()> {
    use kiln::engine::DType;
    // Bad settings are named before anything is read.
    let sizes = sizes
        .iter()
        .map(|s| {
            Ok((
                s.trim().to_string(),
                kiln::estimate::parse_size("--fits", s)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    if devices.len() != 1 || devices[0] != "1" {
        bail!(
            "--fits compares 1 device with ZeRO-2 across {} devices itself: leave out \
             --devices {}",
            kiln::estimate::FIT_DEVICES[1..]
                .iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(" and "),
            devices.join(",")
        );
    }
    if stages.is_some() || partition.is_some() {
        bail!(
            "--fits compares data-parallel ways of training (ZeRO); leave out \
             --pipeline-stages and --partition (without --fits they give a pipeline's table)"
        );
    }
    let lora_flag = kiln::estimate::lora_settings(lora, None)?;
    let m = at_seq(read_model(model)?, seq)?;
    // The flags, else the config's (as `kiln train` reads them), else micro-batch 1 in
    // fp16, the default LoRA settings and every block checkpointed.
    let (micro, dtype, lora, checkpointing) = match config {
        Some(path) => {
            let c = kiln::engine::config::load(path, 1)?;
            (
                c.batch.micro_batch,
                c.precision.dtype(),
                match lora_flag {
                    Some(l) => Some(l),
                    None => kiln::estimate::lora_settings(None, c.kiln.lora.as_ref())?,
                },
                checkpointing.or(c.activation_checkpointing),
            )
        }
        None => (1, DType::F16, lora_flag, checkpointing),
    };
    let lora = match lora {
        Some(l) => l,
        None => kiln::engine::models::lora::LoraConfig::parse_flag(kiln::estimate::FIT_LORA)?,
    };
    let base = m.build(m.block_size());
    out!(
        "{}",
        kiln::estimate::fits_report(
            base,
            (lora, checkpointing.unwrap_or(1)),
            micro,
            dtype,
            &sizes
        )?
    );
    Ok(())
}

pub(crate) fn config(what: ConfigWhat) -> Result<()> {
    let (ConfigWhat::Check { world, .. } | ConfigWhat::Explain { world, .. }) = &what;
    // The world is a device count: as many as `kiln train` can open.
    if *world > kiln::devices::MAX_DEVICES {
        bail!(
            "--world {world}: Kiln trains on at most {} devices; pass the number of devices \
             the run will use",
            kiln::devices::MAX_DEVICES
        );
    }
    match what {
        ConfigWhat::Check { file, world } => {
            let c = kiln::engine::config::load(&file, world)?;
            // Keys accepted but doing nothing here are worth a line too: a user who set
            // one expects it to act.
            for n in &c.notes {
                outln!("note: {n}");
            }
            for w in &c.warnings {
                outln!("warning: {w}");
            }
            // A pipeline's world is its replicas, each taking one device per stage.
            let p = c.pipeline.stages;
            let stages = if p > 1 {
                format!(
                    "; {p} pipeline stages, partition {}: {} devices",
                    c.pipeline.partition.spelled(),
                    p * c.batch.world
                )
            } else {
                String::new()
            };
            outln!(
                "{}: ok (train_batch_size {} = micro-batch {} × accumulation {} × world {}{stages})",
                file.display(),
                c.batch.train_batch_size,
                c.batch.micro_batch,
                c.batch.grad_accum,
                c.batch.world
            );
        }
        ConfigWhat::Explain { file, world } => {
            out!("{}", kiln::engine::config::load(&file, world)?.explain());
        }
    }
    Ok(())
}

pub(crate) fn runs(what: Option<RunsWhat>, root: &std::path::Path) -> Result<()> {
    use kiln::engine::train::runs;
    match what {
        None => {
            let list = runs::list_runs(root)?;
            if list.is_empty() {
                outln!(
                    "no runs under {} (kiln train writes them there)",
                    root.display()
                );
            } else {
                out!("{}", runs::RunsTable(&list));
            }
        }
        Some(RunsWhat::Diff { a, b }) => out!("{}", runs::diff_runs(&a, &b)?),
    }
    Ok(())
}

/// The `memory` column of `kiln devices`: the device-local heap, and the budget
/// where the driver reports one.
fn memory(c: &kiln::engine::Capabilities) -> String {
    let gib = |b: u64| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64);
    match (c.memory_heap, c.memory_budget) {
        (Some(h), Some(b)) => format!("{} (budget {})", gib(h), gib(b)),
        (Some(h), None) => gib(h),
        (None, Some(b)) => format!("budget {}", gib(b)),
        (None, None) => "-".into(),
    }
}

pub(crate) fn devices(json: bool) -> Result<()> {
    let mut rows = kiln::wgpu::adapters();
    let cpu = kiln::cpu::CpuDevice::new();
    // The raw Vulkan backend's devices, `vk:N`, listed after wgpu's adapters.
    let vk = kiln::vulkan::physical_devices();
    if json {
        let mut list: Vec<serde_json::Value> = rows
            .iter()
            .map(|a| {
                let mut v = serde_json::to_value(a).expect("plain data serializes");
                v["spec"] = a.index.to_string().into();
                v
            })
            .collect();
        for d in &vk {
            let mut v = serde_json::to_value(&d.caps)?;
            v["spec"] = format!("vk:{}", d.index).into();
            list.push(v);
        }
        let mut c = serde_json::to_value(cpu.caps())?;
        c["spec"] = "cpu".into();
        list.push(c);
        outln!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(());
    }
    if rows.is_empty() {
        errln!("No GPU adapter found. {}", kiln::wgpu::NO_ADAPTER_HINT);
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
        "memory",
    ];
    let mut table: Vec<Vec<String>> = vec![header.iter().map(|s| s.to_string()).collect()];
    let caps = rows
        .iter()
        .map(|a| (a.index.to_string(), &a.caps))
        .chain(vk.iter().map(|d| (format!("vk:{}", d.index), &d.caps)))
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
            memory(c),
        ]);
    }
    outln!("{}", kiln::bench::align(&table));
    outln!(
        "memory: the device-local heap the driver reports (Vulkan adapters and vk:N), and \
         the budget this process may use where the driver says (VK_EXT_memory_budget); `-`: \
         not reported. Training refuses at start a run over the budget, else over a GPU's \
         heap (a CPU driver such as lavapipe keeps device memory in host memory, so its heap \
         is nominal); --memory-limit SIZE holds a run to a size of your own."
    );
    Ok(())
}
