//! The end of a connection as its client sees it, and clients that stop reading.
//!
//! **Drain.** A client that reads slower than haltd writes (a phone on a weak network, a small
//! receive buffer) still has bytes waiting in its socket when its stream ends in haltd. If the
//! connection were closed then and its stream slot freed, the watchdog could go idle
//! (`pulse.rs`: no slot in use for a second), the kernel's heartbeat would age past its
//! deadline, and the egress check would latch a ceiling at the next unsent byte plus the
//! budget's allowance and hold the rest back for good: the client would never get the end of
//! its stream. So a closing connection whose socket holds bytes TCP has not transmitted yet
//! keeps its descriptor and its slot (the slot keeps the watchdog beating at its full rate)
//! until TCP has transmitted them all; only then is it closed and the slot freed. Bytes TCP
//! transmitted but the client has not acknowledged lie below the next unsent byte, inside any
//! ceiling the check could latch later, so their retransmissions pass whatever the heartbeat
//! does then. The check is a `TCP_INFO` read, at 2 ms after the drain began, then at doubling
//! intervals up to [`DRAIN_POLL_MAX`]. A draining client that takes nothing is cut (below):
//! after `--send-stall-timeout-ms`, or, for a halted stream, which is over, after 3 s (or the
//! watchdog's client window, 4 × `--halt-grace-ms`, if longer) from the drain's start or its
//! last acknowledged byte.
//!
//! **Stall.** A connection is *stalled* when bytes wait in its socket and the client
//! acknowledges none of them (`tcpi_bytes_acked` stands still) for `--send-stall-timeout-ms`.
//! A stalled connection is cut ([`Step::client_stalled`]): a stream still open halts with
//! `CLIENT_STALLED` (recorded and counted like any halt; it degrades nobody), the connection is
//! reset (`SO_LINGER 0`, nothing of it lingers) and its slot is freed. A client that opens
//! streams and never reads them thus holds a slot for at most the timeout plus two scan
//! periods, not for good. Every connection past its request phase is looked at, whether or not
//! a send of it waits (a paced stream's sends complete into the socket buffer for a long while
//! after its client stopped reading): one `TCP_INFO` read per connection per [`scan_period`]
//! (a second at the default timeout), never per token. Draining connections are looked at at
//! each drain check.
//!
//! **The tick.** Two timers per worker: the scan ([`OpKind::Tick`]), armed while the worker has
//! a connection, and the drain checks ([`OpKind::DrainTick`]), armed while a connection
//! drains. A worker without connections wakes for neither.

use std::{io, os::fd::BorrowedFd, sync::Arc, time::Duration};

use io_uring::{opcode, types};

use crate::dataplane::turn::own_trip;
use crate::dataplane::{
    driver::op::{OpBuf, OpKind, Owner},
    timespec, Conn, ConnTag, Io, Step,
};
use crate::{
    clock::monotonic_ns,
    codes::FailureCode,
    gate::held::SendQueue,
    metrics::dataplane::StallPhase,
    stream::{Initiator, Outcome},
};

/// The first drain check comes this long after the drain began; each later one twice as long
/// after the last, up to [`DRAIN_POLL_MAX`].
const DRAIN_POLL_MIN: Duration = Duration::from_millis(2);
/// The longest wait between two checks of a draining connection: how late, at most, its FIN
/// follows its last byte.
const DRAIN_POLL_MAX: Duration = Duration::from_millis(64);

/// How long the client of a halted stream's drain may take nothing, at least: the stream is
/// over, its slot held only for its last bytes. Longer than the watchdog's client window
/// (`watchdog/waits.rs`): TCP itself can go a second or two without a byte to an honest slow
/// client (a zero window waits for the client's window update, or for the persist timer's
/// probe, which backs off from 200 ms).
const HALTED_DRAIN_STALL: Duration = Duration::from_secs(3);

/// How often the connections are looked at: 1/32 of the stall timeout, between 10 ms and 1 s.
/// A stall is seen at most two periods after the timeout ran out.
pub(in crate::dataplane) fn scan_period(stall_timeout: Duration) -> Duration {
    (stall_timeout / 32).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// A client's progress at taking its bytes, as the checks saw it.
#[derive(Debug, Default, Clone, Copy)]
pub(in crate::dataplane) struct StallWatch {
    /// `tcpi_bytes_acked` at the last check that saw it move.
    acked: u64,
    /// When that check was (0: never looked at).
    since_ns: u64,
    /// The scan that last looked at the connection (a connection not looked at in the
    /// previous scan, because it was reading a request, starts afresh).
    scan: u32,
}

impl StallWatch {
    /// Notes the socket's `queue` at `now`; whether the client has taken none of its bytes for
    /// `timeout_ns`.
    fn stalled(&mut self, queue: SendQueue, now: u64, timeout_ns: u64) -> bool {
        if self.since_ns == 0 || queue.acked != self.acked || queue.queued() == 0 {
            self.acked = queue.acked;
            self.since_ns = now;
            return false;
        }
        now.saturating_sub(self.since_ns) >= timeout_ns
    }
}

/// A connection waiting for its client to take the bytes still unsent: when it is checked
/// next. (Its client's progress is the connection's own [`StallWatch`], which the scans kept
/// until the drain began.)
#[derive(Debug, Clone, Copy)]
pub(in crate::dataplane) struct Drain {
    next_ns: u64,
    every_ns: u64,
    /// How long the client may take nothing before it is cut: `--send-stall-timeout-ms`, or,
    /// for a halted stream, [`HALTED_DRAIN_STALL`] from the drain's start.
    stall_ns: u64,
}

/// One of the tick's timers: its duration (handed to the kernel while armed) and whether it
/// is armed.
#[derive(Debug, Default)]
struct Timer {
    ts: Option<Box<types::Timespec>>,
    armed: bool,
}

/// The worker's tick: the scan timer with the scans of sends in flight, the drain timer with
/// the draining connections.
#[derive(Debug, Default)]
pub(in crate::dataplane) struct Tick {
    scan_timer: Timer,
    drain_timer: Timer,
    /// Scans so far.
    scans: u32,
    /// Draining connections, by key and serial (the driver walks them, `driver/ticks.rs`).
    pub(in crate::dataplane) draining: Vec<ConnTag>,
    /// The stalled connections of a scan, by key and serial; reused between scans.
    pub(in crate::dataplane) stalled: Vec<ConnTag>,
}

/// The send queue of `fd`, if it can be read.
fn queue_of(fd: std::os::fd::RawFd) -> Option<SendQueue> {
    // SAFETY: callers pass a connection's open socket; it is closed only after they return.
    SendQueue::of(unsafe { BorrowedFd::borrow_raw(fd) })
}

/// What a drain check found (`Conn::check_drain`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::dataplane) enum DrainCheck {
    /// The connection does not drain (any more): it leaves the list.
    NotDraining,
    /// Not due yet, or bytes still wait and the client takes them: looked at again later.
    Pending,
    /// TCP has transmitted every byte: the connection closes, gracefully.
    Sent,
    /// The client took nothing for its stall timeout: the connection is cut.
    Stalled,
}

impl Conn {
    /// The `scan`-th look at this connection's sends: whether its client has taken none of
    /// its queued bytes for `timeout_ns`. Connections reading a request, draining (their own
    /// checks) or cut are not looked at; one not looked at in the previous scan starts its
    /// wait now.
    pub(in crate::dataplane) fn send_stalled(
        &mut self,
        scan: u32,
        now: u64,
        timeout_ns: u64,
    ) -> bool {
        if self.reading || self.drain.is_some() || self.cut {
            return false;
        }
        if self.stall.scan != scan.wrapping_sub(1) {
            self.stall = StallWatch::default();
        }
        self.stall.scan = scan;
        queue_of(self.fd).is_some_and(|q| self.stall.stalled(q, now, timeout_ns))
    }

    /// The drain check of this connection at `now` (module doc): the next check doubles its
    /// interval while bytes wait and the client takes them.
    pub(in crate::dataplane) fn check_drain(&mut self, now: u64) -> DrainCheck {
        let Some(d) = self.drain.as_mut() else {
            return DrainCheck::NotDraining;
        };
        if now < d.next_ns {
            return DrainCheck::Pending;
        }
        let queue = queue_of(self.fd);
        let stalled = queue.is_some_and(|q| self.stall.stalled(q, now, d.stall_ns));
        if queue.is_some_and(|q| q.unsent() > 0) && !stalled {
            d.every_ns = (d.every_ns * 2).min(DRAIN_POLL_MAX.as_nanos() as u64);
            d.next_ns = now + d.every_ns;
            return DrainCheck::Pending;
        }
        if stalled {
            DrainCheck::Stalled
        } else {
            DrainCheck::Sent
        }
    }

    /// When this connection's next drain check is due, if it drains.
    pub(in crate::dataplane) fn drain_due(&self) -> Option<u64> {
        self.drain.as_ref().map(|d| d.next_ns)
    }

    /// At shutdown, once the drain timeout ran out: a connection still draining is cut
    /// (reset), so that no client waits on a socket haltd no longer watches. Whether it was
    /// draining.
    pub(in crate::dataplane) fn cut_for_exit(&mut self) -> bool {
        if self.drain.is_none() {
            return false;
        }
        self.cut = true;
        // SAFETY: the connection's open socket.
        let sock = unsafe { BorrowedFd::borrow_raw(self.fd) };
        let _ = crate::gate::selftest::set_linger_zero(&sock);
        true
    }
}

impl Io {
    /// The scan timer fired with `ts` (kept for the next arming): the scan's number and the
    /// stall timeout in nanoseconds.
    pub(in crate::dataplane) fn scan_fired(&mut self, ts: Box<types::Timespec>) -> (u32, u64) {
        self.tick.scan_timer.ts = Some(ts);
        self.tick.scan_timer.armed = false;
        let scan = self.tick.scans;
        self.tick.scans = scan.wrapping_add(1);
        (scan, self.shared.cfg.send_stall_timeout.as_nanos() as u64)
    }

    /// The drain timer fired with `ts` (kept for the next arming).
    pub(in crate::dataplane) fn drain_fired(&mut self, ts: Box<types::Timespec>) {
        self.tick.drain_timer.ts = Some(ts);
        self.tick.drain_timer.armed = false;
    }

    /// Submits `timer` to fire after `wait` as an operation of `kind`.
    fn arm_timer(&mut self, kind: OpKind, wait: Duration) -> io::Result<()> {
        let timer = match kind {
            OpKind::DrainTick => &mut self.tick.drain_timer,
            _ => &mut self.tick.scan_timer,
        };
        if timer.armed {
            return Ok(());
        }
        let mut ts = timer.ts.take().unwrap_or_else(|| Box::new(timespec(wait)));
        *ts = timespec(wait);
        let e = opcode::Timeout::new(&raw const *ts).build();
        self.submit(Owner::Worker, kind, OpBuf::Time(ts), e)?;
        match kind {
            OpKind::DrainTick => self.tick.drain_timer.armed = true,
            _ => self.tick.scan_timer.armed = true,
        }
        Ok(())
    }

    /// Arms the scan unless it is armed (a connection was just accepted).
    pub(in crate::dataplane) fn arm_scan(&mut self) -> io::Result<()> {
        let period = scan_period(self.shared.cfg.send_stall_timeout);
        self.arm_timer(OpKind::Tick, period)
    }

    /// Arms the drain timer, unless it is armed, to fire at `due` (nanoseconds, monotonic).
    pub(in crate::dataplane) fn arm_drain_due(&mut self, now: u64, due: u64) -> io::Result<()> {
        let wait = Duration::from_nanos(due.saturating_sub(now)).max(Duration::from_millis(1));
        self.arm_timer(OpKind::DrainTick, wait)
    }
}

impl Step<'_> {
    /// Starts the drain of a closing connection whose socket still holds bytes TCP has not
    /// transmitted; returns whether it drains (the caller leaves it open). A connection that
    /// is already draining stays so.
    pub(in crate::dataplane) fn drain_first(&mut self) -> bool {
        let conn = &mut *self.conn;
        if conn.drain.is_some() {
            return true;
        }
        if conn.cut {
            return false;
        }
        let Some(q) = queue_of(conn.fd) else {
            return false;
        };
        if q.unsent() == 0 {
            return false;
        }
        let now = monotonic_ns();
        let every = DRAIN_POLL_MIN.as_nanos() as u64;
        let halted = self
            .io
            .shared
            .table
            .slot(conn.id.slot)
            .trip_cause()
            .is_some();
        let stall = if halted {
            // A halted stream is over: its client keeps the slot only while it takes its last
            // bytes (the terminal among them), a byte at least every HALTED_DRAIN_STALL (or the
            // watchdog's client window, if longer), counted from now; one that takes nothing is
            // reset.
            conn.stall = StallWatch::default();
            crate::watchdog::waits::client_window(self.io.shared.cfg.halt_grace)
                .max(HALTED_DRAIN_STALL)
        } else {
            // The client's clock goes on from the scans: a client that stopped reading before
            // its stream ended is not given the timeout afresh.
            self.io.shared.cfg.send_stall_timeout
        };
        conn.stall.stalled(q, now, u64::MAX);
        conn.drain = Some(Drain {
            next_ns: now + every,
            every_ns: every,
            stall_ns: stall.as_nanos() as u64,
        });
        // An armed drain timer fires within DRAIN_POLL_MAX: this check waits for it.
        if let Err(e) = self.io.arm_drain_due(now, now + every) {
            tracing::error!(error = %e, "arming the drain check failed; closing at once");
            conn.drain = None;
            return false;
        }
        self.io.tick.draining.push(self.tag());
        self.io.shared.metrics.dataplane.connections_draining.inc();
        true
    }

    /// The client of `key` stopped reading (module doc): its open stream halts with
    /// `CLIENT_STALLED`, and the connection is reset (`SO_LINGER 0`), which frees its slot
    /// once nothing is in flight: the send waiting on the client fails at once, because the
    /// socket is shut down here.
    pub(in crate::dataplane) fn client_stalled(&mut self, phase: StallPhase) {
        let shared = Arc::clone(&self.io.shared);
        let conn = &mut *self.conn;
        if conn.cut {
            return;
        }
        conn.cut = true;
        let queued = queue_of(conn.fd).map_or(0, |q| q.queued());
        shared.metrics.dataplane.client_stalled(phase);
        tracing::warn!(
            stream_id = %conn.id,
            peer = ?conn.peer,
            queued_bytes = queued,
            phase = phase.as_str(),
            timeout_ms = shared.cfg.send_stall_timeout.as_millis() as u64,
            "the client took none of its queued bytes for --send-stall-timeout-ms: resetting its connection"
        );
        // SAFETY: the connection's open socket (it is closed only by `Io::closed`).
        let sock = unsafe { BorrowedFd::borrow_raw(conn.fd) };
        let _ = crate::gate::selftest::set_linger_zero(&sock);
        if matches!(conn.outcome, Outcome::Open | Outcome::Completed) {
            conn.outcome = Outcome::ClientStalled;
        }
        if phase == StallPhase::Drain {
            // The driver ends the drain (`end_drain`), which closes the connection.
            return;
        }
        // A stream still open halts (its incident, metrics, the log); one that ended, or is
        // halting already, is only cut.
        // Whatever the answer (tripped now, halting already, ended), the socket is cut below.
        own_trip::trip_own(
            &shared,
            conn.id,
            FailureCode::ClientStalled,
            Initiator::Client,
        );
        // SAFETY: as above. Shutting the socket down ends the send waiting on the client
        // (it fails with EPIPE) and whatever else waits on it; the close follows from there.
        unsafe { libc::shutdown(conn.fd, libc::SHUT_RDWR) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn q(acked: u64, end: u64) -> SendQueue {
        SendQueue {
            acked,
            end,
            next_unsent: end,
        }
    }

    #[test]
    fn a_client_that_acknowledges_nothing_for_the_timeout_is_stalled() {
        let mut w = StallWatch::default();
        assert!(!w.stalled(q(100, 500), 10 * MS, 1_000 * MS), "first look");
        assert!(!w.stalled(q(100, 500), 900 * MS, 1_000 * MS));
        assert!(w.stalled(q(100, 500), 1_010 * MS, 1_000 * MS));
    }

    #[test]
    fn progress_or_an_empty_queue_restarts_the_clock() {
        let mut w = StallWatch::default();
        w.stalled(q(100, 500), 0, 1_000 * MS);
        assert!(
            !w.stalled(q(101, 500), 999 * MS, 1_000 * MS),
            "one byte acked"
        );
        assert!(!w.stalled(q(101, 500), 1_500 * MS, 1_000 * MS));
        assert!(w.stalled(q(101, 500), 2_000 * MS, 1_000 * MS));
        // Nothing queued: nothing to take, whatever the time.
        let mut w = StallWatch::default();
        w.stalled(q(500, 500), 0, 1_000 * MS);
        assert!(!w.stalled(q(500, 500), 5_000 * MS, 1_000 * MS));
    }

    #[test]
    fn the_scan_period_is_a_thirty_second_of_the_timeout_within_bounds() {
        let ms = Duration::from_millis;
        assert_eq!(scan_period(ms(60_000)), ms(1_000));
        assert_eq!(
            scan_period(ms(30_000)),
            ms(937) + Duration::from_micros(500)
        );
        assert_eq!(scan_period(ms(3_200)), ms(100));
        assert_eq!(scan_period(ms(100)), ms(10));
    }
}
