//! What a request leaves when it ends: one summary, taken once, at the end (the close of its
//! connection, or the start of a kept connection's next request), from which both the access
//! log line and the request metrics are written, so they cannot disagree.
//!
//! A request is a connection's request once one began (its `x-request-id` is known): a
//! connection that never sent one, or a kept connection that closes idle, leaves nothing. A
//! connection refused at accept (an admission cap, `--max-streams`) gets a line of its own
//! ([`Io::summarize_refusal`]).

use std::sync::Arc;

use crate::dataplane::Io;
use crate::dataplane::{conn::Conn, turn::Turn};
use crate::{
    access_log::Entry,
    clock::monotonic_ns,
    metrics::requests::{Observed, Route},
    stream::{Mode, Outcome, SlotSnapshot},
};

/// Tokens a request delivered to its client: a streamed turn's token frames the kernel
/// accepted, a batch turn's tokens once its whole response went out.
fn tokens(turn: Option<&Turn>, snap: &SlotSnapshot, outcome: Outcome) -> u64 {
    match (turn, snap.mode) {
        (Some(_), Mode::Stream) => snap.tokens_delivered,
        (Some(t), Mode::Batch) if outcome == Outcome::Completed => t.tokens_generated,
        _ => 0,
    }
}

impl Io {
    /// The request on `conn` ended: its access log line and its metrics.
    pub(in crate::dataplane) fn summarize(&self, conn: &Conn) {
        let Some(request_id) = conn.request_id.as_deref() else {
            return; // no request began
        };
        let shared = &self.shared;
        let snap = shared.table.slot(conn.id.slot).snapshot(conn.id.slot);
        let outcome = match conn.outcome {
            _ if snap.trip_cause.is_some() => Outcome::of_turn(snap.trip_cause, conn.outcome),
            // A reply that is not a turn (`/healthz`, `/v1/models`) and not an error.
            Outcome::Open if (200..400).contains(&conn.status) => Outcome::Completed,
            o => o,
        };
        let duration_ns = monotonic_ns().saturating_sub(snap.started_ns);
        let turn = conn.turn.as_deref();
        let ttft_ns = turn
            .map(|t| t.obs.first_token_ns)
            .filter(|&t| t != 0)
            .map(|t| t.saturating_sub(snap.started_ns));
        let label = turn
            .and_then(|t| t.obs.model_label.clone())
            .unwrap_or_else(|| shared.metrics.requests.models.label(None));
        let stream_id = conn.id.to_string();
        let key = turn.map(|t| t.key_id.fingerprint());
        let halt_code = snap.trip_cause.map(|c| c.as_str());
        shared.access_log.write(&Entry {
            stream_id: &stream_id,
            request_id,
            key: key.as_deref(),
            key_name: conn.client_key.as_ref().map(|k| k.name.as_str()),
            model: turn.map(|t| &*t.enc.model),
            profile: turn.map(|t| t.policy.profile.as_str()),
            route: turn.map(|t| &*t.policy.route.name),
            surface: conn.route.surface().as_str(),
            endpoint: conn.route.as_str(),
            status: conn.status,
            tokens: tokens(turn, &snap, outcome),
            ttft_ms: ttft_ns.map(|ns| ns as f64 / 1e6),
            duration_ms: duration_ns as f64 / 1e6,
            outcome: outcome.as_str(),
            halt_code,
            initiator: halt_code
                .and(snap.trip_initiator)
                .map(crate::stream::Initiator::as_str),
            upstream_request_id: conn.up.as_ref().and_then(|u| u.request_id.as_deref()),
        });
        shared.metrics.requests.observe(&Observed {
            endpoint: conn.route,
            model: &label,
            outcome,
            ttft_ns,
            duration_ns,
        });
    }

    /// A connection refused at accept, before its request was read: a line with a
    /// generated request id (echoed in the refusal) and no stream.
    pub(in crate::dataplane) fn summarize_refusal(&self, request_id: &str, status: u16) {
        let shared = &self.shared;
        shared.access_log.write(&Entry {
            stream_id: "-",
            request_id,
            key: None,
            key_name: None,
            model: None,
            profile: None,
            route: None,
            surface: Route::Other.surface().as_str(),
            endpoint: Route::Other.as_str(),
            status,
            tokens: 0,
            ttft_ms: None,
            duration_ms: 0.0,
            outcome: Outcome::Rejected.as_str(),
            halt_code: None,
            initiator: None,
            upstream_request_id: None,
        });
        let label: Arc<str> = shared.metrics.requests.models.label(None);
        shared.metrics.requests.observe(&Observed {
            endpoint: Route::Other,
            model: &label,
            outcome: Outcome::Rejected,
            ttft_ns: None,
            duration_ns: 0,
        });
    }
}
