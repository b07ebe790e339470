//! The equivalence key: the raw fields two failures are grouped by (spec 002), no opaque
//! hash, so an operator sees exactly why two calls were considered the same.
//!
//! A call is judged before its result exists, so the state machine groups calls by their
//! [`Target`] (tool, resource, auth scope); the failure that opened the circuit adds the
//! error class and the side-effect boundary, and that full key is what the artifact shows.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::class::FailureClass;

/// What a call acts on: the part of the key known before the call's result.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Target {
    pub tool_name: String,
    /// The registry's resource class, qualified by the resource extracted from the
    /// arguments when the registry says how (`sql_namespace:hr.salaries`); `None` for a
    /// tool without a registry entry.
    pub resource_class: Option<String>,
    /// The principal's scope, from the registry (a fixed scope or an argument); `None`
    /// when unknown.
    pub auth_scope: Option<String>,
}

/// The spec's `EquivalenceKey`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EquivalenceKey {
    pub tool_name: String,
    pub resource_class: Option<String>,
    pub auth_scope: Option<String>,
    /// The normalized failure class.
    pub error_class: FailureClass,
    /// True when a mutation may have happened before the failure (docs/tokencircuit.md,
    /// "side_effect_boundary"): a side-effecting tool whose dispatched call failed in a
    /// way that does not prove it was rejected before acting.
    pub side_effect_boundary: bool,
}

impl EquivalenceKey {
    pub fn new(target: &Target, error_class: FailureClass, side_effect_boundary: bool) -> Self {
        EquivalenceKey {
            tool_name: target.tool_name.clone(),
            resource_class: target.resource_class.clone(),
            auth_scope: target.auth_scope.clone(),
            error_class,
            side_effect_boundary,
        }
    }

    pub fn target(&self) -> Target {
        Target {
            tool_name: self.tool_name.clone(),
            resource_class: self.resource_class.clone(),
            auth_scope: self.auth_scope.clone(),
        }
    }
}

impl fmt::Display for EquivalenceKey {
    /// `tool=run_sql resource=sql_namespace:hr auth=analyst class=permission/auth effect=false`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let or_dash = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".to_owned());
        write!(
            f,
            "tool={} resource={} auth={} class={} side_effect_boundary={}",
            self.tool_name,
            or_dash(&self.resource_class),
            or_dash(&self.auth_scope),
            self.error_class,
            self.side_effect_boundary
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_serializes_its_raw_fields() {
        let target = Target {
            tool_name: "run_sql".into(),
            resource_class: Some("sql_namespace:hr".into()),
            auth_scope: None,
        };
        let key = EquivalenceKey::new(&target, FailureClass::PermissionAuth, false);
        let json = serde_json::to_value(&key).expect("test input");
        assert_eq!(
            json,
            serde_json::json!({
                "tool_name": "run_sql",
                "resource_class": "sql_namespace:hr",
                "auth_scope": null,
                "error_class": "permission/auth",
                "side_effect_boundary": false,
            })
        );
        assert_eq!(key.target(), target);
    }
}
