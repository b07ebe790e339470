//! The emitter's side of a halt: once a stream is tripped (by a detector here, or by the
//! admin API, the watchdog or the kernel elsewhere), cancel its upstream generation, claim
//! the halt (no token is sent from here), record it, and send the terminal frame once the
//! record is on disk (after any send in flight): a halt the client saw is never lost in a
//! crash (issue 13, point 5). The wait for the fsync holds no thread: the ledger's writer
//! rings the worker's eventfd when the record is written. A trip raised on another thread
//! rings the eventfd too ([`Worker::scan_tripped`]).

use std::{
    io,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use crate::dataplane::conn::emit::HaltStep;
use crate::dataplane::turn::own_trip;
use crate::dataplane::{
    conn::{frame, SendKind},
    Worker,
};
use crate::{
    clock::monotonic_ns,
    detect::Trip,
    stream::{Halter, Initiator, Outcome, SlotState},
    upstream::CancelReason,
};

impl Worker {
    /// A detector tripped the stream: note who and why for the terminal event and record,
    /// count it, trip, halt.
    pub(in crate::dataplane) fn detector_trip(&mut self, key: usize, trip: Trip) -> io::Result<()> {
        let shared = Arc::clone(&self.shared);
        let id = self.conns[key].id;
        tracing::info!(stream_id = %id, detector = %trip.detector, code = %trip.code, detail = %trip.detail, "detector tripped the stream");
        shared.metrics.detectors.tripped(trip.detector, trip.code);
        // Bounded: the terminal frame must fit the gate's terminal allowance.
        let detail: String = trip.detail.chars().take(240).collect();
        shared.meta(id.slot).detector_trip = Some((trip.detector, detail));
        let own = own_trip::trip_own(&shared, id, trip.code, Initiator::Detector);
        if let own_trip::OwnTrip::AlreadyTripped(first) = own {
            // Another cause came first: its terminal and record must not name this detector.
            if first != trip.code {
                shared.meta(id.slot).detector_trip = None;
            }
        }
        self.halt(key)
    }

    /// Halts a tripped stream from the emitter's side: claim the halt, then send the terminal
    /// frame (after any send in flight). If the watchdog holds the halt, wait for its wake-up.
    pub(in crate::dataplane) fn halt(&mut self, key: usize) -> io::Result<()> {
        if let Some(g) = self.conns[key]
            .turn
            .as_mut()
            .and_then(|t| t.grounding.as_mut())
        {
            // A halt wins over grounding: the round in flight is cancelled (`ground/mod.rs`).
            g.cancel();
        }
        if self.shared.table.slot(self.conns[key].id.slot).is_tripped() {
            // A tripped turn's generation is cancelled at once (spec: no work for nothing,
            // and vLLM frees the sequence).
            self.up_cancel(key, CancelReason::Trip);
        }
        let shared = Arc::clone(&self.shared);
        let conn = &mut self.conns[key];
        let slot = shared.table.slot(conn.id.slot);
        match conn.emit.halt_step(slot) {
            HaltStep::Halted => {
                conn.outcome = Outcome::Halted;
                self.begin_close(key);
                return Ok(());
            }
            HaltStep::NotTripped => {
                self.begin_close(key);
                return Ok(());
            }
            // Woken later: by the tripper, the watchdog, or the send in flight's completion.
            HaltStep::Wait | HaltStep::AfterSend => return Ok(()),
            HaltStep::Claimed => {}
        }
        // HALTING: the stream is stopped now (the halt latency ends here); the terminal event
        // waits for the incident record.
        slot.note_halt(Halter::Emitter, monotonic_ns());
        conn.outcome = Outcome::Halted;
        let snap = slot.snapshot(conn.id.slot);
        let refs = conn
            .turn
            .as_ref()
            .map(|t| t.detector_refs.clone())
            .unwrap_or_default();
        let cause = snap
            .trip_cause
            .unwrap_or(crate::codes::FailureCode::WatchdogTrip);
        let terminal =
            format!("stream halted ({cause}); terminal event sent once this record was on disk");
        let rec = shared.halt_record(&snap, conn.fd, refs, terminal);
        let on_disk = Arc::new(AtomicBool::new(false));
        let (flag, waker) = (Arc::clone(&on_disk), shared.waker(self.id));
        // Runs on the ledger's writer after the fsync (or its failure: the watchdog then fails
        // every stream closed, and the terminal still goes out).
        let queued = shared.ledger.append_then(rec, move |_| {
            flag.store(true, Ordering::Release);
            if let Some(w) = waker {
                crate::halt::wake_fd(&w);
            }
        });
        if let Err(e) = queued {
            shared.metrics.ledger.errors.inc();
            tracing::error!(error = %e, "flight recorder append failed");
            shared.recorder_failed();
            return self.send_terminal(key);
        }
        let serial = self.conns[key].serial;
        self.awaiting_records.push((
            key,
            serial,
            crate::dataplane::AfterRecord::Terminal,
            on_disk,
        ));
        Ok(())
    }

    /// The halt's record is on disk (or failed): the terminal frame goes out, or, for a
    /// connection already closing, the halt completes without it.
    fn send_terminal(&mut self, key: usize) -> io::Result<()> {
        let shared = Arc::clone(&self.shared);
        let conn = &mut self.conns[key];
        if conn.closing || conn.cut {
            // Closing, or cut because its client stopped reading (its socket is shut down):
            // the halt completes without the terminal frame.
            return self.halt_done(key, false);
        }
        let snap = shared.table.slot(conn.id.slot).snapshot(conn.id.slot);
        if conn.tls.is_some() {
            // Its records as sealed at the trip: `send` sends them as they are.
            let mut out = conn.tls_out.take().unwrap_or_default();
            shared.terminal_wire(&snap, &mut out);
            conn.sealed = Some(out);
        } else {
            shared.terminal_frame(&snap, frame(&mut conn.wbuf));
        }
        self.send(key, SendKind::Terminal)
    }

    pub(in crate::dataplane) fn halt_done(
        &mut self,
        key: usize,
        delivered: bool,
    ) -> io::Result<()> {
        let shared = Arc::clone(&self.shared);
        let conn = &mut self.conns[key];
        let slot = shared.table.slot(conn.id.slot);
        slot.publish_halted();
        let snap = slot.snapshot(conn.id.slot);
        if !delivered {
            tracing::info!(stream_id = %snap.id, "terminal event not delivered (socket closed or dropped by the kernel gate)");
        }
        shared.halt_completed(&snap);
        self.begin_close(key);
        Ok(())
    }

    /// The answers whose record is now on disk go out: terminal frames and final frames.
    fn send_recorded_answers(&mut self) {
        let mut recorded = Vec::new();
        self.awaiting_records
            .retain(|(key, serial, after, on_disk)| {
                if !on_disk.load(Ordering::Acquire) {
                    return true;
                }
                recorded.push((*key, *serial, *after));
                false
            });
        for (key, serial, after) in recorded {
            if self.conns.get(key).is_none_or(|c| c.serial != serial) {
                continue; // the connection ended meanwhile (its client went away)
            }
            let sent = match after {
                crate::dataplane::AfterRecord::Terminal => self.send_terminal(key),
                crate::dataplane::AfterRecord::Final if self.conns[key].closing => Ok(()),
                crate::dataplane::AfterRecord::Final => self.send_final(key),
            };
            if let Err(e) = sent {
                tracing::error!(error = %e, "sending an answer after its record failed");
            }
            self.maybe_finish_close(key);
        }
    }

    /// After a wake-up: halt every tripped stream of this worker, and close the ones the
    /// watchdog halted. During a drain, close the idle kept connections; at shutdown, cut the
    /// connections still draining.
    pub(in crate::dataplane) fn scan_tripped(&mut self) {
        if !self.awaiting_records.is_empty() {
            self.send_recorded_answers();
        }
        if self.shared.draining.load(Ordering::SeqCst) {
            self.close_idle_for_drain();
        }
        if self.shared.shutting_down.load(Ordering::SeqCst) {
            self.cut_drains_for_exit();
        }
        let ignore_halt = self.shared.cfg.faults.emitter_ignores_halt;
        let mut halt = Vec::new();
        let mut carry_on = Vec::new();
        for (key, c) in &self.conns {
            let st = self.shared.table.slot(c.id.slot).state();
            if st == SlotState::Halted || (st == SlotState::Tripped && (c.closing || !ignore_halt))
            {
                halt.push((key, c.closing));
            } else if st == SlotState::Tripped && !c.closing && !c.inflight() && c.turn.is_some() {
                // `emitter-ignores-halt`: an emitter that paused on the trip (it saw
                // TRIPPING) carries on sending tokens, so only the kernel stops it.
                carry_on.push(key);
            }
        }
        for (key, closing) in halt {
            if !closing {
                if let Err(e) = self.halt(key) {
                    tracing::error!(error = %e, "halting a stream failed");
                }
            }
            self.maybe_finish_close(key);
        }
        for key in carry_on {
            if let Err(e) = self.step(key) {
                tracing::error!(error = %e, "fault injection: resuming a stream failed");
            }
        }
    }
}
