//! The halt core: what every thread of the daemon holds to govern streams (the configuration,
//! the stream table, the kernel gate, metrics, the flight recorder, the heartbeat, degraded
//! modes and per-turn facts), and the operations all of them use: trip a stream
//! ([`HaltCore::trip`]), build its terminal frame ([`HaltCore::terminal_frame`]), complete the
//! halt ([`HaltCore::complete_halt`]) and record it ([`HaltCore::record`]).

pub mod handover;
pub mod metrics;
mod modes;
mod policy;

pub use policy::PolicyChangeError;
mod terminal;
mod tls;

pub use terminal::PreparedTerminal;

use std::{
    os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering::SeqCst},
        Arc, Mutex,
    },
    time::{Duration, UNIX_EPOCH},
};

use haltd_common::SockPolicy;

use crate::{
    clock::{monotonic_ns, rfc3339, rfc3339_now},
    codes::FailureCode,
    config::Config,
    detect::DetectorId,
    gate::KernelGate,
    ledger::{Ledger, Record, RecordKind},
    metrics::Metrics,
    modes::{KeyId, Modes, RuntimeMode},
    pulse::{heartbeat_state, HeartbeatState},
    stream::{
        Halter, Initiator, KernelTrip, KernelTripPoint, Mode, SlotSnapshot, StreamTable, TripError,
        TripInfo,
    },
    upstream::UpstreamFailure,
    wire::{nonce_hex, StreamId},
};

/// The halt core: everything the data-plane workers, the watchdog and the control plane share
/// to trip, halt and record streams. One per daemon, behind an `Arc`.
#[derive(Debug)]
pub struct HaltCore {
    pub cfg: Config,
    pub table: StreamTable,
    pub gate: Option<KernelGate>,
    pub metrics: Metrics,
    pub ledger: Ledger,
    /// The watchdog's last heartbeat in this process's `CLOCK_MONOTONIC` (ns); 0 before the
    /// first. Emitters and the watchdog compare it with the same clock. The kernel gate keeps
    /// its own heartbeat, stamped in the kernel's clock (`KernelGate::beat`), so a time
    /// namespace that shifts this clock shifts neither check.
    pub heartbeat_ns: AtomicU64,
    /// The watchdog's idle mode: its flag and the kicks that wake it.
    pub pulse: crate::pulse::Pulse,
    /// When a refused ungovernable connection was last logged (rate limit).
    pub ungovernable_logged_ns: AtomicU64,
    /// One eventfd per data-plane worker: writing it makes the worker look at its streams.
    pub wakers: Vec<std::sync::Arc<OwnedFd>>,
    /// One beat per data-plane worker: the watchdog finds a stuck one (`progress.rs`).
    pub workers: crate::progress::WorkerBeats,
    /// Set once the flight recorder failed: every stream halts and no new turn starts.
    pub recorder_failed: AtomicBool,
    /// Set on SIGTERM/SIGINT: new turns get 503, readiness fails, open streams may finish
    /// (`lifecycle.rs`).
    pub draining: AtomicBool,
    /// Set when the drain is over: what is still open halts with SERVICE_SHUTDOWN, which
    /// degrades nobody.
    pub shutting_down: AtomicBool,
    /// Where this process stands in a hand-over to or from another haltd (`handover.rs`).
    pub handover: handover::Handover,
    /// Degraded safe mode and committed conversation state.
    pub modes: Modes,
    /// What survives a restart (`state.rs`): the degraded scopes, written after their
    /// ledger records.
    pub state: Arc<crate::state::StateStore>,
    /// Scopes entering degraded mode, for the escalation thread (`--escalation-url`,
    /// `escalation.rs`); `None` without one.
    pub escalations: Option<std::sync::mpsc::SyncSender<serde_json::Value>>,
    /// TokenCircuit's per-conversation memory: the backoff clock and the intervention
    /// artifacts (`circuit::store`); unused without `[tool_circuit] enabled`.
    pub circuits: crate::circuit::store::ConversationStore,
    /// The operators' labels of incidents and their counts (`labels.rs`).
    pub labels: crate::labels::Labels,
    /// Per slot: what a terminal frame needs beyond the slot's atomics.
    pub turn_meta: Vec<Mutex<TurnMeta>>,
    /// The profile and routes a new turn starts under, each route with its detectors: built
    /// from the configuration and the runtime switches at start, swapped whole by a SIGHUP
    /// reload (`lifecycle.rs`) or a switch (`admin/policy.rs`); each turn keeps the route it
    /// started with.
    pub policy: arc_swap::ArcSwap<crate::policy::PolicySet>,
    /// What [`HaltCore::policy`] was built from (the configuration SIGHUP last applied, the
    /// switches): a switch or a reload rebuilds from it under this lock, off the data plane.
    pub policy_inputs: Mutex<crate::policy::PolicyInputs>,
    /// What client connections may hold: per-address and request-phase caps.
    pub admission: crate::admission::Admission,
    /// The key store's keys (`keys.rs`; empty and unused with `--client-keys off`).
    pub keys: crate::keys::KeyStore,
    /// The per-scope limits and what each scope used (`limits.rs`).
    pub limits: Arc<crate::limits::LimitTable>,
    /// The per-node secret that keys key fingerprints (`identity.rs`).
    pub node_secret: crate::identity::NodeSecret,
    /// One line per request (`--access-log`), reopened on SIGHUP.
    pub access_log: crate::access_log::AccessLog,
    /// The upstream's addresses, probe verdict and model ids (`--source openai`; `None` with
    /// the built-in source): `upstream/health.rs`, kept by `upstream_watch.rs`.
    pub upstream_health: Option<crate::upstream::health::UpstreamHealth>,
    /// Grounding rounds for turns whose surprise detector runs in `intervene` mode (spec
    /// 003): the grounder, the round limit and deadline, the upstream's continuation. `None`:
    /// no grounder configured, and an intervene-mode breach is only recorded.
    pub grounding: Option<crate::grounding::plan::GroundPlan>,
}

/// Per-turn facts the terminal frame needs that do not fit in an atomic: written at turn
/// start and on an upstream failure, read when a halt is written (by the emitter or the
/// watchdog). A lock per turn and per halt, never per token.
#[derive(Debug, Default)]
pub struct TurnMeta {
    /// The model name the turn's chunks carry.
    pub model: Option<Arc<str>>,
    /// The profile and route the turn started under (its records carry them).
    pub policy: Option<(crate::policy::Profile, Arc<str>)>,
    /// Why the upstream failed, for the error object of the terminal event.
    pub upstream_failure: Option<UpstreamFailure>,
    /// The detector that tripped the stream and what it measured.
    pub detector_trip: Option<(DetectorId, String)>,
    /// The turn's timing fields in force, published by its worker at the turn's start and
    /// whenever a detector breached: what an incident record carries.
    pub timing: Option<crate::detect::timing::TurnTiming>,
    /// TokenCircuit's diagnostic artifact of a `TOOL_CIRCUIT_OPEN` halt (JSON).
    pub tool_circuit: Option<serde_json::Value>,
    /// The terminal frame prepared at the trip (see [`PreparedTerminal`]).
    pub terminal: Option<PreparedTerminal>,
    /// The request's id (`x-request-id`), echoed by a terminal that is a whole response.
    pub request_id: Option<Arc<str>>,
    /// The connection's client TLS session (`--tls-cert`): a trip seals the terminal record
    /// with it.
    pub client_tls: Option<crate::client_tls::SharedTls>,
    /// TLS: the terminal frame as sealed at the trip (its record, then `close_notify`); empty
    /// when none could be sealed (the stream then ends without one).
    pub sealed_terminal: Option<Vec<u8>>,
}

struct GateTrip<'a> {
    gate: &'a KernelGate,
    shared: &'a HaltCore,
}

impl KernelTrip for GateTrip<'_> {
    fn trip(&self, id: StreamId, p: &KernelTripPoint) -> bool {
        let slot = self.shared.table.slot(id.slot);
        // The terminal frame is encoded now, once, at its final length: the gate lets through
        // exactly one frame of exactly this length with this nonce.
        let terminal = self.shared.prepare_terminal(&slot.snapshot(id.slot));
        let (terminal_len, nonce, framing) =
            tls::seal_at_trip(self.shared, id, &terminal, nonce_hex(p.nonce));
        self.shared.meta(id.slot).terminal = Some(terminal);
        let max_event = slot.max_event_bytes.load(SeqCst);
        let allowance = u64::from(p.budget) * u64::from(max_event);
        let policy = SockPolicy {
            tripped: 1,
            cause: p.cause.as_u32(),
            budget: p.budget,
            max_event_bytes: max_event,
            // Frames up to F were handed to the kernel before the trip: they pass as pre-trip
            // even if they reach the gate after this write, and their bytes (the whole of the
            // frame in progress included) are below the ceiling.
            pre_trip_frames: p.frames,
            egress_ceiling: p.bytes + allowance + terminal_len as u64,
            terminal_len: u32::try_from(terminal_len).unwrap_or(u32::MAX),
            framing,
            nonce,
            stream_tag: stream_tag(id),
        };
        // The slot's socket is open: a stream in TRIPPING cannot be closed by its worker
        // (`Slot::settle_for_close`).
        let fd = slot.fd.load(SeqCst);
        // SAFETY: see above; the descriptor stays open for this call.
        let sock = unsafe { BorrowedFd::borrow_raw(fd) };
        match self.gate.set_policy(sock, &policy) {
            Ok(()) => true,
            Err(e) => {
                // The watchdog sees `kernel_tripped == false` and closes the stream at once.
                self.shared.metrics.gate.errors.inc();
                tracing::error!(stream_id = %id, error = %e, "writing the kernel trip failed; the watchdog closes the stream");
                false
            }
        }
    }
}

/// The stream id the gate's halt events carry: `generation << 32 | slot`.
pub fn stream_tag(id: StreamId) -> u64 {
    (u64::from(id.generation) << 32) | u64::from(id.slot)
}

impl HaltCore {
    pub fn kernel_gate_label(&self) -> &'static str {
        if self.gate.is_some() {
            "enforcing"
        } else {
            "disabled"
        }
    }

    /// Trips a stream and wakes its worker. See [`StreamTable::trip`].
    /// The initiator is the one `cause` normally means ([`Initiator::of`]).
    pub fn trip(&self, id: StreamId, cause: FailureCode) -> Result<TripInfo, TripError> {
        self.trip_by(id, cause, Initiator::of(cause))
    }

    /// [`HaltCore::trip`], saying who trips (an operator may give any cause).
    pub fn trip_by(
        &self,
        id: StreamId,
        cause: FailureCode,
        initiator: Initiator,
    ) -> Result<TripInfo, TripError> {
        self.trip_with(id, (cause, initiator, true))
    }

    /// [`HaltCore::trip_by`], saying whether the completed halt degrades the turn's scope
    /// (false: the operator opted out, or degraded it when it tripped, `admin/trip.rs`).
    pub fn trip_with(
        &self,
        id: StreamId,
        (cause, initiator, halt_degrades): (FailureCode, Initiator, bool),
    ) -> Result<TripInfo, TripError> {
        let kernel = self
            .gate
            .as_ref()
            .map(|gate| GateTrip { gate, shared: self });
        let info = self.table.trip_by(
            id,
            (cause, initiator, halt_degrades),
            kernel.as_ref().map(|k| k as &dyn KernelTrip),
            monotonic_ns(),
        )?;
        tracing::info!(stream_id = %id, cause = %cause, initiator = initiator.as_str(), trip_token_index = info.trip_token_index, kernel = info.kernel_enforced, "stream tripped");
        self.wake(self.table.slot(id.slot).worker.load(SeqCst));
        Ok(info)
    }

    /// A connection the gate could not govern: refused (reset, never served), counted, and
    /// logged at most once a second with the count since the last line.
    pub fn note_ungovernable(&self, stream_id: &str, reason: &str) {
        self.metrics.gate.ungovernable_connections.inc();
        let now = monotonic_ns();
        let last = self.ungovernable_logged_ns.load(SeqCst);
        if now.saturating_sub(last) >= 1_000_000_000
            && self
                .ungovernable_logged_ns
                .compare_exchange(last, now, SeqCst, SeqCst)
                .is_ok()
        {
            let total = self.metrics.gate.ungovernable_connections.get();
            tracing::warn!(stream_id, reason, refused_total = total, "a connection the kernel gate could not govern was refused (reset); at most one such line per second");
        }
    }

    /// Whether the egress check holds, or will hold, bytes of this socket back for good
    /// (`gate/held.rs`): closing it gracefully would leave it hanging.
    pub fn kernel_held_bytes(&self, fd: RawFd) -> bool {
        let Some(gate) = &self.gate else {
            return false;
        };
        // SAFETY: callers pass the stream's open socket; it is closed only after they return.
        let sock = unsafe { BorrowedFd::borrow_raw(fd) };
        gate.holds_back(sock, || !self.heartbeat_fresh(monotonic_ns()))
    }

    /// Rings a worker's eventfd.
    pub fn wake(&self, worker: u32) {
        if let Some(fd) = self.wakers.get(worker as usize) {
            wake_fd(fd);
        }
    }

    /// Rings every worker's eventfd (the drain began, or the shutdown: each worker looks at
    /// its connections).
    pub fn wake_all(&self) {
        for fd in &self.wakers {
            wake_fd(fd);
        }
    }

    /// A worker's eventfd, for a thread that wakes it without holding the core (the ledger
    /// writer, once a halt's record is on disk).
    pub fn waker(&self, worker: u32) -> Option<std::sync::Arc<OwnedFd>> {
        self.wakers.get(worker as usize).cloned()
    }

    /// Called by a worker right after it took a slot: if the watchdog is idle, kicks it and
    /// waits (at most the heartbeat deadline) for a beat stamped after the kick, so nothing of
    /// the connection is sent under a stale heartbeat. If none comes the heartbeat stays stale
    /// and the stream halts with HEARTBEAT_LOST at its first step (fail closed).
    pub fn watch_new_slot(&self) {
        if !self.pulse.is_idle() {
            return;
        }
        let kick = self.pulse.kick(monotonic_ns());
        if !self
            .pulse
            .await_beat(&self.heartbeat_ns, kick, self.cfg.heartbeat_deadline)
        {
            tracing::error!(
                "the idle watchdog did not answer a kick within the heartbeat deadline; the new stream halts with HEARTBEAT_LOST"
            );
        }
    }

    /// Whether the watchdog's heartbeat is younger than the deadline.
    pub fn heartbeat_fresh(&self, now_ns: u64) -> bool {
        let hb = self.heartbeat_ns.load(SeqCst);
        hb != 0 && now_ns.saturating_sub(hb) <= self.cfg.heartbeat_deadline.as_nanos() as u64
    }

    /// The heartbeat as health checks report it: with the kernel gate, the age the gate itself
    /// sees (its own clock, read through `clock_read`), and fresh only if both the process's
    /// and the gate's heartbeat are; without it, the process's. A gate whose clock cannot be
    /// read counts as lost.
    pub fn heartbeat_view(&self, now_ns: u64) -> HeartbeatView {
        let process_fresh = self.heartbeat_fresh(now_ns);
        let process_age_s = self.heartbeat_age_s(now_ns);
        let (fresh, age_s, clock, error) = match &self.gate {
            None => (process_fresh, process_age_s, "process", None),
            Some(gate) => match gate.clock() {
                Ok(k) => (
                    process_fresh && !k.heartbeat_lost(),
                    k.heartbeat_age().map_or(f64::INFINITY, |a| a.as_secs_f64()),
                    "kernel",
                    None,
                ),
                Err(e) => (false, f64::INFINITY, "kernel", Some(e.to_string())),
            },
        };
        // Idle only if both clocks agree the watchdog beat within its idle period.
        let idle = error.is_none() && self.pulse.is_idle();
        let state = heartbeat_state(
            fresh,
            idle,
            age_s.max(process_age_s),
            self.cfg.heartbeat_deadline,
        );
        HeartbeatView {
            fresh,
            state,
            age_s,
            clock,
            error,
        }
    }

    pub fn heartbeat_age_s(&self, now_ns: u64) -> f64 {
        let hb = self.heartbeat_ns.load(SeqCst);
        if hb == 0 {
            return f64::INFINITY;
        }
        now_ns.saturating_sub(hb) as f64 / 1e9
    }

    /// The per-turn facts of a slot.
    pub fn meta(&self, slot: u32) -> std::sync::MutexGuard<'_, TurnMeta> {
        // Plain data: consistent even after a panic elsewhere.
        self.turn_meta[slot as usize]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Records a completed halt: metrics and the WATCHDOG_TRIP incident record (queued: for
    /// halts whose terminal event did not wait for it, e.g. a client that went away).
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
        let terminal = if terminal_delivered {
            format!("stream halted ({cause}); terminal event delivered")
        } else {
            format!("stream halted ({cause}); terminal event not delivered (socket closed or dropped by the kernel gate)")
        };
        self.record(self.halt_record(snap, fd, detector_refs, terminal));
        self.halt_completed(snap);
    }

    /// The WATCHDOG_TRIP incident record of a halt; `terminal` says what became of the
    /// terminal event (the detector that tripped, if any, is added to it).
    pub fn halt_record(
        &self,
        snap: &SlotSnapshot,
        fd: RawFd,
        detector_refs: Vec<String>,
        terminal: String,
    ) -> Record {
        let mut rec = self.base_record(RecordKind::Incident, snap);
        rec.detector_refs = detector_refs;
        rec.kernel = self.kernel_socket_state(fd);
        let meta = self.meta(snap.id.slot);
        if let Some(timing) = &meta.timing {
            timing.fill(&mut rec);
        }
        let detector = meta
            .detector_trip
            .as_ref()
            .map(|(name, detail)| format!("; detector {name}: {detail}"))
            .unwrap_or_default();
        drop(meta);
        rec.message = Some(format!("{terminal}{detector}"));
        rec
    }

    /// What follows a halt once it is recorded: metrics, the log line, degraded mode.
    pub fn halt_completed(&self, snap: &SlotSnapshot) {
        let cause = snap.trip_cause.unwrap_or(FailureCode::WatchdogTrip);
        let latency_ms = snap.halt_latency_ms();
        let by = snap.halted_by;
        let initiator = snap.trip_initiator.unwrap_or(Initiator::of(cause));
        self.metrics.halts.observe(
            (cause, initiator),
            snap.post_trip_delivered,
            latency_ms / 1e3,
            by,
        );
        tracing::warn!(stream_id = %snap.id, cause = %cause, initiator = initiator.as_str(), trip_token_index = snap.trip_token_index, post_trip_tokens = snap.post_trip_delivered, halt_latency_ms = latency_ms, halted_by = by.as_str(), "WATCHDOG_TRIP: stream halted");
        // Spec 000 §4.2 step 3: after the halt, runtime_mode = degraded for the scope. Not
        // for the halts of a shutdown: the daemon is going away, nothing was breached.
        if self.shutting_down.load(SeqCst) || !snap.halt_degrades {
            return;
        }
        if let Some(ch) = self.modes.enter(snap.scope(), cause, &snap.id.to_string()) {
            self.record_mode_change(&ch);
        }
    }

    /// The gate's state of a governed socket, for records; `None` without the gate.
    pub fn kernel_socket_state(&self, fd: RawFd) -> Option<serde_json::Value> {
        let gate = self.gate.as_ref()?;
        // SAFETY: callers pass the stream's open socket; it is closed only after they return.
        let sock = unsafe { BorrowedFd::borrow_raw(fd) };
        match gate.socket(sock) {
            Ok(v) => {
                let Some(st) = v.state else {
                    return Some(serde_json::json!({ "error": "no gate state for this socket" }));
                };
                let mut out = serde_json::json!({
                    "frames": st.frames,
                    "post_trip_frames": st.post_trip_frames,
                    "post_trip_bytes": st.post_trip_bytes,
                    "terminal_sent": st.terminal_sent != 0,
                    "dropped": st.dropped != 0,
                    "trip_reason": haltd_common::trip_reason::name(st.trip_reason),
                    "adopted": st.adopted != 0,
                });
                if let Some(p) = v.policy.filter(|p| p.tripped != 0) {
                    out["egress_ceiling"] = p.egress_ceiling.into();
                    out["max_event_bytes"] = p.max_event_bytes.into();
                }
                if let Some(eg) = v.egress {
                    out["egress_dropped_segments"] = eg.dropped_segments.into();
                    out["egress_passed_end"] = eg.passed_end.into();
                    if eg.latched_ceiling != 0 {
                        out["egress_latched_ceiling"] = (eg.latched_ceiling - 1).into();
                        out["egress_latch_reason"] =
                            haltd_common::trip_reason::name(eg.latch_reason).into();
                    }
                }
                Some(out)
            }
            Err(e) => Some(serde_json::json!({ "error": e.to_string() })),
        }
    }

    /// A record with the fields every record of this stream shares, the trip and halt
    /// fields included once the stream tripped.
    pub fn base_record(&self, kind: RecordKind, snap: &SlotSnapshot) -> Record {
        let mut rec = base_record(kind, snap, self.kernel_gate_label());
        if snap.mode != Mode::Pending {
            rec.scope = Some(snap.scope().name());
            if let Some((profile, route)) = &self.meta(snap.id.slot).policy {
                rec.profile = Some(profile.as_str().to_owned());
                rec.route = Some(route.to_string());
            }
            if self.cfg.args.client_keys == crate::keys::ClientKeys::Store {
                // A read lock per record, never per token.
                rec.key_name = self.keys.get(KeyId(snap.key_id)).map(|k| k.name);
            }
        }
        rec
    }

    /// Appends a record; a failure is counted and logged (the ledger thread itself fails
    /// closed on a broken file: later appends error too).
    pub fn record(&self, rec: Record) {
        if let Err(e) = self.ledger.append(rec) {
            self.metrics.ledger.errors.inc();
            tracing::error!(error = %e, "flight recorder append failed");
            self.recorder_failed();
        }
    }

    /// Queues a record (if any), and the state store's change after it once it is on disk;
    /// with no record, the change at once (a normal turn the sampling leaves unrecorded).
    pub fn record_with_state(&self, rec: Option<Record>, changes: Vec<crate::state::Change>) {
        if changes.is_empty() {
            if let Some(rec) = rec {
                self.record(rec);
            }
            return;
        }
        let Some(rec) = rec else {
            self.state.apply(None, changes);
            return;
        };
        let state = Arc::clone(&self.state);
        let queued = self.ledger.append_then(rec, move |written| {
            if written.is_ok() {
                state.apply(None, changes);
            }
        });
        if let Err(e) = queued {
            self.record_failed(&e);
        }
    }

    /// Appends a record and waits until it is on disk (fsync'd): for records whose answer
    /// must not outrun them. A failure is counted and logged and fails the daemon closed.
    /// Blocks for one fsync: not for the data plane's threads.
    pub fn record_durable(&self, rec: Record) -> Result<u64, crate::ledger::LedgerError> {
        self.ledger
            .append_sync(rec)
            .inspect_err(|e| self.record_failed(e))
    }

    /// A record could not be written: counted, logged, and the daemon fails closed.
    pub fn record_failed(&self, e: &crate::ledger::LedgerError) {
        self.metrics.ledger.errors.inc();
        tracing::error!(error = %e, "flight recorder write failed");
        self.recorder_failed();
    }

    /// After the drain: refuse new turns and halt every open stream (SERVICE_SHUTDOWN), so
    /// clients see the typed terminal event rather than a cut connection. Returns how many
    /// were tripped.
    pub fn halt_all_for_shutdown(&self) -> usize {
        self.shutting_down.store(true, SeqCst);
        let tripped = self.trip_all(FailureCode::ServiceShutdown);
        // Workers whose connections only drain are woken too: they cut them
        // (`dataplane/conn/drain.rs`), so nothing is left for a client to wait on after exit.
        self.wake_all();
        tripped
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
        tracing::error!(ledger = %self.ledger.path().display(), state = %self.state.path().display(), "the flight recorder or the state store failed: halting every stream and refusing new turns until haltd is restarted with a writable ledger and state directory");
        self.trip_all(FailureCode::RecorderFailure);
    }
}

/// Rings a data-plane worker's eventfd: the worker then looks at its streams.
pub fn wake_fd(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writing 8 bytes from a live u64 to an eventfd we own.
    let n = unsafe { libc::write(fd.as_raw_fd(), (&raw const one).cast(), 8) };
    if n != 8 {
        tracing::warn!("waking a data-plane worker failed");
    }
}

/// The watchdog heartbeat as `/healthz`, the admin status and the metrics report it.
#[derive(Debug, Clone)]
pub struct HeartbeatView {
    pub fresh: bool,
    /// Fresh, idle (the watchdog sleeps with nothing to police and beat within its idle
    /// period) or lost.
    pub state: HeartbeatState,
    /// Seconds since the last beat; infinite before the first.
    pub age_s: f64,
    /// Whose clock measured the age: `kernel` (the gate's) or `process`.
    pub clock: &'static str,
    /// Why the gate's heartbeat could not be read.
    pub error: Option<String>,
}

impl HeartbeatView {
    /// The age in milliseconds as JSON (`null` before the first beat: JSON has no infinity).
    pub fn age_ms_json(&self) -> serde_json::Value {
        if self.age_s.is_finite() {
            (self.age_s * 1e3).into()
        } else {
            serde_json::Value::Null
        }
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

/// The fields every record of a stream carries, from its slot's snapshot (`kernel_gate`: the
/// gate's label, `HaltCore::kernel_gate_label`): its ids, mode, budget, conversation, the
/// tokens it delivered, and, once tripped, the trip's cause and codes, τ, the post-trip tokens
/// and who halted it.
pub fn base_record(kind: RecordKind, snap: &SlotSnapshot, kernel_gate: &str) -> Record {
    let mut rec = Record {
        kind,
        turn_id: Some(snap.id.to_string()),
        stream_id: Some(snap.id.to_string()),
        mode: (snap.mode != Mode::Pending).then(|| snap.mode.as_str().to_owned()),
        rts_mode: "normal".to_owned(),
        runtime_mode: RuntimeMode::of(snap.degraded).as_str().to_owned(),
        kernel_gate: kernel_gate.to_owned(),
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
        if snap.halted_by != Halter::None {
            rec.halted_by = Some(snap.halted_by.as_str().to_owned());
        }
    }
    rec
}
