//! Choosing devices by name: `cpu`, an adapter index (`0`), a backend (`vulkan`, `gl`),
//! the n-th adapter of a backend (`vulkan:1`), or the n-th Vulkan device through Kiln's
//! raw Vulkan backend (`vk:0`, beside wgpu's `vulkan:0`). See `kiln devices` for the list.

use std::fmt;
use std::str::FromStr;

use kiln_engine::{Device, Error, Result};
use kiln_wgpu::{DeviceOptions, WgpuDevice};

/// A parsed device selector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The CPU reference backend.
    Cpu,
    /// Adapter by its index in `kiln devices`.
    Index(usize),
    /// The `nth` adapter on a wgpu backend (`vulkan`, `gl`, `metal`, `dx12`).
    Backend { backend: String, nth: usize },
    /// The `nth` Vulkan device through the raw Vulkan backend (`vk:N`, kiln-vulkan).
    Vk(usize),
}

const BACKENDS: [&str; 4] = ["vulkan", "gl", "metal", "dx12"];

/// Devices one command opens at most. Each is a device of its own that compiles every
/// kernel it runs (minutes on a CPU adapter): past this, a count is a typo.
pub const MAX_DEVICES: usize = 64;

/// The backends this operating system has, as Kiln's wgpu is built: Vulkan and GL on
/// Windows, Linux and the other Unixes, Metal on Apple's systems, DirectX 12 on Windows.
pub fn os_backends() -> Vec<&'static str> {
    let apple = cfg!(any(target_os = "macos", target_os = "ios"));
    let mut out = vec![];
    if cfg!(windows) || (cfg!(unix) && !apple) {
        out.extend(["vulkan", "gl"]);
    }
    if apple {
        out.push("metal");
    }
    if cfg!(windows) {
        out.push("dx12");
    }
    out
}

/// Why `backend` is not on this operating system, or `None` where it is.
fn missing_backend(backend: &str) -> Option<String> {
    if os_backends().contains(&backend) {
        return None;
    }
    let what = match backend {
        "metal" => "Metal is Apple's GPU API (macOS and iOS)",
        "dx12" => "DirectX 12 is Windows' GPU API",
        "vulkan" => "Kiln reaches Vulkan on Windows, Linux and other Unixes",
        _ => "Kiln reaches GL on Windows, Linux and other Unixes",
    };
    Some(format!(
        "device `{backend}`: {what}; it does not exist on {}. This system's backends: {} \
         (`kiln devices` lists the adapters found, or use `cpu`)",
        std::env::consts::OS,
        os_backends().join(", ")
    ))
}

impl FromStr for DeviceSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim().to_ascii_lowercase();
        if s == "cpu" {
            return Ok(DeviceSpec::Cpu);
        }
        if let Ok(i) = s.parse::<usize>() {
            return Ok(DeviceSpec::Index(i));
        }
        let (name, nth) = match s.split_once(':') {
            Some((n, i)) => (
                n,
                i.parse::<usize>().map_err(|_| {
                    Error::InvalidArgument(format!(
                        "device `{s}`: `{i}` is not an adapter number; write e.g. `{n}:0`"
                    ))
                })?,
            ),
            None => (s.as_str(), 0),
        };
        if name == "vk" {
            return Ok(DeviceSpec::Vk(nth));
        }
        if !BACKENDS.contains(&name) {
            return Err(Error::InvalidArgument(format!(
                "unknown device `{s}`: use `cpu`, an adapter index from `kiln devices`, a backend \
                 ({}) optionally followed by `:N`, or `vk:N` (raw Vulkan)",
                os_backends().join(", ")
            )));
        }
        if let Some(why) = missing_backend(name) {
            return Err(Error::InvalidArgument(why));
        }
        Ok(DeviceSpec::Backend {
            backend: name.to_string(),
            nth,
        })
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Index(i) => write!(f, "{i}"),
            DeviceSpec::Backend { backend, nth } => write!(f, "{backend}:{nth}"),
            DeviceSpec::Vk(n) => write!(f, "vk:{n}"),
        }
    }
}

impl DeviceSpec {
    /// The wgpu adapter index this spec names, or `None` for the CPU.
    pub fn adapter_index(&self) -> Result<Option<usize>> {
        match self {
            DeviceSpec::Cpu => Ok(None),
            DeviceSpec::Vk(_) => Err(Error::InvalidArgument(format!(
                "`{self}` is a raw Vulkan device; this command takes wgpu adapters (`vulkan:N`, \
                 `gl`, an index from `kiln devices`) or `cpu`"
            ))),
            DeviceSpec::Index(i) => Ok(Some(*i)),
            DeviceSpec::Backend { backend, nth } => {
                let all = kiln_wgpu::adapters();
                let matching: Vec<usize> = all
                    .iter()
                    .filter(|a| a.caps.backend == *backend)
                    .map(|a| a.index)
                    .collect();
                matching.get(*nth).copied().map(Some).ok_or_else(|| {
                    if matching.is_empty() {
                        Error::NoAdapter {
                            hint: format!(
                                "no `{backend}` adapter among the {} found. {}",
                                all.len(),
                                kiln_wgpu::NO_ADAPTER_HINT
                            ),
                        }
                    } else {
                        Error::InvalidArgument(format!(
                            "device `{self}`: only {} `{backend}` adapter(s) found (numbered from 0); \
                             run `kiln devices` to list them",
                            matching.len()
                        ))
                    }
                })
            }
        }
    }
}

/// Opens the device a spec names. Each call opens a new, independent device.
pub fn open_device(spec: &DeviceSpec, options: &DeviceOptions) -> Result<Box<dyn Device>> {
    if let DeviceSpec::Vk(n) = spec {
        return Ok(Box::new(kiln_vulkan::VkDevice::open(*n, options)?));
    }
    match spec.adapter_index()? {
        None => Ok(Box::new(kiln_cpu::CpuDevice::new())),
        Some(i) => Ok(Box::new(WgpuDevice::open(i, options)?)),
    }
}

/// A device group from `--devices` items: each a spec (`vulkan:0`, `1`, `gl`, `cpu`),
/// an adapter name or part of one (`llvmpipe`), `all` (every adapter), optionally
/// followed by `xN` for N independent devices on that adapter (`vulkan:0x2`), which is
/// how multi-device training is tested on one machine.
pub fn parse_devices(items: &[String]) -> Result<Vec<DeviceSpec>> {
    let mut out = vec![];
    if items.iter().all(|i| i.trim().is_empty()) {
        return Err(Error::InvalidArgument(
            "--devices is empty: name at least one device, e.g. `--devices vulkan`, \
             `--devices vk:0,gl` or `--devices cpu` (`kiln devices` lists them), or leave \
             the option out for the best adapter"
                .into(),
        ));
    }
    for item in items {
        let item = item.trim();
        if item.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "an empty device name in `{}`: remove the stray comma",
                items.join(",")
            )));
        }
        // The whole item first, so that names holding an `x` (`dx12`) stay names.
        let (specs, copies) = match resolve(item) {
            Ok(specs) => (specs, 1),
            Err(e) => match item.rsplit_once(['x', 'X']) {
                Some((s, n))
                    if !s.is_empty() && !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()) =>
                {
                    let n: usize = n.parse().map_err(|_| {
                        Error::InvalidArgument(format!("device `{item}`: `{n}` is not a count"))
                    })?;
                    if n == 0 {
                        return Err(Error::InvalidArgument(format!(
                            "device `{item}`: x0 asks for no device; write x1 or more"
                        )));
                    }
                    if n > MAX_DEVICES {
                        return Err(too_many(items, n));
                    }
                    (resolve(s)?, n)
                }
                _ => return Err(e),
            },
        };
        let total = out.len() + specs.len() * copies;
        if total > MAX_DEVICES {
            return Err(too_many(items, total));
        }
        for _ in 0..copies {
            out.extend(specs.iter().cloned());
        }
    }
    Ok(out)
}

/// More devices than one command opens.
fn too_many(items: &[String], n: usize) -> Error {
    Error::InvalidArgument(format!(
        "`{}` names {n} devices; Kiln opens at most {MAX_DEVICES} (each device compiles every \
         kernel it runs, minutes on a CPU adapter). Several devices on one adapter only test \
         multi-device code: name a few (`vulkan:0x2`), or one per GPU",
        items.join(",")
    ))
}

/// `all`, a spec, or an adapter name.
fn resolve(spec: &str) -> Result<Vec<DeviceSpec>> {
    if spec.eq_ignore_ascii_case("all") {
        let all: Vec<DeviceSpec> = kiln_wgpu::adapters()
            .iter()
            .map(|a| DeviceSpec::Index(a.index))
            .collect();
        if all.is_empty() {
            return Err(Error::NoAdapter {
                hint: kiln_wgpu::NO_ADAPTER_HINT.to_string(),
            });
        }
        return Ok(all);
    }
    match spec.parse::<DeviceSpec>() {
        Ok(s) => Ok(vec![s]),
        Err(e) => Ok(vec![by_name(spec).ok_or(e)??]),
    }
}

/// The one adapter whose name contains `name` (case-insensitive); `None` if none does.
fn by_name(name: &str) -> Option<Result<DeviceSpec>> {
    let lower = name.to_ascii_lowercase();
    let hits: Vec<_> = kiln_wgpu::adapters()
        .into_iter()
        .filter(|a| a.caps.name.to_ascii_lowercase().contains(&lower))
        .collect();
    match hits.len() {
        0 => None,
        1 => Some(Ok(DeviceSpec::Index(hits[0].index))),
        _ => Some(Err(Error::InvalidArgument(format!(
            "device `{name}` matches {} adapters ({}); name one by index or backend \
             (`kiln devices` lists them)",
            hits.len(),
            hits.iter()
                .map(|a| format!("{}: {} ({})", a.index, a.caps.name, a.caps.backend))
                .collect::<Vec<_>>()
                .join(", ")
        )))),
    }
}

/// The adapter to train on when none is named: discrete GPUs first, then integrated,
/// virtual and CPU adapters (lavapipe); Vulkan before other backends of the same kind.
/// No adapter at all is an error with the install hint, never a silent switch to the
/// CPU reference backend.
pub fn default_device() -> Result<DeviceSpec> {
    let rank = |t: &str| match t {
        "discrete" => 0,
        "integrated" => 1,
        "virtual" => 2,
        "cpu" => 3,
        _ => 4,
    };
    kiln_wgpu::adapters()
        .iter()
        .min_by_key(|a| {
            (
                rank(&a.caps.device_type),
                a.caps.backend != "vulkan",
                a.index,
            )
        })
        .map(|a| DeviceSpec::Index(a.index))
        .ok_or_else(|| Error::NoAdapter {
            hint: kiln_wgpu::NO_ADAPTER_HINT.to_string(),
        })
}

/// Turns off Mesa's device-select Vulkan layer for this process, unless the user set
/// `NODEVICE_SELECT` themselves. The layer reorders adapters (Kiln lists and picks them
/// itself) and, on machines without a display, prints "XDG_RUNTIME_DIR is invalid"
/// errors that are not errors. Call it first thing in `main`, before any thread starts.
pub fn quiet_device_select() {
    if std::env::var_os("NODEVICE_SELECT").is_none() {
        std::env::set_var("NODEVICE_SELECT", "1");
    }
}
