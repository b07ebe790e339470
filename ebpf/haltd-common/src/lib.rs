//! Types shared by the haltd halt gate (the `sk_msg` BPF program in `ebpf/haltd-ebpf`) and the
//! haltd daemon.
//!
//! Every type here is `#[repr(C)]` with explicit padding fields, so the layout the BPF program
//! sees is exactly the layout userspace writes. With the `user` feature the types implement
//! `aya::Pod` and can be stored in maps from userspace.
//!
//! # Map layout and who writes what
//!
//! One writer per field: userspace never overwrites a value BPF increments, and BPF never
//! writes a value userspace owns.
//!
//! | map | kind | key | value | written by |
//! |---|---|---|---|---|
//! | `GOVERNED` | `SOCKHASH` | stream slot (`u32`) | socket | userspace, once per connection |
//! | `SOCK_STATE` | `SK_STORAGE` | socket | [`SockState`] | userspace once before insertion, then BPF only |
//! | `TRIPS` | `ARRAY` | stream slot | [`TripEntry`] | userspace only |
//! | `HEARTBEAT` | `ARRAY` (1) | 0 | [`Heartbeat`] | userspace (watchdog) only |
//! | `VERDICTS` | `PERCPU_ARRAY` | [`verdict`] index | `u64` | BPF only |
//! | `HALT_EVENTS` | `RINGBUF` | – | [`HaltEvent`] | BPF only |
#![no_std]

/// Name of the `sk_msg` program in the object file.
pub const PROGRAM_NAME: &str = "halt_gate";
/// Map names in the object file.
pub const MAP_GOVERNED: &str = "GOVERNED";
pub const MAP_SOCK_STATE: &str = "SOCK_STATE";
pub const MAP_TRIPS: &str = "TRIPS";
pub const MAP_HEARTBEAT: &str = "HEARTBEAT";
pub const MAP_VERDICTS: &str = "VERDICTS";
pub const MAP_HALT_EVENTS: &str = "HALT_EVENTS";

/// Default capacity of `GOVERNED` and `TRIPS`; the daemon may override it at load time.
pub const DEFAULT_MAX_STREAMS: u32 = 16_384;

/// Byte offset of the 16 ASCII-hex nonce in a terminal frame.
///
/// A terminal frame is the one frame the gate lets through after the post-trip budget is
/// spent. The gate recognises it by the per-trip nonce that userspace stores in
/// [`TripEntry::nonce`]; only the terminal encoder writes that nonce, token frames never carry
/// it, so an emitter that keeps sending tokens cannot use the allowance. Both terminal layouts
/// put the nonce at the same offset:
///
/// * SSE, headers already sent: `": haltd-halt" + spaces` (31 bytes), nonce, `"\n"`, events.
/// * whole HTTP response: `"HTTP/1.1 200 OK\r\n"` (17) + `"x-haltd-halt: "` (14), nonce, ...
pub const NONCE_OFFSET: usize = 31;
/// Length of the nonce in bytes (16 lowercase hex digits of a random `u64`).
pub const NONCE_LEN: usize = 16;
/// Bytes of a frame the gate must see to recognise a terminal frame.
pub const TERMINAL_PREFIX_LEN: usize = NONCE_OFFSET + NONCE_LEN;
/// The SSE form of the terminal prefix, before the nonce (exactly [`NONCE_OFFSET`] bytes).
pub const SSE_TERMINAL_PREFIX: &[u8; NONCE_OFFSET] = b": haltd-halt                   ";
/// The HTTP form of the terminal prefix, before the nonce (exactly [`NONCE_OFFSET`] bytes).
pub const HTTP_TERMINAL_PREFIX: &[u8; NONCE_OFFSET] = b"HTTP/1.1 200 OK\r\nx-haltd-halt: ";

/// Per-socket gate state, in `SK_STORAGE`.
///
/// Userspace writes it once, zeroed except `slot` and `generation`, before it inserts the
/// socket into `GOVERNED`; from then on only BPF writes it. Sends on one socket are
/// serialised by the socket lock, so BPF updates these fields without atomics.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockState {
    /// Index into `TRIPS`.
    pub slot: u32,
    /// Must equal `TRIPS[slot].generation`, or the socket is treated as tripped (stale slot).
    pub generation: u32,
    /// Every send the program has seen on this socket, counted before the verdict; the n-th
    /// send of the socket is frame n (1-based). Compared with [`TripEntry::frame_limit`].
    pub frames: u64,
    /// Sends passed while the gate saw the stream tripped (terminal frame excluded).
    pub post_trip_frames: u32,
    /// 1 once the terminal frame passed; everything after it is dropped.
    pub terminal_sent: u32,
    /// Bytes passed while the gate saw the stream tripped (terminal frame excluded).
    pub post_trip_bytes: u64,
    /// `bpf_ktime_get_ns` of the first send seen while tripped; 0 before.
    pub first_post_trip_ns: u64,
    /// Frame limit the gate set itself when it first saw the heartbeat lost, **plus one**:
    /// `n - 1 + Heartbeat::budget_frames + 1` where `n` is that frame's number. The limit
    /// itself may be 0 (first frame, budget 0), so the stored value is shifted to keep
    /// 0 = "never saw the heartbeat lost". Sticky: a socket that once saw a lost heartbeat stays
    /// tripped (fail closed), even after the heartbeat comes back.
    pub stale_frame_limit: u64,
    /// 1 once the gate dropped a send on this socket (drops are permanent).
    pub dropped: u32,
    /// Why the gate considered the stream tripped, one of [`trip_reason`]; 0 while untripped.
    pub trip_reason: u32,
}

/// Per-stream trip state, in `TRIPS[slot]`. Written by userspace only.
///
/// The budget is absolute: userspace reads how many frames it has handed to the kernel for
/// this socket (`F`), then writes `frame_limit = F + B`. Frames numbered up to `F` are
/// pre-trip wherever they are in flight; frames after `F` are post-trip whether they reached
/// the gate before or after this write, so the bound is exact.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TripEntry {
    /// Generation of the stream occupying the slot.
    pub generation: u32,
    /// Non-zero once the stream tripped; never cleared for the same generation.
    pub tripped: u32,
    /// Failure code of the trip (the daemon's `FailureCode` as `u32`), for halt events.
    pub cause: u32,
    /// Largest terminal frame the gate lets through.
    pub terminal_max_bytes: u32,
    /// Highest frame number (see [`SockState::frames`]) that may pass once tripped.
    pub frame_limit: u64,
    /// Bytes allowed to pass in post-trip frames (numbered after `pre_trip_frames`; terminal
    /// excluded).
    pub budget_bytes: u64,
    /// ASCII hex nonce a terminal frame must carry at [`NONCE_OFFSET`]; all zero until tripped.
    pub nonce: [u8; NONCE_LEN],
    /// `F`: frames numbered up to this were handed to the kernel before the trip. When they
    /// reach the gate after this entry is written (still in flight), they pass as untripped
    /// frames and do not use the byte budget, which is meant for the `B` post-trip frames.
    /// Normally `frame_limit - B`; 0 makes every frame the gate sees tripped count as post-trip
    /// (always safe, but in-flight frames then eat into `budget_bytes`).
    pub pre_trip_frames: u64,
}

/// Watchdog heartbeat, in `HEARTBEAT[0]`. Written by userspace (the watchdog thread) only.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Heartbeat {
    /// `CLOCK_MONOTONIC` nanoseconds of the last beat; 0 = no heartbeat yet (fail closed).
    pub last_ns: u64,
    /// A beat older than this counts as lost and every governed stream as tripped.
    pub deadline_ns: u64,
    /// Post-trip frames a socket may still send once the gate itself saw the beat lost (B).
    pub budget_frames: u32,
    pub _pad: u32,
    /// Post-trip bytes likewise.
    pub budget_bytes: u64,
}

/// Emitted by the gate on `HALT_EVENTS` the first time it drops a send on a socket.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HaltEvent {
    pub slot: u32,
    pub generation: u32,
    /// Verdict of the dropped send, one of [`verdict`].
    pub verdict: u32,
    /// One of [`trip_reason`].
    pub trip_reason: u32,
    pub frames: u64,
    pub post_trip_frames: u32,
    pub cause: u32,
    pub ts_ns: u64,
}

/// Why the gate treats a stream as tripped.
pub mod trip_reason {
    pub const NONE: u32 = 0;
    /// Userspace set `TRIPS[slot].tripped`.
    pub const TRIPPED: u32 = 1;
    /// No heartbeat yet, or older than the deadline.
    pub const HEARTBEAT: u32 = 2;
    /// `TRIPS[slot]` missing or of another generation.
    pub const STALE_SLOT: u32 = 3;
}

/// Indices into `VERDICTS` (per-CPU `u64` counters of sends by outcome).
pub mod verdict {
    /// Untripped stream, passed.
    pub const PASS: u32 = 0;
    /// Tripped stream, within the post-trip budget, passed.
    pub const PASS_POST_TRIP: u32 = 1;
    /// The terminal frame, passed.
    pub const PASS_TERMINAL: u32 = 2;
    /// Tripped stream, frame limit passed, dropped.
    pub const DROP_BUDGET: u32 = 3;
    /// Tripped stream, byte budget spent, dropped.
    pub const DROP_BYTES: u32 = 4;
    /// Socket without gate state, dropped (fail closed).
    pub const DROP_NO_STATE: u32 = 5;
    /// Anything after the terminal frame, dropped.
    pub const DROP_AFTER_TERMINAL: u32 = 6;
    /// Number of verdicts.
    pub const COUNT: u32 = 7;
    /// Prometheus label value of each verdict, by index.
    pub const NAMES: [&str; COUNT as usize] = [
        "pass",
        "pass_post_trip",
        "pass_terminal",
        "drop_budget",
        "drop_bytes",
        "drop_no_state",
        "drop_after_terminal",
    ];
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all four are #[repr(C)], made only of integers and byte arrays, with every
    // padding byte spelled out as a field, so any bit pattern is a valid value.
    unsafe impl aya::Pod for super::SockState {}
    unsafe impl aya::Pod for super::TripEntry {}
    unsafe impl aya::Pod for super::Heartbeat {}
    unsafe impl aya::Pod for super::HaltEvent {}
}

// Layouts are part of the kernel ABI of the gate: pin them.
const _: () = {
    assert!(core::mem::size_of::<SockState>() == 56);
    assert!(core::mem::size_of::<TripEntry>() == 56);
    assert!(core::mem::size_of::<Heartbeat>() == 32);
    assert!(core::mem::size_of::<HaltEvent>() == 40);
    assert!(SSE_TERMINAL_PREFIX.len() == NONCE_OFFSET);
    assert!(HTTP_TERMINAL_PREFIX.len() == NONCE_OFFSET);
};
