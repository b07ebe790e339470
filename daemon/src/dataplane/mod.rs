//! The client-facing data plane: one io_uring event loop per worker thread.
//!
//! Each worker accepts on the shared listener, and for every connection: allocates a stream
//! slot, puts the socket under the kernel halt gate before its first send, reads and parses
//! the request, then runs the turn as a chain of completions: (timer →) generate one token →
//! detectors → account the frame → send it → ... Every send on a governed socket carries one
//! frame (one SSE event, or one whole response), which is what the gate counts.
//!
//! Buffers belong to the connection and stay put while an operation that points into them
//! is in flight; a connection is dropped only when none is (`Conn::inflight`). `user_data`
//! is the connection's slab key and the operation kind.
//!
//! A trip raised elsewhere (admin, watchdog) rings the worker's eventfd; the worker then halts
//! the tripped streams it owns at once instead of waiting for their next token.

use std::{
    io,
    net::TcpListener,
    os::fd::{AsRawFd, RawFd},
    sync::{atomic::Ordering::SeqCst, Arc},
    time::Duration,
};

use io_uring::{opcode, squeue, types, IoUring};
use slab::Slab;

use crate::{
    clock::monotonic_ns,
    codes::FailureCode,
    config::SourceKind,
    detect::{pipeline::Gate, pipeline::TurnGovernor, TokenObs},
    halt::HaltCore,
    ledger::RecordKind,
    metrics::{dataplane::RingEvent, upstream::ToolCallKind},
    modes::KeyId,
    source::builtin::{BuiltinModel, BuiltinStream, MODEL_NAME},
    stream::{Halter, Mode, Outcome, SlotState},
    upstream::CancelReason,
    wire::{
        http, BuiltinTurn, ChunkEncoder, ClientRequest, Endpoint, HttpError, RequestHead, StreamId,
        Token,
    },
};
use haltd_common::SockPolicy;

mod govern;
mod proxy;

const OP_ACCEPT: u64 = 1;
const OP_WAKE: u64 = 2;
const OP_RECV: u64 = 3;
const OP_SEND: u64 = 4;
const OP_TIMER: u64 = 5;
const OP_LINK_TIMEOUT: u64 = 6;
const OP_CANCEL: u64 = 7;
const OP_UP_CONNECT: u64 = 8;
const OP_UP_SEND: u64 = 9;
const OP_UP_RECV: u64 = 10;
const OP_UP_LINK: u64 = 11;
/// Receive on the client socket while a proxied turn runs (notices a client that left).
const OP_WATCH: u64 = 12;
const OP_CANCEL_UP: u64 = 13;
/// Key used for the listener and the eventfd, which are not connections.
const WORKER_KEY: u64 = u32::MAX as u64;
const RING_ENTRIES: u32 = 1024;
const RECV_CHUNK: usize = 8 * 1024;

fn ud(key: usize, op: u64) -> u64 {
    ((key as u64) << 8) | op
}

/// What the send in flight carries, which decides what happens when it completes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SendKind {
    Continue100,
    Head,
    Token,
    /// The last frame of a turn that ends normally.
    Final,
    /// An error or health response; the connection closes after it.
    Reply,
    Terminal,
    /// An interim `100 Continue` to a client that half-closed while its proxied turn waits on
    /// the upstream (see `proxy::on_watch`).
    Probe,
}

/// A generated token kept for a batch response.
#[derive(Debug)]
struct HeldToken {
    text: String,
    logprob: f32,
    top: Vec<(String, f32)>,
    offset: usize,
}

/// Where a turn's tokens come from.
#[derive(Debug)]
enum TurnSource {
    Builtin(BuiltinStream),
    /// Proxied to the upstream; its state is the connection's [`proxy::Upstream`].
    Proxy,
}

/// The turn a connection is running.
#[derive(Debug)]
struct Turn {
    source: TurnSource,
    /// What the client asked for.
    stream: bool,
    logprobs: bool,
    top_logprobs: u32,
    include_usage: bool,
    /// The conversation (API key) and whether its scope was degraded at turn start.
    key_id: KeyId,
    degraded: bool,
    /// Tokens the source produced (emitted or held).
    tokens_generated: u64,
    /// The turn's detectors and exfiltration scanner.
    gov: TurnGovernor,
    /// Frames the exfiltration scanner holds back.
    hold: govern::Hold,
    /// A content or tool-call frame went out (the chat role goes in the first).
    first_frame_sent: bool,
    /// Emitted text, for SafetyCheck (bounded; see `govern`).
    out_text: String,
    out_text_truncated: bool,
    /// SafetyCheck inputs fixed at turn start.
    request_urls: std::collections::BTreeSet<String>,
    identity_before: Option<String>,
    identity_after: Option<String>,
    /// SafetyCheck's verdict, once judged.
    safety: Option<serde_json::Value>,
    enc: ChunkEncoder,
    /// Bytes of completion text so far (for `text_offset`).
    text_len: usize,
    /// Batch mode: the response held until the turn completes.
    held_text: String,
    held_tokens: Vec<HeldToken>,
    prompt_tokens: u64,
    /// Token index of the token frame in flight (1-based).
    inflight_token: u64,
    detector_refs: Vec<String>,
    last_token_ns: u64,
    token_gap_ns_sum: u64,
    /// Tool calls emitted to the client (streaming) or held (batch): `{index, id, name}`.
    tool_calls: Vec<serde_json::Value>,
}

#[derive(Debug)]
struct Conn {
    fd: RawFd,
    id: StreamId,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
    woff: usize,
    sending: Option<SendKind>,
    recv_inflight: bool,
    link_inflight: bool,
    timer_inflight: bool,
    cancel_inflight: u32,
    timer_ts: Box<types::Timespec>,
    read_ts: Box<types::Timespec>,
    continue_sent: bool,
    /// The frame in flight went out in more than one send.
    short_write: bool,
    reading: bool,
    pending_terminal: bool,
    closing: bool,
    outcome: Outcome,
    turn: Option<Box<Turn>>,
    /// The upstream exchange of a proxied turn (or `/v1/models`).
    up: Option<Box<proxy::Upstream>>,
    watch_inflight: bool,
    watch_buf: Box<[u8; 16]>,
    /// The client half-closed (or closed) its side: EOF was read after the request.
    peer_eof: bool,
    /// Period of the half-closed client's watch timer (`proxy::WATCH_PERIOD`).
    watch_ts: Box<types::Timespec>,
    /// When the token(s) of the token frame in flight reached haltd (the built-in source
    /// produced it, or the upstream receive carrying it completed); 0 when no token frame is
    /// in flight. Its send's completion observes `haltd_token_overhead_seconds`.
    frame_arrived_ns: u64,
}

impl Conn {
    fn inflight(&self) -> bool {
        self.sending.is_some()
            || self.recv_inflight
            || self.link_inflight
            || self.timer_inflight
            || self.cancel_inflight > 0
            || self.watch_inflight
            || self.up.as_ref().is_some_and(|u| u.inflight())
    }
}

/// Starts the data-plane workers on `listener`.
pub fn spawn_workers(
    shared: &Arc<HaltCore>,
    listener: &TcpListener,
) -> io::Result<Vec<std::thread::JoinHandle<()>>> {
    let mut handles = Vec::new();
    for worker in 0..shared.cfg.workers {
        let listener = listener.try_clone()?;
        let shared = Arc::clone(shared);
        let ring = IoUring::new(RING_ENTRIES)?;
        handles.push(
            std::thread::Builder::new()
                .name(format!("haltd-dp-{worker}"))
                .spawn(move || {
                    let mut w = Worker {
                        id: worker as u32,
                        ring,
                        conns: Slab::new(),
                        listener,
                        shared,
                        wake_buf: Box::new(0),
                        cqes: Vec::new(),
                        cq_dropped_seen: 0,
                        sq_dropped_seen: 0,
                    };
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

struct Worker {
    id: u32,
    ring: IoUring,
    conns: Slab<Conn>,
    listener: TcpListener,
    shared: Arc<HaltCore>,
    wake_buf: Box<u64>,
    cqes: Vec<(u64, i32)>,
    /// The ring's lost-completion and invalid-submission counters as last read (the kernel
    /// keeps them per ring; `haltd_ring_events_total` gets the increments).
    cq_dropped_seen: u32,
    sq_dropped_seen: u32,
}

fn timespec(d: Duration) -> types::Timespec {
    types::Timespec::new()
        .sec(d.as_secs())
        .nsec(d.subsec_nanos())
}

/// A built-in token's alternatives as owned strings (for a token that is kept: batch or held).
fn owned_top(top: &crate::source::builtin::TopLogprobs) -> Vec<(String, f32)> {
    top.as_slice()
        .iter()
        .map(|(t, l)| ((*t).to_owned(), *l))
        .collect()
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

impl Worker {
    /// Counts `n` ring events of `kind` (`haltd_ring_events_total`; rare, never per token).
    fn ring_event(&self, kind: RingEvent, n: u64) {
        self.shared.metrics.dataplane.ring_event(kind, n);
    }

    fn push(&mut self, entry: &squeue::Entry) -> io::Result<()> {
        let mut full = false;
        loop {
            // SAFETY: every entry points into buffers owned by `self.conns` (or the worker)
            // that stay alive and unmoved until the matching completion is reaped.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return Ok(());
            }
            if !full {
                full = true;
                self.ring_event(RingEvent::SqFull, 1);
            }
            if let Err(e) = self.ring.submit() {
                // In the middle of a completion there is no reaping to make room: as before,
                // the worker fails (and the daemon stops, fail closed).
                self.ring_event(RingEvent::SubmitError, 1);
                return Err(e);
            }
        }
    }

    /// After each wait: whether the completion ring overflowed into the kernel's backlog,
    /// and whether the kernel lost completions or rejected submissions since the last look
    /// (three atomic loads of the shared ring header per loop pass).
    fn check_ring(&mut self) {
        if self.ring.submission().cq_overflow() {
            self.ring_event(RingEvent::CqOverflow, 1);
        }
        let cq_dropped = self.ring.completion().overflow();
        if let Some(n) = counter_delta(cq_dropped, &mut self.cq_dropped_seen) {
            self.ring_event(RingEvent::CqDropped, u64::from(n));
            tracing::error!(
                worker = self.id,
                lost = n,
                "the kernel dropped io_uring completions; connections waiting on them may hang"
            );
        }
        let sq_dropped = self.ring.submission().dropped();
        if let Some(n) = counter_delta(sq_dropped, &mut self.sq_dropped_seen) {
            self.ring_event(RingEvent::SqDropped, u64::from(n));
            tracing::error!(
                worker = self.id,
                dropped = n,
                "the kernel rejected io_uring submissions as invalid"
            );
        }
    }

    fn run(&mut self) -> io::Result<()> {
        self.arm_accept()?;
        self.arm_wake()?;
        loop {
            let mut retry = false;
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EAGAIN)) => {
                    // EBUSY: completions wait in the kernel's overflow backlog because the
                    // completion ring is full; EAGAIN: the kernel is short of memory for
                    // requests. Both pass: reap what is there (which makes room), then submit
                    // again. Submissions not taken stay queued in the ring.
                    self.ring_event(RingEvent::SubmitError, 1);
                    tracing::warn!(worker = self.id, error = %e, "io_uring_enter: retrying after reaping completions");
                    retry = true;
                }
                Err(e) => {
                    self.ring_event(RingEvent::SubmitError, 1);
                    return Err(e);
                }
            }
            self.check_ring();
            self.cqes.clear();
            self.cqes
                .extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
            let cqes = std::mem::take(&mut self.cqes);
            if retry && cqes.is_empty() {
                // Nothing to reap (EAGAIN): do not spin on the kernel.
                std::thread::sleep(Duration::from_millis(1));
            }
            for &(data, res) in &cqes {
                self.complete(data, res)?;
            }
            self.cqes = cqes;
        }
    }

    fn arm_accept(&mut self) -> io::Result<()> {
        let e = opcode::Accept::new(
            types::Fd(self.listener.as_raw_fd()),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
        .flags(libc::SOCK_CLOEXEC)
        .build()
        .user_data(ud(WORKER_KEY as usize, OP_ACCEPT));
        self.push(&e)
    }

    fn arm_wake(&mut self) -> io::Result<()> {
        let fd = self.shared.wakers[self.id as usize].as_raw_fd();
        let ptr: *mut u64 = &mut *self.wake_buf;
        let e = opcode::Read::new(types::Fd(fd), ptr.cast(), 8)
            .build()
            .user_data(ud(WORKER_KEY as usize, OP_WAKE));
        self.push(&e)
    }

    fn complete(&mut self, data: u64, res: i32) -> io::Result<()> {
        let key = (data >> 8) as usize;
        let op = data & 0xff;
        if key == WORKER_KEY as usize {
            return match op {
                OP_ACCEPT => {
                    if res >= 0 {
                        self.accepted(res);
                    } else if res != -libc::EINTR && res != -libc::ECONNABORTED {
                        tracing::warn!(error = %io::Error::from_raw_os_error(-res), "accept failed");
                        if res == -libc::EMFILE || res == -libc::ENFILE {
                            std::thread::sleep(Duration::from_millis(10));
                        }
                    }
                    self.arm_accept()
                }
                OP_WAKE => {
                    self.scan_tripped();
                    self.arm_wake()
                }
                _ => Ok(()),
            };
        }
        let Some(conn) = self.conns.get_mut(key) else {
            return Ok(());
        };
        match op {
            OP_RECV => {
                conn.recv_inflight = false;
                self.on_recv(key, res)?;
            }
            OP_LINK_TIMEOUT => conn.link_inflight = false,
            OP_SEND => self.on_send(key, res)?,
            OP_TIMER => {
                conn.timer_inflight = false;
                if !conn.closing {
                    self.step(key)?;
                }
            }
            OP_CANCEL => conn.cancel_inflight = conn.cancel_inflight.saturating_sub(1),
            OP_UP_CONNECT => self.on_up_connect(key, res)?,
            OP_UP_SEND => self.on_up_send(key, res)?,
            OP_UP_RECV => self.on_up_recv(key, res)?,
            OP_UP_LINK => self.on_up_link(key)?,
            OP_WATCH => self.on_watch(key, res)?,
            OP_CANCEL_UP => {
                if let Some(up) = conn.up.as_mut() {
                    up.cancel_inflight = up.cancel_inflight.saturating_sub(1);
                }
            }
            _ => {}
        }
        self.maybe_finish_close(key);
        Ok(())
    }

    fn accepted(&mut self, fd: RawFd) {
        set_nodelay(fd);
        let shared = &self.shared;
        let Some(id) = shared
            .table
            .alloc(self.id, fd, shared.cfg.args.budget, monotonic_ns())
        else {
            self.refuse_at_capacity(fd);
            return;
        };
        // The slot's per-turn facts start empty: a terminal prepared for the stream that had
        // the slot before must never be sent for this one.
        *shared.meta(id.slot) = crate::halt::TurnMeta::default();
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
                return;
            }
        }
        shared.metrics.dataplane.streams_active.inc();
        let conn = Conn {
            fd,
            id,
            rbuf: Vec::with_capacity(RECV_CHUNK),
            wbuf: Vec::with_capacity(4096),
            woff: 0,
            sending: None,
            recv_inflight: false,
            link_inflight: false,
            timer_inflight: false,
            cancel_inflight: 0,
            timer_ts: Box::new(timespec(shared.cfg.token_interval)),
            read_ts: Box::new(timespec(shared.cfg.request_timeout)),
            continue_sent: false,
            short_write: false,
            reading: true,
            pending_terminal: false,
            closing: false,
            outcome: Outcome::Open,
            turn: None,
            up: None,
            watch_inflight: false,
            watch_buf: Box::new([0; 16]),
            peer_eof: false,
            watch_ts: Box::new(timespec(proxy::WATCH_PERIOD)),
            frame_arrived_ns: 0,
        };
        let key = self.conns.insert(conn);
        if let Err(e) = self.arm_recv(key) {
            tracing::error!(error = %e, "arming recv failed");
            self.begin_close(key);
        }
    }

    /// At `--max-streams`: answer 503 and close. With the gate, the connection was governed
    /// at establishment, so it gets an untripped policy with no budget first (no tokens, and
    /// a lost heartbeat still stops it).
    fn refuse_at_capacity(&self, fd: RawFd) {
        let shared = &self.shared;
        shared.metrics.dataplane.rejected(503);
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
        let mut out = Vec::new();
        http::write_error_response(
            &mut out,
            &HttpError::new(
                503,
                "server_error",
                "haltd is at --max-streams; retry later",
            ),
            None,
        );
        // SAFETY: plain non-blocking write and close of the socket we just accepted.
        unsafe {
            libc::send(
                fd,
                out.as_ptr().cast(),
                out.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            );
            libc::close(fd);
        }
    }

    fn arm_recv(&mut self, key: usize) -> io::Result<()> {
        let conn = &mut self.conns[key];
        let max = http::MAX_HEAD_BYTES + self.shared.cfg.args.max_body_bytes + 1;
        if conn.rbuf.len() >= max {
            return Ok(());
        }
        conn.rbuf.reserve(RECV_CHUNK.min(max - conn.rbuf.len()));
        let spare = conn.rbuf.capacity() - conn.rbuf.len();
        let want = spare.min(max - conn.rbuf.len());
        // SAFETY: the pointer is into the spare capacity of `rbuf`, which is not touched or
        // reallocated until this recv completes.
        let ptr = unsafe { conn.rbuf.as_mut_ptr().add(conn.rbuf.len()) };
        let recv = opcode::Recv::new(types::Fd(conn.fd), ptr, want as u32)
            .build()
            .flags(squeue::Flags::IO_LINK)
            .user_data(ud(key, OP_RECV));
        let ts: *const types::Timespec = &*conn.read_ts;
        let link = opcode::LinkTimeout::new(ts)
            .build()
            .user_data(ud(key, OP_LINK_TIMEOUT));
        conn.recv_inflight = true;
        conn.link_inflight = true;
        self.push(&recv)?;
        self.push(&link)
    }

    fn on_recv(&mut self, key: usize, res: i32) -> io::Result<()> {
        let conn = &mut self.conns[key];
        if conn.closing || !conn.reading {
            return Ok(());
        }
        if res == -libc::ECANCELED {
            conn.reading = false;
            return self.reply_error(
                key,
                &HttpError::new(
                    408,
                    "invalid_request_error",
                    "the request did not arrive in time",
                ),
            );
        }
        if res <= 0 {
            // The client went away before sending a whole request.
            conn.outcome = Outcome::ClientGone;
            self.begin_close(key);
            return Ok(());
        }
        // SAFETY: the kernel wrote `res` bytes into the spare capacity we handed it.
        unsafe { conn.rbuf.set_len(conn.rbuf.len() + res as usize) };
        let max_body = self.shared.cfg.args.max_body_bytes;
        let head = match http::parse_head(&conn.rbuf, max_body) {
            Ok(Some(h)) => h,
            Ok(None) => return self.arm_recv(key),
            Err(e) => {
                conn.reading = false;
                return self.reply_error(key, &e);
            }
        };
        let have = conn.rbuf.len() - head.head_len;
        if have < head.content_length {
            if head.expect_continue && !conn.continue_sent {
                conn.continue_sent = true;
                conn.wbuf.clear();
                conn.wbuf
                    .extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
                if self
                    .shared
                    .table
                    .slot(conn.id.slot)
                    .begin_frame(false, false, conn.wbuf.len())
                {
                    // The rest of the body is read after this send completes: one
                    // operation on `wbuf` at a time.
                    return self.send(key, SendKind::Continue100);
                } else {
                    return self.halt(key);
                }
            }
            return self.arm_recv(key);
        }
        if have > head.content_length {
            conn.reading = false;
            return self.reply_error(
                key,
                &HttpError::bad_request(
                    "bytes after the request body (pipelining is not supported)",
                ),
            );
        }
        conn.reading = false;
        self.route(key, head)
    }

    fn route(&mut self, key: usize, head: RequestHead) -> io::Result<()> {
        let path = head.path.split('?').next().unwrap_or_default();
        let endpoint = match path {
            "/v1/chat/completions" => Some(Endpoint::Chat),
            "/v1/completions" => Some(Endpoint::Completion),
            _ => None,
        };
        let proxied = self.shared.cfg.args.source == SourceKind::Openai;
        match (head.method.as_str(), path, endpoint) {
            ("POST", _, Some(endpoint)) if proxied => self.start_proxy_turn(key, endpoint, head),
            ("POST", _, Some(endpoint)) => {
                let key_id =
                    KeyId::of_authorization(head.authorization.as_ref().map(|a| a.as_str()));
                let body = &self.conns[key].rbuf[head.head_len..];
                match ClientRequest::parse(endpoint, body).and_then(|r| r.builtin_turn(MODEL_NAME))
                {
                    Ok(req) => self.start_turn(key, req, key_id),
                    Err(e) => self.reply_error(key, &e),
                }
            }
            (_, _, Some(_)) => {
                self.reply_error(key, &HttpError::method_not_allowed(&head.method, "POST"))
            }
            ("GET", "/healthz", _) => self.reply_health(key),
            ("GET", "/v1/models", _) if proxied => self.start_proxy_models(key, head),
            ("GET", "/v1/models", _) => {
                let body = serde_json::json!({"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "haltd"}]}).to_string();
                self.reply(key, 200, "application/json", body.as_bytes())
            }
            (_, "/healthz" | "/v1/models", _) => {
                self.reply_error(key, &HttpError::method_not_allowed(&head.method, "GET"))
            }
            _ => self.reply_error(
                key,
                &HttpError::new(
                    404,
                    "invalid_request_error",
                    format!(
                        "no route for {} {}",
                        head.method,
                        path.chars().take(200).collect::<String>()
                    ),
                )
                .with_code("not_found"),
            ),
        }
    }

    fn reply_health(&mut self, key: usize) -> io::Result<()> {
        let now = monotonic_ns();
        // A syscall or two per health check (the gate's clock), never per token.
        let hb = self.shared.heartbeat_view(now);
        let fresh = hb.fresh;
        let recorder_ok = !self.shared.recorder_failed.load(SeqCst);
        let status = match (fresh, recorder_ok) {
            (true, true) => "ok",
            (false, _) => "heartbeat_lost",
            (true, false) => "recorder_failed",
        };
        let body = serde_json::json!({
            "status": status,
            "kernel_gate": self.shared.kernel_gate_label(),
            "heartbeat_age_ms": hb.age_ms_json(),
            "heartbeat_clock": hb.clock,
            "recorder_ok": recorder_ok,
            // Not counting this health check's own connection.
            "streams_active": self.shared.table.active_count().saturating_sub(1),
        })
        .to_string();
        let code = if fresh && recorder_ok { 200 } else { 503 };
        self.reply(key, code, "application/json", body.as_bytes())
    }

    fn reply(
        &mut self,
        key: usize,
        status: u16,
        content_type: &str,
        body: &[u8],
    ) -> io::Result<()> {
        self.reply_with(key, status, content_type, body, &[])
    }

    fn reply_with(
        &mut self,
        key: usize,
        status: u16,
        content_type: &str,
        body: &[u8],
        extra: &[(&str, &str)],
    ) -> io::Result<()> {
        let conn = &mut self.conns[key];
        conn.wbuf.clear();
        http::write_head(
            &mut conn.wbuf,
            status,
            content_type,
            Some(body.len()),
            Some(conn.id),
            extra,
        );
        conn.wbuf.extend_from_slice(body);
        if status >= 400 {
            self.shared.metrics.dataplane.rejected(status);
            conn.outcome = Outcome::Rejected;
        }
        if self
            .shared
            .table
            .slot(conn.id.slot)
            .begin_final(conn.wbuf.len())
        {
            self.send(key, SendKind::Reply)
        } else {
            self.halt(key)
        }
    }

    fn reply_error(&mut self, key: usize, err: &HttpError) -> io::Result<()> {
        let conn = &mut self.conns[key];
        tracing::debug!(stream_id = %conn.id, status = err.status, message = %err.message, "request refused");
        conn.wbuf.clear();
        http::write_error_response(&mut conn.wbuf, err, Some(conn.id));
        self.shared.metrics.dataplane.rejected(err.status);
        conn.outcome = Outcome::Rejected;
        if self
            .shared
            .table
            .slot(conn.id.slot)
            .begin_final(conn.wbuf.len())
        {
            self.send(key, SendKind::Reply)
        } else {
            self.halt(key)
        }
    }

    /// The checks and slot set-up every turn starts with: refuse while shutting down or
    /// without a flight recorder, look up degraded mode for the conversation, and fix the
    /// stream's mode and budget. `None`: the turn was refused (the reply is on its way).
    fn open_turn(
        &mut self,
        key: usize,
        endpoint: Endpoint,
        client_stream: bool,
        key_id: KeyId,
        model: Arc<str>,
    ) -> io::Result<Option<(bool, Mode)>> {
        let shared = Arc::clone(&self.shared);
        if shared.shutting_down.load(SeqCst) {
            self.reply_error(
                key,
                &HttpError::new(503, "server_error", "haltd is shutting down")
                    .with_code("shutting_down"),
            )?;
            return Ok(None);
        }
        if shared.recorder_failed.load(SeqCst) {
            // Fail closed: a turn that cannot be recorded is not served.
            self.reply_error(
                key,
                &HttpError::new(
                    503,
                    "server_error",
                    "the flight recorder is unavailable; haltd serves no turns until it is restarted with a writable ledger",
                )
                .with_code("recorder_failed"),
            )?;
            return Ok(None);
        }
        // A lock per turn start (degraded-mode registry), never per token.
        shared.expire_degraded();
        let degraded = shared.modes.is_degraded(key_id);
        let conn = &mut self.conns[key];
        let slot = shared.table.slot(conn.id.slot);
        slot.created.store(crate::clock::unix_secs(), SeqCst);
        slot.endpoint.store(endpoint);
        slot.key_id.store(key_id.0, SeqCst);
        slot.degraded.store(degraded, SeqCst);
        slot.client_sse.store(client_stream, SeqCst);
        // Degraded safe mode serves streaming requests as batch: held until complete.
        let mode = if client_stream && !degraded {
            Mode::Stream
        } else {
            Mode::Batch
        };
        if mode == Mode::Batch || degraded {
            // A batch response is all or nothing, and degraded mode runs with B = 0: no
            // token may follow a trip.
            slot.budget.store(0, SeqCst);
        }
        slot.mode.store(mode);
        {
            let mut meta = shared.meta(conn.id.slot);
            meta.model = Some(model);
            meta.upstream_failure = None;
            meta.detector_trip = None;
        }
        Ok(Some((degraded, mode)))
    }

    /// The detectors of a new turn and their references for records. A detector that cannot
    /// start (an external scorer that cannot be reached) trips the stream at once.
    fn turn_governor(
        &mut self,
        key: usize,
    ) -> (TurnGovernor, Vec<String>, Option<crate::detect::Trip>) {
        let id = self.conns[key].id;
        match self.shared.detectors.turn(&id.to_string(), monotonic_ns()) {
            Ok(gov) => {
                let mut refs = vec!["operator".to_owned(), "watchdog:heartbeat".to_owned()];
                refs.extend(gov.refs());
                refs.push(match self.shared.cfg.detectors.safety.mode {
                    crate::safety::SafetyMode::Enforce => "safety:enforce".to_owned(),
                    crate::safety::SafetyMode::Observe => "safety:observe".to_owned(),
                });
                (gov, refs, None)
            }
            Err(trip) => (
                TurnGovernor::empty(),
                vec![format!("{}:hard", trip.detector)],
                Some(trip),
            ),
        }
    }

    /// The response head of a streaming turn, sent before its first token.
    fn send_stream_head(&mut self, key: usize) -> io::Result<()> {
        let conn = &mut self.conns[key];
        let slot = self.shared.table.slot(conn.id.slot);
        conn.wbuf.clear();
        http::write_head(
            &mut conn.wbuf,
            200,
            "text/event-stream",
            None,
            Some(conn.id),
            &[],
        );
        if slot.begin_frame(false, false, conn.wbuf.len()) {
            slot.headers_sent.store(true, SeqCst);
            return self.send(key, SendKind::Head);
        }
        self.halt(key)
    }

    fn start_turn(&mut self, key: usize, req: BuiltinTurn, key_id: KeyId) -> io::Result<()> {
        let Some((degraded, mode)) = self.open_turn(
            key,
            req.ask.endpoint,
            req.ask.stream,
            key_id,
            MODEL_NAME.into(),
        )?
        else {
            return Ok(());
        };
        let (gov, detector_refs, failed) = self.turn_governor(key);
        let shared = Arc::clone(&self.shared);
        let conn = &mut self.conns[key];
        let created = shared.table.slot(conn.id.slot).created.load(SeqCst);
        let model = BuiltinModel::get();
        // The built-in model's identity cannot change within a turn: before and after are
        // the model the request named (checked equal to it) with no system prompt.
        let identity = crate::safety::identity_digest(MODEL_NAME, "");
        let turn = Turn {
            source: TurnSource::Builtin(
                model
                    .stream(&req.prompt, req.seed, req.max_tokens)
                    .with_ignore_eos(req.ignore_eos),
            ),
            stream: req.ask.stream,
            logprobs: req.ask.logprobs,
            top_logprobs: req.ask.top_logprobs,
            include_usage: req.ask.include_usage,
            key_id,
            degraded,
            tokens_generated: 0,
            prompt_tokens: model.count_tokens(&req.prompt) as u64,
            enc: ChunkEncoder {
                endpoint: req.ask.endpoint,
                stream_id: conn.id,
                created,
                model: MODEL_NAME.into(),
                logprobs: req.ask.logprobs,
                top_logprobs: req.ask.top_logprobs,
                tool_calls: false,
            },
            gov,
            hold: govern::Hold::default(),
            first_frame_sent: false,
            out_text: String::new(),
            out_text_truncated: false,
            request_urls: crate::safety::extract_urls(&req.prompt),
            identity_before: Some(identity.clone()),
            identity_after: Some(identity),
            safety: None,
            text_len: 0,
            held_text: String::new(),
            held_tokens: Vec::new(),
            inflight_token: 0,
            detector_refs,
            last_token_ns: 0,
            token_gap_ns_sum: 0,
            tool_calls: Vec::new(),
        };
        conn.turn = Some(Box::new(turn));
        if !self.arm_turn_policy(key) {
            return self.halt(key);
        }
        if let Some(trip) = failed {
            return self.detector_trip(key, trip);
        }
        if mode == Mode::Stream {
            return self.send_stream_head(key);
        }
        self.step(key)
    }

    /// Gives the kernel gate the turn's own policy, before the turn's first frame: its
    /// budget (0 for batch and degraded turns, as in userspace) and E, the largest token
    /// event its encoder can write, which bounds every post-trip frame and the post-trip
    /// bytes. Written in the frame window so it can never overwrite a trip. Returns false if
    /// the turn cannot go on: the gate refused the write (the stream is tripped then, fail
    /// closed) or a trip came first.
    fn arm_turn_policy(&mut self, key: usize) -> bool {
        let shared = Arc::clone(&self.shared);
        let conn = &self.conns[key];
        let Some(turn) = conn.turn.as_ref() else {
            return false;
        };
        let slot = shared.table.slot(conn.id.slot);
        let max_event = turn.enc.max_event_bytes();
        slot.max_event_bytes.store(max_event, SeqCst);
        let Some(gate) = &shared.gate else {
            return !slot.is_tripped();
        };
        let policy = SockPolicy {
            budget: slot.budget.load(SeqCst),
            max_event_bytes: max_event,
            stream_tag: crate::halt::stream_tag(conn.id),
            ..SockPolicy::default()
        };
        // SAFETY: the connection's socket, open until the connection is dropped.
        let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(conn.fd) };
        let mut res = Ok(());
        if !slot.while_untripped(|| res = gate.set_policy(sock, &policy)) {
            return false;
        }
        if let Err(e) = res {
            shared.metrics.gate.errors.inc();
            tracing::error!(stream_id = %conn.id, error = %e, "writing the turn's kernel policy failed; halting the stream");
            let _ = shared.trip(conn.id, FailureCode::WatchdogTrip);
            return false;
        }
        true
    }

    /// Produces the next frame of a turn: heartbeat and trip checks, then a frame the
    /// exfiltration scanner released earlier, else the next token through the detectors and
    /// the scanner (sent, held back, or kept for a batch response).
    fn step(&mut self, key: usize) -> io::Result<()> {
        let shared = Arc::clone(&self.shared);
        let ignore_halt = shared.cfg.faults.emitter_ignores_halt;
        let conn = &mut self.conns[key];
        let id = conn.id;
        let slot = shared.table.slot(id.slot);
        let now = monotonic_ns();
        if !shared.heartbeat_fresh(now) && !slot.is_tripped() {
            // Fail closed: without a watchdog nobody could enforce a later halt.
            let _ = shared.trip(id, FailureCode::HeartbeatLost);
        }
        if slot.is_tripped() && !(ignore_halt && slot.state() == SlotState::Tripped) {
            return self.halt(key);
        }
        let Some(turn) = conn.turn.as_mut() else {
            return Ok(());
        };
        crate::crash::worker_step(shared.cfg.faults.panic, slot.tokens_submitted.load(SeqCst));
        if matches!(turn.source, TurnSource::Proxy) {
            return self.proxy_step(key);
        }
        if let Some(p) = turn.hold.pop_released() {
            return self.emit_pending(key, p);
        }
        if turn.hold.ending {
            return self.finish(key);
        }
        let TurnSource::Builtin(source) = &mut turn.source else {
            return Ok(());
        };
        let mode = slot.mode();
        let top_n = if turn.logprobs {
            turn.top_logprobs as usize
        } else {
            0
        };
        let Some(tok) = source.next_token(top_n) else {
            if !self.govern_end(key)? {
                return Ok(());
            }
            return self.step(key);
        };
        let produced_ns = monotonic_ns();
        let index = turn.tokens_generated;
        turn.tokens_generated += 1;
        // The detectors judge the token before it is accounted or sent: a failing token is
        // never emitted (spec 001), nor is text the exfiltration scanner flags.
        let obs = TokenObs {
            index,
            text: tok.text,
            logprob: Some(tok.logprob),
            now_ns: now,
        };
        let gate = turn.gov.on_token(&obs, monotonic_ns);
        turn.hold.scanned += tok.text.len();
        match gate {
            Gate::Trip(t) => return self.detector_trip(key, t),
            Gate::Release(n) => turn.hold.release(n),
        }
        if turn.last_token_ns != 0 {
            turn.token_gap_ns_sum += now.saturating_sub(turn.last_token_ns);
        }
        turn.last_token_ns = now;
        let offset = turn.text_len;
        turn.text_len += tok.text.len();
        let index = slot.tokens_submitted.load(SeqCst);
        if mode == Mode::Batch {
            // Held, not sent: batch responses are committed whole. (Allocates per token: the
            // batch path keeps every token for the final body.)
            turn.held_text.push_str(tok.text);
            turn.note_output(tok.text);
            turn.held_tokens.push(HeldToken {
                text: tok.text.to_owned(),
                logprob: tok.logprob,
                top: owned_top(&tok.top),
                offset,
            });
            slot.tokens_submitted.fetch_add(1, SeqCst);
            return self.schedule_next(key);
        }
        if !turn.hold.passes(turn.hold.scanned) {
            // The scanner holds text: this token waits its turn, as an owned copy.
            turn.hold.queue.push_back(govern::Pending {
                text: tok.text.to_owned(),
                kind: govern::PendingKind::Content {
                    logprob: tok.logprob,
                    top: owned_top(&tok.top),
                },
                pos: 0,
                end: turn.hold.scanned,
                offset,
                arrived_ns: produced_ns,
            });
            if let Some(p) = turn.hold.pop_released() {
                return self.emit_pending(key, p);
            }
            return self.schedule_next(key);
        }
        conn.wbuf.clear();
        turn.enc.content_event(
            &mut conn.wbuf,
            tok.text,
            &[Token {
                text: tok.text,
                logprob: tok.logprob,
                top: tok.top.as_slice(),
            }],
            &[offset],
            !turn.first_frame_sent,
        );
        turn.first_frame_sent = true;
        turn.note_output(tok.text);
        if !slot.begin_frame(true, ignore_halt, conn.wbuf.len()) {
            return self.halt(key);
        }
        turn.inflight_token = index + 1;
        conn.frame_arrived_ns = produced_ns;
        self.send(key, SendKind::Token)
    }

    fn schedule_next(&mut self, key: usize) -> io::Result<()> {
        let proxied = matches!(
            self.conns[key].turn.as_ref().map(|t| &t.source),
            Some(TurnSource::Proxy)
        );
        if proxied || self.shared.cfg.token_interval.is_zero() {
            // A proxied turn is paced by its upstream.
            return self.step(key);
        }
        let conn = &mut self.conns[key];
        let ts: *const types::Timespec = &*conn.timer_ts;
        conn.timer_inflight = true;
        let e = opcode::Timeout::new(ts)
            .build()
            .user_data(ud(key, OP_TIMER));
        self.push(&e)
    }

    /// Writes the last frame of a turn that ends normally with `reason` (the final events of
    /// a stream, or the whole batch response) and sends it.
    fn finish_with(
        &mut self,
        key: usize,
        reason: &str,
        usage: (u64, u64),
        tool_calls: Option<&serde_json::Value>,
    ) -> io::Result<()> {
        if !self.safety_at_end(key)? {
            return Ok(());
        }
        let shared = Arc::clone(&self.shared);
        let conn = &mut self.conns[key];
        let slot = shared.table.slot(conn.id.slot);
        let Some(turn) = conn.turn.as_mut() else {
            return Ok(());
        };
        conn.wbuf.clear();
        let degraded_hdr: &[(&str, &str)] = if turn.degraded {
            &[("x-haltd-mode", "degraded")]
        } else {
            &[]
        };
        if slot.mode() == Mode::Stream {
            turn.enc
                .finish_events(&mut conn.wbuf, reason, turn.include_usage.then_some(usage));
        } else {
            // Batch (asked for, or a degraded stream): the whole response in one frame.
            let tops: Vec<Vec<(&str, f32)>> = turn
                .held_tokens
                .iter()
                .map(|t| t.top.iter().map(|(s, l)| (s.as_str(), *l)).collect())
                .collect();
            let toks: Vec<Token<'_>> = turn
                .held_tokens
                .iter()
                .zip(&tops)
                .map(|(t, top)| Token {
                    text: &t.text,
                    logprob: t.logprob,
                    top,
                })
                .collect();
            let offsets: Vec<usize> = turn.held_tokens.iter().map(|t| t.offset).collect();
            if turn.stream {
                // Degraded mode serves a stream request as batch, still as SSE so that
                // streaming clients read it: one content event, the final events, [DONE].
                http::write_head(
                    &mut conn.wbuf,
                    200,
                    "text/event-stream",
                    None,
                    Some(conn.id),
                    degraded_hdr,
                );
                if !turn.held_text.is_empty() || toks.is_empty() {
                    turn.enc
                        .content_event(&mut conn.wbuf, &turn.held_text, &toks, &offsets, true);
                }
                turn.enc
                    .finish_events(&mut conn.wbuf, reason, turn.include_usage.then_some(usage));
            } else {
                let body = turn.enc.batch_body(
                    &turn.held_text,
                    &toks,
                    &offsets,
                    reason,
                    usage,
                    tool_calls,
                );
                http::write_head(
                    &mut conn.wbuf,
                    200,
                    "application/json",
                    Some(body.len()),
                    Some(conn.id),
                    degraded_hdr,
                );
                conn.wbuf.extend_from_slice(&body);
            }
        }
        if slot.begin_final(conn.wbuf.len()) {
            if slot.mode() == Mode::Batch {
                slot.headers_sent.store(true, SeqCst);
            }
            self.send(key, SendKind::Final)
        } else {
            self.halt(key)
        }
    }

    fn finish(&mut self, key: usize) -> io::Result<()> {
        let Some(turn) = self.conns[key].turn.as_ref() else {
            return Ok(());
        };
        let TurnSource::Builtin(source) = &turn.source else {
            return Ok(());
        };
        let reason = source.finish_reason().map_or("stop", |r| r.as_str());
        let usage = (turn.prompt_tokens, turn.tokens_generated);
        self.finish_with(key, reason, usage, None)
    }

    fn send(&mut self, key: usize, kind: SendKind) -> io::Result<()> {
        let conn = &mut self.conns[key];
        // `wbuf` is the kernel's until the send in flight completes; every caller checks.
        debug_assert!(conn.sending.is_none(), "second send while one is in flight");
        conn.woff = 0;
        conn.sending = Some(kind);
        self.shared
            .table
            .slot(conn.id.slot)
            .send_inflight
            .store(true, SeqCst);
        self.submit_send(key)
    }

    fn submit_send(&mut self, key: usize) -> io::Result<()> {
        let conn = &self.conns[key];
        let rest = &conn.wbuf[conn.woff..];
        let e = opcode::Send::new(types::Fd(conn.fd), rest.as_ptr(), rest.len() as u32)
            .flags(libc::MSG_NOSIGNAL)
            .build()
            .user_data(ud(key, OP_SEND));
        self.push(&e)
    }

    fn on_send(&mut self, key: usize, res: i32) -> io::Result<()> {
        let shared = Arc::clone(&self.shared);
        let conn = &mut self.conns[key];
        let Some(kind) = conn.sending else {
            return Ok(());
        };
        let slot = shared.table.slot(conn.id.slot);
        if res > 0 && conn.woff + (res as usize) < conn.wbuf.len() {
            // Short write: send the rest, and send nothing else until it is out. The rest is
            // deliberately not counted as a frame: the kernel runs the gate on it only
            // sometimes (after a failed push, tcp_bpf keeps the previous verdict and passes
            // the next send without running the program), and an uncounted kernel run only
            // makes the gate stricter, while a counted send the gate never saw would let one
            // token too many through.
            conn.woff += res as usize;
            conn.short_write = true;
            return self.submit_send(key);
        }
        if conn.short_write {
            conn.short_write = false;
            resync_frames(&shared, conn.fd, slot);
        }
        conn.sending = None;
        slot.send_inflight.store(false, SeqCst);
        let ok = res > 0;
        if kind == SendKind::Terminal {
            return self.halt_done(key, ok);
        }
        if !ok {
            tracing::debug!(stream_id = %conn.id, error = %io::Error::from_raw_os_error(-res), "send failed");
            if slot.is_tripped() {
                // The kernel gate dropped it, or the watchdog shut the socket: halt path.
                return self.halt(key);
            }
            if res == -libc::EACCES && shared.gate.is_some() {
                // The kernel gate dropped a send of a stream userspace had not tripped: it
                // saw the heartbeat lost (e.g. the whole daemon was stopped past the
                // deadline) or a stale slot. Record it as the halt it is; the drop is
                // permanent, so no terminal frame can follow.
                let cause = kernel_drop_cause(&shared, conn.fd);
                tracing::warn!(stream_id = %conn.id, cause = %cause, "the kernel gate halted a stream userspace had not tripped");
                let _ = shared.trip(conn.id, cause);
                return self.halt(key);
            }
            // The client went away. Make the stream untrippable, then close.
            let _ = slot
                .state
                .compare_exchange(SlotState::Streaming, SlotState::Done);
            if slot.is_tripped() {
                return self.halt(key);
            }
            conn.outcome = Outcome::ClientGone;
            self.begin_close(key);
            return Ok(());
        }
        if kind == SendKind::Token {
            // Account the delivered token before anything else, halt included.
            slot.tokens_delivered.fetch_add(1, SeqCst);
            shared.metrics.dataplane.tokens_emitted.inc();
            // Arrival to send completion, one lock-free observation per token frame.
            let arrived = std::mem::take(&mut conn.frame_arrived_ns);
            if arrived != 0 {
                shared
                    .metrics
                    .dataplane
                    .token_overhead
                    .observe_ns(monotonic_ns().saturating_sub(arrived));
            }
            let index = conn.turn.as_ref().map_or(0, |t| t.inflight_token);
            // τ is published before TRIPPED; a token completing while the trip is still
            // TRIPPING was handed out before the trip, so it is not post-trip.
            let published = matches!(
                slot.state(),
                SlotState::Tripped | SlotState::Halting | SlotState::Halted
            );
            if published && index > slot.trip_token_index.load(SeqCst) {
                slot.post_trip_delivered.fetch_add(1, SeqCst);
            }
            self.proxy_frame_delivered(key);
        }
        let conn = &mut self.conns[key];
        if conn.pending_terminal {
            conn.pending_terminal = false;
            return self.halt(key);
        }
        match kind {
            SendKind::Continue100 => self.arm_recv(key),
            SendKind::Probe => self.probe_sent(key),
            SendKind::Head => self.step(key),
            SendKind::Token => self.schedule_next(key),
            SendKind::Final | SendKind::Reply => {
                slot.state.store(SlotState::Done);
                if kind == SendKind::Final {
                    conn.outcome = Outcome::Completed;
                }
                self.begin_close(key);
                Ok(())
            }
            SendKind::Terminal => Ok(()),
        }
    }

    /// Halts a tripped stream from the emitter's side: claim the halt, then send the terminal
    /// frame (after any send in flight). If the watchdog holds the halt, wait for its wake-up.
    fn halt(&mut self, key: usize) -> io::Result<()> {
        if self.shared.table.slot(self.conns[key].id.slot).is_tripped() {
            // A tripped turn's generation is cancelled at once (spec: no work for nothing,
            // and vLLM frees the sequence).
            self.up_cancel(key, CancelReason::Trip);
        }
        let shared = Arc::clone(&self.shared);
        let conn = &mut self.conns[key];
        let slot = shared.table.slot(conn.id.slot);
        match slot.state() {
            SlotState::Halted => {
                conn.outcome = Outcome::Halted;
                self.begin_close(key);
                return Ok(());
            }
            SlotState::Tripped => {}
            // TRIPPING: the tripper wakes us once it is TRIPPED. HALTING: the watchdog wakes
            // us once it is HALTED.
            SlotState::Tripping | SlotState::Halting => return Ok(()),
            // Not tripped at all (a trip that came too late to take, e.g. after the final
            // frame was committed): nothing to halt, so end the connection as it stands
            // rather than wait for a wake-up that never comes.
            _ => {
                self.begin_close(key);
                return Ok(());
            }
        }
        if conn.sending.is_some() {
            conn.pending_terminal = true;
            return Ok(());
        }
        if !slot.claim_halt() {
            return Ok(());
        }
        conn.outcome = Outcome::Halted;
        let snap = slot.snapshot(conn.id.slot);
        shared.terminal_frame(&snap, &mut conn.wbuf);
        self.send(key, SendKind::Terminal)
    }

    fn halt_done(&mut self, key: usize, delivered: bool) -> io::Result<()> {
        let shared = Arc::clone(&self.shared);
        let conn = &mut self.conns[key];
        let slot = shared.table.slot(conn.id.slot);
        slot.finish_halt(Halter::Emitter, monotonic_ns());
        let refs = conn
            .turn
            .as_ref()
            .map(|t| t.detector_refs.clone())
            .unwrap_or_default();
        shared.complete_halt(&slot.snapshot(conn.id.slot), conn.fd, delivered, refs);
        self.begin_close(key);
        Ok(())
    }

    /// After a wake-up: halt every tripped stream of this worker, and close the ones the
    /// watchdog halted.
    fn scan_tripped(&mut self) {
        let ignore_halt = self.shared.cfg.faults.emitter_ignores_halt;
        let mut halt = Vec::new();
        let mut carry_on = Vec::new();
        for (key, c) in &self.conns {
            let st = self.shared.table.slot(c.id.slot).state();
            if st == SlotState::Halted || (st == SlotState::Tripped && (c.closing || !ignore_halt))
            {
                halt.push((key, c.closing));
            } else if st == SlotState::Tripped && !c.closing && !c.inflight() && c.turn.is_some() {
                // `emitter-ignores-halt`: an emitter that paused on the trip (it saw
                // TRIPPING) carries on sending tokens, so only the kernel stops it.
                carry_on.push(key);
            }
        }
        for (key, closing) in halt {
            if !closing {
                if let Err(e) = self.halt(key) {
                    tracing::error!(error = %e, "halting a stream failed");
                }
            }
            self.maybe_finish_close(key);
        }
        for key in carry_on {
            if let Err(e) = self.step(key) {
                tracing::error!(error = %e, "fault injection: resuming a stream failed");
            }
        }
    }

    fn begin_close(&mut self, key: usize) {
        let Some(conn) = self.conns.get_mut(key) else {
            return;
        };
        if conn.closing {
            return;
        }
        conn.closing = true;
        let mut cancels = Vec::new();
        if conn.timer_inflight {
            cancels.push(ud(key, OP_TIMER));
        }
        if conn.recv_inflight {
            cancels.push(ud(key, OP_RECV));
        }
        if conn.watch_inflight {
            cancels.push(ud(key, OP_WATCH));
        }
        let up_reason = if conn.outcome == Outcome::ClientGone {
            CancelReason::ClientGone
        } else {
            CancelReason::Trip
        };
        let has_up = conn.up.is_some();
        conn.cancel_inflight += cancels.len() as u32;
        for target in cancels {
            let e = opcode::AsyncCancel::new(target)
                .build()
                .user_data(ud(key, OP_CANCEL));
            if self.push(&e).is_err() {
                if let Some(c) = self.conns.get_mut(key) {
                    c.cancel_inflight -= 1;
                }
            }
        }
        if has_up {
            // Closing with the upstream still generating: a trip or a client gone (a turn
            // that finished or failed closed its upstream already, so this is a no-op then).
            self.up_cancel(key, up_reason);
        }
        self.maybe_finish_close(key);
    }

    /// Closes a connection once nothing is in flight and nobody else holds its halt.
    fn maybe_finish_close(&mut self, key: usize) {
        let Some(conn) = self.conns.get(key) else {
            return;
        };
        if !conn.closing || conn.inflight() {
            return;
        }
        let shared = Arc::clone(&self.shared);
        let slot = shared.table.slot(conn.id.slot);
        match slot.state() {
            // The watchdog is writing to this socket: it wakes us when done.
            SlotState::Halting | SlotState::Tripping => return,
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
            return;
        }
        if shared.kernel_held_bytes(conn.fd) {
            // The egress check holds bytes of this stream back: a graceful close would queue
            // the FIN behind them for ever. Reset the connection instead.
            let _ = crate::gate::selftest::set_linger_zero(&conn.fd);
        }
        let conn = self.conns.remove(key);
        // SAFETY: no operation on this descriptor is in flight and the watchdog is done
        // with it (the slot is not HALTING), so nothing else uses it.
        unsafe { libc::close(conn.fd) };
        if let Some(up) = conn.up.as_ref() {
            // SAFETY: nothing is in flight on the upstream socket (`inflight` covers it).
            unsafe { libc::close(up.fd()) };
        }
        shared.metrics.dataplane.streams_active.dec();
        self.record_turn(&conn);
        shared.table.release(conn.id);
    }

    fn record_turn(&self, conn: &Conn) {
        let Some(turn) = conn.turn.as_ref() else {
            return; // not a turn: health checks and refused requests
        };
        let shared = &self.shared;
        let slot = shared.table.slot(conn.id.slot);
        let snap = slot.snapshot(conn.id.slot);
        let outcome = if snap.trip_cause.is_some() {
            Outcome::Halted
        } else {
            conn.outcome
        };
        shared.metrics.dataplane.finished(outcome);
        let mut rec = shared.base_record(RecordKind::Turn, &snap);
        rec.outcome = Some(outcome.as_str().to_owned());
        rec.detector_refs = turn.detector_refs.clone();
        let gaps = turn.tokens_generated.saturating_sub(1).max(1);
        rec.latency_bucket = Some(latency_bucket(turn.token_gap_ns_sum / gaps).to_owned());
        for t in turn.gov.set.observed() {
            shared.metrics.detectors.observed(t.detector, t.code);
        }
        let detectors = turn.gov.summary();
        // The timing fields of spec 000 §6.1 come from the timing detectors.
        let timing = crate::detect::timing::fhr_timing_from_json(
            detectors.pointer("/latency_anomaly/summary"),
            detectors.pointer("/compute_budget/summary"),
        );
        if let Some(b) = timing.latency_bucket {
            rec.latency_bucket = Some(b.to_owned());
        }
        rec.rts_mode = timing.rts_mode.as_str().to_owned();
        rec.tig_breach = timing.tig_breach;
        rec.detectors = Some(detectors);
        rec.safety_verdict = Some(match &turn.safety {
            Some(v) => v.clone(),
            // Not judged at a clean end: judge what the turn did (its halt, if any, ended
            // with the typed terminal event).
            None => serde_json::to_value(turn.safety_verdict(shared, true))
                .unwrap_or(serde_json::Value::Null),
        });
        // TURN-ACID: only a turn that ended cleanly commits; a failed one leaves the
        // conversation's state as it was, and tool calls it already emitted are dispatched
        // effects that need reconciliation.
        let committed = outcome == Outcome::Completed;
        rec.turn_status = Some(if committed { "committed" } else { "failed" }.to_owned());
        let tool_status = if committed {
            ToolCallKind::Committed
        } else {
            ToolCallKind::Dispatched
        };
        rec.tool_calls = turn
            .tool_calls
            .iter()
            .map(|c| {
                let mut c = c.clone();
                c["status"] = tool_status.as_str().into();
                if !committed {
                    c["reconciliation"] = "required".into();
                }
                c
            })
            .collect();
        if !turn.tool_calls.is_empty() {
            shared
                .metrics
                .upstream
                .tool_calls(tool_status, turn.tool_calls.len() as u64);
        }
        if committed {
            let tokens = if snap.mode == Mode::Batch {
                turn.tokens_generated
            } else {
                snap.tokens_delivered
            };
            shared.modes.commit_turn(
                turn.key_id,
                &conn.id.to_string(),
                tokens,
                turn.tool_calls.len() as u64,
            );
        } else {
            shared.modes.fail_turn(turn.key_id);
        }
        let policy = shared.cfg.sampling;
        if let Some(p) = &conn.up {
            rec.upstream = Some(p.record_value(policy.record_token_text));
            if outcome == Outcome::UpstreamFailed {
                rec.failure_codes = vec![FailureCode::UpstreamFailure.as_str().to_owned()];
            }
        }
        let started = snap.started_ns;
        rec.message = Some(format!(
            "turn of {} ms",
            monotonic_ns().saturating_sub(started) / 1_000_000
        ));
        // Spec 000 §6.2: every turn that is not normal is recorded, a normal one with
        // probability --turn-sample-rate. Everything above (metrics, the TURN-ACID commit)
        // happened for every turn; only the ledger line is sampled.
        let decision = crate::sampling::decide_now(&rec, policy.turn_sample_rate);
        shared.metrics.ledger.turn_record(decision.kind());
        let Some(sampling) = decision.field(policy.turn_sample_rate) else {
            return;
        };
        rec.sampling = Some(sampling);
        if policy.record_token_text {
            // The text SafetyCheck keeps anyway (`Turn::out_text`, bounded): recording it adds
            // no per-token work, only this copy per recorded turn.
            let (text, truncated) =
                crate::sampling::text_excerpt(&turn.out_text, turn.out_text_truncated);
            rec.text = Some(text);
            rec.text_truncated = Some(truncated);
        }
        shared.record(rec);
    }
}

/// After a short write, brings the frame count up to the gate's own: the rest of a short write
/// sometimes runs the gate program again (a kernel frame userspace did not count), and from
/// then on a trip's kernel limit would be one frame stricter than B. Only on this rare path
/// (the client reads slower than haltd writes), never per token.
fn resync_frames(shared: &HaltCore, fd: RawFd, slot: &crate::stream::Slot) {
    let Some(gate) = &shared.gate else {
        return;
    };
    // SAFETY: `fd` is this connection's open socket; it is closed only after this returns.
    let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    if let Ok(crate::gate::SocketView {
        state: Some(st), ..
    }) = gate.socket(sock)
    {
        // Never lower it: a trip may have read the count already, and lower is looser.
        slot.frames_submitted.fetch_max(st.frames, SeqCst);
    }
}

/// Why the gate dropped a send of a stream userspace had not tripped, from its socket state.
fn kernel_drop_cause(shared: &HaltCore, fd: RawFd) -> FailureCode {
    let Some(gate) = &shared.gate else {
        return FailureCode::WatchdogTrip;
    };
    // SAFETY: `fd` is this connection's open socket; it is closed only after this returns.
    let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    match gate.socket(sock) {
        Ok(crate::gate::SocketView {
            state: Some(st), ..
        }) if st.trip_reason == haltd_common::trip_reason::HEARTBEAT => FailureCode::HeartbeatLost,
        _ => FailureCode::WatchdogTrip,
    }
}

/// Mean inter-token latency bucket of a turn (FHR `latency_bucket`).
fn latency_bucket(mean_gap_ns: u64) -> &'static str {
    match mean_gap_ns {
        0..=1_000_000 => "le_1ms",
        1_000_001..=10_000_000 => "le_10ms",
        10_000_001..=100_000_000 => "le_100ms",
        _ => "gt_100ms",
    }
}

/// How far a wrapping kernel counter moved since `seen` (which it then becomes); `None` when
/// it did not.
fn counter_delta(now: u32, seen: &mut u32) -> Option<u32> {
    let n = now.wrapping_sub(*seen);
    *seen = now;
    (n != 0).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `Worker::check_ring` relies on: completions past a full completion ring set the
    /// overflow flag (kernels with IORING_FEAT_NODROP keep them in a backlog) or count as
    /// dropped (older kernels), and reaping then entering the kernel again flushes the backlog.
    #[test]
    fn a_full_completion_ring_shows_in_the_counters_check_ring_reads() {
        let Ok(mut ring) = IoUring::new(2) else {
            eprintln!("no io_uring here (kernel.io_uring_disabled?): skipped");
            return;
        };
        let cq = ring.params().cq_entries();
        for i in 0..cq + 2 {
            let nop = opcode::Nop::new().build().user_data(u64::from(i));
            // SAFETY: a NOP points at no memory.
            unsafe { ring.submission().push(&nop) }.expect("room after each submit");
            ring.submit().expect("submit");
        }
        let overflowed = ring.submission().cq_overflow();
        let dropped = ring.completion().overflow();
        assert!(
            overflowed || dropped == 2,
            "flag {overflowed}, dropped {dropped}"
        );
        assert_eq!(ring.submission().dropped(), 0);
        let mut reaped = ring.completion().count() as u32;
        if overflowed {
            ring.submit_and_wait(0).expect("enter flushes the backlog");
            reaped += ring.completion().count() as u32;
            assert!(!ring.submission().cq_overflow(), "backlog flushed");
            assert_eq!(reaped, cq + 2, "no completion lost");
        }
    }
}
