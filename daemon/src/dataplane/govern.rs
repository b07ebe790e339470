//! The detectors on the data plane: per token, [`crate::detect::pipeline::TurnGovernor`]
//! judges the token before it is accounted or sent; the exfiltration scanner may hold text
//! back, so tokens wait in the turn's hold queue until the scanner releases them, and go out
//! one frame each, in order. A trip drops everything held: held text is never emitted.
//!
//! The common case (nothing held) emits the token straight from the source, without copying
//! it; a token joins the hold queue (an owned copy: one allocation) only while the scanner
//! holds text.

use std::{collections::VecDeque, io, sync::atomic::Ordering::SeqCst, sync::Arc};

use serde_json::Value;

use super::{SendKind, Turn, Worker};
use crate::{
    codes::FailureCode,
    detect::{pipeline::Gate, Trip},
    gate::monotonic_ns,
    openai::{Token, MAX_TOP_LOGPROBS},
    safety::{self, SafetyContext, SafetyMode},
};

/// Output text kept per turn for SafetyCheck's cited-source check; beyond it the citation
/// check reports the text as not fully known.
const MAX_SAFETY_TEXT: usize = 256 * 1024;

/// What a held frame carries.
#[derive(Debug)]
pub(super) enum PendingKind {
    Content {
        logprob: f32,
        top: Vec<(String, f32)>,
    },
    /// A tool-call delta, and the calls it starts (`{index, id, name}`).
    ToolCall { delta: Value, started: Vec<Value> },
}

/// A frame held back by the exfiltration scanner.
#[derive(Debug)]
pub(super) struct Pending {
    pub text: String,
    pub kind: PendingKind,
    /// Byte offset in the turn's scanned text where this frame's text ends.
    pub end: usize,
    /// Byte offset of the text in the completion (for `text_offset`).
    pub offset: usize,
    /// When its token reached haltd (`haltd_token_overhead_seconds` runs from here).
    pub arrived_ns: u64,
}

/// The hold queue and scan positions of a turn.
#[derive(Debug, Default)]
pub(super) struct Hold {
    pub queue: VecDeque<Pending>,
    /// Bytes pushed to the scanner so far.
    pub scanned: usize,
    /// Bytes the scanner released so far.
    pub released: usize,
    /// The source ended (and the scanner decided everything): drain, then finish.
    pub ending: bool,
}

impl Hold {
    /// Applies a release of `n` more bytes.
    pub fn release(&mut self, n: usize) {
        self.released = self.released.saturating_add(n).min(self.scanned);
    }
    /// The next frame that may go out.
    pub fn pop_released(&mut self) -> Option<Pending> {
        if self.queue.front().is_some_and(|p| p.end <= self.released) {
            self.queue.pop_front()
        } else {
            None
        }
    }
    /// Whether a frame whose text ends at `end` may skip the queue.
    pub fn passes(&self, end: usize) -> bool {
        self.queue.is_empty() && end <= self.released
    }
}

impl Turn {
    /// Keeps emitted text for SafetyCheck (bounded).
    pub(super) fn note_output(&mut self, text: &str) {
        if self.out_text.len() + text.len() <= MAX_SAFETY_TEXT {
            self.out_text.push_str(text);
        } else {
            self.out_text_truncated = true;
        }
    }

    /// SafetyCheck's verdict on this turn (spec 004), as the record stores it.
    pub(super) fn safety_verdict(
        &self,
        shared: &crate::shared::Shared,
        typed_end: bool,
    ) -> safety::SafetyVerdict {
        let ctx = SafetyContext {
            request_source_urls: Some(self.request_urls.clone()),
            cited_urls: (!self.out_text_truncated).then(|| safety::extract_urls(&self.out_text)),
            last_refusal_was_typed: Some(typed_end),
            identity_before: self.identity_before.clone(),
            identity_after: self.identity_after.clone(),
            versor_condition: None,
        };
        shared
            .detectors
            .safety
            .check(&ctx, &shared.detectors.safety_pack)
    }
}

impl Worker {
    /// A detector tripped the stream: note who and why for the terminal event and record,
    /// count it, trip, halt.
    pub(super) fn detector_trip(&mut self, key: usize, trip: Trip) -> io::Result<()> {
        let shared = Arc::clone(&self.shared);
        let id = self.conns[key].id;
        tracing::info!(stream_id = %id, detector = trip.detector, code = %trip.code, detail = %trip.detail, "detector tripped the stream");
        shared
            .metrics
            .detector_trips
            .get_or_create(&crate::metrics::DetectorLabels {
                detector: trip.detector,
                code: trip.code,
            })
            .inc();
        // Bounded: the terminal frame must fit the gate's terminal allowance.
        let detail: String = trip.detail.chars().take(240).collect();
        shared.meta(id.slot).detector_trip = Some((trip.detector, detail));
        let _ = shared.trip(id, trip.code);
        self.halt(key)
    }

    /// Sends one released frame.
    pub(super) fn emit_pending(&mut self, key: usize, p: Pending) -> io::Result<()> {
        let shared = Arc::clone(&self.shared);
        let ignore_halt = shared.cfg.faults.emitter_ignores_halt;
        let conn = &mut self.conns[key];
        let slot = shared.table.slot(conn.id.slot);
        let Some(turn) = conn.turn.as_mut() else {
            return Ok(());
        };
        let index = slot.tokens_submitted.load(SeqCst);
        conn.wbuf.clear();
        let first = !turn.first_frame_sent;
        match &p.kind {
            PendingKind::Content { logprob, top } => {
                let mut tops: [(&str, f32); MAX_TOP_LOGPROBS as usize] =
                    [("", 0.0); MAX_TOP_LOGPROBS as usize];
                let n = top.len().min(turn.top_logprobs as usize).min(tops.len());
                for (slot_, (s, l)) in tops.iter_mut().zip(top).take(n) {
                    *slot_ = (s.as_str(), *l);
                }
                let tok = Token {
                    text: &p.text,
                    logprob: *logprob,
                    top: &tops[..n],
                };
                turn.enc
                    .content_event(&mut conn.wbuf, &p.text, &[tok], &[p.offset], first);
            }
            PendingKind::ToolCall { delta, .. } => {
                turn.enc.tool_call_event(&mut conn.wbuf, delta, first);
            }
        }
        turn.first_frame_sent = true;
        if !slot.begin_frame(true, ignore_halt, conn.wbuf.len()) {
            return self.halt(key);
        }
        if let PendingKind::ToolCall { started, .. } = p.kind {
            if let Some(up) = conn.up.as_mut() {
                up.set_inflight_tools(started);
            }
        }
        turn.note_output(&p.text);
        turn.inflight_token = index + 1;
        conn.frame_arrived_ns = p.arrived_ns;
        self.send(key, SendKind::Token)
    }

    /// The end of a turn's text: the detectors' and the scanner's last word. Returns `false`
    /// when the turn was tripped (the halt is under way).
    pub(super) fn govern_end(&mut self, key: usize) -> io::Result<bool> {
        let conn = &mut self.conns[key];
        let Some(turn) = conn.turn.as_mut() else {
            return Ok(false);
        };
        if turn.hold.ending {
            return Ok(true);
        }
        turn.hold.ending = true;
        match turn.gov.on_end(monotonic_ns()) {
            Gate::Trip(t) => {
                self.detector_trip(key, t)?;
                Ok(false)
            }
            Gate::Release(n) => {
                turn.hold.release(n);
                Ok(true)
            }
        }
    }

    /// SafetyCheck at the clean end of a turn, before its final frame: the verdict goes into
    /// the record; in enforce mode a violation trips the stream instead of ending it.
    /// Returns `false` when it tripped.
    pub(super) fn safety_at_end(&mut self, key: usize) -> io::Result<bool> {
        let shared = Arc::clone(&self.shared);
        let conn = &mut self.conns[key];
        let Some(turn) = conn.turn.as_mut() else {
            return Ok(true);
        };
        let verdict = turn.safety_verdict(&shared, true);
        let upheld = verdict.upheld;
        let violated: Vec<String> = verdict.violated_boundaries.iter().cloned().collect();
        turn.safety = Some(serde_json::to_value(&verdict).unwrap_or(Value::Null));
        if !upheld && shared.cfg.detectors.safety.mode == SafetyMode::Enforce {
            return self
                .detector_trip(
                    key,
                    Trip {
                        detector: "safety",
                        code: FailureCode::SafetyBoundaryViolated,
                        detail: format!("violated: {}", violated.join(", ")),
                    },
                )
                .map(|()| false);
        }
        Ok(true)
    }
}
