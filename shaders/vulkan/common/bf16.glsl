// bf16 as the upper half of an f32, for the hand-written kernels: the rounding of
// shaders/common/convert.wgsl's bf16_bits (to nearest even, a NaN kept quiet), so the
// SPIR-V and WGSL kernels store the same bits.
uint bf16_bits(float x) {
    uint u = floatBitsToUint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (u >> 16) | 0x40u;
    }
    uint r = u >> 16;
    if ((u & 0x8000u) != 0u && (u & 0x17fffu) != 0u) {
        return r + 1u;
    }
    return r;
}
