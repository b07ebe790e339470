//! Proxied turns: upstream failures and cancellations, the upstream connection pool, and the
//! tool calls upstream streams carried.

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::upstream::{CancelReason, UpstreamFailureKind};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamFailureLabels {
    pub kind: UpstreamFailureKind,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CancelLabels {
    pub reason: CancelReason,
}

/// What became of a tool call an upstream stream carried: the `kind` label of
/// `haltd_tool_calls_total`, and (committed, dispatched) the `status` of the call in the turn
/// record.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum ToolCallKind {
    /// Its turn ended cleanly: committed.
    Committed,
    /// Its turn failed after the client got the call: it needs reconciliation.
    Dispatched,
    /// Degraded mode kept it from the client.
    Suppressed,
}

impl ToolCallKind {
    pub const ALL: [ToolCallKind; 3] = [
        ToolCallKind::Committed,
        ToolCallKind::Dispatched,
        ToolCallKind::Suppressed,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            ToolCallKind::Committed => "committed",
            ToolCallKind::Dispatched => "dispatched",
            ToolCallKind::Suppressed => "suppressed",
        }
    }
}

impl EncodeLabelValue for ToolCallKind {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolCallLabels {
    pub kind: ToolCallKind,
}

/// Why an upstream connection was closed instead of serving another request: the `reason`
/// label of `haltd_upstream_pool_discarded_total`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum DiscardReason {
    /// Its exchange did not end cleanly and reusable: a trip, a failure, a cancellation, a
    /// body not read to its end, or an upstream that said `connection: close`.
    NotReusable,
    /// The worker's pool already held `--upstream-pool-idle` connections.
    PoolFull,
    /// Idle past `--upstream-pool-idle-timeout-ms`.
    IdleTimeout,
    /// The upstream closed it (or sent something) while it was idle, seen before reuse.
    UpstreamClosed,
    /// Reused, it failed before any response byte: the request was retried on a new one.
    Broken,
}

impl DiscardReason {
    pub const ALL: [DiscardReason; 5] = [
        DiscardReason::NotReusable,
        DiscardReason::PoolFull,
        DiscardReason::IdleTimeout,
        DiscardReason::UpstreamClosed,
        DiscardReason::Broken,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            DiscardReason::NotReusable => "not_reusable",
            DiscardReason::PoolFull => "pool_full",
            DiscardReason::IdleTimeout => "idle_timeout",
            DiscardReason::UpstreamClosed => "upstream_closed",
            DiscardReason::Broken => "broken",
        }
    }
}

impl EncodeLabelValue for DiscardReason {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DiscardLabels {
    pub reason: DiscardReason,
}

/// `haltd_upstream_pool_*`: how upstream connections were obtained and why they were closed.
#[derive(Debug)]
pub struct PoolMetrics {
    pub opened: Counter,
    pub reused: Counter,
    pub retried: Counter,
    pub discarded: Family<DiscardLabels, Counter>,
}

impl PoolMetrics {
    fn register(reg: &mut Registry) -> Self {
        let pool = reg.sub_registry_with_prefix("pool");
        let m = PoolMetrics {
            opened: Counter::default(),
            reused: Counter::default(),
            retried: Counter::default(),
            discarded: Family::default(),
        };
        pool.register(
            "opened",
            "Upstream connections opened (no idle pooled connection was at hand)",
            m.opened.clone(),
        );
        pool.register(
            "reused",
            "Upstream requests sent on a pooled keep-alive connection",
            m.reused.clone(),
        );
        pool.register(
            "retried",
            "Requests retried once on a new connection after their pooled one failed before any response byte",
            m.retried.clone(),
        );
        pool.register(
            "discarded",
            "Upstream connections closed instead of pooled or reused, by reason",
            m.discarded.clone(),
        );
        for reason in DiscardReason::ALL {
            drop(m.discarded.get_or_create(&DiscardLabels { reason }));
        }
        m
    }

    pub fn discarded(&self, reason: DiscardReason) {
        self.discarded
            .get_or_create(&DiscardLabels { reason })
            .inc();
    }
}

/// `haltd_upstream_*`, `haltd_tool_calls_total`.
#[derive(Debug)]
pub struct UpstreamMetrics {
    pub failures: Family<UpstreamFailureLabels, Counter>,
    pub cancels: Family<CancelLabels, Counter>,
    pub tool_calls: Family<ToolCallLabels, Counter>,
    pub pool: PoolMetrics,
    /// TLS handshakes with an `https://` upstream completed: one per new connection, none
    /// for a pooled one.
    pub tls_handshakes: Counter,
    /// 1 while the upstream answers its probe (`upstream_watch.rs`), else 0.
    pub up: Gauge,
    pub probe_failures: Counter,
    pub resolve_failures: Counter,
}

impl UpstreamMetrics {
    /// Registers on `reg` (prefix `haltd`); the upstream's own families on its `upstream_`
    /// sub-registry.
    pub fn register(reg: &mut Registry) -> Self {
        let upstream = reg.sub_registry_with_prefix("upstream");
        let failures = Family::<UpstreamFailureLabels, Counter>::default();
        upstream.register(
            "failures",
            "Proxied turns that failed because of the upstream, by kind",
            failures.clone(),
        );
        let cancels = Family::<CancelLabels, Counter>::default();
        upstream.register(
            "cancels",
            "Upstream generations cancelled (connection closed) before they ended, by reason",
            cancels.clone(),
        );
        let tls_handshakes = Counter::default();
        upstream.register(
            "tls_handshakes",
            "TLS handshakes completed with an https:// upstream (one per new connection; a pooled connection keeps its session)",
            tls_handshakes.clone(),
        );
        let up = Gauge::default();
        upstream.register(
            "up",
            "1 while the upstream answers its probe (--upstream-probe-*; without the probe: while its name resolves), else 0",
            up.clone(),
        );
        let probe_failures = Counter::default();
        upstream.register(
            "probe_failures",
            "Upstream probes (GET --upstream-probe-path) that failed: refused, timed out, unresolved or not 2xx",
            probe_failures.clone(),
        );
        let resolve_failures = Counter::default();
        upstream.register(
            "resolve_failures",
            "Resolutions of the upstream's host name that failed (the last addresses, if any, stay in use)",
            resolve_failures.clone(),
        );
        let pool = PoolMetrics::register(upstream);
        let tool_calls = Family::<ToolCallLabels, Counter>::default();
        reg.register(
            "tool_calls",
            "Tool calls seen in upstream streams: committed, dispatched (needs reconciliation) or suppressed (degraded mode)",
            tool_calls.clone(),
        );
        for kind in UpstreamFailureKind::ALL {
            drop(failures.get_or_create(&UpstreamFailureLabels { kind }));
        }
        for reason in CancelReason::ALL {
            drop(cancels.get_or_create(&CancelLabels { reason }));
        }
        for kind in ToolCallKind::ALL {
            drop(tool_calls.get_or_create(&ToolCallLabels { kind }));
        }
        UpstreamMetrics {
            failures,
            cancels,
            tool_calls,
            pool,
            tls_handshakes,
            up,
            probe_failures,
            resolve_failures,
        }
    }

    pub fn failed(&self, kind: UpstreamFailureKind) {
        self.failures
            .get_or_create(&UpstreamFailureLabels { kind })
            .inc();
    }

    pub fn cancelled(&self, reason: CancelReason) {
        self.cancels.get_or_create(&CancelLabels { reason }).inc();
    }

    pub fn tool_calls(&self, kind: ToolCallKind, n: u64) {
        self.tool_calls
            .get_or_create(&ToolCallLabels { kind })
            .inc_by(n);
    }
}
