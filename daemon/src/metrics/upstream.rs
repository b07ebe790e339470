//! Proxied turns: upstream failures and cancellations, and the tool calls upstream streams
//! carried.

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder},
    metrics::{counter::Counter, family::Family},
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

/// `haltd_upstream_*`, `haltd_tool_calls_total`.
#[derive(Debug)]
pub struct UpstreamMetrics {
    pub failures: Family<UpstreamFailureLabels, Counter>,
    pub cancels: Family<CancelLabels, Counter>,
    pub tool_calls: Family<ToolCallLabels, Counter>,
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
