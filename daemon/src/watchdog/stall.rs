//! A data-plane worker stuck in one step (issue 33): found from its beat ([`crate::progress`]),
//! its streams halted, and the daemon ended for the service manager to restart.
//!
//! Each round looks at every worker's counter. One that is handling (not waiting on its ring)
//! and has not moved for `--worker-stall-ms` while it owns open streams is stuck: a detector,
//! a SafetyCheck predicate or any other step that does not return. Its streams cannot be
//! policed by it any more, so the watchdog trips every one of them with `DETECTOR_FAILURE`
//! (naming the check that was running when the worker recorded one; the kernel gate holds the
//! budget B from the trip on) and halts them at once, without the grace period an emitter
//! gets: this one will never answer. The other workers' streams flow until those halts are
//! on disk (or [`EXIT_WAIT`] passed); then they end as at the end of a drain, with the typed
//! `SERVICE_SHUTDOWN` terminal, and once those are recorded too the watchdog records why and
//! ends the process with [`EXIT_CODE`].
//!
//! The worker is not replaced in place: its io_uring owns its connections (their operations
//! and buffers are with the kernel under that ring) and the accepts queued on it; the thread
//! cannot be stopped from outside without leaving all of that half done. A restart is clean,
//! and the durable state (`state.rs`) makes it loosen nothing.

use std::{sync::atomic::Ordering::SeqCst, time::Duration};

use crate::{
    codes::FailureCode,
    detect::DetectorId,
    halt::HaltCore,
    ledger::{Record, RecordKind},
    progress::Check,
    stream::SlotState,
    wire::StreamId,
};

/// The exit status once a stuck worker's streams are halted (`EX_SOFTWARE`, as for a worker
/// whose ring failed): the unit restarts haltd.
pub const EXIT_CODE: i32 = 70;

/// Longest the watchdog waits for the stuck worker's halts to be recorded before it exits
/// anyway (a disk that takes this long has failed the recorder already).
pub const EXIT_WAIT: Duration = Duration::from_secs(10);

/// What the rounds saw of one worker's counter.
#[derive(Debug, Clone, Copy, Default)]
struct Seen {
    steps: u64,
    since_ns: u64,
}

/// The stuck worker, once one is found.
#[derive(Debug, Clone, Copy)]
pub struct Stuck {
    pub worker: u32,
    pub check: Check,
    /// How long it had been in its step when found.
    pub stalled: Duration,
    /// When it was found (monotonic ns).
    found_ns: u64,
    /// When the other workers' streams were halted for the exit, and how many.
    shutdown_ns: Option<u64>,
    others: usize,
}

/// The watchdog's view of the workers' progress. Owned by the watchdog thread.
#[derive(Debug, Default)]
pub struct Stalls {
    seen: Vec<Seen>,
    stuck: Option<Stuck>,
}

impl Stalls {
    /// The stuck worker, if one was found.
    pub fn stuck(&self) -> Option<u32> {
        self.stuck.map(|s| s.worker)
    }

    /// Looks at every worker at `now`; trips the streams of the first one found stuck.
    pub fn look(&mut self, shared: &HaltCore, now: u64) {
        if self.stuck.is_some() {
            return;
        }
        let limit = shared.cfg.worker_stall.as_nanos() as u64;
        self.seen.resize(shared.workers.len(), Seen::default());
        for (worker, beat) in shared.workers.iter().enumerate() {
            let (steps, handling) = beat.read();
            let seen = &mut self.seen[worker];
            if steps != seen.steps || !handling || seen.since_ns == 0 {
                *seen = Seen {
                    steps,
                    since_ns: now,
                };
                continue;
            }
            let stalled = now.saturating_sub(seen.since_ns);
            if stalled < limit || open_streams(shared, worker as u32) == 0 {
                continue;
            }
            let stuck = Stuck {
                worker: worker as u32,
                check: beat.check(),
                stalled: Duration::from_nanos(stalled),
                found_ns: now,
                shutdown_ns: None,
                others: 0,
            };
            self.stuck = Some(stuck);
            trip_streams(shared, &stuck);
            return;
        }
    }

    /// The exit, in two steps. Once every stream of the stuck worker is halted and its
    /// record on disk (or past [`EXIT_WAIT`]), the other workers' streams are halted with
    /// `SERVICE_SHUTDOWN`, as at the end of a drain (typed terminal, recorded, degrading
    /// nobody), so that the exit cuts no client without its terminal; once those are done
    /// too (or past [`EXIT_WAIT`] again), it records why and ends the process.
    /// `halts_pending`: the watchdog's own halts still waiting for their record.
    pub fn exit_when_recorded(&mut self, shared: &HaltCore, now: u64, halts_pending: bool) {
        let Some(stuck) = self.stuck.as_mut() else {
            return;
        };
        let since = stuck.shutdown_ns.unwrap_or(stuck.found_ns);
        let waited = Duration::from_nanos(now.saturating_sub(since));
        let worker = stuck.worker;
        let unfinished = shared.table.live().any(|(_, s)| {
            s.state() != SlotState::Halted
                && (stuck.shutdown_ns.is_some() || s.worker.load(SeqCst) == worker)
        });
        if (unfinished || halts_pending) && waited < EXIT_WAIT {
            return;
        }
        if stuck.shutdown_ns.is_none() {
            shared.draining.store(true, SeqCst);
            stuck.others = shared.halt_all_for_shutdown();
            stuck.shutdown_ns = Some(now);
            return;
        }
        let message = format!(
            "data-plane worker {} was stuck for {} ms in {}; its streams were halted with DETECTOR_FAILURE, then the other workers' {} streams with SERVICE_SHUTDOWN ({}); haltd exits {EXIT_CODE} for the service manager to restart it",
            stuck.worker,
            stuck.stalled.as_millis(),
            check_name(stuck.check),
            stuck.others,
            if unfinished || halts_pending {
                "some halts were not done in time"
            } else {
                "every halt recorded"
            },
        );
        exit(shared, message);
    }
}

/// Records why, flushes the recorder and the state store, and ends the process.
fn exit(shared: &HaltCore, message: String) -> ! {
    tracing::error!("{message}");
    let rec = Record {
        kind: RecordKind::Lifecycle,
        kernel_gate: shared.kernel_gate_label().into(),
        message: Some(message),
        ..Record::default()
    };
    if let Err(e) = shared.ledger.append_sync(rec) {
        tracing::error!(error = %e, "the exit's lifecycle record could not be written");
    }
    let _ = shared.ledger.flush();
    shared.state.flush();
    std::process::exit(EXIT_CODE);
}

/// What a recorded check is called in records and logs.
fn check_name(check: Check) -> String {
    match DetectorId::of_check(check) {
        Some(DetectorId::Safety) => "SafetyCheck's predicates".to_owned(),
        Some(id) => format!("detector {id}"),
        None => "a step with no check recorded".to_owned(),
    }
}

/// The open streams a worker owns.
fn open_streams(shared: &HaltCore, worker: u32) -> usize {
    shared
        .table
        .live()
        .filter(|(_, s)| s.worker.load(SeqCst) == worker)
        .count()
}

/// Trips every open stream of the stuck worker with `DETECTOR_FAILURE`, naming the check.
fn trip_streams(shared: &HaltCore, stuck: &Stuck) {
    let streams = open_streams(shared, stuck.worker);
    tracing::error!(
        worker = stuck.worker,
        stalled_ms = stuck.stalled.as_millis() as u64,
        check = check_name(stuck.check),
        streams,
        "a data-plane worker is stuck in one step; halting its streams with DETECTOR_FAILURE"
    );
    let ids: Vec<StreamId> = shared
        .table
        .live()
        .filter(|(_, s)| s.worker.load(SeqCst) == stuck.worker && !s.is_tripped())
        .map(|(idx, s)| StreamId {
            slot: idx,
            generation: s.generation.load(SeqCst),
        })
        .collect();
    let detail = format!(
        "worker {} stuck for {} ms in {}",
        stuck.worker,
        stuck.stalled.as_millis(),
        check_name(stuck.check)
    );
    let detector = DetectorId::of_check(stuck.check);
    for id in ids {
        // The stuck worker may hold this lock (it stopped anywhere): then the record names no
        // detector rather than the watchdog waiting on it.
        if let (Some(d), Ok(mut meta)) = (detector, shared.turn_meta[id.slot as usize].try_lock()) {
            meta.detector_trip = Some((d, detail.clone()));
        }
        if let Err(e) = shared.trip(id, FailureCode::DetectorFailure) {
            // It ended meanwhile, or another cause tripped it first: no halt of ours needed.
            tracing::debug!(stream_id = %id, error = %e, "stuck worker: stream not tripped");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_are_named_for_records() {
        assert_eq!(check_name(Check::Surprise), "detector surprise");
        assert_eq!(check_name(Check::Safety), "SafetyCheck's predicates");
        assert_eq!(check_name(Check::None), "a step with no check recorded");
    }
}
