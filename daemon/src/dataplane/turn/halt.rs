//! The emitter's side of a halt: once a stream is tripped (by a detector here, or by the
//! admin API, the watchdog or the kernel elsewhere), cancel its upstream generation, claim
//! the halt (no token is sent from here), record it, and send the terminal frame once the
//! record is on disk (after any send in flight): a halt the client saw is never lost in a
//! crash (issue 13, point 5). The wait for the fsync holds no thread: the ledger's writer
//! rings the worker's eventfd when the record is written. A trip raised on another thread
//! rings the eventfd too (`driver/wake.rs`).

use std::{
    io,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use crate::dataplane::conn::emit::HaltStep;
use crate::dataplane::turn::own_trip;
use crate::dataplane::Step;
use crate::dataplane::{
    conn::{
        outbox::{frame, SendKind},
        Conn,
    },
    AfterRecord,
};
use crate::{
    clock::monotonic_ns,
    detect::Trip,
    stream::{Halter, Initiator, Outcome, SlotState},
    upstream::CancelReason,
};

/// What a wake-up asks of a connection whose stream is tripped (`Conn::on_wake`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::dataplane) enum WakeNeed {
    /// Nothing: its stream is not tripped, or its halt is under way.
    Nothing,
    /// Its halt, from the emitter's side (`Step::halt`), then its close if it is closing.
    Halt,
    /// Its close only: it was closing already when the watchdog halted it.
    Close,
    /// `emitter-ignores-halt` (fault injection): an emitter that paused on the trip (it saw
    /// TRIPPING) carries on sending tokens, so only the kernel stops it.
    CarryOn,
}

impl Conn {
    /// What the worker's wake-up asks of this connection, its slot being in `state`.
    pub(in crate::dataplane) fn on_wake(&self, state: SlotState, ignore_halt: bool) -> WakeNeed {
        let tripped = state == SlotState::Tripped;
        if state == SlotState::Halted || (tripped && (self.closing || !ignore_halt)) {
            if self.closing {
                WakeNeed::Close
            } else {
                WakeNeed::Halt
            }
        } else if tripped && !self.closing && !self.inflight() && self.turn.is_some() {
            WakeNeed::CarryOn
        } else {
            WakeNeed::Nothing
        }
    }
}

impl Step<'_> {
    /// An answer whose record is now on disk goes out: the halt's terminal frame, or the
    /// turn's final frame (unless the connection is closing). A final frame whose record may
    /// have failed (the recorder failed meanwhile) does not: the turn is not answered as
    /// complete, and the connection ends without it (fail closed). A halt's terminal goes
    /// out either way: it ends the stream.
    pub(in crate::dataplane) fn send_recorded(&mut self, after: AfterRecord) -> io::Result<()> {
        match after {
            AfterRecord::Terminal => self.send_terminal(),
            AfterRecord::Final if self.conn.closing => Ok(()),
            AfterRecord::Final if self.io.shared.ledger.is_failed() => {
                tracing::warn!(stream_id = %self.conn.id, "the flight recorder failed before this turn's record was on disk: its final frame is not sent");
                self.begin_close();
                Ok(())
            }
            AfterRecord::Final => self.send_final(),
        }
    }
}

impl Step<'_> {
    /// A detector tripped the stream: note who and why for the terminal event and record,
    /// count it, trip, halt.
    pub(in crate::dataplane) fn detector_trip(&mut self, trip: Trip) -> io::Result<()> {
        let shared = Arc::clone(&self.io.shared);
        let id = self.conn.id;
        tracing::info!(stream_id = %id, detector = %trip.detector, code = %trip.code, detail = %trip.detail, "detector tripped the stream");
        shared.metrics.detectors.tripped(trip.detector, trip.code);
        // Bounded: the terminal frame must fit the gate's terminal allowance.
        let detail: String = trip.detail.chars().take(240).collect();
        self.publish_timing();
        shared.meta(id.slot).detector_trip = Some((trip.detector, detail));
        let own = own_trip::trip_own(&shared, id, trip.code, Initiator::Detector);
        if let own_trip::OwnTrip::AlreadyTripped(first) = own {
            // Another cause came first: its terminal and record must not name this detector.
            if first != trip.code {
                shared.meta(id.slot).detector_trip = None;
            }
        }
        self.halt()
    }

    /// Halts a tripped stream from the emitter's side: claim the halt, then send the terminal
    /// frame (after any send in flight). If the watchdog holds the halt, wait for its wake-up.
    pub(in crate::dataplane) fn halt(&mut self) -> io::Result<()> {
        if let Some(g) = self.conn.turn.as_mut().and_then(|t| t.grounding.as_mut()) {
            // A halt wins over grounding: the round in flight is cancelled (`ground.rs`).
            g.cancel();
        }
        if self.io.shared.table.slot(self.conn.id.slot).is_tripped() {
            // A tripped turn's generation is cancelled at once (spec: no work for nothing,
            // and vLLM frees the sequence).
            self.up_cancel(CancelReason::Trip);
        }
        let shared = Arc::clone(&self.io.shared);
        let conn = &mut *self.conn;
        let slot = shared.table.slot(conn.id.slot);
        match conn.emit.halt_step(slot) {
            HaltStep::Halted => {
                conn.outcome = Outcome::Halted;
                self.begin_close();
                return Ok(());
            }
            HaltStep::NotTripped => {
                self.begin_close();
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
        shared.degrade_before_terminal(slot, &snap);
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
        let (flag, waker) = (Arc::clone(&on_disk), shared.waker(self.io.id));
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
            return self.send_terminal();
        }
        self.await_record(crate::dataplane::AfterRecord::Terminal, on_disk);
        Ok(())
    }

    /// The halt's record is on disk (or failed): the terminal frame goes out, or, for a
    /// connection already closing, the halt completes without it.
    fn send_terminal(&mut self) -> io::Result<()> {
        let shared = Arc::clone(&self.io.shared);
        let conn = &mut *self.conn;
        if conn.closing || conn.cut {
            // Closing, or cut because its client stopped reading (its socket is shut down):
            // the halt completes without the terminal frame.
            return self.halt_done(false);
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
        self.send(SendKind::Terminal)
    }

    pub(in crate::dataplane) fn halt_done(&mut self, delivered: bool) -> io::Result<()> {
        let shared = Arc::clone(&self.io.shared);
        let conn = &mut *self.conn;
        let slot = shared.table.slot(conn.id.slot);
        slot.publish_halted();
        let snap = slot.snapshot(conn.id.slot);
        if !delivered {
            tracing::info!(stream_id = %snap.id, "terminal event not delivered (socket closed or dropped by the kernel gate)");
        }
        shared.halt_completed(&snap);
        self.begin_close();
        Ok(())
    }
}
