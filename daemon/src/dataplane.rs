//! The client-facing data plane: one io_uring event loop per worker thread.
//!
//! Each worker accepts on the shared listener, and for every connection: allocates a stream
//! slot, puts the socket under the kernel halt gate before its first send, reads and parses
//! the request, then runs the turn as a chain of completions. Every token, from either
//! source, goes through one pipeline (`turn/pipeline.rs`): observe (detectors) → release (the
//! exfiltration hold-back) → encode → account (the slot's frame count) → send. Every send on
//! a governed socket carries one frame (one SSE event; before a trip up to 16 token events an
//! upstream delivered together; or one whole response), which is what the gate counts.
//!
//! The modules, grouped by the object they serve (one concern per file):
//!
//! | folder | file | what |
//! |---|---|---|
//! | `driver/` | `ring.rs` | the io_uring driver: the ring's setup, the loop, submission, completion dispatch |
//! | | `step.rs` | a connection's `Step`: the connection and the worker's `Io`, never the slab |
//! | | `conns.rs` | the slab: a connection in (accepted) and out (closed once its step returned) |
//! | | `ticks.rs`, `wake.rs` | the driver's walks over the connections: the stall scan and drain checks; the eventfd's wake-up (trips, records on disk, grounding answers, drain, shutdown) |
//! | | `op.rs` | operations that own their buffers while the kernel has them |
//! | | `deadline.rs` | the timer that enforces upstream receive deadlines |
//! | `conn/` | `conn.rs` (beside the folder) | a client connection: accept and govern, its state (with `KeepAlive`), closing |
//! | | `outbox.rs` | the frame buffer and what a send carries (`SendKind`), below the connection |
//! | | `emit.rs` | the connection's sends as a state machine without I/O: staging, accounting, the send in flight, a short write's rest, the terminal that waits for it, delivery |
//! | | `send.rs` | the driver's half of a send: submitting it, and doing what its completion means |
//! | | `client_tls.rs` | TLS on client connections (`--tls-cert`): handshake, records, `close_notify` |
//! | | `keepalive.rs` | a kept connection's next turn: a new stream, re-armed in the gate |
//! | | `request.rs` | reading the request, routing it, replies (errors, `/healthz`, `/v1/models`) |
//! | | `passthrough.rs` | what is answered without a turn: `/v1/models/{id}`, `/v1/embeddings` relayed |
//! | | `readiness.rs` | `/readyz`: the checks and the body that names the one that failed |
//! | | `drain.rs` | a closing connection waits for its client to take its last bytes; clients that stop reading are cut |
//! | | `watch.rs` | noticing a client that leaves while its turn waits on the upstream |
//! | | `summary.rs` | what a request leaves when it ends: the access log line and the request metrics |
//! | `turn/` | `turn.rs` | a turn: its state, opening it (mode, budget, detectors) |
//! | | `policy.rs` | the turn's kernel policy |
//! | | `pipeline.rs` | the per-token step for every source |
//! | | `phase.rs` | which phase of the pipeline runs next, decided without I/O |
//! | | `encode.rs` | the encode phase: a token's SSE event, a released frame, a batch turn's tokens |
//! | | `score.rs` | the observe phase; a token parked while the external scorer answers |
//! | | `hold.rs`, `holdback.rs` | the exfiltration hold queue, which also frames proxied text; intervene mode's hold-back window |
//! | | `circuit.rs`, `circuit_record.rs` | TokenCircuit: tool calls held until judged, `TOOL_CIRCUIT_OPEN`, its ledger records |
//! | | `end.rs` | the end of a turn: the last word of the detectors, SafetyCheck, the final frame |
//! | | `halt.rs`, `own_trip.rs` | the emitter's side of a halt; a trip the worker raises on its own stream |
//! | | `record.rs` | the turn's flight-recorder record |
//! | `ground/` | `ground.rs` | intervene mode's grounding rounds: pause, ground, rewind, resume |
//! | | `state.rs` | a turn's grounding as state (its rounds, the one in flight, the continuation's seed) |
//! | | `continuation.rs`, `post_hoc.rs` | a proxied turn's re-issued continuation; the post-hoc fallback |
//! | `upstream_io/` | `upstream_io.rs` | the upstream exchange of a proxied turn on the ring |
//! | | `exchange.rs`, `recv.rs` | the exchange as state (what to ask, socket, buffers, parser, limits, `Reuse`); what its receives bring |
//! | | `sock.rs` | the upstream's TCP socket and the address its connect owns |
//! | | `tls.rs` | TLS on that socket for an `https://` upstream (rustls over the ring's buffers) |
//! | | `pool.rs`, `reuse.rs` | the worker's idle keep-alive upstream connections, and when one is pooled or retried |
//!
//! The `Worker` is the driver: it owns the slab of connections, and its methods (all in
//! `driver/`) are the loop, the completion dispatch and the walks over every connection.
//! Everything one connection does runs on its `Step` (`driver/step.rs`), which borrows that
//! connection and the worker's `Io` but not the slab, so no connection code can look a
//! connection up by key; a connection leaves the slab only in the driver, after the step that
//! closed it returned.
//!
//! A trip raised elsewhere (admin, watchdog) rings the worker's eventfd; the worker then halts
//! the tripped streams it owns at once instead of waiting for their next token.

use std::{io, net::TcpListener, os::fd::RawFd, sync::Arc, time::Duration};

use io_uring::{types, IoUring};
use slab::Slab;

use crate::halt::HaltCore;

mod conn;
mod driver;
mod ground;
mod turn;
mod upstream_io;

use conn::Conn;
use driver::step::{ConnTag, Step};

/// Starts the data-plane workers on `listener`.
pub fn spawn_workers(
    shared: &Arc<HaltCore>,
    listener: &TcpListener,
) -> io::Result<Vec<std::thread::JoinHandle<()>>> {
    let mut handles = Vec::new();
    for worker in 0..shared.cfg.workers {
        let listener = listener.try_clone()?;
        let shared = Arc::clone(shared);
        let (ring, ring_setup) = driver::ring::RingSetup::build()?;
        handles.push(
            std::thread::Builder::new()
                .name(format!("haltd-dp-{worker}"))
                .spawn(move || {
                    let pool = upstream_io::pool::UpstreamPool::new(
                        shared.cfg.args.upstream_pool_idle,
                        shared.cfg.upstream_pool_idle_timeout,
                    );
                    let mut w = Worker {
                        conns: Slab::new(),
                        io: Io {
                            id: worker as u32,
                            ring,
                            ring_setup,
                            listener,
                            shared,
                            ops: driver::op::OpTable::default(),
                            pool,
                            next_serial: 0,
                            cqes: Vec::new(),
                            cq_dropped_seen: 0,
                            sweep: driver::deadline::Sweep::default(),
                            tick: conn::drain::Tick::default(),
                            to_close: Vec::new(),
                            sq_dropped_seen: 0,
                            awaiting_records: Vec::new(),
                            grounding: None,
                        },
                    };
                    if let Some(beat) = w.io.shared.workers.get(worker) {
                        crate::progress::attach(std::sync::Arc::clone(beat));
                    }
                    if let Err(e) = w.run() {
                        // A dead worker cannot police its streams: stop the daemon (fail closed).
                        tracing::error!(worker, error = %e, "data-plane worker failed; exiting");
                        std::process::exit(70);
                    }
                })?,
        );
    }
    Ok(handles)
}

/// One data-plane worker, the io_uring driver: the connections it owns, and everything
/// else it holds (`Io`). Its methods are the driver's: the loop, the completion dispatch, and
/// the timers and scans that walk every connection. What one connection does runs on a
/// [`Step`], which borrows that connection and the `Io` but never the slab: code that handles
/// one connection cannot look another up, and a connection leaves the slab only in the
/// driver, after the step that closed it has returned (`finish_closes`).
struct Worker {
    conns: Slab<Conn>,
    io: Io,
}

/// What a worker holds besides its connections: the ring and the operations in flight, the
/// listener, the shared core, the upstream pool, timers and the lists of connections waiting
/// on the driver.
struct Io {
    id: u32,
    ring: IoUring,
    /// How the ring was set up (`ring.rs`).
    ring_setup: driver::ring::RingSetup,
    listener: TcpListener,
    shared: Arc<HaltCore>,
    /// The operations in flight, which own their buffers (`op.rs`).
    ops: driver::op::OpTable,
    /// Idle keep-alive connections to the upstream, this worker's own (`pool.rs`).
    pool: upstream_io::pool::UpstreamPool,
    /// The serial of the next connection (tells a reused slab key from the connection an
    /// old operation belongs to).
    next_serial: u64,
    cqes: Vec<(u64, i32)>,
    /// The ring's lost-completion and invalid-submission counters as last read (the kernel
    /// keeps them per ring; `haltd_ring_events_total` gets the increments).
    cq_dropped_seen: u32,
    sq_dropped_seen: u32,
    /// The timer that enforces upstream receive deadlines (`deadline.rs`).
    sweep: driver::deadline::Sweep,
    /// The timers that watch sends waiting on their client and draining connections
    /// (`drain.rs`).
    tick: conn::drain::Tick,
    /// Connections that began to close during the current pass, by key and serial: each is
    /// closed (if nothing is in flight) once the pass is over, never in the middle of a
    /// handler, so a handler's connection key stays valid until it returns.
    to_close: Vec<ConnTag>,
    /// Answers waiting for their record to reach the disk, by connection: the
    /// flag turns `true` once it is, and the answer may go out (`halt.rs`, `record.rs`).
    awaiting_records: Vec<(ConnTag, AfterRecord, Arc<std::sync::atomic::AtomicBool>)>,
    /// The worker's grounding thread, started at its first round (`ground.rs`).
    grounding: Option<ground::GroundRunner>,
}

/// What goes out once a record is on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AfterRecord {
    /// A halt's terminal frame, after its incident record.
    Terminal,
    /// A completed turn's final frame, after its turn record.
    Final,
}

fn timespec(d: Duration) -> types::Timespec {
    types::Timespec::new()
        .sec(d.as_secs())
        .nsec(d.subsec_nanos())
}

/// One token per frame must leave at once: no Nagle delay on client or upstream sockets.
fn set_nodelay(fd: RawFd) {
    let one: libc::c_int = 1;
    // SAFETY: setsockopt on a socket the caller owns, with a valid int option value.
    unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            (&raw const one).cast(),
            size_of::<libc::c_int>() as u32,
        );
    }
}
