//! A client connection: its socket and stream id, its buffers, the state of the operations
//! in flight on it, and its life from accept (governed by the kernel gate before anything is
//! sent) to close (once nothing is in flight and nobody else holds its halt).

pub(in crate::dataplane) mod client_tls;
pub(in crate::dataplane) mod drain;
pub(in crate::dataplane) mod emit;
pub(in crate::dataplane) mod keepalive;
pub(in crate::dataplane) mod outbox;
pub(in crate::dataplane) mod passthrough;
pub(in crate::dataplane) mod readiness;
pub(in crate::dataplane) mod request;
pub(in crate::dataplane) mod send;
pub(in crate::dataplane) mod summary;
pub(in crate::dataplane) mod watch;

use std::{os::fd::RawFd, sync::Arc};

use io_uring::{opcode, types};

use crate::dataplane::upstream_io::pool;
use crate::dataplane::{
    driver::op::{OpBuf, OpKind},
    timespec,
    turn::Turn,
    upstream_io::Upstream,
};
use crate::dataplane::{Io, Step};
use crate::{
    admission::{Admission, Refusal},
    clock::monotonic_ns,
    metrics::requests::Route,
    stream::{Halter, Outcome, SlotState},
    upstream::CancelReason,
    wire::{http, http::Persist, HttpError, StreamId},
};
use haltd_common::SockPolicy;

/// Bytes read per receive of a request.
pub(in crate::dataplane) const RECV_CHUNK: usize = 8 * 1024;

/// What a request's turn does with its connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::dataplane) enum KeepAlive {
    /// The reply says `connection: close` (the client did not ask to keep it).
    Close,
    /// The reply says `connection: keep-alive`; after a normal end the next request is read.
    Keep,
    /// The client asked, but this is the connection's last turn (`--max-turns-per-conn`):
    /// the reply says `connection: close`.
    LastTurn,
}

impl KeepAlive {
    /// What the turn's response head says.
    pub(in crate::dataplane) fn persist(self) -> Persist {
        match self {
            KeepAlive::Keep => Persist::KeepAlive,
            KeepAlive::Close | KeepAlive::LastTurn => Persist::Close,
        }
    }

    /// For a request that `asked` to keep the connection, on a connection that began `turns`
    /// requests (this one included).
    pub(in crate::dataplane) fn decide(asked: bool, turns: u32, max_turns: u32) -> Self {
        match (asked, turns < max_turns) {
            (false, _) => KeepAlive::Close,
            (true, true) => KeepAlive::Keep,
            (true, false) => KeepAlive::LastTurn,
        }
    }
}

#[derive(Debug)]
pub(in crate::dataplane) struct Conn {
    pub(in crate::dataplane) fd: RawFd,
    pub(in crate::dataplane) id: StreamId,
    /// Tells this connection from a later one with the same slab key (an operation's owner).
    pub(in crate::dataplane) serial: u64,
    /// Operations in flight that this connection submitted (`op.rs`): it is dropped only
    /// when there are none, so that its descriptor outlives them.
    pub(in crate::dataplane) ops: u32,
    /// The request as read so far: allocated while the request is read (a receive reserves
    /// its room), freed once it is routed; `None` while a receive owns it.
    pub(in crate::dataplane) rbuf: Option<Vec<u8>>,
    /// The frame being written, reused from frame to frame; `None` while a send owns it.
    pub(in crate::dataplane) wbuf: Option<Vec<u8>>,
    /// The client sends: the frame staged, the send in flight and what its completion
    /// means (`emit.rs`).
    pub(in crate::dataplane) emit: emit::Emitter,
    /// The receive of the request in flight (what a cancellation names).
    pub(in crate::dataplane) recv_op: Option<u64>,
    /// The pacing timer in flight.
    pub(in crate::dataplane) timer_op: Option<u64>,
    /// The watch of the client in flight (`watch.rs`).
    pub(in crate::dataplane) watch_op: Option<u64>,
    /// The wait for the external scorer in flight while a token is parked (`score.rs`).
    pub(in crate::dataplane) score_op: Option<u64>,
    /// Durations handed to timeouts, back with their completion (reused, not reallocated).
    pub(in crate::dataplane) timer_ts: Option<Box<types::Timespec>>,
    pub(in crate::dataplane) read_ts: Option<Box<types::Timespec>>,
    pub(in crate::dataplane) watch_ts: Option<Box<types::Timespec>>,
    /// The scorer's deadlines (`score.rs`): two, as a deadline's completion may come after
    /// the next token's wait is armed.
    pub(in crate::dataplane) score_ts: [Option<Box<types::Timespec>>; 2],
    /// The watch's receive buffer (its bytes are never read).
    pub(in crate::dataplane) watch_buf: Option<Vec<u8>>,
    pub(in crate::dataplane) continue_sent: bool,
    pub(in crate::dataplane) reading: bool,
    /// The final frame is written and recorded, and waits for the upstream exchange to
    /// settle (its body drained and the connection pooled) before it goes out
    /// (`upstream_io/reuse.rs`, [`Step::send_final`]).
    pub(in crate::dataplane) final_waits_upstream: bool,
    pub(in crate::dataplane) closing: bool,
    pub(in crate::dataplane) outcome: Outcome,
    pub(in crate::dataplane) turn: Option<Box<Turn>>,
    /// The upstream exchange of a proxied turn (or `/v1/models`).
    pub(in crate::dataplane) up: Option<Box<Upstream>>,
    /// The client half-closed (or closed) its side: EOF was read after the request.
    pub(in crate::dataplane) peer_eof: bool,
    /// The client's IP address, read at accept (what `--max-conns-per-addr` counts).
    pub(in crate::dataplane) peer: Option<std::net::IpAddr>,
    /// The turn's place in its scope's concurrency limit (`limits.rs`): given back when the
    /// connection goes on to its next request or closes. `None` without limits.
    pub(in crate::dataplane) place: Option<crate::limits::Place>,
    /// With `--client-keys store`: the key the request authenticated with (records and the
    /// access log name it).
    pub(in crate::dataplane) client_key: Option<crate::keys::KeyMatch>,
    /// When the request began: `--request-timeout-ms` counts from here. Accept for the first
    /// request, the first byte of the request for the later ones of a kept connection.
    pub(in crate::dataplane) accepted_ns: u64,
    /// Whether this turn keeps the connection (`keepalive.rs`).
    pub(in crate::dataplane) keep: KeepAlive,
    /// Requests begun on this connection, this one included.
    pub(in crate::dataplane) turns: u32,
    /// A kept connection waiting for its next request (not in the request phase); since when.
    pub(in crate::dataplane) idle_since_ns: Option<u64>,
    /// Bytes that followed the request's body: the start of the next request (answered in
    /// order, after this one); empty, and unallocated, without pipelining.
    pub(in crate::dataplane) pipelined: Vec<u8>,
    /// The request's id: the client's `x-request-id` or a generated one (`None` until a
    /// request began; a connection that never sent one leaves no access log line).
    pub(in crate::dataplane) request_id: Option<Arc<str>>,
    /// Whether `request_id` is the client's own (it sent a well-formed one).
    pub(in crate::dataplane) request_id_from_client: bool,
    /// The client's `traceparent`, if well formed: passed to the upstream.
    pub(in crate::dataplane) traceparent: Option<String>,
    /// Headers of the client's surface that go upstream with a passed-through turn
    /// (`--upstream-surfaces`; Messages: `x-api-key`, `anthropic-version`, `anthropic-beta`).
    pub(in crate::dataplane) surface_headers: Vec<(&'static str, String)>,
    /// What the request asked for (the access log's and the metrics' `endpoint`).
    pub(in crate::dataplane) route: Route,
    /// The status the response head said (0: no response went out).
    pub(in crate::dataplane) status: u16,
    /// The client TLS session (`--tls-cert`), shared with whoever trips this connection's
    /// stream (`client_tls.rs`); `None` for plain HTTP.
    pub(in crate::dataplane) tls: Option<crate::client_tls::SharedTls>,
    /// TLS: the ciphertext receive buffer; `None` while a receive owns it.
    pub(in crate::dataplane) tls_in: Option<Vec<u8>>,
    /// TLS: the frame's records, sealed when the frame was counted, for the next send.
    pub(in crate::dataplane) sealed: Option<Vec<u8>>,
    /// TLS: a spent send buffer, for the next records.
    pub(in crate::dataplane) tls_out: Option<Vec<u8>>,
    /// TLS: what the last receive opened into, for the HTTP side once the handshake flight it
    /// provoked went out (`Some(0)`: the client ended the TLS stream).
    pub(in crate::dataplane) tls_plain_ready: Option<usize>,
    /// TLS: the close said (or decided not to say) `close_notify` (`client_tls.rs`).
    pub(in crate::dataplane) notified: bool,
    /// The client's progress at taking the bytes waiting in its socket (`drain.rs`).
    pub(in crate::dataplane) stall: drain::StallWatch,
    /// Closing, the connection waits for its client to take its last bytes (`drain.rs`).
    pub(in crate::dataplane) drain: Option<drain::Drain>,
    /// The connection is cut (its client stalled): it closes with a reset, without
    /// `close_notify` or a drain.
    pub(in crate::dataplane) cut: bool,
}

impl Conn {
    /// A connection just accepted and governed, about to read its first request.
    pub(in crate::dataplane) fn new(
        fd: RawFd,
        id: StreamId,
        serial: u64,
        peer: Option<std::net::IpAddr>,
        accepted_ns: u64,
        cfg: &crate::config::Config,
        tls: Option<crate::client_tls::SharedTls>,
    ) -> Self {
        Conn {
            fd,
            id,
            serial,
            ops: 0,
            rbuf: Some(Vec::new()),
            wbuf: None,
            emit: emit::Emitter::default(),
            recv_op: None,
            timer_op: None,
            watch_op: None,
            score_op: None,
            timer_ts: Some(Box::new(timespec(cfg.token_interval))),
            read_ts: Some(Box::new(timespec(cfg.request_timeout))),
            watch_ts: None,
            score_ts: [None, None],
            watch_buf: None,
            continue_sent: false,
            reading: true,
            final_waits_upstream: false,
            closing: false,
            outcome: Outcome::Open,
            turn: None,
            up: None,
            peer_eof: false,
            peer,
            place: None,
            client_key: None,
            accepted_ns,
            keep: KeepAlive::Close,
            turns: 1,
            idle_since_ns: None,
            pipelined: Vec::new(),
            request_id: None,
            request_id_from_client: false,
            traceparent: None,
            surface_headers: Vec::new(),
            route: Route::Other,
            status: 0,
            tls,
            tls_in: None,
            sealed: None,
            tls_out: None,
            tls_plain_ready: None,
            notified: false,
            stall: drain::StallWatch::default(),
            drain: None,
            cut: false,
        }
    }

    pub(in crate::dataplane) fn inflight(&self) -> bool {
        self.ops > 0
    }

    /// The request phase is over (routed, answered with an error, or closing): it no longer
    /// counts against `--request-phase-share`. Idempotent.
    pub(in crate::dataplane) fn leave_request_phase(&mut self, admission: &Admission) {
        if self.reading {
            self.reading = false;
            admission.leave_request();
        }
    }

    /// The header fields that join haltd's access log and records to the upstream's logs
    /// (`wire::trace::upstream_correlation`, `--upstream-request-id`): the stream id, an
    /// upstream request id, the client's own id and `traceparent`.
    pub(in crate::dataplane) fn correlation(
        &self,
        mode: crate::wire::trace::UpstreamRequestId,
        stream_id: &str,
    ) -> Vec<(&'static str, String)> {
        crate::wire::trace::upstream_correlation(
            mode,
            stream_id,
            (self.request_id.as_deref(), self.request_id_from_client),
            self.traceparent.as_deref(),
        )
    }

    /// Every header field haltd adds to an upstream request of this connection: the
    /// correlation fields, then a passed-through surface's headers (the client's `x-api-key`
    /// only where no key of haltd's replaces the client's credential).
    pub(in crate::dataplane) fn upstream_headers(
        &self,
        cfg: &crate::config::Config,
        stream_id: &str,
    ) -> Vec<(&'static str, String)> {
        let mut fields = self.correlation(cfg.args.upstream_request_id, stream_id);
        // haltd's own key replaces the client's, and a key of haltd's store never leaves.
        let own_key = !cfg.client_credential_goes_upstream();
        fields.extend(
            self.surface_headers
                .iter()
                .filter(|(n, _)| !(own_key && *n == "x-api-key"))
                .cloned(),
        );
        fields
    }
}

impl Io {
    /// A connection the listener accepted: admitted (admission caps, `--max-streams`), given
    /// a stream slot and put under the kernel halt gate before anything of it is sent. `None`
    /// when it was refused or could not be governed (it is closed then).
    pub(in crate::dataplane) fn admit(&mut self, fd: RawFd) -> Option<Conn> {
        self.next_serial += 1;
        let serial = self.next_serial;
        let shared = &self.shared;
        let peer = peer_ip(fd);
        if let Err(why) = shared.admission.admit(peer) {
            self.refuse(fd, &refusal_error(why));
            return None;
        }
        let tls = match shared.cfg.client_tls.as_ref().map(|c| c.session()) {
            None => None,
            Some(Ok(t)) => Some(Arc::new(std::sync::Mutex::new(t))),
            Some(Err(e)) => {
                tracing::warn!(error = %e, "starting a client TLS session failed; refusing the connection");
                shared.admission.leave_request();
                shared.admission.release(peer);
                self.refuse(fd, &at_capacity());
                return None;
            }
        };
        let accepted_ns = monotonic_ns();
        let Some(id) = shared
            .table
            .alloc(self.id, fd, shared.cfg.args.budget, accepted_ns)
        else {
            shared.admission.leave_request();
            shared.admission.release(peer);
            self.refuse(fd, &at_capacity());
            return None;
        };
        // Before anything of this connection is sent: an idle watchdog beats first.
        shared.watch_new_slot();
        // The slot's per-turn facts start empty: a terminal prepared for the stream that had
        // the slot before must never be sent for this one.
        *shared.meta(id.slot) = crate::halt::TurnMeta::for_connection(tls.clone());
        if let Some(gate) = &shared.gate {
            // SAFETY: `fd` is open for the duration of this call.
            let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
            let policy = SockPolicy {
                stream_tag: crate::halt::stream_tag(id),
                ..SockPolicy::default()
            };
            let slot = shared.table.slot(id.slot);
            // In the frame window, so a trip cannot be overwritten by this first policy.
            let mut res = Ok(crate::gate::Governed::Inserted);
            let untripped = slot.while_untripped(|| res = gate.govern(sock, &policy));
            if let Err(e) = res.map_err(|e| e.to_string()).and_then(|_| {
                untripped
                    .then_some(())
                    .ok_or_else(|| "tripped before it was governed".to_owned())
            }) {
                shared.note_ungovernable(&id.to_string(), &e);
                // Reset, not a graceful close: nothing of this connection may linger.
                let _ = crate::gate::selftest::set_linger_zero(&sock);
                // SAFETY: closing the socket we accepted; nothing else refers to it.
                unsafe { libc::close(fd) };
                shared.table.release(id);
                shared.admission.leave_request();
                shared.admission.release(peer);
                return None;
            }
        }
        shared.metrics.dataplane.streams_active.inc();
        Some(Conn::new(
            fd,
            id,
            serial,
            peer,
            accepted_ns,
            &shared.cfg,
            tls,
        ))
    }

    /// Closed: the connection, out of the driver's slab, leaves its socket, its slot, its
    /// records and its metrics; its upstream socket goes back to the pool or is closed. A cut
    /// connection (`cut`) closes with a reset.
    pub(in crate::dataplane) fn closed(&mut self, mut conn: Conn) {
        let shared = Arc::clone(&self.shared);
        if conn.cut {
            let _ = crate::gate::selftest::set_linger_zero(&conn.fd);
        }
        conn.leave_request_phase(&shared.admission);
        shared.admission.release(conn.peer);
        // SAFETY: no operation on this descriptor is in flight and the watchdog is done
        // with it (the slot is not HALTING), so nothing else uses it.
        unsafe { libc::close(conn.fd) };
        if let Some(up) = conn.up.as_mut() {
            // Nothing is in flight on the upstream socket either (its operations are the
            // connection's, and `inflight` covers them).
            let kept = pool::Kept {
                fd: up.fd(),
                tls: up.tls.take(),
            };
            self.release_upstream(kept, up.reuse, conn.outcome);
        }
        shared.metrics.dataplane.streams_active.dec();
        self.summarize(&conn);
        self.record_turn(&conn);
        shared.table.release(conn.id);
    }
}

impl Step<'_> {
    /// A closing connection with nothing in flight, once nobody else holds its halt: kept for
    /// its next request, or waiting for its `close_notify` or for its client to take its last
    /// bytes; `true` when it is to close now (the driver closes it, `Io::closed`).
    pub(in crate::dataplane) fn finish_close(&mut self) -> bool {
        let conn = &*self.conn;
        if !conn.closing || conn.inflight() {
            return false;
        }
        let shared = Arc::clone(&self.io.shared);
        let slot = shared.table.slot(conn.id.slot);
        match slot.state() {
            // The watchdog is writing to this socket: it wakes us when done.
            SlotState::Halting | SlotState::Tripping => return false,
            // Tripped while closing (e.g. the client went away at the same moment): the halt
            // still gets its record, without a terminal frame.
            SlotState::Tripped if slot.claim_halt() => {
                slot.finish_halt(Halter::Emitter, monotonic_ns());
                shared.complete_halt(&slot.snapshot(conn.id.slot), conn.fd, false, Vec::new());
            }
            _ => {}
        }
        // Out of reach of trips before the descriptor goes: a trip writes the kernel through
        // it. A trip that raced in wakes us once it is published.
        if !slot.settle_for_close() {
            return false;
        }
        let farewell_begun = conn.notified || conn.drain.is_some();
        if !farewell_begun && self.next_turn() {
            // The connection is kept: the next request is read on it, under a new stream.
            return false;
        }
        // TLS: `close_notify` first (a send; the close goes on when it completes).
        if self.say_close_notify() {
            return false;
        }
        let fd = self.conn.fd;
        if shared.kernel_held_bytes(fd) {
            // The egress check holds bytes of this stream back, or will once TCP tries to
            // send them (`gate/held.rs`): a graceful close would queue the FIN behind them for
            // ever. Reset the connection instead.
            note_held_reset(&shared, self.conn.id, fd);
            self.conn.cut = true;
            let _ = crate::gate::selftest::set_linger_zero(&fd);
        }
        // Bytes TCP has not sent yet: the connection waits for its client (`drain.rs`).
        !self.drain_first()
    }
}

impl Io {
    /// Refused at accept (`--max-streams`, or an admission cap): answer `err` and close.
    /// With the gate, the connection was governed at establishment, so it gets an untripped
    /// policy with no budget first (no tokens, and a lost heartbeat still stops it).
    pub(in crate::dataplane) fn refuse(&self, fd: RawFd, err: &HttpError) {
        let shared = &self.shared;
        shared.metrics.dataplane.rejected(err.status);
        if let Some(gate) = &shared.gate {
            // SAFETY: `fd` is open for the duration of this call.
            let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
            if let Err(e) = gate.govern(sock, &SockPolicy::default()) {
                shared.note_ungovernable("-", &e.to_string());
                let _ = crate::gate::selftest::set_linger_zero(&sock);
                // SAFETY: closing the socket we just accepted; nothing else refers to it.
                unsafe { libc::close(fd) };
                return;
            }
        }
        // A refusal takes no slot, but its answer is a governed send too: an idle watchdog
        // beats first (a watchdog that is not idle beats every interval anyway).
        shared.watch_new_slot();
        let request_id = crate::wire::trace::generate_request_id();
        self.summarize_refusal(&request_id, err.status);
        let mut out = Vec::new();
        // A TLS client cannot read a plain answer, and sealing one needs a handshake first:
        // it is only closed.
        if shared.cfg.client_tls.is_none() {
            // Refused before its path was read: in the OpenAI shape.
            http::write_error_response(
                &mut out,
                err,
                None,
                Some(&request_id),
                crate::wire::Endpoint::Chat,
            );
        }
        // SAFETY: plain non-blocking write and close of the socket we just accepted.
        unsafe {
            if !out.is_empty() {
                libc::send(
                    fd,
                    out.as_ptr().cast(),
                    out.len(),
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                );
            }
            libc::close(fd);
        }
    }
}

impl Step<'_> {
    /// Begins to close the connection: its operations in flight are cancelled, its upstream
    /// exchange is cancelled, and the driver closes it once this pass is over.
    pub(in crate::dataplane) fn begin_close(&mut self) {
        let conn = &mut *self.conn;
        if conn.closing {
            return;
        }
        conn.closing = true;
        if let Some(g) = conn.turn.as_mut().and_then(|t| t.grounding.as_mut()) {
            // A round in flight is dropped with the connection (`ground.rs`).
            g.cancel();
        }
        let targets = [conn.timer_op, conn.recv_op, conn.watch_op, conn.score_op];
        let up_reason = if conn.outcome == Outcome::ClientGone {
            CancelReason::ClientGone
        } else {
            CancelReason::Trip
        };
        let has_up = conn.up.is_some() && conn.outcome != Outcome::Completed;
        for target in targets.into_iter().flatten() {
            // A failed submission leaves the operation to complete by itself.
            let e = opcode::AsyncCancel::new(target).build();
            let _ = self.submit(OpKind::Cancel, OpBuf::None, e);
        }
        if has_up {
            // Closing with the upstream still generating: a trip or a client gone (a turn
            // that failed closed its upstream already; one that ended otherwise than
            // completed has its connection shut down, never pooled).
            self.up_cancel(up_reason);
        }
        // Closed once this pass is over (`finish_closes`), after the step that closes it
        // has returned.
        self.close_later();
    }
}

/// Logs why a closing connection is reset for bytes the egress check holds back: the socket's
/// queue, its gate state and the heartbeat's age (a rare path: a few syscalls).
fn note_held_reset(shared: &crate::halt::HaltCore, id: StreamId, fd: RawFd) {
    // SAFETY: the connection's open socket; it is closed only after this returns.
    let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let queue = crate::gate::held::SendQueue::of(sock);
    let view = shared.gate.as_ref().and_then(|g| g.socket(sock).ok());
    let egress = view.as_ref().and_then(|v| v.egress);
    let policy = view.as_ref().and_then(|v| v.policy);
    tracing::info!(
        stream_id = %id,
        queue = ?queue,
        egress_latched = egress.map(|e| e.latched_ceiling),
        egress_dropped = egress.map(|e| e.dropped_segments),
        trip_ceiling = policy.map(|p| p.egress_ceiling),
        terminal_len = policy.map(|p| p.terminal_len),
        heartbeat_age_ms = shared.heartbeat_age_s(monotonic_ns()) * 1e3,
        "the egress check holds back bytes of this connection: closing it with a reset"
    );
}

/// The peer's IP address, if the socket has one (it is read once, at accept).
fn peer_ip(fd: RawFd) -> Option<std::net::IpAddr> {
    // SAFETY: all zeroes is a valid `sockaddr_storage` (plain integers and bytes).
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: `fd` is an open socket for the duration of this call; `getpeername` writes at
    // most `len` bytes into the storage.
    let rc = unsafe { libc::getpeername(fd, (&raw mut storage).cast(), &raw mut len) };
    if rc != 0 {
        return None;
    }
    match i32::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: the kernel wrote a `sockaddr_in` for an AF_INET socket.
            let sin = unsafe { &*(&raw const storage).cast::<libc::sockaddr_in>() };
            Some(std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)).into())
        }
        libc::AF_INET6 => {
            // SAFETY: the kernel wrote a `sockaddr_in6` for an AF_INET6 socket.
            let sin6 = unsafe { &*(&raw const storage).cast::<libc::sockaddr_in6>() };
            let v6 = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            // A v4 client of a dual-stack listener counts as its v4 address.
            Some(v6.to_ipv4_mapped().map_or(v6.into(), Into::into))
        }
        _ => None,
    }
}

/// The table is full: every slot holds a connection. Slots free as streams end (a client
/// that stops reading within `--send-stall-timeout-ms`), so a retry after a second is sane.
fn at_capacity() -> HttpError {
    HttpError::new(
        503,
        "server_error",
        "haltd is at --max-streams; retry later",
    )
    .with_retry_after("1")
}

pub(in crate::dataplane) fn refusal_error(why: Refusal) -> HttpError {
    match why {
        Refusal::PerAddress => HttpError::new(
            429,
            "rate_limit_error",
            "too many open connections from this address (--max-conns-per-addr); retry later",
        )
        .with_retry_after("1"),
        Refusal::RequestPhase => HttpError::new(
            503,
            "server_error",
            "too many connections are still sending their request (--request-phase-share); retry later",
        )
        .with_retry_after("1"),
    }
}
