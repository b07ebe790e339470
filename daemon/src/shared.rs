//! State shared by every thread of the daemon, and the two operations all of them use: trip a
//! stream, and complete a halt (terminal frame, metrics, flight-recorder record).

use std::{
    os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering::SeqCst},
        Arc, Mutex,
    },
    time::{Duration, UNIX_EPOCH},
};

use haltd_common::TripEntry;

use crate::{
    codes::FailureCode,
    config::Config,
    gate::{monotonic_ns, KernelGate},
    ledger::{rfc3339, rfc3339_now, Ledger, Record, RecordKind},
    metrics::Metrics,
    modes::{KeyId, ModeChange, Modes},
    openai::Halt,
    source::builtin::MODEL_NAME,
    stream::{
        halter, nonce_hex, KernelTrip, Mode, SlotSnapshot, StreamId, StreamTable, TripError,
        TripInfo,
    },
};

/// Everything the data-plane workers, the watchdog and the control plane share.
#[derive(Debug)]
pub struct Shared {
    pub cfg: Config,
    pub table: StreamTable,
    pub gate: Option<KernelGate>,
    pub metrics: Metrics,
    pub ledger: Ledger,
    /// The watchdog's last heartbeat (`CLOCK_MONOTONIC` ns); 0 before the first. The same
    /// value goes to the kernel gate, so userspace and kernel judge staleness alike.
    pub heartbeat_ns: AtomicU64,
    /// One eventfd per data-plane worker: writing it makes the worker look at its streams.
    pub wakers: Vec<OwnedFd>,
    /// Set once the flight recorder failed: every stream halts and no new turn starts.
    pub recorder_failed: AtomicBool,
    /// Set on SIGTERM/SIGINT: open streams halt, new turns get 503.
    pub shutting_down: AtomicBool,
    /// Degraded safe mode and committed conversation state.
    pub modes: Modes,
    /// Per slot: what a terminal frame needs beyond the slot's atomics.
    pub turn_meta: Vec<Mutex<TurnMeta>>,
    /// The detectors every turn is governed by (built from the configuration at start).
    pub detectors: crate::detect::pipeline::Detectors,
}

/// Per-turn facts the terminal frame needs that do not fit in an atomic: written at turn
/// start and on an upstream failure, read when a halt is written (by the emitter or the
/// watchdog). A lock per turn and per halt, never per token.
#[derive(Debug, Default)]
pub struct TurnMeta {
    /// The model name the turn's chunks carry.
    pub model: Option<Arc<str>>,
    /// Why the upstream failed (kind, message), for the error object of the terminal event.
    pub upstream_failure: Option<(&'static str, String)>,
    /// The detector that tripped the stream and what it measured.
    pub detector_trip: Option<(&'static str, String)>,
}

struct GateTrip<'a> {
    gate: &'a KernelGate,
    shared: &'a Shared,
}

impl KernelTrip for GateTrip<'_> {
    fn trip(
        &self,
        id: StreamId,
        cause: FailureCode,
        frame_limit: u64,
        budget: u32,
        nonce: u64,
    ) -> bool {
        let entry = TripEntry {
            generation: id.generation,
            tripped: 1,
            cause: cause.as_u32(),
            terminal_max_bytes: self.shared.cfg.terminal_max_bytes,
            frame_limit,
            // Frames up to F were handed to the kernel before the trip: they pass as pre-trip
            // even if they reach the gate after this write, and leave the byte budget alone.
            pre_trip_frames: frame_limit - u64::from(budget),
            budget_bytes: u64::from(budget) * self.shared.cfg.args.max_frame_bytes,
            nonce: nonce_hex(nonce),
        };
        match self.gate.trip(id.slot, entry) {
            Ok(()) => true,
            Err(e) => {
                // The watchdog sees `kernel_tripped == false` and closes the stream at once.
                self.shared.metrics.gate_errors.inc();
                tracing::error!(stream_id = %id, error = %e, "writing the kernel trip map failed; the watchdog closes the stream");
                false
            }
        }
    }
}

impl Shared {
    pub fn kernel_gate_label(&self) -> &'static str {
        if self.gate.is_some() {
            "enforcing"
        } else {
            "disabled"
        }
    }

    /// Trips a stream and wakes its worker. See [`StreamTable::trip`].
    pub fn trip(&self, id: StreamId, cause: FailureCode) -> Result<TripInfo, TripError> {
        let kernel = self
            .gate
            .as_ref()
            .map(|gate| GateTrip { gate, shared: self });
        let info = self.table.trip(
            id,
            cause,
            kernel.as_ref().map(|k| k as &dyn KernelTrip),
            monotonic_ns(),
        )?;
        tracing::info!(stream_id = %id, cause = %cause, trip_token_index = info.trip_token_index, kernel = info.kernel_enforced, "stream tripped");
        self.wake(self.table.slot(id.slot).worker.load(SeqCst));
        Ok(info)
    }

    /// Rings a worker's eventfd.
    pub fn wake(&self, worker: u32) {
        if let Some(fd) = self.wakers.get(worker as usize) {
            let one: u64 = 1;
            // SAFETY: writing 8 bytes from a live u64 to an eventfd we own.
            let n = unsafe { libc::write(fd.as_raw_fd(), (&raw const one).cast(), 8) };
            if n != 8 {
                tracing::warn!(worker, "waking a data-plane worker failed");
            }
        }
    }

    /// Whether the watchdog's heartbeat is younger than the deadline.
    pub fn heartbeat_fresh(&self, now_ns: u64) -> bool {
        let hb = self.heartbeat_ns.load(SeqCst);
        hb != 0 && now_ns.saturating_sub(hb) <= self.cfg.heartbeat_deadline.as_nanos() as u64
    }

    pub fn heartbeat_age_s(&self, now_ns: u64) -> f64 {
        let hb = self.heartbeat_ns.load(SeqCst);
        if hb == 0 {
            return f64::INFINITY;
        }
        now_ns.saturating_sub(hb) as f64 / 1e9
    }

    /// The terminal frame for a tripped stream, in the form its response needs.
    pub fn terminal_frame(&self, snap: &SlotSnapshot, out: &mut Vec<u8>) {
        let (model, detail) = {
            let meta = self.meta(snap.id.slot);
            let model = meta.model.clone().unwrap_or_else(|| MODEL_NAME.into());
            let mut detail = Vec::new();
            if let Some((kind, message)) = &meta.upstream_failure {
                detail.push((
                    "upstream",
                    serde_json::json!({"kind": kind, "message": message}),
                ));
            }
            if let Some((name, what)) = &meta.detector_trip {
                detail.push((
                    "detector",
                    serde_json::json!({"name": name, "detail": what}),
                ));
            }
            (model, detail)
        };
        let halt = Halt {
            stream_id: snap.id,
            endpoint: snap.endpoint,
            created: snap.created,
            model,
            code: snap.trip_cause.unwrap_or(FailureCode::WatchdogTrip),
            trip_token_index: snap.trip_token_index,
            post_trip_tokens: snap.post_trip_delivered,
            nonce: snap.nonce,
            degraded: snap.degraded,
            detail,
        };
        out.clear();
        if snap.mode == Mode::Stream && snap.headers_sent {
            halt.sse_terminal(out);
        } else {
            halt.http_terminal(out, snap.client_sse);
        }
    }

    /// The per-turn facts of a slot.
    pub fn meta(&self, slot: u32) -> std::sync::MutexGuard<'_, TurnMeta> {
        // Plain data: consistent even after a panic elsewhere.
        self.turn_meta[slot as usize]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Records a change of `runtime_mode` and counts it.
    pub fn record_mode_change(&self, ch: &ModeChange) {
        self.metrics
            .mode_changes
            .get_or_create(&crate::metrics::ModeChangeLabels {
                to: ch.to,
                by: ch.by,
            })
            .inc();
        self.metrics
            .degraded_scopes
            .set(self.modes.degraded_count() as i64);
        tracing::warn!(scope = %ch.scope, from = ch.from, to = ch.to, by = ch.by, cause = ?ch.cause, "runtime_mode changed");
        let rec = Record {
            kind: RecordKind::Lifecycle,
            runtime_mode: ch.to.to_owned(),
            kernel_gate: self.kernel_gate_label().to_owned(),
            stream_id: ch.stream_id.clone(),
            mode_change: serde_json::to_value(ch).ok(),
            message: Some(format!(
                "runtime_mode {} -> {} for {} ({})",
                ch.from, ch.to, ch.scope, ch.by
            )),
            ..Record::default()
        };
        self.record(rec);
    }

    /// Ends the degraded scopes whose timer ran out, recording each change.
    pub fn expire_degraded(&self) {
        for ch in self.modes.expire(std::time::SystemTime::now()) {
            self.record_mode_change(&ch);
        }
    }

    /// Records a completed halt: metrics and the WATCHDOG_TRIP incident record.
    ///
    /// `fd` is the stream's socket, still open: the record carries the gate's own count of
    /// what passed after the trip, next to userspace's.
    pub fn complete_halt(
        &self,
        snap: &SlotSnapshot,
        fd: RawFd,
        terminal_delivered: bool,
        detector_refs: Vec<String>,
    ) {
        let cause = snap.trip_cause.unwrap_or(FailureCode::WatchdogTrip);
        let latency_ms = snap.halt_latency_ms();
        let latency_s = latency_ms / 1e3;
        let by = halter::name(snap.halted_by);
        self.metrics
            .observe_halt(cause, snap.post_trip_delivered, latency_s, by);
        let mut rec = self.base_record(RecordKind::Incident, snap);
        rec.detector_refs = detector_refs;
        rec.kernel = self.kernel_socket_state(fd);
        let detector = self
            .meta(snap.id.slot)
            .detector_trip
            .as_ref()
            .map(|(name, detail)| format!("; detector {name}: {detail}"))
            .unwrap_or_default();
        rec.message = Some(if terminal_delivered {
            format!("stream halted ({cause}); terminal event delivered{detector}")
        } else {
            format!("stream halted ({cause}); terminal event not delivered (socket closed or dropped by the kernel gate){detector}")
        });
        self.record(rec);
        tracing::warn!(stream_id = %snap.id, cause = %cause, trip_token_index = snap.trip_token_index, post_trip_tokens = snap.post_trip_delivered, halt_latency_ms = latency_ms, halted_by = by, "WATCHDOG_TRIP: stream halted");
        // Spec 000 §4.2 step 3: after the halt, runtime_mode = degraded for the scope. Not
        // for the halts of a shutdown: the daemon is going away, nothing was breached.
        if self.shutting_down.load(SeqCst) {
            return;
        }
        if let Some(ch) = self
            .modes
            .enter(KeyId(snap.key_id), cause, &snap.id.to_string())
        {
            self.record_mode_change(&ch);
        }
    }

    /// The gate's state of a governed socket, for records; `None` without the gate.
    pub fn kernel_socket_state(&self, fd: RawFd) -> Option<serde_json::Value> {
        let gate = self.gate.as_ref()?;
        // SAFETY: callers pass the stream's open socket; it is closed only after they return.
        let sock = unsafe { BorrowedFd::borrow_raw(fd) };
        match gate.socket_state(sock) {
            Ok(Some(st)) => Some(serde_json::json!({
                "frames": st.frames,
                "post_trip_frames": st.post_trip_frames,
                "post_trip_bytes": st.post_trip_bytes,
                "terminal_sent": st.terminal_sent != 0,
                "dropped": st.dropped != 0,
                "trip_reason": match st.trip_reason {
                    haltd_common::trip_reason::TRIPPED => "tripped",
                    haltd_common::trip_reason::HEARTBEAT => "heartbeat",
                    haltd_common::trip_reason::STALE_SLOT => "stale_slot",
                    _ => "none",
                },
            })),
            Ok(None) => Some(serde_json::json!({ "error": "no gate state for this socket" })),
            Err(e) => Some(serde_json::json!({ "error": e.to_string() })),
        }
    }

    /// A record with the fields every record of this stream shares, the trip and halt
    /// fields included once the stream tripped.
    pub fn base_record(&self, kind: RecordKind, snap: &SlotSnapshot) -> Record {
        let mut rec = Record {
            kind,
            turn_id: Some(snap.id.to_string()),
            stream_id: Some(snap.id.to_string()),
            mode: (snap.mode != Mode::Pending).then(|| snap.mode.as_str().to_owned()),
            rts_mode: "normal".to_owned(),
            runtime_mode: if snap.degraded { "degraded" } else { "full" }.to_owned(),
            kernel_gate: self.kernel_gate_label().to_owned(),
            budget: Some(snap.budget),
            conversation: (snap.mode != Mode::Pending).then(|| KeyId(snap.key_id).fingerprint()),
            tokens_emitted: snap.tokens_delivered,
            started_at: Some(rfc3339(
                UNIX_EPOCH + Duration::from_millis(snap.started_unix_ms),
            )),
            ended_at: Some(rfc3339_now()),
            ..Record::default()
        };
        if let Some(cause) = snap.trip_cause {
            // Every halt is a WATCHDOG_TRIP event (spec 000 §4.2 step 4), whatever tripped it.
            rec.watchdog_trip = true;
            rec.timing_incidents = vec![FailureCode::WatchdogTrip.as_str().to_owned()];
            rec.failure_codes = failure_codes(cause);
            rec.trip_cause = Some(cause.as_str().to_owned());
            rec.trip_token_index = Some(snap.trip_token_index);
            rec.halt_tokens_post_trip = Some(snap.post_trip_delivered);
            if snap.halt_ns != 0 {
                rec.halt_latency_ms = Some(snap.halt_latency_ms());
            }
            if snap.halted_by != halter::NONE {
                rec.halted_by = Some(halter::name(snap.halted_by).to_owned());
            }
        }
        rec
    }

    /// Appends a record; a failure is counted and logged (the ledger thread itself fails
    /// closed on a broken file: later appends error too).
    pub fn record(&self, rec: Record) {
        if let Err(e) = self.ledger.append(rec) {
            self.metrics.ledger_errors.inc();
            tracing::error!(error = %e, "flight recorder append failed");
            self.recorder_failed();
        }
    }

    /// On shutdown: refuse new turns and halt every open stream (OPERATOR_TRIP), so clients see
    /// the typed terminal event rather than a cut connection. Returns how many were tripped.
    pub fn halt_all_for_shutdown(&self) -> usize {
        self.shutting_down.store(true, SeqCst);
        self.trip_all(FailureCode::OperatorTrip)
    }

    /// Trips every open stream that is not tripped yet; returns how many it tripped.
    pub fn trip_all(&self, cause: FailureCode) -> usize {
        let ids: Vec<StreamId> = self
            .table
            .live()
            .filter(|(_, s)| !s.is_tripped())
            .map(|(idx, s)| StreamId {
                slot: idx,
                generation: s.generation.load(SeqCst),
            })
            .collect();
        // Streams that end meanwhile answer an error; they need no halt.
        ids.into_iter()
            .filter(|id| self.trip(*id, cause).is_ok())
            .count()
    }

    /// Fail closed on a broken flight recorder: halt every open stream with RECORDER_FAILURE
    /// and refuse new turns (503), since none of them could be recorded. Idempotent.
    pub fn recorder_failed(&self) {
        if self.recorder_failed.swap(true, SeqCst) {
            return;
        }
        tracing::error!(ledger = %self.ledger.path().display(), "the flight recorder failed: halting every stream and refusing new turns until haltd is restarted with a writable ledger");
        self.trip_all(FailureCode::RecorderFailure);
    }
}

/// `failure_codes[]` of a halted turn: WATCHDOG_TRIP plus the cause, once each.
pub fn failure_codes(cause: FailureCode) -> Vec<String> {
    let mut v = vec![FailureCode::WatchdogTrip.as_str().to_owned()];
    if cause != FailureCode::WatchdogTrip {
        v.push(cause.as_str().to_owned());
    }
    v
}
