//! An exhaustive `stateright` model of the haltd halt gate on one governed TCP socket:
//! emitter × watchdog (heartbeat) × trip write × the kernel's send path (`tcp_bpf` with the
//! `halt_gate` send check) × TCP transmission (with the `halt_egress` segment check) × the
//! peer. The kernel steps call the real pure decisions of `haltd_common::decide`
//! ([`send_verdict`], [`segment_verdict`] and so [`egress_ceiling`], [`heartbeat_lost`]) on the
//! real map values ([`SockState`], [`SockPolicy`], [`EgressState`], [`Heartbeat`]), so what the
//! checker proves for small bounds is about that code.
//!
//! [`send_verdict`]: haltd_common::decide::send_verdict
//! [`segment_verdict`]: haltd_common::decide::segment_verdict
//! [`egress_ceiling`]: haltd_common::decide::egress_ceiling
//! [`heartbeat_lost`]: haltd_common::decide::heartbeat_lost
//! [`SockState`]: haltd_common::SockState
//! [`SockPolicy`]: haltd_common::SockPolicy
//! [`EgressState`]: haltd_common::EgressState
//! [`Heartbeat`]: haltd_common::Heartbeat
//!
//! # What is modelled
//!
//! * **Userspace.** The emitter counts a token frame (and its whole size) before the frame's
//!   first send, as haltd's `begin_frame` does, then sends it ([`Action::Begin`],
//!   [`Action::Send`]). Three emitters ([`Emitter`]): *honest* (each send a new whole frame or
//!   the rest of the frame in progress; no new frame once tripped; stops after a failed send),
//!   *disciplined* (the same sends, but it ignores the trip, as under the
//!   `emitter-ignores-halt` fault) and *adversarial* (any send of 1..=`max_send` units at any
//!   time: new data after a short write, bytes no frame declared, several frames in one send).
//!   The trip write ([`Action::Trip`], once, at any step) stores `tripped`, `F` =
//!   frames counted, ceiling = bytes counted (the whole frame in progress included) + B × E +
//!   T, T and the nonce; before it the policy is the turn's (untripped, B, E). The halter sends
//!   the terminal frame (exactly T units, the only send carrying the nonce) once after the
//!   trip: at a frame boundary for haltd's emitters, at any step between an adversary's sends.
//! * **The send path** (`tcp_bpf_sendmsg` / `tcp_bpf_send_verdict`). The socket keeps a
//!   verdict ([`Eval`]). With none kept, the program judges the whole send; a drop fails the
//!   send with `EACCES` and is kept for good (every later send fails unjudged). A pass is kept
//!   while the push is partial: the kernel accepts a nondeterministic prefix of 1..=size units
//!   within the free send-buffer space (none free: the sender waits before the program runs);
//!   a complete push clears the kept verdict; after a short write the rest of the send is
//!   discarded and the *next* send, whatever it is, passes unjudged on the kept pass (the
//!   backpressure bypass).
//! * **TCP.** The send queue holds the accepted bytes in stream order; a transmit sends the next
//!   segment from `snd_nxt` (1..=`mss` units) or retransmits from the first unacknowledged
//!   byte; the egress program judges every payload segment, retransmissions included, with
//!   `(snd_nxt, segment end)`. A passed segment reaches the peer or (with `net_loss`) is lost;
//!   the peer keeps out-of-order data and acknowledges its in-order prefix, which frees
//!   send-buffer space. A dropped new segment either leaves `snd_nxt` where it was (the drop
//!   reported as an error) or, with `drop_advances`, counts as sent and is retransmitted later
//!   (reported as congestion).
//! * **Heartbeat** ([`config::Heartbeat`]): always fresh; going stale at any step
//!   for good; going stale and fresh at any step; or coming back only after the trip write
//!   (haltd's watchdog trips every stream before it beats again after a gap). Each program run
//!   asks [`heartbeat_lost`] of a fresh or a stale map value.
//!
//! # Properties
//!
//! The *trip point* is the first of: the trip write, the first program run that saw the
//! heartbeat lost. `A` is the bytes accepted before it, `p` the rest of the frame in progress
//! then (counted by userspace, not yet accepted).
//!
//! * **P1** sends the send check passed as post-trip token frames ≤ B.
//! * **P2** bytes at stream offsets ≥ `A` that passed the egress check (a superset of those the
//!   peer got) ≤ B × E + `p` (+ T once userspace tripped). **P2u**: the same from the trip
//!   write.
//! * **P3** (honest, disciplined) token frames begun after the trip point that reached the peer
//!   whole ≤ B. **P3u**: the same from the trip write.
//! * **L1** nothing is dropped (by either check) before any trip point. **L2** (honest) nothing
//!   is dropped while no program has seen the heartbeat lost: the frame in progress and the
//!   terminal get out. **S1**–**S3** (`sometimes`): the terminal can reach the peer, a post-trip
//!   frame can (B > 0), every frame can in an untripped stream. The `liveness` tests add that
//!   from every reachable state these outcomes stay reachable.
//!
//! # Findings
//!
//! Every property holds for every emitter, budget and heartbeat. The model first found a gap
//! where the heartbeat comes back: a check that saw it lost latched its own limit, the other
//! did not, and the trip userspace wrote after the heartbeat came back counted as pre-trip what
//! it handed over in between. The checks now share their latches; [`Mistake::UnsharedLatches`]
//! keeps the old gate as a mutation, which the checker breaks in 9 steps (see
//! `tests/mutations.rs` and the crate's README).
//!
//! # Abstractions
//!
//! Sizes are abstract units (the kernel sees them as byte counts), small: E ≤ 2, T ≤ 3, a send
//! buffer of 2–3, a stream of at most 16. Time is only "heartbeat fresh or stale": every
//! program run reads the same clock ([`kernel::NOW_NS`]). Statistics no decision reads (the
//! egress check's drop counter, drop and pass offsets, first-drop time) are forgotten after each
//! run, so a retransmission of a dropped segment is not a new state. One socket, its policy
//! present from the turn start.
//!
//! # Not modelled
//!
//! A socket without a policy (`NO_POLICY`) and the accept-time policy with budget 0; adoption
//! (`halt_adopt`); several sockets; the kernel running the program more than once in one send
//! call (a send larger than the message ring, about 544 KiB, is judged chunk by chunk; cork
//! and `apply_bytes` are not used by haltd's programs); a TCP header the egress check cannot
//! read (`offsets: None`); a window between userspace reading its counters and writing the
//! trip (the write is one step; haltd's emitter begins no frame while a trip is being written);
//! close, FIN and reset; the halt events and per-CPU counters.

pub mod config;
pub mod kernel;
pub mod model;
pub mod run;
pub mod state;

pub use config::{Config, Emitter, Heartbeat, Mistake};
pub use model::{prop, Action, GateModel};
pub use run::{check, Outcome};
pub use state::{Eval, State, TripMark};
