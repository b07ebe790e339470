//! Keeping upstream connections for the next request: what decides that a turn's connection
//! goes back to its worker's pool (`pool.rs`), reading the end of a body the turn no longer
//! needs, and the one retry of a request whose pooled connection turned out to be dead.
//!
//! A connection is pooled only when all of this holds: the response said nothing against
//! keep-alive and had a framing of its own, its body ended cleanly (read to the chunked
//! terminator or the `content-length`, with nothing after it), and the turn completed. A trip,
//! a failure, a cancellation or a client that left shuts the connection down instead
//! ([`Upstream::discard`]): a generation may still be running on it.
//!
//! A reused connection may have been closed by the upstream just before the request went out
//! (its keep-alive timeout, a restart). When it fails on send, or on receive before any
//! response byte (EPIPE, ECONNRESET, EOF), and nothing reached the client yet, the request is
//! sent once more on a new connection; the upstream did not start a generation for it.

use std::{io, sync::atomic::Ordering::SeqCst, sync::Arc};

use io_uring::opcode;

use crate::dataplane::{
    conn::outbox::SendKind,
    driver::op::{OpBuf, OpKind},
    upstream_io::exchange::{Reuse, Upstream},
    upstream_io::pool::{close_kept, Kept},
    upstream_io::sock::upstream_socket,
};
use crate::dataplane::{Io, Step};
use crate::{clock::monotonic_ns, stream::Outcome, upstream::metrics::DiscardReason};

/// Whether a failed operation's result is what a connection closed by the upstream gives.
pub(in crate::dataplane) fn closed_by_peer(res: i32) -> bool {
    res == 0 || [libc::EPIPE, libc::ECONNRESET, libc::ECONNABORTED].contains(&-res)
}

impl Upstream {
    /// Reads `res` bytes after the exchange ended: the rest of a body being drained (it may
    /// complete the body and make the connection reusable), or stray bytes or EOF on a
    /// connection that looked reusable (it is not). Returns whether to read on.
    fn take_after_end(&mut self, res: i32) -> bool {
        if res == -libc::ECANCELED && std::mem::take(&mut self.recv_stopped) {
            // The receive armed with the turn's deadline, stopped at the end of the turn's
            // text: a drain reads on with its own, short deadline.
            return self.reuse == Reuse::Draining;
        }
        match self.reuse {
            Reuse::No => false,
            // A receive that was in flight when the body completed, cancelled since: the
            // connection stays reusable unless it brought bytes or EOF.
            Reuse::Ready => {
                if res != -libc::ECANCELED {
                    self.discard();
                }
                false
            }
            Reuse::Draining if res <= 0 => {
                self.discard();
                false
            }
            Reuse::Draining => {
                self.body.clear();
                let read = self.rbuf.as_deref().unwrap_or_default();
                let fed = self.reader.feed(read, &mut self.body);
                self.body.clear();
                match fed {
                    Err(_) => {
                        self.discard();
                        false
                    }
                    Ok(_) if self.reader.is_done() => {
                        self.reuse = Reuse::Ready;
                        false
                    }
                    Ok(_) => true,
                }
            }
        }
    }
}

impl Io {
    /// The connection is closing and its upstream socket is idle: back to the pool (with its
    /// TLS session) if its response ended cleanly and the turn completed, else closed.
    pub(in crate::dataplane) fn release_upstream(
        &mut self,
        conn: Kept,
        reuse: Reuse,
        outcome: Outcome,
    ) {
        let metrics = &self.shared.metrics.upstream.pool;
        if reuse == Reuse::Ready && outcome == Outcome::Completed {
            self.pool.put(conn, monotonic_ns(), metrics);
            return;
        }
        // Nothing is in flight on the upstream socket (its operations are the connection's,
        // all complete), and nothing else holds its descriptor. A socket already shut down
        // (a trip, a failure) refuses the close_notify, which is then not sent.
        close_kept(conn);
        metrics.discarded(DiscardReason::NotReusable);
    }
}

impl Step<'_> {
    /// A receive on the upstream socket completed after the exchange ended.
    pub(in crate::dataplane) fn up_after_end(&mut self, res: i32) -> io::Result<()> {
        let more = self
            .conn
            .up
            .as_mut()
            .is_some_and(|up| up.take_after_end(res));
        if more {
            return self.up_arm_recv();
        }
        Ok(())
    }

    /// After any completion of the connection's operations: a final frame waiting for its
    /// upstream exchange goes out once that has settled (a drain that completed or failed,
    /// the cancelled receive back, a TLS error after the end).
    pub(in crate::dataplane) fn send_waiting_final(&mut self) -> io::Result<()> {
        let waiting = self.conn.final_waits_upstream && !self.conn.closing;
        if waiting && self.settle_upstream() {
            self.conn.final_waits_upstream = false;
            return self.send(SendKind::Final);
        }
        Ok(())
    }

    /// Sends a completed turn's final frame (written, counted and recorded) once its upstream
    /// exchange has settled: the rest of the body drained and the connection back in the
    /// pool. A client that sees the end of its answer and sends the next request at once (on
    /// this connection or another) then finds the connection pooled, instead of racing the
    /// drain and connecting anew. The wait is at most the drain's deadline
    /// (`DRAIN_TIMEOUT_NS`); usually the chunked terminator came with `[DONE]` and there is no
    /// wait at all.
    pub(in crate::dataplane) fn send_final(&mut self) -> io::Result<()> {
        if self.settle_upstream() {
            return self.send(SendKind::Final);
        }
        self.conn.final_waits_upstream = true;
        // The body's end may not be read yet by anything: a receive held back while the
        // source had tokens queued is not re-armed once the text is complete. Arm the drain
        // now (a no-op when a receive or its linked timeout is in flight; the latter arms it
        // when it completes), so the wait ends by the drain's deadline at the latest.
        self.up_arm_recv()
    }

    /// Whether the connection's upstream exchange (if any) has settled; one whose response
    /// ended cleanly, with nothing in flight on its socket, is given back to the pool here.
    fn settle_upstream(&mut self) -> bool {
        let conn = &mut *self.conn;
        let Some(up) = conn.up.as_mut() else {
            return true;
        };
        let idle = up.recv_op.is_none()
            && up.send_op.is_none()
            && up.connect_op.is_none()
            && up.links == 0;
        match up.reuse {
            // Shut down, or never to be pooled: closed with the connection, nothing to wait for.
            Reuse::No => true,
            Reuse::Draining => false,
            Reuse::Ready if !idle => false,
            Reuse::Ready => {
                let Some(mut up) = conn.up.take() else {
                    return true;
                };
                let kept = Kept {
                    fd: up.fd(),
                    tls: up.tls.take(),
                };
                self.io
                    .release_upstream(kept, Reuse::Ready, Outcome::Completed);
                true
            }
        }
    }

    /// The source ended while a receive with the turn's (long) deadline is still armed on a
    /// connection kept for reuse: that receive is cancelled, so that closing the turn waits
    /// at most for the drain's deadline (a drain arms a new one), not for the stall deadline.
    pub(in crate::dataplane) fn up_stop_reading(&mut self) {
        let conn = &mut *self.conn;
        let Some(up) = conn.up.as_mut() else {
            return;
        };
        let Some(target) = up.recv_op.filter(|_| up.reuse != Reuse::No) else {
            return;
        };
        up.recv_stopped = true;
        let e = opcode::AsyncCancel::new(target).build();
        // A failed submission leaves the receive to its deadline.
        let _ = self.submit(OpKind::Cancel, OpBuf::None, e);
    }

    /// The request's pooled connection failed before any response byte: when nothing reached
    /// the client yet, send the request again on a new connection. Returns whether it did.
    pub(in crate::dataplane) fn up_retry(&mut self) -> io::Result<bool> {
        let shared = Arc::clone(&self.io.shared);
        let conn = &mut *self.conn;
        let client_got_bytes = shared.table.slot(conn.id.slot).headers_sent.load(SeqCst);
        let Some(up) = conn.up.as_mut() else {
            return Ok(false);
        };
        let idle_socket = up.connect_op.is_none() && up.send_op.is_none() && up.recv_op.is_none();
        if !up.reused
            || up.retried
            || up.finished
            || up.received > 0
            || up.request.is_empty()
            || !idle_socket
            || conn.closing
            || client_got_bytes
        {
            return Ok(false);
        }
        let Some(Ok(addr)) = shared.upstream_health.as_ref().map(|h| h.addr()) else {
            return Ok(false);
        };
        let Ok(fd) = upstream_socket(addr) else {
            return Ok(false);
        };
        // SAFETY: no operation is in flight on the broken socket (checked above; this is
        // the completion of its last one), and nothing else holds its descriptor.
        unsafe { libc::close(up.fd) };
        up.fd = fd;
        // The new connection gets a new TLS session (`on_up_connect`).
        up.tls = None;
        up.reused = false;
        up.retried = true;
        up.wbuf = std::mem::take(&mut up.request);
        let pool = &shared.metrics.upstream.pool;
        pool.discarded(DiscardReason::Broken);
        pool.retried.inc();
        tracing::debug!(stream_id = %conn.id, "pooled upstream connection was closed; retrying on a new one");
        self.up_connect(Some(addr))?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::upstream_io::{Purpose, UpstreamRequest};

    /// An exchange whose response head and first chunk were read, ended by the turn.
    fn ended(head: &str) -> Upstream {
        let req = UpstreamRequest {
            purpose: Purpose::Turn,
            api_path: "/v1/chat/completions",
            method: "POST",
            authorization: None,
            body: None,
        };
        // No socket: `discard`'s shutdown of -1 fails harmlessly.
        let mut up = Upstream::new(-1, &req, Vec::new(), String::new());
        let mut body = Vec::new();
        up.reader.feed(head.as_bytes(), &mut body).expect("head");
        up.finish_exchange();
        up
    }

    const CHUNKED: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\ne\r\ndata: [DONE]\n\n\r\n";

    fn bytes(up: &mut Upstream, b: &[u8]) -> i32 {
        up.rbuf = Some(b.to_vec());
        b.len() as i32
    }

    #[test]
    fn a_drained_terminator_makes_the_connection_reusable() {
        let mut up = ended(CHUNKED);
        assert_eq!(up.reuse, Reuse::Draining);
        let n = bytes(&mut up, b"0\r\n");
        assert!(up.take_after_end(n), "half a terminator: read on");
        let n = bytes(&mut up, b"\r\n");
        assert!(!up.take_after_end(n));
        assert_eq!(up.reuse, Reuse::Ready);
    }

    #[test]
    fn anything_but_a_clean_end_is_not_reusable() {
        // Bytes after the body's end.
        let mut up = ended(CHUNKED);
        let n = bytes(&mut up, b"0\r\n\r\nHTTP/1.1");
        assert!(!up.take_after_end(n));
        assert_eq!(up.reuse, Reuse::No);
        // EOF, or the drain's deadline, before the terminator.
        for res in [0, -libc::ECANCELED, -libc::ECONNRESET] {
            let mut up = ended(CHUNKED);
            assert!(!up.take_after_end(res));
            assert_eq!(up.reuse, Reuse::No, "{res}");
        }
        // The upstream said `connection: close`.
        let up = ended(&CHUNKED.replace("chunked\r\n", "chunked\r\nconnection: close\r\n"));
        assert_eq!(up.reuse, Reuse::No);
        // A complete body, then stray bytes or EOF on a receive still armed.
        for res in [0, 3] {
            let mut up = ended(&format!("{CHUNKED}0\r\n\r\n"));
            assert_eq!(up.reuse, Reuse::Ready);
            up.rbuf = Some(b"abc".to_vec());
            assert!(!up.take_after_end(res));
            assert_eq!(up.reuse, Reuse::No, "{res}");
        }
    }

    #[test]
    fn a_receive_stopped_at_the_end_of_the_text_is_not_a_failure() {
        let mut up = ended(&format!("{CHUNKED}0\r\n\r\n"));
        up.recv_stopped = true;
        assert!(!up.take_after_end(-libc::ECANCELED));
        assert_eq!(up.reuse, Reuse::Ready);
        // Draining: the stopped receive is replaced by one with the drain's deadline.
        let mut up = ended(CHUNKED);
        up.recv_stopped = true;
        assert!(up.take_after_end(-libc::ECANCELED));
        assert_eq!(up.reuse, Reuse::Draining);
    }
}
