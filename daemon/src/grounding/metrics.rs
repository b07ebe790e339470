//! Grounding (`grounding/`, docs/grounding.md): every arm attempt of every round, by arm and
//! outcome, and how long each arm took. Counted per attempt (a few per round, at most
//! `max_rounds` rounds per reply), never per token.

use std::time::Duration;

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder},
    metrics::{counter::Counter, family::Family},
    registry::{Registry, Unit},
};

use crate::grounding::{ArmKind, ArmOutcome};
use crate::histogram::NsHistogram;

impl ArmKind {
    /// Every arm, for the series that exist from the start.
    pub const ALL: [ArmKind; 3] = [ArmKind::Memory, ArmKind::Tool, ArmKind::Web];

    /// The label value (the config file's spelling).
    pub fn as_str(self) -> &'static str {
        match self {
            ArmKind::Memory => "memory",
            ArmKind::Tool => "tool",
            ArmKind::Web => "web",
        }
    }
}

impl ArmOutcome {
    /// Every outcome.
    pub const ALL: [ArmOutcome; 5] = [
        ArmOutcome::Grounded,
        ArmOutcome::Empty,
        ArmOutcome::Timeout,
        ArmOutcome::Failed,
        ArmOutcome::Skipped,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ArmOutcome::Grounded => "grounded",
            ArmOutcome::Empty => "empty",
            ArmOutcome::Timeout => "timeout",
            ArmOutcome::Failed => "failed",
            ArmOutcome::Skipped => "skipped",
        }
    }
}

impl EncodeLabelValue for ArmKind {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

impl EncodeLabelValue for ArmOutcome {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AttemptLabels {
    pub arm: ArmKind,
    pub outcome: ArmOutcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ArmLabels {
    pub arm: ArmKind,
}

/// `haltd_grounding_arm_seconds`: 1 ms to 32 s, doubling.
pub const ARM_BUCKETS_NS: [u64; 16] = {
    let mut b = [0; 16];
    let mut i = 0;
    while i < 16 {
        b[i] = 1_000_000 << i;
        i += 1;
    }
    b
};

type ArmFamily = Family<ArmLabels, NsHistogram, fn() -> NsHistogram>;

/// `haltd_grounding_rounds_total{arm,outcome}` and `haltd_grounding_arm_seconds{arm}`.
#[derive(Clone, Debug)]
pub struct GroundingMetrics {
    attempts: Family<AttemptLabels, Counter>,
    seconds: ArmFamily,
}

impl GroundingMetrics {
    pub fn register(reg: &mut Registry) -> Self {
        let attempts = Family::<AttemptLabels, Counter>::default();
        reg.register(
            "grounding_rounds",
            "Grounding arm attempts, by arm and outcome (grounded, empty, timeout, failed, skipped): one per arm a round tried",
            attempts.clone(),
        );
        let seconds: ArmFamily = Family::new_with_constructor(|| NsHistogram::new(&ARM_BUCKETS_NS));
        reg.register_with_unit(
            "grounding_arm",
            "How long each grounding arm took, per attempt (a timeout counts its deadline), by arm",
            Unit::Seconds,
            seconds.clone(),
        );
        // Every series from the start: an alert on timeouts sees a zero, not a gap.
        for arm in ArmKind::ALL {
            drop(seconds.get_or_create(&ArmLabels { arm }));
            for outcome in ArmOutcome::ALL {
                drop(attempts.get_or_create(&AttemptLabels { arm, outcome }));
            }
        }
        GroundingMetrics { attempts, seconds }
    }

    /// One attempt (per round, never per token).
    pub fn attempt(&self, arm: ArmKind, outcome: ArmOutcome, took: Duration) {
        self.attempts
            .get_or_create(&AttemptLabels { arm, outcome })
            .inc();
        self.seconds
            .get_or_create(&ArmLabels { arm })
            .observe_ns(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX));
    }

    /// Attempts counted so far with these labels (tests).
    pub fn count(&self, arm: ArmKind, outcome: ArmOutcome) -> u64 {
        self.attempts
            .get_or_create(&AttemptLabels { arm, outcome })
            .get()
    }
}
