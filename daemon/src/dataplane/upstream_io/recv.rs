//! What a receive on the upstream socket brings: the response head (a streaming `200`, or a
//! whole body to relay or explain), then SSE events, each fed to the turn's upstream source
//! ([`crate::source::upstream::UpstreamSource::push_event`]); then the pipeline runs if it can
//! take them, and the next receive is armed (unless the source's queue is full: back-pressure
//! on the upstream). A whole body (`/v1/models`, an error status) is relayed or explained
//! (`up_whole_body`). Every failure here ends the turn typed (`up_fail`).

use std::{io, sync::Arc};

use serde_json::Value;

use crate::dataplane::upstream_io;
use crate::dataplane::Step;
use crate::dataplane::{
    upstream_io::reuse::closed_by_peer,
    upstream_io::{Purpose, Upstream},
};
use crate::{
    clock::monotonic_ns,
    source::upstream::UpstreamSource,
    stream::Mode,
    upstream::{ResponseHead, UpstreamFailureKind},
    wire::{self, Endpoint},
};

/// What the bytes of one receive amount to.
enum Received {
    /// No response head yet: read on.
    NoHead,
    /// A whole body (`/v1/models`, or an error status) to relay or explain, complete.
    Body(u16, Vec<u8>),
    /// More of a whole body is due: read on.
    MoreBody,
    /// The stream's events were fed to the source.
    Stream { had_head: bool },
    /// The exchange failed.
    Failed(UpstreamFailureKind, String, Option<u16>),
}

impl Step<'_> {
    /// A receive completed; `buf` holds what it read, back from the kernel.
    pub(in crate::dataplane) fn on_up_recv(&mut self, res: i32, buf: Vec<u8>) -> io::Result<()> {
        // When the bytes arrived: the start of every token's haltd_token_overhead_seconds.
        let arrived_ns = monotonic_ns();
        let conn = &mut *self.conn;
        let Some(up) = conn.up.as_mut() else {
            return Ok(());
        };
        up.recv_op = None;
        up.rbuf = Some(buf);
        // TLS: the ciphertext becomes plaintext here, or nothing the HTTP side reads.
        let Some(res) = self.up_tls_open(res)? else {
            return Ok(());
        };
        let conn = &mut *self.conn;
        let Some(up) = conn.up.as_mut() else {
            return Ok(());
        };
        if up.finished {
            return self.up_after_end(res);
        }
        if conn.closing {
            return Ok(());
        }
        let retryable = up.reused && up.received == 0 && closed_by_peer(res);
        if retryable && self.up_retry()? {
            return Ok(());
        }
        if res < 0 {
            return self.up_recv_failed(res);
        }
        self.up_recv_data(res, arrived_ns)
    }

    /// `res` bytes (0: EOF) of the response arrived, in `up.rbuf`.
    fn up_recv_data(&mut self, res: i32, arrived_ns: u64) -> io::Result<()> {
        let shared = Arc::clone(&self.io.shared);
        let conn = &mut *self.conn;
        let id = conn.id;
        let Some(up) = conn.up.as_mut() else {
            return Ok(());
        };
        up.received += res as usize;
        if res > 0 && up.purpose == upstream_io::Purpose::Turn {
            if let Some(h) = &shared.upstream_health {
                // The backend answers: a probe that times out meanwhile met it busy.
                h.note_bytes(arrived_ns);
            }
        }
        let endpoint = shared.table.slot(id.slot).endpoint();
        let source = conn.turn.as_mut().and_then(|t| t.source.upstream_mut());
        match up_received(up, source, res, endpoint, arrived_ns) {
            Received::NoHead | Received::MoreBody => self.up_arm_recv(),
            Received::Body(status, body) => self.up_whole_body(status, body),
            Received::Failed(kind, msg, status) => self.up_fail(kind, msg, status),
            Received::Stream { had_head } => {
                let conn = &mut *self.conn;
                let queued = conn
                    .turn
                    .as_ref()
                    .and_then(|t| t.source.upstream())
                    .is_some_and(UpstreamSource::has_items);
                let idle = conn.emit.idle();
                tracing::trace!(stream_id = %id, res, queued, idle, "upstream bytes");
                let slot = shared.table.slot(id.slot);
                let resumed = slot.headers_sent.load(std::sync::atomic::Ordering::SeqCst);
                if !had_head && slot.mode() == Mode::Stream && !resumed {
                    // The upstream accepted the turn: the client's response begins now. (A
                    // grounded continuation's response continues the client's, `ground.rs`.)
                    if idle {
                        self.send_stream_head()?;
                    }
                } else if queued && idle {
                    self.step()?;
                }
                self.up_arm_recv()
            }
        }
    }

    /// A receive failed: its deadline passed (time to the first event, or the stall
    /// deadline), or the socket did.
    pub(in crate::dataplane) fn up_recv_failed(&mut self, res: i32) -> io::Result<()> {
        let cfg = &self.io.shared.cfg;
        let events = self.conn.up.as_ref().map_or(0, |u| u.events);
        let (kind, msg) = if res == -libc::ECANCELED && self.up_tls_handshaking() {
            let ms = cfg.upstream_first_token_timeout.as_millis();
            (
                UpstreamFailureKind::FirstTokenTimeout,
                format!("the TLS handshake with the upstream did not complete within {ms} ms"),
            )
        } else if res == -libc::ECANCELED && events == 0 {
            let ms = cfg.upstream_first_token_timeout.as_millis();
            (
                UpstreamFailureKind::FirstTokenTimeout,
                format!("the upstream sent no event within {ms} ms"),
            )
        } else if res == -libc::ECANCELED {
            let ms = cfg.upstream_stall_timeout.as_millis();
            (
                UpstreamFailureKind::Stalled,
                format!("the upstream stream stalled: no event for {ms} ms after {events} events"),
            )
        } else {
            let e = io::Error::from_raw_os_error(-res);
            (
                UpstreamFailureKind::IoError,
                format!("reading from the upstream: {e}"),
            )
        };
        self.up_fail(kind, msg, None)
    }

    /// A whole non-streaming upstream body: `/v1/models` to relay, or an error status.
    pub(in crate::dataplane) fn up_whole_body(
        &mut self,
        status: u16,
        body: Vec<u8>,
    ) -> io::Result<()> {
        let conn = &mut *self.conn;
        let Some(up) = conn.up.as_mut() else {
            return Ok(());
        };
        up.body = Vec::new();
        up.finish_exchange();
        match (up.purpose, status) {
            (Purpose::Models, 200) => return self.reply(200, "application/json", &body),
            (Purpose::Model, 200) => return self.reply_model_from_list(&body),
            // Embeddings are relayed as they came, an error status too: it is the upstream's
            // answer to the client's request, not a failure of a turn.
            (Purpose::Passthrough, _) => return self.reply(status, "application/json", &body),
            _ => {}
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
        let msg = if body.is_empty() {
            // Nothing to quote: name what haltd added to the client's request, the likeliest
            // cause of a refusal the client cannot explain (a backend that checks
            // `x-request-id`'s shape, say).
            format!(
                "the upstream answered {status} with an empty body; haltd added these request headers: {} (see --upstream-request-id)",
                up.added_headers.join(", ")
            )
        } else {
            format!("the upstream answered {status}: {quote}")
        };
        up.failure_quote = Some(quote);
        up.status = Some(status);
        self.up_fail(UpstreamFailureKind::HttpStatus, msg, Some(status))
    }
}

/// Takes the `res` bytes a receive brought (0: the upstream closed) into the response reader,
/// and what they complete into the source.
fn up_received(
    up: &mut Upstream,
    source: Option<&mut UpstreamSource>,
    res: i32,
    endpoint: Endpoint,
    arrived_ns: u64,
) -> Received {
    let prev_status = up.status;
    let had_head = up.reader.head().is_some();
    up.body.clear();
    let mut early_eof = None;
    if res == 0 {
        if let Err(e) = up.reader.eof() {
            if up.reader.head().is_none() {
                let what = "the upstream closed the connection before a response".to_owned();
                return Received::Failed(UpstreamFailureKind::EarlyEof, what, prev_status);
            }
            early_eof = Some(format!(
                "the upstream closed the connection mid-stream: {e}"
            ));
        }
    } else {
        let read = up.rbuf.as_deref().unwrap_or_default();
        if let Err(e) = up.reader.feed(read, &mut up.body) {
            return Received::Failed(
                UpstreamFailureKind::Malformed,
                format!("malformed upstream response: {e}"),
                prev_status,
            );
        }
    }
    let Some(head) = up.reader.head() else {
        return Received::NoHead;
    };
    let status = head.status;
    up.status = Some(status);
    if up.retry_after.is_none() {
        up.retry_after = head.retry_after.clone();
    }
    let complete = res == 0 || up.reader.is_done();
    if let (Some(what), true) = (
        early_eof.as_ref(),
        up.purpose != Purpose::Turn || status != 200,
    ) {
        return Received::Failed(UpstreamFailureKind::EarlyEof, what.clone(), Some(status));
    }
    if up.purpose != Purpose::Turn || status != 200 {
        // A whole body to relay (models, embeddings) or to explain (an error status).
        if up.body.len() + up.wbuf.len() > up.purpose.whole_body_limit() {
            return Received::Failed(
                UpstreamFailureKind::Malformed,
                "upstream response body too large".to_owned(),
                Some(status),
            );
        }
        let chunk = std::mem::take(&mut up.body);
        up.wbuf.extend_from_slice(&chunk);
        if !complete {
            return Received::MoreBody;
        }
        return Received::Body(status, std::mem::take(&mut up.wbuf));
    }
    if let Some(msg) = not_a_governable_stream(head) {
        return Received::Failed(UpstreamFailureKind::Malformed, msg, Some(status));
    }
    let Some(source) = source else {
        return match early_eof {
            Some(what) => Received::Failed(UpstreamFailureKind::EarlyEof, what, Some(status)),
            None => Received::NoHead,
        };
    };
    up.sse.push(&up.body);
    feed_events(up, source, endpoint, arrived_ns);
    // An early end is queued behind what was read before it, so the tokens the upstream
    // sent still go out (governed) before the turn fails.
    if let (Some(what), false) = (early_eof, source.saw_done()) {
        source.push_failure(UpstreamFailureKind::EarlyEof, what);
    }
    if res == 0 && !source.saw_done() {
        if !source.has_finish() {
            let n = up.events;
            source.push_failure(
                UpstreamFailureKind::EarlyEof,
                format!("the upstream closed the stream after {n} events without a finish_reason or [DONE]"),
            );
        } else {
            // Some servers end with the final chunk and close, without `[DONE]`.
            source.push_done();
        }
    }
    Received::Stream { had_head }
}

/// Why a `200` response cannot be governed: compressed, or not an event stream.
fn not_a_governable_stream(head: &ResponseHead) -> Option<String> {
    if let Some(enc) = head
        .content_encoding
        .as_deref()
        .filter(|e| !e.eq_ignore_ascii_case("identity"))
    {
        return Some(format!(
            "the upstream sent a {enc}-encoded stream although haltd asked for identity; compressed streams are not governed"
        ));
    }
    let sse = head
        .content_type
        .as_deref()
        .is_some_and(|c| c.to_ascii_lowercase().starts_with("text/event-stream"));
    if !sse {
        let ct = head.content_type.clone().unwrap_or_default();
        return Some(format!(
            "the upstream answered 200 with content-type {ct:?}, not text/event-stream"
        ));
    }
    None
}

/// Feeds every complete SSE event to the source, until the stream breaks.
fn feed_events(
    up: &mut Upstream,
    source: &mut UpstreamSource,
    endpoint: Endpoint,
    arrived_ns: u64,
) {
    loop {
        // The event is lent from the parser's buffers (no copy); the source reads it at once.
        match up.sse.next_event_ref() {
            Ok(None) => break,
            Ok(Some(ev)) => {
                up.events += 1;
                up.last_event_ns = monotonic_ns();
                if up.first_event_ns == 0 {
                    up.first_event_ns = up.last_event_ns;
                }
                if !source.push_event(endpoint, ev, arrived_ns) {
                    break;
                }
            }
            Err(e) => {
                source.push_broken(format!("malformed upstream event stream: {e}"));
                break;
            }
        }
    }
}
