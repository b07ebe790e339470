//! `[tool_circuit]` of the config file: whether the proxy enforces TokenCircuit, the
//! budgets and backoff in force, and the operator's tool registry. Read once at start.
//!
//! ```toml
//! [tool_circuit]
//! enabled = true
//! budgets = { transient = 2, validation = 1, missing_resource = 1, ambiguous_effect = 1 }
//! backoff = { base_ms = 500, cap_ms = 30000 }
//! conversations = 4096
//! reconcile_alert_after_s = 3600
//!
//! [tool_circuit.tools.run_sql]
//! resource_class = "sql_namespace"
//! resource = "/schema"
//! auth_scope = { fixed = "analyst" }
//! ```

use std::sync::Arc;

use serde::Deserialize;

use super::policy::{Backoff, Budgets, CircuitPolicy, DEFAULT_RECONCILE_ALERT_AFTER_S};
use super::registry::{AuthScopeSource, ToolRegistry};
use super::store::{DEFAULT_CONVERSATIONS, MAX_CONVERSATIONS};

/// The most retries a budget may allow: a larger one is no budget.
pub const MAX_BUDGET: u32 = 100;
/// The longest backoff cap (ms): ten minutes.
pub const MAX_BACKOFF_MS: u64 = 600_000;
/// The longest `reconcile_alert_after_s`: 30 days.
pub const MAX_RECONCILE_ALERT_AFTER_S: u64 = 30 * 86_400;

/// The section as written.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ToolCircuitSection {
    /// Enforce TokenCircuit on proxied chat turns (default: off).
    pub enabled: bool,
    /// Retries per class (defaults: the spec's table).
    pub budgets: Budgets,
    /// The transient backoff (defaults: base 500 ms, cap 30 s).
    pub backoff: Backoff,
    /// The operator's tool registry, by tool name.
    pub tools: ToolRegistry,
    /// Conversations whose backoff clock and artifacts are kept in memory (default 4096;
    /// the least recently used is evicted).
    pub conversations: usize,
    /// The age (s) past which an unreconciled dispatched call raises
    /// `HaltdUnreconciledToolCalls` (default 3600, 60 to 30 days).
    pub reconcile_alert_after_s: u64,
}

impl Default for ToolCircuitSection {
    fn default() -> Self {
        ToolCircuitSection {
            enabled: false,
            budgets: Budgets::default(),
            backoff: Backoff::default(),
            tools: ToolRegistry::default(),
            conversations: DEFAULT_CONVERSATIONS,
            reconcile_alert_after_s: DEFAULT_RECONCILE_ALERT_AFTER_S,
        }
    }
}

/// A bad `[tool_circuit]` value, with the key it is at.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {reason}")]
pub struct SectionError {
    /// The dotted key (`tool_circuit.backoff.base_ms`).
    pub key: String,
    pub reason: String,
}

fn bad(key: impl Into<String>, reason: impl Into<String>) -> SectionError {
    SectionError {
        key: key.into(),
        reason: reason.into(),
    }
}

impl ToolCircuitSection {
    /// Reads the section (`None`: absent); the policy to enforce, `None` when disabled.
    pub fn load(section: Option<toml::Value>) -> Result<Option<Arc<CircuitPolicy>>, SectionError> {
        let Some(value) = section else {
            return Ok(None);
        };
        if !value.is_table() {
            return Err(bad("tool_circuit", "must be a table ([tool_circuit])"));
        }
        let section = ToolCircuitSection::deserialize(value)
            .map_err(|e| bad("tool_circuit", e.message().to_owned()))?
            .validate()?;
        Ok(section.enabled.then(|| {
            Arc::new(CircuitPolicy {
                budgets: section.budgets,
                backoff: section.backoff,
                registry: section.tools,
                conversations: section.conversations,
                reconcile_alert_after_s: section.reconcile_alert_after_s,
            })
        }))
    }

    /// Checks the ranges and the registry's JSON pointers.
    pub fn validate(self) -> Result<Self, SectionError> {
        let b = &self.budgets;
        for (name, v) in [
            ("transient", b.transient),
            ("validation", b.validation),
            ("missing_resource", b.missing_resource),
            ("ambiguous_effect", b.ambiguous_effect),
        ] {
            if v > MAX_BUDGET {
                return Err(bad(
                    format!("tool_circuit.budgets.{name}"),
                    format!("{v} is more than {MAX_BUDGET}"),
                ));
            }
        }
        if self.conversations == 0 || self.conversations > MAX_CONVERSATIONS {
            return Err(bad(
                "tool_circuit.conversations",
                format!("need 1 to {MAX_CONVERSATIONS}, got {}", self.conversations),
            ));
        }
        if !(60..=MAX_RECONCILE_ALERT_AFTER_S).contains(&self.reconcile_alert_after_s) {
            return Err(bad(
                "tool_circuit.reconcile_alert_after_s",
                format!(
                    "need 60 to {MAX_RECONCILE_ALERT_AFTER_S}, got {}",
                    self.reconcile_alert_after_s
                ),
            ));
        }
        let o = &self.backoff;
        if o.base_ms == 0 || o.base_ms > o.cap_ms || o.cap_ms > MAX_BACKOFF_MS {
            return Err(bad(
                "tool_circuit.backoff",
                format!(
                    "need 0 < base_ms <= cap_ms <= {MAX_BACKOFF_MS}, got base_ms {} cap_ms {}",
                    o.base_ms, o.cap_ms
                ),
            ));
        }
        for (tool, p) in &self.tools.0 {
            let pointers = [
                ("resource", p.resource.as_deref()),
                (
                    "auth_scope",
                    match &p.auth_scope {
                        Some(AuthScopeSource::Argument(s) | AuthScopeSource::Result(s)) => {
                            Some(s.as_str())
                        }
                        _ => None,
                    },
                ),
            ];
            for (field, pointer) in pointers {
                if let Some(ptr) = pointer.filter(|s| !s.starts_with('/')) {
                    return Err(bad(
                        format!("tool_circuit.tools.{tool}.{field}"),
                        format!("{ptr:?} is not a JSON pointer (it starts with /)"),
                    ));
                }
            }
            if p.verifier.as_deref() == Some(tool.as_str()) {
                return Err(bad(
                    format!("tool_circuit.tools.{tool}.verifier"),
                    "a tool cannot verify itself",
                ));
            }
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<Option<Arc<CircuitPolicy>>, SectionError> {
        let mut table: toml::Table = toml::from_str(text).expect("test input");
        ToolCircuitSection::load(table.remove("tool_circuit"))
    }

    #[test]
    fn absent_or_disabled_enforces_nothing() {
        assert_eq!(load(""), Ok(None));
        assert_eq!(
            load("[tool_circuit]\nbudgets = { transient = 3 }\n"),
            Ok(None)
        );
    }

    #[test]
    fn an_enabled_section_gives_its_policy() {
        let p = load(
            "[tool_circuit]\nenabled = true\nbudgets = { transient = 3 }\n\
             [tool_circuit.tools.create_order]\nmethod = \"POST\"\nverifier = \"get_order\"\n",
        )
        .expect("valid")
        .expect("enabled");
        assert_eq!(p.budgets.transient, 3);
        assert_eq!(p.budgets.validation, 1);
        assert_eq!(p.backoff, Backoff::default());
        assert_eq!(p.conversations, DEFAULT_CONVERSATIONS);
        assert!(p.registry.0.contains_key("create_order"));
    }

    #[test]
    fn bad_values_name_their_key() {
        let cases = [
            (
                "[tool_circuit]\nbudgets = { transient = 101 }\n",
                "tool_circuit.budgets.transient",
            ),
            (
                "[tool_circuit]\nbackoff = { base_ms = 0 }\n",
                "tool_circuit.backoff",
            ),
            (
                "[tool_circuit]\nbackoff = { base_ms = 10, cap_ms = 5 }\n",
                "tool_circuit.backoff",
            ),
            (
                "[tool_circuit.tools.a]\nresource = \"schema\"\n",
                "tool_circuit.tools.a.resource",
            ),
            (
                "[tool_circuit.tools.a]\nverifier = \"a\"\n",
                "tool_circuit.tools.a.verifier",
            ),
            ("[tool_circuit]\nenable = true\n", "tool_circuit"),
            (
                "[tool_circuit]\nconversations = 0\n",
                "tool_circuit.conversations",
            ),
            (
                "[tool_circuit.tools.a]\nmethod = \"FETCH\"\n",
                "tool_circuit",
            ),
        ];
        for (text, key) in cases {
            let e = load(text).expect_err(text);
            assert_eq!(e.key, key, "{text}: {e}");
        }
    }
}
