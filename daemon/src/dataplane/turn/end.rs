//! The end of a turn's text, the last stage of the pipeline: the detectors' and the
//! scanner's last word ([`Step::govern_end`]), then, once every held frame went out,
//! SafetyCheck's verdict and the final frame (the final events of a stream, or the whole
//! batch response).

use std::{io, sync::atomic::Ordering::SeqCst, sync::Arc};

use serde_json::{json, Value};

use crate::dataplane::Step;
use crate::dataplane::{
    conn::outbox::frame,
    turn::{HeldToken, Turn},
};
use crate::{
    clock::monotonic_ns,
    codes::FailureCode,
    detect::{pipeline::Gate, DetectorId, Trip, TripKind},
    progress::Check,
    safety::SafetyMode,
    stream::Mode,
    wire::{
        http::{self, Persist},
        Channel, StreamId, Token,
    },
};

/// Writes the whole batch response (asked for, or a degraded stream) into `out`: one frame.
fn encode_batch(
    turn: &Turn,
    out: &mut Vec<u8>,
    id: StreamId,
    end: (&str, (u64, u64)),
    tool_calls: Option<&Value>,
    (persist, request_id): (Persist, &str),
) {
    let (reason, usage) = end;
    let with_mode = [("x-request-id", request_id), ("x-haltd-mode", "degraded")];
    let degraded_hdr: &[(&str, &str)] = if turn.degraded {
        &with_mode
    } else {
        &with_mode[..1]
    };
    let tops: Vec<Vec<(&str, f32)>> = turn
        .held_tokens
        .iter()
        .map(|t| t.top.iter().map(|(s, l)| (s.as_str(), *l)).collect())
        .collect();
    let toks: Vec<Token<'_>> = turn
        .held_tokens
        .iter()
        .zip(&tops)
        .map(|(t, top)| Token {
            text: &t.text,
            logprob: t.logprob,
            top,
        })
        .collect();
    let offsets: Vec<usize> = turn.held_tokens.iter().map(|t| t.offset).collect();
    if turn.stream {
        // Degraded mode serves a stream request as batch, still as SSE so that streaming
        // clients read it: the reasoning event (if any), one content event, the final
        // events, [DONE].
        http::write_head_persist(
            out,
            200,
            "text/event-stream",
            None,
            Some(id),
            degraded_hdr,
            persist,
        );
        let body = out.len();
        let mut first = true;
        for (channel, text) in [
            (Channel::Reasoning, &turn.held_reasoning),
            (Channel::Content, &turn.held_text),
        ] {
            let of = |t: &HeldToken| t.channel == channel;
            let toks: Vec<Token<'_>> = filtered(&toks, &turn.held_tokens, of);
            let offsets: Vec<usize> = filtered(&offsets, &turn.held_tokens, of);
            let empty_answer = channel == Channel::Content && first && toks.is_empty();
            if !text.is_empty() || empty_answer {
                turn.enc
                    .content_event(out, text, &toks, &offsets, first, channel);
                first = false;
            }
        }
        turn.enc
            .finish_events(out, reason, turn.include_usage.then_some(usage));
        if persist == Persist::KeepAlive {
            http::chunk_in_place(out, body);
            out.extend_from_slice(http::LAST_CHUNK);
        }
    } else {
        let texts = (turn.held_text.as_str(), turn.held_reasoning.as_str());
        let body = turn
            .enc
            .batch_body(texts, &toks, &offsets, reason, usage, tool_calls);
        http::write_head_persist(
            out,
            200,
            "application/json",
            Some(body.len()),
            Some(id),
            degraded_hdr,
            persist,
        );
        out.extend_from_slice(&body);
    }
}

/// The entries of `items` (one per held token) whose token `keep` accepts.
fn filtered<T: Copy>(items: &[T], held: &[HeldToken], keep: impl Fn(&HeldToken) -> bool) -> Vec<T> {
    items
        .iter()
        .zip(held)
        .filter(|(_, t)| keep(t))
        .map(|(i, _)| *i)
        .collect()
}

/// The source's text is complete (at `now`): the detectors and the exfiltration scanner have
/// their last word, and what the scanner held may go (the hold-back window opens too), or a
/// detector trips. Once per turn: later calls change nothing.
pub(in crate::dataplane) fn end_of_text(turn: &mut Turn, now: u64) -> Result<(), Trip> {
    if turn.hold.ending {
        return Ok(());
    }
    turn.hold.ending = true;
    if let Some(back) = turn.hold.back.as_mut() {
        // The text is complete: nothing more can be rewound, the held tokens may go.
        back.open();
    }
    match turn.gov.on_end(now) {
        Gate::Trip(t) => Err(t),
        Gate::Release(n) => {
            turn.hold.release(n);
            Ok(())
        }
    }
}

impl Step<'_> {
    /// The source ended and every held frame went out: the final frame, with the source's
    /// finish reason and usage (haltd's own count when it gave none).
    pub(in crate::dataplane) fn finish(&mut self) -> io::Result<()> {
        let conn = &mut *self.conn;
        let batch = self.io.shared.table.slot(conn.id.slot).mode() == Mode::Batch;
        let Some(turn) = conn.turn.as_mut() else {
            return Ok(());
        };
        let ending = turn.source.get().ending();
        let usage = ending
            .usage
            .unwrap_or((turn.prompt_tokens, turn.tokens_generated));
        turn.usage = Some(usage);
        let tools =
            (!ending.tools.is_empty() && !turn.degraded).then_some(Value::Array(ending.tools));
        if batch {
            if let Some(Value::Array(all)) = &tools {
                turn.tool_calls = all
                    .iter()
                    .enumerate()
                    .map(|(i, t)| json!({"index": i, "id": t["id"], "name": t["function"]["name"]}))
                    .collect();
            }
        }
        self.finish_with(&ending.reason, usage, tools.as_ref())
    }

    /// Writes the last frame of a turn that ends normally with `reason` (the final events of
    /// a stream, or the whole batch response) and sends it.
    pub(in crate::dataplane) fn finish_with(
        &mut self,
        reason: &str,
        usage: (u64, u64),
        tool_calls: Option<&Value>,
    ) -> io::Result<()> {
        if !self.safety_at_end()? {
            return Ok(());
        }
        let shared = Arc::clone(&self.io.shared);
        let conn = &mut *self.conn;
        let slot = shared.table.slot(conn.id.slot);
        let Some(turn) = conn.turn.as_mut() else {
            return Ok(());
        };
        let out = frame(&mut conn.wbuf);
        let persist = conn.keep.persist();
        if slot.mode() == Mode::Stream {
            if let Some(a) = turn.grounding.as_ref().and_then(|g| g.annotation.as_ref()) {
                // The post-hoc fallback's evidence, after the reply (`ground/post_hoc.rs`).
                turn.enc.annotation_event(out, "haltd_grounding", a);
            }
            turn.enc
                .finish_events(out, reason, turn.include_usage.then_some(usage));
            if persist == Persist::KeepAlive {
                // The last token chunk, then the end of the chunked body.
                http::chunk_in_place(out, 0);
                out.extend_from_slice(http::LAST_CHUNK);
            }
        } else {
            let rid = conn.request_id.as_deref().unwrap_or_default();
            encode_batch(
                turn,
                out,
                conn.id,
                (reason, usage),
                tool_calls,
                (persist, rid),
            );
        }
        let conn = &*self.conn;
        let len = conn.wire_len();
        let slot = shared.table.slot(conn.id.slot);
        if slot.begin_final(len) {
            if slot.mode() == Mode::Batch {
                slot.headers_sent.store(true, SeqCst);
            }
            self.record_then_finish()
        } else {
            self.halt()
        }
    }

    pub(in crate::dataplane) fn govern_end(&mut self) -> io::Result<bool> {
        let conn = &mut *self.conn;
        let Some(turn) = conn.turn.as_mut() else {
            return Ok(false);
        };
        match end_of_text(turn, monotonic_ns()) {
            Err(t) => {
                self.detector_trip(t)?;
                Ok(false)
            }
            Ok(()) => Ok(true),
        }
    }

    pub(in crate::dataplane) fn safety_at_end(&mut self) -> io::Result<bool> {
        let conn = &mut *self.conn;
        let Some(turn) = conn.turn.as_mut() else {
            return Ok(true);
        };
        crate::progress::running(Check::Safety);
        if self.io.shared.cfg.faults.detector_hang == Some(DetectorId::Safety) {
            crate::progress::hang_once(Check::Safety);
        }
        let verdict = turn.safety_verdict(true);
        crate::progress::running(Check::None);
        let upheld = verdict.upheld;
        let violated: Vec<String> = verdict.violated_boundaries.iter().cloned().collect();
        *turn.safety.get_mut() = Some(serde_json::to_value(&verdict).unwrap_or(Value::Null));
        if !upheld && turn.detectors.cfg.safety.mode == SafetyMode::Enforce {
            return self
                .detector_trip(Trip {
                    detector: DetectorId::Safety,
                    code: FailureCode::SafetyBoundaryViolated,
                    kind: TripKind::Breach,
                    detail: format!("violated: {}", violated.join(", ")),
                })
                .map(|()| false);
        }
        Ok(true)
    }
}
