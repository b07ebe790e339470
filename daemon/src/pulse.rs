//! The watchdog's idle mode: with no stream to police it beats once a second instead of every
//! `--heartbeat-interval-ms`, and a new connection kicks it awake before anything is sent.
//!
//! Why: a watchdog that wakes 200 times a second costs 5 ms of CPU a second on a VM even when
//! each round does nothing (a wake-up alone costs 20–30 µs there), which is most of what an idle
//! haltd spent. With nothing open there is nothing to police, so nothing is lost by sleeping.
//!
//! What stays true:
//!
//! * Only the watchdog stamps the heartbeat, so a beat still means "the watchdog is alive".
//! * No governed byte goes out under a stale heartbeat: a worker that takes a slot while the
//!   watchdog is idle kicks it ([`Pulse::kick`]) and waits ([`Pulse::await_beat`]), before its
//!   connection is read or written, for a beat stamped after the kick, at most the heartbeat
//!   deadline. A watchdog that does not answer in time (stalled, or its kernel stamp failed)
//!   leaves the heartbeat stale, and the stream halts with HEARTBEAT_LOST as any stream does
//!   under a lost heartbeat (fail closed).
//! * The kick cannot be missed: a worker inserts its slot into the active-slot bitmap, then
//!   reads [`Pulse::is_idle`]; the watchdog sets the flag, then reads the bitmap (all `SeqCst`).
//!   One of the two sees the other's write: either the worker kicks, or the watchdog sees the
//!   slot and stays awake.
//! * The watchdog enters idle mode only after [`IDLE_AFTER`] with no slot in use, so
//!   back-to-back requests never pay a kick, and leaves it at the first round that sees a slot.
//!
//! The wait is synchronous on the worker thread, bounded by the deadline; it happens only for a
//! connection that arrives after at least [`IDLE_AFTER`] with none open (so the worker has
//! nothing else of its own to serve), and normally lasts one thread wake-up of the watchdog
//! plus its kernel stamp (tens of microseconds).

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering::SeqCst},
        Condvar, Mutex, OnceLock,
    },
    thread::{self, Thread},
    time::Duration,
};

use crate::clock::monotonic_ns;

/// How long the table must have been empty before the watchdog goes idle.
pub const IDLE_AFTER: Duration = Duration::from_secs(1);

/// The watchdog's period while idle: it still beats, drains the gate's events and checks the
/// recorder this often, so a watchdog that died while idle shows as lost within
/// `IDLE_BEAT + --heartbeat-deadline-ms`.
pub const IDLE_BEAT: Duration = Duration::from_secs(1);

/// How the watchdog sleeps after a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sleep {
    /// `--heartbeat-interval-ms`: streams are open, or were recently.
    Busy,
    /// [`IDLE_BEAT`], or until a kick.
    Idle,
}

/// The idle flag, the kicks and the answer to them, shared by the watchdog and the workers.
#[derive(Debug, Default)]
pub struct Pulse {
    /// Set while the watchdog is in idle mode (see the module docs for the ordering).
    idle: AtomicBool,
    /// When the oldest unanswered kick was made (`CLOCK_MONOTONIC` ns); 0 when none is pending.
    kick_ns: AtomicU64,
    /// The watchdog thread, to unpark on a kick (set when it starts).
    watchdog: OnceLock<Thread>,
    /// Workers waiting for the beat that answers their kick wait here.
    beaten: Mutex<()>,
    beaten_cv: Condvar,
}

impl Pulse {
    /// Whether the watchdog is in idle mode; a worker reads this after it took a slot.
    pub fn is_idle(&self) -> bool {
        self.idle.load(SeqCst)
    }

    /// Wakes the watchdog for a beat. Returns the kick's time: the beat that answers it is
    /// stamped no earlier. Kicks before the watchdog answers share the first one's time, so a
    /// watchdog that does not answer costs every waiter the same deadline, not one each.
    pub fn kick(&self, now_ns: u64) -> u64 {
        let now_ns = now_ns.max(1);
        let kick = match self.kick_ns.compare_exchange(0, now_ns, SeqCst, SeqCst) {
            Ok(_) => now_ns,
            Err(pending) => pending,
        };
        if let Some(t) = self.watchdog.get() {
            t.unpark();
        }
        kick
    }

    /// Waits until `heartbeat` holds a beat stamped at or after `kick`, at most until
    /// `kick + deadline`. Returns whether the beat came.
    pub fn await_beat(&self, heartbeat: &AtomicU64, kick: u64, deadline: Duration) -> bool {
        let until = kick.saturating_add(deadline.as_nanos() as u64);
        let mut guard = self.beaten.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            // Read under the lock: the watchdog stores the beat, then takes the lock to notify,
            // so a beat after this read finds this thread waiting.
            if heartbeat.load(SeqCst) >= kick {
                return true;
            }
            let now = monotonic_ns();
            if now >= until {
                return false;
            }
            guard = self
                .beaten_cv
                .wait_timeout(guard, Duration::from_nanos(until - now))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// The watchdog registers its own thread, for [`Pulse::kick`] to unpark.
    pub(super) fn register_watchdog(&self) {
        let _ = self.watchdog.set(thread::current());
    }

    /// Takes the pending kick, if any; the watchdog calls this before it reads the clock for
    /// its beat, so the beat is stamped after every kick it answers.
    pub(super) fn take_kick(&self) -> bool {
        self.kick_ns.swap(0, SeqCst) != 0
    }

    /// Wakes the workers waiting for a beat (after the beat is stored).
    pub(super) fn answer(&self) {
        drop(self.beaten.lock().unwrap_or_else(|p| p.into_inner()));
        self.beaten_cv.notify_all();
    }

    /// Sleeps `dur`, or less if a kick comes.
    pub(super) fn sleep(&self, dur: Duration) {
        let until = monotonic_ns().saturating_add(dur.as_nanos() as u64);
        loop {
            if self.kick_ns.load(SeqCst) != 0 {
                return;
            }
            let now = monotonic_ns();
            if now >= until {
                return;
            }
            // A kick's unpark before this park makes it return at once: no kick is lost.
            thread::park_timeout(Duration::from_nanos(until - now));
        }
    }

    /// The watchdog's choice after a round at `now_ns`. `any_live` reads the active-slot
    /// bitmap; `last_busy_ns` is when a round last saw a slot in use (the watchdog's own).
    pub(super) fn plan(
        &self,
        now_ns: u64,
        last_busy_ns: &mut u64,
        any_live: impl Fn() -> bool,
    ) -> Sleep {
        if any_live() {
            *last_busy_ns = now_ns;
            self.idle.store(false, SeqCst);
            return Sleep::Busy;
        }
        if self.idle.load(SeqCst) {
            return Sleep::Idle;
        }
        if now_ns.saturating_sub(*last_busy_ns) < IDLE_AFTER.as_nanos() as u64 {
            return Sleep::Busy;
        }
        self.idle.store(true, SeqCst);
        // A worker that took a slot before the store above may have read the flag clear and
        // not kicked: this read sees its slot.
        if any_live() {
            self.idle.store(false, SeqCst);
            *last_busy_ns = now_ns;
            return Sleep::Busy;
        }
        Sleep::Idle
    }
}

/// The heartbeat as health checks and metrics report it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HeartbeatState {
    /// Younger than the deadline.
    Fresh,
    /// Older than the deadline, but the watchdog is in idle mode and beat within its idle
    /// period: nothing is open, and a new connection gets a fresh beat before it is served.
    Idle,
    /// Older than the deadline (or than the idle period in idle mode): the watchdog is not
    /// beating; every stream halts with HEARTBEAT_LOST.
    Lost,
}

impl HeartbeatState {
    pub fn as_str(self) -> &'static str {
        match self {
            HeartbeatState::Fresh => "fresh",
            HeartbeatState::Idle => "idle",
            HeartbeatState::Lost => "lost",
        }
    }
}

/// Classifies a heartbeat `age_s` seconds old (the larger of the process's and the gate's).
pub fn heartbeat_state(fresh: bool, idle: bool, age_s: f64, deadline: Duration) -> HeartbeatState {
    if fresh {
        HeartbeatState::Fresh
    } else if idle && age_s <= (IDLE_BEAT + deadline).as_secs_f64() {
        HeartbeatState::Idle
    } else {
        HeartbeatState::Lost
    }
}

/// How long past its last beat the watchdog is late at `now_ns`, if it is: more than
/// `deadline` after the beat, not counting the part of the sleep it planned beyond a normal
/// interval (an idle sleep is no gap; oversleeping it by more than the deadline is).
pub fn overdue(
    now_ns: u64,
    last_beat_ns: u64,
    planned: Duration,
    interval: Duration,
    deadline: Duration,
) -> Option<u64> {
    if last_beat_ns == 0 {
        return None;
    }
    let extra = planned.saturating_sub(interval).as_nanos() as u64;
    let gap = now_ns.saturating_sub(last_beat_ns);
    (gap.saturating_sub(extra) > deadline.as_nanos() as u64).then_some(gap)
}

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Instant};

    use super::*;

    const MS: u64 = 1_000_000;
    const S: u64 = 1_000 * MS;

    #[test]
    fn goes_idle_only_after_a_second_without_a_slot_and_wakes_at_the_first_one() {
        let p = Pulse::default();
        let mut last_busy = 0;
        assert_eq!(p.plan(10 * S, &mut last_busy, || true), Sleep::Busy);
        assert!(!p.is_idle());
        // Empty, but not for long enough: still beating at the full rate.
        assert_eq!(
            p.plan(10 * S + 500 * MS, &mut last_busy, || false),
            Sleep::Busy
        );
        assert!(!p.is_idle());
        assert_eq!(p.plan(11 * S, &mut last_busy, || false), Sleep::Idle);
        assert!(p.is_idle());
        assert_eq!(p.plan(12 * S, &mut last_busy, || false), Sleep::Idle);
        // A slot in use ends idle mode at once, and the hysteresis starts again from there.
        assert_eq!(p.plan(13 * S, &mut last_busy, || true), Sleep::Busy);
        assert!(!p.is_idle());
        assert_eq!(last_busy, 13 * S);
        assert_eq!(
            p.plan(13 * S + 999 * MS, &mut last_busy, || false),
            Sleep::Busy
        );
    }

    #[test]
    fn a_slot_taken_while_going_idle_keeps_the_watchdog_awake() {
        // The worker inserted its slot after the first read of the bitmap and read the flag
        // before the watchdog set it: it did not kick, so the second read must catch it.
        let p = Pulse::default();
        let mut last_busy = 0;
        let reads = std::cell::Cell::new(0);
        let any_live = || {
            reads.set(reads.get() + 1);
            reads.get() > 1
        };
        assert_eq!(p.plan(5 * S, &mut last_busy, any_live), Sleep::Busy);
        assert!(!p.is_idle());
        assert_eq!(last_busy, 5 * S);
    }

    #[test]
    fn a_kick_cuts_the_idle_sleep_short_and_the_beat_answers_it() {
        let p = Arc::new(Pulse::default());
        let heartbeat = Arc::new(AtomicU64::new(0));
        let (p2, hb2) = (Arc::clone(&p), Arc::clone(&heartbeat));
        let (tx, rx) = std::sync::mpsc::channel();
        let watchdog = thread::spawn(move || {
            p2.register_watchdog();
            tx.send(()).expect("registered");
            let t = Instant::now();
            p2.sleep(Duration::from_secs(30));
            let slept = t.elapsed();
            assert!(p2.take_kick(), "woken by the kick");
            hb2.store(monotonic_ns(), SeqCst);
            p2.answer();
            slept
        });
        rx.recv().expect("watchdog started");
        let kick = p.kick(monotonic_ns());
        assert!(p.await_beat(&heartbeat, kick, Duration::from_secs(10)));
        assert!(heartbeat.load(SeqCst) >= kick);
        let slept = watchdog.join().expect("watchdog");
        assert!(
            slept < Duration::from_secs(10),
            "slept {slept:?} despite the kick"
        );
        assert!(!p.take_kick(), "the kick was answered");
    }

    #[test]
    fn an_unanswered_kick_fails_after_the_deadline_and_later_kicks_share_it() {
        let p = Pulse::default();
        let heartbeat = AtomicU64::new(0);
        let t = Instant::now();
        let kick = p.kick(monotonic_ns());
        assert!(!p.await_beat(&heartbeat, kick, Duration::from_millis(50)));
        assert!(t.elapsed() >= Duration::from_millis(50));
        // Nobody answered: a second kick shares the first one's time, so its wait is over.
        assert_eq!(p.kick(monotonic_ns()), kick);
        let t = Instant::now();
        assert!(!p.await_beat(&heartbeat, kick, Duration::from_millis(50)));
        assert!(t.elapsed() < Duration::from_millis(50));
        // A beat older than the kick does not answer it; one stamped after does.
        heartbeat.store(kick - 1, SeqCst);
        assert!(!p.await_beat(&heartbeat, kick, Duration::ZERO));
        heartbeat.store(kick, SeqCst);
        assert!(p.await_beat(&heartbeat, kick, Duration::ZERO));
    }

    #[test]
    fn an_idle_heartbeat_is_idle_only_within_the_idle_period() {
        let d = Duration::from_millis(200);
        assert_eq!(heartbeat_state(true, true, 0.5, d), HeartbeatState::Fresh);
        assert_eq!(heartbeat_state(false, true, 0.9, d), HeartbeatState::Idle);
        assert_eq!(heartbeat_state(false, true, 1.19, d), HeartbeatState::Idle);
        assert_eq!(heartbeat_state(false, true, 1.21, d), HeartbeatState::Lost);
        assert_eq!(heartbeat_state(false, false, 0.3, d), HeartbeatState::Lost);
        let never = f64::INFINITY;
        assert_eq!(heartbeat_state(false, true, never, d), HeartbeatState::Lost);
    }

    #[test]
    fn a_planned_idle_sleep_is_no_gap_but_oversleeping_it_is() {
        let interval = Duration::from_millis(5);
        let deadline = Duration::from_millis(50);
        let busy = interval;
        // Busy: as before, late once the beat is older than the deadline.
        assert_eq!(overdue(100 * MS, 60 * MS, busy, interval, deadline), None);
        assert_eq!(
            overdue(111 * MS, 60 * MS, busy, interval, deadline),
            Some(51 * MS)
        );
        // Idle: a second's sleep is planned; late only past it plus the deadline.
        let idle = IDLE_BEAT;
        assert_eq!(overdue(S + 40 * MS, 0, idle, interval, deadline), None);
        assert_eq!(overdue(S + 40 * MS, 1, idle, interval, deadline), None);
        assert_eq!(overdue(2 * S, S, idle, interval, deadline), None);
        assert_eq!(
            overdue(2 * S + 46 * MS, S, idle, interval, deadline),
            Some(S + 46 * MS)
        );
        assert_eq!(
            overdue(10 * S, 0, idle, interval, deadline),
            None,
            "no beat yet"
        );
    }
}
