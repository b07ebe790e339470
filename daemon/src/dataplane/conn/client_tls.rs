//! TLS on client connections (`--tls-cert`), on the same io_uring as everything else: the
//! connection's session (`client_tls::ClientTls`, rustls sans I/O) sits between the ring's
//! buffers and the HTTP side, with no blocking call and no extra thread, as the upstream's does
//! (`upstream_io/tls.rs`).
//!
//! - **Receives** take ciphertext into the connection's own buffer; what it opens into is
//!   appended to the request buffer, and the HTTP side reads on as if it had come off the
//!   socket. The handshake rides on the request's deadline (`--request-timeout-ms` from
//!   accept). A failed handshake (or a bad record) ends that connection only, counted in
//!   `haltd_client_tls_handshake_failures_total`.
//! - **Sends** carry records: the handshake's flights as they are, every frame sealed into
//!   records and sent in one send. A frame is counted in the slot's frame window at its length
//!   on the wire (`emit.rs` `Conn::count_frame`), and sealed in the same hold of the session's lock,
//!   so a trip (which seals the terminal record under that lock, `halt.rs` `GateTrip`) always
//!   falls between two records: every record sealed before the terminal was counted before
//!   the trip and goes out before it, and no record is sealed for a frame the trip refused.
//! - **Close**: `close_notify` before every close haltd makes of a connection whose stream
//!   did not halt, sent on the ring behind what the client has not read yet
//!   ([`Step::say_close_notify`]); a halted stream's terminal frame carries it
//!   (`client_tls.rs` `seal_terminal`).

use std::{io, sync::Arc};

use crate::dataplane::conn::outbox::SendKind;
use crate::dataplane::Step;
use crate::{
    client_tls::{lock, Opened},
    stream::Outcome,
};

impl Step<'_> {
    /// A receive of a TLS connection brought `res` bytes of ciphertext in `cipher` (or ended):
    /// open them into the request buffer and read on as the HTTP side would; send what the
    /// session has to send (a handshake flight) first.
    pub(in crate::dataplane) fn on_tls_recv(
        &mut self,
        res: i32,
        cipher: Vec<u8>,
    ) -> io::Result<()> {
        let shared = Arc::clone(&self.io.shared);
        let conn = &mut *self.conn;
        let Some(tls) = conn.tls.clone() else {
            return Ok(());
        };
        let Ok(n @ 1..) = usize::try_from(res) else {
            conn.tls_in = Some(cipher);
            return self.on_recv(res);
        };
        if conn.closing {
            conn.tls_in = Some(cipher);
            return Ok(());
        }
        let mut out = conn.tls_out.take().unwrap_or_default();
        out.clear();
        let (opened, was_handshaking) = {
            let mut session = lock(&tls);
            let was = session.is_handshaking();
            let opened = session.open(&cipher[..n.min(cipher.len())], false);
            if let Ok(Opened::Data(len)) = opened {
                let rbuf = conn.rbuf.get_or_insert_with(Vec::new);
                rbuf.extend_from_slice(&session.plain_mut()[..len]);
            }
            session.pending(&mut out);
            if was && !session.is_handshaking() && opened.is_ok() {
                shared.metrics.dataplane.client_tls_handshakes.inc();
            }
            (opened, was)
        };
        conn.tls_in = Some(cipher);
        let opened = match opened {
            Ok(o) => o,
            Err(e) => {
                conn.tls_out = Some(out);
                if was_handshaking {
                    shared.metrics.dataplane.client_tls_handshake_failures.inc();
                }
                tracing::debug!(stream_id = %conn.id, error = %e, handshake = was_handshaking, "client TLS failed; closing its connection");
                conn.outcome = Outcome::ClientGone;
                self.begin_close();
                return Ok(());
            }
        };
        conn.tls_plain_ready = match opened {
            Opened::Data(len) => Some(len),
            Opened::Eof { .. } => Some(0),
            Opened::Nothing => None,
        };
        if out.is_empty() {
            conn.tls_out = Some(out);
            return self.tls_read_on();
        }
        // A handshake flight: counted like any frame the gate sees, sent as it is.
        let slot = shared.table.slot(conn.id.slot);
        if !slot.begin_frame(0, false, out.len()) {
            conn.tls_out = Some(out);
            return self.halt();
        }
        conn.sealed = Some(out);
        self.send(SendKind::Handshake)
    }

    /// After a receive was opened (and its flight sent): the plaintext goes to the HTTP side,
    /// or another receive is armed.
    pub(in crate::dataplane) fn tls_read_on(&mut self) -> io::Result<()> {
        match self.conn.tls_plain_ready.take() {
            Some(len) => self.on_recv(len as i32),
            None => self.arm_recv(),
        }
    }

    /// A client TLS connection that haltd closes says `close_notify` first, as one more send
    /// on the ring, so that it queues behind whatever the client has not read yet and the
    /// close waits for it (a non-blocking send would fail on a full socket, and the client
    /// would see a bare EOF): after a completed turn, an error reply, an idle kept connection,
    /// the last turn of a connection, a drain. Not after a halt (the terminal frame carried
    /// it, inside the gate's terminal allowance), nor to a client that left, nor on a cut
    /// connection, nor during the handshake. Returns whether the send is in flight (the close
    /// goes on at its completion); decided once per close.
    pub(in crate::dataplane) fn say_close_notify(&mut self) -> bool {
        let shared = Arc::clone(&self.io.shared);
        let conn = &mut *self.conn;
        let Some(tls) = conn.tls.clone() else {
            return false;
        };
        if conn.notified {
            return false;
        }
        conn.notified = true;
        let tripped = shared.table.slot(conn.id.slot).trip_cause().is_some();
        let left = matches!(
            conn.outcome,
            Outcome::Halted | Outcome::ClientGone | Outcome::ClientStalled
        );
        if tripped || left || conn.cut {
            return false;
        }
        let mut out = conn.tls_out.take().unwrap_or_default();
        {
            let mut session = lock(&tls);
            if session.is_handshaking() {
                conn.tls_out = Some(out);
                return false;
            }
            session.close_notify(&mut out);
        }
        if out.is_empty() {
            conn.tls_out = Some(out);
            return false;
        }
        conn.sealed = Some(out);
        match self.send(SendKind::CloseNotify) {
            Ok(()) => true,
            Err(e) => {
                // Not submitted: the close goes on without it.
                tracing::warn!(error = %e, "sending close_notify failed; closing without it");
                let conn = &mut *self.conn;
                conn.emit.abandon_send();
                shared
                    .table
                    .slot(conn.id.slot)
                    .send_inflight
                    .store(false, std::sync::atomic::Ordering::SeqCst);
                false
            }
        }
    }
}
