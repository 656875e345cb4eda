//! WGSL assembly: a kernel file from `shaders/` plus generated typed bindings.
//!
//! WGSL has no generics, so a kernel body is written once against accessor
//! functions (`x_load(w) -> vec2<f32>`, `y_store(w, v)`) and the host prepends, per
//! launch dtype, the binding and accessors from `shaders/dtype/*.wgsl`. One kernel
//! file thus serves f32, native f16, packed f16 and bf16 operands in any mix.

use kiln_engine::DType;

macro_rules! shader {
    ($path:literal) => {
        include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../shaders/",
            $path
        ))
    };
}

const PARAMS: &str = shader!("common/params.wgsl");
const CONVERT: &str = shader!("common/convert.wgsl");

/// How a binding is accessed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    Read,
    ReadWrite,
}

/// A binding after the params uniform (binding 0): either typed — declared here from
/// the launch dtype — or declared by the kernel file itself.
#[derive(Clone, Copy, Debug)]
pub struct Slot {
    pub name: &'static str,
    pub access: Access,
    pub typed: bool,
}

/// A kernel file and the bindings it expects, in binding order from 1.
#[derive(Debug)]
pub struct KernelSource {
    pub file: &'static str,
    pub body: &'static str,
    pub slots: &'static [Slot],
}

const fn typed(name: &'static str, access: Access) -> Slot {
    Slot {
        name,
        access,
        typed: true,
    }
}

const fn own(name: &'static str, access: Access) -> Slot {
    Slot {
        name,
        access,
        typed: false,
    }
}

use Access::{Read, ReadWrite};

pub const FILL: KernelSource = KernelSource {
    file: "fill.wgsl",
    body: shader!("fill.wgsl"),
    slots: &[own("dst", ReadWrite)],
};
pub const CAST: KernelSource = KernelSource {
    file: "cast.wgsl",
    body: shader!("cast.wgsl"),
    slots: &[typed("src", Read), typed("dst", ReadWrite)],
};
pub const BINARY: KernelSource = KernelSource {
    file: "binary.wgsl",
    body: shader!("binary.wgsl"),
    slots: &[typed("a", Read), typed("b", Read), typed("out", ReadWrite)],
};
pub const SCALE: KernelSource = KernelSource {
    file: "scale.wgsl",
    body: shader!("scale.wgsl"),
    slots: &[typed("x", Read), typed("out", ReadWrite)],
};
pub const AXPY: KernelSource = KernelSource {
    file: "axpy.wgsl",
    body: shader!("axpy.wgsl"),
    slots: &[typed("x", Read), typed("y", ReadWrite)],
};
pub const REDUCE: KernelSource = KernelSource {
    file: "reduce.wgsl",
    body: shader!("reduce.wgsl"),
    slots: &[typed("src", Read), own("dst", ReadWrite)],
};
pub const NONFINITE: KernelSource = KernelSource {
    file: "nonfinite.wgsl",
    body: shader!("nonfinite.wgsl"),
    slots: &[own("src", Read), own("flag", ReadWrite)],
};

/// Every kernel file, for validation.
pub const ALL: &[&KernelSource] = &[&FILL, &CAST, &BINARY, &SCALE, &AXPY, &REDUCE, &NONFINITE];

/// How a typed slot's elements are stored in WGSL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Repr {
    F32,
    /// Native `f16` (needs SHADER_F16).
    F16,
    /// f16 as two halves per `u32`, computed in f32.
    F16Packed,
    BF16,
}

impl Repr {
    /// The representation of a float dtype on an adapter with or without native f16.
    pub fn of(dtype: DType, native_f16: bool) -> Repr {
        match dtype {
            DType::F32 => Repr::F32,
            DType::F16 if native_f16 => Repr::F16,
            DType::F16 => Repr::F16Packed,
            DType::BF16 => Repr::BF16,
            DType::U32 => {
                unreachable!("u32 buffers are never typed slots; Kernel::validate rejects them")
            }
        }
    }

    fn template(self) -> &'static str {
        match self {
            Repr::F32 => shader!("dtype/f32.wgsl"),
            Repr::F16 => shader!("dtype/f16.wgsl"),
            Repr::F16Packed => shader!("dtype/f16_packed.wgsl"),
            Repr::BF16 => shader!("dtype/bf16.wgsl"),
        }
    }

    pub fn all(native_f16: bool) -> &'static [Repr] {
        if native_f16 {
            &[Repr::F32, Repr::F16, Repr::F16Packed, Repr::BF16]
        } else {
            &[Repr::F32, Repr::F16Packed, Repr::BF16]
        }
    }
}

/// Section `name` (`decl`, `load`, `store`) of a dtype template.
fn section<'a>(template: &'a str, name: &str) -> &'a str {
    let marker = format!("//@ {name}\n");
    let start = template
        .find(&marker)
        .unwrap_or_else(|| panic!("dtype template lacks section `{name}`"))
        + marker.len();
    let end = template[start..]
        .find("//@ ")
        .map_or(template.len(), |e| start + e);
    &template[start..end]
}

/// The full WGSL module for `kernel` with `reprs` for its typed slots, in slot order.
pub fn assemble(kernel: &KernelSource, reprs: &[Repr]) -> String {
    let n_typed = kernel.slots.iter().filter(|s| s.typed).count();
    assert_eq!(
        n_typed,
        reprs.len(),
        "{}: one repr per typed slot",
        kernel.file
    );
    let mut out = String::new();
    if reprs.contains(&Repr::F16) {
        out.push_str("enable f16;\n\n");
    }
    out.push_str(PARAMS);
    out.push('\n');
    out.push_str(CONVERT);
    out.push('\n');
    let mut reprs = reprs.iter();
    for (i, slot) in kernel.slots.iter().enumerate().filter(|(_, s)| s.typed) {
        let t = reprs.next().expect("checked above").template();
        let access = match slot.access {
            Access::Read => "read",
            Access::ReadWrite => "read_write",
        };
        let mut text = section(t, "decl").to_string();
        text.push_str(section(t, "load"));
        if slot.access == Access::ReadWrite {
            text.push_str(section(t, "store"));
        }
        let text = text
            .replace("$S", slot.name)
            .replace("$B", &(i + 1).to_string())
            .replace("$A", access);
        out.push_str(&text);
        out.push('\n');
    }
    out.push_str(kernel.body);
    out
}
