//! The kernel gate's policy of a turn ([`Step::arm_turn_policy`]): its budget and the
//! largest token event it can write, given to the gate before the turn's first frame.

use std::sync::{atomic::Ordering::SeqCst, Arc};

use haltd_common::SockPolicy;

use crate::dataplane::turn::own_trip;
use crate::dataplane::Step;
use crate::{codes::FailureCode, stream::Initiator, wire::http};

impl Step<'_> {
    /// Gives the kernel gate the turn's own policy, before the turn's first frame: its
    /// budget (0 for batch and degraded turns, as in userspace) and E, the largest token
    /// event its encoder can write, which bounds every post-trip frame and the post-trip
    /// bytes. Written in the frame window so it can never overwrite a trip. Returns false if
    /// the turn cannot go on: the gate refused the write (the stream is tripped then, fail
    /// closed) or a trip came first.
    pub(in crate::dataplane) fn arm_turn_policy(&mut self) -> bool {
        let shared = Arc::clone(&self.io.shared);
        let conn = &*self.conn;
        let Some(turn) = conn.turn.as_ref() else {
            return false;
        };
        let slot = shared.table.slot(conn.id.slot);
        let max_event = turn.enc.max_event_bytes();
        // A chunked response's token frame is its event plus the chunk's framing.
        let max_event = if slot.chunked.load(SeqCst) {
            max_event + http::chunk_overhead(max_event)
        } else {
            max_event
        };
        // On TLS, the record it is sealed into (one record: far below 16 KiB).
        let max_event = match conn.tls.as_ref() {
            Some(tls) => {
                let sealed = crate::client_tls::lock(tls).sealed_len(max_event as usize);
                u32::try_from(sealed).unwrap_or(u32::MAX)
            }
            None => max_event,
        };
        slot.max_event_bytes.store(max_event, SeqCst);
        let Some(gate) = &shared.gate else {
            return !slot.is_tripped();
        };
        let policy = SockPolicy {
            budget: slot.budget.load(SeqCst),
            max_event_bytes: max_event,
            stream_tag: crate::halt::stream_tag(conn.id),
            ..SockPolicy::default()
        };
        // SAFETY: the connection's socket, open until the connection is dropped.
        let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(conn.fd) };
        let mut res = Ok(());
        if !slot.while_untripped(|| res = gate.set_policy(sock, &policy)) {
            return false;
        }
        if let Err(e) = res {
            shared.metrics.gate.errors.inc();
            tracing::error!(stream_id = %conn.id, error = %e, "writing the turn's kernel policy failed; halting the stream");
            // Tripped or not (an earlier trip stands; a finished stream sends nothing more),
            // the turn is not served.
            own_trip::trip_own(
                &shared,
                conn.id,
                FailureCode::WatchdogTrip,
                Initiator::Kernel,
            );
            return false;
        }
        true
    }
}
