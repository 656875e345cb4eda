// The factor gradients are multiplied by: 1 / (loss_scale * max(1, (norm / loss_scale
// + 1e-6) / clip)), norm = sqrt(sum of squares of the scaled gradients); clip = 0 turns
// clipping off. Computed on the device so that no step waits on a host round trip.
// Params: alpha = loss scale, u0 = clip (f32 bits).
@group(0) @binding(1) var<storage, read> sum_squares: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(1)
fn main() {
    let ls = P.alpha;
    let clip = bitcast<f32>(P.u0);
    var combined = ls;
    if (clip > 0.0) {
        combined = ls * max(1.0, (sqrt(sum_squares[0]) / ls + 1e-6) / clip);
    }
    out[0] = 1.0 / combined;
}
