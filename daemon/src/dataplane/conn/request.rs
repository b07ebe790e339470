//! A connection's request: reading it (with the request deadline, and `100 Continue` when
//! asked), routing it, and the replies that are not turns (errors, `/healthz`, the built-in
//! `/v1/models`).

use std::{io, sync::atomic::Ordering::SeqCst};

use io_uring::{opcode, squeue, types};

use crate::dataplane::conn::passthrough;
use crate::dataplane::conn::readiness;
use crate::dataplane::Step;
use crate::dataplane::{
    conn::KeepAlive,
    conn::{
        outbox::{frame, SendKind},
        RECV_CHUNK,
    },
    driver::op::{OpBuf, OpKind},
    timespec,
};
use crate::{
    clock::monotonic_ns,
    config::SourceKind,
    keys::ClientKeys,
    limits::{Limit, Limits},
    metrics::requests::{ClientError, Route},
    pulse::HeartbeatState,
    scope::Identity,
    source::builtin::MODEL_NAME,
    stream::Outcome,
    wire::{
        http,
        surface::{self, Handling},
        ClientRequest, Endpoint, HttpError, RequestHead,
    },
};

/// The `endpoint` label of a routed request.
fn route_label(row: &surface::Route) -> Route {
    match row.handling {
        Handling::Governed(Endpoint::Chat) => Route::Chat,
        Handling::Governed(Endpoint::Completion) => Route::Completions,
        Handling::Governed(Endpoint::Messages) | Handling::Refused(Endpoint::Messages, _) => {
            Route::Messages
        }
        Handling::Governed(Endpoint::Responses) => Route::Responses,
        Handling::Refused(..) => Route::Other,
        Handling::Models => Route::Models,
        Handling::Embeddings => Route::Embeddings,
        Handling::Health => Route::Health,
    }
}

/// The 404 for a path no row of the routing table serves: `unsupported_endpoint` under
/// `/v1/` (a surface haltd does not govern), `not_found` elsewhere.
fn unrouted(method: &str, path: &str) -> HttpError {
    let shown: String = path.chars().take(200).collect();
    if surface::is_api_path(path) {
        return HttpError::new(
            404,
            "invalid_request_error",
            format!("{shown} is not served by haltd (docs/wire-format.md lists what is)"),
        )
        .with_code(surface::UNSUPPORTED_ENDPOINT);
    }
    HttpError::new(
        404,
        "invalid_request_error",
        format!(
            "no route for {} {shown}",
            method.chars().take(32).collect::<String>()
        ),
    )
    .with_code("not_found")
}

impl Step<'_> {
    /// Receives more of the request, linked to the request deadline. The request buffer
    /// moves into the receive and comes back with its completion.
    pub(in crate::dataplane) fn arm_recv(&mut self) -> io::Result<()> {
        let max = http::MAX_HEAD_BYTES + self.io.shared.cfg.args.max_body_bytes + 1;
        let timeout = self.io.shared.cfg.request_timeout;
        let idle_timeout = self.io.shared.cfg.client_idle_timeout;
        let conn = &mut *self.conn;
        // The deadline is absolute, from accept (or the first byte of a kept connection's
        // next request) to the end of the body: a client that sends a byte now and then gets
        // no more time for it. A kept connection waits for that first byte at most the idle
        // timeout.
        let deadline = match conn.idle_since_ns {
            Some(since) => since + idle_timeout.as_nanos() as u64,
            None => conn.accepted_ns + timeout.as_nanos() as u64,
        };
        let Some(left) = deadline.checked_sub(monotonic_ns()).filter(|&l| l > 0) else {
            if conn.idle_since_ns.is_some() {
                return self.idle_timed_out();
            }
            return self.request_too_slow();
        };
        if conn.rbuf.as_ref().is_some_and(|b| b.len() >= max) {
            return Ok(());
        }
        let (buf, want) = if conn.tls.is_some() {
            // Ciphertext into the session's own buffer; its plaintext is appended to the
            // request (`client_tls.rs`).
            let mut buf = conn.tls_in.take().unwrap_or_default();
            buf.clear();
            buf.reserve(RECV_CHUNK);
            let want = buf.capacity();
            (buf, want)
        } else {
            let mut buf = conn.rbuf.take().unwrap_or_default();
            buf.reserve(RECV_CHUNK.min(max - buf.len()));
            let want = (buf.capacity() - buf.len()).min(max - buf.len());
            (buf, want)
        };
        let mut buf = buf;
        let ptr = buf.spare_capacity_mut().as_mut_ptr().cast::<u8>();
        let recv = opcode::Recv::new(types::Fd(conn.fd), ptr, want as u32)
            .build()
            .flags(squeue::Flags::IO_LINK);
        // The previous deadline's timespec may still be with its completion: a new one then.
        let mut ts = conn
            .read_ts
            .take()
            .unwrap_or_else(|| Box::new(timespec(timeout)));
        *ts = timespec(std::time::Duration::from_nanos(left));
        let link = opcode::LinkTimeout::new(&raw const *ts).build();
        let recv = self.submit(OpKind::Recv, OpBuf::Recv(buf), recv)?;
        self.conn.recv_op = Some(recv);
        self.submit(OpKind::RecvDeadline, OpBuf::Time(ts), link)
            .map(drop)
    }

    /// `--request-timeout-ms` passed since accept before the whole request arrived: 408.
    fn request_too_slow(&mut self) -> io::Result<()> {
        self.conn.leave_request_phase(&self.io.shared.admission);
        self.reply_error(&HttpError::new(
            408,
            "invalid_request_error",
            "the request did not arrive in time",
        ))
    }

    pub(in crate::dataplane) fn on_recv(&mut self, res: i32) -> io::Result<()> {
        let conn = &mut *self.conn;
        let idle = conn.idle_since_ns.is_some();
        if conn.closing || !(conn.reading || idle) {
            return Ok(());
        }
        if res == -libc::ECANCELED {
            if idle {
                return self.idle_timed_out();
            }
            return self.request_too_slow();
        }
        if res <= 0 {
            // The client went away before sending a whole request (or closed a kept
            // connection between requests).
            conn.outcome = Outcome::ClientGone;
            self.begin_close();
            return Ok(());
        }
        if idle && !self.request_begins()? {
            return Ok(());
        }
        self.on_request_bytes()
    }

    /// Parses what arrived of the request: reads on, answers `100 Continue`, refuses, or
    /// routes the whole request.
    pub(in crate::dataplane) fn on_request_bytes(&mut self) -> io::Result<()> {
        let conn = &mut *self.conn;
        let max_body = self.io.shared.cfg.args.max_body_bytes;
        let rbuf = conn.rbuf.as_deref().unwrap_or_default();
        let identity_header = self.io.shared.cfg.args.identity_header.as_deref();
        let head = match http::parse_head_with(rbuf, max_body, identity_header) {
            Ok(Some(h)) => h,
            Ok(None) => return self.arm_recv(),
            Err(e) => {
                // Answered in the error schema of the path's surface when its line was read
                // (a Messages client's two credentials: Anthropic's), and logged as its route.
                if let Some(row) = http::request_path(rbuf).and_then(surface::route) {
                    conn.route = route_label(row);
                }
                conn.leave_request_phase(&self.io.shared.admission);
                return self.reply_error(&e);
            }
        };
        if conn.request_id.is_none() {
            // The client's id when it is well formed, else one of haltd's (per request, not
            // per token).
            let rid = head
                .request_id
                .clone()
                .unwrap_or_else(crate::wire::trace::generate_request_id);
            conn.request_id = Some(rid.into());
            conn.request_id_from_client = head.request_id.is_some();
            conn.traceparent.clone_from(&head.traceparent);
        }
        self.choose_keep_alive(&head);
        let conn = &mut *self.conn;
        let rbuf = conn.rbuf.as_deref().unwrap_or_default();
        let have = rbuf.len() - head.head_len;
        if have < head.content_length {
            if head.expect_continue && !conn.continue_sent {
                conn.continue_sent = true;
                frame(&mut conn.wbuf).extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
                if conn.count_frame(self.io.shared.table.slot(conn.id.slot), 0, false) {
                    // The rest of the body is read after this send completes: one
                    // operation on `wbuf` at a time.
                    return self.send(SendKind::Continue100);
                } else {
                    return self.halt();
                }
            }
            return self.arm_recv();
        }
        let end = head.head_len + head.content_length;
        if have > head.content_length {
            if conn.keep == KeepAlive::Close {
                conn.leave_request_phase(&self.io.shared.admission);
                return self.reply_error(&HttpError::bad_request(
                    "bytes after the request body (pipelining needs connection: keep-alive)",
                ));
            }
            // Pipelined: the rest is the next request, read once this turn ended.
            conn.pipelined.clear();
            conn.pipelined.extend_from_slice(&rbuf[end..]);
        }
        conn.leave_request_phase(&self.io.shared.admission);
        // The request buffer is freed once the request is routed: nothing reads it after.
        let request = conn.rbuf.take().unwrap_or_default();
        let body = request.get(head.head_len..end).unwrap_or_default();
        self.route(head, body)
    }

    /// Routes a request by the table of `wire::surface`.
    pub(in crate::dataplane) fn route(&mut self, head: RequestHead, body: &[u8]) -> io::Result<()> {
        let path = head.path.split('?').next().unwrap_or_default();
        let Some(row) = surface::route(path) else {
            self.conn.route = Route::Other;
            return self.reply_error(&unrouted(&head.method, path));
        };
        self.conn.route = route_label(row);
        if head.method != row.method {
            return self.reply_error(&HttpError::method_not_allowed(&head.method, row.method));
        }
        let proxied = self.io.shared.cfg.args.source == SourceKind::Openai;
        let keyed = self.io.shared.cfg.args.client_keys == ClientKeys::Store;
        if keyed && matches!(row.handling, Handling::Embeddings | Handling::Models) {
            // With the key store every /v1/ request needs a key, before any upstream work
            // (a governed turn's is checked as it is admitted).
            if let Err(e) = self.identify(&head) {
                return self.reply_error(&e);
            }
        }
        match row.handling {
            Handling::Governed(endpoint) if proxied => {
                let who = match self.admit_turn(&head) {
                    Ok(who) => who,
                    Err(e) => return self.reply_error(&e),
                };
                self.start_proxy_turn(endpoint, &head, body, who)
            }
            Handling::Governed(endpoint) => {
                let who = match self.admit_turn(&head) {
                    Ok(who) => who,
                    Err(e) => return self.reply_error(&e),
                };
                match ClientRequest::parse(endpoint, body).and_then(|r| r.builtin_turn(MODEL_NAME))
                {
                    Ok(req) => self.start_builtin_turn(req, who),
                    Err(e) => self.reply_error(&e),
                }
            }
            Handling::Refused(_, why) => self.reply_error(
                &HttpError::new(404, "invalid_request_error", format!("{path}: {why}"))
                    .with_code(surface::UNSUPPORTED_ENDPOINT),
            ),
            Handling::Embeddings => self.start_embeddings(head, body),
            Handling::Health if path == "/healthz" => self.reply_health(),
            Handling::Health => self.reply_ready(),
            Handling::Models => self.route_models(&head, path, proxied),
        }
    }

    /// Who the request is (`scope.rs`): its scope and its conversation key, and with
    /// `--client-keys store` the key it authenticated with, or the 401 to answer. An HMAC
    /// (and with the store a SHA-256 and a read lock) per request, never per token.
    fn identify(&mut self, head: &RequestHead) -> Result<(Identity, Limits), HttpError> {
        let shared = &self.io.shared;
        let node = shared.limits.limits();
        if shared.cfg.args.client_keys == ClientKeys::Off {
            let group = self.conn.peer.map(|a| shared.admission.groups().group(a));
            let who = Identity::without_store(&shared.node_secret, head.credential(), group);
            return Ok((who, node));
        }
        let token = head.bearer.as_ref().map(|b| b.as_str());
        match shared
            .keys
            .verify(token, crate::clock::unix_ms(std::time::SystemTime::now()))
        {
            Ok(key) => {
                let who = Identity::of_key(&shared.node_secret, head.credential(), key.id);
                let limits = key.limits.over(node);
                self.conn.client_key = Some(key);
                Ok((who, limits))
            }
            Err(refusal) => Err(
                HttpError::new(401, "authentication_error", refusal.to_string())
                    .with_code("invalid_api_key")
                    .without_retry(),
            ),
        }
    }

    /// A governed turn's identity and its place in its scope's limits, or the 401 or 429 to
    /// answer.
    fn admit_turn(&mut self, head: &RequestHead) -> Result<Identity, HttpError> {
        let (who, limits) = self.identify(head)?;
        match self.over_limit(&who, limits) {
            Some(refused) => Err(refused),
            None => Ok(who),
        }
    }

    /// Takes the turn's place in its scope's limits (`limits.rs`), or the 429 to answer: before
    /// any upstream work. One lock per request, none without limits.
    fn over_limit(&mut self, who: &Identity, limits: Limits) -> Option<HttpError> {
        let shared = &self.io.shared;
        // A key of the store is always counted (`haltctl key list`, kept across restarts).
        if limits.is_none() && who.scope.kind != crate::scope::ScopeKind::Apikey {
            return None;
        }
        match shared.limits.admit(who.scope, limits, monotonic_ns()) {
            Ok(place) => {
                self.conn.place = Some(place);
                None
            }
            Err(r) => {
                shared
                    .metrics
                    .dataplane
                    .limit_refusals
                    .get_or_create(&crate::metrics::dataplane::LimitLabels {
                        limit: crate::metrics::dataplane::LimitLabel(r.limit),
                    })
                    .inc();
                let kind = match r.limit {
                    Limit::TokensPerMinute => "tokens",
                    Limit::Concurrency | Limit::RequestsPerMinute => "requests",
                };
                Some(
                    HttpError::new(429, kind, r.message())
                        .with_code("rate_limit_exceeded")
                        .with_retry_after(http::retry_after_seconds(r.retry_after_s)),
                )
            }
        }
    }

    /// `GET /v1/models` and `/v1/models/{id}`: the OpenAI list. A client that says
    /// `anthropic-version` (the Anthropic SDK's `models.list()`) is refused explicitly: the
    /// Anthropic form of the list is not served.
    fn route_models(&mut self, head: &RequestHead, path: &str, proxied: bool) -> io::Result<()> {
        if head.anthropic_version.is_some() {
            return self.reply_error(
                &HttpError::new(
                    404,
                    "invalid_request_error",
                    "the Anthropic form of the model list is not served; GET /v1/models without anthropic-version gives the OpenAI list",
                )
                .with_code(surface::UNSUPPORTED_ENDPOINT),
            );
        }
        match passthrough::model_id(path) {
            Some(Ok(id)) => {
                let id = id.to_owned();
                self.start_model(head.clone(), &id)
            }
            Some(Err(e)) => self.reply_error(&e),
            None if proxied => self.start_proxy_models(head.clone()),
            None => {
                let body = serde_json::json!({"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "haltd"}]}).to_string();
                self.reply(200, "application/json", body.as_bytes())
            }
        }
    }

    pub(in crate::dataplane) fn reply_health(&mut self) -> io::Result<()> {
        let now = monotonic_ns();
        // A syscall or two per health check (the gate's clock), never per token.
        let hb = self.io.shared.heartbeat_view(now);
        // An idle watchdog (it beat within its idle period) is a live one; this connection
        // normally woke it already (`HaltCore::watch_new_slot`), so it reads fresh.
        let fresh = hb.state != HeartbeatState::Lost;
        let recorder_ok = !self.io.shared.recorder_failed.load(SeqCst);
        let status = match (fresh, recorder_ok) {
            (true, true) => "ok",
            (false, _) => "heartbeat_lost",
            (true, false) => "recorder_failed",
        };
        let body = serde_json::json!({
            "status": status,
            "kernel_gate": self.io.shared.kernel_gate_label(),
            "heartbeat_state": hb.state,
            "heartbeat_age_ms": hb.age_ms_json(),
            "heartbeat_clock": hb.clock,
            "recorder_ok": recorder_ok,
            // Not counting this health check's own connection.
            "streams_active": self.io.shared.table.active_count().saturating_sub(1),
        })
        .to_string();
        let code = if fresh && recorder_ok { 200 } else { 503 };
        self.reply(code, "application/json", body.as_bytes())
    }

    /// `/readyz`: whether this haltd should get new turns (`readiness.rs`).
    pub(in crate::dataplane) fn reply_ready(&mut self) -> io::Result<()> {
        let (ready, body) = readiness::check(&self.io.shared);
        self.reply(
            if ready { 200 } else { 503 },
            "application/json",
            body.as_bytes(),
        )
    }

    pub(in crate::dataplane) fn reply(
        &mut self,
        status: u16,
        content_type: &str,
        body: &[u8],
    ) -> io::Result<()> {
        self.reply_with(status, content_type, body, &[])
    }

    pub(in crate::dataplane) fn reply_with(
        &mut self,
        status: u16,
        content_type: &str,
        body: &[u8],
        extra: &[(&str, &str)],
    ) -> io::Result<()> {
        let conn = &mut *self.conn;
        let rid = request_id(&mut conn.request_id);
        // A few header fields per reply (not per token).
        let mut fields = extra.to_vec();
        fields.push(("x-request-id", &rid));
        let out = frame(&mut conn.wbuf);
        http::write_head(
            out,
            status,
            content_type,
            Some(body.len()),
            Some(conn.id),
            &fields,
        );
        out.extend_from_slice(body);
        conn.status = status;
        if status >= 400 {
            self.io.shared.metrics.dataplane.rejected(status);
            conn.outcome = Outcome::Rejected;
        }
        self.send_reply()
    }

    pub(in crate::dataplane) fn reply_error(&mut self, err: &HttpError) -> io::Result<()> {
        let conn = &mut *self.conn;
        tracing::debug!(stream_id = %conn.id, status = err.status, detail = %err.message, "request refused");
        let rid = request_id(&mut conn.request_id);
        let schema = match conn.route {
            Route::Messages => Endpoint::Messages,
            _ => Endpoint::Chat,
        };
        http::write_error_response(
            frame(&mut conn.wbuf),
            err,
            Some(conn.id),
            Some(&rid),
            schema,
        );
        conn.status = err.status;
        self.io.shared.metrics.dataplane.rejected(err.status);
        if let Some(reason) = ClientError::of_status(err.status) {
            self.io.shared.metrics.requests.client_error(reason);
        }
        conn.outcome = Outcome::Rejected;
        self.send_reply()
    }

    /// Sends the reply in the connection's frame buffer as the final frame (counted in the
    /// trip's frame window; a trip that came first halts instead).
    fn send_reply(&mut self) -> io::Result<()> {
        let conn = &*self.conn;
        if self
            .io
            .shared
            .table
            .slot(conn.id.slot)
            .begin_final(conn.wire_len())
        {
            self.send(SendKind::Reply)
        } else {
            self.halt()
        }
    }
}

/// The request's id, generated now for a request refused before its head was read.
fn request_id(id: &mut Option<std::sync::Arc<str>>) -> std::sync::Arc<str> {
    std::sync::Arc::clone(
        id.get_or_insert_with(|| crate::wire::trace::generate_request_id().into()),
    )
}
