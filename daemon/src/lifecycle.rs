//! The daemon's life once it serves: systemd's notifications, the stop signals and the drain.
//!
//! - **systemd** (`Type=notify`): `READY=1` once haltd serves; `WATCHDOG=1` every half of
//!   `WATCHDOG_USEC`, but only while haltd's own watchdog heartbeat is fresh, so a stalled
//!   watchdog is restarted by systemd as well as failing its streams closed; `STOPPING=1` when a
//!   drain starts. Without `NOTIFY_SOCKET` nothing is sent.
//! - **SIGTERM / SIGINT** drain: readiness turns 503 and new turns are refused with 503
//!   `shutting_down` and `retry-after: 1`, while open streams may finish for up to
//!   `--drain-timeout-ms`. What is still open then halts with `SERVICE_SHUTDOWN` (typed terminal
//!   event, within the budget, recorded; it degrades nobody), and haltd exits 0 once those
//!   halts are recorded. On the way out it moves back to the cgroup it was started in and
//!   removes its own cgroup leaf (said in the stop record; where that is not allowed, the next
//!   start removes it). A second signal during the drain ends it at once.
//! - **SIGHUP** reloads what can change without a restart: the detectors and SafetyCheck
//!   (`[detectors.*]`, `[safety]` of `--config`) for turns that start afterwards, and the log
//!   level (`[log] level`, unless `HALTD_LOG` is set), and the client TLS certificate and key
//!   (`--tls-cert`, `--tls-key`) for connections accepted afterwards. A file that does not
//!   validate changes nothing. It also reopens the ledger: once it was moved aside (logrotate),
//!   a new segment at `--ledger` continues the chain (`ledger` module doc, rotation); and an
//!   access log file (`--access-log FILE`, after logrotate moved it). Either way a `lifecycle`
//!   record says what happened. (Sampling, listeners and every flag stay as started.)

use std::{
    os::fd::{AsFd, OwnedFd},
    sync::{atomic::Ordering::SeqCst, Arc},
    time::Duration,
};

use sd_notify::NotifyState;
use tokio::{
    signal::unix::{signal, Signal, SignalKind},
    time::{sleep, Instant},
};

use crate::{
    clock::monotonic_ns,
    halt::HaltCore,
    ledger::{Record, RecordKind},
    logging::LogControl,
    pulse::HeartbeatState,
    stream::SlotState,
};

/// Tells systemd haltd serves (no-op without `NOTIFY_SOCKET`).
pub fn notify_ready() {
    notify(&[NotifyState::Ready]);
}

fn notify(state: &[NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(false, state) {
        tracing::warn!(error = %e, "writing to systemd's NOTIFY_SOCKET failed");
    }
}

/// Pings systemd's watchdog every half of `WATCHDOG_USEC` (when `WATCHDOG_PID` is haltd's, as
/// systemd sets them) while haltd's own heartbeat is fresh;
/// never returns. Without a systemd watchdog it waits forever.
pub async fn feed_systemd_watchdog(shared: Arc<HaltCore>) {
    let mut usec = 0;
    if !sd_notify::watchdog_enabled(false, &mut usec) || usec == 0 {
        return std::future::pending().await;
    }
    let every = Duration::from_micros(usec / 2);
    tracing::info!(
        interval_ms = every.as_millis() as u64,
        "systemd watchdog: pinging while the heartbeat is fresh"
    );
    loop {
        sleep(every).await;
        // A syscall or two per ping (the gate's clock), never per token.
        if shared.heartbeat_view(monotonic_ns()).state != HeartbeatState::Lost {
            notify(&[NotifyState::Watchdog]);
        }
    }
}

/// Installs the SIGHUP handler (its default action would end the process) and returns the
/// task that reloads on each SIGHUP; it never ends.
pub fn reload_on_hangup(
    shared: Arc<HaltCore>,
    log: LogControl,
) -> std::io::Result<impl std::future::Future<Output = ()>> {
    let mut hup = signal(SignalKind::hangup())?;
    Ok(async move {
        while hup.recv().await.is_some() {
            notify(&[NotifyState::Reloading]);
            // First the ledger, so that this reload's record opens the new segment's chain.
            let core = Arc::clone(&shared);
            let segment = tokio::task::spawn_blocking(move || reopen_ledger(&core))
                .await
                .unwrap_or_else(|e| format!("reopening the ledger: {e}"));
            let message = match reload(&shared, &log) {
                Ok(done) => {
                    tracing::info!(detail = %done, "reloaded on SIGHUP");
                    format!("reloaded on SIGHUP: {done}")
                }
                Err(why) => {
                    tracing::warn!(error = %why, "reload on SIGHUP failed; the running configuration stays");
                    format!("reload on SIGHUP failed, the running configuration stays: {why}")
                }
            };
            let message = match restart_only_changes(&shared) {
                Some(keys) => format!("{message}; {keys}"),
                None => message,
            };
            let message = format!("{message}; {segment}");
            let message = match shared.access_log.reopen_on_hangup() {
                Some(reopened) => format!("{message}; {reopened}"),
                None => message,
            };
            shared.record(Record {
                kind: RecordKind::Lifecycle,
                kernel_gate: shared.kernel_gate_label().into(),
                message: Some(message),
                ..Record::default()
            });
            notify(&[NotifyState::Ready]);
        }
    })
}

/// Rotation (logrotate's `postrotate`): once the ledger file was moved aside, a new segment at
/// `--ledger` continues the chain, its first record a `lifecycle` record linked to the previous
/// head. Blocking (the writer's fsyncs). Says what happened.
fn reopen_ledger(shared: &HaltCore) -> String {
    let path = shared.ledger.path().display().to_string();
    let rec = Record {
        kind: RecordKind::Lifecycle,
        kernel_gate: shared.kernel_gate_label().into(),
        message: Some(format!(
            "ledger reopened on SIGHUP: a new segment at {path} continues the chain"
        )),
        ..Record::default()
    };
    match shared.ledger.reopen(rec) {
        Ok(Some(written)) => {
            let seq = written.seq;
            // The store's point must stay in the current segment (`state/restore.rs`).
            shared.state.link(written.into());
            tracing::info!(path, seq, "ledger reopened on SIGHUP: a new segment");
            format!("ledger reopened: a new segment at {path} from seq {seq}")
        }
        Ok(None) => format!("ledger {path} not moved aside: it stays the current segment"),
        Err(e) => {
            tracing::error!(path, error = %e, "reopening the ledger on SIGHUP failed");
            format!("reopening the ledger {path} failed: {e}")
        }
    }
}

/// The keys of `--config` that changed since start but apply only at the next start
/// (`config/sighup.rs`), named in a WARN line; `None` when there are none (or the file cannot
/// be read: the reload says why).
fn restart_only_changes(shared: &HaltCore) -> Option<String> {
    let now = shared.cfg.args.read_config_file().ok()?;
    let keys = crate::config::sighup::changed_restart_keys(
        shared.cfg.file_at_start.as_ref(),
        now.as_ref(),
    );
    if keys.is_empty() {
        return None;
    }
    let keys = keys.join(", ");
    tracing::warn!(keys = %keys, "changed in --config but applied only at the next start: restart haltd to apply them");
    Some(format!(
        "changed in --config but applied only at the next start: {keys}"
    ))
}

/// Reads `--config` again and applies it; says what it applied, or why it applied nothing.
fn reload(shared: &HaltCore, log: &LogControl) -> Result<String, String> {
    let next = shared.cfg.args.reloadable().map_err(|e| e.to_string())?;
    let policy = shared
        .prepare_policy(|inputs| {
            inputs.detectors = next.detectors;
            inputs.routes = next.routes;
        })
        .map_err(|e| e.to_string())?;
    // Read before anything is applied: a broken pair changes nothing, as a broken file does.
    let tls = match &shared.cfg.client_tls {
        Some(cfg) => Some(cfg.reread().map_err(|e| e.to_string())?),
        None => None,
    };
    let level = log.apply_file_level(next.log_level.as_deref())?;
    let file = shared
        .cfg
        .args
        .config
        .as_ref()
        .map_or_else(|| "no --config".to_owned(), |p| p.display().to_string());
    let set = policy.set();
    let safety = &set.default_route().detectors.cfg.safety;
    let routes: Vec<&str> = set.routes.iter().map(|r| &*r.name).collect();
    let what = format!(
        "detectors and SafetyCheck from {file} (safety pack {:?}, {} boundaries), routes {} under profile {}, log level {level:?}",
        safety.pack_id,
        safety.boundaries.len(),
        routes.join(", "),
        set.profile,
    );
    let set = shared.install_policy(policy);
    shared
        .metrics
        .detectors
        .operating_point(&set.default_route().detectors.cfg);
    let tls = match (&shared.cfg.client_tls, tls) {
        (Some(cfg), Some(next)) => format!(", {}", cfg.install(next)),
        _ => String::new(),
    };
    Ok(what + &tls)
}

/// SIGTERM and SIGINT (a drain), and SIGUSR2 (a successor took over), as one stream of stop
/// requests.
#[derive(Debug)]
pub struct StopSignals {
    term: Signal,
    int: Signal,
    usr2: Signal,
}

/// What a stop signal asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// SIGTERM or SIGINT: drain (new turns 503) and exit.
    Drain,
    /// SIGUSR2 from a successor (`server/takeover.rs`): stop accepting, drain serving the turns
    /// of the open connections, exit.
    HandOver,
}

impl StopSignals {
    /// Installs the handlers (replacing the default action, which would end the process).
    pub fn install() -> std::io::Result<Self> {
        Ok(StopSignals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            usr2: signal(SignalKind::user_defined2())?,
        })
    }

    /// The next stop signal that applies: a SIGUSR2 while no successor asked to take over
    /// (`admin/handover.rs`) is logged and ignored, since handing over to nobody would leave
    /// the port without a listener.
    pub async fn next(&mut self, shared: &HaltCore) -> Stop {
        loop {
            match self.recv().await {
                Stop::HandOver if shared.handover.successor().is_none() => {
                    tracing::warn!("SIGUSR2 without a hand-over under way (no successor asked with --take-over); ignored");
                }
                stop => return stop,
            }
        }
    }

    /// The next stop signal.
    pub async fn recv(&mut self) -> Stop {
        tokio::select! {
            _ = self.term.recv() => Stop::Drain,
            _ = self.int.recv() => Stop::Drain,
            _ = self.usr2.recv() => Stop::HandOver,
        }
    }
}

/// How a drain ended.
struct Drained {
    /// Streams that were open when the drain started.
    open_at_start: usize,
    /// Whether every stream finished by itself.
    complete: bool,
    /// Whether a second signal cut it short.
    interrupted: bool,
    took: Duration,
}

/// Drains, halts what is left with `SERVICE_SHUTDOWN`, records the stop and exits 0.
pub async fn stop(shared: &HaltCore, signals: &mut StopSignals) -> ! {
    let drained = drain(shared, signals).await;
    finish(shared, &drained, "haltd stopping on signal").await
}

/// A successor took over (SIGUSR2): once the listener's accept queue is empty (the successor
/// steers new connections to itself), the listener is shut down, and what is still half-open
/// on it moves to the successor (`reuseport.rs`). Then the drain, serving the turns of the open
/// connections, and the exit, as [`stop`].
pub async fn hand_over(shared: &HaltCore, signals: &mut StopSignals, listener: &OwnedFd) -> ! {
    let t0 = Instant::now();
    shared.handover.handing_over.store(true, SeqCst);
    let successor = shared.handover.successor();
    let mut queued = crate::reuseport::accept_queue_len(listener.as_fd()).unwrap_or(0);
    while queued > 0 && t0.elapsed() < ACCEPT_QUEUE_WAIT {
        sleep(Duration::from_millis(1)).await;
        queued = crate::reuseport::accept_queue_len(listener.as_fd()).unwrap_or(0);
    }
    shared.handover.listener_shut.store(true, SeqCst);
    if let Err(e) = crate::reuseport::shut_down(listener.as_fd()) {
        tracing::error!(error = %e, "shutting the --listen socket down failed; its connections are accepted until the exit");
    }
    let accepted = shared.metrics.dataplane.accepted_total();
    tracing::info!(
        successor = successor.unwrap_or_default(),
        queued_at_shutdown = queued,
        accepted,
        took_ms = t0.elapsed().as_millis() as u64,
        "handing over: the listener is shut down; draining the open streams"
    );
    shared.wake_all();
    let drained = drain(shared, signals).await;
    let who = successor.map_or_else(|| "a successor".to_owned(), |p| format!("pid {p}"));
    let what = format!(
        "haltd handed over to {who} (accepted {accepted} connections in all; {queued} still queued when its listener shut down {} ms after SIGUSR2)",
        t0.elapsed().as_millis().saturating_sub(drained.took.as_millis()),
    );
    finish(shared, &drained, &what).await
}

/// How long a hand-over waits for the listener's accept queue to empty before it shuts the
/// listener down anyway (what is still queued then moves to the successor).
const ACCEPT_QUEUE_WAIT: Duration = Duration::from_secs(1);

/// What every stop ends with: the halts of what is still open, the stop record, the exit.
async fn finish(shared: &HaltCore, drained: &Drained, what: &str) -> ! {
    let halted = shared.halt_all_for_shutdown();
    tracing::info!(
        drained_ms = drained.took.as_millis() as u64,
        halted_streams = halted,
        "drain over; halting what is still open with SERVICE_SHUTDOWN and stopping"
    );
    wait_for_halts(shared).await;
    let leaf = leave_cgroup(shared);
    let left = shared.table.active_count();
    let how = if drained.interrupted {
        "cut short by a second signal"
    } else if drained.complete {
        "complete"
    } else {
        "timed out"
    };
    let rec = Record {
        kind: RecordKind::Lifecycle,
        kernel_gate: shared.kernel_gate_label().into(),
        message: Some(format!(
            "{what}: drain {how} after {} ms ({} streams open at the signal), {halted} open streams halted with SERVICE_SHUTDOWN, {left} still open at exit{leaf}",
            drained.took.as_millis(),
            drained.open_at_start,
        )),
        ..Record::default()
    };
    let _ = shared.ledger.append_sync(rec);
    let _ = shared.ledger.flush();
    // Every change queued for the state store is committed before the process ends (the
    // exit runs no destructor).
    shared.state.flush();
    std::process::exit(0);
}

/// Removes haltd's own cgroup leaf on the way out (`gate/cgroup.rs`): once every halt is
/// under way no socket is opened any more, and the programs stay with the sockets still
/// charged to the leaf. Says what happened, for the stop record (empty without a gate).
fn leave_cgroup(shared: &HaltCore) -> String {
    let Some(gate) = &shared.gate else {
        return String::new();
    };
    let leaf = gate.cgroup().display().to_string();
    match gate.leave_cgroup() {
        Ok(()) => {
            tracing::info!(leaf, "removed haltd's own cgroup leaf on the way out; its gate programs stay with the sockets still charged to it until they close");
            format!("; cgroup leaf {leaf} removed")
        }
        Err(e) => {
            tracing::warn!(leaf, error = %e, "haltd's own cgroup leaf stays; the next start removes it");
            format!("; cgroup leaf {leaf} left for the next start to remove: {e}")
        }
    }
}

/// How long the shutdown waits, past the emitters' and the watchdog's time to claim the
/// halts, for halts that are under way: their incident record is queued and its terminal
/// event goes out once the record is on disk, which takes what the disk takes (hundreds of ms
/// on a busy one). Well under systemd's `TimeoutStopSec` in deploy/systemd (45 s).
const RECORD_WAIT: Duration = Duration::from_secs(10);

/// Waits for the shutdown halts: their emitters (and, failing them, the watchdog) claim them
/// within 4 × `--halt-grace-ms` + 200 ms, unless a send waits on a slow client, then each waits
/// for its incident record to be on disk before its terminal event goes out, and its
/// connection for its client to take its last bytes. Past the claim deadline the wait goes on,
/// up to [`RECORD_WAIT`], only while some halt is under way (`TRIPPED` with a send in flight,
/// `HALTING`, or `HALTED` and closing): exiting then would cut a client whose halt is recorded
/// a moment later. Connections that only drained are cut by their workers at once
/// (`HaltCore::halt_all_for_shutdown`).
async fn wait_for_halts(shared: &HaltCore) {
    let claimed_by = Instant::now() + 4 * shared.cfg.halt_grace + Duration::from_millis(200);
    let recorded_by = claimed_by + RECORD_WAIT;
    let under_way = || {
        shared.table.live().any(|(_, s)| match s.state() {
            SlotState::Halting | SlotState::Halted => true,
            SlotState::Tripped => s.send_inflight.load(SeqCst),
            _ => false,
        })
    };
    while shared.table.active_count() > 0 {
        let now = Instant::now();
        if now >= recorded_by || (now >= claimed_by && !under_way()) {
            break;
        }
        sleep(Duration::from_millis(5)).await;
    }
}

/// Refuses new turns and waits, up to `--drain-timeout-ms`, for the open ones to end.
async fn drain(shared: &HaltCore, signals: &mut StopSignals) -> Drained {
    let t0 = Instant::now();
    shared.draining.store(true, SeqCst);
    // Each worker closes its idle kept connections now (with close_notify on TLS).
    shared.wake_all();
    notify(&[NotifyState::Stopping]);
    let open_at_start = shared.table.active_count();
    let what = if shared.handover.handing_over.load(SeqCst) {
        "handing over; draining: open streams may finish, and the turns of connections already accepted are served"
    } else {
        "signal received; draining: new turns get 503, open streams may finish"
    };
    tracing::info!(
        open_streams = open_at_start,
        drain_timeout_ms = shared.cfg.drain_timeout.as_millis() as u64,
        "{what}"
    );
    let deadline = t0 + shared.cfg.drain_timeout;
    let mut interrupted = false;
    while shared.table.active_count() > 0 && Instant::now() < deadline {
        tokio::select! {
            () = sleep(Duration::from_millis(10)) => {}
            _ = signals.recv() => {
                interrupted = true;
                break;
            }
        }
    }
    Drained {
        open_at_start,
        complete: shared.table.active_count() == 0,
        interrupted,
        took: t0.elapsed(),
    }
}
