//! The model's state: userspace (emitter, halter, trip writer), the kernel (the socket's cached
//! verdict, the gate's map values, the send queue, the peer) and the ghost variables the
//! properties read.

use std::hash::{Hash, Hasher};

use haltd_common::{EgressState, SockPolicy, SockState};

/// `psock->eval` in `tcp_bpf`: the verdict the kernel keeps for the socket between sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Eval {
    /// `__SK_NONE`: the next send runs the program.
    None,
    /// `__SK_PASS` kept after a short write: the next send passes without the program.
    Pass,
    /// `__SK_DROP`: every later send fails with `EACCES` without the program.
    Drop,
}

/// Where the stream was when it tripped (the first trip point), for the byte bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TripMark {
    /// Bytes the kernel had accepted into the send queue before the trip point.
    pub accepted: u8,
    /// Bytes of the frame in progress userspace had counted but the kernel not accepted yet.
    pub pending: u8,
    /// Whether the trip point is userspace's trip write (else the first kernel observation of
    /// a lost heartbeat).
    pub by_user: bool,
}

/// One state of the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct State {
    // ---- userspace ----
    /// Token frames userspace counted as handed to the kernel (`frames_submitted`: counted
    /// before the frame's first send, as haltd's `begin_frame` does).
    pub frames_counted: u8,
    /// Bytes of those frames (their whole sizes).
    pub bytes_counted: u8,
    /// Bytes of the frame in progress not yet accepted by the kernel (0: none in progress).
    pub pending: u8,
    /// The frame in progress is the terminal frame.
    pub cur_terminal: bool,
    /// The frame in progress was begun after the (first) trip point.
    pub cur_post_trip: bool,
    /// The frame in progress was begun after userspace's trip write.
    pub cur_post_user_trip: bool,
    /// A send failed (`EACCES`): a disciplined emitter stops.
    pub send_failed: bool,
    /// The halter sent (began) the terminal frame.
    pub terminal_started: bool,
    /// Userspace wrote the trip.
    pub user_tripped: bool,
    /// The watchdog's heartbeat is fresh.
    pub hb_fresh: bool,
    /// TLS: records sealed so far (the last sequence number used); 0 without TLS.
    pub sealed: u8,
    /// TLS: the sequence number of the frame in progress (0: none, or not TLS).
    pub cur_seq: u8,
    /// TLS: the terminal record's sequence number, fixed when it is sealed (0: not yet).
    pub terminal_seq: u8,

    // ---- kernel ----
    pub eval: Eval,
    /// `SOCK_STATE` (written by the send check only).
    pub sock: SockState,
    /// `SOCK_POLICY` (written by userspace only).
    pub policy: SockPolicy,
    /// `EGRESS_STATE` (written by the egress check only).
    pub egress: EgressState,
    /// Bytes accepted into the send queue (the stream offset of the next byte queued).
    pub accepted: u8,
    /// `snd_nxt` as a stream offset: the next byte never sent.
    pub snd_nxt: u8,
    /// Bytes the peer holds (bit i: stream offset i), in order or not.
    pub rcv: u16,

    // ---- ghost ----
    /// The first trip point.
    pub trip: Option<TripMark>,
    /// Userspace's trip write.
    pub user_trip: Option<TripMark>,
    /// Some program observed the heartbeat lost.
    pub hb_seen: bool,
    /// Sends the send check passed as post-trip token frames (saturates at 15).
    pub post_trip_passes: u8,
    /// Highest stream offset a segment that passed the egress check ended at.
    pub left: u8,
    /// Bit `e - 1`: a token frame begun after the trip point ends at stream offset `e`.
    pub post_trip_frame_ends: u16,
    /// The same for token frames begun after userspace's trip write.
    pub post_user_trip_frame_ends: u16,
    /// Stream offset the terminal frame ends at, once it is wholly accepted (0: not yet).
    pub terminal_end: u8,
    /// A check dropped something before any trip point.
    pub drop_before_trip: bool,
    /// A check dropped something of an honest emitter while no program had seen the heartbeat
    /// lost.
    pub honest_drop: bool,
    /// TLS: the sequence number of the last record wholly accepted by the kernel.
    pub last_seq_sent: u8,
    /// TLS: a record was wholly accepted after one sealed later (the client could not open it).
    pub out_of_order: bool,
}

impl State {
    /// Bytes delivered to the peer in order: the longest prefix it holds.
    pub fn delivered(&self) -> u8 {
        self.rcv.trailing_ones() as u8
    }

    /// Of the frames whose end offsets are the bits of `ends`, those that reached the peer whole
    /// (with every byte before them).
    pub fn frames_delivered(&self, ends: u16) -> u32 {
        let d = self.delivered();
        let reached = if d >= 16 { u16::MAX } else { (1u16 << d) - 1 };
        (ends & reached).count_ones()
    }

    /// Bytes the socket holds that the peer has not acknowledged.
    pub fn unacked(&self) -> u8 {
        self.accepted - self.delivered()
    }
}

// The haltd-common map values do not implement `Hash` (they are kernel ABI); the checker
// needs it, so hash every field by hand. A field added to one of them must be added here.
impl Hash for State {
    fn hash<H: Hasher>(&self, h: &mut H) {
        (
            self.frames_counted,
            self.bytes_counted,
            self.pending,
            self.cur_terminal,
            self.cur_post_trip,
            self.cur_post_user_trip,
            self.send_failed,
            self.terminal_started,
            self.user_tripped,
            self.hb_fresh,
        )
            .hash(h);
        (
            self.sealed,
            self.cur_seq,
            self.terminal_seq,
            self.last_seq_sent,
            self.out_of_order,
        )
            .hash(h);
        self.eval.hash(h);
        let s = &self.sock;
        (
            s.frames,
            s.post_trip_frames,
            s.post_trip_bytes,
            s.first_post_trip_ns,
            s.stale_frame_limit,
            s.terminal_sent,
            s.dropped,
            s.trip_reason,
            s.adopted,
        )
            .hash(h);
        let p = &self.policy;
        (
            p.tripped,
            p.cause,
            p.budget,
            p.max_event_bytes,
            p.pre_trip_frames,
            p.egress_ceiling,
            p.terminal_len,
            p.framing,
            p.nonce,
            p.stream_tag,
        )
            .hash(h);
        let e = &self.egress;
        (
            e.latched_ceiling,
            e.dropped_segments,
            e.dropped_end,
            e.passed_end,
            e.first_drop_ns,
            e.latch_reason,
            e._pad,
        )
            .hash(h);
        (self.accepted, self.snd_nxt, self.rcv).hash(h);
        (
            self.trip,
            self.user_trip,
            self.hb_seen,
            self.post_trip_passes,
        )
            .hash(h);
        (
            self.left,
            self.post_trip_frame_ends,
            self.post_user_trip_frame_ends,
            self.terminal_end,
            self.drop_before_trip,
            self.honest_drop,
        )
            .hash(h);
    }
}
