//! The six failure classes of spec 002 and the state-transition table.
//!
//! | class | next allowed action | budget | verifier required |
//! |---|---|---|---|
//! | transient | retry with backoff, same intent | +2 | same verifier passes |
//! | validation | ask model/user for corrected args | +1 | args structurally changed |
//! | permission/auth | stop; request auth/scope change | 0 | n/a |
//! | missing_resource | discovery step or human confirmation | +1 | resource identifier resolved |
//! | ambiguous_effect | reconcile / read-after-write verify | +1 | result confirmed |
//! | invariant_violation | fail closed and page human | 0 | n/a |

use std::fmt;

use serde::{Deserialize, Serialize};

/// A failure class: how a failed tool call may (or may not) be retried.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum FailureClass {
    #[serde(rename = "transient")]
    Transient,
    #[serde(rename = "validation")]
    Validation,
    #[serde(rename = "permission/auth")]
    PermissionAuth,
    #[serde(rename = "missing_resource")]
    MissingResource,
    #[serde(rename = "ambiguous_effect")]
    AmbiguousEffect,
    #[serde(rename = "invariant_violation")]
    InvariantViolation,
}

/// What the spec allows after a failure of a class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NextAction {
    /// Retry the same intent after the backoff.
    RetryWithBackoff,
    /// Retry once with corrected (structurally changed) arguments.
    CorrectArguments,
    /// Stop; the principal's auth or scope must change first.
    RequestAuthChange,
    /// A discovery step (or a human) must resolve the identifier first.
    DiscoverResource,
    /// Reconcile with a read-after-write verifier before any retry of the effect.
    VerifyEffect,
    /// Fail closed and page a human.
    FailClosed,
}

/// What must hold before a retry counts as allowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VerifierRequirement {
    /// The same verifier (the backoff) must pass.
    SameVerifierPasses,
    /// The canonical arguments must differ from the failed call's.
    ArgsStructurallyChanged,
    /// The resource identifier was resolved (a discovery result, or a different resource).
    ResourceIdentifierResolved,
    /// A verifier result confirmed the state.
    ResultConfirmed,
    /// No retry is ever allowed.
    NotApplicable,
}

impl FailureClass {
    pub const ALL: [FailureClass; 6] = [
        FailureClass::Transient,
        FailureClass::Validation,
        FailureClass::PermissionAuth,
        FailureClass::MissingResource,
        FailureClass::AmbiguousEffect,
        FailureClass::InvariantViolation,
    ];

    /// The name as written in artifacts, metrics and docs.
    pub const fn as_str(self) -> &'static str {
        match self {
            FailureClass::Transient => "transient",
            FailureClass::Validation => "validation",
            FailureClass::PermissionAuth => "permission/auth",
            FailureClass::MissingResource => "missing_resource",
            FailureClass::AmbiguousEffect => "ambiguous_effect",
            FailureClass::InvariantViolation => "invariant_violation",
        }
    }

    /// The spec's budget delta: retries allowed after a failure of this class.
    pub const fn default_budget(self) -> u32 {
        match self {
            FailureClass::Transient => 2,
            FailureClass::Validation
            | FailureClass::MissingResource
            | FailureClass::AmbiguousEffect => 1,
            FailureClass::PermissionAuth | FailureClass::InvariantViolation => 0,
        }
    }

    pub const fn next_action(self) -> NextAction {
        match self {
            FailureClass::Transient => NextAction::RetryWithBackoff,
            FailureClass::Validation => NextAction::CorrectArguments,
            FailureClass::PermissionAuth => NextAction::RequestAuthChange,
            FailureClass::MissingResource => NextAction::DiscoverResource,
            FailureClass::AmbiguousEffect => NextAction::VerifyEffect,
            FailureClass::InvariantViolation => NextAction::FailClosed,
        }
    }

    pub const fn verifier(self) -> VerifierRequirement {
        match self {
            FailureClass::Transient => VerifierRequirement::SameVerifierPasses,
            FailureClass::Validation => VerifierRequirement::ArgsStructurallyChanged,
            FailureClass::MissingResource => VerifierRequirement::ResourceIdentifierResolved,
            FailureClass::AmbiguousEffect => VerifierRequirement::ResultConfirmed,
            FailureClass::PermissionAuth | FailureClass::InvariantViolation => {
                VerifierRequirement::NotApplicable
            }
        }
    }

    /// Classes whose budget is 0 by definition: not configurable, never retried, and a
    /// request arriving with one open is answered by haltd without calling the model.
    pub const fn fails_closed(self) -> bool {
        matches!(
            self,
            FailureClass::PermissionAuth | FailureClass::InvariantViolation
        )
    }
}

impl fmt::Display for FailureClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_matches_the_spec() {
        let rows: Vec<_> = FailureClass::ALL
            .iter()
            .map(|c| (c.as_str(), c.default_budget(), c.fails_closed()))
            .collect();
        assert_eq!(
            rows,
            [
                ("transient", 2, false),
                ("validation", 1, false),
                ("permission/auth", 0, true),
                ("missing_resource", 1, false),
                ("ambiguous_effect", 1, false),
                ("invariant_violation", 0, true),
            ]
        );
    }

    #[test]
    fn classes_serialize_under_the_spec_names() {
        for c in FailureClass::ALL {
            let json = serde_json::to_string(&c).expect("test input");
            assert_eq!(json, format!("\"{}\"", c.as_str()));
            assert_eq!(
                serde_json::from_str::<FailureClass>(&json).expect("test input"),
                c
            );
        }
    }
}
