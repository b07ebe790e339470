//! Degraded safe mode: changes of `runtime_mode`, the scopes in it, and the escalations of
//! scopes entering it (`escalation.rs`).

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::modes::{ChangedBy, RuntimeMode};

/// How an escalation ended (the `outcome` label of `haltd_escalations_total`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum EscalationOutcome {
    /// The endpoint answered 2xx.
    Delivered,
    /// Every attempt failed, or the deadline passed.
    Failed,
    /// Not attempted: the queue of escalations waiting was full.
    Dropped,
}

impl EscalationOutcome {
    pub const ALL: [EscalationOutcome; 3] = [
        EscalationOutcome::Delivered,
        EscalationOutcome::Failed,
        EscalationOutcome::Dropped,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            EscalationOutcome::Delivered => "delivered",
            EscalationOutcome::Failed => "failed",
            EscalationOutcome::Dropped => "dropped",
        }
    }
}

impl EncodeLabelValue for EscalationOutcome {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EscalationLabels {
    pub outcome: EscalationOutcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeChangeLabels {
    pub to: RuntimeMode,
    pub by: ChangedBy,
}

/// `haltd_runtime_mode_changes_total`, `haltd_degraded_scopes`, `haltd_escalations_total`.
#[derive(Debug)]
pub struct ModeMetrics {
    pub changes: Family<ModeChangeLabels, Counter>,
    pub degraded_scopes: Gauge,
    pub escalations: Family<EscalationLabels, Counter>,
}

impl ModeMetrics {
    /// Registers on `reg` (prefix `haltd`).
    pub fn register(reg: &mut Registry) -> Self {
        let changes = Family::<ModeChangeLabels, Counter>::default();
        reg.register(
            "runtime_mode_changes",
            "Changes of runtime_mode (degraded safe mode), by new mode and by whom",
            changes.clone(),
        );
        let degraded_scopes = Gauge::default();
        reg.register(
            "degraded_scopes",
            "Scopes (API keys, or the node) currently in degraded safe mode",
            degraded_scopes.clone(),
        );
        for (to, by) in [
            (RuntimeMode::Degraded, ChangedBy::Halt),
            (RuntimeMode::Full, ChangedBy::Operator),
            (RuntimeMode::Full, ChangedBy::Timer),
            (RuntimeMode::Degraded, ChangedBy::Start),
        ] {
            drop(changes.get_or_create(&ModeChangeLabels { to, by }));
        }
        let escalations = Family::<EscalationLabels, Counter>::default();
        reg.register(
            "escalations",
            "Escalations of a scope entering degraded mode to --escalation-url, by outcome: delivered (a 2xx answer), failed (every attempt failed or the deadline passed), dropped (the queue was full)",
            escalations.clone(),
        );
        for outcome in EscalationOutcome::ALL {
            drop(escalations.get_or_create(&EscalationLabels { outcome }));
        }
        ModeMetrics {
            changes,
            degraded_scopes,
            escalations,
        }
    }

    /// A change of `runtime_mode` to `to`, by `by`.
    pub fn changed(&self, to: RuntimeMode, by: ChangedBy) {
        self.changes
            .get_or_create(&ModeChangeLabels { to, by })
            .inc();
    }
}

impl ModeMetrics {
    /// One escalation ended so.
    pub fn escalated(&self, outcome: EscalationOutcome) {
        self.escalations
            .get_or_create(&EscalationLabels { outcome })
            .inc();
    }
}
