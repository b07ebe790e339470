//! The upstream socket of a proxied turn (`--source openai`, and `GET /v1/models`), on the
//! same io_uring as the client connection: connect (linked timeout) → send the request
//! (always `stream: true`, logprobs on; [`crate::upstream::prepare_turn`]) → receive the
//! response (linked timeout: time to the first event, then the inter-token deadline; see
//! `upstream_io/recv.rs`). What arrives feeds the turn's [`crate::source::upstream`] source,
//! which the pipeline governs exactly like built-in tokens. The upstream socket is not
//! governed: only client-facing sends carry tokens.
//!
//! Connections are kept alive and reused (`pool.rs`, `upstream_io/reuse.rs`): a turn takes an
//! idle connection of its worker when there is one and sends at once, else connects. An
//! `https://` upstream's connections carry a TLS session (`upstream_io/tls.rs`) between these
//! sends and receives and the HTTP side.
//!
//! Cancellation: a trip, a client that goes away, or a failure shuts the upstream socket down
//! (`shutdown(SHUT_RDWR)` sends the FIN at once, whatever is in flight on it; vLLM aborts a
//! generation whose connection closes) and the turn's record says why. Such a connection is
//! never pooled.
//!
//! Failures map to a typed end: before the client's response began, an HTTP error whose
//! status says whose fault it was (the upstream's 4xx passes through as that 4xx, its 5xx and
//! every transport failure become 502, timeouts 504); after it began, a trip with
//! `UPSTREAM_FAILURE` whose terminal event carries `upstream: {kind, message}`.

pub(in crate::dataplane) mod exchange;
pub(in crate::dataplane) mod pool;
pub(in crate::dataplane) mod recv;
pub(in crate::dataplane) mod reuse;
pub(in crate::dataplane) mod sock;
pub(in crate::dataplane) mod tls;

use std::{io, net::SocketAddr, sync::atomic::Ordering::SeqCst, sync::Arc};

use io_uring::{opcode, squeue, types};
use serde_json::json;

use crate::dataplane::turn::own_trip;
use crate::dataplane::Step;
use crate::dataplane::{
    driver::op::{OpBuf, OpKind},
    timespec,
    upstream_io::sock::{sockaddr, upstream_socket},
};
use crate::{
    clock::monotonic_ns,
    codes::FailureCode,
    metrics::requests::Route,
    stream::Outcome,
    upstream::{self, CancelReason, UpstreamFailure, UpstreamFailureKind},
    wire::{messages, HttpError},
};

/// Receive buffer per upstream connection.
pub(in crate::dataplane) const UP_RECV_CHUNK: usize = 16 * 1024;
/// How long the end of a body (the chunked terminator behind `[DONE]`) may take once the
/// turn has all it needs; past it the connection is closed rather than pooled.
pub(in crate::dataplane) const DRAIN_TIMEOUT_NS: u64 = 250_000_000;

pub(in crate::dataplane) use crate::dataplane::upstream_io::exchange::{
    Purpose, Reuse, Upstream, UpstreamRequest,
};

impl Step<'_> {
    /// Opens an upstream exchange for connection `key`: socket, request bytes, connect.
    pub(in crate::dataplane) fn open_upstream(
        &mut self,
        req: &UpstreamRequest<'_>,
        system_prompt: String,
    ) -> io::Result<()> {
        let shared = Arc::clone(&self.io.shared);
        let Some(url) = shared.cfg.upstream.as_ref() else {
            return self.reply_error(&HttpError::new(
                500,
                "server_error",
                "no upstream configured",
            ));
        };
        let pool_metrics = &shared.metrics.upstream.pool;
        let mut pooled = self.io.pool.take(monotonic_ns(), pool_metrics);
        if shared.cfg.upstream_tls.is_some() && pooled.as_ref().is_some_and(|k| k.tls.is_none()) {
            // Never in clear to an https:// upstream: a pooled connection of such an upstream
            // always has its session; one without would be a bug, and is not used.
            if let Some(k) = pooled.take() {
                pool::close_kept(k);
            }
        }
        let tls = pooled.as_mut().and_then(|k| k.tls.take());
        let reused = pooled.is_some();
        // A new connection goes to the latest resolution of the upstream's name.
        let addr = match (&pooled, shared.upstream_health.as_ref().map(|h| h.addr())) {
            (None, Some(Ok(addr))) => Some(addr),
            (None, Some(Err(unresolved))) => return self.reply_error(&unresolved),
            _ => None,
        };
        let fd = match (pooled, addr) {
            (Some(k), _) => Ok(k.fd),
            (None, Some(addr)) => upstream_socket(addr),
            (None, None) => Err(io::ErrorKind::AddrNotAvailable.into()),
        };
        let fd = match fd {
            Ok(fd) => fd,
            Err(e) => {
                return self.reply_error(&HttpError::new(
                    503,
                    "server_error",
                    format!("cannot open a socket to the upstream: {e}"),
                ))
            }
        };
        let mut wbuf = Vec::new();
        // haltd's own key (`--upstream-api-key-file`) replaces the client's credential; a key
        // of haltd's store (`--client-keys store`) is haltd's to check and never goes upstream.
        let authorization = match &shared.cfg.upstream_api_key {
            Some(k) => Some(k.header_value()),
            None if shared.cfg.client_credential_goes_upstream() => req.authorization,
            None => None,
        };
        let stream_id = self.conn.id.to_string();
        let fields = self.conn.upstream_headers(&shared.cfg, &stream_id);
        let refs: Vec<(&str, &str)> = fields.iter().map(|(n, v)| (*n, v.as_str())).collect();
        upstream::write_http_request_with(
            &mut wbuf,
            url,
            (req.method, req.api_path),
            authorization,
            &refs,
            req.body,
        );
        let mut up = Box::new(Upstream::new(fd, req, wbuf, system_prompt));
        up.added_headers = fields.iter().map(|(n, _)| *n).collect();
        up.request_id = fields
            .into_iter()
            .find_map(|(n, v)| (n == "x-request-id").then_some(v));
        if reused {
            // An idle keep-alive connection: the request goes out at once (in its TLS
            // session, if it has one: no new handshake).
            pool_metrics.reused.inc();
            up.reused = true;
            let mut request = std::mem::take(&mut up.wbuf);
            if let Some(mut link) = tls {
                link.seal(&request);
                // Kept in clear for the one retry, which starts a new session.
                up.request = request;
                request = link.pending().unwrap_or_default();
                up.tls = Some(link);
            }
            self.conn.up = Some(up);
            self.up_send(request, 0)?;
        } else {
            self.conn.up = Some(up);
            self.up_connect(addr)?;
        }
        self.arm_watch()
    }

    /// Connects the upstream socket (a new one, made for `addr`) of connection `key`.
    pub(in crate::dataplane) fn up_connect(&mut self, addr: Option<SocketAddr>) -> io::Result<()> {
        let shared = Arc::clone(&self.io.shared);
        let (Some(addr), Some(up)) = (addr, self.conn.up.as_ref()) else {
            return Ok(());
        };
        shared.metrics.upstream.pool.opened.inc();
        let addr = sockaddr(addr);
        let addr_ptr: *const libc::sockaddr = (&raw const addr.storage).cast();
        let connect = opcode::Connect::new(types::Fd(up.fd), addr_ptr, addr.len)
            .build()
            .flags(squeue::Flags::IO_LINK);
        let timeout = shared.cfg.upstream_connect_timeout;
        let buf = OpBuf::Addr(addr);
        let op = self.submit_with_deadline(OpKind::UpConnect, buf, connect, timeout)?;
        if let Some(up) = self.conn.up.as_mut() {
            up.connect_op = Some(op);
        }
        Ok(())
    }

    pub(in crate::dataplane) fn on_up_connect(&mut self, res: i32) -> io::Result<()> {
        let conn = &mut *self.conn;
        let Some(up) = conn.up.as_mut() else {
            return Ok(());
        };
        up.connect_op = None;
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
            return self.up_fail(kind, format!("upstream {what}"), None);
        }
        let request = std::mem::take(&mut up.wbuf);
        if self.io.shared.cfg.upstream_tls.is_some() {
            return self.up_tls_begin(request);
        }
        self.up_send(request, 0)
    }

    /// Sends `buf[off..]` of the request. An upstream that accepts but never reads must not
    /// hold the turn: the connect timeout bounds each send of the request too.
    pub(in crate::dataplane) fn up_send(&mut self, buf: Vec<u8>, off: usize) -> io::Result<()> {
        let timeout = self.io.shared.cfg.upstream_connect_timeout;
        let Some(up) = self.conn.up.as_mut() else {
            return Ok(());
        };
        let rest = &buf[off..];
        let e = opcode::Send::new(types::Fd(up.fd), rest.as_ptr(), rest.len() as u32)
            .flags(libc::MSG_NOSIGNAL)
            .build()
            .flags(squeue::Flags::IO_LINK);
        let buf = OpBuf::Send { buf, off };
        let op = self.submit_with_deadline(OpKind::UpSend, buf, e, timeout)?;
        if let Some(up) = self.conn.up.as_mut() {
            up.send_op = Some(op);
        }
        Ok(())
    }

    /// Submits an upstream operation (built with `IO_LINK`) and, linked to it, a timeout of
    /// `deadline`; returns the operation's `user_data`.
    pub(in crate::dataplane) fn submit_with_deadline(
        &mut self,
        kind: OpKind,
        buf: OpBuf,
        entry: squeue::Entry,
        deadline: std::time::Duration,
    ) -> io::Result<u64> {
        let conn = &mut *self.conn;
        let mut ts = conn
            .up
            .as_mut()
            .and_then(|u| u.ts.take())
            .unwrap_or_else(|| Box::new(timespec(deadline)));
        *ts = timespec(deadline);
        let link = opcode::LinkTimeout::new(&raw const *ts).build();
        let op = self.submit(kind, buf, entry)?;
        self.submit(OpKind::UpDeadline, OpBuf::Time(ts), link)?;
        if let Some(up) = self.conn.up.as_mut() {
            up.links += 1;
        }
        Ok(op)
    }

    /// The request's send completed; `buf` is the request, back from the kernel.
    pub(in crate::dataplane) fn on_up_send(
        &mut self,
        res: i32,
        buf: Vec<u8>,
        off: usize,
    ) -> io::Result<()> {
        let conn = &mut *self.conn;
        let Some(up) = conn.up.as_mut() else {
            return Ok(());
        };
        up.send_op = None;
        if up.finished || conn.closing {
            return Ok(());
        }
        if res == -libc::ECANCELED {
            return self.up_fail(
                UpstreamFailureKind::ConnectTimeout,
                "the upstream did not take the request in time".to_owned(),
                None,
            );
        }
        if res <= 0 {
            // A pooled connection the upstream closed meanwhile: retried once, afresh (a TLS
            // connection kept its request in clear already).
            if up.tls.is_none() {
                up.request = buf;
            }
            if self.up_retry()? {
                return Ok(());
            }
            let e = io::Error::from_raw_os_error(-res);
            return self.up_fail(
                UpstreamFailureKind::IoError,
                format!("sending the request to the upstream: {e}"),
                None,
            );
        }
        let off = off + res as usize;
        if off < buf.len() {
            return self.up_send(buf, off);
        }
        if let Some(link) = up.tls.as_mut() {
            // The send buffer back for the next records; the session may have more to send.
            link.recycle(buf);
            if self.up_tls_flush()? {
                return Ok(());
            }
        } else if up.reused && !up.retried {
            // Kept until the response begins, for the one retry.
            up.request = buf;
        }
        self.up_arm_recv()
    }

    /// Arms a receive on the upstream socket with the deadline that applies now (time to
    /// the first event, or the inter-token stall deadline; the worker's sweep timer enforces
    /// it, `deadline.rs`), unless one is armed, the queue is full (backpressure) or the
    /// exchange is over.
    pub(in crate::dataplane) fn up_arm_recv(&mut self) -> io::Result<()> {
        let cfg_first = self.io.shared.cfg.upstream_first_token_timeout;
        let cfg_stall = self.io.shared.cfg.upstream_stall_timeout;
        let conn = &mut *self.conn;
        let Some(up) = conn.up.as_mut() else {
            return Ok(());
        };
        // The end of a finished body is read on (to pool the connection) even while the
        // client's connection closes.
        let draining = up.finished && up.reuse == Reuse::Draining;
        if conn.closing && !draining {
            return Ok(());
        }
        let source_full = conn
            .turn
            .as_ref()
            .and_then(|t| t.source.upstream())
            .is_some_and(|s| !s.wants_more());
        // Not for the turn any more (a drain reads on), or back-pressure from the source.
        let done_or_full = (up.finished || source_full) && !draining;
        if done_or_full
            || up.recv_op.is_some()
            || up.links > 0
            || up.send_op.is_some()
            || up.connect_op.is_some()
        {
            return Ok(());
        }
        // Deadlines are absolute: time to the first event counts from the request, the stall
        // deadline from the last event. Bytes that are no event (keep-alive comments, a
        // response head) do not extend them.
        let deadline = if draining {
            monotonic_ns() + DRAIN_TIMEOUT_NS
        } else if up.events == 0 {
            up.started_ns + cfg_first.as_nanos() as u64
        } else {
            up.last_event_ns + cfg_stall.as_nanos() as u64
        };
        let mut buf = up
            .rbuf
            .take()
            .unwrap_or_else(|| Vec::with_capacity(UP_RECV_CHUNK));
        buf.clear();
        let ptr = buf.spare_capacity_mut().as_mut_ptr().cast::<u8>();
        let recv = if up.tls.as_ref().is_some_and(|t| t.peer_closed()) {
            // The TLS stream ended with the last data (close_notify): nothing more will be
            // read, whether or not a FIN follows; a no-op completes as the end of stream.
            opcode::Nop::new().build()
        } else {
            self.io
                .ring_setup
                .recv_when_ready(up.fd, ptr, buf.capacity())
        };
        up.recv_deadline_ns = deadline;
        up.recv_cancelled = false;
        up.recv_stopped = false;
        let op = self.submit(OpKind::UpRecv, OpBuf::Recv(buf), recv)?;
        if let Some(up) = self.conn.up.as_mut() {
            up.recv_op = Some(op);
        }
        self.io.arm_sweep()
    }

    /// A linked deadline completed; `ts` is its timespec, back for the next one.
    pub(in crate::dataplane) fn on_up_link(&mut self, ts: Box<types::Timespec>) -> io::Result<()> {
        let conn = &mut *self.conn;
        if let Some(up) = conn.up.as_mut() {
            up.ts = Some(ts);
            up.links = up.links.saturating_sub(1);
            // The linked timeout of the previous receive completes after it; a receive that
            // was due meanwhile (the queue drained) is armed now.
            let queued = conn
                .turn
                .as_ref()
                .and_then(|t| t.source.upstream())
                .is_some_and(|s| s.has_items());
            if !queued && up.links == 0 {
                return self.up_arm_recv();
            }
        }
        Ok(())
    }

    /// Ends the upstream exchange because of a trip or a client that went away: the
    /// connection is shut down at once, which makes vLLM abort the generation.
    pub(in crate::dataplane) fn up_cancel(&mut self, reason: CancelReason) {
        let conn = &mut *self.conn;
        let Some(up) = conn.up.as_mut() else {
            return;
        };
        if up.finished {
            // Its response is complete, but the turn ends tripped or without its client:
            // never pooled.
            up.discard();
            return;
        }
        up.finished = true;
        up.cancelled = Some(reason);
        if let Some(s) = conn.turn.as_mut().and_then(|t| t.source.upstream_mut()) {
            s.clear();
        }
        self.io.shared.metrics.upstream.cancelled(reason);
        tracing::info!(stream_id = %conn.id, reason = %reason, "cancelling the upstream request");
        up.shutdown();
        if let Some(target) = up.connect_op {
            let e = opcode::AsyncCancel::new(target).build();
            // A failed submission leaves the connect to its deadline.
            let _ = self.submit(OpKind::Cancel, OpBuf::None, e);
        }
    }

    /// The upstream failed: count and note it, close the exchange, and end the turn with the
    /// typed error (an HTTP error before the response began, else an UPSTREAM_FAILURE trip).
    pub(in crate::dataplane) fn up_fail(
        &mut self,
        kind: UpstreamFailureKind,
        message: String,
        upstream_status: Option<u16>,
    ) -> io::Result<()> {
        let shared = Arc::clone(&self.io.shared);
        let conn = &mut *self.conn;
        let id = conn.id;
        let Some(up) = conn.up.as_mut() else {
            return Ok(());
        };
        let failure = UpstreamFailure::new(kind, message, upstream_status);
        up.finished = true;
        if let Some(s) = conn.turn.as_mut().and_then(|t| t.source.upstream_mut()) {
            s.clear();
        }
        up.failure = Some(failure.clone());
        up.discard();
        let purpose = up.purpose;
        let retry_after = up.retry_after.clone();
        shared.metrics.upstream_failed(&failure);
        tracing::warn!(stream_id = %id, kind = %kind, source = failure.source().as_str(), retry = failure.retry(), detail = %failure.message, "upstream failure");
        let slot = shared.table.slot(id.slot);
        if slot.is_tripped() {
            return self.halt();
        }
        if purpose == Purpose::Turn {
            shared.meta(id.slot).upstream_failure = Some(failure.clone());
        }
        if !slot.headers_sent.load(SeqCst) && conn.emit.idle() {
            // Nothing of the response went out: answer with a status that says whose fault
            // it was, and the error object.
            let status = failure.http_status();
            let mut error = json!({
                "message": failure.message,
                "type": failure.error_type(),
                "code": FailureCode::UpstreamFailure.as_str(),
                "upstream": {"kind": kind.as_str(), "status": upstream_status},
                "stream_id": id.to_string(),
            });
            // In the error shape of the client's surface, as every other error: a Messages
            // client's SDK reads Anthropic's `{"type": "error", "error": {type, ...}}`.
            let body = if conn.route == Route::Messages {
                error["type"] = messages::terminal::error_type(status).into();
                json!({"type": "error", "error": error})
            } else {
                json!({ "error": error })
            }
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
            self.reply_with(status, "application/json", body.as_bytes(), &extra)?;
            self.conn.outcome = Outcome::UpstreamFailed;
            return Ok(());
        }
        // The client's stream is open: a trip, so the terminal event carries the failure
        // and the halt is recorded like any other.
        // Halted now or halting already under an earlier cause, the halt path ends it; one
        // that finished has nothing left to send, and the halt path closes it as it is.
        own_trip::trip_own(
            &shared,
            id,
            FailureCode::UpstreamFailure,
            crate::stream::Initiator::of(FailureCode::UpstreamFailure),
        );
        self.halt()
    }
}
