//! Noticing a client that leaves while its proxied turn waits on the upstream: a client that
//! goes away cancels the upstream generation at once, not at the next token. A client that
//! only half-closed (it may still read) is served like any other; an interim
//! `100 Continue` tells the two apart.

use std::{io, os::fd::RawFd, sync::atomic::Ordering::SeqCst, sync::Arc};

use io_uring::{opcode, types};

use crate::dataplane::Step;
use crate::dataplane::{
    conn::outbox::{frame, SendKind},
    conn::KeepAlive,
    driver::op::{OpBuf, OpKind},
    timespec,
};
use crate::{
    stream::{Mode, Outcome, SlotState},
    upstream::CancelReason,
};

/// How often a half-closed client is checked for a reset while its turn waits on the upstream.
pub(in crate::dataplane) const WATCH_PERIOD: std::time::Duration =
    std::time::Duration::from_millis(100);
/// Bytes the watch's receive may take (they are never read: bytes after the request end the
/// watch).
const WATCH_BYTES: usize = 16;

/// Whether the connection was reset or closed by the peer (TCP state `CLOSE`): a client that
/// closed for good answers the interim response haltd sends after its FIN with a reset.
fn peer_reset(fd: RawFd) -> bool {
    // TCP_CLOSE is 7; an error reading the state counts as gone.
    crate::gate::held::tcp_info(fd).is_none_or(|info| info.tcpi_state == 7)
}

impl Step<'_> {
    /// Watches the client socket while the turn waits on the upstream: a client that goes
    /// away cancels the upstream generation at once, not at the next token. Before the client
    /// half-closed, a receive (EOF or an error ends it); after, a timer that looks every
    /// [`WATCH_PERIOD`] for the reset only a client that closed for good sends back (see
    /// `on_watch`). A poll cannot wait for it: io_uring reports the peer's FIN (`POLLRDHUP`)
    /// whatever the mask.
    pub(in crate::dataplane) fn arm_watch(&mut self) -> io::Result<()> {
        let conn = &mut *self.conn;
        if conn.watch_op.is_some() || conn.closing {
            return Ok(());
        }
        let (buf, e) = if conn.peer_eof {
            if self
                .io
                .shared
                .table
                .slot(conn.id.slot)
                .headers_sent
                .load(SeqCst)
            {
                // The response is under way: a client that left shows at the next send.
                return Ok(());
            }
            let ts = conn
                .watch_ts
                .take()
                .unwrap_or_else(|| Box::new(timespec(WATCH_PERIOD)));
            let e = opcode::Timeout::new(&raw const *ts).build();
            (OpBuf::Time(ts), e)
        } else {
            let mut buf = conn
                .watch_buf
                .take()
                .unwrap_or_else(|| Vec::with_capacity(WATCH_BYTES));
            buf.clear();
            let ptr = buf.spare_capacity_mut().as_mut_ptr().cast::<u8>();
            let len = buf.capacity() as u32;
            // On a kept connection, bytes after the request are the next request (answered in
            // order): the watch only peeks at them.
            // On TLS, every byte is part of the session's record stream: only peeked at.
            let flags = if conn.keep == KeepAlive::Keep || conn.tls.is_some() {
                libc::MSG_PEEK
            } else {
                0
            };
            let e = opcode::Recv::new(types::Fd(conn.fd), ptr, len)
                .flags(flags)
                .build();
            (OpBuf::Recv(buf), e)
        };
        let op = self.submit(OpKind::Watch, buf, e)?;
        self.conn.watch_op = Some(op);
        Ok(())
    }

    pub(in crate::dataplane) fn on_watch(&mut self, res: i32) -> io::Result<()> {
        let shared = Arc::clone(&self.io.shared);
        let conn = &mut *self.conn;
        if conn.closing || res == -libc::ECANCELED {
            return Ok(());
        }
        if res > 0 && !conn.peer_eof {
            // Bytes after the request: not served on a connection that is not kept, the next
            // request on a kept one; either way stop watching rather than spin on them.
            return Ok(());
        }
        if conn.peer_eof && res == -libc::ETIME && !peer_reset(conn.fd) {
            // Still a half-closed client that reads: look again later.
            return self.arm_watch();
        }
        if res == 0 && !conn.peer_eof {
            // EOF: the client half-closed (it may still be reading, as `nc -N` and many
            // HTTP/1.0-style tools do) or closed. A half-closed client is served like any
            // other. To tell the two apart before the response begins, send an interim
            // `100 Continue` (HTTP/1.1 clients skip 1xx responses): a client that closed
            // answers it with a reset, which the poll armed next sees.
            conn.peer_eof = true;
            let slot = shared.table.slot(conn.id.slot);
            if slot.headers_sent.load(SeqCst) || !conn.emit.idle() {
                return self.arm_watch();
            }
            let out = frame(&mut conn.wbuf);
            out.extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
            if !conn.count_frame(slot, 0, false) {
                return self.halt();
            }
            return self.send(SendKind::Probe);
        }
        // An error, or a reset or hang-up after EOF: the client went away. Make the stream
        // untrippable, cancel the upstream.
        let slot = shared.table.slot(conn.id.slot);
        let _ = slot
            .state
            .compare_exchange(SlotState::Streaming, SlotState::Done);
        if slot.is_tripped() {
            return self.halt();
        }
        tracing::debug!(stream_id = %conn.id, "client went away; cancelling the upstream request");
        conn.outcome = Outcome::ClientGone;
        self.up_cancel(CancelReason::ClientGone);
        self.begin_close();
        Ok(())
    }

    /// The interim response sent to a client that half-closed went out: watch for its reset,
    /// and carry on with whatever the upstream sent meanwhile.
    pub(in crate::dataplane) fn probe_sent(&mut self) -> io::Result<()> {
        self.arm_watch()?;
        let conn = &*self.conn;
        let slot = self.io.shared.table.slot(conn.id.slot);
        // The upstream's head may have arrived while the probe was in flight: the client's
        // response begins now, as it would have then.
        let head_due = slot.mode() == Mode::Stream
            && !slot.headers_sent.load(SeqCst)
            && conn
                .up
                .as_ref()
                .is_some_and(|u| u.reader.head().is_some() && !u.finished);
        if head_due {
            return self.send_stream_head();
        }
        self.pump()
    }
}
