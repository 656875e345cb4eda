#!/usr/bin/env bash
# Compiles the hand-written GLSL kernels to the SPIR-V modules committed beside them
# (spv/), so users build without a shader compiler. tests/spirv.rs runs this into a
# scratch directory and fails when a committed module differs (a stale .spv).
#   bash shaders/vulkan/build.sh [OUT_DIR]      (Debian/Ubuntu: apt-get install glslang-tools)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/spv}"
mkdir -p "$out"
command -v glslangValidator >/dev/null || {
    echo "glslangValidator not found: sudo apt-get install -y glslang-tools" >&2
    exit 1
}
# matmul_cpu: two tile shapes (TM rows x NV vec4 column groups per lane: 16x2, and 64x4
# for large products) x f32 or f16 storage x A and B each as stored or transposed, and
# B as stored read 4 values at a time (VEC_B, for N a multiple of 4: `_vec`).
for tile in 16x2 64x4; do
    for dtype in f32 f16; do
        for ops in nn nn_vec nt tn tn_vec tt; do
            defs=(-DTILE_M="${tile%x*}" -DTILE_NV="${tile#*x}")
            [ "$dtype" = f16 ] && defs+=(-DSTORE_F16)
            [ "${ops:0:1}" = t ] && defs+=(-DTRANS_A)
            [ "${ops:1:1}" = t ] && defs+=(-DTRANS_B)
            [ "${ops:2}" = _vec ] && defs+=(-DVEC_B)
            glslangValidator -V --target-env vulkan1.2 "${defs[@]}" \
                -o "$out/matmul_cpu_${tile}_${dtype}_${ops}.spv" "$here/matmul_cpu.comp" >/dev/null
        done
    done
done
# matmul_cpu with the fused epilogue (EPILOGUE: bias, GELU, f32 copy of C, `_epi`), for
# Kiln's raw Vulkan backend: it specializes the tile shape, so only the 16x2 build.
for dtype in f32 f16; do
    for ops in nn nn_vec nt tn tn_vec tt; do
        defs=(-DEPILOGUE)
        [ "$dtype" = f16 ] && defs+=(-DSTORE_F16)
        [ "${ops:0:1}" = t ] && defs+=(-DTRANS_A)
        [ "${ops:1:1}" = t ] && defs+=(-DTRANS_B)
        [ "${ops:2}" = _vec ] && defs+=(-DVEC_B)
        glslangValidator -V --target-env vulkan1.2 "${defs[@]}" \
            -o "$out/matmul_cpu_16x2_${dtype}_${ops}_epi.spv" "$here/matmul_cpu.comp" >/dev/null
    done
done
# matmul_cpu for mixed storage (MIXED, `_mixed`: A, B, C and the bias each f32, f16 or
# bf16 by specialization constants; the epilogue included), for Kiln's raw Vulkan
# backend: one module per transpose and B load, whatever the storage types.
for ops in nn nn_vec nt tn tn_vec tt; do
    defs=(-DMIXED)
    [ "${ops:0:1}" = t ] && defs+=(-DTRANS_A)
    [ "${ops:1:1}" = t ] && defs+=(-DTRANS_B)
    [ "${ops:2}" = _vec ] && defs+=(-DVEC_B)
    glslangValidator -V --target-env vulkan1.2 "${defs[@]}" \
        -o "$out/matmul_cpu_16x2_${ops}_mixed.spv" "$here/matmul_cpu.comp" >/dev/null
done
# The same with A and B read through uniform texel buffers (TEXEL, `_mixed_texel`), which
# a CPU driver gathers where it loops over the lanes of a storage load.
for ops in nn nn_vec nt tn tn_vec tt; do
    defs=(-DMIXED -DTEXEL)
    [ "${ops:0:1}" = t ] && defs+=(-DTRANS_A)
    [ "${ops:1:1}" = t ] && defs+=(-DTRANS_B)
    [ "${ops:2}" = _vec ] && defs+=(-DVEC_B)
    glslangValidator -V --target-env vulkan1.2 "${defs[@]}" \
        -o "$out/matmul_cpu_16x2_${ops}_mixed_texel.spv" "$here/matmul_cpu.comp" >/dev/null
done
# gemm_f32: the raw Vulkan backend's plain tiled f32 GEMM (kiln-vulkan).
glslangValidator -V --target-env vulkan1.2 -o "$out/gemm_f32.spv" "$here/gemm_f32.comp" >/dev/null
# matmul_tiled and gemv: the GPU-class tiled GEMM and the GEMV, for Kiln's raw Vulkan
# backend; tile shape, transposes, 16-byte loads, storage and the epilogue are all
# specialization constants. The `_packed` builds are for devices without 16-bit
# storage: f16 and bf16 operands read two to a 32-bit word.
for kernel in matmul_tiled gemv; do
    glslangValidator -V --target-env vulkan1.2 \
        -o "$out/${kernel}.spv" "$here/${kernel}.comp" >/dev/null
    glslangValidator -V --target-env vulkan1.2 -DPACKED \
        -o "$out/${kernel}_packed.spv" "$here/${kernel}.comp" >/dev/null
done
# attention: the fused attention's three passes (forward, dq, dk/dv), for Kiln's raw
# Vulkan backend; tile shape, head dim and storage are specialization constants. The
# `_packed` builds keep f16 and bf16 two to a word (devices without 16-bit storage).
for pass in fwd dq dkv; do
    glslangValidator -V --target-env vulkan1.2 -D"${pass^^}" \
        -o "$out/attention_${pass}.spv" "$here/attention.comp" >/dev/null
    glslangValidator -V --target-env vulkan1.2 -D"${pass^^}" -DPACKED \
        -o "$out/attention_${pass}_packed.spv" "$here/attention.comp" >/dev/null
done
