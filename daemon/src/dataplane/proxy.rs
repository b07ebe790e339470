//! The `openai` source: a turn proxied to an OpenAI-compatible upstream (vLLM, llama.cpp
//! server, Ollama), on the same io_uring as the client connection.
//!
//! Per turn: connect (linked timeout) → send the request (always `stream: true`, logprobs on;
//! [`crate::upstream::prepare_turn`] of the [`crate::wire::ClientRequest`]) → receive the response (linked timeout: time to the
//! first event, then the inter-token deadline) → parse it into [`Item`]s → govern and emit
//! them one frame at a time, exactly like built-in tokens (detectors, frame accounting, the
//! kernel gate). The upstream socket is not governed: only client-facing sends carry tokens.
//!
//! Cancellation: a trip, a client that goes away, or a failure shuts the upstream socket down
//! (`shutdown(SHUT_RDWR)` sends the FIN at once, whatever is in flight on it; vLLM aborts a
//! generation whose connection closes) and the turn's record says why.
//!
//! Failures map to a typed end: before the client's response began, an HTTP error whose
//! status says whose fault it was (the upstream's 4xx passes through as that 4xx, its 5xx and
//! every transport failure become 502, timeouts 504); after it began, a trip with
//! `UPSTREAM_FAILURE` whose terminal event carries `upstream: {kind, message}`.
//!
//! Per event the upstream's JSON is parsed into owned values (`serde_json`): this allocates
//! per token, unlike the built-in source; it is bounded by the event size limit.

use std::{
    collections::{BTreeSet, VecDeque},
    io,
    os::fd::RawFd,
    sync::atomic::Ordering::SeqCst,
    sync::Arc,
};

use io_uring::{opcode, squeue, types};
use serde_json::{json, Value};

use super::{
    govern, timespec, ud, HeldToken, SendKind, Turn, TurnSource, Worker, OP_UP_CONNECT, OP_UP_LINK,
    OP_UP_RECV, OP_UP_SEND, OP_WATCH,
};
use crate::{
    clock::monotonic_ns,
    codes::FailureCode,
    detect::{pipeline::Gate, DetectorId, TokenObs, TripKind},
    metrics::upstream::ToolCallKind,
    modes::KeyId,
    stream::{Mode, Outcome, SlotState},
    upstream::{
        self,
        framing::{self, Split},
        CancelReason, FinishReason, ResponseReader, SseParser, UpToken, UpstreamError,
        UpstreamEvent, UpstreamFailure, UpstreamFailureKind,
    },
    wire::{self, ChunkEncoder, ClientRequest, Endpoint, HttpError, RequestHead},
};

/// Largest upstream response head.
const MAX_UPSTREAM_HEAD: usize = 64 * 1024;
/// Largest single SSE event from the upstream.
const MAX_UPSTREAM_EVENT: usize = 1 << 20;
/// Largest non-streaming upstream body (error bodies, `/v1/models`).
const MAX_UPSTREAM_BODY: usize = 4 << 20;
/// Receive buffer per upstream connection.
const UP_RECV_CHUNK: usize = 16 * 1024;
/// Items parsed but not yet emitted before haltd stops reading the upstream (TCP then pushes
/// back on it): a slow client slows the generation instead of growing memory.
const MAX_QUEUED_ITEMS: usize = 256;

/// What an upstream exchange is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Purpose {
    Turn,
    /// `GET /v1/models`, relayed whole.
    Models,
}

/// One thing the upstream said, in the order the client sees it.
#[derive(Debug)]
enum Item {
    /// Text and the tokens the detectors observe before any of its frames goes out: one token
    /// (`Split::Token`, `tokens` = that token), or text whose tokens (possibly none) do not
    /// spell it (`Split::Chars`); and when the receive that completed its event came back
    /// (`haltd_token_overhead_seconds`).
    Content {
        text: String,
        tokens: Vec<UpToken>,
        split: Split,
        arrived_ns: u64,
    },
    /// A tool-call delta, with the logprobs of its tokens (scored like content) and its
    /// arrival.
    ToolCalls(Value, Vec<UpToken>, u64),
    Finish(FinishReason),
    Usage(u64, u64),
    Done,
    Error(UpstreamError),
    /// The stream broke here (malformed event): what came before it is still emitted.
    Broken(String),
}

/// The upstream side of a connection: socket, buffers, parser state, and what happened.
#[derive(Debug)]
pub(super) struct Upstream {
    purpose: Purpose,
    fd: RawFd,
    addr: Box<libc::sockaddr_storage>,
    addr_len: libc::socklen_t,
    wbuf: Vec<u8>,
    woff: usize,
    rbuf: Vec<u8>,
    ts: Box<types::Timespec>,
    connect_inflight: bool,
    send_inflight: bool,
    recv_inflight: bool,
    /// Linked timeouts not yet completed (connect, send and receive each carry one).
    link_inflight: u32,
    pub(super) cancel_inflight: u32,
    reader: ResponseReader,
    sse: SseParser,
    body: Vec<u8>,
    items: VecDeque<Item>,
    /// Set once the exchange is over (done, failed or cancelled): nothing more is read.
    finished: bool,
    /// `[DONE]` (or a break in the stream) is queued: nothing after it is read.
    saw_done: bool,
    finish: Option<FinishReason>,
    usage: Option<(u64, u64)>,
    status: Option<u16>,
    retry_after: Option<String>,
    failure: Option<UpstreamFailure>,
    /// The end of `failure`'s message that quotes the upstream (its error message), which
    /// records leave out unless `--record-token-text`: some backends build it from the
    /// request (a validation error that echoes the input).
    failure_quote: Option<String>,
    cancelled: Option<CancelReason>,
    events: u64,
    started_ns: u64,
    first_event_ns: u64,
    last_event_ns: u64,
    /// Tool-call deltas merged by index (the batch body, and the record).
    tools: Vec<Value>,
    /// Tool calls first seen in the frame in flight: dispatched once the kernel accepts it.
    inflight_tools: Vec<Value>,
    /// The model the upstream says it answered with (its chunks' `model`).
    model: Option<String>,
    /// The system prompt of the request sent (SafetyCheck's identity).
    system_prompt: String,
    api_path: &'static str,
}

impl Upstream {
    pub(super) fn inflight(&self) -> bool {
        self.connect_inflight
            || self.send_inflight
            || self.recv_inflight
            || self.link_inflight > 0
            || self.cancel_inflight > 0
    }

    pub(super) fn fd(&self) -> RawFd {
        self.fd
    }

    /// The tool calls the frame about to be sent starts (dispatched once it is accepted).
    pub(super) fn set_inflight_tools(&mut self, started: Vec<Value>) {
        self.inflight_tools = started;
    }

    /// The FHR `upstream` field; without `record_text`, what the upstream's error message
    /// said is replaced by its length and SHA-256.
    pub(super) fn record_value(&self, record_text: bool) -> Value {
        let failure = self.failure.as_ref().map(|f| {
            let message = &f.message;
            // The quote ends the message (`<what haltd saw>: <quote>`).
            let message = match self.failure_quote.as_deref() {
                Some(q) if !record_text && !q.is_empty() => match message.strip_suffix(q) {
                    Some(head) => format!("{head}{}", crate::sampling::withheld(q)),
                    None => crate::sampling::withheld(message),
                },
                _ => message.clone(),
            };
            json!({"kind": f.kind.as_str(), "message": message})
        });
        json!({
            "path": self.api_path,
            "status": self.status,
            "events": self.events,
            "first_event_ms": (self.first_event_ns != 0)
                .then(|| (self.first_event_ns - self.started_ns) as f64 / 1e6),
            "finish_reason": self.finish.as_ref().map(FinishReason::as_str),
            "failure": failure,
            "cancelled": self.cancelled.is_some(),
            "cancel_reason": self.cancelled.map(CancelReason::as_str),
        })
    }
}

fn sockaddr(addr: std::net::SocketAddr) -> (Box<libc::sockaddr_storage>, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: Box<libc::sockaddr_storage> = Box::new(unsafe { std::mem::zeroed() });
    let len = match addr {
        std::net::SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&raw mut *ss).cast::<libc::sockaddr_in>(), sin) };
            size_of::<libc::sockaddr_in>()
        }
        std::net::SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { std::ptr::write((&raw mut *ss).cast::<libc::sockaddr_in6>(), sin6) };
            size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// The client's request, parsed once, prepared for the upstream, with SafetyCheck's inputs
/// taken from the same parsed request (the URLs it cites, its system prompt).
fn prepare_proxied(
    endpoint: Endpoint,
    body: &[u8],
    degraded: bool,
) -> Result<(upstream::UpstreamTurn, BTreeSet<String>, String), HttpError> {
    let req = ClientRequest::parse(endpoint, body)?;
    let urls = crate::safety::request_sources(req.json());
    let system_prompt = crate::safety::system_prompt(req.json());
    Ok((upstream::prepare_turn(req, degraded)?, urls, system_prompt))
}

/// How often a half-closed client is checked for a reset while its turn waits on the upstream.
pub(super) const WATCH_PERIOD: std::time::Duration = std::time::Duration::from_millis(100);

/// Whether the connection was reset or closed by the peer (TCP state `CLOSE`): a client that
/// closed for good answers the interim response haltd sends after its FIN with a reset.
fn peer_reset(fd: RawFd) -> bool {
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `info`, a live tcp_info.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut len,
        )
    };
    // TCP_CLOSE is 7; an error reading the state counts as gone.
    rc != 0 || info.tcpi_state == 7
}

/// Splits an upstream chunk into items ([`framing`]): one per token when the tokens spell the
/// content exactly (vLLM may put several tokens in one chunk), else one for the content, framed
/// per character; a tool-call delta is its own item. Every item arrived at `arrived_ns` (the
/// receive that completed the chunk's event).
fn push_chunk(items: &mut VecDeque<Item>, c: upstream::UpstreamChunk, arrived_ns: u64) {
    let spelled = c.tokens_match_content();
    let upstream::UpstreamChunk {
        content,
        tokens,
        tool_calls,
        finish_reason,
        usage,
        ..
    } = c;
    match tool_calls {
        // A tool-call chunk: its logprobs belong to the call's tokens.
        Some(calls) if content.is_empty() => {
            items.push_back(Item::ToolCalls(calls, tokens, arrived_ns));
        }
        calls => {
            if spelled && tokens.len() == 1 {
                // The common case: the content is the token's text, moved, not copied.
                items.push_back(Item::Content {
                    text: content,
                    tokens,
                    split: Split::Token,
                    arrived_ns,
                });
            } else if spelled {
                for t in tokens {
                    items.push_back(Item::Content {
                        text: t.text.clone(),
                        tokens: vec![t],
                        split: Split::Token,
                        arrived_ns,
                    });
                }
            } else if !content.is_empty() || !tokens.is_empty() {
                items.push_back(Item::Content {
                    text: content,
                    tokens,
                    split: Split::Chars,
                    arrived_ns,
                });
            }
            // Content and a tool call in one chunk (rare): the call after the text, its
            // arguments per character.
            if let Some(calls) = calls {
                items.push_back(Item::ToolCalls(calls, Vec::new(), arrived_ns));
            }
        }
    }
    if let Some(r) = finish_reason {
        items.push_back(Item::Finish(r));
    }
    if let Some(u) = usage {
        items.push_back(Item::Usage(u.prompt_tokens, u.completion_tokens));
    }
}

/// Merges one tool-call delta list into `tools` (by `index`); returns the calls it started
/// (`{index, id, name}`), which are the ones a frame carrying this delta dispatches.
fn merge_tool_calls(tools: &mut Vec<Value>, delta: &Value) -> Vec<Value> {
    let mut started = Vec::new();
    let Some(list) = delta.as_array() else {
        return started;
    };
    for d in list {
        let index = d.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
        while tools.len() <= index {
            tools.push(
                json!({"id": null, "type": "function", "function": {"name": "", "arguments": ""}}),
            );
        }
        let t = &mut tools[index];
        let fresh = t["id"].is_null();
        if let Some(id) = d.get("id").and_then(Value::as_str) {
            t["id"] = id.into();
        }
        if let Some(f) = d.get("function") {
            for key in ["name", "arguments"] {
                if let Some(piece) = f.get(key).and_then(Value::as_str) {
                    let cur = t["function"][key].as_str().unwrap_or("").to_owned();
                    t["function"][key] = (cur + piece).into();
                }
            }
        }
        if fresh && !t["id"].is_null() {
            started.push(json!({"index": index, "id": t["id"], "name": t["function"]["name"]}));
        }
    }
    started
}

impl Worker {
    /// Opens an upstream exchange for connection `key`: socket, request bytes, connect.
    #[expect(
        clippy::too_many_arguments,
        reason = "one call site per purpose; a struct would only rename them"
    )]
    fn open_upstream_with(
        &mut self,
        key: usize,
        purpose: Purpose,
        api_path: &'static str,
        method: &str,
        authorization: Option<&str>,
        body: Option<&[u8]>,
        system_prompt: String,
    ) -> io::Result<()> {
        let shared = Arc::clone(&self.shared);
        let Some(url) = shared.cfg.upstream.as_ref() else {
            return self.reply_error(
                key,
                &HttpError::new(500, "server_error", "no upstream configured"),
            );
        };
        let addr = url.addrs[0];
        let (ss, addr_len) = sockaddr(addr);
        let family = if addr.is_ipv4() {
            libc::AF_INET
        } else {
            libc::AF_INET6
        };
        // SAFETY: plain socket creation; the descriptor is owned by this connection.
        let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            return self.reply_error(
                key,
                &HttpError::new(
                    503,
                    "server_error",
                    format!("cannot open a socket to the upstream: {e}"),
                ),
            );
        }
        super::set_nodelay(fd);
        let mut wbuf = Vec::new();
        upstream::write_http_request(&mut wbuf, url, method, api_path, authorization, body);
        let up = Upstream {
            purpose,
            fd,
            addr: ss,
            addr_len,
            wbuf,
            woff: 0,
            rbuf: Vec::with_capacity(UP_RECV_CHUNK),
            ts: Box::new(timespec(shared.cfg.upstream_connect_timeout)),
            connect_inflight: false,
            send_inflight: false,
            recv_inflight: false,
            link_inflight: 0,
            cancel_inflight: 0,
            reader: ResponseReader::new(MAX_UPSTREAM_HEAD),
            sse: SseParser::new(MAX_UPSTREAM_EVENT),
            body: Vec::new(),
            items: VecDeque::new(),
            finished: false,
            saw_done: false,
            finish: None,
            usage: None,
            status: None,
            retry_after: None,
            failure: None,
            failure_quote: None,
            cancelled: None,
            events: 0,
            started_ns: monotonic_ns(),
            first_event_ns: 0,
            last_event_ns: 0,
            tools: Vec::new(),
            inflight_tools: Vec::new(),
            model: None,
            system_prompt,
            api_path,
        };
        let conn = &mut self.conns[key];
        conn.up = Some(Box::new(up));
        let up = conn.up.as_mut().expect("just set");
        let addr_ptr: *const libc::sockaddr = (&raw const *up.addr).cast();
        let connect = opcode::Connect::new(types::Fd(fd), addr_ptr, up.addr_len)
            .build()
            .flags(squeue::Flags::IO_LINK)
            .user_data(ud(key, OP_UP_CONNECT));
        up.connect_inflight = true;
        self.push_with_deadline(key, &connect)?;
        self.arm_watch(key)
    }

    /// Watches the client socket while the turn waits on the upstream: a client that goes
    /// away cancels the upstream generation at once, not at the next token. Before the client
    /// half-closed, a receive (EOF or an error ends it); after, a timer that looks every
    /// [`WATCH_PERIOD`] for the reset only a client that closed for good sends back (see
    /// `on_watch`). A poll cannot wait for it: io_uring reports the peer's FIN (`POLLRDHUP`)
    /// whatever the mask.
    fn arm_watch(&mut self, key: usize) -> io::Result<()> {
        let conn = &mut self.conns[key];
        if conn.watch_inflight || conn.closing {
            return Ok(());
        }
        let e = if conn.peer_eof {
            if self
                .shared
                .table
                .slot(conn.id.slot)
                .headers_sent
                .load(SeqCst)
            {
                // The response is under way: a client that left shows at the next send.
                return Ok(());
            }
            let ts: *const types::Timespec = &*conn.watch_ts;
            opcode::Timeout::new(ts)
                .build()
                .user_data(ud(key, OP_WATCH))
        } else {
            let ptr = conn.watch_buf.as_mut_ptr();
            opcode::Recv::new(types::Fd(conn.fd), ptr, conn.watch_buf.len() as u32)
                .build()
                .user_data(ud(key, OP_WATCH))
        };
        conn.watch_inflight = true;
        self.push(&e)
    }

    pub(super) fn on_watch(&mut self, key: usize, res: i32) -> io::Result<()> {
        let shared = Arc::clone(&self.shared);
        let conn = &mut self.conns[key];
        conn.watch_inflight = false;
        if conn.closing || res == -libc::ECANCELED {
            return Ok(());
        }
        if res > 0 && !conn.peer_eof {
            // Bytes after the request: not served (one request per connection); stop
            // watching rather than spin on a chatty client.
            return Ok(());
        }
        if conn.peer_eof && res == -libc::ETIME && !peer_reset(conn.fd) {
            // Still a half-closed client that reads: look again later.
            return self.arm_watch(key);
        }
        if res == 0 && !conn.peer_eof {
            // EOF: the client half-closed (it may still be reading, as `nc -N` and many
            // HTTP/1.0-style tools do) or closed. A half-closed client is served like any
            // other. To tell the two apart before the response begins, send an interim
            // `100 Continue` (HTTP/1.1 clients skip 1xx responses): a client that closed
            // answers it with a reset, which the poll armed next sees.
            conn.peer_eof = true;
            let slot = shared.table.slot(conn.id.slot);
            if slot.headers_sent.load(SeqCst) || conn.sending.is_some() {
                return self.arm_watch(key);
            }
            conn.wbuf.clear();
            conn.wbuf
                .extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
            if !slot.begin_frame(false, false, conn.wbuf.len()) {
                return self.halt(key);
            }
            return self.send(key, SendKind::Probe);
        }
        // An error, or a reset or hang-up after EOF: the client went away. Make the stream
        // untrippable, cancel the upstream.
        let slot = shared.table.slot(conn.id.slot);
        let _ = slot
            .state
            .compare_exchange(SlotState::Streaming, SlotState::Done);
        if slot.is_tripped() {
            return self.halt(key);
        }
        tracing::debug!(stream_id = %conn.id, "client went away; cancelling the upstream request");
        conn.outcome = Outcome::ClientGone;
        self.up_cancel(key, CancelReason::ClientGone);
        self.begin_close(key);
        Ok(())
    }

    /// The interim response sent to a client that half-closed went out: watch for its reset,
    /// and carry on with whatever the upstream sent meanwhile.
    pub(super) fn probe_sent(&mut self, key: usize) -> io::Result<()> {
        self.arm_watch(key)?;
        let conn = &self.conns[key];
        let slot = self.shared.table.slot(conn.id.slot);
        // The upstream's head may have arrived while the probe was in flight: the client's
        // response begins now, as it would have then.
        let head_due = slot.mode() == Mode::Stream
            && !slot.headers_sent.load(SeqCst)
            && conn
                .up
                .as_ref()
                .is_some_and(|u| u.reader.head().is_some() && !u.finished);
        if head_due {
            return self.send_stream_head(key);
        }
        self.proxy_step(key)
    }

    /// `POST /v1/chat/completions` or `/v1/completions` with `--source openai`.
    pub(super) fn start_proxy_turn(
        &mut self,
        key: usize,
        endpoint: Endpoint,
        head: RequestHead,
    ) -> io::Result<()> {
        let auth = head.authorization.as_ref().map(|a| a.as_str().to_owned());
        let key_id = KeyId::of_authorization(auth.as_deref());
        // Degraded mode decides what is forwarded, so look it up before preparing the body.
        self.shared.expire_degraded();
        let degraded = self.shared.modes.is_degraded(key_id);
        let body = &self.conns[key].rbuf[head.head_len..];
        let (up, request_urls, system_prompt) = match prepare_proxied(endpoint, body, degraded) {
            Ok(v) => v,
            Err(e) => return self.reply_error(key, &e),
        };
        let model: Arc<str> = up.model.as_str().into();
        let Some((degraded, _mode)) =
            self.open_turn(key, endpoint, up.ask.stream, key_id, Arc::clone(&model))?
        else {
            return Ok(());
        };
        let (gov, mut detector_refs, failed) = self.turn_governor(key);
        detector_refs.push("upstream:integrity".to_owned());
        let identity_before = crate::safety::identity_digest(&up.model, &system_prompt);
        let shared = Arc::clone(&self.shared);
        let conn = &mut self.conns[key];
        let created = shared.table.slot(conn.id.slot).created.load(SeqCst);
        let ask = up.ask;
        conn.turn = Some(Box::new(Turn {
            source: TurnSource::Proxy,
            stream: ask.stream,
            logprobs: ask.logprobs,
            top_logprobs: ask.top_logprobs,
            include_usage: ask.include_usage,
            key_id,
            degraded,
            tokens_generated: 0,
            gov,
            hold: govern::Hold::default(),
            first_frame_sent: false,
            out_text: String::new(),
            out_text_truncated: false,
            request_urls,
            identity_before: Some(identity_before),
            identity_after: None,
            safety: None,
            enc: ChunkEncoder {
                endpoint,
                stream_id: conn.id,
                created,
                model,
                logprobs: ask.logprobs,
                top_logprobs: ask.top_logprobs,
                // Degraded mode emits no tool calls (a degraded stream is batch anyway).
                tool_calls: endpoint == Endpoint::Chat && !degraded,
            },
            text_len: 0,
            held_text: String::new(),
            held_tokens: Vec::new(),
            prompt_tokens: 0,
            inflight_token: 0,
            detector_refs,
            last_token_ns: 0,
            token_gap_ns_sum: 0,
            tool_calls: Vec::new(),
        }));
        if !self.arm_turn_policy(key) {
            return self.halt(key);
        }
        if let Some(trip) = failed {
            return self.detector_trip(key, trip);
        }
        let path = match endpoint {
            Endpoint::Chat => upstream::CHAT_PATH,
            Endpoint::Completion => upstream::COMPLETIONS_PATH,
        };
        self.open_upstream_with(
            key,
            Purpose::Turn,
            path,
            "POST",
            auth.as_deref(),
            Some(&up.body),
            system_prompt,
        )
    }

    /// `GET /v1/models` with `--source openai`: relayed from the upstream.
    pub(super) fn start_proxy_models(&mut self, key: usize, head: RequestHead) -> io::Result<()> {
        let auth = head.authorization.as_ref().map(|a| a.as_str().to_owned());
        self.open_upstream_with(
            key,
            Purpose::Models,
            upstream::MODELS_PATH,
            "GET",
            auth.as_deref(),
            None,
            String::new(),
        )
    }

    pub(super) fn on_up_connect(&mut self, key: usize, res: i32) -> io::Result<()> {
        let conn = &mut self.conns[key];
        let Some(up) = conn.up.as_mut() else {
            return Ok(());
        };
        up.connect_inflight = false;
        if up.finished || conn.closing {
            return Ok(());
        }
        if res < 0 {
            let (kind, what) = match -res {
                libc::ECANCELED => (
                    UpstreamFailureKind::ConnectTimeout,
                    "connecting timed out".to_owned(),
                ),
                libc::ECONNREFUSED => (
                    UpstreamFailureKind::ConnectRefused,
                    "connection refused".to_owned(),
                ),
                e => (
                    UpstreamFailureKind::IoError,
                    format!("connect: {}", io::Error::from_raw_os_error(e)),
                ),
            };
            return self.up_fail(key, kind, format!("upstream {what}"), None);
        }
        self.up_send(key)
    }

    fn up_send(&mut self, key: usize) -> io::Result<()> {
        let timeout = self.shared.cfg.upstream_connect_timeout;
        let up = self.conns[key].up.as_mut().expect("upstream open");
        // An upstream that accepts but never reads must not hold the turn: the connect
        // timeout bounds each send of the request too.
        *up.ts = timespec(timeout);
        let rest = &up.wbuf[up.woff..];
        let e = opcode::Send::new(types::Fd(up.fd), rest.as_ptr(), rest.len() as u32)
            .flags(libc::MSG_NOSIGNAL)
            .build()
            .flags(squeue::Flags::IO_LINK)
            .user_data(ud(key, OP_UP_SEND));
        up.send_inflight = true;
        self.push_with_deadline(key, &e)
    }

    /// Pushes an upstream operation (built with `IO_LINK`) and, linked to it, a timeout of
    /// `up.ts` (the kernel copies the timespec when it takes the entries).
    fn push_with_deadline(&mut self, key: usize, entry: &squeue::Entry) -> io::Result<()> {
        let up = self.conns[key].up.as_mut().expect("upstream open");
        let ts: *const types::Timespec = &*up.ts;
        let link = opcode::LinkTimeout::new(ts)
            .build()
            .user_data(ud(key, OP_UP_LINK));
        up.link_inflight += 1;
        self.push(entry)?;
        self.push(&link)
    }

    pub(super) fn on_up_send(&mut self, key: usize, res: i32) -> io::Result<()> {
        let conn = &mut self.conns[key];
        let Some(up) = conn.up.as_mut() else {
            return Ok(());
        };
        up.send_inflight = false;
        if up.finished || conn.closing {
            return Ok(());
        }
        if res == -libc::ECANCELED {
            return self.up_fail(
                key,
                UpstreamFailureKind::ConnectTimeout,
                "the upstream did not take the request in time".to_owned(),
                None,
            );
        }
        if res <= 0 {
            let e = io::Error::from_raw_os_error(-res);
            return self.up_fail(
                key,
                UpstreamFailureKind::IoError,
                format!("sending the request to the upstream: {e}"),
                None,
            );
        }
        up.woff += res as usize;
        if up.woff < up.wbuf.len() {
            return self.up_send(key);
        }
        up.wbuf = Vec::new();
        self.up_arm_recv(key)
    }

    /// Arms a receive on the upstream socket with the deadline that applies now (time to
    /// the first event, or the inter-token stall deadline), unless one is armed, the queue
    /// is full (backpressure) or the exchange is over.
    fn up_arm_recv(&mut self, key: usize) -> io::Result<()> {
        let cfg_first = self.shared.cfg.upstream_first_token_timeout;
        let cfg_stall = self.shared.cfg.upstream_stall_timeout;
        let conn = &mut self.conns[key];
        if conn.closing {
            return Ok(());
        }
        let Some(up) = conn.up.as_mut() else {
            return Ok(());
        };
        if up.finished
            || up.saw_done
            || up.recv_inflight
            || up.link_inflight > 0
            || up.send_inflight
            || up.connect_inflight
            || up.items.len() >= MAX_QUEUED_ITEMS
        {
            return Ok(());
        }
        // Deadlines are absolute: time to the first event counts from the request, the stall
        // deadline from the last event. Bytes that are no event (keep-alive comments, a
        // response head) do not extend them.
        let deadline = if up.events == 0 {
            up.started_ns + cfg_first.as_nanos() as u64
        } else {
            up.last_event_ns + cfg_stall.as_nanos() as u64
        };
        let left = deadline.saturating_sub(monotonic_ns()).max(1_000);
        *up.ts = timespec(std::time::Duration::from_nanos(left));
        up.rbuf.clear();
        let ptr = up.rbuf.as_mut_ptr();
        let recv = opcode::Recv::new(types::Fd(up.fd), ptr, UP_RECV_CHUNK as u32)
            .build()
            .flags(squeue::Flags::IO_LINK)
            .user_data(ud(key, OP_UP_RECV));
        up.recv_inflight = true;
        self.push_with_deadline(key, &recv)
    }

    pub(super) fn on_up_link(&mut self, key: usize) -> io::Result<()> {
        if let Some(up) = self.conns.get_mut(key).and_then(|c| c.up.as_mut()) {
            up.link_inflight = up.link_inflight.saturating_sub(1);
            // The linked timeout of the previous receive completes after it; a receive that
            // was due meanwhile (the queue drained) is armed now.
            if up.items.is_empty() && up.link_inflight == 0 {
                return self.up_arm_recv(key);
            }
        }
        Ok(())
    }

    pub(super) fn on_up_recv(&mut self, key: usize, res: i32) -> io::Result<()> {
        // When the bytes arrived: the start of every token's haltd_token_overhead_seconds.
        let arrived_ns = monotonic_ns();
        let shared = Arc::clone(&self.shared);
        let conn = &mut self.conns[key];
        let id = conn.id;
        let Some(up) = conn.up.as_mut() else {
            return Ok(());
        };
        up.recv_inflight = false;
        if up.finished || conn.closing {
            return Ok(());
        }
        let events = up.events;
        let prev_status = up.status;
        if res == -libc::ECANCELED {
            return if events == 0 {
                let ms = shared.cfg.upstream_first_token_timeout.as_millis();
                self.up_fail(
                    key,
                    UpstreamFailureKind::FirstTokenTimeout,
                    format!("the upstream sent no event within {ms} ms"),
                    None,
                )
            } else {
                let ms = shared.cfg.upstream_stall_timeout.as_millis();
                self.up_fail(
                    key,
                    UpstreamFailureKind::Stalled,
                    format!(
                        "the upstream stream stalled: no event for {ms} ms after {events} events"
                    ),
                    None,
                )
            };
        }
        if res < 0 {
            let e = io::Error::from_raw_os_error(-res);
            return self.up_fail(
                key,
                UpstreamFailureKind::IoError,
                format!("reading from the upstream: {e}"),
                None,
            );
        }
        let had_head = up.reader.head().is_some();
        up.body.clear();
        if res == 0 {
            if let Err(e) = up.reader.eof() {
                let what = if up.reader.head().is_none() {
                    "the upstream closed the connection before a response".to_owned()
                } else {
                    format!("the upstream closed the connection mid-stream: {e}")
                };
                return self.up_fail(key, UpstreamFailureKind::EarlyEof, what, prev_status);
            }
        } else {
            // SAFETY: the kernel wrote `res` bytes into the buffer we handed it.
            unsafe { up.rbuf.set_len(res as usize) };
            if let Err(e) = up.reader.feed(&up.rbuf, &mut up.body) {
                return self.up_fail(
                    key,
                    UpstreamFailureKind::Malformed,
                    format!("malformed upstream response: {e}"),
                    prev_status,
                );
            }
        }
        let Some(head) = up.reader.head() else {
            return self.up_arm_recv(key);
        };
        let status = head.status;
        up.status = Some(status);
        if up.retry_after.is_none() {
            up.retry_after = head.retry_after.clone();
        }
        let sse = head
            .content_type
            .as_deref()
            .is_some_and(|c| c.to_ascii_lowercase().starts_with("text/event-stream"));
        let complete = res == 0 || up.reader.is_done();
        if up.purpose == Purpose::Models || status != 200 {
            // A whole body to relay (models) or to explain (an error status).
            if up.body.len() + up.wbuf.len() > MAX_UPSTREAM_BODY {
                return self.up_fail(
                    key,
                    UpstreamFailureKind::Malformed,
                    "upstream response body too large".to_owned(),
                    Some(status),
                );
            }
            let chunk = std::mem::take(&mut up.body);
            up.wbuf.extend_from_slice(&chunk);
            if !complete {
                return self.up_arm_recv(key);
            }
            let body = std::mem::take(&mut up.wbuf);
            return self.up_whole_body(key, status, body);
        }
        if let Some(enc) = head
            .content_encoding
            .as_deref()
            .filter(|e| !e.eq_ignore_ascii_case("identity"))
        {
            let msg = format!(
                "the upstream sent a {enc}-encoded stream although haltd asked for identity; compressed streams are not governed"
            );
            return self.up_fail(key, UpstreamFailureKind::Malformed, msg, Some(status));
        }
        if !sse {
            let ct = head.content_type.clone().unwrap_or_default();
            return self.up_fail(
                key,
                UpstreamFailureKind::Malformed,
                format!(
                    "the upstream answered 200 with content-type {ct:?}, not text/event-stream"
                ),
                Some(status),
            );
        }
        up.sse.push(&up.body);
        let endpoint = shared.table.slot(id.slot).endpoint();
        loop {
            match up.sse.next_event() {
                Ok(None) => break,
                Ok(Some(ev)) => {
                    up.events += 1;
                    up.last_event_ns = monotonic_ns();
                    if up.first_event_ns == 0 {
                        up.first_event_ns = up.last_event_ns;
                    }
                    match upstream::parse_event(endpoint, &ev) {
                        Ok(UpstreamEvent::Chunk(c)) => {
                            if up.model.is_none() {
                                up.model.clone_from(&c.model);
                            }
                            push_chunk(&mut up.items, c, arrived_ns);
                        }
                        Ok(UpstreamEvent::Done) => {
                            up.saw_done = true;
                            up.items.push_back(Item::Done);
                        }
                        Ok(UpstreamEvent::Error(e)) => up.items.push_back(Item::Error(e)),
                        Err(e) => {
                            up.items
                                .push_back(Item::Broken(format!("malformed upstream event: {e}")));
                            up.saw_done = true;
                            break;
                        }
                    }
                }
                Err(e) => {
                    up.items.push_back(Item::Broken(format!(
                        "malformed upstream event stream: {e}"
                    )));
                    up.saw_done = true;
                    break;
                }
            }
        }
        if res == 0 && !up.saw_done {
            if up.finish.is_some() || up.items.iter().any(|i| matches!(i, Item::Finish(_))) {
                // Some servers end with the final chunk and close, without `[DONE]`.
                up.items.push_back(Item::Done);
                up.saw_done = true;
            } else {
                let n = up.events;
                return self.up_fail(
                    key,
                    UpstreamFailureKind::EarlyEof,
                    format!("the upstream closed the stream after {n} events without a finish_reason or [DONE]"),
                    Some(status),
                );
            }
        }
        let queued = !up.items.is_empty();
        let idle = conn.sending.is_none();
        tracing::trace!(stream_id = %id, res, queued = up.items.len(), events = up.events, done = up.saw_done, idle, "upstream bytes");
        if !had_head && shared.table.slot(id.slot).mode() == Mode::Stream {
            // The upstream accepted the turn: the client's response begins now.
            if idle {
                self.send_stream_head(key)?;
            }
        } else if queued && idle {
            self.step(key)?;
        }
        self.up_arm_recv(key)
    }

    /// A whole non-streaming upstream body: `/v1/models` to relay, or an error status.
    fn up_whole_body(&mut self, key: usize, status: u16, body: Vec<u8>) -> io::Result<()> {
        let conn = &mut self.conns[key];
        let Some(up) = conn.up.as_mut() else {
            return Ok(());
        };
        up.finished = true;
        up.body = Vec::new();
        // SAFETY: shutting down our own socket; its descriptor stays open until the
        // connection is dropped.
        unsafe { libc::shutdown(up.fd, libc::SHUT_RDWR) };
        if up.purpose == Purpose::Models && status == 200 {
            return self.reply(key, 200, "application/json", &body);
        }
        let parsed: Option<Value> = serde_json::from_slice(&body).ok();
        let message = parsed
            .as_ref()
            .and_then(|v| {
                v.pointer("/error/message")
                    .or_else(|| v.get("message"))
                    .or_else(|| v.get("detail"))
            })
            .map(|m| match m {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            })
            .unwrap_or_else(|| String::from_utf8_lossy(&body).chars().take(300).collect());
        let quote = wire::truncate_chars(&message, 500);
        let msg = format!("the upstream answered {status}: {quote}");
        up.failure_quote = Some(quote);
        up.status = Some(status);
        self.up_fail(key, UpstreamFailureKind::HttpStatus, msg, Some(status))
    }

    /// Governs and emits the next queued upstream item (called by `step` for proxied turns,
    /// after its heartbeat and trip checks): at most one frame goes out per call.
    pub(super) fn proxy_step(&mut self, key: usize) -> io::Result<()> {
        let shared = Arc::clone(&self.shared);
        loop {
            let conn = &mut self.conns[key];
            if conn.sending.is_some() || conn.closing {
                return Ok(());
            }
            let id = conn.id;
            let slot = shared.table.slot(id.slot);
            let mode = slot.mode();
            let (Some(turn), Some(up)) = (conn.turn.as_mut(), conn.up.as_mut()) else {
                return Ok(());
            };
            if let Some(p) = turn.hold.pop_released() {
                return self.emit_pending(key, p);
            }
            if turn.hold.ending {
                // The upstream is done and nothing is held any more.
                return self.proxy_finish(key);
            }
            let Some(item) = up.items.pop_front() else {
                return self.up_arm_recv(key);
            };
            match item {
                Item::Content {
                    text,
                    tokens,
                    split,
                    arrived_ns,
                } => {
                    // The detectors see every token before any frame of the item goes out;
                    // text without tokens (no logprobs) is one observation without one.
                    let now = monotonic_ns();
                    let mut trip = None;
                    if tokens.is_empty() {
                        let obs = TokenObs {
                            index: turn.tokens_generated,
                            text: &text,
                            logprob: None,
                            now_ns: now,
                        };
                        trip = turn.gov.set.observe(&obs, monotonic_ns);
                    }
                    for (i, t) in tokens.iter().enumerate() {
                        if trip.is_some() {
                            break;
                        }
                        let obs = TokenObs {
                            index: turn.tokens_generated + i as u64,
                            text: &t.text,
                            logprob: t.logprob,
                            now_ns: now,
                        };
                        trip = turn.gov.set.observe(&obs, monotonic_ns);
                    }
                    let trip = trip.or_else(|| match turn.gov.scan(&text) {
                        Gate::Trip(t) => Some(t),
                        Gate::Release(n) => {
                            turn.hold.scanned += text.len();
                            turn.hold.release(n);
                            None
                        }
                    });
                    if let Some(t) = trip {
                        if t.detector == DetectorId::HaltMonitor && t.kind == TripKind::Unscorable {
                            Self::note_missing_logprobs(&shared, up, id.slot);
                        }
                        return self.detector_trip(key, t);
                    }
                    if turn.last_token_ns != 0 {
                        turn.token_gap_ns_sum += now.saturating_sub(turn.last_token_ns);
                    }
                    turn.last_token_ns = now;
                    // One token per frame by the rule; a chunk with more upstream tokens than
                    // frames (byte tokens of one character) counts those, so that detector
                    // indices stay distinct.
                    let frames = split.frames(&text);
                    turn.tokens_generated += frames.max(tokens.len() as u64);
                    let offset = turn.text_len;
                    turn.text_len += text.len();
                    if mode == Mode::Batch {
                        turn.held_text.push_str(&text);
                        turn.note_output(&text);
                        let mut off = offset;
                        for t in tokens {
                            let len = t.text.len();
                            turn.held_tokens.push(HeldToken {
                                text: t.text,
                                logprob: t.logprob.unwrap_or(f32::NEG_INFINITY),
                                top: t.top,
                                offset: off,
                            });
                            off += len;
                        }
                        slot.tokens_submitted.fetch_add(frames, SeqCst);
                        continue;
                    }
                    // The frames go out through the hold queue, one per step, in order behind
                    // anything the scanner holds (the text moves in, no copy).
                    let token = tokens.into_iter().next();
                    turn.hold.push_text(text, split, token, offset, arrived_ns);
                    continue;
                }
                Item::ToolCalls(delta, tokens, arrived_ns) => {
                    let now = monotonic_ns();
                    let mut trip = None;
                    for (i, t) in tokens.iter().enumerate() {
                        let obs = TokenObs {
                            index: turn.tokens_generated + i as u64,
                            text: &t.text,
                            logprob: t.logprob,
                            now_ns: now,
                        };
                        trip = turn.gov.set.observe(&obs, monotonic_ns);
                        if trip.is_some() {
                            break;
                        }
                    }
                    if let Some(t) = trip {
                        if t.detector == DetectorId::HaltMonitor && t.kind == TripKind::Unscorable {
                            Self::note_missing_logprobs(&shared, up, id.slot);
                        }
                        return self.detector_trip(key, t);
                    }
                    if turn.degraded {
                        turn.tokens_generated += tokens.len() as u64;
                        // Degraded safe mode blocks new tool dispatch: not emitted; each call
                        // (a delta entry that starts one, with its id) is counted once.
                        let n = delta.as_array().map_or(0, |l| {
                            l.iter()
                                .filter(|d| d.get("id").is_some_and(|i| !i.is_null()))
                                .count()
                        }) as u64;
                        shared
                            .metrics
                            .upstream
                            .tool_calls(ToolCallKind::Suppressed, n);
                        continue;
                    }
                    let parts = match framing::tool_call_parts(&delta) {
                        Ok(p) => p,
                        Err(e) => {
                            let msg = format!("malformed upstream tool call: {e}");
                            return self.up_fail(
                                key,
                                UpstreamFailureKind::Malformed,
                                msg,
                                Some(200),
                            );
                        }
                    };
                    // A tool call's name and arguments are output like any text: scanned for
                    // secrets, held back the same way.
                    let args: String = parts
                        .iter()
                        .flat_map(|p| [p.name.as_deref().unwrap_or(""), p.arguments.as_str()])
                        .collect();
                    match turn.gov.scan(&args) {
                        Gate::Trip(t) => return self.detector_trip(key, t),
                        Gate::Release(n) => {
                            turn.hold.scanned += args.len();
                            turn.hold.release(n);
                        }
                    }
                    let frames = framing::tool_call_frames(&parts, &tokens);
                    turn.tokens_generated += frames.max(tokens.len() as u64);
                    let started = merge_tool_calls(&mut up.tools, &delta);
                    if mode == Mode::Batch {
                        slot.tokens_submitted.fetch_add(frames, SeqCst);
                        continue;
                    }
                    // Emitted through the queue (in order behind any held frame).
                    turn.hold
                        .push_tool_calls(parts, tokens, &started, arrived_ns);
                    continue;
                }
                Item::Finish(r) if turn.degraded && r == FinishReason::ToolCalls => {
                    // No tool call reached the client: the turn simply ended.
                    up.finish = Some(FinishReason::Stop);
                }
                Item::Finish(r) => {
                    if matches!(r, FinishReason::Error | FinishReason::Abort) {
                        let what = r.as_str().to_owned();
                        return self.up_fail(
                            key,
                            UpstreamFailureKind::ErrorEvent,
                            format!(
                                "the upstream ended the generation with finish_reason {what:?}"
                            ),
                            None,
                        );
                    }
                    up.finish = Some(r);
                }
                Item::Usage(p, c) => up.usage = Some((p, c)),
                Item::Error(e) => {
                    let quote = wire::truncate_chars(&e.message, 500);
                    let msg = format!("the upstream sent an error event: {quote}");
                    up.failure_quote = Some(quote);
                    return self.up_fail(key, UpstreamFailureKind::ErrorEvent, msg, e.status);
                }
                Item::Broken(msg) => {
                    return self.up_fail(key, UpstreamFailureKind::Malformed, msg, Some(200))
                }
                Item::Done => {
                    up.finished = true;
                    // SAFETY: closing our half of our own socket; the descriptor stays
                    // open until the connection is dropped.
                    unsafe { libc::shutdown(up.fd, libc::SHUT_RDWR) };
                    if let Some(m) = &up.model {
                        turn.identity_after =
                            Some(crate::safety::identity_digest(m, &up.system_prompt));
                    }
                    if !self.govern_end(key)? {
                        return Ok(());
                    }
                    // Loop: drain what the scanner released, then finish.
                }
            }
        }
    }

    /// The upstream finished and every held frame went out: the final frame.
    fn proxy_finish(&mut self, key: usize) -> io::Result<()> {
        let conn = &mut self.conns[key];
        let batch = self.shared.table.slot(conn.id.slot).mode() == Mode::Batch;
        let (Some(turn), Some(up)) = (conn.turn.as_mut(), conn.up.as_mut()) else {
            return Ok(());
        };
        let reason = up
            .finish
            .as_ref()
            .map_or("stop", FinishReason::as_str)
            .to_owned();
        let usage = up
            .usage
            .unwrap_or((turn.prompt_tokens, turn.tokens_generated));
        let tools =
            (!up.tools.is_empty() && !turn.degraded).then(|| Value::Array(up.tools.clone()));
        if batch {
            if let Some(Value::Array(all)) = &tools {
                turn.tool_calls = all
                    .iter()
                    .enumerate()
                    .map(|(i, t)| json!({"index": i, "id": t["id"], "name": t["function"]["name"]}))
                    .collect();
            }
        }
        self.finish_with(key, &reason, usage, tools.as_ref())
    }

    /// The HaltMonitor cannot score what the upstream sends: say why in the terminal event,
    /// the record and the failure metric.
    fn note_missing_logprobs(shared: &crate::halt::HaltCore, up: &mut Upstream, slot: u32) {
        let msg = "the upstream sent tokens without logprobs while the HaltMonitor (--hard-limit) is on; they cannot be scored".to_owned();
        let failure = UpstreamFailure::new(UpstreamFailureKind::MissingLogprobs, msg, None);
        shared.metrics.upstream.failed(failure.kind);
        shared.meta(slot).upstream_failure = Some(failure.clone());
        up.failure = Some(failure);
    }

    /// The frame in flight was accepted by the kernel: tool calls it started are dispatched.
    pub(super) fn proxy_frame_delivered(&mut self, key: usize) {
        let conn = &mut self.conns[key];
        if let (Some(turn), Some(up)) = (conn.turn.as_mut(), conn.up.as_mut()) {
            turn.tool_calls.append(&mut up.inflight_tools);
        }
    }

    /// Ends the upstream exchange because of a trip or a client that went away: the
    /// connection is shut down at once, which makes vLLM abort the generation.
    pub(super) fn up_cancel(&mut self, key: usize, reason: CancelReason) {
        let Some(conn) = self.conns.get_mut(key) else {
            return;
        };
        let Some(up) = conn.up.as_mut() else {
            return;
        };
        if up.finished {
            return;
        }
        up.finished = true;
        up.cancelled = Some(reason);
        up.items.clear();
        self.shared.metrics.upstream.cancelled(reason);
        tracing::info!(stream_id = %conn.id, reason = %reason, "cancelling the upstream request");
        Self::up_shutdown(up);
        if up.connect_inflight {
            up.cancel_inflight += 1;
            let e = opcode::AsyncCancel::new(ud(key, OP_UP_CONNECT))
                .build()
                .user_data(ud(key, super::OP_CANCEL_UP));
            if self.push(&e).is_err() {
                if let Some(up) = self.conns.get_mut(key).and_then(|c| c.up.as_mut()) {
                    up.cancel_inflight -= 1;
                }
            }
        }
    }

    fn up_shutdown(up: &mut Upstream) {
        // SAFETY: our own socket; shutdown ends the TCP connection (FIN) now, whatever is in
        // flight on it, and the descriptor stays open until the connection is dropped.
        unsafe { libc::shutdown(up.fd, libc::SHUT_RDWR) };
    }

    /// The upstream failed: count and note it, close the exchange, and end the turn with the
    /// typed error (an HTTP error before the response began, else an UPSTREAM_FAILURE trip).
    fn up_fail(
        &mut self,
        key: usize,
        kind: UpstreamFailureKind,
        message: String,
        upstream_status: Option<u16>,
    ) -> io::Result<()> {
        let shared = Arc::clone(&self.shared);
        let conn = &mut self.conns[key];
        let id = conn.id;
        let Some(up) = conn.up.as_mut() else {
            return Ok(());
        };
        let failure = UpstreamFailure::new(kind, message, upstream_status);
        up.finished = true;
        up.items.clear();
        up.failure = Some(failure.clone());
        Self::up_shutdown(up);
        let purpose = up.purpose;
        let retry_after = up.retry_after.clone();
        shared.metrics.upstream.failed(kind);
        tracing::warn!(stream_id = %id, kind = %kind, source = ?failure.source(), retry = failure.retry(), message = %failure.message, "upstream failure");
        let slot = shared.table.slot(id.slot);
        if slot.is_tripped() {
            return self.halt(key);
        }
        if purpose == Purpose::Turn {
            shared.meta(id.slot).upstream_failure = Some(failure.clone());
        }
        if !slot.headers_sent.load(SeqCst) && conn.sending.is_none() {
            // Nothing of the response went out: answer with a status that says whose fault
            // it was, and the error object.
            let status = failure.http_status();
            let body = json!({"error": {
                "message": failure.message,
                "type": failure.error_type(),
                "code": FailureCode::UpstreamFailure.as_str(),
                "upstream": {"kind": kind.as_str(), "status": upstream_status},
                "stream_id": id.to_string(),
            }})
            .to_string();
            let mut extra: Vec<(&str, &str)> = Vec::new();
            if let Some(ra) = retry_after.as_deref() {
                if status == 429 || status == 503 {
                    extra.push(("retry-after", ra));
                }
            }
            if conn.turn.as_ref().is_some_and(|t| t.degraded) {
                extra.push(("x-haltd-mode", "degraded"));
            }
            self.reply_with(key, status, "application/json", body.as_bytes(), &extra)?;
            if let Some(c) = self.conns.get_mut(key) {
                c.outcome = Outcome::UpstreamFailed;
            }
            return Ok(());
        }
        // The client's stream is open: a trip, so the terminal event carries the failure
        // and the halt is recorded like any other.
        let _ = shared.trip(id, FailureCode::UpstreamFailure);
        self.halt(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_call_deltas_merge_by_index() {
        let mut tools = Vec::new();
        let s1 = merge_tool_calls(
            &mut tools,
            &json!([{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]),
        );
        assert_eq!(s1.len(), 1);
        assert_eq!(s1[0]["name"], "get_weather");
        let s2 = merge_tool_calls(
            &mut tools,
            &json!([{"index": 0, "function": {"arguments": "{\"city\":"}}]),
        );
        assert!(s2.is_empty());
        merge_tool_calls(
            &mut tools,
            &json!([{"index": 0, "function": {"arguments": "\"Oslo\"}"}}]),
        );
        let s3 = merge_tool_calls(
            &mut tools,
            &json!([{"index": 1, "id": "call_2", "function": {"name": "f", "arguments": "{}"}}]),
        );
        assert_eq!(s3[0]["index"], 1);
        assert_eq!(tools[0]["function"]["arguments"], "{\"city\":\"Oslo\"}");
        assert_eq!(tools[1]["id"], "call_2");
    }
}
