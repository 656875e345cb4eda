//! Every first-generation kernel against the CPU reference, on both f16 paths,
//! over awkward sizes: empty, one element, odd, primes, past a workgroup, and large.

mod common;

use common::*;
use kiln::engine::kernels::{self, Axpy, Binary, Cast, Fill, NonFinite, Reduce, Scale};
use kiln::engine::{BinaryOp, DType, HostData, Kernel, ReduceOp};

/// 0 where legal, 1, odd and prime lengths, one past a workgroup of pairs, and a
/// large prime that needs many workgroups and an odd tail.
const SIZES: [usize; 6] = [0, 1, 7, 513, 4099, 1_000_003];

#[test]
fn fill_matches_cpu_bit_exactly() {
    for p in gpu_paths() {
        for dtype in DType::ALL {
            let values: &[f64] = if dtype == DType::U32 {
                &[0.0, 7.0, 4294967295.0]
            } else {
                &[0.0, -0.0, 1.5, 0.1, -65520.0, 1e-7, f64::INFINITY, f64::NAN]
            };
            for &value in values {
                for len in SIZES {
                    let out = run_both(p.dev.as_ref(), &[HostData::zeros(dtype, len)], |b| {
                        (Kernel::Fill(Fill { dst: b[0], value }), vec![0])
                    });
                    let what = format!("{}: fill {dtype} x{len} with {value}", p.name);
                    assert_bits_eq(&what, &out[0].0, &out[0].1);
                }
            }
        }
    }
}

#[test]
fn copy_is_bit_exact() {
    for p in gpu_paths() {
        for dtype in DType::ALL {
            for len in SIZES {
                let src = data(dtype, len, len as u64, true);
                let out = run_both(
                    p.dev.as_ref(),
                    &[src.clone(), HostData::zeros(dtype, len)],
                    |b| {
                        (
                            Kernel::Copy(kernels::Copy {
                                src: b[0],
                                dst: b[1],
                            }),
                            vec![1],
                        )
                    },
                );
                let what = format!("{}: copy {dtype} x{len}", p.name);
                assert_bits_eq(&what, &out[0].0, &src);
                assert_bits_eq(&what, &out[0].0, &out[0].1);
            }
        }
    }
}

#[test]
fn cast_matches_cpu_bit_exactly_between_all_float_dtypes() {
    for p in gpu_paths() {
        for from in DType::FLOATS {
            for to in DType::FLOATS {
                for len in SIZES {
                    let src = data(from, len, 17 + len as u64, true);
                    let out = run_both(p.dev.as_ref(), &[src, HostData::zeros(to, len)], |b| {
                        (
                            Kernel::Cast(Cast {
                                src: b[0],
                                dst: b[1],
                            }),
                            vec![1],
                        )
                    });
                    let what = format!("{}: cast {from} -> {to} x{len}", p.name);
                    assert_bits_eq(&what, &out[0].0, &out[0].1);
                }
            }
        }
    }
}

/// Same-dtype operands for each float dtype, plus the mixes training uses
/// (f16 activations with f32 gradients, bf16 with f32).
fn operand_sets() -> Vec<[DType; 3]> {
    use DType::*;
    vec![
        [F32, F32, F32],
        [F16, F16, F16],
        [BF16, BF16, BF16],
        [F16, F32, F32],
        [F32, BF16, F16],
        [BF16, F16, BF16],
    ]
}

#[test]
fn add_and_mul_match_cpu() {
    for p in gpu_paths() {
        for op in [BinaryOp::Add, BinaryOp::Mul] {
            for [da, db, dout] in operand_sets() {
                for len in SIZES {
                    let inputs = [
                        finite(da, len, 1 + len as u64),
                        finite(db, len, 2 + len as u64),
                        HostData::zeros(dout, len),
                    ];
                    let out = run_both(p.dev.as_ref(), &inputs, |b| {
                        let k = Kernel::Binary(Binary {
                            op,
                            a: b[0],
                            b: b[1],
                            out: b[2],
                        });
                        (k, vec![2])
                    });
                    let what = format!("{}: {op:?} {da},{db} -> {dout} x{len}", p.name);
                    // One f32 operation rounded once to the output: exact, see assert_ulps.
                    assert_ulps(&what, &out[0].0, &out[0].1, 0);
                }
            }
        }
    }
}

#[test]
fn scale_and_axpy_match_cpu() {
    for p in gpu_paths() {
        for [dx, dy, _] in operand_sets() {
            for len in SIZES {
                let alpha = -0.7391;
                let inputs = [
                    finite(dx, len, 3 + len as u64),
                    finite(dy, len, 4 + len as u64),
                ];
                let scaled = run_both(p.dev.as_ref(), &inputs, |b| {
                    (
                        Kernel::Scale(Scale {
                            alpha,
                            x: b[0],
                            out: b[1],
                        }),
                        vec![1],
                    )
                });
                let what = format!("{}: scale {dx} -> {dy} x{len}", p.name);
                assert_ulps(&what, &scaled[0].0, &scaled[0].1, 0);

                let axpy = run_both(p.dev.as_ref(), &inputs, |b| {
                    (
                        Kernel::Axpy(Axpy {
                            alpha,
                            x: b[0],
                            y: b[1],
                        }),
                        vec![1],
                    )
                });
                let what = format!("{}: axpy {dx} into {dy} x{len}", p.name);
                assert_ulps(&what, &axpy[0].0, &axpy[0].1, 1);
            }
        }
    }
}

#[test]
fn sum_and_max_match_cpu_within_f32_accumulation_error() {
    for p in gpu_paths() {
        for dtype in DType::FLOATS {
            for len in SIZES {
                let src = finite(dtype, len, 5 + len as u64);
                let abs_sum: f64 = src.to_f32().iter().map(|v| v.abs() as f64).sum();
                let sq_sum: f64 = src.to_f32().iter().map(|&v| v as f64 * v as f64).sum();
                for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::SumSquares] {
                    let out = run_both(
                        p.dev.as_ref(),
                        &[src.clone(), HostData::zeros(DType::F32, 1)],
                        |b| {
                            (
                                Kernel::Reduce(Reduce {
                                    op,
                                    src: b[0],
                                    dst: b[1],
                                }),
                                vec![1],
                            )
                        },
                    );
                    let (g, c) = (out[0].0.to_f32()[0], out[0].1.to_f32()[0]);
                    let what = format!("{}: {op:?} of {dtype} x{len}", p.name);
                    match op {
                        // Max involves no rounding at all.
                        ReduceOp::Max => assert_eq!(g.to_bits(), c.to_bits(), "{what}"),
                        // f32 accumulation along at most `depth` sequential additions: each
                        // thread folds ceil(len / (2 * 256 * 256)) pairs, then two 8-level
                        // trees; error <= depth * eps32 * sum |x| (standard bound).
                        // (Squares add one rounding each: depth + 1, over sum x^2.)
                        ReduceOp::Sum | ReduceOp::SumSquares => {
                            let depth = 2 * len.div_ceil(2 * 256 * 256) + 8 + 8 + 3;
                            let mass = if op == ReduceOp::Sum { abs_sum } else { sq_sum };
                            let tol = depth as f64 * f32::EPSILON as f64 * mass;
                            assert!(
                                (g as f64 - c as f64).abs() <= tol,
                                "{what}: gpu {g}, cpu {c}, tolerance {tol}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn nonfinite_flags_any_inf_or_nan_across_buffers() {
    for p in gpu_paths() {
        for dtype in DType::FLOATS {
            for len in [1usize, 7, 4099, 1_000_003] {
                let clean = finite(dtype, len, 6);
                let poison = |at: usize, v: f32| {
                    let mut x = finite(DType::F32, len, 7).to_f32();
                    x[at] = v;
                    HostData::from_f32(dtype, &x)
                };
                let cases = [
                    ("clean", vec![clean.clone(), finite(DType::F32, 3, 8)], 0u32),
                    (
                        "inf at the odd tail",
                        vec![clean.clone(), poison(len - 1, f32::INFINITY)],
                        1,
                    ),
                    (
                        "NaN at the start",
                        vec![poison(0, f32::NAN), clean.clone()],
                        1,
                    ),
                    ("-inf mid-way", vec![poison(len / 2, f32::NEG_INFINITY)], 1),
                ];
                for (case, inputs, want) in cases {
                    let mut all = inputs.clone();
                    all.push(HostData::U32(vec![7])); // stale flag: the kernel must clear it
                    let n = inputs.len();
                    let out = run_both(p.dev.as_ref(), &all, |b| {
                        let k = Kernel::NonFinite(NonFinite {
                            srcs: b[..n].to_vec(),
                            flag: b[n],
                        });
                        (k, vec![n])
                    });
                    let what = format!("{}: nonfinite {dtype} x{len} {case}", p.name);
                    assert_eq!(out[0].1, HostData::U32(vec![want]), "{what}: cpu");
                    assert_eq!(out[0].0, HostData::U32(vec![want]), "{what}: gpu");
                }
            }
        }
    }
}

#[test]
fn many_launches_share_one_submit_and_keep_program_order() {
    // 3000 dependent launches in one stream: more than one parameter arena's worth is
    // not needed for correctness, but the order must hold across uploads mid-stream.
    for p in gpu_paths() {
        let dev = p.dev.as_ref();
        let x = put(dev, &HostData::F32(vec![1.0; 9]));
        let y = put(dev, &HostData::F32(vec![0.0; 9]));
        for _ in 0..3000 {
            dev.launch(&Kernel::Axpy(Axpy { alpha: 1.0, x, y }))
                .unwrap();
        }
        // Uploaded after the launches above were recorded: must not overwrite `x` before them.
        dev.upload(x, &HostData::F32(vec![2.0; 9])).unwrap();
        dev.launch(&Kernel::Axpy(Axpy { alpha: 1.0, x, y }))
            .unwrap();
        dev.submit().unwrap();
        dev.wait().unwrap();
        assert_eq!(
            dev.download(y).unwrap(),
            HostData::F32(vec![3002.0; 9]),
            "{}",
            p.name
        );
    }
}

/// The row argmax, first on hand-built rows whose answers are known (ties, NaN, -inf,
/// padding columns larger than every class), then on random rows with many ties
/// (values on a coarse grid) against the CPU, over awkward shapes: one column, primes,
/// rows past a workgroup, and (130 rows) the CPU adapters' one-lane-per-row plan.
#[test]
fn argmax_picks_the_first_largest_class_and_never_nan() {
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    // (row, classes, want); each row padded with 1e4 past its classes.
    let known: [(&[f32], usize, u32); 8] = [
        (&[1.0, 3.0, 2.0, 3.0], 4, 1),
        (&[nan, -1.0, -0.5, -0.5], 4, 2),
        (&[-inf, -inf, -inf, -inf], 4, 0),
        (&[nan, -inf, -inf, nan], 4, 1),
        (&[nan, nan, nan, nan], 4, 0),
        (&[0.0, -2.0, inf, inf], 4, 2),
        (&[-3.0, -1.0, 5.0, 9.0], 2, 1),
        (&[-3.4028235e38, -inf, -3.4028235e38, 0.0], 3, 0),
    ];
    let cols = 5;
    for p in gpu_paths() {
        for dtype in DType::FLOATS {
            for &(row, classes, want) in &known {
                let mut r = row.to_vec();
                r.resize(cols, 1e4);
                let x = HostData::from_f32(dtype, &r);
                let out = run_both(p.dev.as_ref(), &[x, HostData::U32(vec![9])], |b| {
                    (argmax(b, cols, classes), vec![1])
                });
                let what = format!("{}: argmax of {row:?} ({classes} classes, {dtype})", p.name);
                assert_eq!(out[0].1, HostData::U32(vec![want]), "{what}: cpu");
                assert_eq!(out[0].0, HostData::U32(vec![want]), "{what}: gpu");
            }
            for (rows, cols, classes) in [
                (1, 1, 1),
                (3, 7, 7),
                (5, 257, 250),
                (130, 13, 11),
                (2, 1031, 1031),
            ] {
                // Values on a grid of 8 per unit in [-2, 2): ties within a row are common.
                let v: Vec<f32> = finite(DType::F32, rows * cols, (rows * cols) as u64)
                    .to_f32()
                    .iter()
                    .map(|x| (x * 8.0).round() / 8.0)
                    .collect();
                let x = HostData::from_f32(dtype, &v);
                let out = run_both(
                    p.dev.as_ref(),
                    &[x, HostData::U32(vec![u32::MAX; rows])],
                    |b| (argmax(b, cols, classes), vec![1]),
                );
                let what = format!(
                    "{}: argmax of {rows}x{cols} ({classes} classes, {dtype})",
                    p.name
                );
                assert_eq!(out[0].0, out[0].1, "{what}");
            }
        }
    }
}

fn argmax(b: &[kiln::engine::Buffer], cols: usize, classes: usize) -> Kernel {
    Kernel::ArgMax(kernels::ArgMax {
        x: b[0],
        out: b[1],
        cols,
        classes,
    })
}
