//! The policy in force: budgets per class and the transient backoff.
//!
//! Spec 002 asks whether budgets are per-deployment or fixed: they are configurable
//! (`[tool_circuit]`), default to the spec's table, and every artifact records the values
//! it was judged under. The two fail-closed classes (permission/auth, invariant_violation)
//! have budget 0 by definition and are not configurable.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::class::FailureClass;
use super::registry::ToolRegistry;

/// Conversations TokenCircuit keeps by default (`[tool_circuit] conversations`).
pub const DEFAULT_CONVERSATIONS: usize = 4096;

/// Retries allowed after a failure, per class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Budgets {
    pub transient: u32,
    pub validation: u32,
    pub missing_resource: u32,
    pub ambiguous_effect: u32,
}

impl Default for Budgets {
    fn default() -> Self {
        Budgets {
            transient: FailureClass::Transient.default_budget(),
            validation: FailureClass::Validation.default_budget(),
            missing_resource: FailureClass::MissingResource.default_budget(),
            ambiguous_effect: FailureClass::AmbiguousEffect.default_budget(),
        }
    }
}

impl Budgets {
    /// The budget in force for a class.
    pub const fn of(&self, class: FailureClass) -> u32 {
        match class {
            FailureClass::Transient => self.transient,
            FailureClass::Validation => self.validation,
            FailureClass::MissingResource => self.missing_resource,
            FailureClass::AmbiguousEffect => self.ambiguous_effect,
            FailureClass::PermissionAuth | FailureClass::InvariantViolation => 0,
        }
    }
}

/// Full-jitter exponential backoff for transient failures: after the n-th failure (n from
/// 0) a retry may come `uniform(0, min(cap, base·2ⁿ))` after the failed result arrived, or
/// after its `Retry-After`, whichever is later.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Backoff {
    pub base_ms: u64,
    pub cap_ms: u64,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base_ms: 500,
            cap_ms: 30_000,
        }
    }
}

impl Backoff {
    /// The backoff after the `attempt`-th failure. The jitter is drawn from a digest of the
    /// failed call's id, so rebuilding the state from a transcript gives the same delay.
    pub fn delay(&self, attempt: u32, call_id: &str) -> Duration {
        let ceiling = self
            .base_ms
            .saturating_mul(1u64.checked_shl(attempt.min(62)).unwrap_or(u64::MAX))
            .min(self.cap_ms);
        let digest = Sha256::digest(call_id.as_bytes());
        let mut seed = [0u8; 8];
        seed.copy_from_slice(&digest[..8]);
        let draw = u64::from_le_bytes(seed) % ceiling.saturating_add(1);
        Duration::from_millis(draw)
    }
}

/// Everything the state machine judges with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CircuitPolicy {
    pub budgets: Budgets,
    pub backoff: Backoff,
    pub registry: ToolRegistry,
    /// Conversations the in-memory store keeps (`store.rs`).
    pub conversations: usize,
    /// The age (s) past which an unreconciled dispatched call alerts (`dispatched.rs`).
    pub reconcile_alert_after_s: u64,
}

/// `[tool_circuit] reconcile_alert_after_s` by default: an hour.
pub const DEFAULT_RECONCILE_ALERT_AFTER_S: u64 = 3600;

impl Default for CircuitPolicy {
    fn default() -> Self {
        CircuitPolicy {
            budgets: Budgets::default(),
            backoff: Backoff::default(),
            registry: ToolRegistry::default(),
            conversations: DEFAULT_CONVERSATIONS,
            reconcile_alert_after_s: DEFAULT_RECONCILE_ALERT_AFTER_S,
        }
    }
}

/// The values in force, as recorded in every artifact.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyInForce {
    pub budgets: Budgets,
    pub backoff: Backoff,
}

impl CircuitPolicy {
    pub fn in_force(&self) -> PolicyInForce {
        PolicyInForce {
            budgets: self.budgets,
            backoff: self.backoff,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_spec_table() {
        let b = Budgets::default();
        for class in FailureClass::ALL {
            assert_eq!(b.of(class), class.default_budget(), "{class}");
        }
    }

    #[test]
    fn full_jitter_stays_under_the_capped_ceiling_and_is_reproducible() {
        let backoff = Backoff {
            base_ms: 100,
            cap_ms: 1_000,
        };
        let mut distinct = std::collections::BTreeSet::new();
        for i in 0..200 {
            let id = format!("call_{i}");
            for attempt in 0..8 {
                let d = backoff.delay(attempt, &id);
                let ceiling = (100u64 << attempt).min(1_000);
                assert!(d <= Duration::from_millis(ceiling), "{attempt} {d:?}");
                assert_eq!(d, backoff.delay(attempt, &id));
            }
            distinct.insert(backoff.delay(3, &id));
        }
        assert!(
            distinct.len() > 50,
            "jitter spreads the delays: {}",
            distinct.len()
        );
        assert_eq!(backoff.delay(u32::MAX, "x"), backoff.delay(u32::MAX, "x"));
    }
}
