//! What the worker's eventfd ringing means to the driver: a trip raised on another thread
//! (admin, watchdog), a record on disk, a grounding round that answered, a drain or a
//! shutdown. The driver walks the connections concerned and hands each its part on its step.

use std::sync::atomic::Ordering;

use crate::{
    dataplane::{turn::halt::WakeNeed, ConnTag, Worker},
    metrics::dataplane::KeepAliveClose,
};

impl Worker {
    /// The eventfd rang: answers whose record is on disk go out; during a drain the idle kept
    /// connections close; at shutdown the connections still draining are cut; every tripped
    /// stream of this worker halts, and the ones the watchdog halted close; then the
    /// grounding rounds that answered are applied (after the trip scan, so a turn halted
    /// meanwhile only drops its answer).
    pub(in crate::dataplane) fn on_wake(&mut self) {
        if !self.io.awaiting_records.is_empty() {
            self.send_recorded_answers();
        }
        if self.io.shared.draining.load(Ordering::SeqCst) {
            self.close_idle_for_drain();
        }
        if self.io.shared.shutting_down.load(Ordering::SeqCst) {
            self.cut_drains_for_exit();
        }
        self.scan_tripped();
        self.take_grounded();
    }

    /// The answers whose record is now on disk go out: terminal frames and final frames.
    fn send_recorded_answers(&mut self) {
        let mut recorded = Vec::new();
        self.io.awaiting_records.retain(|(tag, after, on_disk)| {
            if !on_disk.load(Ordering::Acquire) {
                return true;
            }
            recorded.push((*tag, *after));
            false
        });
        for (tag, after) in recorded {
            // A connection that ended meanwhile (its client went away) has no step.
            let Some(mut step) = self.step_of(tag) else {
                continue;
            };
            if let Err(e) = step.send_recorded(after) {
                tracing::error!(error = %e, "sending an answer after its record failed");
            }
            self.maybe_finish_close(tag);
        }
    }

    /// The drain began (SIGTERM/SIGINT): every kept connection waiting for its next request
    /// closes now (with `close_notify` on TLS), rather than hold its slot until its idle
    /// timeout or the end of the drain.
    fn close_idle_for_drain(&mut self) {
        let idle: Vec<ConnTag> = self
            .conns
            .iter()
            .filter(|(_, c)| c.idle_kept())
            .map(|(key, c)| ConnTag {
                key,
                serial: c.serial,
            })
            .collect();
        for tag in idle {
            if let Some(mut step) = self.step_of(tag) {
                step.io
                    .shared
                    .metrics
                    .dataplane
                    .keepalive_closed(KeepAliveClose::Drain);
                step.begin_close();
            }
        }
    }

    /// Halts every tripped stream of this worker, and closes the ones the watchdog halted.
    fn scan_tripped(&mut self) {
        let ignore_halt = self.io.shared.cfg.faults.emitter_ignores_halt;
        let table = &self.io.shared.table;
        let woken: Vec<(ConnTag, WakeNeed)> = self
            .conns
            .iter()
            .map(|(key, c)| {
                let need = c.on_wake(table.slot(c.id.slot).state(), ignore_halt);
                let tag = ConnTag {
                    key,
                    serial: c.serial,
                };
                (tag, need)
            })
            .filter(|&(_, need)| need != WakeNeed::Nothing)
            .collect();
        for (tag, need) in woken {
            let Some(mut step) = self.step_of(tag) else {
                continue;
            };
            match need {
                WakeNeed::Halt => {
                    if let Err(e) = step.halt() {
                        tracing::error!(error = %e, "halting a stream failed");
                    }
                }
                WakeNeed::CarryOn => {
                    if let Err(e) = step.step() {
                        tracing::error!(error = %e, "fault injection: resuming a stream failed");
                    }
                    continue;
                }
                WakeNeed::Close | WakeNeed::Nothing => {}
            }
            self.maybe_finish_close(tag);
        }
    }

    /// The grounding rounds that answered are applied to the turns waiting for them.
    fn take_grounded(&mut self) {
        for done in self.io.grounding_answers() {
            let Some(mut step) = self.step_of(done.tag()) else {
                continue;
            };
            if let Err(e) = step.grounded(done) {
                tracing::error!(error = %e, "resuming a grounded stream failed");
                step.begin_close();
            }
        }
    }
}
