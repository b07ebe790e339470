//! The data plane: open and finished streams, refused requests, token frames and their
//! overhead, io_uring trouble.

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::{Registry, Unit},
};

use crate::{histogram::NsHistogram, stream::Outcome};

/// `haltd_token_overhead_seconds` bucket bounds in ns: 5 µs doubling to 164 ms.
pub const TOKEN_OVERHEAD_BUCKETS_NS: [u64; 16] = {
    let mut b = [0; 16];
    let mut i = 0;
    while i < b.len() {
        b[i] = 5_000 << i;
        i += 1;
    }
    b
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: Outcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabels {
    pub status: u16,
}

/// Kinds of `haltd_ring_events_total`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum RingEvent {
    /// A loop pass found the completion ring full (completions wait in the kernel's backlog).
    CqOverflow,
    /// Completions the kernel lost.
    CqDropped,
    /// Submissions the kernel rejected as invalid.
    SqDropped,
    /// A push found the submission ring full and submitted early.
    SqFull,
    /// `io_uring_enter` failed.
    SubmitError,
}

impl RingEvent {
    /// Every kind, each a series from the start.
    pub const ALL: [RingEvent; 5] = [
        RingEvent::CqOverflow,
        RingEvent::CqDropped,
        RingEvent::SqDropped,
        RingEvent::SqFull,
        RingEvent::SubmitError,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            RingEvent::CqOverflow => "cq_overflow",
            RingEvent::CqDropped => "cq_dropped",
            RingEvent::SqDropped => "sq_dropped",
            RingEvent::SqFull => "sq_full",
            RingEvent::SubmitError => "submit_error",
        }
    }
}

impl EncodeLabelValue for RingEvent {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RingEventLabels {
    pub kind: RingEvent,
}

/// Why haltd closed a kept client connection itself (`haltd_keepalive_closes_total`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum KeepAliveClose {
    /// No next request within `--client-idle-timeout-ms`.
    IdleTimeout,
    /// The turn was the connection's `--max-turns-per-conn`-th: its reply said close.
    MaxTurns,
    /// haltd began its drain (SIGTERM/SIGINT): an idle kept connection closes at once, and one
    /// whose turn completes during the drain is not kept.
    Drain,
}

impl KeepAliveClose {
    pub const ALL: [KeepAliveClose; 3] = [
        KeepAliveClose::IdleTimeout,
        KeepAliveClose::MaxTurns,
        KeepAliveClose::Drain,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            KeepAliveClose::IdleTimeout => "idle_timeout",
            KeepAliveClose::MaxTurns => "max_turns",
            KeepAliveClose::Drain => "drain",
        }
    }
}

/// Where a client stopped reading (`haltd_client_stalls_total`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum StallPhase {
    /// While its stream was open (a send waited on the client): the stream halted with
    /// `CLIENT_STALLED`.
    Stream,
    /// After its stream ended, while the connection waited for the client to take the bytes
    /// still queued (the drain): nothing was left to halt.
    Drain,
}

impl StallPhase {
    pub const ALL: [StallPhase; 2] = [StallPhase::Stream, StallPhase::Drain];

    pub const fn as_str(self) -> &'static str {
        match self {
            StallPhase::Stream => "stream",
            StallPhase::Drain => "drain",
        }
    }
}

impl EncodeLabelValue for StallPhase {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StallPhaseLabels {
    pub phase: StallPhase,
}

impl EncodeLabelValue for KeepAliveClose {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

/// The `limit` label of `haltd_limit_refusals_total`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct LimitLabel(pub crate::limits::Limit);

impl EncodeLabelValue for LimitLabel {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.0.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitLabels {
    pub limit: LimitLabel,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KeepAliveCloseLabels {
    pub reason: KeepAliveClose,
}

/// `haltd_streams_*`, `haltd_requests_rejected_total`, `haltd_tokens_emitted_total`,
/// `haltd_token_overhead_seconds`, `haltd_ring_events_total`, `haltd_keepalive_*`. The per-token path touches
/// only `tokens_emitted` and `token_overhead` (relaxed atomic adds, no lock, no lookup).
#[derive(Debug)]
pub struct DataPlaneMetrics {
    /// Client connections accepted on `--listen`, refused ones included.
    pub connections_accepted: Counter,
    pub streams_active: Gauge,
    pub streams_total: Family<OutcomeLabels, Counter>,
    pub requests_rejected: Family<StatusLabels, Counter>,
    pub tokens_emitted: Counter,
    pub token_overhead: NsHistogram,
    pub ring_events: Family<RingEventLabels, Counter>,
    /// Requests that arrived on a kept connection (its second request and later).
    pub keepalive_turns: Counter,
    /// `--tls-cert`: client TLS handshakes completed, and those that failed.
    pub client_tls_handshakes: Counter,
    pub client_tls_handshake_failures: Counter,
    pub keepalive_closes: Family<KeepAliveCloseLabels, Counter>,
    /// Connections whose stream ended and which wait for their client to take the bytes still
    /// queued in the socket (`dataplane/conn/drain.rs`).
    pub connections_draining: Gauge,
    /// Clients cut because they stopped reading (`--send-stall-timeout-ms`).
    pub client_stalls: Family<StallPhaseLabels, Counter>,
    /// Requests refused by a per-scope limit (`limits.rs`).
    pub limit_refusals: Family<LimitLabels, Counter>,
}

/// `haltd_connections_accepted_total` and `haltd_streams_active`.
fn register_connections(reg: &mut Registry) -> (Counter, Gauge) {
    let connections_accepted = Counter::default();
    reg.register(
        "connections_accepted",
        "Client connections this process accepted on --listen (refused ones included); during a hand-over each process counts its own",
        connections_accepted.clone(),
    );
    let streams_active = Gauge::default();
    reg.register(
        "streams_active",
        "Open client connections (governed streams)",
        streams_active.clone(),
    );
    (connections_accepted, streams_active)
}

impl DataPlaneMetrics {
    /// Client connections accepted so far.
    pub fn accepted_total(&self) -> u64 {
        self.connections_accepted.get()
    }

    /// Registers on `reg` (prefix `haltd`).
    pub fn register(reg: &mut Registry) -> Self {
        let (connections_accepted, streams_active) = register_connections(reg);
        let streams_total = Family::<OutcomeLabels, Counter>::default();
        reg.register(
            "streams",
            "Finished streams by outcome",
            streams_total.clone(),
        );
        let requests_rejected = Family::<StatusLabels, Counter>::default();
        reg.register(
            "requests_rejected",
            "Requests answered with an error status",
            requests_rejected.clone(),
        );
        let tokens_emitted = Counter::default();
        reg.register(
            "tokens_emitted",
            "Token frames the kernel accepted for clients",
            tokens_emitted.clone(),
        );
        let token_overhead = NsHistogram::new(&TOKEN_OVERHEAD_BUCKETS_NS);
        reg.register_with_unit(
            "token_overhead",
            "Streaming overhead per token frame: from the token's arrival at haltd (the upstream receive that carried it, or the built-in source producing it) to the completion of the send that carried its frame to the client",
            Unit::Seconds,
            token_overhead.clone(),
        );
        let ring_events = Family::<RingEventLabels, Counter>::default();
        reg.register(
            "ring_events",
            "Data-plane io_uring trouble, by kind: cq_overflow (loop passes that found the completion ring full, completions waiting in the kernel's backlog), cq_dropped (completions the kernel lost), sq_dropped (submissions the kernel rejected as invalid), sq_full (pushes that found the submission ring full and submitted early), submit_error (io_uring_enter failed; EBUSY and EAGAIN are retried, anything else stops the daemon)",
            ring_events.clone(),
        );
        for kind in RingEvent::ALL {
            drop(ring_events.get_or_create(&RingEventLabels { kind }));
        }
        let (keepalive_turns, keepalive_closes, connections_draining, client_stalls) =
            register_connection_ends(reg);
        let client_tls_handshakes = Counter::default();
        reg.register(
            "client_tls_handshakes",
            "Client TLS handshakes completed (--tls-cert)",
            client_tls_handshakes.clone(),
        );
        let client_tls_handshake_failures = Counter::default();
        reg.register(
            "client_tls_handshake_failures",
            "Client TLS handshakes that failed (a bad ClientHello, no common version or suite, no http/1.1 in ALPN, an alert from the client, garbage); each ends only its own connection",
            client_tls_handshake_failures.clone(),
        );
        let limit_refusals = Family::<LimitLabels, Counter>::default();
        reg.register(
            "limit_refusals",
            "Governed requests answered 429 because their scope was over a limit of this node: concurrency (--limit-concurrency), requests_per_minute, tokens_per_minute",
            limit_refusals.clone(),
        );
        for limit in crate::limits::Limit::ALL {
            drop(limit_refusals.get_or_create(&LimitLabels {
                limit: LimitLabel(limit),
            }));
        }
        DataPlaneMetrics {
            connections_accepted,
            limit_refusals,
            client_tls_handshakes,
            client_tls_handshake_failures,
            keepalive_turns,
            keepalive_closes,
            connections_draining,
            client_stalls,
            streams_active,
            streams_total,
            requests_rejected,
            tokens_emitted,
            token_overhead,
            ring_events,
        }
    }

    /// A request answered with an error `status`.
    pub fn rejected(&self, status: u16) {
        self.requests_rejected
            .get_or_create(&StatusLabels { status })
            .inc();
    }

    /// A stream that finished with `outcome`.
    pub fn finished(&self, outcome: Outcome) {
        self.streams_total
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    /// A client stopped reading and was cut.
    pub fn client_stalled(&self, phase: StallPhase) {
        self.client_stalls
            .get_or_create(&StallPhaseLabels { phase })
            .inc();
    }

    /// A kept connection closed by haltd for `reason`.
    pub fn keepalive_closed(&self, reason: KeepAliveClose) {
        self.keepalive_closes
            .get_or_create(&KeepAliveCloseLabels { reason })
            .inc();
    }

    /// `n` ring events of `kind` (rare, never per token).
    pub fn ring_event(&self, kind: RingEvent, n: u64) {
        self.ring_events
            .get_or_create(&RingEventLabels { kind })
            .inc_by(n);
    }
}

/// The series of how client connections end: `haltd_keepalive_*`,
/// `haltd_connections_draining`, `haltd_client_stalls_total`.
fn register_connection_ends(
    reg: &mut Registry,
) -> (
    Counter,
    Family<KeepAliveCloseLabels, Counter>,
    Gauge,
    Family<StallPhaseLabels, Counter>,
) {
    let keepalive_turns = Counter::default();
    reg.register(
        "keepalive_turns",
        "Requests read on a kept client connection (its second request and later)",
        keepalive_turns.clone(),
    );
    let keepalive_closes = Family::<KeepAliveCloseLabels, Counter>::default();
    reg.register(
        "keepalive_closes",
        "Kept client connections haltd closed itself, by reason: idle_timeout (no next request within --client-idle-timeout-ms), max_turns (the --max-turns-per-conn-th turn said connection: close), drain (haltd began its SIGTERM/SIGINT drain)",
        keepalive_closes.clone(),
    );
    for reason in KeepAliveClose::ALL {
        drop(keepalive_closes.get_or_create(&KeepAliveCloseLabels { reason }));
    }
    let connections_draining = Gauge::default();
    reg.register(
        "connections_draining",
        "Client connections whose stream ended and which wait, holding their stream slot, for the client to take the bytes still queued in the socket",
        connections_draining.clone(),
    );
    let client_stalls = Family::<StallPhaseLabels, Counter>::default();
    reg.register(
        "client_stalls",
        "Client connections reset because bytes waited in the socket and the client acknowledged none of them for --send-stall-timeout-ms, by phase: stream (the stream halted with CLIENT_STALLED), drain (the stream had ended; its last bytes were not taken)",
        client_stalls.clone(),
    );
    for phase in StallPhase::ALL {
        drop(client_stalls.get_or_create(&StallPhaseLabels { phase }));
    }
    (
        keepalive_turns,
        keepalive_closes,
        connections_draining,
        client_stalls,
    )
}
