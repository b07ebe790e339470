//! Why a proxied turn's upstream exchange ended early, typed (after pingora's `etype`,
//! `esource` and `retry`): the [`UpstreamFailureKind`], whose fault it was
//! ([`FailureSource`]) and whether sending the request again could help. The client's answer
//! derives from it: before the response began, an HTTP error whose status
//! ([`UpstreamFailure::http_status`]) says whose fault it was; after, a halt whose terminal
//! event names the kind (`"upstream":{"kind":...}`). Records, logs and the `kind` label of
//! `haltd_upstream_failures_total` spell the kind with [`UpstreamFailureKind::as_str`].

use std::fmt;

use prometheus_client::encoding::{EncodeLabelValue, LabelValueEncoder};

/// What went wrong with the upstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UpstreamFailureKind {
    /// Nobody listens at the upstream address.
    ConnectRefused,
    /// Connecting, or handing over the request, took longer than
    /// `--upstream-connect-timeout-ms`.
    ConnectTimeout,
    /// No SSE event within `--upstream-first-token-timeout-ms` of the request.
    FirstTokenTimeout,
    /// No SSE event within `--upstream-stall-timeout-ms` of the last one.
    Stalled,
    /// The response could not be read: bad framing, a bad event, a stream that is not
    /// `text/event-stream`, a compressed one, a body over the limit, a bad tool call.
    Malformed,
    /// The upstream sent an error event, or ended the generation with `finish_reason`
    /// `error` or `abort`.
    ErrorEvent,
    /// The connection closed before the response, or the stream ended without a
    /// `finish_reason` or `[DONE]`.
    EarlyEof,
    /// The upstream answered with a status other than 200.
    HttpStatus,
    /// A socket error on the upstream connection.
    IoError,
    /// Tokens without logprobs while the HaltMonitor needs them (`--hard-limit` above 0).
    MissingLogprobs,
    /// TLS with an `https://` upstream failed: its certificate did not verify (unknown CA,
    /// another name, expired), it sent an alert, or its records were bad.
    Tls,
}

/// Whose fault a failure was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureSource {
    /// The upstream judged the client's request and refused it (its 4xx).
    Client,
    /// The upstream (or the path to it) failed.
    Upstream,
    /// haltd's own side: its configuration needs what the upstream does not send (logprobs
    /// for the HaltMonitor).
    Internal,
}

impl FailureSource {
    /// Its spelling in logs.
    pub const fn as_str(self) -> &'static str {
        match self {
            FailureSource::Client => "client",
            FailureSource::Upstream => "upstream",
            FailureSource::Internal => "internal",
        }
    }
}

impl UpstreamFailureKind {
    /// Every kind, in the order the metric's series are listed.
    pub const ALL: [UpstreamFailureKind; 11] = [
        UpstreamFailureKind::ConnectRefused,
        UpstreamFailureKind::ConnectTimeout,
        UpstreamFailureKind::FirstTokenTimeout,
        UpstreamFailureKind::Stalled,
        UpstreamFailureKind::Malformed,
        UpstreamFailureKind::ErrorEvent,
        UpstreamFailureKind::EarlyEof,
        UpstreamFailureKind::HttpStatus,
        UpstreamFailureKind::IoError,
        UpstreamFailureKind::MissingLogprobs,
        UpstreamFailureKind::Tls,
    ];

    /// The kind as records, the terminal event and the metric label spell it.
    pub const fn as_str(self) -> &'static str {
        match self {
            UpstreamFailureKind::ConnectRefused => "connect_refused",
            UpstreamFailureKind::ConnectTimeout => "connect_timeout",
            UpstreamFailureKind::FirstTokenTimeout => "first_token_timeout",
            UpstreamFailureKind::Stalled => "stalled",
            UpstreamFailureKind::Malformed => "malformed",
            UpstreamFailureKind::ErrorEvent => "error_event",
            UpstreamFailureKind::EarlyEof => "early_eof",
            UpstreamFailureKind::HttpStatus => "http_status",
            UpstreamFailureKind::IoError => "io_error",
            UpstreamFailureKind::MissingLogprobs => "missing_logprobs",
            UpstreamFailureKind::Tls => "tls",
        }
    }

    /// The upstream did not answer in time.
    pub const fn is_timeout(self) -> bool {
        matches!(
            self,
            UpstreamFailureKind::ConnectTimeout | UpstreamFailureKind::FirstTokenTimeout
        )
    }
}

impl fmt::Display for UpstreamFailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl EncodeLabelValue for UpstreamFailureKind {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        fmt::Write::write_str(encoder, self.as_str())
    }
}

/// One upstream failure: its kind, what haltd saw (client-facing, bounded), and the status
/// the upstream answered with, if it answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpstreamFailure {
    pub kind: UpstreamFailureKind,
    pub message: String,
    pub upstream_status: Option<u16>,
}

impl UpstreamFailure {
    pub fn new(kind: UpstreamFailureKind, message: String, upstream_status: Option<u16>) -> Self {
        UpstreamFailure {
            kind,
            message,
            upstream_status,
        }
    }

    /// Whose fault it was: an error status or error event in 4xx is the upstream judging the
    /// client's request; missing logprobs are haltd's configuration asking for what this
    /// upstream does not send; everything else is the upstream's.
    pub fn source(&self) -> FailureSource {
        match (self.kind, self.upstream_status) {
            (
                UpstreamFailureKind::HttpStatus | UpstreamFailureKind::ErrorEvent,
                Some(400..=499),
            ) => FailureSource::Client,
            (UpstreamFailureKind::MissingLogprobs, _) => FailureSource::Internal,
            _ => FailureSource::Upstream,
        }
    }

    /// Whether the same request, sent again later, could succeed: yes for what passes (a
    /// refused or slow connection, a stall, a broken stream, the upstream's 5xx, 408 and
    /// 429), no for the client's own request errors, a protocol the upstream does not speak,
    /// a certificate that does not verify and a backend that sends no logprobs.
    pub fn retry(&self) -> bool {
        match self.kind {
            UpstreamFailureKind::ConnectRefused
            | UpstreamFailureKind::ConnectTimeout
            | UpstreamFailureKind::FirstTokenTimeout
            | UpstreamFailureKind::Stalled
            | UpstreamFailureKind::EarlyEof
            | UpstreamFailureKind::IoError => true,
            UpstreamFailureKind::Malformed
            | UpstreamFailureKind::MissingLogprobs
            | UpstreamFailureKind::Tls => false,
            UpstreamFailureKind::HttpStatus | UpstreamFailureKind::ErrorEvent => {
                match self.upstream_status {
                    Some(408 | 429) => true,
                    Some(s) => s >= 500,
                    None => true,
                }
            }
        }
    }

    /// The HTTP status a failure before the client's response began is answered with: the
    /// client's fault keeps the upstream's 4xx; "unavailable, retry later" stays 503 (with
    /// the upstream's `retry-after`); an upstream that did not answer in time is 504; any
    /// other failure of the upstream is 502.
    pub fn http_status(&self) -> u16 {
        match (self.source(), self.upstream_status) {
            (FailureSource::Client, Some(s)) => s,
            _ if self.kind == UpstreamFailureKind::HttpStatus
                && self.upstream_status == Some(503) =>
            {
                503
            }
            _ if self.kind.is_timeout() => 504,
            _ => 502,
        }
    }

    /// The OpenAI error `type` of that answer: the client's fault is its request error.
    pub fn error_type(&self) -> &'static str {
        match self.source() {
            FailureSource::Client => "invalid_request_error",
            FailureSource::Upstream | FailureSource::Internal => "upstream_error",
        }
    }
}

/// Why an upstream generation was cancelled (its connection shut down) before it ended: the
/// `reason` label of `haltd_upstream_cancels_total` and the record's `cancel_reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CancelReason {
    /// The stream was tripped.
    Trip,
    /// The client went away.
    ClientGone,
}

impl CancelReason {
    pub const ALL: [CancelReason; 2] = [CancelReason::Trip, CancelReason::ClientGone];

    pub const fn as_str(self) -> &'static str {
        match self {
            CancelReason::Trip => "trip",
            CancelReason::ClientGone => "client_gone",
        }
    }
}

impl fmt::Display for CancelReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl EncodeLabelValue for CancelReason {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        fmt::Write::write_str(encoder, self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::{UpstreamFailureKind as K, *};

    fn status(kind: K, upstream: Option<u16>) -> u16 {
        UpstreamFailure::new(kind, String::new(), upstream).http_status()
    }

    #[test]
    fn failure_statuses_keep_client_errors_client_errors() {
        assert_eq!(status(K::HttpStatus, Some(400)), 400);
        assert_eq!(status(K::HttpStatus, Some(404)), 404);
        assert_eq!(status(K::HttpStatus, Some(429)), 429);
        assert_eq!(status(K::HttpStatus, Some(500)), 502);
        assert_eq!(status(K::HttpStatus, Some(503)), 503);
        assert_eq!(status(K::ErrorEvent, Some(400)), 400);
        assert_eq!(status(K::ErrorEvent, Some(503)), 502);
        assert_eq!(status(K::ErrorEvent, None), 502);
        assert_eq!(status(K::ConnectRefused, None), 502);
        assert_eq!(status(K::ConnectTimeout, None), 504);
        assert_eq!(status(K::FirstTokenTimeout, None), 504);
        assert_eq!(status(K::Malformed, Some(200)), 502);
        assert_eq!(status(K::Malformed, Some(404)), 502);
        assert_eq!(status(K::EarlyEof, None), 502);
        assert_eq!(status(K::MissingLogprobs, None), 502);
        assert_eq!(status(K::Tls, None), 502);
    }

    #[test]
    fn whose_fault_and_whether_to_retry() {
        let f = |kind, s| UpstreamFailure::new(kind, String::new(), s);
        assert_eq!(f(K::HttpStatus, Some(422)).source(), FailureSource::Client);
        assert_eq!(
            f(K::HttpStatus, Some(422)).error_type(),
            "invalid_request_error"
        );
        assert!(!f(K::HttpStatus, Some(422)).retry());
        assert!(f(K::HttpStatus, Some(429)).retry());
        assert!(f(K::HttpStatus, Some(503)).retry());
        assert_eq!(f(K::Stalled, None).source(), FailureSource::Upstream);
        assert_eq!(f(K::Stalled, None).error_type(), "upstream_error");
        assert!(f(K::Stalled, None).retry());
        assert!(!f(K::MissingLogprobs, None).retry());
        assert!(!f(K::Tls, None).retry());
        assert_eq!(f(K::Tls, None).source(), FailureSource::Upstream);
        assert_eq!(
            f(K::MissingLogprobs, None).source(),
            FailureSource::Internal
        );
    }

    #[test]
    fn kinds_are_spelled_as_before() {
        let names: Vec<&str> = K::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "connect_refused",
                "connect_timeout",
                "first_token_timeout",
                "stalled",
                "malformed",
                "error_event",
                "early_eof",
                "http_status",
                "io_error",
                "missing_logprobs",
                "tls",
            ]
        );
        assert_eq!(CancelReason::ClientGone.to_string(), "client_gone");
    }
}
