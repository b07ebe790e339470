//! The watchdog (spec 000 §3.2, §4): its own thread, independent of the data-plane workers.
//!
//! Every `--heartbeat-interval-ms` (once a second in idle mode, see [`pulse`]) it
//! 1. writes the heartbeat to the kernel gate and to the in-process copy (a lost heartbeat
//!    makes the gate and the emitters treat every stream as tripped: fail closed);
//! 2. looks at every tripped stream and halts, itself, any whose emitter has not: the kernel
//!    write failed, the post-trip budget is spent, or `--halt-grace-ms` passed (an emitter
//!    whose send waits on a client that still takes bytes is left to finish it, [`waits`]). It claims the
//!    halt, queues the incident record, and once that is on disk ([`pending`]: it never waits
//!    for the disk itself) writes the terminal frame with a plain non-blocking `send` and
//!    shuts the socket down, so a blocked or stuck emitter cannot keep a tripped stream open.
//!    It walks the open
//!    streams only ([`crate::stream::StreamTable::live`], an active-slot bitmap), so a round
//!    with nothing open costs the same whatever `--max-streams` is;
//! 3. folds kernel halt events into metrics.
//!
//! It never closes a descriptor (the owning worker does, after the halt), so it can never
//! write to a descriptor number that was reused.
//!
//! With no slot in use for [`pulse::IDLE_AFTER`] it goes idle: it beats once a second (and
//! at once when a worker that takes a slot kicks it), because with nothing open there is nothing
//! to police, and a watchdog woken 200 times a second was most of an idle haltd's CPU.

use std::{
    sync::{atomic::Ordering::SeqCst, Arc},
    thread,
    time::{Duration, Instant},
};

use crate::{
    clock::monotonic_ns,
    codes::FailureCode,
    halt::HaltCore,
    stream::{Halter, SlotState},
};

pub mod pending;
pub mod stall;
pub mod waits;

use crate::pulse::{self, Sleep};
use pending::{Claimed, Pending};
use stall::Stalls;
use waits::{SendWaits, Verdict};

/// How long past the grace period the watchdog waits for an emitter's in-flight send, at
/// least; then for as long as the client takes bytes ([`waits`]).
const SEND_STUCK_FACTOR: u32 = 4;

/// The watchdog thread, started and without privileges, waiting for the core to watch.
#[derive(Debug)]
pub struct Waiting {
    core: std::sync::mpsc::SyncSender<Arc<HaltCore>>,
}

impl Waiting {
    /// Hands the thread the core: it starts beating. It runs for the life of the daemon.
    pub fn start(self, shared: Arc<HaltCore>) {
        // The thread waits in `recv` until this send; it cannot have gone.
        let _ = self.core.send(shared);
    }
}

/// Why the watchdog thread could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("starting the watchdog thread: {0}")]
    Spawn(#[source] std::io::Error),
    #[error("the watchdog thread's privilege drop: {0}")]
    Privileges(#[source] crate::privs::PrivError),
    #[error("the watchdog thread ended before it reported its privilege drop")]
    Gone,
}

/// Starts the watchdog thread while the process still holds its start-up capabilities (before
/// the main thread's own drop, see [`crate::privs`]): it takes its real-time priority, which
/// needs `CAP_SYS_NICE`, then drops every capability of its own, and waits for the core.
/// Returns once the thread has dropped them.
pub fn spawn_unprivileged() -> Result<Waiting, SpawnError> {
    let (dropped_tx, dropped_rx) = std::sync::mpsc::sync_channel(1);
    let (core_tx, core_rx) = std::sync::mpsc::sync_channel::<Arc<HaltCore>>(1);
    thread::Builder::new()
        .name("haltd-watchdog".into())
        .spawn(move || {
            raise_priority();
            let dropped = crate::privs::drop_thread();
            let ok = dropped.is_ok();
            let _ = dropped_tx.send(dropped);
            // A failed drop ends the thread (and the start); so does a start that fails
            // before it hands over the core (the sender is dropped).
            if let (true, Ok(shared)) = (ok, core_rx.recv()) {
                run(&shared);
            }
        })
        .map_err(SpawnError::Spawn)?;
    match dropped_rx.recv() {
        Ok(Ok(_)) => Ok(Waiting { core: core_tx }),
        Ok(Err(e)) => Err(SpawnError::Privileges(e)),
        Err(_) => Err(SpawnError::Gone),
    }
}

fn run(shared: &HaltCore) {
    raise_priority();
    shared.pulse.register_watchdog();
    let started = Instant::now();
    let interval = shared.cfg.heartbeat_interval;
    let mut pending = Pending::new();
    let mut waits = SendWaits::default();
    let mut stalls = Stalls::default();
    let mut last_busy = monotonic_ns();
    let mut planned = interval;
    loop {
        if let Some(after) = shared.cfg.faults.watchdog_stall_after {
            if started.elapsed() >= after {
                tracing::error!(
                    "fault injection: the watchdog thread stalls now (no more heartbeats)"
                );
                loop {
                    thread::park();
                }
            }
        }
        // Before the clock is read: the beat below is stamped after every kick it answers.
        let kicked = shared.pulse.take_kick();
        let now = monotonic_ns();
        round(
            shared,
            now,
            planned,
            (&mut pending, &mut waits, &mut stalls),
        );
        if kicked {
            shared.pulse.answer();
        }
        planned = match shared
            .pulse
            .plan(now, &mut last_busy, || shared.table.any_live())
        {
            Sleep::Busy => interval,
            Sleep::Idle => pulse::IDLE_BEAT,
        };
        shared.pulse.sleep(planned);
    }
}

/// One round at `now`, after a sleep of `planned`: the gap check, the beat, a stuck worker,
/// the halts due and those whose incident is on disk, the gate's events.
fn round(
    shared: &HaltCore,
    now: u64,
    planned: Duration,
    (pending, waits, stalls): (&mut Pending, &mut SendWaits, &mut Stalls),
) {
    let last = shared.heartbeat_ns.load(SeqCst);
    let cfg = &shared.cfg;
    if let Some(gap) = pulse::overdue(
        now,
        last,
        planned,
        cfg.heartbeat_interval,
        cfg.heartbeat_deadline,
    ) {
        // This thread missed its own deadline (the whole daemon was stopped or starved):
        // every stream that was open during the gap went unwatched, so it halts before the
        // next beat makes the heartbeat look fresh again (fail closed).
        halt_after_gap(shared, gap);
    }
    beat(shared, now);
    if shared.ledger.is_failed() || shared.state.is_failed() {
        shared.recorder_failed();
    }
    crate::crash::watchdog_pass(cfg.faults.panic, &shared.table);
    stalls.look(shared, now);
    enforce(shared, now, pending, (waits, stalls.stuck()));
    pending.finish_written(shared);
    stalls.exit_when_recorded(shared, now, !pending.is_empty());
    if let Some(gate) = &shared.gate {
        let mut events = 0u64;
        if let Err(e) = gate.drain_halt_events(&mut |ev| {
            events += 1;
            tracing::debug!(
                stream_tag = format_args!("{:#x}", ev.stream_tag),
                verdict = haltd_common::verdict::NAMES
                    .get(ev.verdict as usize)
                    .copied()
                    .unwrap_or("unknown"),
                frames = ev.frames,
                "kernel gate dropped a send"
            );
        }) {
            tracing::warn!(error = %e, "reading kernel halt events failed");
        }
        shared.metrics.gate.halt_events.inc_by(events);
    }
}

fn halt_after_gap(shared: &HaltCore, gap_ns: u64) {
    let open = shared.table.live().filter(|(_, s)| !s.is_tripped()).count();
    tracing::error!(
        gap_ms = gap_ns / 1_000_000,
        streams = open,
        "the watchdog missed its heartbeat deadline; halting every open stream with HEARTBEAT_LOST"
    );
    shared.trip_all(FailureCode::HeartbeatLost);
}

fn beat(shared: &HaltCore, now: u64) {
    if let Some(gate) = &shared.gate {
        if let Err(e) = gate.beat() {
            // Leave the in-process heartbeat stale too: every emitter then halts its stream.
            shared.metrics.gate.errors.inc();
            tracing::error!(error = %e, "writing the kernel heartbeat failed; streams will halt with HEARTBEAT_LOST");
            return;
        }
    }
    shared.heartbeat_ns.store(now, SeqCst);
}

/// Claims the halts that are due. `stuck`: a worker stuck in one step ([`stall`]), whose
/// tripped streams are due at once (it will never send their terminal).
fn enforce(
    shared: &HaltCore,
    now: u64,
    pending: &mut Pending,
    (waits, stuck): (&mut SendWaits, Option<u32>),
) {
    let grace = shared.cfg.halt_grace.as_nanos() as u64;
    let window = waits::client_window(shared.cfg.halt_grace);
    waits.begin_round();
    for (idx, slot) in shared.table.live() {
        if slot.state() != SlotState::Tripped {
            continue;
        }
        let since_trip = now.saturating_sub(slot.trip_ns.load(SeqCst));
        let kernel_missing = shared.gate.is_some() && !slot.kernel_tripped.load(SeqCst);
        let budget_spent =
            slot.post_trip_delivered.load(SeqCst) >= u64::from(slot.budget.load(SeqCst));
        let owner_stuck = stuck == Some(slot.worker.load(SeqCst));
        let fd = slot.fd.load(SeqCst);
        // A stuck worker never reaps its completions, so its flag says nothing: its send can
        // only still be under way with bytes waiting in the socket.
        let send_stuck = slot.send_inflight.load(SeqCst) && (!owner_stuck || queued(fd));
        // From the trip on: is the send in flight waiting on a client that takes bytes?
        let waiting = send_stuck.then(|| {
            let generation = slot.generation.load(SeqCst);
            waits.look((idx, generation), fd, now, window)
        });
        let why = Due {
            owner_stuck,
            kernel_missing,
            budget_spent,
        };
        if !why.at(since_trip, grace) {
            continue;
        }
        if send_stuck && !kernel_missing && !owner_stuck {
            // The emitter's send will complete (or fail); writing now could interleave. A send
            // that waits on a client that takes bytes is left to it; one over an empty queue
            // (a stuck emitter) or to a client that took nothing for the window is not.
            if since_trip <= grace * u64::from(SEND_STUCK_FACTOR)
                || waiting == Some(Verdict::ClientMoves)
            {
                continue;
            }
        }
        if !slot.claim_halt() {
            continue;
        }
        slot.note_halt(Halter::Watchdog, monotonic_ns());
        // The incident is on disk before the client can see the halt (issue 13, point 5); a
        // failure fails every stream closed (RECORDER_FAILURE), and this one still ends.
        let terminal = if send_stuck {
            "stream halted by the watchdog; no terminal event (a send was stuck in the socket: its client took nothing, or the emitter is stuck)"
        } else {
            "stream halted by the watchdog; terminal event sent after this record was on disk"
        };
        let rec = shared.halt_record(
            &slot.snapshot(idx),
            fd,
            vec!["watchdog".to_owned()],
            terminal.to_owned(),
        );
        let claim = Claimed {
            idx,
            fd,
            send_stuck,
        };
        pending.queue(shared, claim, rec);
    }
    waits.end_round();
}

/// What makes a tripped stream's halt due before its emitter halts it.
#[derive(Debug, Clone, Copy, Default)]
struct Due {
    /// Its worker is stuck ([`stall`]): it will never answer.
    owner_stuck: bool,
    /// The kernel trip map was not written: only userspace holds the stream.
    kernel_missing: bool,
    /// Its B post-trip frames went out: nothing more may, so it need not wait the whole grace.
    budget_spent: bool,
}

impl Due {
    /// Whether the halt is due `since_trip` ns after the trip, with a grace of `grace` ns.
    fn at(self, since_trip: u64, grace: u64) -> bool {
        self.owner_stuck
            || self.kernel_missing
            || since_trip > grace
            || (self.budget_spent && since_trip > grace / 4)
    }
}

/// Whether bytes wait in the socket `fd` (a tripped slot's, open until its halt completes).
fn queued(fd: i32) -> bool {
    // SAFETY: a tripped slot's socket stays open until its halt completes (only its worker
    // closes it, after the halt).
    let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    crate::gate::held::SendQueue::of(sock).is_some_and(|q| q.queued() > 0)
}

/// Asks for a real-time priority so a busy node cannot starve the heartbeat; without the
/// privilege the watchdog still runs, and a missed deadline still fails closed. The priority
/// stays after the thread drops `CAP_SYS_NICE`.
fn raise_priority() {
    let param = libc::sched_param { sched_priority: 10 };
    // SAFETY: plain syscall on the calling thread with a valid sched_param.
    let rc = unsafe { libc::pthread_setschedparam(libc::pthread_self(), libc::SCHED_FIFO, &param) };
    if rc != 0 {
        tracing::info!("watchdog runs without real-time priority (no CAP_SYS_NICE?)");
    }
}

#[cfg(test)]
mod tests {
    use super::Due;

    #[test]
    fn a_halt_is_due_after_the_grace_or_a_quarter_of_it_once_the_budget_is_spent() {
        let grace = 40;
        let plain = Due::default();
        assert!(!plain.at(40, grace) && plain.at(41, grace));
        let spent = Due {
            budget_spent: true,
            ..Due::default()
        };
        assert!(!spent.at(10, grace) && spent.at(11, grace));
        for at_once in [
            Due {
                owner_stuck: true,
                ..Due::default()
            },
            Due {
                kernel_missing: true,
                ..Due::default()
            },
        ] {
            assert!(at_once.at(0, grace), "{at_once:?}");
        }
    }
}
