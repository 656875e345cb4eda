// Exact f32 -> 16-bit conversions in integer arithmetic: round to nearest, ties to even;
// overflow goes to infinity; NaN stays NaN (quiet bit set, high payload bits kept).
// Done by hand rather than with pack2x16float, whose out-of-range result WGSL leaves
// undefined, so that every adapter stores the same bits the CPU reference does.

fn f16_bits(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    let sign = (b >> 16u) & 0x8000u;
    let e = (b >> 23u) & 0xffu;
    let man = b & 0x7fffffu;
    if (e == 0xffu) {
        return sign | 0x7c00u | select(0u, 0x200u | (man >> 13u), man != 0u);
    }
    // Rebias the exponent from f32 (127) to f16 (15).
    let he = i32(e) - 112;
    if (he >= 31) {
        return sign | 0x7c00u;
    }
    if (he <= 0) {
        // Subnormal f16 (or zero): shift in the hidden bit and round at the cut.
        if (he < -10) {
            return sign;
        }
        let m = man | 0x800000u;
        let sh = u32(14 - he);
        let rb = 1u << (sh - 1u);
        var hm = m >> sh;
        if ((m & rb) != 0u && (m & (3u * rb - 1u)) != 0u) {
            hm += 1u;
        }
        return sign | hm;
    }
    let r = sign | (u32(he) << 10u) | (man >> 13u);
    // Round bit 0x1000 set and (sticky bits or odd result) -> round up; a carry into the
    // exponent is the correct result, up to infinity.
    if ((man & 0x1000u) != 0u && (man & 0x2fffu) != 0u) {
        return r + 1u;
    }
    return r;
}

fn bf16_bits(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return (b >> 16u) | 0x40u;
    }
    let r = b >> 16u;
    if ((b & 0x8000u) != 0u && (b & 0x17fffu) != 0u) {
        return r + 1u;
    }
    return r;
}
