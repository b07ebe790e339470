//! Requests as a client sees them: how many, by endpoint, model and outcome; how long to the
//! first token, between tokens and to the end, by endpoint and model; and the requests that
//! failed by the client's own fault (`haltd_client_errors_total`), kept apart from upstream
//! failures.
//!
//! All of it is observed from the one summary each request leaves when it ends
//! (`dataplane/conn/summary.rs`), which also writes the access log line: the line and the metrics
//! cannot disagree. The exception is the inter-token histogram, observed as each token frame is
//! delivered, through a handle the turn resolved at its start (one atomic add, no lookup, no
//! lock).

use std::sync::Arc;

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder},
    metrics::{counter::Counter, family::Family},
    registry::{Registry, Unit},
};

use crate::{histogram::NsHistogram, metrics::models::ModelLabels, stream::Outcome};

/// Bounds in ns doubling from `first`.
const fn doubling<const N: usize>(first: u64) -> [u64; N] {
    let mut b = [0; N];
    let mut i = 0;
    while i < N {
        b[i] = first << i;
        i += 1;
    }
    b
}

/// `haltd_time_to_first_token_seconds`: 5 ms to 164 s.
pub const TTFT_BUCKETS_NS: [u64; 16] = doubling(5_000_000);
/// `haltd_inter_token_latency_seconds`: 100 µs to 3.3 s.
pub const ITL_BUCKETS_NS: [u64; 16] = doubling(100_000);
/// `haltd_request_duration_seconds`: 10 ms to 328 s.
pub const DURATION_BUCKETS_NS: [u64; 16] = doubling(10_000_000);

/// What a request asked for: the `endpoint` label.
#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Route {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
    /// `/v1/messages` (and its refused `count_tokens`).
    Messages,
    /// `/v1/responses`.
    Responses,
    /// `/v1/models`, `/v1/models/{id}`.
    Models,
    /// `/v1/embeddings` (relayed, no tokens governed).
    Embeddings,
    /// `/healthz`, `/readyz`.
    Health,
    /// Anything else, or a request refused before its path was read.
    #[default]
    Other,
}

impl Route {
    pub const fn as_str(self) -> &'static str {
        match self {
            Route::Chat => "chat",
            Route::Completions => "completions",
            Route::Messages => "messages",
            Route::Responses => "responses",
            Route::Models => "models",
            Route::Embeddings => "embeddings",
            Route::Health => "health",
            Route::Other => "other",
        }
    }

    /// The API family the route belongs to: the `surface` label.
    pub const fn surface(self) -> Surface {
        match self {
            Route::Chat
            | Route::Completions
            | Route::Responses
            | Route::Models
            | Route::Embeddings => Surface::Openai,
            Route::Messages => Surface::Anthropic,
            Route::Health => Surface::Haltd,
            Route::Other => Surface::Other,
        }
    }

    /// Whether requests of this route are turns (they have tokens and latency histograms).
    pub const fn is_turn(self) -> bool {
        matches!(
            self,
            Route::Chat | Route::Completions | Route::Messages | Route::Responses
        )
    }
}

impl EncodeLabelValue for Route {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

/// Whose API a request spoke: the `surface` label (OpenAI's chat, completions, responses,
/// models and embeddings; Anthropic's Messages; haltd's own health checks; anything unrouted).
#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Surface {
    Openai,
    Anthropic,
    Haltd,
    #[default]
    Other,
}

impl Surface {
    pub const fn as_str(self) -> &'static str {
        match self {
            Surface::Openai => "openai",
            Surface::Anthropic => "anthropic",
            Surface::Haltd => "haltd",
            Surface::Other => "other",
        }
    }
}

impl EncodeLabelValue for Surface {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

/// Why a request failed by the client's fault: the `reason` label of
/// `haltd_client_errors_total`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum ClientError {
    /// haltd refused the request as malformed or unacceptable (400, 411, 413, 415, 417, 422,
    /// 431, 505).
    InvalidRequest,
    /// No such route (404).
    NotFound,
    /// The route exists, not with this method (405).
    MethodNotAllowed,
    /// The request did not arrive within `--request-timeout-ms` (408).
    RequestTimeout,
    /// The upstream refused the request with a 4xx of its own (an unknown model, a bad
    /// parameter, a missing key).
    UpstreamRefused,
}

impl ClientError {
    pub const ALL: [ClientError; 5] = [
        ClientError::InvalidRequest,
        ClientError::NotFound,
        ClientError::MethodNotAllowed,
        ClientError::RequestTimeout,
        ClientError::UpstreamRefused,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            ClientError::InvalidRequest => "invalid_request",
            ClientError::NotFound => "not_found",
            ClientError::MethodNotAllowed => "method_not_allowed",
            ClientError::RequestTimeout => "request_timeout",
            ClientError::UpstreamRefused => "upstream_refused",
        }
    }

    /// The client error of a status haltd answers itself, if it is one (429 and 5xx are
    /// haltd's own refusals, not the client's fault; 505 is the client's HTTP version).
    pub const fn of_status(status: u16) -> Option<Self> {
        match status {
            404 => Some(ClientError::NotFound),
            405 => Some(ClientError::MethodNotAllowed),
            408 => Some(ClientError::RequestTimeout),
            429 => None,
            400..=499 | 505 => Some(ClientError::InvalidRequest),
            _ => None,
        }
    }
}

impl EncodeLabelValue for ClientError {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClientErrorLabels {
    pub reason: ClientError,
}

/// The labels of the latency histograms.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub endpoint: Route,
    /// A known model name, `other` or `none` ([`ModelLabels`]).
    pub model: String,
}

/// The labels of `haltd_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub surface: Surface,
    pub endpoint: Route,
    pub model: String,
    pub outcome: Outcome,
}

type NsFamily = Family<RouteLabels, NsHistogram, fn() -> NsHistogram>;

/// What one request left when it ended, as the metrics take it.
#[derive(Debug, Clone, Copy)]
pub struct Observed<'a> {
    pub endpoint: Route,
    /// The resolved label ([`ModelLabels::label`]).
    pub model: &'a str,
    pub outcome: Outcome,
    /// Time to the first token reaching the client, if one did.
    pub ttft_ns: Option<u64>,
    pub duration_ns: u64,
}

/// `haltd_requests_total`, `haltd_time_to_first_token_seconds`,
/// `haltd_inter_token_latency_seconds`, `haltd_request_duration_seconds`,
/// `haltd_client_errors_total`, and the known model names.
#[derive(Debug)]
pub struct RequestMetrics {
    pub requests: Family<RequestLabels, Counter>,
    pub ttft: NsFamily,
    pub inter_token: NsFamily,
    pub duration: NsFamily,
    pub client_errors: Family<ClientErrorLabels, Counter>,
    /// The model names labels may carry.
    pub models: ModelLabels,
}

impl RequestMetrics {
    /// Registers on `reg` (prefix `haltd`).
    pub fn register(reg: &mut Registry) -> Self {
        let requests = Family::<RequestLabels, Counter>::default();
        reg.register(
            "requests",
            "Requests answered, by surface (whose API: openai, anthropic, haltd), endpoint, model (a known name, other or none) and outcome; one per access log line",
            requests.clone(),
        );
        let ttft: NsFamily = Family::new_with_constructor(|| NsHistogram::new(&TTFT_BUCKETS_NS));
        reg.register_with_unit(
            "time_to_first_token",
            "Turns: from the request's start to the first token frame's delivery to the client (a batch turn: its whole response), by endpoint and model",
            Unit::Seconds,
            ttft.clone(),
        );
        let inter_token: NsFamily =
            Family::new_with_constructor(|| NsHistogram::new(&ITL_BUCKETS_NS));
        reg.register_with_unit(
            "inter_token_latency",
            "Streamed turns: time between consecutive token frames delivered to the client, by endpoint and model",
            Unit::Seconds,
            inter_token.clone(),
        );
        let duration: NsFamily =
            Family::new_with_constructor(|| NsHistogram::new(&DURATION_BUCKETS_NS));
        reg.register_with_unit(
            "request_duration",
            "Turns, end to end: from the request's start to its end (completed, halted, failed or refused), by endpoint and model",
            Unit::Seconds,
            duration.clone(),
        );
        let client_errors = Family::<ClientErrorLabels, Counter>::default();
        reg.register(
            "client_errors",
            "Requests that failed by the client's fault, by reason: invalid_request, not_found, method_not_allowed, request_timeout (haltd's own refusals), upstream_refused (the upstream's 4xx: an unknown model, a bad parameter); not upstream failures",
            client_errors.clone(),
        );
        for reason in ClientError::ALL {
            drop(client_errors.get_or_create(&ClientErrorLabels { reason }));
        }
        RequestMetrics {
            requests,
            ttft,
            inter_token,
            duration,
            client_errors,
            models: ModelLabels::default(),
        }
    }

    /// A request failed by the client's fault.
    pub fn client_error(&self, reason: ClientError) {
        self.client_errors
            .get_or_create(&ClientErrorLabels { reason })
            .inc();
    }

    /// The inter-token histogram of a turn, resolved once at its start: what it observes per
    /// token frame (lock-free, no lookup).
    pub fn inter_token_handle(&self, endpoint: Route, model: &Arc<str>) -> NsHistogram {
        let labels = RouteLabels {
            endpoint,
            model: model.to_string(),
        };
        self.inter_token.get_or_create(&labels).clone()
    }

    /// A request ended: counted, and a turn's latencies observed.
    pub fn observe(&self, o: &Observed<'_>) {
        self.requests
            .get_or_create(&RequestLabels {
                surface: o.endpoint.surface(),
                endpoint: o.endpoint,
                model: o.model.to_owned(),
                outcome: o.outcome,
            })
            .inc();
        if !o.endpoint.is_turn() {
            return;
        }
        let labels = RouteLabels {
            endpoint: o.endpoint,
            model: o.model.to_owned(),
        };
        if let Some(ns) = o.ttft_ns {
            self.ttft.get_or_create(&labels).observe_ns(ns);
        }
        self.duration
            .get_or_create(&labels)
            .observe_ns(o.duration_ns);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_errors_are_the_clients_statuses_only() {
        assert_eq!(
            ClientError::of_status(400),
            Some(ClientError::InvalidRequest)
        );
        assert_eq!(
            ClientError::of_status(413),
            Some(ClientError::InvalidRequest)
        );
        assert_eq!(
            ClientError::of_status(505),
            Some(ClientError::InvalidRequest)
        );
        assert_eq!(ClientError::of_status(404), Some(ClientError::NotFound));
        assert_eq!(
            ClientError::of_status(405),
            Some(ClientError::MethodNotAllowed)
        );
        assert_eq!(
            ClientError::of_status(408),
            Some(ClientError::RequestTimeout)
        );
        for s in [200, 429, 500, 502, 503, 504] {
            assert_eq!(ClientError::of_status(s), None, "{s}");
        }
    }
}
