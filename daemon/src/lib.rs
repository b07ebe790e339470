//! haltd: a token-stream governor for LLM inference nodes.
//!
//! # Architecture
//!
//! ```text
//! client ──HTTP/1.1 + SSE──► dataplane (io_uring, one loop per worker thread)
//!                               │ one token per SSE event, one event per send
//!                               │ source (built-in | upstream) → detectors → hold-back → stream (frame accounting)
//!                               ▼
//!                            stream::StreamTable (atomics, shared by every thread)
//!                               ▲ trip (admin, detectors, watchdog)     │ heartbeats, halts
//!                               │                                        ▼
//!  admin (tokio: admin API, /metrics)                        watchdog thread ──► gate (BPF maps)
//!                                                                                   │
//!  kernel: send() on a governed socket ──► sk_msg "halt_gate" ──► PASS / DROP ◄─────┘
//! ```
//!
//! * [`dataplane`] accepts, puts every socket under the kernel [`gate`] before its first
//!   send, parses requests with the [`wire`] layer (HTTP heads, the client request parsed
//!   once, SSE and JSON encoders, the terminal event) and runs each turn as a chain of
//!   io_uring completions; with `--source openai` the [`upstream`] protocol (which uses the
//!   wire layer, never the reverse) proxies the turn to a backend.
//! * [`halt`] is the halt core every thread holds ([`halt::HaltCore`]): trip, terminal frame,
//!   completed halt, record.
//! * [`stream`] holds the per-stream state machine; a trip fixes the trip point τ and writes
//!   the kernel trip map with an absolute frame limit before it is published, so the kernel
//!   bound of B post-trip frames is exact even for an emitter that ignores the halt.
//! * [`watchdog`] runs on its own thread: heartbeats to the kernel (a stale one trips every
//!   stream, in the kernel and in userspace), and halts streams whose emitter did not.
//! * [`ledger`] is the hash-linked flight recorder, [`sampling`] what it keeps of normal
//!   turns; [`metrics`] the Prometheus surface.
//! * [`privs`] gives up every capability, in every thread, once the gate is loaded and the
//!   listeners are bound (and switches to `--user`).
//! * [`progress`] is what each worker is doing (its loop count and the check it runs): the
//!   watchdog halts the streams of a worker stuck in one step, and haltd exits 70.
//! * [`crash`] fails closed on a panic: the process ends at once and the next start records
//!   the crash.
//! * [`source`] is the built-in deterministic language model; [`monitor`] the HaltMonitor of
//!   spec 001, and [`detect`] every detector; [`clock`] the daemon's clocks.
//! * [`grounding`] is the grounding round of spec 003 (surprise-gated intervention).
//! * [`circuit`] is TokenCircuit (spec 002): the tool-call failure state machine, which the
//!   data plane enforces on proxied chat turns with `[tool_circuit] enabled`.

pub(crate) mod access_log;
pub mod admin;
pub(crate) mod admission;
pub mod build_info;
pub mod calibrate;
pub mod circuit;
pub mod cli_docs;
pub(crate) mod client_tls;
pub mod clock;
pub(crate) mod codes;
pub mod config;
pub mod crash;
pub mod credential;
pub mod ctl;
pub(crate) mod dataplane;
pub mod detect;
pub(crate) mod escalation;
#[cfg(any(test, feature = "fuzz"))]
pub mod fuzz;
pub mod gate;
pub mod grounding;
pub(crate) mod halt;
pub(crate) mod histogram;
pub mod identity;
pub mod keys;
pub mod labels;
pub mod ledger;
pub(crate) mod lifecycle;
pub mod limits;
pub mod logging;
pub(crate) mod metrics;
pub mod modes;
pub(crate) mod monitor;
pub(crate) mod pem;
pub mod policy;
pub mod privs;
pub mod progress;
pub(crate) mod pulse;
pub mod reuseport;
pub(crate) mod safety;
pub mod sampling;
pub mod scope;
pub mod server;
pub mod source;
pub mod state;
pub(crate) mod stream;
pub mod upstream;
pub(crate) mod upstream_watch;
pub(crate) mod watchdog;
pub mod wire;
