//! Tripped streams whose emitter has a send in flight: is that send waiting on a client that
//! still takes bytes, or on nothing?
//!
//! After a trip the emitter sends the terminal frame once its send in flight completes. A send
//! that waits for room in the socket waits on the client: a slow but live client (a phone on a
//! weak network) takes its bytes, the send completes, and the client gets the rest of its
//! pre-trip tokens, the terminal and `[DONE]`; the kernel bounds whatever goes out meanwhile.
//! Cutting such a send would cost the client its terminal. A client that takes nothing, or an
//! emitter that is stuck with nothing queued under its send, is another matter: the watchdog
//! halts the stream itself, without a terminal frame (it could interleave with the send), and
//! shuts the socket down (G2).
//!
//! So from the trip on, each round reads the socket's `TCP_INFO` and `SIOCOUTQ` for the tripped
//! streams with a send in flight (rare: a few syscalls each, never per token) and notes when
//! the client last acknowledged a byte. The watchdog leaves the stream to its emitter while the
//! client took a byte within [`client_window`] and bytes wait in the socket.

use std::{os::fd::BorrowedFd, time::Duration};

use crate::gate::held::SendQueue;

/// The shortest time a client may take nothing before the watchdog gives up on it.
pub const MIN_CLIENT_WINDOW: Duration = Duration::from_secs(1);

/// How long a tripped stream's client may take nothing, its emitter's send waiting on it,
/// before the watchdog halts the stream itself: 4 × `--halt-grace-ms`, at least
/// [`MIN_CLIENT_WINDOW`] (a client reading 1 KiB every 100 ms through a 4 KiB buffer opens its
/// window every 200–300 ms).
pub fn client_window(grace: Duration) -> Duration {
    (grace * super::SEND_STUCK_FACTOR).max(MIN_CLIENT_WINDOW)
}

/// One stream's client, as the rounds saw it.
#[derive(Debug, Clone, Copy)]
struct Seen {
    idx: u32,
    generation: u32,
    /// `tcpi_bytes_acked` when it last moved.
    acked: u64,
    /// When a round last saw it move (or first looked).
    since_ns: u64,
    /// The round that last looked (entries no round looks at any more are dropped).
    round: u64,
}

/// What the watchdog knows of the clients of tripped streams with a send in flight. Owned by
/// the watchdog thread.
#[derive(Debug, Default)]
pub struct SendWaits {
    seen: Vec<Seen>,
    round: u64,
}

/// Whether a send in flight waits on its client, by what one look found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Bytes wait and the client took one within the window: leave it to the emitter.
    ClientMoves,
    /// Bytes wait and the client took none for the window.
    ClientStopped,
    /// Nothing waits in the socket, or it cannot be read: the send cannot be waiting on the
    /// client; the emitter is stuck.
    NothingQueued,
}

impl SendWaits {
    /// A new round begins.
    pub fn begin_round(&mut self) {
        self.round += 1;
    }

    /// Drops what no round looked at in the last one (streams that left this state).
    pub fn end_round(&mut self) {
        let round = self.round;
        self.seen.retain(|s| s.round == round);
    }

    /// Looks at the socket `fd` of slot `idx` (generation `generation`) at `now`.
    pub fn look(
        &mut self,
        (idx, generation): (u32, u32),
        fd: i32,
        now: u64,
        window: Duration,
    ) -> Verdict {
        // SAFETY: a tripped slot's socket stays open until its halt completes (only its worker
        // closes it, after the halt).
        let queue = SendQueue::of(unsafe { BorrowedFd::borrow_raw(fd) });
        let Some(queue) = queue.filter(|q| q.queued() > 0) else {
            return Verdict::NothingQueued;
        };
        let round = self.round;
        let entry = match self
            .seen
            .iter_mut()
            .find(|s| s.idx == idx && s.generation == generation)
        {
            Some(s) => s,
            None => {
                self.seen.push(Seen {
                    idx,
                    generation,
                    acked: queue.acked,
                    since_ns: now,
                    round,
                });
                return Verdict::ClientMoves;
            }
        };
        entry.round = round;
        judge(entry, queue.acked, now, window)
    }
}

/// Notes `acked` at `now` in `entry`; whether the client took a byte within `window`.
fn judge(entry: &mut Seen, acked: u64, now: u64, window: Duration) -> Verdict {
    if acked != entry.acked {
        entry.acked = acked;
        entry.since_ns = now;
        return Verdict::ClientMoves;
    }
    if now.saturating_sub(entry.since_ns) >= window.as_nanos() as u64 {
        Verdict::ClientStopped
    } else {
        Verdict::ClientMoves
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn the_window_is_four_graces_and_at_least_a_second() {
        assert_eq!(client_window(Duration::from_millis(50)), MIN_CLIENT_WINDOW);
        assert_eq!(
            client_window(Duration::from_millis(400)),
            Duration::from_millis(1600)
        );
    }

    #[test]
    fn a_client_that_takes_bytes_keeps_its_send_and_one_that_stops_loses_it() {
        let w = Duration::from_secs(1);
        let mut e = Seen {
            idx: 1,
            generation: 1,
            acked: 100,
            since_ns: 0,
            round: 1,
        };
        assert_eq!(judge(&mut e, 100, 900 * MS, w), Verdict::ClientMoves);
        assert_eq!(judge(&mut e, 200, 950 * MS, w), Verdict::ClientMoves);
        assert_eq!(e.since_ns, 950 * MS, "progress restarts the window");
        assert_eq!(judge(&mut e, 200, 1_900 * MS, w), Verdict::ClientMoves);
        assert_eq!(judge(&mut e, 200, 1_950 * MS, w), Verdict::ClientStopped);
    }

    #[test]
    fn entries_no_round_looks_at_are_dropped() {
        let mut w = SendWaits::default();
        w.begin_round();
        w.seen.push(Seen {
            idx: 3,
            generation: 7,
            acked: 0,
            since_ns: 0,
            round: w.round,
        });
        w.end_round();
        assert_eq!(w.seen.len(), 1, "looked at this round");
        w.begin_round();
        w.end_round();
        assert!(w.seen.is_empty(), "not looked at: gone");
    }
}
