//! The map values and codes: the gate's kernel ABI.
//!
//! Every type is `#[repr(C)]` with explicit padding fields, so the layout the BPF programs see
//! is exactly the layout userspace writes. With the `user` feature the types implement
//! `aya::Pod` and can be stored in maps from userspace.

use crate::NONCE_LEN;

/// Per-socket state of the send check (`halt_gate`), in `SOCK_STATE`.
///
/// `halt_adopt` creates it zeroed with `adopted = 1` when it puts the socket into `GOVERNED`;
/// userspace creates it zeroed for a socket it governs itself, before inserting it. From then
/// on only `halt_gate` writes it. Sends on one socket are serialised by the socket lock, so the
/// program updates these fields without atomics.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockState {
    /// Every send the program has seen on this socket, counted before the verdict; the n-th
    /// send of the socket is frame n (1-based). Compared with [`SockPolicy::pre_trip_frames`].
    pub frames: u64,
    /// Sends passed while the gate saw the stream tripped (terminal frame excluded).
    pub post_trip_frames: u64,
    /// Bytes passed while the gate saw the stream tripped (terminal frame excluded).
    pub post_trip_bytes: u64,
    /// `bpf_ktime_get_ns` of the first send seen while tripped; 0 before.
    pub first_post_trip_ns: u64,
    /// Frame limit the gate set itself when it first saw the heartbeat lost, **plus one**:
    /// `n - 1 + SockPolicy::budget + 1` where `n` is that frame's number (0 stays "never saw
    /// the heartbeat lost"). Sticky: a socket that once saw a lost heartbeat stays tripped.
    pub stale_frame_limit: u64,
    /// 1 once the terminal frame passed; everything after it is dropped.
    pub terminal_sent: u32,
    /// 1 once the gate dropped a send on this socket (drops are permanent).
    pub dropped: u32,
    /// Why the gate considered the stream tripped, one of [`trip_reason`]; 0 while untripped.
    pub trip_reason: u32,
    /// 1 when `halt_adopt` put the socket into `GOVERNED`.
    pub adopted: u32,
}

/// Per-socket policy and trip, in `SOCK_POLICY`. Written by userspace only, by socket.
///
/// Written three times in a stream's life, each time whole: at accept (untripped, budget 0),
/// when the turn starts (its budget and largest token event), and at the trip. A socket
/// without a policy is treated as tripped with nothing allowed (fail closed).
///
/// The frame limit is absolute: userspace reads how many frames it handed to the kernel for
/// this socket (`F`, [`SockPolicy::pre_trip_frames`]), so frames numbered up to `F` are pre-trip
/// wherever they are in flight, and frames after `F` are post-trip whether they reached the gate
/// before or after the trip was written: at most `F + budget` frames ever pass.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockPolicy {
    /// Non-zero once the stream tripped; never cleared for the same socket.
    pub tripped: u32,
    /// Failure code of the trip (the daemon's `FailureCode` as `u32`), for halt events.
    pub cause: u32,
    /// B: post-trip token frames this stream may send (0 for batch and degraded turns, and
    /// before the turn starts). Also the budget when the gate itself sees the heartbeat lost.
    pub budget: u32,
    /// E: the largest token event this stream's encoder can write; a post-trip frame larger
    /// than this is dropped, and the post-trip bytes are at most `budget × E`.
    pub max_event_bytes: u32,
    /// `F`: frames handed to the kernel before the trip (set at the trip).
    pub pre_trip_frames: u64,
    /// The egress ceiling (set at the trip): no segment may end beyond this byte offset of the
    /// stream. It is the bytes of the frames handed to the kernel before the trip, plus
    /// `budget × E`, plus `terminal_len`.
    pub egress_ceiling: u64,
    /// Exact length of this trip's terminal frame (set at the trip).
    pub terminal_len: u32,
    /// How the stream is framed on the wire, one of [`framing`]: where a terminal frame
    /// carries [`SockPolicy::nonce`]. Set at the trip (0, plain, before).
    pub framing: u32,
    /// What a terminal frame must carry: plain framing, the ASCII hex nonce at
    /// [`crate::NONCE_OFFSET`]; TLS framing, the first 16 ciphertext bytes of the sealed
    /// terminal record, at [`crate::TLS_NONCE_OFFSET`]. All zero until tripped (never
    /// matches).
    pub nonce: [u8; NONCE_LEN],
    /// The daemon's stream id (`generation << 32 | slot`), for halt events; 0 before the turn.
    pub stream_tag: u64,
}

/// Per-socket state of the egress check (`halt_egress`), in `EGRESS_STATE`. BPF only.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EgressState {
    /// Ceiling the egress check latched itself, **plus one** (0 = none): when it first saw the
    /// heartbeat lost, or the socket without a policy, the stream offset of the next unsent
    /// byte plus `budget × E`. Sticky.
    pub latched_ceiling: u64,
    /// Segments dropped for ending beyond the ceiling (each retransmission counts).
    pub dropped_segments: u64,
    /// Highest stream offset a dropped segment ended at.
    pub dropped_end: u64,
    /// Highest stream offset a passed segment ended at.
    pub passed_end: u64,
    /// `bpf_ktime_get_ns` of the first drop; 0 before.
    pub first_drop_ns: u64,
    /// Why the ceiling was latched, one of [`trip_reason`]; 0 while not latched.
    pub latch_reason: u32,
    pub _pad: u32,
}

/// Watchdog heartbeat, in `HEARTBEAT[0]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Heartbeat {
    /// `bpf_ktime_get_ns` of the last beat, written by `heartbeat_stamp`; 0 = no heartbeat yet
    /// (fail closed).
    pub last_ns: u64,
    /// A beat older than this counts as lost and every governed stream as tripped. Written by
    /// userspace once, at load, before the first beat.
    pub deadline_ns: u64,
    /// `bpf_ktime_get_ns` when `clock_read` last ran: how userspace reads the kernel's clock.
    pub read_ns: u64,
}

/// Emitted on `HALT_EVENTS` the first time each check drops something on a socket.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HaltEvent {
    /// [`SockPolicy::stream_tag`] of the socket (0 without a policy).
    pub stream_tag: u64,
    /// Verdict of the dropped send, one of [`verdict`].
    pub verdict: u32,
    /// One of [`trip_reason`].
    pub trip_reason: u32,
    /// The send check: frames the socket sent. The egress check: the stream offset the
    /// dropped segment ended at.
    pub frames: u64,
    /// The send check: post-trip frames it passed. The egress check: the ceiling in force.
    pub post_trip_frames: u64,
    pub cause: u32,
    pub _pad: u32,
    pub ts_ns: u64,
}

/// How a governed stream is framed on the wire ([`SockPolicy::framing`]).
pub mod framing {
    /// Plain HTTP: a terminal frame carries the ASCII nonce at [`crate::NONCE_OFFSET`].
    pub const PLAIN: u32 = 0;
    /// TLS records sealed in userspace: every frame is sent as its records in one send, and a
    /// terminal frame starts with the terminal record, whose first 16 ciphertext bytes (at
    /// [`crate::TLS_NONCE_OFFSET`], after the record header) are the nonce.
    pub const TLS: u32 = 1;
}

/// Why the gate treats a stream as tripped.
pub mod trip_reason {
    pub const NONE: u32 = 0;
    /// Userspace set [`super::SockPolicy::tripped`].
    pub const TRIPPED: u32 = 1;
    /// No heartbeat yet, or older than the deadline.
    pub const HEARTBEAT: u32 = 2;
    /// The socket has no policy (never given one, or the daemon lost track of it).
    pub const NO_POLICY: u32 = 3;

    /// Label of a reason, for records and metrics.
    pub fn name(reason: u32) -> &'static str {
        match reason {
            TRIPPED => "tripped",
            HEARTBEAT => "heartbeat",
            NO_POLICY => "no_policy",
            _ => "none",
        }
    }
}

/// Indices into `VERDICTS` (per-CPU `u64` counters by outcome).
pub mod verdict {
    /// Send check: untripped stream, passed.
    pub const PASS: u32 = 0;
    /// Send check: tripped stream, within the post-trip budget, passed.
    pub const PASS_POST_TRIP: u32 = 1;
    /// Send check: the terminal frame, passed.
    pub const PASS_TERMINAL: u32 = 2;
    /// Send check: tripped stream, frame limit passed, dropped.
    pub const DROP_BUDGET: u32 = 3;
    /// Send check: tripped stream, byte budget spent, dropped.
    pub const DROP_BYTES: u32 = 4;
    /// Send check: socket without gate state, dropped (fail closed).
    pub const DROP_NO_STATE: u32 = 5;
    /// Send check: anything after the terminal frame, dropped.
    pub const DROP_AFTER_TERMINAL: u32 = 6;
    /// Send check: a post-trip frame larger than the stream's largest token event, dropped.
    pub const DROP_FRAME_SIZE: u32 = 7;
    /// Egress check: a governed segment within the ceiling (or untripped), passed.
    pub const EGRESS_PASS: u32 = 8;
    /// Egress check: a segment ending beyond the ceiling, dropped (TCP retransmits it, and it
    /// is dropped again, for as long as the ceiling holds).
    pub const EGRESS_DROP_CEILING: u32 = 9;
    /// Egress check: a segment of a tripped governed stream whose TCP header could not be
    /// read, dropped (fail closed).
    pub const EGRESS_DROP_UNPARSED: u32 = 10;
    /// Adoption: a connection on a governed port put into `GOVERNED` at establishment.
    pub const ADOPTED: u32 = 11;
    /// Adoption: a connection on a governed port that could not be put into `GOVERNED` (the
    /// map is full); the daemon refuses it.
    pub const ADOPT_FAILED: u32 = 12;
    /// Number of counters.
    pub const COUNT: u32 = 13;
    /// Prometheus label value of each counter, by index.
    pub const NAMES: [&str; COUNT as usize] = [
        "pass",
        "pass_post_trip",
        "pass_terminal",
        "drop_budget",
        "drop_bytes",
        "drop_no_state",
        "drop_after_terminal",
        "drop_frame_size",
        "egress_pass",
        "egress_drop_ceiling",
        "egress_drop_unparsed",
        "adopted",
        "adopt_failed",
    ];

    /// Whether a send-check verdict lets the send through.
    #[inline(always)]
    pub fn passes(v: u32) -> bool {
        matches!(v, PASS | PASS_POST_TRIP | PASS_TERMINAL)
    }

    /// Whether a send-check verdict drops because the stream is tripped (not for missing
    /// state), which is what a halt event reports.
    #[inline(always)]
    pub fn is_trip_drop(v: u32) -> bool {
        matches!(
            v,
            DROP_BUDGET | DROP_BYTES | DROP_AFTER_TERMINAL | DROP_FRAME_SIZE
        )
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: (this and the four below) #[repr(C)], made only of integers and byte arrays,
    // with every padding byte spelled out as a field, so any bit pattern is a valid value.
    unsafe impl aya::Pod for super::SockState {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::SockPolicy {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::EgressState {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::Heartbeat {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::HaltEvent {}
}

// Layouts are part of the kernel ABI of the gate: pin them.
const _: () = {
    assert!(core::mem::size_of::<SockState>() == 56);
    assert!(core::mem::size_of::<SockPolicy>() == 64);
    assert!(core::mem::size_of::<EgressState>() == 48);
    assert!(core::mem::size_of::<Heartbeat>() == 24);
    assert!(core::mem::size_of::<HaltEvent>() == 48);
    assert!(crate::SSE_TERMINAL_PREFIX.len() == crate::NONCE_OFFSET);
    assert!(crate::HTTP_TERMINAL_PREFIX.len() == crate::NONCE_OFFSET);
};
