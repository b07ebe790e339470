//! The operator's tool registry: what haltd cannot learn from the wire about a tool.
//!
//! Per tool: its resource class and where the resource is in the arguments, where the
//! principal's auth scope comes from, whether it has side effects (declared, or from the
//! HTTP method of an HTTP tool), and the read-after-write verifier tool. A tool without an
//! entry is judged as idempotent with no resource class, no auth scope and no verifier.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::canonical::{normalize_text, CanonicalArgs};
use super::key::Target;

/// Whether a tool may change state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Effect {
    Idempotent,
    SideEffecting,
}

/// The HTTP method of an HTTP tool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum HttpMethod {
    Get,
    Head,
    Options,
    Post,
    Put,
    Patch,
    Delete,
}

impl HttpMethod {
    /// POST, PUT, PATCH and DELETE may change state.
    pub const fn mutates(self) -> bool {
        matches!(
            self,
            HttpMethod::Post | HttpMethod::Put | HttpMethod::Patch | HttpMethod::Delete
        )
    }
}

/// Where the auth scope of the key comes from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AuthScopeSource {
    /// A fixed scope set by the operator (the agent's principal).
    Fixed(String),
    /// A JSON pointer into the call's arguments (`/role`).
    Argument(String),
    /// A JSON pointer into the failed result (`/error/scope`); it is recorded in the key of
    /// the failure, and a new call is matched without it.
    Result(String),
}

/// One tool's registry entry.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ToolProfile {
    /// The resource class (`sql_namespace`, `api_endpoint`).
    pub resource_class: Option<String>,
    /// A JSON pointer to the resource in the arguments (`/table`); the key's resource class
    /// becomes `class:resource`.
    pub resource: Option<String>,
    /// Where the auth scope comes from; none when unset.
    pub auth_scope: Option<AuthScopeSource>,
    /// Declared effect; when unset, a mutating `method` makes the tool side-effecting and
    /// anything else idempotent.
    pub effect: Option<Effect>,
    /// The HTTP method, for HTTP tools.
    pub method: Option<HttpMethod>,
    /// The read-after-write verifier: a read-only tool whose result confirms the state.
    pub verifier: Option<String>,
}

impl ToolProfile {
    pub fn effect(&self) -> Effect {
        match (self.effect, self.method) {
            (Some(effect), _) => effect,
            (None, Some(method)) if method.mutates() => Effect::SideEffecting,
            (None, _) => Effect::Idempotent,
        }
    }
}

/// The registry: tool name → profile.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ToolRegistry(pub BTreeMap<String, ToolProfile>);

/// The profile of a tool without an entry.
static UNREGISTERED: ToolProfile = ToolProfile {
    resource_class: None,
    resource: None,
    auth_scope: None,
    effect: None,
    method: None,
    verifier: None,
};

impl ToolRegistry {
    pub fn profile(&self, tool: &str) -> &ToolProfile {
        self.0.get(tool).unwrap_or(&UNREGISTERED)
    }

    /// The tools whose verifier is `tool`.
    pub fn verified_by<'a>(&'a self, tool: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.0
            .iter()
            .filter(move |(_, p)| p.verifier.as_deref() == Some(tool))
            .map(|(name, _)| name.as_str())
    }

    /// The target of a call: the tool, its resource and the auth scope known before the
    /// result.
    pub fn target(&self, tool: &str, args: &CanonicalArgs) -> Target {
        let profile = self.profile(tool);
        let value = args.value();
        let at = |pointer: &str| value.as_ref().and_then(|v| pointed_text(v, pointer));
        let resource = profile.resource.as_deref().and_then(at);
        let resource_class = match (&profile.resource_class, resource) {
            (Some(class), Some(resource)) => Some(format!("{class}:{resource}")),
            (Some(class), None) => Some(class.clone()),
            (None, resource) => resource,
        };
        let auth_scope = match &profile.auth_scope {
            Some(AuthScopeSource::Fixed(scope)) => Some(scope.clone()),
            Some(AuthScopeSource::Argument(pointer)) => at(pointer),
            Some(AuthScopeSource::Result(_)) | None => None,
        };
        Target {
            tool_name: tool.to_owned(),
            resource_class,
            auth_scope,
        }
    }
}

/// The text at a JSON pointer: a string (normalized), or a number or bool as written.
pub fn pointed_text(value: &Value, pointer: &str) -> Option<String> {
    match value.pointer(pointer)? {
        Value::String(s) => Some(normalize_text(s)),
        v @ (Value::Number(_) | Value::Bool(_)) => Some(v.to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registry() -> ToolRegistry {
        toml::from_str(
            r#"
            [run_sql]
            resource_class = "sql_namespace"
            resource = "/schema"
            auth_scope = { fixed = "analyst" }

            [create_order]
            method = "POST"
            verifier = "get_order"
            "#,
        )
        .expect("test input")
    }

    #[test]
    fn the_target_carries_the_resource_and_scope() {
        let reg = registry();
        let t = reg.target("run_sql", &CanonicalArgs::of(r#"{"schema":"hr","q":"x"}"#));
        assert_eq!(t.resource_class.as_deref(), Some("sql_namespace:hr"));
        assert_eq!(t.auth_scope.as_deref(), Some("analyst"));
        let t = reg.target("other", &CanonicalArgs::of("{}"));
        assert_eq!((t.resource_class, t.auth_scope), (None, None));
    }

    #[test]
    fn a_mutating_method_makes_a_tool_side_effecting() {
        let reg = registry();
        assert_eq!(reg.profile("create_order").effect(), Effect::SideEffecting);
        assert_eq!(reg.profile("run_sql").effect(), Effect::Idempotent);
        assert_eq!(
            reg.verified_by("get_order").collect::<Vec<_>>(),
            ["create_order"]
        );
    }
}
