//! The turn's flight-recorder record (spec 000 §6): written when the connection closes, with
//! its outcome, the detectors' summaries, SafetyCheck's verdict, the tool calls and the
//! upstream exchange. The TURN-ACID commit (or failure) of the conversation happens here too,
//! for every turn; only the ledger line is sampled.

use crate::dataplane::ground;
use crate::dataplane::{Io, Step};
use crate::{
    clock::monotonic_ns,
    codes::FailureCode,
    detect::timing::latency_bucket,
    halt::HaltCore,
    ledger::{Record, RecordKind},
    state::Change,
    stream::{Mode, Outcome, SlotSnapshot},
    upstream::metrics::ToolCallKind,
};

use std::{
    io,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use crate::dataplane::{conn::Conn, turn::Turn};

impl Io {
    /// The turn's record at the close of its connection, unless it was written before the
    /// turn's final frame ([`Step::record_then_finish`]).
    pub(in crate::dataplane) fn record_turn(&self, conn: &Conn) {
        if conn.turn.as_ref().is_none_or(|t| t.recorded) {
            return; // not a turn (health checks, refused requests), or recorded already
        }
        let snap = self.shared.table.slot(conn.id.slot).snapshot(conn.id.slot);
        let outcome = Outcome::of_turn(snap.trip_cause, conn.outcome);
        let (rec, change) = self.turn_record(conn, &snap, outcome);
        self.shared.record_with_state(rec, change);
    }

    /// The turn's record (`None`: a normal turn the sampling leaves out, or no turn), after
    /// the metrics and the TURN-ACID commit, which happen for every turn; with the commit's
    /// change for the state store, to be written after the record.
    fn turn_record(
        &self,
        conn: &Conn,
        snap: &SlotSnapshot,
        outcome: Outcome,
    ) -> (Option<Record>, Vec<Change>) {
        let Some(turn) = conn.turn.as_ref() else {
            return (None, Vec::new());
        };
        let shared = &self.shared;
        shared.metrics.dataplane.finished(outcome);
        let mut rec = shared.base_record(RecordKind::Turn, snap);
        rec.outcome = Some(outcome.as_str().to_owned());
        rec.detector_refs = turn.detector_refs.clone();
        record_detectors(
            shared,
            turn,
            (outcome == Outcome::Completed, snap.id.slot),
            &mut rec,
        );
        rec.grounding = ground::receipt(shared, turn, shared.cfg.sampling.record_token_text);
        let mut change = commit_turn(shared, conn, turn, snap, outcome, &mut rec);
        change.extend(charge_limits(shared, conn, turn, snap));
        let policy = shared.cfg.sampling;
        if let Some(p) = &conn.up {
            let finish = turn.source.upstream().and_then(|s| s.finish());
            rec.upstream = Some(p.record_value(policy.record_token_text, finish));
            if outcome == Outcome::UpstreamFailed {
                rec.failure_codes = vec![FailureCode::UpstreamFailure.as_str().to_owned()];
            }
        }
        let asked = if matches!(turn.source, super::TurnSource::Fixed(_)) {
            ", answered with --degraded-ask-first instead of the model"
        } else {
            ""
        };
        rec.message = Some(format!(
            "turn of {} ms{asked}",
            monotonic_ns().saturating_sub(snap.started_ns) / 1_000_000
        ));
        // Spec 000 §6.2: every turn that is not normal is recorded, a normal one with
        // probability --turn-sample-rate. Everything above (metrics, the TURN-ACID commit)
        // happened for every turn; only the ledger line is sampled.
        // The route's rate, where it sets one.
        let rate = turn
            .policy
            .route
            .turn_sample_rate
            .unwrap_or(policy.turn_sample_rate);
        let decision = crate::sampling::decide_now(&rec, rate);
        shared.metrics.ledger.turn_record(decision.kind());
        let Some(sampling) = decision.field(rate) else {
            return (None, change);
        };
        rec.sampling = Some(sampling);
        if policy.record_token_text {
            // The text SafetyCheck keeps anyway (`Turn::out_text`, bounded): recording it adds
            // no per-token work, only this copy per recorded turn.
            let (text, truncated) =
                crate::sampling::text_excerpt(&turn.out_text, turn.out_text_truncated);
            rec.text = Some(text);
            rec.text_truncated = Some(truncated);
        }
        (Some(rec), change)
    }
}

impl Step<'_> {
    /// A turn that ends cleanly commits (TURN-ACID), and its record is on disk before the
    /// client sees the final frame (issue 13, point 5): the final frame, written into the
    /// connection's buffer and counted (`begin_final`), goes out once the ledger's writer
    /// reports the record written (it rings the worker's eventfd; no thread waits). A normal
    /// turn the sampling leaves unrecorded has nothing to wait for.
    pub(in crate::dataplane) fn record_then_finish(&mut self) -> io::Result<()> {
        let conn = &*self.conn;
        let snap = self
            .io
            .shared
            .table
            .slot(conn.id.slot)
            .snapshot(conn.id.slot);
        let (rec, change) = self.io.turn_record(conn, &snap, Outcome::Completed);
        if let Some(turn) = self.conn.turn.as_mut() {
            turn.recorded = true;
        }
        let Some(rec) = rec else {
            self.io.shared.record_with_state(None, change);
            return self.send_final();
        };
        let on_disk = Arc::new(AtomicBool::new(false));
        let (flag, waker) = (Arc::clone(&on_disk), self.io.shared.waker(self.io.id));
        let state = Arc::clone(&self.io.shared.state);
        // Per turn, not per token: the change and the closure are allocated once.
        let queued = self.io.shared.ledger.append_then(rec, move |written| {
            if written.is_ok() && !change.is_empty() {
                state.apply(None, change);
            }
            flag.store(true, Ordering::Release);
            if let Some(w) = waker {
                crate::halt::wake_fd(&w);
            }
        });
        if let Err(e) = queued {
            self.io.shared.metrics.ledger.errors.inc();
            tracing::error!(error = %e, "flight recorder append failed");
            self.io.shared.recorder_failed();
            // Unrecorded: the turn must not be answered as complete. The slot is past its
            // last trip point, so end the connection without the final frame.
            self.begin_close();
            return Ok(());
        }
        self.await_record(crate::dataplane::AfterRecord::Final, on_disk);
        Ok(())
    }
}

/// The detectors' part of the record: their summaries, the timing fields, SafetyCheck's
/// verdict (`completed`: the turn ended with its final frame).
fn record_detectors(
    shared: &HaltCore,
    turn: &Turn,
    (completed, slot): (bool, u32),
    rec: &mut Record,
) {
    let gaps = turn.tokens_generated.saturating_sub(1).max(1);
    rec.latency_bucket = Some(latency_bucket(turn.token_gap_ns_sum / gaps).to_owned());
    for t in turn.gov.set.observed() {
        shared.metrics.detectors.observed(t.detector, t.code);
    }
    let tripped_by = shared.meta(slot).detector_trip.as_ref().map(|(d, _)| *d);
    let judged = turn
        .gov
        .judged(tripped_by)
        .map(
            |(detector, mode, findings, tripped)| crate::policy::metrics::Judged {
                detector,
                mode,
                findings,
                tripped,
            },
        );
    shared
        .metrics
        .policy
        .judged(&turn.policy.route.name, judged);
    let detectors = turn.gov.summary();
    shared.metrics.detectors.turn_ended(&detectors);
    // The timing fields of spec 000 §6.1 come from the timing detectors.
    let timing = crate::detect::timing::fhr_timing_from_json(
        detectors.pointer("/latency_anomaly/summary"),
        detectors.pointer("/compute_budget/summary"),
    );
    if let Some(b) = timing.latency_bucket {
        rec.latency_bucket = Some(b.to_owned());
    }
    rec.rts_mode = timing.rts_mode.as_str().to_owned();
    rec.tig_breach = timing.tig_breach;
    // The timing findings of the turn (observe-mode ones too), then WATCHDOG_TRIP if halted.
    rec.timing_incidents = turn.gov.set.timing_now().incidents_field(rec.watchdog_trip);
    rec.detectors = Some(detectors);
    // Taken: a turn is recorded once (`Turn::recorded`).
    let judged = turn.safety.borrow_mut().take();
    rec.safety_verdict = Some(match judged {
        Some(v) => v,
        // Not judged at a clean end: judge what the turn did (its halt, if any, ended
        // with the typed terminal event).
        None => {
            serde_json::to_value(turn.safety_verdict(completed)).unwrap_or(serde_json::Value::Null)
        }
    });
}

/// TURN-ACID: only a turn that ended cleanly commits; a failed one leaves the conversation's
/// state as it was, and tool calls it already emitted are dispatched effects that need
/// reconciliation (held by `circuit::dispatched` until an operator records what happened).
/// Returns the state store's changes.
fn commit_turn(
    shared: &HaltCore,
    conn: &Conn,
    turn: &Turn,
    snap: &SlotSnapshot,
    outcome: Outcome,
    rec: &mut Record,
) -> Vec<Change> {
    let committed = outcome == Outcome::Completed;
    rec.turn_status = Some(if committed { "committed" } else { "failed" }.to_owned());
    let tool_status = if committed {
        ToolCallKind::Committed
    } else {
        ToolCallKind::Dispatched
    };
    rec.tool_calls = turn
        .tool_calls
        .iter()
        .map(|c| {
            let mut c = c.clone();
            c["status"] = tool_status.as_str().into();
            if !committed {
                c["reconciliation"] = "required".into();
            }
            c
        })
        .collect();
    if !turn.tool_calls.is_empty() {
        shared
            .metrics
            .upstream
            .tool_calls(tool_status, turn.tool_calls.len() as u64);
    }
    if committed {
        let tokens = if snap.mode == Mode::Batch {
            turn.tokens_generated
        } else {
            snap.tokens_delivered
        };
        vec![shared.modes.commit_turn(
            turn.key_id,
            &conn.id.to_string(),
            tokens,
            turn.tool_calls.len() as u64,
        )]
    } else {
        let mut changes = hold_dispatched(shared, conn, turn, &mut rec.tool_calls);
        changes.push(shared.modes.fail_turn(turn.key_id));
        changes
    }
}

/// Charges the turn's tokens to its scope's minute (`limits.rs`): what the final frame
/// reported, else what was generated (and the built-in source's prompt: a halted proxied turn
/// never learns its prompt's size). A key of the key store gets its counts stored.
fn charge_limits(
    shared: &HaltCore,
    conn: &Conn,
    turn: &Turn,
    snap: &SlotSnapshot,
) -> Option<Change> {
    let place = conn.place.as_ref()?;
    let tokens = turn.usage.map_or(
        turn.prompt_tokens + turn.tokens_generated.max(snap.tokens_delivered),
        |(p, c)| p + c,
    );
    let now = crate::clock::monotonic_ns();
    let used = shared.limits.charge(place.scope(), tokens, now);
    let scope = place.scope();
    (scope.kind == crate::scope::ScopeKind::Apikey).then(|| {
        let wall = crate::clock::unix_ms(std::time::SystemTime::now());
        let kept = crate::limits::LimitTable::stored(&used, now, wall);
        Change::KeyUsage(crate::state::ClientKeyRow {
            id: scope.id.fingerprint(),
            body: serde_json::to_value(kept).unwrap_or_default(),
        })
    })
}

/// A failed turn's dispatched calls (`calls`, its record's), held until reconciled: each gets
/// its reference and arguments digest in the record too. Returns the state store's changes.
/// Per failed turn with calls, never per token.
fn hold_dispatched(
    shared: &HaltCore,
    conn: &Conn,
    turn: &Turn,
    calls: &mut [serde_json::Value],
) -> Vec<Change> {
    use crate::circuit::dispatched::{arguments_digest, reference, DispatchedCall};
    if calls.is_empty() {
        return Vec::new();
    }
    let conversation = turn.circuit.as_deref().map(|c| c.conversation().clone());
    let merged = turn.source.upstream().map_or(&[][..], |s| s.tool_calls());
    let (key, stream_id) = (turn.key_id.fingerprint(), conn.id.to_string());
    let held = calls
        .iter_mut()
        .map(|c| {
            let call_id = c["id"].as_str().unwrap_or_default().to_owned();
            let tool = c["name"].as_str().unwrap_or_default().to_owned();
            let arguments = c["index"]
                .as_u64()
                .and_then(|i| merged.get(usize::try_from(i).ok()?))
                .and_then(|m| m.pointer("/function/arguments"))
                .and_then(serde_json::Value::as_str)
                .unwrap_or_default();
            let delivered_unix_ms = c["delivered_unix_ms"]
                .as_u64()
                .unwrap_or_else(crate::clock::unix_ms_now);
            let call = DispatchedCall {
                reference: reference(&stream_id, &call_id, delivered_unix_ms),
                key: key.clone(),
                conversation: conversation.clone(),
                call_id,
                tool,
                arguments_sha256: arguments_digest(arguments),
                delivered_unix_ms,
                stream_id: stream_id.clone(),
                outcome: None,
                reconciled_unix_ms: None,
                reconciled_by: None,
                retried: false,
            };
            c["ref"] = call.reference.clone().into();
            c["arguments_sha256"] = call.arguments_sha256.clone().into();
            c["conversation"] = serde_json::to_value(&call.conversation).unwrap_or_default();
            call
        })
        .collect();
    shared.circuits.dispatched.add(held)
}
