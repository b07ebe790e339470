//! A client connection: its socket and stream id, its buffers, the state of the operations
//! in flight on it, and its life from accept (governed by the kernel gate before anything is
//! sent) to close (once nothing is in flight and nobody else holds its halt).

use std::{os::fd::RawFd, sync::Arc};

use io_uring::{opcode, types};

use super::{
    ring::{ud, OP_CANCEL, OP_RECV, OP_TIMER, OP_WATCH},
    timespec,
    turn::Turn,
    upstream_io::Upstream,
    watch, Worker,
};
use crate::{
    clock::monotonic_ns,
    stream::{Halter, Outcome, SlotState},
    upstream::CancelReason,
    wire::{http, HttpError, StreamId},
};
use haltd_common::SockPolicy;

/// Bytes read per receive of a request.
pub(super) const RECV_CHUNK: usize = 8 * 1024;

/// What the send in flight carries, which decides what happens when it completes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SendKind {
    Continue100,
    Head,
    Token,
    /// The last frame of a turn that ends normally.
    Final,
    /// An error or health response; the connection closes after it.
    Reply,
    Terminal,
    /// An interim `100 Continue` to a client that half-closed while its proxied turn waits on
    /// the upstream (see `watch::on_watch`).
    Probe,
}

#[derive(Debug)]
pub(super) struct Conn {
    pub(super) fd: RawFd,
    pub(super) id: StreamId,
    pub(super) rbuf: Vec<u8>,
    pub(super) wbuf: Vec<u8>,
    pub(super) woff: usize,
    pub(super) sending: Option<SendKind>,
    pub(super) recv_inflight: bool,
    pub(super) link_inflight: bool,
    pub(super) timer_inflight: bool,
    pub(super) cancel_inflight: u32,
    pub(super) timer_ts: Box<types::Timespec>,
    pub(super) read_ts: Box<types::Timespec>,
    pub(super) continue_sent: bool,
    /// The frame in flight went out in more than one send.
    pub(super) short_write: bool,
    pub(super) reading: bool,
    pub(super) pending_terminal: bool,
    pub(super) closing: bool,
    pub(super) outcome: Outcome,
    pub(super) turn: Option<Box<Turn>>,
    /// The upstream exchange of a proxied turn (or `/v1/models`).
    pub(super) up: Option<Box<Upstream>>,
    pub(super) watch_inflight: bool,
    pub(super) watch_buf: Box<[u8; 16]>,
    /// The client half-closed (or closed) its side: EOF was read after the request.
    pub(super) peer_eof: bool,
    /// Period of the half-closed client's watch timer (`watch::WATCH_PERIOD`).
    pub(super) watch_ts: Box<types::Timespec>,
    /// When the token(s) of the token frame in flight reached haltd (the built-in source
    /// produced it, or the upstream receive carrying it completed); 0 when no token frame is
    /// in flight. Its send's completion observes `haltd_token_overhead_seconds`.
    pub(super) frame_arrived_ns: u64,
}

impl Conn {
    pub(super) fn inflight(&self) -> bool {
        self.sending.is_some()
            || self.recv_inflight
            || self.link_inflight
            || self.timer_inflight
            || self.cancel_inflight > 0
            || self.watch_inflight
            || self.up.as_ref().is_some_and(|u| u.inflight())
    }
}

impl Worker {
    pub(super) fn accepted(&mut self, fd: RawFd) {
        super::set_nodelay(fd);
        let shared = &self.shared;
        let Some(id) = shared
            .table
            .alloc(self.id, fd, shared.cfg.args.budget, monotonic_ns())
        else {
            self.refuse_at_capacity(fd);
            return;
        };
        // The slot's per-turn facts start empty: a terminal prepared for the stream that had
        // the slot before must never be sent for this one.
        *shared.meta(id.slot) = crate::halt::TurnMeta::default();
        if let Some(gate) = &shared.gate {
            // SAFETY: `fd` is open for the duration of this call.
            let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
            let policy = SockPolicy {
                stream_tag: crate::halt::stream_tag(id),
                ..SockPolicy::default()
            };
            let slot = shared.table.slot(id.slot);
            // In the frame window, so a trip cannot be overwritten by this first policy.
            let mut res = Ok(crate::gate::Governed::Inserted);
            let untripped = slot.while_untripped(|| res = gate.govern(sock, &policy));
            if let Err(e) = res.map_err(|e| e.to_string()).and_then(|_| {
                untripped
                    .then_some(())
                    .ok_or_else(|| "tripped before it was governed".to_owned())
            }) {
                shared.note_ungovernable(&id.to_string(), &e);
                // Reset, not a graceful close: nothing of this connection may linger.
                let _ = crate::gate::selftest::set_linger_zero(&sock);
                // SAFETY: closing the socket we accepted; nothing else refers to it.
                unsafe { libc::close(fd) };
                shared.table.release(id);
                return;
            }
        }
        shared.metrics.dataplane.streams_active.inc();
        let conn = Conn {
            fd,
            id,
            rbuf: Vec::with_capacity(RECV_CHUNK),
            wbuf: Vec::with_capacity(4096),
            woff: 0,
            sending: None,
            recv_inflight: false,
            link_inflight: false,
            timer_inflight: false,
            cancel_inflight: 0,
            timer_ts: Box::new(timespec(shared.cfg.token_interval)),
            read_ts: Box::new(timespec(shared.cfg.request_timeout)),
            continue_sent: false,
            short_write: false,
            reading: true,
            pending_terminal: false,
            closing: false,
            outcome: Outcome::Open,
            turn: None,
            up: None,
            watch_inflight: false,
            watch_buf: Box::new([0; 16]),
            peer_eof: false,
            watch_ts: Box::new(timespec(watch::WATCH_PERIOD)),
            frame_arrived_ns: 0,
        };
        let key = self.conns.insert(conn);
        if let Err(e) = self.arm_recv(key) {
            tracing::error!(error = %e, "arming recv failed");
            self.begin_close(key);
        }
    }

    /// At `--max-streams`: answer 503 and close. With the gate, the connection was governed
    /// at establishment, so it gets an untripped policy with no budget first (no tokens, and
    /// a lost heartbeat still stops it).
    pub(super) fn refuse_at_capacity(&self, fd: RawFd) {
        let shared = &self.shared;
        shared.metrics.dataplane.rejected(503);
        if let Some(gate) = &shared.gate {
            // SAFETY: `fd` is open for the duration of this call.
            let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
            if let Err(e) = gate.govern(sock, &SockPolicy::default()) {
                shared.note_ungovernable("-", &e.to_string());
                let _ = crate::gate::selftest::set_linger_zero(&sock);
                // SAFETY: closing the socket we just accepted; nothing else refers to it.
                unsafe { libc::close(fd) };
                return;
            }
        }
        let mut out = Vec::new();
        http::write_error_response(
            &mut out,
            &HttpError::new(
                503,
                "server_error",
                "haltd is at --max-streams; retry later",
            ),
            None,
        );
        // SAFETY: plain non-blocking write and close of the socket we just accepted.
        unsafe {
            libc::send(
                fd,
                out.as_ptr().cast(),
                out.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            );
            libc::close(fd);
        }
    }

    pub(super) fn begin_close(&mut self, key: usize) {
        let Some(conn) = self.conns.get_mut(key) else {
            return;
        };
        if conn.closing {
            return;
        }
        conn.closing = true;
        let mut cancels = Vec::new();
        if conn.timer_inflight {
            cancels.push(ud(key, OP_TIMER));
        }
        if conn.recv_inflight {
            cancels.push(ud(key, OP_RECV));
        }
        if conn.watch_inflight {
            cancels.push(ud(key, OP_WATCH));
        }
        let up_reason = if conn.outcome == Outcome::ClientGone {
            CancelReason::ClientGone
        } else {
            CancelReason::Trip
        };
        let has_up = conn.up.is_some();
        conn.cancel_inflight += cancels.len() as u32;
        for target in cancels {
            let e = opcode::AsyncCancel::new(target)
                .build()
                .user_data(ud(key, OP_CANCEL));
            if self.push(&e).is_err() {
                if let Some(c) = self.conns.get_mut(key) {
                    c.cancel_inflight -= 1;
                }
            }
        }
        if has_up {
            // Closing with the upstream still generating: a trip or a client gone (a turn
            // that finished or failed closed its upstream already, so this is a no-op then).
            self.up_cancel(key, up_reason);
        }
        self.maybe_finish_close(key);
    }

    /// Closes a connection once nothing is in flight and nobody else holds its halt.
    pub(super) fn maybe_finish_close(&mut self, key: usize) {
        let Some(conn) = self.conns.get(key) else {
            return;
        };
        if !conn.closing || conn.inflight() {
            return;
        }
        let shared = Arc::clone(&self.shared);
        let slot = shared.table.slot(conn.id.slot);
        match slot.state() {
            // The watchdog is writing to this socket: it wakes us when done.
            SlotState::Halting | SlotState::Tripping => return,
            // Tripped while closing (e.g. the client went away at the same moment): the halt
            // still gets its record, without a terminal frame.
            SlotState::Tripped if slot.claim_halt() => {
                slot.finish_halt(Halter::Emitter, monotonic_ns());
                shared.complete_halt(&slot.snapshot(conn.id.slot), conn.fd, false, Vec::new());
            }
            _ => {}
        }
        // Out of reach of trips before the descriptor goes: a trip writes the kernel through
        // it. A trip that raced in wakes us once it is published.
        if !slot.settle_for_close() {
            return;
        }
        if shared.kernel_held_bytes(conn.fd) {
            // The egress check holds bytes of this stream back: a graceful close would queue
            // the FIN behind them for ever. Reset the connection instead.
            let _ = crate::gate::selftest::set_linger_zero(&conn.fd);
        }
        let conn = self.conns.remove(key);
        // SAFETY: no operation on this descriptor is in flight and the watchdog is done
        // with it (the slot is not HALTING), so nothing else uses it.
        unsafe { libc::close(conn.fd) };
        if let Some(up) = conn.up.as_ref() {
            // SAFETY: nothing is in flight on the upstream socket (`inflight` covers it).
            unsafe { libc::close(up.fd()) };
        }
        shared.metrics.dataplane.streams_active.dec();
        self.record_turn(&conn);
        shared.table.release(conn.id);
    }
}
