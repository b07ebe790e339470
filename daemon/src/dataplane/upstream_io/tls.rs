//! TLS on the upstream socket of an `https://` upstream, on the same io_uring as everything
//! else: the connection's [`TlsLink`] (rustls, sans I/O) sits between the ring's buffers and
//! the HTTP reader. No blocking call and no extra thread: a receive's ciphertext is opened
//! into plaintext that replaces it in the receive buffer (the two buffers are swapped, both
//! reused), and what rustls has to send (the handshake's flights, the request's records, an
//! alert) goes out as an ordinary upstream send with its linked deadline.
//!
//! The handshake rides on the exchange's deadlines: each of its sends is bounded by
//! `--upstream-connect-timeout-ms` like the request's, and its receives by the time to the
//! first event (`--upstream-first-token-timeout-ms`), which counts from the request. The
//! request is queued in the session before the handshake and leaves right after it.
//!
//! A failed handshake or a bad record ends the exchange as `UPSTREAM_FAILURE` kind `tls`,
//! with rustls's error; the socket is shut down at once, nothing is sent in clear. A pooled
//! connection keeps its session ([`Kept`]): a reused one sends its request at once, with no
//! new handshake. `close_notify` from the upstream ends the response like a TCP close (and a
//! connection that got one while idle is not reused); haltd sends its own before closing a
//! connection that ended cleanly.

use std::{io, sync::Arc};

use crate::dataplane::upstream_io::exchange::Reuse;
use crate::dataplane::Step;
use crate::upstream::{tls::Opened, UpstreamFailureKind};

impl Step<'_> {
    /// The new connection is up: start its TLS session with the request queued behind the
    /// handshake, and send the ClientHello.
    pub(in crate::dataplane) fn up_tls_begin(&mut self, request: Vec<u8>) -> io::Result<()> {
        let shared = Arc::clone(&self.io.shared);
        let Some(tls) = shared.cfg.upstream_tls.as_ref() else {
            return self.up_send(request, 0);
        };
        let mut link = match tls.link() {
            Ok(l) => Box::new(l),
            Err(e) => {
                let msg = format!("starting TLS with the upstream: {e}");
                return self.up_fail(UpstreamFailureKind::Tls, msg, None);
            }
        };
        link.seal(&request);
        let hello = link.pending();
        if let Some(up) = self.conn.up.as_mut() {
            up.tls = Some(link);
        }
        match hello {
            Some(bytes) => self.up_send(bytes, 0),
            None => self.up_arm_recv(),
        }
    }

    /// Sends what the connection's TLS session has to send, unless a send is in flight (its
    /// completion flushes again). Returns whether a send was submitted.
    pub(in crate::dataplane) fn up_tls_flush(&mut self) -> io::Result<bool> {
        let Some(up) = self.conn.up.as_mut() else {
            return Ok(false);
        };
        if up.send_op.is_some() || (up.reuse == Reuse::No && up.finished) {
            return Ok(false);
        }
        let Some(bytes) = up.tls.as_mut().and_then(|t| t.pending()) else {
            return Ok(false);
        };
        self.up_send(bytes, 0)?;
        Ok(true)
    }

    /// A receive brought `res` bytes of ciphertext (0: the TCP stream ended): open them. The
    /// plaintext replaces them in the receive buffer and its length is returned for the HTTP
    /// side to read as if it had come off the socket; `None` when there is nothing for it (a
    /// handshake message, a ticket, half a record: a receive is armed again), or when the
    /// session failed (the exchange is ended, typed). A connection without TLS, a failed
    /// receive, and bytes nobody reads any more pass through unchanged.
    pub(in crate::dataplane) fn up_tls_open(&mut self, res: i32) -> io::Result<Option<i32>> {
        let shared = Arc::clone(&self.io.shared);
        let conn = &mut *self.conn;
        let closing = conn.closing;
        let Some(up) = conn.up.as_mut() else {
            return Ok(Some(res));
        };
        let unread = (closing && !up.finished) || (up.finished && up.reuse == Reuse::No);
        let (Some(link), Some(rbuf), false, Ok(n)) = (
            up.tls.as_mut(),
            up.rbuf.as_mut(),
            unread,
            usize::try_from(res),
        ) else {
            return Ok(Some(res));
        };
        let was_handshaking = link.is_handshaking();
        let opened = link.open(&rbuf[..n.min(rbuf.len())], n == 0);
        if was_handshaking && !link.is_handshaking() {
            shared.metrics.upstream.tls_handshakes.inc();
        }
        match opened {
            Ok(Opened::Data(len)) => {
                std::mem::swap(rbuf, link.plain_mut());
                self.up_tls_flush()?;
                Ok(Some(len as i32))
            }
            Ok(Opened::Eof { .. }) => {
                rbuf.clear();
                Ok(Some(0))
            }
            Ok(Opened::Nothing) => {
                self.up_tls_flush()?;
                self.up_arm_recv()?;
                Ok(None)
            }
            Err(e) if up.finished => {
                tracing::debug!(error = %e, "TLS error on an upstream connection after its exchange");
                up.discard();
                Ok(None)
            }
            Err(e) => {
                let when = if was_handshaking {
                    "TLS handshake with the upstream failed"
                } else {
                    "TLS with the upstream failed"
                };
                let msg = format!("{when}: {e}");
                self.up_fail(UpstreamFailureKind::Tls, msg, None)?;
                Ok(None)
            }
        }
    }

    /// Whether the upstream connection of `key` is still in its TLS handshake.
    pub(in crate::dataplane) fn up_tls_handshaking(&self) -> bool {
        self.conn
            .up
            .as_ref()
            .and_then(|u| u.tls.as_ref())
            .is_some_and(|t| t.is_handshaking())
    }
}
