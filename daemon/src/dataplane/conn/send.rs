//! Client sends: one frame per send on a governed socket, and what each completion means
//! (a short write sends the rest before anything else; a failed send is a halt, a kernel
//! drop or a client gone; a delivered token frame is counted, then the turn goes on).

use std::{io, os::fd::RawFd, sync::atomic::Ordering::SeqCst, sync::Arc};

use io_uring::{opcode, types};

use crate::dataplane::turn;
use crate::dataplane::turn::circuit;
use crate::dataplane::turn::own_trip;
use crate::dataplane::Step;
use crate::dataplane::{
    conn::emit::{Completion, Emitter, FailedSend},
    conn::outbox::SendKind,
    conn::Conn,
    driver::op::{OpBuf, OpKind},
};
use crate::{
    clock::monotonic_ns,
    codes::FailureCode,
    halt::HaltCore,
    stream::{Initiator, Outcome, SlotState},
};

impl Step<'_> {
    /// Sends the frame in the connection's frame buffer, which the send owns until it
    /// completes.
    pub(in crate::dataplane) fn send(&mut self, kind: SendKind) -> io::Result<()> {
        let conn = &mut *self.conn;
        let buf = match conn.tls.as_ref() {
            None => conn.wbuf.take().unwrap_or_default(),
            // Sealed when it was counted (`begin_frame_on`), or now: a final frame, a reply
            // (no trip can come after `begin_final`), the terminal (sealed at the trip).
            Some(tls) => conn.sealed.take().unwrap_or_else(|| {
                let mut out = conn.tls_out.take().unwrap_or_default();
                crate::client_tls::lock(tls)
                    .seal(conn.wbuf.as_deref().unwrap_or_default(), &mut out);
                out
            }),
        };
        // Every caller checks that no send is in flight: one frame at a time.
        conn.emit.begin_send(kind);
        self.io
            .shared
            .table
            .slot(conn.id.slot)
            .send_inflight
            .store(true, SeqCst);
        if buf.is_empty() {
            // TLS with nothing to send: a reply while the handshake is under way, or a
            // terminal that could not be sealed. The connection ends without it.
            return self.on_send(-libc::ENOTCONN, buf, 0);
        }
        self.submit_send(buf, 0)
    }

    /// Submits the send of `buf[off..]`.
    fn submit_send(&mut self, buf: Vec<u8>, off: usize) -> io::Result<()> {
        let conn = &*self.conn;
        let rest = &buf[off..];
        let e = opcode::Send::new(types::Fd(conn.fd), rest.as_ptr(), rest.len() as u32)
            .flags(libc::MSG_NOSIGNAL)
            .build();
        self.submit(OpKind::Send, OpBuf::Send { buf, off }, e)
            .map(drop)
    }

    /// A send completed; `buf` is its frame, back from the kernel: the connection's emitter
    /// says what that means (`emit.rs`), and the driver does it.
    pub(in crate::dataplane) fn on_send(
        &mut self,
        res: i32,
        buf: Vec<u8>,
        off: usize,
    ) -> io::Result<()> {
        let shared = Arc::clone(&self.io.shared);
        let conn = &mut *self.conn;
        let done = match conn.emit.complete(res, off, buf.len()) {
            Completion::Stray => {
                conn.recycle(buf);
                return Ok(());
            }
            Completion::Rest { off } => return self.submit_send(buf, off),
            Completion::Done(done) => done,
        };
        // The frame buffer is the connection's again, for the next frame.
        conn.recycle(buf);
        let slot = shared.table.slot(conn.id.slot);
        if done.resync {
            resync_frames(&shared, conn.fd, slot);
        }
        slot.send_inflight.store(false, SeqCst);
        let kind = done.kind;
        if kind == SendKind::Terminal {
            return self.halt_done(done.ok);
        }
        if kind == SendKind::CloseNotify {
            // The close goes on (`ring.rs` `complete` finishes it); a failure only means the
            // client is gone.
            return Ok(());
        }
        if !done.ok {
            return self.send_failed(res);
        }
        if kind == SendKind::Token {
            token_delivered(&shared, conn);
        }
        if done.then_halt {
            return self.halt();
        }
        self.sent(kind)
    }

    /// A send that is not a token's last word went out whole: the step it enables.
    fn sent(&mut self, kind: SendKind) -> io::Result<()> {
        let shared = Arc::clone(&self.io.shared);
        match kind {
            SendKind::Continue100 => self.arm_recv(),
            SendKind::Handshake => self.tls_read_on(),
            SendKind::Probe => self.probe_sent(),
            SendKind::Head => self.step(),
            SendKind::Token => self.schedule_next(),
            SendKind::Final | SendKind::Reply => {
                let conn = &mut *self.conn;
                let slot = shared.table.slot(conn.id.slot);
                slot.state.store(SlotState::Done);
                if kind == SendKind::Final {
                    conn.outcome = Outcome::Completed;
                    if slot.mode() == crate::stream::Mode::Batch {
                        batch_delivered(&shared, conn.turn.as_deref_mut());
                    }
                }
                self.begin_close();
                Ok(())
            }
            SendKind::Terminal | SendKind::CloseNotify => Ok(()),
        }
    }

    /// A send failed: the halt path when the stream is tripped (the gate dropped it, or the
    /// watchdog shut the socket), a halt recorded from the gate's state when the gate dropped
    /// a send userspace had not tripped, else the client went away.
    pub(in crate::dataplane) fn send_failed(&mut self, res: i32) -> io::Result<()> {
        let shared = Arc::clone(&self.io.shared);
        let conn = &mut *self.conn;
        let slot = shared.table.slot(conn.id.slot);
        tracing::debug!(stream_id = %conn.id, error = %io::Error::from_raw_os_error(-res), "send failed");
        match Emitter::failed_send(slot, res, shared.gate.is_some()) {
            FailedSend::Halt => return self.halt(),
            FailedSend::KernelDrop => {
                // E.g. the whole daemon was stopped past the heartbeat deadline. The drop is
                // permanent whatever the table answers: the halt path records it (under the
                // first cause if the stream was tripped already) and closes.
                let cause = kernel_drop_cause(&shared, conn.fd);
                tracing::warn!(stream_id = %conn.id, cause = %cause, "the kernel gate halted a stream userspace had not tripped");
                own_trip::trip_own(&shared, conn.id, cause, Initiator::Kernel);
                return self.halt();
            }
            // The client went away (or stalled and was cut, `drain.rs`): close.
            FailedSend::ClientGone => {}
        }
        if !conn.cut {
            conn.outcome = Outcome::ClientGone;
        }
        self.begin_close();
        Ok(())
    }
}

impl Conn {
    /// A send buffer back from the kernel: the frame buffer again, or on TLS the spare one
    /// for the next records.
    fn recycle(&mut self, buf: Vec<u8>) {
        if self.tls.is_some() {
            self.tls_out = Some(buf);
        } else {
            self.wbuf = Some(buf);
        }
    }
}

/// A token frame was delivered to the kernel: count its tokens (post-trip too), observe
/// their overhead, dispatch the tool calls it started.
fn token_delivered(shared: &HaltCore, conn: &mut Conn) {
    let slot = shared.table.slot(conn.id.slot);
    // Arrival to send completion, one lock-free observation per token.
    let now = monotonic_ns();
    let overhead = &shared.metrics.dataplane.token_overhead;
    let delivered = conn.emit.delivered(slot, |arrived| {
        if arrived != 0 {
            overhead.observe_ns(now.saturating_sub(arrived));
        }
    });
    let n = delivered.tokens;
    shared.metrics.dataplane.tokens_emitted.inc_by(n as u64);
    let Some(turn) = conn.turn.as_mut() else {
        return;
    };
    // Time to first token, and the gap since the last (the turn's own handle): the
    // frame's tokens reached the client together.
    for _ in 0..n {
        turn.obs.token_sent(now);
    }
    // The tool calls the frame started are dispatched now (TokenCircuit notes it: per
    // frame that starts a call, never per token, its store's lock is taken).
    if !turn.tools_in_flight.is_empty() {
        let circuit = turn.circuit.as_deref();
        circuit::delivered(&shared.circuits, circuit, &turn.tools_in_flight);
        stamp_delivered(&mut turn.tools_in_flight);
    }
    turn.tool_calls.append(&mut turn.tools_in_flight);
}

/// A batch turn's whole response was delivered: its tokens reached the client now, all at
/// once (`haltd_tokens_emitted_total`, its time to first token), and its tool calls with
/// them.
fn batch_delivered(shared: &HaltCore, turn: Option<&mut turn::Turn>) {
    let Some(turn) = turn else {
        return;
    };
    shared
        .metrics
        .dataplane
        .tokens_emitted
        .inc_by(turn.tokens_generated);
    if turn.tokens_generated > 0 && turn.obs.first_token_ns == 0 {
        turn.obs.first_token_ns = monotonic_ns();
    }
    if !turn.tool_calls.is_empty() {
        let circuit = turn.circuit.as_deref();
        circuit::delivered(&shared.circuits, circuit, &turn.tool_calls);
        stamp_delivered(&mut turn.tool_calls);
    }
}

/// Notes when the kernel accepted the calls (`delivered_unix_ms`, in the turn's record): the
/// time a failed turn's dispatched call is listed with (`haltctl reconcile`).
fn stamp_delivered(calls: &mut [serde_json::Value]) {
    let now = crate::clock::unix_ms_now();
    for c in calls {
        c["delivered_unix_ms"] = now.into();
    }
}

/// After a short write, brings the frame count up to the gate's own: the rest of a short write
/// sometimes runs the gate program again (a kernel frame userspace did not count), and from
/// then on a trip's kernel limit would be one frame stricter than B. Only on this rare path
/// (the client reads slower than haltd writes), never per token.
fn resync_frames(shared: &HaltCore, fd: RawFd, slot: &crate::stream::Slot) {
    let Some(gate) = &shared.gate else {
        return;
    };
    // SAFETY: `fd` is this connection's open socket; it is closed only after this returns.
    let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    if let Ok(crate::gate::SocketView {
        state: Some(st), ..
    }) = gate.socket(sock)
    {
        // Never lower it: a trip may have read the count already, and lower is looser.
        slot.frames_submitted.fetch_max(st.frames, SeqCst);
    }
}

/// Why the gate dropped a send of a stream userspace had not tripped, from its socket state.
fn kernel_drop_cause(shared: &HaltCore, fd: RawFd) -> FailureCode {
    let Some(gate) = &shared.gate else {
        return FailureCode::WatchdogTrip;
    };
    // SAFETY: `fd` is this connection's open socket; it is closed only after this returns.
    let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    match gate.socket(sock) {
        Ok(crate::gate::SocketView {
            state: Some(st), ..
        }) if st.trip_reason == haltd_common::trip_reason::HEARTBEAT => FailureCode::HeartbeatLost,
        _ => FailureCode::WatchdogTrip,
    }
}
