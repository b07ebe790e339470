//! Whether the egress check holds bytes of a socket back for good, asked when haltd closes the
//! socket (`dataplane/conn.rs` `Step::finish_close`): a graceful close queues the FIN behind
//! the send queue, so a queue that reaches past the stream's ceiling would keep the FIN, and
//! the client, waiting for ever (FIN-WAIT-1 until TCP gives up, minutes later). Such a socket
//! is reset instead (`SO_LINGER 0`).
//!
//! Held bytes are not only those the check already dropped: a segment is judged only when TCP
//! transmits it, and a client that reads slowly (a closed window) keeps the end of the queue
//! from being judged until after the close. So the question is asked of the queue as it stands:
//! does it end past the ceiling in force (the trip's, or the one the check latched), or past
//! the one the check will latch at the next segment it judges because it sees the heartbeat
//! lost now (or the send check latched, or the socket has no policy): the next unsent byte
//! plus the stream's budget of token events (`decide::segment_verdict`)? Bytes up to the
//! ceiling leave, a halted stream's terminal frame included, so a close that resets nothing
//! deliverable stays graceful.

use std::os::fd::{AsRawFd as _, BorrowedFd};

use haltd_common::{decide, EgressState};

use super::KernelGate;

/// The kernel's `TCP_INFO` of socket `fd`; `None` if it cannot be read.
pub fn tcp_info(fd: std::os::fd::RawFd) -> Option<libc::tcp_info> {
    // SAFETY: a zeroed tcp_info is a valid value of the plain C struct.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `info`, a live tcp_info.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(info)
}

/// The socket's send queue as stream offsets (those of the egress check: bytes since the
/// connection began, `tcpi_bytes_acked` at `snd_una`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendQueue {
    /// The offset just past the last byte the client acknowledged (`tcpi_bytes_acked`).
    pub acked: u64,
    /// The offset just past the last byte written to the socket.
    pub end: u64,
    /// The offset of the next byte TCP has not transmitted yet (`snd_nxt`).
    pub next_unsent: u64,
}

/// TCP states (`tcpi_state`) in which the socket's own FIN is queued or sent but not yet
/// acknowledged: it takes a sequence number, which `SIOCOUTQ` and `tcpi_notsent_bytes` count
/// as if it were a byte.
const FIN_UNACKED: [u8; 3] = [
    4,  // TCP_FIN_WAIT1
    9,  // TCP_LAST_ACK
    11, // TCP_CLOSING
];

impl SendQueue {
    /// The queue of `sock` (`TCP_INFO` and `SIOCOUTQ`); `None` if either cannot be read. A
    /// FIN haltd queued (a socket it shut down) is not a byte of the stream: it is left out,
    /// so that a queue ending exactly at a ceiling is not taken for one past it.
    pub fn of(sock: BorrowedFd<'_>) -> Option<Self> {
        let fd = sock.as_raw_fd();
        let info = tcp_info(fd)?;
        let mut outq: libc::c_int = 0;
        // SAFETY: SIOCOUTQ writes one int (for TCP: write_seq − snd_una, the bytes not acked).
        if unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &raw mut outq) } != 0 {
            return None;
        }
        let outq = u64::try_from(outq).ok()?;
        let fin = FIN_UNACKED.contains(&info.tcpi_state) && outq > 0;
        Some(Self::from_counts(
            info.tcpi_bytes_acked,
            outq,
            u64::from(info.tcpi_notsent_bytes),
            fin,
        ))
    }

    /// The queue from the kernel's counts: bytes acknowledged, `SIOCOUTQ`, not sent, and
    /// whether a FIN of the socket is among them (counted by the kernel as one more byte).
    fn from_counts(acked: u64, outq: u64, notsent: u64, fin: bool) -> Self {
        let raw_end = acked.saturating_add(outq);
        let raw_next = raw_end.saturating_sub(notsent);
        if !fin {
            return SendQueue {
                acked,
                end: raw_end,
                next_unsent: raw_next,
            };
        }
        // The FIN is the last sequence number: unsent, it is counted in both; sent, only in
        // SIOCOUTQ.
        let end = raw_end - 1;
        SendQueue {
            acked,
            end,
            next_unsent: raw_next.min(end),
        }
    }

    /// Bytes written and not yet acknowledged by the client.
    pub fn queued(&self) -> u64 {
        self.end.saturating_sub(self.acked)
    }

    /// Bytes written that TCP has not transmitted yet.
    pub fn unsent(&self) -> u64 {
        self.end.saturating_sub(self.next_unsent)
    }
}

/// What [`holds_back`] judges: the socket's gate state and whether the gate sees the heartbeat
/// lost now.
#[derive(Debug, Clone, Copy)]
pub struct HeldInputs<'a> {
    pub egress: EgressState,
    pub policy: Option<&'a haltd_common::SockPolicy>,
    /// The send check latched its own frame limit (`stale_frame_limit != 0`).
    pub send_latched: bool,
    pub heartbeat_lost: bool,
}

/// Whether bytes of a socket with `queue` stay held back for good (module doc).
pub fn holds_back(inputs: &HeldInputs<'_>, queue: SendQueue) -> bool {
    let mut eg = inputs.egress;
    if eg.dropped_segments > 0 {
        return true;
    }
    if eg.latched_ceiling == 0
        && (inputs.heartbeat_lost || inputs.send_latched || inputs.policy.is_none())
    {
        // The latch the check will make at the next segment it judges, as it makes it.
        let allowance = inputs.policy.map_or(0, |p| {
            u64::from(p.budget).saturating_mul(u64::from(p.max_event_bytes))
        });
        eg.latched_ceiling = queue
            .next_unsent
            .saturating_add(allowance)
            .saturating_add(1);
    }
    queue.end > decide::egress_ceiling(&eg, inputs.policy)
}

impl KernelGate {
    /// Whether the egress check holds, or will hold, bytes of `sock` back for good (module
    /// doc). Reads the socket's gate state and queue: a few syscalls, on a close only.
    /// `heartbeat_lost` is asked only when the answer depends on it; the caller answers from
    /// the process's copy of the heartbeat (`HaltCore::heartbeat_fresh`), not from the kernel
    /// clock, whose program run shares a lock with the watchdog's beat (a worker preempted
    /// while holding it would delay the real-time watchdog). Anything it cannot read counts as
    /// not held (a graceful close).
    pub fn holds_back(&self, sock: BorrowedFd<'_>, heartbeat_lost: impl FnOnce() -> bool) -> bool {
        let Ok(view) = self.socket(sock) else {
            return false;
        };
        let Some(queue) = SendQueue::of(sock) else {
            return view.egress.is_some_and(|eg| eg.dropped_segments > 0);
        };
        let mut inputs = HeldInputs {
            egress: view.egress.unwrap_or_default(),
            policy: view.policy.as_ref(),
            send_latched: view.state.is_some_and(|s| s.stale_frame_limit != 0),
            heartbeat_lost: false,
        };
        if holds_back(&inputs, queue) {
            return true;
        }
        // A lost heartbeat only lowers the ceiling: ask only when that matters.
        inputs.heartbeat_lost = true;
        holds_back(&inputs, queue) && heartbeat_lost()
    }
}

#[cfg(test)]
mod tests {
    use haltd_common::SockPolicy;

    use super::*;

    fn tripped(ceiling: u64, budget: u32, e: u32) -> SockPolicy {
        SockPolicy {
            tripped: 1,
            budget,
            max_event_bytes: e,
            egress_ceiling: ceiling,
            ..SockPolicy::default()
        }
    }

    fn inputs<'a>(policy: Option<&'a SockPolicy>, heartbeat_lost: bool) -> HeldInputs<'a> {
        HeldInputs {
            egress: EgressState::default(),
            policy,
            send_latched: false,
            heartbeat_lost,
        }
    }

    #[test]
    fn a_queued_fin_is_no_byte_of_the_stream() {
        // 1,000 bytes written, 600 acked, 100 unsent, no FIN.
        let q = SendQueue::from_counts(600, 400, 100, false);
        assert_eq!((q.end, q.next_unsent), (1_000, 900));
        // The same after shutdown, the FIN unsent: both counts hold it.
        let q = SendQueue::from_counts(600, 401, 101, true);
        assert_eq!((q.end, q.next_unsent), (1_000, 900));
        // Every byte and the FIN sent, none of it acked.
        let q = SendQueue::from_counts(600, 401, 0, true);
        assert_eq!((q.end, q.next_unsent, q.unsent()), (1_000, 1_000, 0));
    }

    /// On a real socket: after `shutdown`, the queue still ends at the last byte written (the
    /// watchdog shuts down the sockets of the streams it halts; counting the FIN as a byte put
    /// a halted queue one byte past its ceiling, and reset the client).
    #[test]
    fn a_real_socket_shut_down_ends_its_queue_at_its_last_byte() {
        use std::io::Write as _;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let client =
            std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (mut server, _) = listener.accept().expect("accept");
        server.set_nonblocking(true).expect("nonblocking");
        let mut written = 0u64;
        let chunk = [7u8; 4096];
        // Fill the socket: the client does not read.
        while let Ok(n) = server.write(&chunk) {
            written += n as u64;
        }
        let before = SendQueue::of(std::os::fd::AsFd::as_fd(&server)).expect("queue");
        assert_eq!(before.end, written);
        server
            .shutdown(std::net::Shutdown::Write)
            .expect("shutdown");
        let after = SendQueue::of(std::os::fd::AsFd::as_fd(&server)).expect("queue");
        assert_eq!(after.end, written, "the FIN counted as a byte: {after:?}");
        assert!(after.next_unsent <= after.end);
        drop(client);
    }

    #[test]
    fn a_queue_within_the_trip_ceiling_closes_gracefully_and_one_past_it_is_reset() {
        let p = tripped(1_000, 5, 100);
        let within = SendQueue {
            acked: 0,
            end: 1_000,
            next_unsent: 600,
        };
        assert!(!holds_back(&inputs(Some(&p), false), within));
        let past = SendQueue {
            acked: 0,
            end: 1_001,
            next_unsent: 600,
        };
        assert!(holds_back(&inputs(Some(&p), false), past));
    }

    #[test]
    fn a_lost_heartbeat_holds_what_lies_past_the_next_unsent_byte_and_the_budget() {
        // Untripped, B = 2, E = 100: the check will latch at 600 + 200.
        let p = SockPolicy {
            budget: 2,
            max_event_bytes: 100,
            ..SockPolicy::default()
        };
        let q = |end| SendQueue {
            acked: 0,
            end,
            next_unsent: 600,
        };
        assert!(!holds_back(&inputs(Some(&p), true), q(800)));
        assert!(holds_back(&inputs(Some(&p), true), q(801)));
        // The same queue with a fresh heartbeat and no trip: nothing is held.
        assert!(!holds_back(&inputs(Some(&p), false), q(5_000)));
        // No policy: nothing more may leave.
        assert!(holds_back(&inputs(None, false), q(601)));
    }

    #[test]
    fn a_dropped_segment_or_an_existing_latch_decides() {
        let mut i = inputs(None, false);
        i.egress.dropped_segments = 1;
        let empty = SendQueue {
            acked: 0,
            end: 0,
            next_unsent: 0,
        };
        assert!(holds_back(&i, empty));
        let p = tripped(u64::MAX, 0, 100);
        let mut i = inputs(Some(&p), false);
        i.egress.latched_ceiling = 501; // latched at 500
        let q = |end| SendQueue {
            acked: 0,
            end,
            next_unsent: end,
        };
        assert!(!holds_back(&i, q(500)));
        assert!(holds_back(&i, q(501)));
    }
}
