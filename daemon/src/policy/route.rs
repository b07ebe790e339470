//! `[[routes]]` of the config file: which turns a route takes (model, surface, path, key id)
//! and what it sets for them (B, batch-only, each detector's mode and thresholds,
//! TokenCircuit's budgets, the turn sampling rate), validated like every other key.
//!
//! ```toml
//! [[routes]]
//! name = "sensitive"
//! model = "gpt-4o*"            # exact, or a prefix ending in `*`
//! surface = "chat"             # chat | completions | messages | responses
//! key_id = "00c0ffee00c0ffee"  # the key store's id (without a store: the credential's)
//! budget = 0
//! batch_only = true
//! turn_sample_rate = 1.0
//! profiles = ["mkp"]           # applies only under these profiles (default: every one)
//! tool_circuit_budgets = { transient = 1 }
//! [routes.detectors.surprise]  # merged over [detectors.surprise], key by key
//! mode = "hard"
//! threshold_bits = 6.0
//! ```
//!
//! Routes are tried in file order and the first that matches takes the turn; a turn no
//! route matches runs under `default`, the top-level settings.

use serde::Deserialize;

use super::Profile;
use crate::{
    circuit::policy::Budgets,
    detect::{
        config::{err, ConfigFileError},
        pipeline::DetectorsConfig,
    },
    identity::KeyId,
    wire::{
        endpoint::Endpoint,
        surface::{Handling, ROUTES},
    },
};

/// The name of the route a turn no configured route matches runs under.
pub const DEFAULT_ROUTE: &str = "default";

/// Most routes one file may name: every turn start walks them.
pub const MAX_ROUTES: usize = 64;

/// A string matched exactly, or as a prefix when it ends in `*`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pattern {
    Exact(String),
    Prefix(String),
}

impl Pattern {
    fn new(s: &str) -> Pattern {
        match s.strip_suffix('*') {
            Some(p) => Pattern::Prefix(p.to_owned()),
            None => Pattern::Exact(s.to_owned()),
        }
    }

    pub fn matches(&self, s: &str) -> bool {
        match self {
            Pattern::Exact(e) => e == s,
            Pattern::Prefix(p) => s.starts_with(p.as_str()),
        }
    }
}

/// What a turn is matched on.
#[derive(Clone, Copy, Debug)]
pub struct TurnKey<'a> {
    pub endpoint: Endpoint,
    pub model: &'a str,
    /// The key store's id (without a store: the credential's fingerprint).
    pub key: KeyId,
}

/// Which turns a route takes: every key given must match.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RouteMatch {
    pub model: Option<Pattern>,
    pub surface: Option<Endpoint>,
    pub path: Option<Pattern>,
    pub key_id: Option<KeyId>,
}

impl RouteMatch {
    pub fn matches(&self, t: &TurnKey<'_>) -> bool {
        self.model.as_ref().is_none_or(|m| m.matches(t.model))
            && self.surface.is_none_or(|s| s == t.endpoint)
            && self
                .path
                .as_ref()
                .is_none_or(|p| p.matches(endpoint_path(t.endpoint)))
            && self.key_id.is_none_or(|k| k == t.key)
    }
}

/// The surface names a route's `surface` takes.
pub const SURFACES: [(&str, Endpoint); 4] = [
    ("chat", Endpoint::Chat),
    ("completions", Endpoint::Completion),
    ("messages", Endpoint::Messages),
    ("responses", Endpoint::Responses),
];

/// The name of a governed surface, as routes and records spell it.
pub fn surface_name(e: Endpoint) -> &'static str {
    SURFACES
        .iter()
        .find(|(_, s)| *s == e)
        .map_or("chat", |(n, _)| n)
}

/// The path a governed endpoint is served on (the routing table's row).
pub fn endpoint_path(e: Endpoint) -> &'static str {
    ROUTES
        .iter()
        .find(|r| r.handling == Handling::Governed(e))
        .map_or("", |r| r.path)
}

/// TokenCircuit budgets a route sets, each over `[tool_circuit] budgets`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetOverrides {
    pub transient: Option<u32>,
    pub validation: Option<u32>,
    pub missing_resource: Option<u32>,
    pub ambiguous_effect: Option<u32>,
}

impl BudgetOverrides {
    /// `base` with these budgets over it.
    pub fn over(&self, base: Budgets) -> Budgets {
        Budgets {
            transient: self.transient.unwrap_or(base.transient),
            validation: self.validation.unwrap_or(base.validation),
            missing_resource: self.missing_resource.unwrap_or(base.missing_resource),
            ambiguous_effect: self.ambiguous_effect.unwrap_or(base.ambiguous_effect),
        }
    }
}

/// One `[[routes]]` entry as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    name: String,
    model: Option<String>,
    surface: Option<String>,
    path: Option<String>,
    key_id: Option<String>,
    budget: Option<i64>,
    batch_only: Option<bool>,
    turn_sample_rate: Option<f64>,
    profiles: Option<Vec<String>>,
    tool_circuit_budgets: Option<BudgetOverrides>,
    detectors: Option<toml::Table>,
}

/// One route, validated; its detectors are the file's with the route's tables merged over.
#[derive(Clone, Debug)]
pub struct RouteConfig {
    pub name: String,
    pub matcher: RouteMatch,
    pub budget: Option<u32>,
    pub batch_only: bool,
    pub turn_sample_rate: Option<f64>,
    /// The profiles it applies under (empty: every one).
    pub profiles: Vec<Profile>,
    pub circuit_budgets: Option<BudgetOverrides>,
    /// The route's own `[routes.detectors.*]` tables, as written (what `--lock-policy`
    /// compares and what `haltctl detector list` shows).
    pub detector_tables: toml::Table,
    pub detectors: DetectorsConfig,
}

impl RouteConfig {
    pub fn applies_in(&self, p: Profile) -> bool {
        self.profiles.is_empty() || self.profiles.contains(&p)
    }
}

/// Reads `[[routes]]` of `file` (absent: none). `cli_hard_limit` is `--hard-limit`, which a
/// route's own `hard_limit` replaces.
pub fn load(
    file: Option<&toml::Table>,
    cli_hard_limit: f64,
    max_budget: u32,
) -> Result<Vec<RouteConfig>, ConfigFileError> {
    let Some(value) = file.and_then(|f| f.get("routes")) else {
        return Ok(Vec::new());
    };
    let Some(list) = value.as_array() else {
        return Err(err("routes", "must be an array of tables ([[routes]])"));
    };
    if list.len() > MAX_ROUTES {
        return Err(err(
            "routes",
            format!("{} routes; at most {MAX_ROUTES}", list.len()),
        ));
    }
    let mut routes: Vec<RouteConfig> = Vec::with_capacity(list.len());
    for (i, v) in list.iter().enumerate() {
        let raw = RawRoute::deserialize(v.clone())
            .map_err(|e| err(format!("routes[{i}]"), e.message().to_owned()))?;
        let r = route(raw, file, cli_hard_limit, max_budget)?;
        if routes.iter().any(|o| o.name == r.name) {
            return Err(err(
                format!("routes.{}", r.name),
                "a second route of this name",
            ));
        }
        routes.push(r);
    }
    Ok(routes)
}

fn route(
    raw: RawRoute,
    file: Option<&toml::Table>,
    cli_hard_limit: f64,
    max_budget: u32,
) -> Result<RouteConfig, ConfigFileError> {
    let name = raw.name;
    let valid_name = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !valid_name || name == DEFAULT_ROUTE {
        return Err(err(
            format!("routes.{name}.name"),
            format!("{name:?}: 1 to 64 letters, digits, '_' or '-', and not {DEFAULT_ROUTE:?}"),
        ));
    }
    let at = |key: &str| format!("routes.{name}.{key}");
    let matcher = matcher(&raw.model, &raw.surface, &raw.path, &raw.key_id, &at)?;
    let budget = raw
        .budget
        .map(|b| {
            u32::try_from(b)
                .ok()
                .filter(|b| *b <= max_budget)
                .ok_or_else(|| err(at("budget"), format!("{b} is not in 0..={max_budget}")))
        })
        .transpose()?;
    if let Some(r) = raw.turn_sample_rate {
        if !(0.01..=1.0).contains(&r) {
            return Err(err(
                at("turn_sample_rate"),
                format!("{r} is not in 0.01..=1"),
            ));
        }
    }
    let profiles = raw
        .profiles
        .unwrap_or_default()
        .iter()
        .map(|p| {
            Profile::parse(p).ok_or_else(|| {
                err(
                    at("profiles"),
                    format!("{p:?} is not a profile (full, mkp)"),
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(b) = &raw.tool_circuit_budgets {
        let over = b.over(Budgets::default());
        let max = crate::circuit::config::MAX_BUDGET;
        if [
            over.transient,
            over.validation,
            over.missing_resource,
            over.ambiguous_effect,
        ]
        .iter()
        .any(|v| *v > max)
        {
            return Err(err(
                at("tool_circuit_budgets"),
                format!("a budget is more than {max}"),
            ));
        }
    }
    let detector_tables = raw.detectors.unwrap_or_default();
    let detectors = merged_detectors(file, &detector_tables, cli_hard_limit)
        .map_err(|e| err(format!("routes.{name}.{}", e.at), e.reason))?;
    Ok(RouteConfig {
        matcher,
        budget,
        batch_only: raw.batch_only.unwrap_or(false),
        turn_sample_rate: raw.turn_sample_rate,
        profiles,
        circuit_budgets: raw.tool_circuit_budgets,
        detector_tables,
        detectors,
        name,
    })
}

fn matcher(
    model: &Option<String>,
    surface: &Option<String>,
    path: &Option<String>,
    key_id: &Option<String>,
    at: &dyn Fn(&str) -> String,
) -> Result<RouteMatch, ConfigFileError> {
    let surface = surface
        .as_deref()
        .map(|s| {
            SURFACES
                .iter()
                .find(|(n, _)| *n == s)
                .map(|(_, e)| *e)
                .ok_or_else(|| {
                    err(
                        at("surface"),
                        format!("{s:?} is not one of chat, completions, messages, responses"),
                    )
                })
        })
        .transpose()?;
    let path = match path.as_deref() {
        Some(p) if !p.starts_with('/') => {
            return Err(err(at("path"), format!("{p:?} does not start with '/'")))
        }
        Some(p) => {
            let pat = Pattern::new(p);
            if !SURFACES.iter().any(|(_, e)| pat.matches(endpoint_path(*e))) {
                return Err(err(
                    at("path"),
                    format!("{p:?} matches no governed path (/v1/chat/completions, /v1/completions, /v1/messages, /v1/responses)"),
                ));
            }
            Some(pat)
        }
        None => None,
    };
    let key_id = key_id
        .as_deref()
        .map(|k| {
            KeyId::parse_fingerprint(k)
                .ok_or_else(|| err(at("key_id"), format!("{k:?} is not 16 hex digits")))
        })
        .transpose()?;
    let m = RouteMatch {
        model: model.as_deref().map(Pattern::new),
        surface,
        path,
        key_id,
    };
    if m == RouteMatch::default() {
        return Err(err(
            at("name"),
            "matches every turn: give model, surface, path or key_id (the top-level settings are the default route)",
        ));
    }
    Ok(m)
}

/// The file's detector settings with a route's tables merged over them, key by key.
fn merged_detectors(
    file: Option<&toml::Table>,
    route: &toml::Table,
    cli_hard_limit: f64,
) -> Result<DetectorsConfig, ConfigFileError> {
    let mut merged: toml::Table = file
        .into_iter()
        .flatten()
        .filter(|(k, _)| k.as_str() == "detectors" || k.as_str() == "safety")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let detectors = merged
        .entry("detectors")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let Some(detectors) = detectors.as_table_mut() else {
        return Err(err("detectors", "must be a table"));
    };
    for (name, table) in route {
        let Some(table) = table.as_table() else {
            return Err(err(format!("detectors.{name}"), "must be a table"));
        };
        let into = detectors
            .entry(name.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        let Some(into) = into.as_table_mut() else {
            return Err(err(format!("detectors.{name}"), "must be a table"));
        };
        for (k, v) in table {
            into.insert(k.clone(), v.clone());
        }
    }
    // A route's own hard limit replaces --hard-limit for its turns.
    let own_limit = route
        .get("halt_monitor")
        .and_then(|t| t.get("hard_limit"))
        .is_some();
    let cli = if own_limit { 0.0 } else { cli_hard_limit };
    DetectorsConfig::load(Some(&merged), cli)
}

#[cfg(test)]
mod tests;
