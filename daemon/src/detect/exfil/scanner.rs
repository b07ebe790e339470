//! The per-turn scanner: runs the rules over the turn's text, byte by byte, and says how much
//! of it may be released.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;

use regex_automata::dfa::Automaton;
use regex_automata::util::primitives::StateID;

use super::rules::ExfilRules;
use super::{ExfilHit, ExfilStep};

/// A live candidate match: anchored at absolute offset `start`, in DFA state `state` after
/// every scanned byte from `start` on.
#[derive(Clone, Copy)]
struct Run {
    start: usize,
    state: StateID,
    /// It started right after an ASCII letter, in [`ExfilRules::after_letter`]'s DFA.
    after_letter: bool,
}

/// Per-turn streaming scanner. Feed it each token's text with [`push`](Self::push); release
/// what it says; call [`finish`](Self::finish) at the end of the turn.
///
/// After a [`ExfilStep::Breach`] the scanner stays usable: the breaching match counts as
/// decided, so a caller in `observe` mode keeps pushing and the held text (the match included)
/// is released as usual; further secrets are reported as they are found. Several matches
/// decided by one byte are reported by consecutive calls (an empty `push("")` is fine).
pub struct ExfilScanner {
    rules: Arc<ExfilRules>,
    /// The unreleased text: `buf[0]` is at absolute offset `base`.
    buf: Vec<u8>,
    base: usize,
    /// Absolute offset up to which every candidate has been advanced.
    scanned: usize,
    /// The byte at `scanned - 1` (look-behind for the next candidate start).
    prev: Option<u8>,
    /// Live candidates, in increasing `start` order.
    runs: Vec<Run>,
    /// Decided breaches not yet reported.
    pending: VecDeque<ExfilHit>,
    peak_held: usize,
    ended: bool,
}

impl fmt::Debug for ExfilScanner {
    // Never prints the held text: it may be a secret.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExfilScanner")
            .field("released", &self.base)
            .field("held", &self.buf.len())
            .field("live_candidates", &self.runs.len())
            .field("pending_breaches", &self.pending.len())
            .field("peak_held", &self.peak_held)
            .finish()
    }
}

impl ExfilScanner {
    /// A scanner for one turn. Allocates the held-text buffer and the candidate list (once per
    /// turn; [`reset`](Self::reset) reuses them).
    pub fn new(rules: Arc<ExfilRules>) -> Self {
        let cap = rules.max_match_len() + 64;
        Self {
            rules,
            buf: Vec::with_capacity(cap),
            base: 0,
            scanned: 0,
            prev: None,
            runs: Vec::with_capacity(16),
            pending: VecDeque::new(),
            peak_held: 0,
            ended: false,
        }
    }

    /// Starts a new turn, keeping the allocations.
    pub fn reset(&mut self) {
        self.buf.clear();
        self.base = 0;
        self.scanned = 0;
        self.prev = None;
        self.runs.clear();
        self.pending.clear();
        self.peak_held = 0;
        self.ended = false;
    }

    /// Appends the next token's text. Returns how many bytes at the front of the not-yet-released
    /// text may now be released: everything before the start of the earliest candidate that
    /// some rule could still complete, whatever text follows (all of it when there is none).
    /// Or a breach, in which case nothing is released by this call.
    pub fn push(&mut self, text: &str) -> ExfilStep {
        if self.ended {
            // A push after `finish` without `reset` is a caller bug; scan it as a new turn
            // rather than lose it.
            self.reset();
        }
        self.buf.extend_from_slice(text.as_bytes());
        if let Some(hit) = self.pending.pop_front() {
            return ExfilStep::Breach(hit);
        }
        self.scan();
        if let Some(hit) = self.pending.pop_front() {
            return ExfilStep::Breach(hit);
        }
        let n = self.runs.first().map_or(self.scanned, |r| r.start) - self.base;
        self.release(n)
    }

    /// End of the turn: decides everything still held (a candidate that is a complete match at
    /// the end of the text is one). Returns a breach, or `Release` of everything held. Call it
    /// again after a breach to get the next one or the final release. The next turn starts
    /// with [`reset`](Self::reset) (a `push` after the final release also starts one).
    pub fn finish(&mut self) -> ExfilStep {
        if let Some(hit) = self.pending.pop_front() {
            return ExfilStep::Breach(hit);
        }
        self.scan();
        if self.pending.is_empty() && !self.ended {
            let end = self.scanned;
            for run in self.runs.drain(..) {
                let dfa = self.rules.dfa(run.after_letter);
                let eoi = dfa.dfa.next_eoi_state(run.state);
                if dfa.dfa.is_match_state(eoi) {
                    if let Some(hit) = self
                        .rules
                        .decide(dfa, &self.buf, self.base, run.start, end, eoi)
                    {
                        self.pending.push_back(hit);
                    }
                }
            }
            self.ended = true;
        }
        if let Some(hit) = self.pending.pop_front() {
            return ExfilStep::Breach(hit);
        }
        let n = self.buf.len();
        self.release(n)
    }

    /// Bytes pushed but not yet released.
    pub fn held_bytes(&self) -> usize {
        self.buf.len()
    }

    /// Bytes released so far in this turn (the absolute offset of the held text).
    pub fn released_bytes(&self) -> usize {
        self.base
    }

    /// The most bytes held after any `push` of this turn (the per-turn hold-back measure).
    pub fn peak_held_bytes(&self) -> usize {
        self.peak_held
    }

    fn release(&mut self, n: usize) -> ExfilStep {
        self.buf.drain(..n);
        self.base += n;
        self.peak_held = self.peak_held.max(self.buf.len());
        ExfilStep::Release(n)
    }

    /// Advances every candidate over the unscanned bytes, starting a candidate at each byte.
    /// Stops after the first byte that decides a breach (the rest is scanned by the next call).
    fn scan(&mut self) {
        let Self {
            rules,
            buf,
            base,
            scanned,
            prev,
            runs,
            pending,
            ..
        } = self;
        let end = *base + buf.len();
        while *scanned < end {
            let i = *scanned;
            let b = buf[i - *base];
            // No fresh candidate after a letter when no rule may start there.
            let fresh = rules.dfa_after(*prev).map(|d| Run {
                start: i,
                state: d.start_for(*prev),
                after_letter: prev.is_some_and(|p| p.is_ascii_alphabetic()),
            });
            let total = runs.len() + usize::from(fresh.is_some());
            let mut keep = 0;
            for k in 0..total {
                let mut run = match (runs.get(k), fresh) {
                    (Some(r), _) => *r,
                    (None, Some(f)) => f,
                    (None, None) => break,
                };
                let dfa = rules.dfa(run.after_letter);
                run.state = dfa.dfa.next_state(run.state, b);
                if dfa.dfa.is_dead_state(run.state) {
                    continue;
                }
                if dfa.dfa.is_match_state(run.state) {
                    // A match [run.start, i) is complete (DFA matches are reported one byte late).
                    if let Some(hit) = rules.decide(dfa, buf, *base, run.start, i, run.state) {
                        pending.push_back(hit);
                        continue;
                    }
                }
                // Consumed bytes: i + 1 - start. One more than the longest match can still
                // report that match (above); beyond that nothing can match from here.
                if i + 1 - run.start > rules.max_match_len() {
                    continue;
                }
                // keep <= k: this overwrites a slot already read (or appends the fresh run).
                if keep < runs.len() {
                    runs[keep] = run;
                } else {
                    runs.push(run);
                }
                keep += 1;
            }
            runs.truncate(keep);
            *prev = Some(b);
            *scanned = i + 1;
            if !pending.is_empty() {
                return;
            }
        }
    }
}
