//! Degraded safe mode: changes of `runtime_mode` and the scopes in it.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::modes::{ChangedBy, RuntimeMode};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeChangeLabels {
    pub to: RuntimeMode,
    pub by: ChangedBy,
}

/// `haltd_runtime_mode_changes_total`, `haltd_degraded_scopes`.
#[derive(Debug)]
pub struct ModeMetrics {
    pub changes: Family<ModeChangeLabels, Counter>,
    pub degraded_scopes: Gauge,
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
        ModeMetrics {
            changes,
            degraded_scopes,
        }
    }

    /// A change of `runtime_mode` to `to`, by `by`.
    pub fn changed(&self, to: RuntimeMode, by: ChangedBy) {
        self.changes
            .get_or_create(&ModeChangeLabels { to, by })
            .inc();
    }
}
