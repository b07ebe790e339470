//! The `[safety]` config section: the mode, the pack, the operator's alias groups and
//! declarative predicates, each validated at start with an error naming its key.
//!
//! The five v1 boundaries are never removed: `boundaries` must list every one of them (an
//! operator adds boundaries, never drops one), and a v1 boundary's predicate can only be
//! replaced by a declarative one that says `replace = true`, which the verdict records in
//! `replaced_boundaries` and in the result's `predicate: "config"`.

use std::{collections::BTreeSet, sync::Arc};

use serde::{Deserialize, Serialize};

use super::{
    declarative::{Declarative, PredicateSpec},
    identity::ModelAliases,
    Checkability, SafetyCheck, SafetyPack, SafetyVerdict, DEFAULT_PACK_ID, NO_IDENTITY_OVERRIDE,
    V1_BOUNDARIES, V1_REGISTRY,
};
use crate::codes::FailureCode;

/// What a violated verdict does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SafetyMode {
    /// The verdict goes into the turn record; nothing trips (spec 004 v1: observational).
    #[default]
    Observe,
    /// A verdict that is not upheld trips the stream with `SAFETY_BOUNDARY_VIOLATED`.
    Enforce,
}

/// The `safety` config section.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SafetyConfig {
    /// `observe` (default): record the verdict; `enforce`: a violation trips the stream with
    /// `SAFETY_BOUNDARY_VIOLATED`.
    pub mode: SafetyMode,
    /// Count every boundary not decided by runtime evidence as violated (default `false`).
    /// With `enforce` it needs `no_hot_path_repair` and `preserve_versor_closure`, which haltd
    /// can never check, replaced by declarative predicates: every turn would trip.
    pub require_runtime_checkable: bool,
    /// The pack id written into every verdict (default `haltd-safety-v1`).
    pub pack_id: String,
    /// The pack's boundary ids (default: the five v1 boundaries, which it must keep). Ids
    /// without a predicate are recorded as unknown.
    pub boundaries: Vec<String>,
    /// Groups of model names that are one model for `no_identity_override` (a backend's
    /// served names).
    pub model_aliases: Vec<Vec<String>>,
    /// Declarative predicates: each judges the boundary it names, added to the pack.
    pub predicates: Vec<PredicateSpec>,
}

impl Default for SafetyConfig {
    fn default() -> Self {
        SafetyConfig {
            mode: SafetyMode::Observe,
            require_runtime_checkable: false,
            pack_id: DEFAULT_PACK_ID.to_owned(),
            boundaries: V1_BOUNDARIES.iter().map(|s| (*s).to_owned()).collect(),
            model_aliases: Vec::new(),
            predicates: Vec::new(),
        }
    }
}

/// An invalid `safety` config value; names the key (relative to `safety.`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid safety.{key}: {reason}")]
pub struct SafetyConfigError {
    pub key: String,
    pub reason: String,
}

fn config_err(key: impl Into<String>, reason: impl Into<String>) -> SafetyConfigError {
    SafetyConfigError {
        key: key.into(),
        reason: reason.into(),
    }
}

/// Most characters in a pack or boundary id.
const MAX_ID_LEN: usize = 128;

fn check_id(key: &str, id: &str) -> Result<(), SafetyConfigError> {
    if id.is_empty() || id.len() > MAX_ID_LEN {
        return Err(config_err(
            key,
            format!("{id:?} must be 1 to {MAX_ID_LEN} characters"),
        ));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':')))
    {
        return Err(config_err(
            key,
            format!("{id:?} contains {c:?}; ids use ASCII letters, digits, '_', '-', '.', ':'"),
        ));
    }
    Ok(())
}

impl SafetyConfig {
    pub fn validate(self) -> Result<Self, SafetyConfigError> {
        check_id("pack_id", &self.pack_id)?;
        let mut seen = BTreeSet::new();
        for b in &self.boundaries {
            check_id("boundaries", b)?;
            if !seen.insert(b.as_str()) {
                return Err(config_err("boundaries", format!("{b:?} is listed twice")));
            }
        }
        let dropped: Vec<&str> = V1_BOUNDARIES
            .into_iter()
            .filter(|b| !seen.contains(b))
            .collect();
        if !dropped.is_empty() {
            return Err(config_err(
                "boundaries",
                format!(
                    "leaves out the v1 boundaries {}: they are never removed; list them, \
                     or replace a predicate with [[safety.predicates]] and replace = true",
                    dropped.join(", ")
                ),
            ));
        }
        self.validate_aliases()?;
        self.declaratives()?;
        self.validate_enforce()?;
        Ok(self)
    }

    fn validate_aliases(&self) -> Result<(), SafetyConfigError> {
        for (i, group) in self.model_aliases.iter().enumerate() {
            let key = format!("model_aliases[{i}]");
            if group.len() < 2 {
                return Err(config_err(key, "a group names at least two models"));
            }
            if let Some(m) = group.iter().find(|m| m.is_empty() || m.len() > 256) {
                return Err(config_err(
                    key,
                    format!("{m:?}: a model name is 1 to 256 bytes"),
                ));
            }
        }
        Ok(())
    }

    /// `mode = "enforce"` with `require_runtime_checkable` would trip every turn while a
    /// boundary haltd can never check keeps its default predicate.
    fn validate_enforce(&self) -> Result<(), SafetyConfigError> {
        if self.mode != SafetyMode::Enforce || !self.require_runtime_checkable {
            return Ok(());
        }
        // The v1 boundaries the registry says haltd can never check, unless replaced.
        let never: Vec<&str> = V1_REGISTRY
            .into_iter()
            .filter(|(_, c)| matches!(c, Checkability::NotCheckable(_)))
            .map(|(b, _)| b)
            .filter(|b| !self.predicates.iter().any(|p| p.replace && p.name == *b))
            .collect();
        if never.is_empty() {
            return Ok(());
        }
        Err(config_err(
            "require_runtime_checkable",
            format!(
                "with mode = \"enforce\" every turn would trip: haltd can never check {} at \
                 runtime; replace them with [[safety.predicates]] (replace = true) or use \
                 mode = \"observe\"",
                never.join(", ")
            ),
        ))
    }

    /// The declarative predicates, validated: names are ids, unique, and a v1 id only with
    /// `replace = true` (and `replace` only for a v1 id).
    pub fn declaratives(&self) -> Result<Vec<Declarative>, SafetyConfigError> {
        let mut names = BTreeSet::new();
        let mut out = Vec::with_capacity(self.predicates.len());
        for (i, spec) in self.predicates.iter().enumerate() {
            let key = format!("predicates[{i}].name");
            check_id(&key, &spec.name)?;
            if !names.insert(spec.name.as_str()) {
                return Err(config_err(
                    key,
                    format!("{:?} is the name of an earlier predicate", spec.name),
                ));
            }
            let v1 = V1_BOUNDARIES.contains(&spec.name.as_str());
            if v1 && !spec.replace {
                return Err(config_err(
                    key,
                    format!(
                        "{:?} is a v1 boundary: set replace = true to replace its predicate",
                        spec.name
                    ),
                ));
            }
            if !v1 && spec.replace {
                return Err(config_err(
                    format!("predicates[{i}].replace"),
                    format!(
                        "{:?} is not a v1 boundary: there is nothing to replace",
                        spec.name
                    ),
                ));
            }
            out.push(Declarative::compile(i, spec)?);
        }
        Ok(out)
    }

    /// The pack this config declares: `boundaries` and every declarative predicate's name.
    pub fn pack(&self) -> SafetyPack {
        let extra = self.predicates.iter().map(|p| p.name.clone());
        SafetyPack::new(
            self.pack_id.clone(),
            self.boundaries.iter().cloned().chain(extra),
        )
    }

    /// The registry of a validated config: the v1 defaults (with its alias groups), its
    /// declarative predicates, its policy.
    pub fn safety_check(&self) -> Result<SafetyCheck, SafetyConfigError> {
        let aliases = Arc::new(ModelAliases::new(&self.model_aliases));
        let mut check =
            SafetyCheck::new().with_require_runtime_checkable(self.require_runtime_checkable);
        check.register_v1(NO_IDENTITY_OVERRIDE, move |ctx| {
            super::identity::no_identity_override(ctx, &aliases)
        });
        for d in self.declaratives()? {
            check.register_declarative(d);
        }
        Ok(check)
    }

    /// The code to trip with for `verdict`: `SAFETY_BOUNDARY_VIOLATED` in `enforce` mode when
    /// the verdict is not upheld, else none.
    pub fn trip_code(&self, verdict: &SafetyVerdict) -> Option<FailureCode> {
        (self.mode == SafetyMode::Enforce && !verdict.upheld)
            .then_some(FailureCode::SafetyBoundaryViolated)
    }
}
