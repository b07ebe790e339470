//! Changing the policy in force (`policy.rs`): a runtime switch (`admin/policy.rs`) or a
//! SIGHUP reload rebuilds the set from what it was built from, checks the profile's floor and
//! `--lock-policy`, and swaps it whole. New turns take it; open ones keep theirs.

use std::sync::Arc;

use super::HaltCore;
use crate::policy::{lock, PolicyError, PolicyInputs, PolicySet};

/// Why a policy change was not applied.
#[derive(Debug, thiserror::Error)]
pub enum PolicyChangeError {
    /// The configuration or the switch does not build (a floor breach names its key).
    #[error("{0}")]
    Build(#[from] PolicyError),
    /// `--lock-policy` refuses it: each way it loosens the policy.
    #[error("refused by --lock-policy: it loosens the policy: {}", .0.join("; "))]
    Locked(Vec<String>),
}

/// A built change, not yet in force ([`HaltCore::install_policy`]).
#[derive(Debug)]
pub struct PreparedPolicy {
    inputs: PolicyInputs,
    set: PolicySet,
}

impl PreparedPolicy {
    pub fn set(&self) -> &PolicySet {
        &self.set
    }
}

/// The inputs in force (plain data: consistent even after a panic elsewhere).
fn held(m: &std::sync::Mutex<PolicyInputs>) -> std::sync::MutexGuard<'_, PolicyInputs> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl HaltCore {
    /// Builds the policy `change` makes of the inputs in force, and checks it: the floor of
    /// its profile, and with `--lock-policy` that it loosens nothing. A refusal is counted
    /// and logged (WARN); the caller records it.
    pub fn prepare_policy(
        &self,
        change: impl FnOnce(&mut PolicyInputs),
    ) -> Result<PreparedPolicy, PolicyChangeError> {
        let mut inputs = held(&self.policy_inputs).clone();
        change(&mut inputs);
        let now = self.policy.load_full();
        let built = inputs
            .build(Some(&now.default_route().detectors))
            .map_err(PolicyChangeError::from)
            .and_then(|set| {
                let loosens = lock::loosenings(&now, &set);
                if self.cfg.args.lock_policy && !loosens.is_empty() {
                    return Err(PolicyChangeError::Locked(loosens));
                }
                Ok(set)
            });
        match built {
            Ok(set) => Ok(PreparedPolicy { inputs, set }),
            Err(e) => {
                self.metrics.policy.refused.inc();
                tracing::warn!(error = %e, "policy change refused; the policy in force stays");
                Err(e)
            }
        }
    }

    /// Puts a prepared policy in force for new turns, and its gauges.
    pub fn install_policy(&self, p: PreparedPolicy) -> Arc<PolicySet> {
        let mut inputs = held(&self.policy_inputs);
        let set = Arc::new(p.set);
        self.policy.store(Arc::clone(&set));
        *inputs = p.inputs;
        drop(inputs);
        self.metrics.policy.show(&set);
        set
    }

    /// Every route name a switch may name (the configured ones, `default`).
    pub fn policy_route_names(&self) -> Vec<String> {
        held(&self.policy_inputs)
            .route_names()
            .into_iter()
            .map(str::to_owned)
            .collect()
    }

    /// The runtime switches in force (what the state store keeps).
    pub fn policy_overrides(&self) -> crate::policy::Overrides {
        held(&self.policy_inputs).overrides.clone()
    }
}
