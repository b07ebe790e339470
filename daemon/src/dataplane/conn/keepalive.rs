//! HTTP keep-alive for clients: after a turn that ended normally, a connection whose client
//! asked for it (`connection: keep-alive`) reads its next request, up to
//! `--max-turns-per-conn` turns, each waited for at most `--client-idle-timeout-ms`.
//!
//! Each turn is its own stream: a new slot with a new generation (a new stream id), and a
//! new kernel policy (untripped, budget 0, the new stream's tag) written before the next
//! request is read, exactly as at accept; the turn's own policy follows at turn start. No
//! moment of a kept connection is without a policy of its current stream. The gate counts
//! frames and bytes per socket, over all its turns, so the new stream's counters start
//! where the socket's stand ([`SentBefore`]): a later trip's `F` and `S(F)` are absolute, as
//! the gate's limit and egress ceiling need.
//!
//! A connection is kept only when nothing ever tripped on it: its turn completed, and the
//! gate's state for the socket shows no trip, drop, latched ceiling or terminal frame. A
//! turn that tripped closes the connection after its terminal event (fail closed), as does
//! anything the gate's state cannot confirm.
//!
//! Pipelined requests are answered in order: bytes after a request's body are kept as the
//! start of the next request, which is read only once this turn ended.

use std::{io, sync::atomic::Ordering::SeqCst, sync::Arc};

use haltd_common::SockPolicy;

use crate::dataplane::conn::{refusal_error, Conn, KeepAlive};
use crate::dataplane::turn::own_trip;
use crate::dataplane::upstream_io::pool;
use crate::dataplane::Step;
use crate::{
    admission::Refusal,
    clock::monotonic_ns,
    codes::FailureCode,
    gate::SocketView,
    metrics::dataplane::KeepAliveClose,
    stream::{Initiator, Outcome, SentBefore},
    wire::RequestHead,
};

/// The socket's frame count if the gate never saw anything tripped on it, else `None`.
fn never_tripped(view: &SocketView) -> Option<u64> {
    let st = view.state?;
    let policy_untripped = view.policy.is_some_and(|p| p.tripped == 0);
    let egress_clean = view
        .egress
        .is_none_or(|e| e.latched_ceiling == 0 && e.dropped_segments == 0);
    let send_clean = st.stale_frame_limit == 0
        && st.dropped == 0
        && st.terminal_sent == 0
        && st.trip_reason == 0
        && st.post_trip_frames == 0;
    (policy_untripped && egress_clean && send_clean).then_some(st.frames)
}

impl Conn {
    /// A kept connection waiting for its next request (no turn, not closing).
    pub(in crate::dataplane) fn idle_kept(&self) -> bool {
        self.idle_since_ns.is_some() && !self.closing && self.turn.is_none()
    }
}

impl Step<'_> {
    /// The request's head is read: decide whether its turn keeps the connection.
    pub(in crate::dataplane) fn choose_keep_alive(&mut self, head: &RequestHead) {
        let max_turns = self.io.shared.cfg.args.max_turns_per_conn;
        let conn = &mut *self.conn;
        conn.keep = KeepAlive::decide(head.keep_alive, conn.turns, max_turns);
        // A kept streaming response is chunked, its terminal frame too.
        let slot = self.io.shared.table.slot(conn.id.slot);
        slot.chunked.store(conn.keep == KeepAlive::Keep, SeqCst);
    }

    /// Called once the turn's stream is out of reach of trips and nothing is in flight:
    /// if the turn completed and keeps the connection, moves the connection to a new stream
    /// and reads the next request. Returns false when the connection is to close instead
    /// (the caller closes it as it would have).
    pub(in crate::dataplane) fn next_turn(&mut self) -> bool {
        let shared = Arc::clone(&self.io.shared);
        let conn = &*self.conn;
        if conn.outcome != Outcome::Completed || shared.shutting_down.load(SeqCst) {
            return false;
        }
        if shared.draining.load(SeqCst) && conn.keep == KeepAlive::Keep {
            // Draining: the connection is not kept for a request that would only get 503.
            shared
                .metrics
                .dataplane
                .keepalive_closed(KeepAliveClose::Drain);
            return false;
        }
        match conn.keep {
            KeepAlive::Close => return false,
            KeepAlive::LastTurn => {
                shared
                    .metrics
                    .dataplane
                    .keepalive_closed(KeepAliveClose::MaxTurns);
                return false;
            }
            KeepAlive::Keep => {}
        }
        let old = conn.id;
        let slot = shared.table.slot(old.slot);
        let mut before = SentBefore {
            frames: slot.frames_submitted.load(SeqCst),
            bytes: slot.bytes_submitted.load(SeqCst),
        };
        // SAFETY: the connection's socket, open until the connection is dropped.
        let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(conn.fd) };
        if let Some(gate) = &shared.gate {
            match gate.socket(sock).ok().as_ref().and_then(never_tripped) {
                // The gate may have counted more runs than frames (short writes): its count.
                Some(frames) => before.frames = before.frames.max(frames),
                None => return false,
            }
        }
        let budget = shared.cfg.args.budget;
        let Some(id) =
            shared
                .table
                .alloc_after(self.io.id, conn.fd, budget, monotonic_ns(), before)
        else {
            return false;
        };
        *shared.meta(id.slot) = crate::halt::TurnMeta::for_connection(conn.tls.clone());
        let mut governed = Ok(());
        if let Some(gate) = &shared.gate {
            let policy = SockPolicy {
                stream_tag: crate::halt::stream_tag(id),
                ..SockPolicy::default()
            };
            // In the frame window, so a trip of the new stream is never overwritten.
            shared
                .table
                .slot(id.slot)
                .while_untripped(|| governed = gate.set_policy(sock, &policy));
        }
        self.io.summarize(&*self.conn);
        self.io.record_turn(&*self.conn);
        if let Some(mut up) = self.conn.up.take() {
            // Nothing is in flight on the upstream socket (its operations were the turn's).
            let kept = pool::Kept {
                fd: up.fd(),
                tls: up.tls.take(),
            };
            self.io.release_upstream(kept, up.reuse, Outcome::Completed);
        }
        shared.table.release(old);
        self.reset_for_next(id);
        if let Err(e) = governed {
            // The new stream cannot be governed: it trips and closes without serving (fail
            // closed), as a turn whose policy write failed does.
            shared.metrics.gate.errors.inc();
            tracing::error!(stream_id = %id, error = %e, "writing a kept connection's kernel policy failed; closing it");
            // The stream was never served: it closes whatever the table answers.
            own_trip::trip_own(&shared, id, FailureCode::WatchdogTrip, Initiator::Kernel);
            self.conn.outcome = Outcome::Halted;
            self.begin_close();
            return true;
        }
        if let Err(e) = self.read_next() {
            tracing::error!(error = %e, "reading a kept connection's next request failed");
            self.begin_close();
        }
        true
    }

    /// The connection's state for its next stream `id`, waiting for the next request.
    fn reset_for_next(&mut self, id: crate::wire::StreamId) {
        let conn = &mut *self.conn;
        conn.id = id;
        conn.turns += 1;
        conn.turn = None;
        conn.place = None;
        conn.client_key = None;
        conn.keep = KeepAlive::Close;
        conn.outcome = Outcome::Open;
        conn.closing = false;
        conn.continue_sent = false;
        conn.emit.reset_for_next_turn();
        conn.final_waits_upstream = false;
        conn.idle_since_ns = Some(monotonic_ns());
        conn.rbuf = Some(std::mem::take(&mut conn.pipelined));
        conn.request_id = None;
        conn.request_id_from_client = false;
        conn.traceparent = None;
        conn.surface_headers.clear();
        conn.route = crate::metrics::requests::Route::Other;
        conn.status = 0;
    }

    /// Reads the next request: at once if it was pipelined, else when its bytes arrive.
    fn read_next(&mut self) -> io::Result<()> {
        if self.conn.rbuf.as_ref().is_some_and(|b| !b.is_empty()) {
            if !self.request_begins()? {
                return Ok(());
            }
            return self.on_request_bytes();
        }
        self.arm_recv()
    }

    /// The first byte of a kept connection's next request arrived: the request deadline
    /// starts now, and the connection takes its place in the request phase again (refused
    /// with 503 when the phase is full). Returns whether the request is to be read.
    pub(in crate::dataplane) fn request_begins(&mut self) -> io::Result<bool> {
        let shared = Arc::clone(&self.io.shared);
        let conn = &mut *self.conn;
        conn.idle_since_ns = None;
        let now = monotonic_ns();
        conn.accepted_ns = now;
        let slot = shared.table.slot(conn.id.slot);
        slot.started_ns.store(now, SeqCst);
        slot.started_unix_ms
            .store(crate::clock::unix_ms_now(), SeqCst);
        shared.metrics.dataplane.keepalive_turns.inc();
        if shared.admission.enter_request().is_err() {
            self.reply_error(&refusal_error(Refusal::RequestPhase))?;
            return Ok(false);
        }
        conn.reading = true;
        Ok(true)
    }

    /// No next request within `--client-idle-timeout-ms`: close the connection.
    pub(in crate::dataplane) fn idle_timed_out(&mut self) -> io::Result<()> {
        self.io
            .shared
            .metrics
            .dataplane
            .keepalive_closed(KeepAliveClose::IdleTimeout);
        self.begin_close();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::http::Persist;
    use haltd_common::{EgressState, SockState};

    #[test]
    fn only_a_request_that_asks_is_kept_and_the_last_turn_says_close() {
        assert_eq!(KeepAlive::decide(false, 1, 1000), KeepAlive::Close);
        assert_eq!(KeepAlive::decide(true, 1, 1000), KeepAlive::Keep);
        assert_eq!(KeepAlive::decide(true, 999, 1000), KeepAlive::Keep);
        assert_eq!(KeepAlive::decide(true, 1000, 1000), KeepAlive::LastTurn);
        assert_eq!(KeepAlive::decide(true, 1, 1), KeepAlive::LastTurn);
        assert_eq!(KeepAlive::LastTurn.persist(), Persist::Close);
        assert_eq!(KeepAlive::Keep.persist(), Persist::KeepAlive);
    }

    #[test]
    fn a_socket_is_reused_only_if_the_gate_never_saw_it_tripped() {
        let clean = SocketView {
            state: Some(SockState {
                frames: 7,
                adopted: 1,
                ..SockState::default()
            }),
            policy: Some(SockPolicy::default()),
            egress: Some(EgressState {
                passed_end: 900,
                ..EgressState::default()
            }),
        };
        assert_eq!(never_tripped(&clean), Some(7));
        let mut v = clean;
        v.state = None;
        assert_eq!(never_tripped(&v), None, "no state: not governed");
        let mut v = clean;
        v.policy = None;
        assert_eq!(
            never_tripped(&v),
            None,
            "no policy: the gate treats it as tripped"
        );
        let mut v = clean;
        v.policy = Some(SockPolicy {
            tripped: 1,
            ..SockPolicy::default()
        });
        assert_eq!(never_tripped(&v), None);
        for st in [
            SockState {
                stale_frame_limit: 3,
                ..SockState::default()
            },
            SockState {
                dropped: 1,
                ..SockState::default()
            },
            SockState {
                terminal_sent: 1,
                ..SockState::default()
            },
            SockState {
                trip_reason: 2,
                ..SockState::default()
            },
            SockState {
                post_trip_frames: 1,
                ..SockState::default()
            },
        ] {
            let mut v = clean;
            v.state = Some(st);
            assert_eq!(never_tripped(&v), None, "{st:?}");
        }
        for eg in [
            EgressState {
                latched_ceiling: 5,
                ..EgressState::default()
            },
            EgressState {
                dropped_segments: 1,
                ..EgressState::default()
            },
        ] {
            let mut v = clean;
            v.egress = Some(eg);
            assert_eq!(never_tripped(&v), None, "{eg:?}");
        }
    }
}
