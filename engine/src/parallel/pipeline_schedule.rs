//! The synchronous one-forward-one-backward (1F1B) pipeline schedule, as data: for
//! each of `p` stages and each clock tick, the instructions it runs. An executor walks
//! the lists; tests read them.
//!
//! Every forward and every backward takes one tick. Micro-batch `i` runs forward on
//! stage `s` at tick `2i + s` (one tick after the stage before it, whose activation
//! it receives) and backward at tick `2i + 2p - 1 - s` (one tick after the stage after
//! it, whose activation gradient it receives). Forward ticks of a stage have the parity
//! of `s` and backward ticks the other, so they never collide; the last stage runs a
//! micro-batch's backward right after its forward; in the steady state every stage
//! alternates one forward and one backward. Micro-batch `i` is alive on stage `s` from
//! its forward to its backward, `2p - 1 - 2s` ticks, so at most `p - s` micro-batches'
//! activations are held at once. The last event is stage 0's backward of the last
//! micro-batch at tick `2m + 2p - 3`: `2(m + p - 1)` ticks, of which each stage idles
//! `2(p - 1)` — the bubble, `(p - 1)/(m + p - 1)` of the step. After the last tick
//! the stages meet for the step's end: the tied embedding's two gradients summed
//! between first and last stage, the data-parallel gradient exchange, one optimizer
//! step.

/// One thing a stage does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Instr {
    /// Read micro-batch `micro`'s inputs (first stage) or targets (last stage).
    Load { micro: usize },
    /// Receive micro-batch `micro`'s activation from the stage before.
    RecvActivation { micro: usize },
    /// Run this stage's forward of `micro`, keeping what backward needs in `buffer`.
    Forward { micro: usize, buffer: usize },
    /// Send `micro`'s output activation to the stage after.
    SendActivation { micro: usize },
    /// Receive the gradient of `micro`'s output activation from the stage after.
    RecvGrad { micro: usize },
    /// Run this stage's backward of `micro` from `buffer` (freeing it), adding into the
    /// stage's parameter gradients.
    Backward { micro: usize, buffer: usize },
    /// Send the gradient of `micro`'s input activation to the stage before.
    SendGrad { micro: usize },
    /// Sum the tied parameters' gradients with the other end's copy (first and last
    /// stage, when the model ties its input and output embeddings).
    ReduceTiedGrads,
    /// The data-parallel gradient exchange of this stage's parameters.
    ReduceGrads,
    /// The optimizer step for this stage's parameters (one decision for all stages).
    OptimizerStep,
}

/// A training step's instructions: `ticks[s][t]` is what stage `s` runs at tick `t`
/// (empty: idle), and `end[s]` what it runs once every tick is done.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    pub stages: usize,
    pub micro_batches: usize,
    pub ticks: Vec<Vec<Vec<Instr>>>,
    pub end: Vec<Vec<Instr>>,
}

impl Schedule {
    /// The 1F1B step of `micro_batches` micro-batches over `stages` stages; `tied`:
    /// the first and last stage hold copies of one parameter (GPT-2's embedding).
    /// Zero stages or micro-batches is an error naming the setting.
    pub fn one_forward_one_backward(
        stages: usize,
        micro_batches: usize,
        tied: bool,
    ) -> crate::Result<Schedule> {
        if stages == 0 || micro_batches == 0 {
            return Err(crate::Error::InvalidArgument(format!(
                "a pipeline schedule needs at least one stage and one micro-batch \
                 (gradient_accumulation_steps), got {stages} stages and {micro_batches} \
                 micro-batches"
            )));
        }
        let (p, m) = (stages, micro_batches);
        let len = 2 * (m + p - 1);
        let mut ticks = vec![vec![vec![]; len]; p];
        for (s, stage) in ticks.iter_mut().enumerate() {
            let (first, last) = (s == 0, s + 1 == p);
            // Buffers are reused round-robin: at most p - s micro-batches are alive.
            let buffers = (p - s).min(m);
            for i in 0..m {
                let buffer = i % buffers;
                let mut fwd = vec![];
                if first || last {
                    fwd.push(Instr::Load { micro: i });
                }
                if !first {
                    fwd.push(Instr::RecvActivation { micro: i });
                }
                fwd.push(Instr::Forward { micro: i, buffer });
                if !last {
                    fwd.push(Instr::SendActivation { micro: i });
                }
                stage[2 * i + s] = fwd;
                let mut bwd = vec![];
                if !last {
                    bwd.push(Instr::RecvGrad { micro: i });
                }
                bwd.push(Instr::Backward { micro: i, buffer });
                if !first {
                    bwd.push(Instr::SendGrad { micro: i });
                }
                stage[2 * i + 2 * p - 1 - s] = bwd;
            }
        }
        let end = (0..p)
            .map(|s| {
                let mut e = vec![];
                if tied && p > 1 && (s == 0 || s + 1 == p) {
                    e.push(Instr::ReduceTiedGrads);
                }
                e.extend([Instr::ReduceGrads, Instr::OptimizerStep]);
                e
            })
            .collect();
        Ok(Schedule {
            stages: p,
            micro_batches: m,
            ticks,
            end,
        })
    }

    /// Ticks in the step.
    pub fn len(&self) -> usize {
        self.ticks[0].len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The share of a stage's ticks it idles: `(p - 1)/(m + p - 1)` by construction,
    /// counted from the lists.
    pub fn bubble(&self, stage: usize) -> f64 {
        let idle = self.ticks[stage].iter().filter(|t| t.is_empty()).count();
        idle as f64 / self.len() as f64
    }

    /// The most activation buffers stage `stage` uses.
    pub fn buffers(&self, stage: usize) -> usize {
        self.ticks[stage]
            .iter()
            .flatten()
            .filter_map(|i| match i {
                Instr::Forward { buffer, .. } => Some(buffer + 1),
                _ => None,
            })
            .max()
            .unwrap_or(0)
    }
}

/// The schedule's idle share of a step: each of `p` stages idles `p - 1` of the
/// `m + p - 1` slots a step of `m` micro-batches takes.
pub fn theoretical_bubble(p: usize, m: usize) -> f64 {
    (p - 1) as f64 / (m + p - 1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (tick, instruction) of every instruction of stage `s` matching `f`.
    fn find(sch: &Schedule, s: usize, f: impl Fn(&Instr) -> bool) -> Vec<(usize, Instr)> {
        sch.ticks[s]
            .iter()
            .enumerate()
            .flat_map(|(t, is)| is.iter().filter(|i| f(i)).map(move |i| (t, *i)))
            .collect()
    }

    #[test]
    fn one_forward_one_backward_holds_its_invariants() {
        for p in 1..=4usize {
            for m in [1, 2, p, 2 * p + 1] {
                let sch = Schedule::one_forward_one_backward(p, m, true).unwrap();
                let what = format!("p {p} m {m}");
                assert_eq!(sch.len(), 2 * (m + p - 1), "{what}");
                for s in 0..p {
                    let (first, last) = (s == 0, s + 1 == p);
                    // Each micro-batch once forward, once backward, forward first, in
                    // the same buffer; at most p buffers (p - s here).
                    for i in 0..m {
                        let f = find(
                            &sch,
                            s,
                            |x| matches!(x, Instr::Forward { micro, .. } if *micro == i),
                        );
                        let b = find(
                            &sch,
                            s,
                            |x| matches!(x, Instr::Backward { micro, .. } if *micro == i),
                        );
                        assert_eq!((f.len(), b.len()), (1, 1), "{what} stage {s} micro {i}");
                        assert!(f[0].0 < b[0].0, "{what} stage {s} micro {i}");
                        let buf = |x: Instr| match x {
                            Instr::Forward { buffer, .. } | Instr::Backward { buffer, .. } => {
                                buffer
                            }
                            _ => unreachable!(),
                        };
                        assert_eq!(buf(f[0].1), buf(b[0].1));
                    }
                    assert!(sch.buffers(s) <= p && sch.buffers(s) <= p - s, "{what}");
                    // Buffers in use at once never collide.
                    let mut held: Vec<Option<usize>> = vec![None; sch.buffers(s)];
                    for is in &sch.ticks[s] {
                        for i in is {
                            match *i {
                                Instr::Forward { micro, buffer } => {
                                    assert_eq!(held[buffer], None, "{what} stage {s}");
                                    held[buffer] = Some(micro);
                                }
                                Instr::Backward { micro, buffer } => {
                                    assert_eq!(held[buffer], Some(micro), "{what} stage {s}");
                                    held[buffer] = None;
                                }
                                _ => {}
                            }
                        }
                    }
                    // The ends of the pipeline never receive or send activations.
                    let recv = find(&sch, s, |x| matches!(x, Instr::RecvActivation { .. }));
                    let send = find(&sch, s, |x| matches!(x, Instr::SendActivation { .. }));
                    assert_eq!(recv.is_empty(), first, "{what} stage {s}");
                    assert_eq!(send.is_empty(), last, "{what} stage {s}");
                    // Every send is received by the neighbour one tick later.
                    if !last {
                        for (t, x) in send {
                            let Instr::SendActivation { micro } = x else {
                                unreachable!()
                            };
                            let got = find(&sch, s + 1, |y| *y == Instr::RecvActivation { micro });
                            assert_eq!(got.len(), 1);
                            assert_eq!(got[0].0, t + 1, "{what} stage {s} micro {micro}");
                        }
                    }
                    if !first {
                        for (t, x) in find(&sch, s, |x| matches!(x, Instr::SendGrad { .. })) {
                            let Instr::SendGrad { micro } = x else {
                                unreachable!()
                            };
                            let got = find(&sch, s - 1, |y| *y == Instr::RecvGrad { micro });
                            assert_eq!(got.len(), 1);
                            assert_eq!(got[0].0, t + 1, "{what} stage {s} micro {micro}");
                        }
                    }
                    // A tick is a forward or a backward, never both.
                    for is in &sch.ticks[s] {
                        let f = is.iter().any(|i| matches!(i, Instr::Forward { .. }));
                        let b = is.iter().any(|i| matches!(i, Instr::Backward { .. }));
                        assert!(!(f && b), "{what} stage {s}");
                    }
                    let theory = (p - 1) as f64 / (m + p - 1) as f64;
                    assert!((sch.bubble(s) - theory).abs() < 1e-12, "{what} stage {s}");
                    let tied = sch.end[s].contains(&Instr::ReduceTiedGrads);
                    assert_eq!(tied, p > 1 && (first || last), "{what} stage {s}");
                    assert_eq!(sch.end[s].last(), Some(&Instr::OptimizerStep));
                }
            }
        }
        // Hand-checked: 2 stages, 3 micro-batches.
        let sch = Schedule::one_forward_one_backward(2, 3, false).unwrap();
        let kinds = |s: usize| -> String {
            sch.ticks[s]
                .iter()
                .map(|t| {
                    t.iter()
                        .find_map(|i| match i {
                            Instr::Forward { micro, .. } => Some(format!("F{micro}")),
                            Instr::Backward { micro, .. } => Some(format!("B{micro}")),
                            _ => None,
                        })
                        .unwrap_or_else(|| "-".into())
                })
                .collect::<Vec<_>>()
                .join(" ")
        };
        assert_eq!(kinds(0), "F0 - F1 B0 F2 B1 - B2");
        assert_eq!(kinds(1), "- F0 B0 F1 B1 F2 B2 -");
        assert!(Schedule::one_forward_one_backward(0, 4, true).is_err());
        assert!(Schedule::one_forward_one_backward(2, 0, true).is_err());
    }
}
