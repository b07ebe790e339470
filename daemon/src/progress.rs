//! What each data-plane worker is doing, for the watchdog to find one that is stuck (issue 33).
//!
//! A worker's life is a loop: wait on its io_uring for completions, then handle them. Each
//! worker has a [`WorkerBeat`]: a counter it bumps as it goes into the wait and again as it
//! comes out, so an odd value means "waiting" and an even one "handling", and the check that
//! is running, if any (a detector on a token, SafetyCheck at a turn's end). The worker only
//! stores: two relaxed additions per loop pass and two stores per check, no clock, no lock.
//!
//! The watchdog ([`crate::watchdog`]) reads them every round. A worker whose counter stayed on
//! the same even value for `--worker-stall-ms` while it owns open streams is stuck in one
//! step: a detector, a predicate or any other code that does not return. It cannot police its
//! streams, so the watchdog halts them itself, naming the check that was running.
//!
//! A worker is not replaced in place: its ring owns its connections (their operations and
//! buffers are in the kernel under that ring) and the accepts queued on it, and the thread
//! cannot be stopped from outside without leaving all of that half done. haltd exits 70 once
//! the stuck worker's halts are recorded and the other workers' streams ended typed
//! (`watchdog/stall.rs`), and the service manager restarts it; the durable state
//! (`state.rs`) makes that restart loosen nothing.

use std::{
    cell::OnceCell,
    sync::{
        atomic::{AtomicU64, AtomicU8, Ordering::Relaxed},
        Arc,
    },
};

/// A check a worker runs inside a step, as recorded for the watchdog.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Check {
    /// None running (or one that is not tracked).
    None = 0,
    HaltMonitor,
    Surprise,
    ComputeBudget,
    LatencyAnomaly,
    Exfil,
    /// SafetyCheck's predicates at a turn's end.
    Safety,
}

impl Check {
    const ALL: [Check; 7] = [
        Check::None,
        Check::HaltMonitor,
        Check::Surprise,
        Check::ComputeBudget,
        Check::LatencyAnomaly,
        Check::Exfil,
        Check::Safety,
    ];

    fn from_u8(v: u8) -> Check {
        Check::ALL
            .get(usize::from(v))
            .copied()
            .unwrap_or(Check::None)
    }
}

/// One worker's progress, written by that worker only.
#[derive(Debug, Default)]
pub struct WorkerBeat {
    /// Bumped into and out of every wait on the ring: odd while waiting.
    steps: AtomicU64,
    /// The [`Check`] running now.
    check: AtomicU8,
}

impl WorkerBeat {
    /// The worker goes into its wait for completions.
    pub fn waiting(&self) {
        self.steps.fetch_add(1, Relaxed);
    }

    /// The worker is back from its wait, handling what completed.
    pub fn handling(&self) {
        self.steps.fetch_add(1, Relaxed);
    }

    /// The counter and whether the worker is handling (not waiting), as the watchdog reads it.
    pub fn read(&self) -> (u64, bool) {
        let v = self.steps.load(Relaxed);
        (v, v.is_multiple_of(2))
    }

    /// The check running now.
    pub fn check(&self) -> Check {
        Check::from_u8(self.check.load(Relaxed))
    }
}

/// Every worker's beat, by worker number; shared by the workers and the watchdog.
#[derive(Debug)]
pub struct WorkerBeats(Vec<Arc<WorkerBeat>>);

impl WorkerBeats {
    pub fn new(workers: usize) -> Self {
        WorkerBeats((0..workers).map(|_| Arc::default()).collect())
    }

    pub fn get(&self, worker: usize) -> Option<&Arc<WorkerBeat>> {
        self.0.get(worker)
    }

    pub fn iter(&self) -> impl Iterator<Item = &WorkerBeat> {
        self.0.iter().map(|b| &**b)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

thread_local! {
    /// The beat of the worker running on this thread (none on other threads).
    static THIS_WORKER: OnceCell<Arc<WorkerBeat>> = const { OnceCell::new() };
}

/// Makes `beat` this thread's: [`running`] then records checks in it.
pub fn attach(beat: Arc<WorkerBeat>) {
    THIS_WORKER.with(|b| {
        let _ = b.set(beat);
    });
}

/// Records that `check` runs now on this thread (`Check::None`: it returned). Nothing on a
/// thread that is no worker's (tests, the admin plane).
pub fn running(check: Check) {
    THIS_WORKER.with(|b| {
        if let Some(b) = b.get() {
            b.check.store(check as u8, Relaxed);
        }
    });
}

/// Under `--fault detector-hang=NAME`, a per-token detector hangs at this token of a turn (so
/// that streams on every worker are under way when it does).
pub const HANG_AT_TOKEN: u64 = 20;

/// The test fault `--fault detector-hang=NAME`: the first call hangs its thread forever, with
/// `check` recorded as running; every later call returns at once, so one worker hangs and the
/// others go on.
pub fn hang_once(check: Check) {
    static HUNG: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if HUNG.swap(true, Relaxed) {
        return;
    }
    running(check);
    tracing::error!(
        check = ?check,
        "fault injection: this worker hangs now in a check that never returns"
    );
    loop {
        std::thread::park();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counter_is_odd_while_waiting_and_even_while_handling() {
        let b = WorkerBeat::default();
        assert_eq!(b.read(), (0, true));
        b.waiting();
        assert_eq!(b.read(), (1, false));
        b.handling();
        assert_eq!(b.read(), (2, true));
    }

    #[test]
    fn a_check_is_recorded_only_on_a_worker_thread() {
        let beat = Arc::new(WorkerBeat::default());
        running(Check::Surprise);
        assert_eq!(beat.check(), Check::None);
        let b2 = Arc::clone(&beat);
        std::thread::spawn(move || {
            attach(b2);
            running(Check::Safety);
        })
        .join()
        .expect("the worker thread ends");
        assert_eq!(beat.check(), Check::Safety);
        assert_eq!(Check::from_u8(200), Check::None);
    }
}
