//! What the haltd halt gate (the BPF programs in `ebpf/haltd-ebpf`) and the haltd daemon share:
//! the `#[repr(C)]` map values, the verdict and reason codes, and — in [`decide`] — the gate's
//! pure decision functions, which the BPF programs run in the kernel and the `stateright` model
//! of the gate (`model/`) runs exhaustively.
//!
//! # Two checks, one per send and one per segment
//!
//! * **`halt_gate`** (`sk_msg`, on every governed socket) judges each send call: it counts
//!   frames, lets a tripped stream send at most its budget of post-trip frames of at most its
//!   largest token event each, then the one terminal frame that carries the trip's nonce, then
//!   nothing. A drop fails the send with `EACCES` and is permanent. The kernel does not run it
//!   for every send, though: while a push stays partial (backpressure), `tcp_bpf` keeps the
//!   previous verdict and passes later sends without running the program.
//! * **`halt_egress`** (`cgroup_skb/egress`, on haltd's own cgroup) judges every TCP segment of
//!   a governed socket by its byte offset in the stream and caches nothing: once the stream is
//!   tripped, no segment may end beyond its post-trip byte ceiling. That bounds what a sender
//!   can get out whatever send calls it makes, short writes and cached verdicts included.
//!
//! Two more programs serve them: **`halt_adopt`** (`sock_ops`) puts every connection accepted
//! on a governed port into `GOVERNED` the moment it is established (before the client can
//! half-close it, which would make a later insertion fail), and **`heartbeat_stamp`** /
//! **`clock_read`** (flow dissectors, never attached, run by `BPF_PROG_RUN`) write the watchdog's heartbeat and
//! read the kernel's clock, so the heartbeat and the checks use one clock
//! (`bpf_ktime_get_ns`), whatever time namespace the daemon runs in.
//!
//! # Map layout and who writes what
//!
//! One writer per field: userspace never overwrites a value BPF increments, and BPF never
//! writes a value userspace owns.
//!
//! | map | kind | key | value | written by |
//! |---|---|---|---|---|
//! | `GOVERNED` | `SOCKHASH` | socket cookie (`u64`) | socket | `halt_adopt`, or userspace for a socket it governs itself |
//! | `GOVERNED_PORTS` | `HASH` | local port (`u32`) | `u32` (1) | userspace |
//! | `SOCK_STATE` | `SK_STORAGE` | socket | [`SockState`] | `halt_adopt` creates it; then `halt_gate` only |
//! | `SOCK_POLICY` | `SK_STORAGE` | socket | [`SockPolicy`] | userspace only |
//! | `EGRESS_STATE` | `SK_STORAGE` | socket | [`EgressState`] | `halt_egress` only |
//! | `HEARTBEAT` | `ARRAY` (1) | 0 | [`Heartbeat`] | `deadline_ns`: userspace, once at load; `last_ns`: `heartbeat_stamp`; `read_ns`: `clock_read` |
//! | `VERDICTS` | `PERCPU_ARRAY` | [`verdict`] index | `u64` | BPF only |
//! | `HALT_EVENTS` | `RINGBUF` | – | [`HaltEvent`] | BPF only |
//!
//! A userspace update of an `SK_STORAGE` value replaces it as a whole (a new element is linked
//! in, the old one unlinked), so the programs never see a policy half-written.
#![no_std]

mod abi;
pub mod decide;

pub use abi::*;

/// Program names in the object file.
pub const PROGRAM_GATE: &str = "halt_gate";
pub const PROGRAM_EGRESS: &str = "halt_egress";
pub const PROGRAM_ADOPT: &str = "halt_adopt";
pub const PROGRAM_STAMP: &str = "heartbeat_stamp";
pub const PROGRAM_CLOCK: &str = "clock_read";

/// Map names in the object file.
pub const MAP_GOVERNED: &str = "GOVERNED";
pub const MAP_GOVERNED_PORTS: &str = "GOVERNED_PORTS";
pub const MAP_SOCK_STATE: &str = "SOCK_STATE";
pub const MAP_SOCK_POLICY: &str = "SOCK_POLICY";
pub const MAP_EGRESS_STATE: &str = "EGRESS_STATE";
pub const MAP_HEARTBEAT: &str = "HEARTBEAT";
pub const MAP_VERDICTS: &str = "VERDICTS";
pub const MAP_HALT_EVENTS: &str = "HALT_EVENTS";

/// Default capacity of `GOVERNED`; the daemon sets it at load time.
pub const DEFAULT_MAX_SOCKETS: u32 = 16_384;
/// Capacity of `GOVERNED_PORTS`.
pub const MAX_GOVERNED_PORTS: u32 = 64;

/// Byte offset of the 16 ASCII-hex nonce in a terminal frame.
///
/// A terminal frame is the one frame the gate lets through after the post-trip budget is
/// spent. The gate recognises it by its exact length ([`SockPolicy::terminal_len`]) and the
/// per-trip nonce that userspace stores in [`SockPolicy::nonce`]; only the terminal encoder
/// writes that nonce, token frames never carry it, so an emitter that keeps sending tokens
/// cannot use the allowance. Both terminal layouts put the nonce at the same offset:
///
/// * SSE, headers already sent: `": haltd-halt" + spaces` (31 bytes), nonce, `"\n"`, events.
/// * whole HTTP response: `"HTTP/1.1 200 OK\r\n"` (17) + `"x-haltd-halt: "` (14), nonce, ...
pub const NONCE_OFFSET: usize = 31;
/// TLS framing ([`framing::TLS`]): byte offset of the nonce in a terminal frame, the first
/// byte after the terminal record's 5-byte header. The 16 bytes there are ciphertext of the
/// record: AEAD output under the session's key at that record's sequence number (TLS 1.3, and
/// TLS 1.2 ChaCha20-Poly1305), or the record's 8-byte explicit nonce, unique per record of
/// the connection, then 8 bytes of AEAD output (TLS 1.2 AES-GCM). haltd seals the terminal
/// before it writes the trip and stores them; a token record (another sequence number, and
/// sealed with them after the trip only by an emitter that ignores it) does not carry them.
pub const TLS_NONCE_OFFSET: usize = 5;
/// Bytes of a TLS-framed frame the gate must see to recognise a terminal frame.
pub const TLS_TERMINAL_PREFIX_LEN: usize = TLS_NONCE_OFFSET + NONCE_LEN;
/// Length of the nonce in bytes (16 lowercase hex digits of a random `u64`, or 16 ciphertext
/// bytes under TLS framing).
pub const NONCE_LEN: usize = 16;
/// Bytes of a frame the gate must see to recognise a terminal frame.
pub const TERMINAL_PREFIX_LEN: usize = NONCE_OFFSET + NONCE_LEN;
/// The SSE form of the terminal prefix, before the nonce (exactly [`NONCE_OFFSET`] bytes).
pub const SSE_TERMINAL_PREFIX: &[u8; NONCE_OFFSET] = b": haltd-halt                   ";
/// The HTTP form of the terminal prefix, before the nonce (exactly [`NONCE_OFFSET`] bytes).
pub const HTTP_TERMINAL_PREFIX: &[u8; NONCE_OFFSET] = b"HTTP/1.1 200 OK\r\nx-haltd-halt: ";
