//! The per-turn scanner: runs the rules over the turn's text, byte by byte, and says how much
//! of it may be released.
//!
//! It can also *look ahead* ([`ExfilScanner::look_ahead`]): a caller that already knows the
//! text that comes next (the built-in model can produce its next token before the current one
//! goes out) asks whether that text rules out the candidates that hold the current text back.
//! Each held candidate's DFA state is advanced over the next text on a copy (one `StateID`,
//! no allocation) and nothing else changes: the next text is scanned for real when it is
//! pushed, so every byte is still scanned once, in order, by `push`.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;

use regex_automata::dfa::Automaton;
use regex_automata::util::primitives::StateID;

use super::rules::{ExfilRules, RuleDfa};
use super::{Ahead, ExfilHit, ExfilStep};

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
    /// The text not yet past every candidate: `buf[0]` is at absolute offset `base`.
    buf: Vec<u8>,
    base: usize,
    /// Absolute offset up to which the caller was told to release (`>= base`): past `base`
    /// when a look-ahead ruled out candidates that `push` has not advanced yet. Those bytes
    /// stay in `buf` until then (a candidate's value check reads its bytes from there).
    out: usize,
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
            .field("released", &self.out)
            .field("held", &self.held_bytes())
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
            out: 0,
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
        self.out = 0;
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
            return self.breach(hit);
        }
        self.scan();
        if let Some(hit) = self.pending.pop_front() {
            return self.breach(hit);
        }
        let point = self.runs.first().map_or(self.scanned, |r| r.start);
        self.release_to(point)
    }

    /// Looks at `next`, the text the next [`push`](Self::push) will bring (or the end of the
    /// turn), without scanning it: releases the held text that no candidate can cover given
    /// that text. Returns how many more bytes may be released now (0 when nothing was held
    /// or every held candidate could still match).
    ///
    /// A held candidate is ruled out when, advanced over `next` on a copy of its state, it
    /// dies (or grows longer than any match) before reaching a match; it blocks the release
    /// from its start when it reaches a match state within `next` (a possible secret, decided
    /// by `push`), is still live at the end of `next`, or would be a complete match if the
    /// text ended here (the turn may end before `next` is pushed: a trip, a disconnect).
    ///
    /// Contract: the next `push` brings exactly `Ahead::Text`'s text, or the turn ends (no
    /// more pushes: `finish`, or a trip that drops the held text). Then no byte of a match is
    /// released before the match is reported, as for `push` alone: a byte released here is
    /// one that `push(next)` would have released. Never reports a breach; cost: one
    /// transition per held candidate and byte of `next` until it is decided (none when
    /// nothing is held), no allocation.
    pub fn look_ahead(&mut self, next: Ahead<'_>) -> usize {
        if self.ended || !self.pending.is_empty() || self.scanned != self.base + self.buf.len() {
            // A breach is being reported, or the text is not scanned to its end: no release.
            return 0;
        }
        let mut point = self.scanned;
        for run in &self.runs {
            let dfa = self.rules.dfa(run.after_letter);
            if !self.ruled_out(dfa, run, next) {
                point = run.start;
                break;
            }
        }
        let to = point.max(self.out);
        let n = to - self.out;
        self.out = to;
        n
    }

    /// Whether `run` can match neither at the end of the text so far nor within `next`.
    fn ruled_out(&self, dfa: &RuleDfa, run: &Run, next: Ahead<'_>) -> bool {
        if dfa.dfa.is_match_state(dfa.dfa.next_eoi_state(run.state)) {
            return false;
        }
        let Ahead::Text(text) = next else {
            // The text ends here: a candidate that is no match at its end never will be.
            return true;
        };
        let mut state = run.state;
        for (j, &b) in text.as_bytes().iter().enumerate() {
            state = dfa.dfa.next_state(state, b);
            if dfa.dfa.is_dead_state(state) {
                return true;
            }
            if dfa.dfa.is_match_state(state) {
                // A match ends before this byte: `push` decides it (a value check may clear it).
                return false;
            }
            // As in `scan`: longer than the longest match, nothing can match from here.
            if self.scanned + j + 1 - run.start > self.rules.max_match_len() {
                return true;
            }
        }
        false
    }

    /// End of the turn: decides everything still held (a candidate that is a complete match at
    /// the end of the text is one). Returns a breach, or `Release` of everything held. Call it
    /// again after a breach to get the next one or the final release. The next turn starts
    /// with [`reset`](Self::reset) (a `push` after the final release also starts one).
    pub fn finish(&mut self) -> ExfilStep {
        if let Some(hit) = self.pending.pop_front() {
            return self.breach(hit);
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
            return self.breach(hit);
        }
        let end = self.base + self.buf.len();
        self.release_to(end)
    }

    /// Bytes pushed but not yet released.
    pub fn held_bytes(&self) -> usize {
        self.base + self.buf.len() - self.out
    }

    /// Bytes released so far in this turn (the absolute offset of the held text).
    pub fn released_bytes(&self) -> usize {
        self.out
    }

    /// The most bytes held after any `push` of this turn (the per-turn hold-back measure).
    pub fn peak_held_bytes(&self) -> usize {
        self.peak_held
    }

    /// Everything before absolute offset `point` is decided: drops it from the buffer and
    /// releases what a look-ahead did not release already.
    fn release_to(&mut self, point: usize) -> ExfilStep {
        // Only a `push` that broke `look_ahead`'s contract (other text than announced) could
        // leave a candidate alive in text already released.
        debug_assert!(point >= self.out, "look_ahead's text was not the next push");
        self.buf.drain(..point - self.base);
        self.base = point;
        let to = point.max(self.out);
        let n = to - self.out;
        self.out = to;
        self.peak_held = self.peak_held.max(self.held_bytes());
        ExfilStep::Release(n)
    }

    fn breach(&self, hit: ExfilHit) -> ExfilStep {
        debug_assert!(
            hit.start >= self.out,
            "look_ahead's text was not the next push"
        );
        ExfilStep::Breach(hit)
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
