//! HaltMonitor: the per-token threshold check of spec 001 (G6; both in docs/spec.md).
//!
//! The spec models the monitor as a function `run : hard_limit → List (Token × Score) → Output`
//! and proves three properties about it: halt is irrevocable, every emitted token passed the
//! threshold, and any failing score halts the stream. haltd needs the same check in two shapes:
//! token by token on a live stream ([`HaltMonitor::check`]), and over a complete list as the
//! spec states it, for the tests. Both are the *same* code: `run` (test builds only) is
//! implemented by driving a [`HaltMonitor`], so the property tests on `run` cover the streaming
//! monitor too, and a separate transcription of the spec's recursive definition in the test
//! module checks that `run` matches the spec.
//!
//! Floating point versus the spec's rationals:
//! - A score passes when `score >= hard_limit`; a score exactly at the limit passes, as in the
//!   spec (`current_score < hard_limit → halt`).
//! - A NaN score has no place in the spec's ordered rationals. `NaN < limit` is false in IEEE
//!   754, so a literal transcription would let it pass; haltd halts on it instead (fail closed,
//!   G3): a scorer that returns NaN is broken and its tokens are unpoliced.
//! - A NaN or infinite `hard_limit` is rejected at construction ([`HaltMonitor::new`]), which
//!   is where the daemon validates its config. A NaN limit would pass every score, `-inf`
//!   would pass every non-NaN score and `+inf` would halt on the first token: all three are
//!   configuration mistakes, not policies.

use std::fmt;

/// Construction errors of [`HaltMonitor`].
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum MonitorError {
    /// The threshold is NaN or infinite.
    #[error("hard_limit must be a finite number, got {value}")]
    NonFiniteLimit { value: f64 },
}

/// What the monitor says about one scored token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Decision {
    /// The token passed and may be emitted.
    Emit,
    /// The stream is halted: this token and every later one must not be emitted.
    Halt,
}

/// The result of running the monitor over a whole stream (spec 001 `HaltMonitor.Output`).
#[cfg(test)]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Output<T> {
    /// Every token passed; the list is exactly the input tokens.
    Emitted(Vec<T>),
    /// The prefix emitted before the first failing token; the failing token is not in it.
    Halted(Vec<T>),
}

#[cfg(test)]
impl<T> Output<T> {
    /// The emitted tokens, whatever the outcome (spec `Output.tokens`).
    pub fn tokens(&self) -> &[T] {
        match self {
            Output::Emitted(ts) | Output::Halted(ts) => ts,
        }
    }

    /// True when the whole input passed (spec `Output.isEmitted`).
    pub fn is_emitted(&self) -> bool {
        matches!(self, Output::Emitted(_))
    }
}

/// Streaming threshold monitor: one per stream, fed one score per token.
///
/// Once [`check`](Self::check) has returned [`Decision::Halt`] it returns `Halt` forever; there
/// is deliberately no reset, so a halted stream cannot be resumed by anything that holds the
/// monitor.
#[derive(Debug, Clone, PartialEq)]
pub struct HaltMonitor {
    hard_limit: f64,
    halted: bool,
}

impl HaltMonitor {
    /// A monitor that halts on the first score below `hard_limit`.
    ///
    /// Fails on a NaN or infinite limit (see the module docs).
    pub fn new(hard_limit: f64) -> Result<Self, MonitorError> {
        if !hard_limit.is_finite() {
            return Err(MonitorError::NonFiniteLimit { value: hard_limit });
        }
        Ok(Self {
            hard_limit,
            halted: false,
        })
    }

    /// Checks the next token's score. `score < hard_limit` or a NaN score halts, irrevocably.
    #[inline]
    pub fn check(&mut self, score: f64) -> Decision {
        // NaN compares false with everything, so it is tested explicitly: it must halt.
        if self.halted || score.is_nan() || score < self.hard_limit {
            self.halted = true;
            Decision::Halt
        } else {
            Decision::Emit
        }
    }

    /// True once any check has halted.
    pub fn is_halted(&self) -> bool {
        self.halted
    }

    /// The threshold this monitor enforces.
    pub fn hard_limit(&self) -> f64 {
        self.hard_limit
    }
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Decision::Emit => "emit",
            Decision::Halt => "halt",
        })
    }
}

/// Runs the monitor over a complete list of `(token, score)` items (spec 001 `HaltMonitor.run`).
///
/// Implemented by feeding a [`HaltMonitor`] item by item, so it cannot drift from the
/// streaming monitor. A non-finite `hard_limit` cannot be enforced meaningfully, so it yields
/// `Halted(vec![])` (fail closed) rather than a panic; the daemon rejects such limits earlier,
/// at config validation, through [`HaltMonitor::new`].
#[cfg(test)]
pub fn run<T: Clone>(hard_limit: f64, items: &[(T, f64)]) -> Output<T> {
    let Ok(mut monitor) = HaltMonitor::new(hard_limit) else {
        return Output::Halted(Vec::new());
    };
    let mut emitted = Vec::with_capacity(items.len());
    for (token, score) in items {
        match monitor.check(*score) {
            Decision::Emit => emitted.push(token.clone()),
            Decision::Halt => return Output::Halted(emitted),
        }
    }
    Output::Emitted(emitted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Transcription of the spec's recursive definition, kept apart from the implementation:
    ///
    /// ```text
    /// run h []             = emitted []
    /// run h ((t, s) :: xs) = if s < h then halted []
    ///                        else match run h xs with
    ///                             | emitted ts => emitted (t :: ts)
    ///                             | halted ts  => halted (t :: ts)
    /// ```
    ///
    /// Only valid for non-NaN scores (the spec's scores are rationals).
    fn spec_run<T: Clone>(h: f64, items: &[(T, f64)]) -> Output<T> {
        match items.split_first() {
            None => Output::Emitted(Vec::new()),
            Some(((t, s), rest)) => {
                if *s < h {
                    Output::Halted(Vec::new())
                } else {
                    match spec_run(h, rest) {
                        Output::Emitted(ts) => {
                            Output::Emitted(std::iter::once(t.clone()).chain(ts).collect())
                        }
                        Output::Halted(ts) => {
                            Output::Halted(std::iter::once(t.clone()).chain(ts).collect())
                        }
                    }
                }
            }
        }
    }

    /// Feeds the streaming monitor item by item, the way the data plane does.
    fn stream_run<T: Clone>(h: f64, items: &[(T, f64)]) -> Output<T> {
        let mut m = HaltMonitor::new(h).expect("finite limit");
        let mut out = Vec::new();
        for (t, s) in items {
            if m.check(*s) == Decision::Halt {
                assert!(m.is_halted());
                return Output::Halted(out);
            }
            out.push(t.clone());
        }
        Output::Emitted(out)
    }

    /// Limits and scores on a quarter grid, so that exact-boundary scores (== limit) are
    /// common; plus arbitrary finite scores and infinities for the tails.
    fn limit() -> impl Strategy<Value = f64> {
        prop_oneof![
            (-8i32..=8).prop_map(|q| f64::from(q) * 0.25),
            -1.0e6f64..1.0e6f64,
        ]
    }

    fn score() -> impl Strategy<Value = f64> {
        prop_oneof![
            6 => (-8i32..=8).prop_map(|q| f64::from(q) * 0.25),
            2 => proptest::num::f64::NORMAL | proptest::num::f64::ZERO,
            1 => Just(f64::INFINITY),
            1 => Just(f64::NEG_INFINITY),
        ]
    }

    /// Items are (index, score) so every token is distinct and positions are checkable.
    fn items() -> impl Strategy<Value = Vec<(usize, f64)>> {
        proptest::collection::vec(score(), 0..40)
            .prop_map(|scores| scores.into_iter().enumerate().collect())
    }

    fn first_failure(h: f64, items: &[(usize, f64)]) -> Option<usize> {
        items.iter().position(|(_, s)| *s < h)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Property 1: halt is irrevocable. After the first failing item the output is the
        /// halted prefix before it, and appending any items never changes that.
        #[test]
        fn prop_halt_is_irrevocable(h in limit(), xs in items(), tail in items()) {
            if let Some(i) = first_failure(h, &xs) {
                let expected = Output::Halted(xs[..i].iter().map(|(t, _)| *t).collect());
                prop_assert_eq!(&run(h, &xs), &expected);
                let mut longer = xs.clone();
                longer.extend(tail.iter().map(|(t, s)| (t + 1000, *s)));
                prop_assert_eq!(&run(h, &longer), &expected);
            }
        }

        /// Property 2: every emitted token passed the threshold (score >= hard_limit).
        #[test]
        fn prop_emitted_tokens_pass(h in limit(), xs in items()) {
            for t in run(h, &xs).tokens() {
                prop_assert!(xs[*t].1 >= h, "token {} with score {} < {}", t, xs[*t].1, h);
            }
        }

        /// Property 3: any failing score halts the stream.
        #[test]
        fn prop_failing_score_halts(h in limit(), xs in items()) {
            let out = run(h, &xs);
            if xs.iter().any(|(_, s)| *s < h) {
                prop_assert!(!out.is_emitted());
            } else {
                prop_assert_eq!(out, Output::Emitted(xs.iter().map(|(t, _)| *t).collect()));
            }
        }

        /// G6: the failing token itself is never emitted.
        #[test]
        fn prop_failing_token_not_emitted(h in limit(), xs in items()) {
            if let Some(i) = first_failure(h, &xs) {
                let out = run(h, &xs);
                prop_assert!(!out.tokens().contains(&xs[i].0));
                prop_assert_eq!(out.tokens().len(), i);
            }
        }

        /// The streaming monitor, fed item by item, produces exactly run()'s output.
        #[test]
        fn prop_streaming_equals_run(h in limit(), xs in items()) {
            prop_assert_eq!(stream_run(h, &xs), run(h, &xs));
        }

        /// run() equals the transcription of the spec's recursive definition.
        #[test]
        fn prop_run_equals_spec(h in limit(), xs in items()) {
            prop_assert_eq!(run(h, &xs), spec_run(h, &xs));
        }

        /// Once halted, the streaming monitor says Halt for every later score, even passing ones.
        #[test]
        fn prop_monitor_stays_halted(h in limit(), later in proptest::collection::vec(score(), 0..20)) {
            let mut m = HaltMonitor::new(h).expect("finite limit");
            prop_assert_eq!(m.check(f64::NEG_INFINITY), Decision::Halt);
            for s in later {
                prop_assert_eq!(m.check(s), Decision::Halt);
                prop_assert!(m.is_halted());
            }
        }
    }

    #[test]
    fn boundary_score_passes() {
        let mut m = HaltMonitor::new(0.5).expect("finite limit");
        assert_eq!(m.check(0.5), Decision::Emit);
        assert_eq!(m.check(0.500_000_1), Decision::Emit);
        assert_eq!(m.check(0.499_999_9), Decision::Halt);
        assert_eq!(m.check(1.0), Decision::Halt);
        assert_eq!(
            run(0.5, &[("a", 0.5), ("b", 0.5)]),
            Output::Emitted(vec!["a", "b"])
        );
    }

    #[test]
    fn nan_score_halts() {
        let mut m = HaltMonitor::new(0.0).expect("finite limit");
        assert_eq!(m.check(1.0), Decision::Emit);
        assert_eq!(m.check(f64::NAN), Decision::Halt);
        assert_eq!(m.check(1.0), Decision::Halt);
        assert_eq!(
            run(0.0, &[("a", 1.0), ("b", f64::NAN), ("c", 1.0)]),
            Output::Halted(vec!["a"])
        );
    }

    #[test]
    fn non_finite_limit_rejected() {
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert!(matches!(
                HaltMonitor::new(bad),
                Err(MonitorError::NonFiniteLimit { .. })
            ));
            assert_eq!(run(bad, &[("a", 1.0)]), Output::Halted(vec![]));
        }
        let m = HaltMonitor::new(-3.5).expect("finite limit");
        assert_eq!(m.hard_limit(), -3.5);
        assert!(!m.is_halted());
    }

    #[test]
    fn empty_input_is_emitted() {
        let out = run::<&str>(0.0, &[]);
        assert!(out.is_emitted());
        assert!(out.tokens().is_empty());
    }
}
