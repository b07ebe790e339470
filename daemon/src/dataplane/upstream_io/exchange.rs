//! The upstream side of a proxied turn's connection, as state: what to ask ([`UpstreamRequest`],
//! [`Purpose`]) and what the exchange holds and has seen ([`Upstream`]: socket, buffers,
//! parser state, failure, cancellation). The I/O on it is `upstream_io.rs`.

use std::os::fd::RawFd;

use serde_json::{json, Value};

use crate::{
    clock::monotonic_ns,
    upstream::{
        CancelReason, FinishReason, ResponseReader, SseParser, TlsLink, UpstreamFailure,
        UpstreamFailureKind,
    },
};
use io_uring::types;

/// Largest upstream response head.
pub(in crate::dataplane) const MAX_UPSTREAM_HEAD: usize = 64 * 1024;
/// Largest single SSE event from the upstream.
pub(in crate::dataplane) const MAX_UPSTREAM_EVENT: usize = 1 << 20;
/// Largest non-streaming upstream body (error bodies, `/v1/models`).
pub(in crate::dataplane) const MAX_UPSTREAM_BODY: usize = 4 << 20;
/// Largest relayed embeddings answer: a batch of 256 inputs of 3,072 dimensions is about
/// 16 MiB of JSON. Larger answers fail as `UPSTREAM_FAILURE` (`malformed`, "too large").
pub(in crate::dataplane) const MAX_PASSTHROUGH_BODY: usize = 32 << 20;

/// Whether an upstream connection may serve another request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::dataplane) enum Reuse {
    /// No: it is (being) shut down, or its exchange is not over.
    No,
    /// The turn has all it needs; the end of the body is still being read.
    Draining,
    /// The response ended cleanly: it may go back to the pool once the turn completed.
    Ready,
}

/// What to ask the upstream.
#[derive(Debug)]
pub(in crate::dataplane) struct UpstreamRequest<'a> {
    pub(in crate::dataplane) purpose: Purpose,
    pub(in crate::dataplane) api_path: &'static str,
    pub(in crate::dataplane) method: &'a str,
    pub(in crate::dataplane) authorization: Option<&'a str>,
    pub(in crate::dataplane) body: Option<&'a [u8]>,
}

/// What an upstream exchange is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::dataplane) enum Purpose {
    Turn,
    /// `GET /v1/models`, relayed whole.
    Models,
    /// `GET /v1/models` for `GET /v1/models/{id}`: the one entry is answered
    /// (`passthrough.rs`).
    Model,
    /// `POST /v1/embeddings`, relayed whole with its status (`passthrough.rs`).
    Passthrough,
}

impl Purpose {
    /// The largest whole body (not an event stream) this exchange takes from the upstream.
    pub(in crate::dataplane) fn whole_body_limit(self) -> usize {
        match self {
            Purpose::Passthrough => MAX_PASSTHROUGH_BODY,
            Purpose::Turn | Purpose::Models | Purpose::Model => MAX_UPSTREAM_BODY,
        }
    }
}

/// The upstream side of a connection: socket, buffers, parser state, and what happened.
#[derive(Debug)]
pub(in crate::dataplane) struct Upstream {
    pub(in crate::dataplane) purpose: Purpose,
    pub(in crate::dataplane) fd: RawFd,
    /// The request bytes until the send takes them; then a whole body (`/v1/models`, an
    /// error) as it arrives.
    pub(in crate::dataplane) wbuf: Vec<u8>,
    /// The receive buffer, reused; `None` while a receive owns it.
    pub(in crate::dataplane) rbuf: Option<Vec<u8>>,
    /// The deadline handed to linked timeouts, back with their completion.
    pub(in crate::dataplane) ts: Option<Box<types::Timespec>>,
    /// The operations in flight on the socket (a cancellation names the connect).
    pub(in crate::dataplane) connect_op: Option<u64>,
    pub(in crate::dataplane) send_op: Option<u64>,
    pub(in crate::dataplane) recv_op: Option<u64>,
    /// When the receive in flight is due (`deadline.rs` cancels it after that).
    pub(in crate::dataplane) recv_deadline_ns: u64,
    /// The receive in flight was cancelled for its deadline.
    pub(in crate::dataplane) recv_cancelled: bool,
    /// Linked timeouts not yet completed (connect and send each carry one).
    pub(in crate::dataplane) links: u32,
    pub(in crate::dataplane) reader: ResponseReader,
    pub(in crate::dataplane) sse: SseParser,
    pub(in crate::dataplane) body: Vec<u8>,
    /// Set once the exchange is over (done, failed or cancelled): nothing more is read.
    pub(in crate::dataplane) finished: bool,
    pub(in crate::dataplane) status: Option<u16>,
    pub(in crate::dataplane) retry_after: Option<String>,
    pub(in crate::dataplane) failure: Option<UpstreamFailure>,
    /// The end of `failure`'s message that quotes the upstream (its error message), which
    /// records leave out unless `--record-token-text`: some backends build it from the
    /// request (a validation error that echoes the input).
    pub(in crate::dataplane) failure_quote: Option<String>,
    pub(in crate::dataplane) cancelled: Option<CancelReason>,
    pub(in crate::dataplane) events: u64,
    pub(in crate::dataplane) started_ns: u64,
    pub(in crate::dataplane) first_event_ns: u64,
    pub(in crate::dataplane) last_event_ns: u64,
    /// The system prompt of the request sent (SafetyCheck's identity).
    pub(in crate::dataplane) system_prompt: String,
    pub(in crate::dataplane) api_path: &'static str,
    /// The model a `GET /v1/models/{id}` asked for ([`Purpose::Model`]).
    pub(in crate::dataplane) only_model: Option<Box<str>>,
    /// The connection came from the worker's pool (its request may be retried once).
    pub(in crate::dataplane) reused: bool,
    /// The request was retried on a new connection already.
    pub(in crate::dataplane) retried: bool,
    /// Response bytes read on this connection.
    pub(in crate::dataplane) received: usize,
    /// The request as sent on a reused connection, kept for its one retry.
    pub(in crate::dataplane) request: Vec<u8>,
    /// Whether the connection may serve another request once the turn is done.
    pub(in crate::dataplane) reuse: Reuse,
    /// The TLS session of an `https://` upstream's connection (`upstream_io/tls.rs`).
    pub(in crate::dataplane) tls: Option<Box<TlsLink>>,
    /// The receive in flight was cancelled when the turn's text ended (`upstream_io/reuse.rs`).
    pub(in crate::dataplane) recv_stopped: bool,
    /// The header fields haltd added to the request (`wire::trace::upstream_correlation`):
    /// named when the upstream refuses the request with an empty body.
    pub(in crate::dataplane) added_headers: Vec<&'static str>,
    /// The `x-request-id` haltd sent, if it sent one (the access log's `upstream_request_id`).
    pub(in crate::dataplane) request_id: Option<String>,
}

impl Upstream {
    pub(in crate::dataplane) fn new(
        fd: RawFd,
        req: &UpstreamRequest<'_>,
        wbuf: Vec<u8>,
        system_prompt: String,
    ) -> Self {
        Upstream {
            purpose: req.purpose,
            fd,
            wbuf,
            rbuf: None,
            ts: None,
            connect_op: None,
            send_op: None,
            recv_op: None,
            recv_deadline_ns: 0,
            recv_cancelled: false,
            links: 0,
            reader: ResponseReader::new(MAX_UPSTREAM_HEAD),
            sse: SseParser::new(MAX_UPSTREAM_EVENT),
            body: Vec::new(),
            finished: false,
            status: None,
            retry_after: None,
            failure: None,
            failure_quote: None,
            cancelled: None,
            events: 0,
            started_ns: monotonic_ns(),
            first_event_ns: 0,
            last_event_ns: 0,
            system_prompt,
            api_path: req.api_path,
            only_model: None,
            reused: false,
            retried: false,
            received: 0,
            request: Vec::new(),
            reuse: Reuse::No,
            recv_stopped: false,
            tls: None,
            added_headers: Vec::new(),
            request_id: None,
        }
    }

    pub(in crate::dataplane) fn fd(&self) -> RawFd {
        self.fd
    }

    /// The exchange is over (the stream ended): nothing more is read for the turn. A
    /// keep-alive response whose body ended cleanly leaves the connection reusable; one whose
    /// end is still due (the chunked terminator behind `[DONE]`) is drained first; any other
    /// connection is shut down at once.
    pub(in crate::dataplane) fn finish_exchange(&mut self) {
        self.finished = true;
        let keep_alive = self.reader.head().is_some_and(|h| h.keep_alive);
        self.reuse = match (keep_alive, self.reader.is_done()) {
            (true, true) => Reuse::Ready,
            (true, false) => Reuse::Draining,
            (false, _) => Reuse::No,
        };
        if self.reuse == Reuse::No {
            self.shutdown();
        }
    }

    /// The connection will serve no other request: shut it down now.
    pub(in crate::dataplane) fn discard(&mut self) {
        self.reuse = Reuse::No;
        self.shutdown();
    }

    pub(in crate::dataplane) fn shutdown(&self) {
        // SAFETY: our own socket; shutdown ends the TCP connection (FIN) now, whatever is in
        // flight on it, and the descriptor stays open until the connection is dropped.
        unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
    }

    /// The HaltMonitor cannot score what the upstream sends: say why in the terminal event,
    /// the record and the failure metric.
    pub(in crate::dataplane) fn note_missing_logprobs(
        &mut self,
        shared: &crate::halt::HaltCore,
        slot: u32,
    ) {
        let msg = "the upstream sent tokens without logprobs while the HaltMonitor (--hard-limit) is on; they cannot be scored".to_owned();
        let failure = UpstreamFailure::new(UpstreamFailureKind::MissingLogprobs, msg, None);
        shared.metrics.upstream.failed(failure.kind);
        shared.meta(slot).upstream_failure = Some(failure.clone());
        self.failure = Some(failure);
    }

    /// The FHR `upstream` field; without `record_text`, what the upstream's error message
    /// said is replaced by its length and SHA-256.
    pub(in crate::dataplane) fn record_value(
        &self,
        record_text: bool,
        finish: Option<&FinishReason>,
    ) -> Value {
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
            "finish_reason": finish.map(FinishReason::as_str),
            "failure": failure,
            "cancelled": self.cancelled.is_some(),
            "cancel_reason": self.cancelled.map(CancelReason::as_str),
        })
    }
}
