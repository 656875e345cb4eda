//! Built-in synthetic dataset: digit addition. Needs no download and is a pure function
//! of (digits, seed).
//!
//! # Vocabulary (13 ids)
//!
//! | id    | token                      |
//! |-------|----------------------------|
//! | 0..=9 | the digits `0`..`9`        |
//! | 10    | `+` ([`Addition::PLUS`])   |
//! | 11    | `=` ([`Addition::EQUALS`]) |
//! | 12    | newline, the separator ([`Addition::SEP`]) |
//!
//! # Line format
//!
//! With `d` digits, a problem is one line of `3d + 4` tokens:
//! `a` and `b` zero-padded to `d` digits (most significant first), then `=`, then the sum
//! zero-padded to `d + 1` digits and written **reversed** (least significant first), then
//! the separator. For `d = 2`, 47 + 85 = 132 is `47+85=231\n`.
//!
//! Why: reversed, each answer digit depends only on the operand digits at the same place
//! and the carry out of the digit just produced, so a small model can emit it left to
//! right; in the usual order the first digit depends on every carry. Fixed widths put
//! every digit at a fixed offset in the line and make every line the same length, so
//! the model needs no counting and rows of the stream stay easy to lay out. With rows of
//! exactly one line (T + 1 = 3d + 4, so each position has one role) and the loss on the
//! answers only ([`Addition::mask_prompts`]), `d = 2` (the default) is what a 2-layer,
//! 100k-parameter GPT learns in a few hundred steps (measured: 50% held-out exact match
//! at step 300, 100% by step 1000, micro-batch 64, AdamW 3e-3). With several lines per
//! row, or the loss on the random operands too, the same model stayed at chance for
//! 700 steps.
//!
//! # Held-out problems
//!
//! A fixed ~10% of the (a, b) pairs, chosen by a hash of (digits, a, b) that does not
//! depend on the seed, never appear in the training stream: training lines are drawn
//! uniformly from the other pairs. [`Addition::eval_rows`] lays out only held-out
//! problems. (The pair (b, a) of a held-out (a, b) may well be a training pair: held-out
//! accuracy measures generalisation to unseen operand pairs, commutativity included.)

use super::{hash, DataError, MemorySource, Result};

/// Largest supported digit count (sums stay below 2 * 10^9).
pub const MAX_DIGITS: u32 = 9;
/// The default digit count.
pub const DEFAULT_DIGITS: u32 = 2;

const HELD_OUT_SALT: u64 = 0x6865_6C64_6F75_7421;
const EVAL_SALT: u64 = 0x6576_616C_7561_7465;
/// A pair is held out when its hash falls in this many of 1000 buckets (10%).
const HELD_OUT_PER_MILLE: u64 = 100;

/// The addition dataset for a digit count and a training seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Addition {
    digits: u32,
    seed: u64,
}

/// One held-out problem inside [`EvalRows`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvalProblem {
    /// Row of the batch it lies in.
    pub row: usize,
    pub a: u64,
    pub b: u64,
    /// Positions in the row's `T` predictions (0..T) at which the model predicts the
    /// answer's tokens: the `d + 1` reversed sum digits and the trailing separator.
    pub positions: Vec<usize>,
    /// The expected token at each of `positions` (equal to `targets` there).
    pub expected: Vec<u32>,
}

/// Held-out problems laid out like training rows, for one teacher-forced forward pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvalRows {
    pub t: usize,
    pub rows: usize,
    /// `rows * t` input ids, as [`Batch::tokens`](super::Batch::tokens).
    pub tokens: Vec<u32>,
    /// `rows * t` next-token targets, as [`Batch::targets`](super::Batch::targets).
    pub targets: Vec<u32>,
    /// The scored problems, in row order.
    pub problems: Vec<EvalProblem>,
}

impl Addition {
    pub const PLUS: u32 = 10;
    pub const EQUALS: u32 = 11;
    pub const SEP: u32 = 12;
    pub const VOCAB_SIZE: usize = 13;

    /// `digits` in `1..=9`.
    pub fn new(digits: u32, seed: u64) -> Result<Addition> {
        if !(1..=MAX_DIGITS).contains(&digits) {
            return Err(DataError::InvalidArgument(format!(
                "addition: digits must be in 1..={MAX_DIGITS}, got {digits}"
            )));
        }
        Ok(Addition { digits, seed })
    }

    pub fn digits(&self) -> u32 {
        self.digits
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// 13: digits, `+`, `=`, separator.
    pub fn vocab_size() -> usize {
        Addition::VOCAB_SIZE
    }

    /// Tokens per problem line: `3 * digits + 4`.
    pub fn line_len(&self) -> usize {
        3 * self.digits as usize + 4
    }

    /// Operands are in `0..operand_limit()` (10^digits).
    pub fn operand_limit(&self) -> u64 {
        10u64.pow(self.digits)
    }

    /// Text of token ids: digits, `+`, `=`, `\n` for the separator, `?` for ids outside
    /// the vocabulary.
    pub fn decode(ids: &[u32]) -> String {
        ids.iter()
            .map(|&id| match id {
                0..=9 => char::from(b'0' + id as u8),
                Addition::PLUS => '+',
                Addition::EQUALS => '=',
                Addition::SEP => '\n',
                _ => '?',
            })
            .collect()
    }

    /// Token ids of a text made of digits, `+`, `=` and newlines; `None` if it has any
    /// other character.
    pub fn encode(text: &str) -> Option<Vec<u32>> {
        text.chars()
            .map(|c| match c {
                '0'..='9' => Some(c as u32 - '0' as u32),
                '+' => Some(Addition::PLUS),
                '=' => Some(Addition::EQUALS),
                '\n' => Some(Addition::SEP),
                _ => None,
            })
            .collect()
    }

    /// Whether (a, b) belongs to the held-out set (independent of the seed).
    pub fn is_held_out(&self, a: u64, b: u64) -> bool {
        hash(&[HELD_OUT_SALT, self.digits as u64, a, b]) % 1000 < HELD_OUT_PER_MILLE
    }

    /// Uniform pair from a hash stream, attempt by attempt.
    fn draw(&self, words: [u64; 3], attempt: u64) -> (u64, u64) {
        let n = self.operand_limit() as u128;
        let pick = |which: u64| {
            let h = hash(&[words[0], words[1], words[2], attempt, which]);
            ((h as u128 * n) >> 64) as u64
        };
        (pick(0), pick(1))
    }

    /// The pair of training line `i`: uniform over the pairs that are not held out.
    pub fn train_problem(&self, i: u64) -> (u64, u64) {
        (0..)
            .map(|k| self.draw([self.seed, i, 0], k))
            .find(|&(a, b)| !self.is_held_out(a, b))
            .expect("an infinite search returns")
    }

    /// The `j`-th problem of the evaluation stream: uniform over the held-out pairs, the
    /// same for every seed.
    pub fn held_out_problem(&self, j: u64) -> (u64, u64) {
        (0..)
            .map(|k| self.draw([EVAL_SALT, j, self.digits as u64], k))
            .find(|&(a, b)| self.is_held_out(a, b))
            .expect("an infinite search returns")
    }

    /// Appends the line of `a + b` to `out`.
    pub fn push_line(&self, a: u64, b: u64, out: &mut Vec<u32>) {
        let d = self.digits as usize;
        let push_padded = |mut x: u64, width: usize, reversed: bool, out: &mut Vec<u32>| {
            let mut digits: Vec<u32> = (0..width)
                .map(|_| {
                    let r = (x % 10) as u32;
                    x /= 10;
                    r
                })
                .collect(); // least significant first
            if !reversed {
                digits.reverse();
            }
            out.extend(digits);
        };
        push_padded(a, d, false, out);
        out.push(Addition::PLUS);
        push_padded(b, d, false, out);
        out.push(Addition::EQUALS);
        push_padded(a + b, d + 1, true, out);
        out.push(Addition::SEP);
    }

    /// The first `lines` training lines, concatenated.
    pub fn train_tokens(&self, lines: u64) -> Vec<u32> {
        let mut out = Vec::with_capacity(lines as usize * self.line_len());
        for i in 0..lines {
            let (a, b) = self.train_problem(i);
            self.push_line(a, b, &mut out);
        }
        out
    }

    /// The training stream of `lines` lines as a token source (a few hundred thousand
    /// tokens is plenty for `digits = 2`, e.g. 50 000 lines = 500 000 tokens).
    pub fn train_source(&self, lines: u64) -> MemorySource {
        MemorySource::new(
            format!(
                "addition(digits={}, seed={}, lines={lines})",
                self.digits, self.seed
            ),
            self.train_tokens(lines),
            Some(Addition::VOCAB_SIZE),
        )
    }

    /// Marks every target that is not part of an answer as [`crate::IGNORE_TARGET`], in
    /// rows of `t` positions: the operands are random, so predicting them teaches nothing
    /// and their irreducible loss (ln 10 per digit) would drown the answers' signal.
    /// A target is trained when an `=` has been seen in the row since the last
    /// separator, that is: the answer digits and the separator ending the line.
    /// Works from the tokens alone, whatever the row's offset in the stream.
    pub fn mask_prompts(tokens: &[u32], targets: &mut [u32], t: usize) {
        for (row, tgt) in tokens.chunks(t).zip(targets.chunks_mut(t)) {
            let mut answering = false;
            for (&tok, target) in row.iter().zip(tgt) {
                if tok == Self::EQUALS {
                    answering = true;
                } else if tok == Self::SEP {
                    answering = false;
                }
                if !answering {
                    *target = crate::IGNORE_TARGET;
                }
            }
        }
    }

    /// `rows` rows of `t + 1` tokens made of held-out problems, for exact-match accuracy
    /// from one teacher-forced forward pass (feed `tokens`, take the argmax per position,
    /// call [`accuracy`]).
    ///
    /// The rows are consecutive windows of the evaluation stream (held-out problems
    /// 0, 1, 2, ... one line each), each ending at a line boundary: row `i` holds
    /// `n = (t + 1) / line_len` whole problems `i n + 1 ..= i n + n`, preceded by the
    /// tail of problem `i n` when `(t + 1)` is not a multiple of the line length; that
    /// partial line is context only. Every whole problem is scored: its answer comes
    /// after its full question inside the row. Once `rows * n` exceeds the number of
    /// held-out pairs, problems repeat (they are drawn uniformly from that set).
    /// Needs `t + 1 >= line_len`.
    pub fn eval_rows(&self, t: usize, rows: usize) -> Result<EvalRows> {
        let l = self.line_len();
        if t + 1 < l {
            return Err(DataError::InvalidArgument(format!(
                "addition: a row of T + 1 = {} tokens cannot hold one problem line of {l} \
                 tokens ({} digits): use T >= {}",
                t + 1,
                self.digits,
                l - 1
            )));
        }
        let n = (t + 1) / l;
        let lead = (t + 1) % l;
        let d = self.digits as usize;
        let mut tokens = Vec::with_capacity(rows * t);
        let mut targets = Vec::with_capacity(rows * t);
        let mut problems = Vec::with_capacity(rows * n);
        let mut stream = Vec::with_capacity((n + 1) * l);
        for row in 0..rows {
            stream.clear();
            let first = (row * n) as u64;
            for j in first..=first + n as u64 {
                let (a, b) = self.held_out_problem(j);
                self.push_line(a, b, &mut stream);
            }
            let window = &stream[stream.len() - (t + 1)..];
            tokens.extend_from_slice(&window[..t]);
            targets.extend_from_slice(&window[1..]);
            for k in 0..n {
                let (a, b) = self.held_out_problem(first + 1 + k as u64);
                // Answer tokens: line offsets 2d+2 .. 3d+4 (sum digits, separator). The
                // token at row position p is predicted at position p - 1.
                let answer = lead + k * l + 2 * d + 2;
                let positions: Vec<usize> = (answer - 1..answer - 1 + d + 2).collect();
                let expected = positions.iter().map(|&p| window[p + 1]).collect();
                problems.push(EvalProblem {
                    row,
                    a,
                    b,
                    positions,
                    expected,
                });
            }
        }
        Ok(EvalRows {
            t,
            rows,
            tokens,
            targets,
            problems,
        })
    }
}

/// Exact-match accuracy of held-out problems from one teacher-forced forward pass.
/// `predictions` are the model's argmax ids at every position of every row of `rows`
/// (`rows.rows * rows.t`, row-major, as the logits come out). A problem is correct iff
/// the argmax at every one of its answer positions equals the expected token. Returns
/// (correct, total problems).
///
/// This equals the exact match of greedy decoding from the prompt (the row up to the
/// problem's `=`): greedy decoding feeds its own outputs back, teacher forcing feeds the
/// true answer. As long as every answer token so far was right the two inputs are the
/// same, so the next greedy token is the teacher-forced argmax at that position. So if
/// all teacher-forced argmaxes are right, greedy emits exactly the answer; and at the
/// first wrong teacher-forced position greedy has had the same (correct) prefix and
/// emits the same wrong token. (Both must break argmax ties the same way.)
///
/// # Panics
/// If `predictions.len() != rows.rows * rows.t`.
pub fn accuracy(predictions: &[u32], rows: &EvalRows) -> (usize, usize) {
    assert_eq!(
        predictions.len(),
        rows.rows * rows.t,
        "accuracy: expected one prediction per position ({} rows x T = {}), got {}",
        rows.rows,
        rows.t,
        predictions.len()
    );
    let correct = rows
        .problems
        .iter()
        .filter(|p| {
            let base = p.row * rows.t;
            p.positions
                .iter()
                .zip(&p.expected)
                .all(|(&pos, &want)| predictions[base + pos] == want)
        })
        .count();
    (correct, rows.problems.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::TokenSource;

    /// Parses `aa+bb=ccc` (sum reversed) and checks widths and arithmetic.
    fn parse_line(add: &Addition, line: &str) -> (u64, u64) {
        let d = add.digits() as usize;
        let (a, rest) = line.split_once('+').expect(line);
        let (b, c) = rest.split_once('=').expect(line);
        assert_eq!((a.len(), b.len(), c.len()), (d, d, d + 1), "{line}");
        let (a, b): (u64, u64) = (a.parse().unwrap(), b.parse().unwrap());
        let c: u64 = c.chars().rev().collect::<String>().parse().unwrap();
        assert_eq!(a + b, c, "{line}");
        (a, b)
    }

    #[test]
    fn only_answers_and_their_separator_are_trained_on() {
        // A row starting mid-line: "5+31=64\n27+0" (tokens), targets shifted by one.
        let stream = Addition::encode("5+31=64\n27+08=5").unwrap();
        let t = stream.len() - 1;
        let tokens = stream[..t].to_vec();
        let mut targets = stream[1..].to_vec();
        Addition::mask_prompts(&tokens, &mut targets, t);
        let kept: String = targets
            .iter()
            .map(|&x| {
                if x == crate::IGNORE_TARGET {
                    '.'
                } else {
                    Addition::decode(&[x]).chars().next().unwrap()
                }
            })
            .collect();
        // After `=`: the answer digits and the newline; then after the second `=`, `5`.
        assert_eq!(kept, "....64\n......5");
    }

    #[test]
    fn vocabulary_round_trips() {
        assert_eq!(Addition::vocab_size(), 13);
        let text = "0123456789+=\n";
        let ids = Addition::encode(text).unwrap();
        assert_eq!(ids, (0..13).collect::<Vec<u32>>());
        assert_eq!(Addition::decode(&ids), text);
        assert_eq!(Addition::decode(&[13]), "?");
        assert!(Addition::encode("1-2").is_none());
        let add = Addition::new(2, 0).unwrap();
        let mut line = Vec::new();
        add.push_line(47, 85, &mut line);
        assert_eq!(Addition::decode(&line), "47+85=231\n");
        line.clear();
        add.push_line(3, 5, &mut line);
        assert_eq!(Addition::decode(&line), "03+05=800\n");
        assert!(Addition::new(0, 0).is_err() && Addition::new(10, 0).is_err());
    }

    #[test]
    fn the_stream_is_a_function_of_the_seed() {
        let a = Addition::new(3, 1).unwrap();
        let x = a.train_tokens(500);
        assert_eq!(x, Addition::new(3, 1).unwrap().train_tokens(500));
        assert_ne!(x, Addition::new(3, 2).unwrap().train_tokens(500));
        assert_eq!(x.len(), 500 * 13);
        let s = a.train_source(500);
        assert_eq!(s.len(), 500 * 13);
        assert_eq!(s.vocab_hint(), Some(13));
    }

    #[test]
    fn lines_parse_back_to_correct_sums() {
        for digits in [1, 2, 4] {
            let add = Addition::new(digits, 5).unwrap();
            let text = Addition::decode(&add.train_tokens(2000));
            assert!(text.ends_with('\n'));
            let lines: Vec<&str> = text.trim_end_matches('\n').split('\n').collect();
            assert_eq!(lines.len(), 2000);
            for line in lines {
                let (a, b) = parse_line(&add, line);
                assert!(a < add.operand_limit() && b < add.operand_limit());
            }
        }
    }

    #[test]
    fn held_out_pairs_never_appear_in_training_two_digits_exhaustively() {
        let add = Addition::new(2, 11).unwrap();
        let held: Vec<(u64, u64)> = (0..100)
            .flat_map(|a| (0..100).map(move |b| (a, b)))
            .filter(|&(a, b)| add.is_held_out(a, b))
            .collect();
        // About 10% of the 10 000 pairs.
        assert!((800..1200).contains(&held.len()), "{}", held.len());
        // 200 000 training lines: every pair seen is a training pair, and (with 9 000
        // training pairs, ~22 draws each) every training pair is seen.
        let mut seen = vec![false; 10_000];
        for i in 0..200_000 {
            let (a, b) = add.train_problem(i);
            seen[(a * 100 + b) as usize] = true;
        }
        for a in 0..100 {
            for b in 0..100 {
                assert_eq!(
                    seen[(a * 100 + b) as usize],
                    !add.is_held_out(a, b),
                    "{a}+{b}"
                );
            }
        }
        // The held-out set is the same for another seed; eval draws only from it.
        let other = Addition::new(2, 12).unwrap();
        assert!(held.iter().all(|&(a, b)| other.is_held_out(a, b)));
        for j in 0..2000 {
            let (a, b) = add.held_out_problem(j);
            assert!(add.is_held_out(a, b));
            assert_eq!((a, b), other.held_out_problem(j));
        }
    }

    #[test]
    fn eval_rows_hold_scored_held_out_problems() {
        let add = Addition::new(2, 0).unwrap();
        // T + 1 = 35: three whole lines of 10 after a 5-token tail.
        let ev = add.eval_rows(34, 4).unwrap();
        assert_eq!((ev.t, ev.rows, ev.tokens.len()), (34, 4, 4 * 34));
        assert_eq!(ev.problems.len(), 12);
        for (r, row_problems) in ev.problems.chunks(3).enumerate() {
            let row_tokens = &ev.tokens[r * 34..(r + 1) * 34];
            let row_targets = &ev.targets[r * 34..(r + 1) * 34];
            assert_eq!(row_tokens[1..], row_targets[..33]);
            // The row ends with a whole line; decode the full window.
            let mut window = row_tokens.to_vec();
            window.push(row_targets[33]);
            let text = Addition::decode(&window);
            assert!(text.ends_with('\n'), "{text:?}");
            let whole: Vec<&str> = text[5..].trim_end_matches('\n').split('\n').collect();
            assert_eq!(whole.len(), 3);
            for (p, line) in row_problems.iter().zip(whole) {
                assert_eq!(p.row, r);
                assert_eq!(parse_line(&add, line), (p.a, p.b));
                assert!(add.is_held_out(p.a, p.b));
                assert_eq!(p.positions.len(), 4);
                for (&pos, &want) in p.positions.iter().zip(&p.expected) {
                    assert_eq!(row_targets[pos], want);
                }
                // The first answer position predicts the token after '='.
                assert_eq!(row_tokens[p.positions[0]], Addition::EQUALS);
                assert_eq!(*p.expected.last().unwrap(), Addition::SEP);
            }
        }
        assert!(add.eval_rows(8, 1).is_err());
        assert_eq!(add.eval_rows(9, 1).unwrap().problems.len(), 1);
    }

    #[test]
    fn accuracy_counts_exact_matches() {
        let add = Addition::new(2, 0).unwrap();
        let ev = add.eval_rows(29, 2).unwrap(); // 3 problems per row, no partial line
        assert_eq!(ev.problems.len(), 6);
        // Perfect predictions: the targets themselves.
        assert_eq!(accuracy(&ev.targets, &ev), (6, 6));
        // Wrong everywhere except at answer positions: still all correct.
        let mut pred = vec![Addition::PLUS; ev.targets.len()];
        for p in &ev.problems {
            for (&pos, &want) in p.positions.iter().zip(&p.expected) {
                pred[p.row * ev.t + pos] = want;
            }
        }
        assert_eq!(accuracy(&pred, &ev), (6, 6));
        // One wrong digit in one problem, one wrong separator in another.
        let p = &ev.problems[4];
        pred[p.row * ev.t + p.positions[1]] = (p.expected[1] + 1) % 10;
        let q = &ev.problems[0];
        pred[q.row * ev.t + q.positions[3]] = 0;
        assert_eq!(accuracy(&pred, &ev), (4, 6));
    }

    #[test]
    #[should_panic(expected = "one prediction per position")]
    fn accuracy_rejects_wrong_length() {
        let ev = Addition::new(1, 0).unwrap().eval_rows(6, 1).unwrap();
        accuracy(&[0; 3], &ev);
    }
}
