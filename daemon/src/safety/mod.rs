//! SafetyCheck (spec 004, ADR-0032): a registry of named predicates, one per safety-pack
//! boundary id, that turns what a turn provides ([`SafetyContext`]) into one auditable
//! [`SafetyVerdict`] for the turn record's `safety_verdict` field.
//!
//! This module is pure: no I/O, no clocks, no globals. The data plane fills a
//! [`SafetyContext`] (with [`request_sources`], [`extract_urls`], [`system_prompt`] and
//! [`identity_digest`]), calls [`SafetyCheck::check`] and decides, from [`SafetyConfig`], what
//! a violation does: `observe` (the default) records it, `enforce` trips the stream with
//! `SAFETY_BOUNDARY_VIOLATED` ([`SafetyConfig::trip_code`]).
//!
//! # Honesty rules (spec 004, docs/spec.md; as in OPA decision logs and Cedar)
//!
//! * Every [`SafetyContext`] field is optional. A predicate whose input is absent reports
//!   `upheld: true, runtime_checkable: false` and a reason naming the missing input: absence
//!   of evidence is not evidence of violation, and the verdict says it had no evidence.
//! * A boundary haltd cannot judge at runtime says `runtime_checkable: false`, never a bare
//!   pass. Each serialised result also carries a derived `status` (`upheld`, `violated` or
//!   `not_checkable`), so "undefined" is its own state in the record, as in OPA decision logs.
//! * A pack boundary with no registered predicate is recorded in
//!   [`SafetyVerdict::unknown_boundaries`] (upheld, not checkable, reason
//!   [`NO_PREDICATE_REASON`]).
//! * [`SafetyCheck::require_runtime_checkable`] is the deployment policy of spec 004: with it,
//!   every boundary that was not checked at runtime (unknown, or its predicate lacked
//!   evidence) counts as violated, with a reason saying why.
//! * A predicate that panics is a violation (deny on error, G3 in docs/spec.md), not a crash of the
//!   data plane and not a pass.
//! * A predicate that returns a result for another boundary id is rebound to the id it was
//!   registered under (spec 004 "Defensive: predicate-result rebinding"); unlike the spec's
//!   silent rebinding, haltd keeps the id the predicate gave as a `rebound_from` evidence
//!   entry, so the bug stays visible in audit.
//!
//! # The five v1 boundaries in haltd
//!
//! | boundary | haltd checks | checkable when |
//! |---|---|---|
//! | `preserve_versor_closure` | `versor_condition < 1e-6` | a versor condition is supplied (never by haltd: it has no field state) |
//! | `no_fabricated_source` | cited URLs ⊆ request source URLs, after [`normalize_url`] | both sets are known |
//! | `no_silent_correction` | every halt/refusal of the turn ended typed | the data plane says so |
//! | `no_identity_override` | identity digest as requested = as answered | both digests are known |
//! | `no_hot_path_repair` | nothing: a code-path boundary | never (static analysis and code review) |
//!
//! The flight recorder holds no prompt or output text, so evidence names URLs by
//! [`url_digest`] and counts, never by their text.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    panic::AssertUnwindSafe,
    sync::Arc,
};

use serde::{ser::SerializeStruct, Deserialize, Serialize, Serializer};

use crate::codes::FailureCode;

mod inputs;

pub use inputs::{
    extract_urls, identity_digest, normalize_url, request_sources, system_prompt, url_digest,
};

/// Boundary id: the runtime's field state keeps versor closure (spec 004 row 1).
pub const PRESERVE_VERSOR_CLOSURE: &str = "preserve_versor_closure";
/// Boundary id: every cited source was given to the model.
pub const NO_FABRICATED_SOURCE: &str = "no_fabricated_source";
/// Boundary id: a refusal or correction is typed, never silent.
pub const NO_SILENT_CORRECTION: &str = "no_silent_correction";
/// Boundary id: the identity the turn ran under is the one requested.
pub const NO_IDENTITY_OVERRIDE: &str = "no_identity_override";
/// Boundary id: no normalisation or drift repair on the hot path (a code-path boundary).
pub const NO_HOT_PATH_REPAIR: &str = "no_hot_path_repair";

/// The five v1 boundaries, in lex order.
pub const V1_BOUNDARIES: [&str; 5] = [
    NO_FABRICATED_SOURCE,
    NO_HOT_PATH_REPAIR,
    NO_IDENTITY_OVERRIDE,
    NO_SILENT_CORRECTION,
    PRESERVE_VERSOR_CLOSURE,
];

/// Pack id of [`SafetyPack::v1`].
pub const DEFAULT_PACK_ID: &str = "haltd-safety-v1";

/// `preserve_versor_closure` holds while the versor condition is strictly below this.
pub const VERSOR_HALT_THRESHOLD: f64 = 1.0e-6;

/// Reason of a pack boundary without a registered predicate (spec 004, verbatim).
pub const NO_PREDICATE_REASON: &str = "no predicate registered for boundary";

/// Boundaries haltd can never check at runtime with its default predicates: with
/// `require_runtime_checkable` and `enforce` they would trip every turn.
const NEVER_CHECKABLE_IN_HALTD: [&str; 2] = [NO_HOT_PATH_REPAIR, PRESERVE_VERSOR_CLOSURE];

/// Most URL digests one result lists in its evidence (the count is always complete).
const MAX_EVIDENCE_URLS: usize = 16;

// ---------------------------------------------------------------------------------------------
// Context, results, verdict
// ---------------------------------------------------------------------------------------------

/// What one turn provides to the predicates. Every field is optional: leave `None` what the
/// data plane does not know, and the predicates that need it say "not checkable".
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SafetyContext {
    /// URLs the request gave the model as sources: [`request_sources`] of the client's body
    /// (message contents except the assistant's, the completions prompt, `sources`,
    /// `documents`). `Some(empty)` means "the request gave no sources", which is evidence.
    pub request_source_urls: Option<BTreeSet<String>>,
    /// URLs cited in the turn's output text: [`extract_urls`] of the text the turn produced.
    pub cited_urls: Option<BTreeSet<String>>,
    /// Whether every halt or refusal of the turn ended with haltd's typed end: the terminal
    /// `error` event (`"type":"halted"`) of a stream, the degraded-safe batch body, or a typed
    /// HTTP error object. `Some(true)` also for a turn with no halt or refusal at all (nothing
    /// was corrected); `Some(false)` when haltd cut, dropped or altered output without one.
    pub last_refusal_was_typed: Option<bool>,
    /// [`identity_digest`] of the identity the client asked for: the request's `model` and its
    /// [`system_prompt`]. Leave `None` when the request named no model.
    pub identity_before: Option<String>,
    /// [`identity_digest`] of the identity the turn was answered under: the `model` the token
    /// source reported (an upstream's chunks; `builtin` for the built-in source) and the
    /// [`system_prompt`] of the body haltd actually sent.
    pub identity_after: Option<String>,
    /// The field state's versor condition. haltd keeps no field state: always `None` there;
    /// the field exists for deployments that register a source of one.
    pub versor_condition: Option<f64>,
}

/// One boundary's result (spec 004 `SafetyCheckResult`).
#[derive(Clone, Debug, PartialEq)]
pub struct SafetyCheckResult {
    pub boundary_id: String,
    pub upheld: bool,
    pub reason: String,
    /// Whether runtime evidence decided `upheld`. `false` with `upheld: true` means "no
    /// opinion", never "checked and fine".
    pub runtime_checkable: bool,
    /// What was measured, as ordered key/value pairs (no prompt or output text).
    pub evidence: Vec<(String, String)>,
}

/// The three states of a result, derived from `upheld` and `runtime_checkable`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckStatus {
    /// Runtime evidence shows the boundary held.
    Upheld,
    /// The boundary is violated (or counts as violated under policy, or its predicate failed).
    Violated,
    /// Nothing at runtime could judge it; recorded as upheld by the spec's default.
    NotCheckable,
}

impl SafetyCheckResult {
    /// Runtime evidence shows the boundary held.
    pub fn upheld(boundary_id: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::new(boundary_id, true, true, reason)
    }

    /// Runtime evidence shows the boundary violated.
    pub fn violated(boundary_id: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::new(boundary_id, false, true, reason)
    }

    /// No runtime evidence: upheld by default, `runtime_checkable: false`.
    pub fn not_checkable(boundary_id: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::new(boundary_id, true, false, reason)
    }

    fn new(
        boundary_id: impl Into<String>,
        upheld: bool,
        runtime_checkable: bool,
        reason: impl Into<String>,
    ) -> Self {
        SafetyCheckResult {
            boundary_id: boundary_id.into(),
            upheld,
            reason: reason.into(),
            runtime_checkable,
            evidence: Vec::new(),
        }
    }

    /// Appends one evidence entry.
    #[must_use]
    pub fn with_evidence(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.evidence.push((key.into(), value.into()));
        self
    }

    pub fn status(&self) -> CheckStatus {
        match (self.upheld, self.runtime_checkable) {
            (false, _) => CheckStatus::Violated,
            (true, true) => CheckStatus::Upheld,
            (true, false) => CheckStatus::NotCheckable,
        }
    }
}

impl Serialize for SafetyCheckResult {
    /// `{"boundary_id","status","upheld","runtime_checkable","reason","evidence":[[k,v],..]}`.
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut s = serializer.serialize_struct("SafetyCheckResult", 6)?;
        s.serialize_field("boundary_id", &self.boundary_id)?;
        s.serialize_field("status", &self.status())?;
        s.serialize_field("upheld", &self.upheld)?;
        s.serialize_field("runtime_checkable", &self.runtime_checkable)?;
        s.serialize_field("reason", &self.reason)?;
        s.serialize_field("evidence", &self.evidence)?;
        s.end()
    }
}

/// The verdict over a whole pack (spec 004 `SafetyVerdict`): the turn record's
/// `safety_verdict`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SafetyVerdict {
    pub pack_id: String,
    /// One result per pack boundary, in lex order of `boundary_id`.
    pub results: Vec<SafetyCheckResult>,
    /// True iff every result is upheld.
    pub upheld: bool,
    pub violated_boundaries: BTreeSet<String>,
    /// How many results runtime evidence decided.
    pub runtime_checkable_count: usize,
    /// Pack boundaries with no registered predicate.
    pub unknown_boundaries: BTreeSet<String>,
    /// The policy the verdict was computed under.
    pub require_runtime_checkable: bool,
}

impl SafetyVerdict {
    /// The result for `boundary_id`, if the pack declared it.
    pub fn result(&self, boundary_id: &str) -> Option<&SafetyCheckResult> {
        self.results.iter().find(|r| r.boundary_id == boundary_id)
    }
}

/// A safety pack: an id and the boundary ids it declares (a set: duplicates collapse, order
/// is lex).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SafetyPack {
    pub pack_id: String,
    pub boundary_ids: BTreeSet<String>,
}

impl SafetyPack {
    pub fn new<I, S>(pack_id: impl Into<String>, boundary_ids: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        SafetyPack {
            pack_id: pack_id.into(),
            boundary_ids: boundary_ids.into_iter().map(Into::into).collect(),
        }
    }

    /// The v1 pack: [`DEFAULT_PACK_ID`] with the five [`V1_BOUNDARIES`].
    pub fn v1() -> Self {
        Self::new(DEFAULT_PACK_ID, V1_BOUNDARIES)
    }
}

impl Default for SafetyPack {
    fn default() -> Self {
        Self::v1()
    }
}

// ---------------------------------------------------------------------------------------------
// The registry
// ---------------------------------------------------------------------------------------------

/// A boundary predicate. It must be pure and cheap: it may run on the data plane at turn end.
pub type SafetyPredicate = Arc<dyn Fn(&SafetyContext) -> SafetyCheckResult + Send + Sync>;

/// The registry of boundary predicates (spec 004 `SafetyCheck`).
#[derive(Clone)]
pub struct SafetyCheck {
    predicates: BTreeMap<String, SafetyPredicate>,
    /// Deployment policy: a boundary not decided by runtime evidence (no predicate, or a
    /// predicate without evidence) counts as violated. Default `false` (spec 004).
    pub require_runtime_checkable: bool,
}

impl fmt::Debug for SafetyCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SafetyCheck")
            .field("predicates", &self.predicates.keys().collect::<Vec<_>>())
            .field("require_runtime_checkable", &self.require_runtime_checkable)
            .finish()
    }
}

impl Default for SafetyCheck {
    fn default() -> Self {
        Self::new()
    }
}

impl SafetyCheck {
    /// A registry with the five v1 default predicates.
    pub fn new() -> Self {
        let mut check = Self::empty();
        check.register(PRESERVE_VERSOR_CLOSURE, preserve_versor_closure);
        check.register(NO_FABRICATED_SOURCE, no_fabricated_source);
        check.register(NO_SILENT_CORRECTION, no_silent_correction);
        check.register(NO_IDENTITY_OVERRIDE, no_identity_override);
        check.register(NO_HOT_PATH_REPAIR, no_hot_path_repair);
        check
    }

    /// A registry with no predicates at all.
    pub fn empty() -> Self {
        SafetyCheck {
            predicates: BTreeMap::new(),
            require_runtime_checkable: false,
        }
    }

    /// Sets [`require_runtime_checkable`](Self::require_runtime_checkable).
    #[must_use]
    pub fn with_require_runtime_checkable(mut self, require: bool) -> Self {
        self.require_runtime_checkable = require;
        self
    }

    /// Registers `predicate` for `boundary_id`, replacing (and returning) any earlier one.
    pub fn register<F>(
        &mut self,
        boundary_id: impl Into<String>,
        predicate: F,
    ) -> Option<SafetyPredicate>
    where
        F: Fn(&SafetyContext) -> SafetyCheckResult + Send + Sync + 'static,
    {
        self.predicates
            .insert(boundary_id.into(), Arc::new(predicate))
    }

    /// Whether a predicate is registered for `boundary_id`.
    pub fn is_registered(&self, boundary_id: &str) -> bool {
        self.predicates.contains_key(boundary_id)
    }

    /// The registered boundary ids, in lex order.
    pub fn boundary_ids(&self) -> impl Iterator<Item = &str> {
        self.predicates.keys().map(String::as_str)
    }

    /// Checks every boundary of `pack` against `ctx`.
    pub fn check(&self, ctx: &SafetyContext, pack: &SafetyPack) -> SafetyVerdict {
        let mut results = Vec::with_capacity(pack.boundary_ids.len());
        let mut unknown_boundaries = BTreeSet::new();
        // `boundary_ids` is a BTreeSet: iteration is already lex order, without duplicates.
        for id in &pack.boundary_ids {
            let mut result = match self.predicates.get(id) {
                Some(predicate) => run_predicate(id, predicate, ctx),
                None => {
                    unknown_boundaries.insert(id.clone());
                    SafetyCheckResult::not_checkable(id.as_str(), NO_PREDICATE_REASON)
                }
            };
            if self.require_runtime_checkable && result.upheld && !result.runtime_checkable {
                result.upheld = false;
                result.reason = format!(
                    "require_runtime_checkable: not decided by runtime evidence ({})",
                    result.reason
                );
            }
            results.push(result);
        }
        let violated_boundaries: BTreeSet<String> = results
            .iter()
            .filter(|r| !r.upheld)
            .map(|r| r.boundary_id.clone())
            .collect();
        SafetyVerdict {
            pack_id: pack.pack_id.clone(),
            upheld: violated_boundaries.is_empty(),
            runtime_checkable_count: results.iter().filter(|r| r.runtime_checkable).count(),
            results,
            violated_boundaries,
            unknown_boundaries,
            require_runtime_checkable: self.require_runtime_checkable,
        }
    }
}

/// Runs one predicate: a panic is a violation (deny on error), a result for another id is
/// rebound to `id` with a `rebound_from` evidence entry.
fn run_predicate(id: &str, predicate: &SafetyPredicate, ctx: &SafetyContext) -> SafetyCheckResult {
    // Contained: the daemon's panic hook leaves this panic to us (crate::crash).
    match crate::crash::containment::contain(AssertUnwindSafe(|| predicate(ctx))) {
        Ok(mut result) => {
            if result.boundary_id != id {
                let given = std::mem::replace(&mut result.boundary_id, id.to_owned());
                result.evidence.push(("rebound_from".to_owned(), given));
            }
            result
        }
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".to_owned());
            SafetyCheckResult::new(
                id,
                false,
                false,
                format!("predicate panicked: {msg}; counted as violated (deny on error)"),
            )
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The five v1 default predicates
// ---------------------------------------------------------------------------------------------

fn missing(boundary_id: &str, inputs: &str) -> SafetyCheckResult {
    SafetyCheckResult::not_checkable(
        boundary_id,
        format!("not checkable: {inputs} not provided (absence of evidence is not evidence of violation)"),
    )
}

/// `preserve_versor_closure`: holds iff `versor_condition < 1e-6` ([`VERSOR_HALT_THRESHOLD`]);
/// a NaN condition is a violation (it is not below anything). haltd keeps no field state, so
/// without a supplied condition the boundary is not checkable.
pub fn preserve_versor_closure(ctx: &SafetyContext) -> SafetyCheckResult {
    let id = PRESERVE_VERSOR_CLOSURE;
    let Some(cond) = ctx.versor_condition else {
        return SafetyCheckResult::not_checkable(
            id,
            "not checkable: haltd keeps no field state, so there is no versor_condition to read",
        );
    };
    let result = if cond < VERSOR_HALT_THRESHOLD {
        SafetyCheckResult::upheld(id, "versor condition below the halt threshold")
    } else {
        SafetyCheckResult::violated(
            id,
            "versor condition at or above the halt threshold (or not a number)",
        )
    };
    result
        .with_evidence("versor_condition", format!("{cond:e}"))
        .with_evidence("threshold", format!("{VERSOR_HALT_THRESHOLD:e}"))
}

/// `no_fabricated_source`: holds iff every cited URL, after [`normalize_url`], is one of the
/// request's source URLs after [`normalize_url`]. Checkable only when both sets are known; an
/// empty cited set holds, and citing anything when the request gave no source violates. The
/// evidence has the counts and the [`url_digest`]s of the unmatched URLs (at most 16).
pub fn no_fabricated_source(ctx: &SafetyContext) -> SafetyCheckResult {
    let id = NO_FABRICATED_SOURCE;
    let (allowed, cited) = match (&ctx.request_source_urls, &ctx.cited_urls) {
        (Some(a), Some(c)) => (a, c),
        (None, Some(_)) => return missing(id, "request_source_urls"),
        (Some(_), None) => return missing(id, "cited_urls"),
        (None, None) => return missing(id, "request_source_urls and cited_urls"),
    };
    let allowed: BTreeSet<String> = allowed.iter().map(|u| normalize_url(u)).collect();
    let cited: BTreeSet<String> = cited.iter().map(|u| normalize_url(u)).collect();
    let unmatched: Vec<&String> = cited.difference(&allowed).collect();
    let result = if unmatched.is_empty() {
        SafetyCheckResult::upheld(id, "every cited URL is a source given in the request")
    } else {
        SafetyCheckResult::violated(
            id,
            format!(
                "{} cited URL(s) not among the request's sources",
                unmatched.len()
            ),
        )
    };
    let mut result = result
        .with_evidence("cited_count", cited.len().to_string())
        .with_evidence("request_source_count", allowed.len().to_string())
        .with_evidence("unmatched_count", unmatched.len().to_string());
    if !unmatched.is_empty() {
        let digests: Vec<String> = unmatched
            .iter()
            .take(MAX_EVIDENCE_URLS)
            .map(|u| url_digest(u))
            .collect();
        result = result.with_evidence("unmatched_sha256_16", digests.join(","));
    }
    result
}

/// `no_silent_correction`: holds iff `last_refusal_was_typed` is `Some(true)`.
pub fn no_silent_correction(ctx: &SafetyContext) -> SafetyCheckResult {
    let id = NO_SILENT_CORRECTION;
    match ctx.last_refusal_was_typed {
        None => missing(id, "last_refusal_was_typed"),
        Some(true) => SafetyCheckResult::upheld(
            id,
            "every halt or refusal of the turn ended with a typed terminal event or error object",
        ),
        Some(false) => SafetyCheckResult::violated(
            id,
            "a halt or refusal of the turn ended without a typed terminal event or error object",
        ),
    }
    .with_evidence(
        "last_refusal_was_typed",
        match ctx.last_refusal_was_typed {
            None => "unknown",
            Some(true) => "true",
            Some(false) => "false",
        },
    )
}

/// `no_identity_override`: holds iff `identity_before == identity_after` (both
/// [`identity_digest`]s); checkable only when both are known.
pub fn no_identity_override(ctx: &SafetyContext) -> SafetyCheckResult {
    let id = NO_IDENTITY_OVERRIDE;
    let (before, after) = match (&ctx.identity_before, &ctx.identity_after) {
        (Some(b), Some(a)) => (b, a),
        (None, Some(_)) => return missing(id, "identity_before"),
        (Some(_), None) => return missing(id, "identity_after"),
        (None, None) => return missing(id, "identity_before and identity_after"),
    };
    let result = if before == after {
        SafetyCheckResult::upheld(id, "the turn was answered under the identity requested")
    } else {
        SafetyCheckResult::violated(
            id,
            "the identity the turn was answered under differs from the one requested",
        )
    };
    result
        .with_evidence("identity_before", before.as_str())
        .with_evidence("identity_after", after.as_str())
}

/// `no_hot_path_repair`: a code-path boundary. No runtime evidence can prove or disprove it,
/// so it is never runtime-checkable, whatever the context holds.
pub fn no_hot_path_repair(_ctx: &SafetyContext) -> SafetyCheckResult {
    SafetyCheckResult::not_checkable(
        NO_HOT_PATH_REPAIR,
        "not runtime-checkable: a code-path boundary (no normalisation or drift repair on the \
         token hot path); enforced by static analysis and code review, no runtime evidence exists",
    )
}

// ---------------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------------

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
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SafetyConfig {
    /// `observe` (default): record the verdict; `enforce`: a violation trips the stream with
    /// `SAFETY_BOUNDARY_VIOLATED`.
    pub mode: SafetyMode,
    /// Count every boundary not decided by runtime evidence as violated (default `false`).
    /// With `enforce` it may not be combined with `no_hot_path_repair` or
    /// `preserve_versor_closure`, which haltd can never check: every turn would trip.
    pub require_runtime_checkable: bool,
    /// The pack id written into every verdict (default `haltd-safety-v1`).
    pub pack_id: String,
    /// The pack's boundary ids (default: the five v1 boundaries). Ids without a registered
    /// predicate are recorded as unknown.
    pub boundaries: Vec<String>,
}

impl Default for SafetyConfig {
    fn default() -> Self {
        SafetyConfig {
            mode: SafetyMode::Observe,
            require_runtime_checkable: false,
            pack_id: DEFAULT_PACK_ID.to_owned(),
            boundaries: V1_BOUNDARIES.iter().map(|s| (*s).to_owned()).collect(),
        }
    }
}

/// An invalid `safety` config value; names the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid safety.{key}: {reason}")]
pub struct SafetyConfigError {
    pub key: &'static str,
    pub reason: String,
}

fn config_err(key: &'static str, reason: impl Into<String>) -> SafetyConfigError {
    SafetyConfigError {
        key,
        reason: reason.into(),
    }
}

/// Most characters in a pack or boundary id.
const MAX_ID_LEN: usize = 128;

fn check_id(key: &'static str, id: &str) -> Result<(), SafetyConfigError> {
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
        if self.boundaries.is_empty() {
            return Err(config_err(
                "boundaries",
                "must name at least one boundary (an empty pack checks nothing)",
            ));
        }
        let mut seen = BTreeSet::new();
        for b in &self.boundaries {
            check_id("boundaries", b)?;
            if !seen.insert(b.as_str()) {
                return Err(config_err("boundaries", format!("{b:?} is listed twice")));
            }
        }
        if self.mode == SafetyMode::Enforce && self.require_runtime_checkable {
            let never: Vec<&str> = NEVER_CHECKABLE_IN_HALTD
                .into_iter()
                .filter(|b| seen.contains(b))
                .collect();
            if !never.is_empty() {
                return Err(config_err(
                    "require_runtime_checkable",
                    format!(
                        "with mode = \"enforce\" every turn would trip: haltd can never check {} at runtime; \
                         drop them from safety.boundaries or use mode = \"observe\"",
                        never.join(", ")
                    ),
                ));
            }
        }
        Ok(self)
    }

    /// The pack this config declares.
    pub fn pack(&self) -> SafetyPack {
        SafetyPack::new(self.pack_id.clone(), self.boundaries.iter().cloned())
    }

    /// A registry with the v1 defaults and this config's policy.
    pub fn safety_check(&self) -> SafetyCheck {
        SafetyCheck::new().with_require_runtime_checkable(self.require_runtime_checkable)
    }

    /// The code to trip with for `verdict`: `SAFETY_BOUNDARY_VIOLATED` in `enforce` mode when
    /// the verdict is not upheld, else none.
    pub fn trip_code(&self, verdict: &SafetyVerdict) -> Option<FailureCode> {
        (self.mode == SafetyMode::Enforce && !verdict.upheld)
            .then_some(FailureCode::SafetyBoundaryViolated)
    }
}

#[cfg(test)]
mod tests {
    use super::{inputs::scheme_len, *};
    use proptest::prelude::*;
    use serde_json::json;

    fn set(items: &[&str]) -> Option<BTreeSet<String>> {
        Some(items.iter().map(|s| (*s).to_owned()).collect())
    }

    fn urls(text: &str) -> Vec<String> {
        extract_urls(text).into_iter().collect()
    }

    fn evidence<'a>(r: &'a SafetyCheckResult, key: &str) -> Option<&'a str> {
        r.evidence
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn full_ctx() -> SafetyContext {
        SafetyContext {
            request_source_urls: set(&["https://a.example/doc"]),
            cited_urls: set(&["https://a.example/doc"]),
            last_refusal_was_typed: Some(true),
            identity_before: Some(identity_digest("m", "sys")),
            identity_after: Some(identity_digest("m", "sys")),
            versor_condition: None,
        }
    }

    // --- preserve_versor_closure -------------------------------------------------------------

    #[test]
    fn versor_closure_without_field_state_is_not_checkable() {
        let r = preserve_versor_closure(&SafetyContext::default());
        assert!(r.upheld && !r.runtime_checkable);
        assert_eq!(r.status(), CheckStatus::NotCheckable);
        assert!(r.reason.contains("no field state"), "{}", r.reason);
    }

    #[test]
    fn versor_closure_below_threshold_holds_at_or_above_or_nan_violates() {
        let at = |v: f64| {
            preserve_versor_closure(&SafetyContext {
                versor_condition: Some(v),
                ..SafetyContext::default()
            })
        };
        let ok = at(1.0e-7);
        assert!(ok.upheld && ok.runtime_checkable);
        assert_eq!(evidence(&ok, "versor_condition"), Some("1e-7"));
        for bad in [VERSOR_HALT_THRESHOLD, 0.5, f64::NAN, f64::INFINITY] {
            let r = at(bad);
            assert!(!r.upheld && r.runtime_checkable, "{bad}");
            assert_eq!(r.status(), CheckStatus::Violated);
        }
    }

    // --- no_fabricated_source ----------------------------------------------------------------

    #[test]
    fn fabricated_source_subset_holds() {
        let r = no_fabricated_source(&SafetyContext {
            request_source_urls: set(&["https://a.example/x", "https://b.example/y"]),
            cited_urls: set(&["https://a.example/x"]),
            ..SafetyContext::default()
        });
        assert!(r.upheld && r.runtime_checkable, "{r:?}");
        assert_eq!(evidence(&r, "cited_count"), Some("1"));
        assert_eq!(evidence(&r, "request_source_count"), Some("2"));
        assert_eq!(evidence(&r, "unmatched_count"), Some("0"));
        assert_eq!(evidence(&r, "unmatched_sha256_16"), None);
    }

    #[test]
    fn fabricated_source_outside_the_request_violates_and_names_it_by_digest() {
        let r = no_fabricated_source(&SafetyContext {
            request_source_urls: set(&["https://a.example/x"]),
            cited_urls: set(&["https://a.example/x", "https://evil.example/made-up"]),
            ..SafetyContext::default()
        });
        assert!(!r.upheld && r.runtime_checkable);
        assert_eq!(evidence(&r, "unmatched_count"), Some("1"));
        let digest = url_digest("https://evil.example/made-up");
        assert_eq!(digest.len(), 16);
        assert_eq!(evidence(&r, "unmatched_sha256_16"), Some(digest.as_str()));
        // No URL text in the result.
        let json = serde_json::to_string(&r).expect("serialises");
        assert!(!json.contains("evil.example"), "{json}");
    }

    #[test]
    fn fabricated_source_compares_normalised_urls() {
        let r = no_fabricated_source(&SafetyContext {
            request_source_urls: set(&["https://Docs.Example.COM:443/Guide/#intro"]),
            cited_urls: set(&[
                "HTTPS://docs.example.com/Guide",
                "https://docs.example.com/Guide?",
            ]),
            ..SafetyContext::default()
        });
        assert!(r.upheld && r.runtime_checkable, "{r:?}");
        // Path case matters.
        let r = no_fabricated_source(&SafetyContext {
            request_source_urls: set(&["https://docs.example.com/Guide"]),
            cited_urls: set(&["https://docs.example.com/guide"]),
            ..SafetyContext::default()
        });
        assert!(!r.upheld);
    }

    #[test]
    fn fabricated_source_edge_sets() {
        // Nothing cited: holds, and that is evidence.
        let r = no_fabricated_source(&SafetyContext {
            request_source_urls: set(&[]),
            cited_urls: set(&[]),
            ..SafetyContext::default()
        });
        assert!(r.upheld && r.runtime_checkable);
        // Citing when the request gave no source violates.
        let r = no_fabricated_source(&SafetyContext {
            request_source_urls: set(&[]),
            cited_urls: set(&["https://x.example"]),
            ..SafetyContext::default()
        });
        assert!(!r.upheld && r.runtime_checkable);
    }

    #[test]
    fn fabricated_source_missing_inputs_are_named() {
        for (ctx, name) in [
            (
                SafetyContext {
                    cited_urls: set(&["https://x.example"]),
                    ..SafetyContext::default()
                },
                "request_source_urls not provided",
            ),
            (
                SafetyContext {
                    request_source_urls: set(&[]),
                    ..SafetyContext::default()
                },
                "cited_urls not provided",
            ),
            (
                SafetyContext::default(),
                "request_source_urls and cited_urls not provided",
            ),
        ] {
            let r = no_fabricated_source(&ctx);
            assert!(r.upheld && !r.runtime_checkable);
            assert!(r.reason.contains(name), "{}", r.reason);
        }
    }

    #[test]
    fn unmatched_digests_are_capped_but_counted() {
        let cited: Vec<String> = (0..40).map(|i| format!("https://x.example/{i}")).collect();
        let r = no_fabricated_source(&SafetyContext {
            request_source_urls: set(&[]),
            cited_urls: Some(cited.into_iter().collect()),
            ..SafetyContext::default()
        });
        assert_eq!(evidence(&r, "unmatched_count"), Some("40"));
        let listed = evidence(&r, "unmatched_sha256_16").expect("digests");
        assert_eq!(listed.split(',').count(), MAX_EVIDENCE_URLS);
    }

    // --- no_silent_correction ----------------------------------------------------------------

    #[test]
    fn silent_correction_follows_the_typed_flag() {
        let with = |v| {
            no_silent_correction(&SafetyContext {
                last_refusal_was_typed: v,
                ..SafetyContext::default()
            })
        };
        let r = with(Some(true));
        assert!(r.upheld && r.runtime_checkable);
        let r = with(Some(false));
        assert!(!r.upheld && r.runtime_checkable);
        assert_eq!(evidence(&r, "last_refusal_was_typed"), Some("false"));
        let r = with(None);
        assert!(r.upheld && !r.runtime_checkable);
        assert!(r.reason.contains("last_refusal_was_typed not provided"));
    }

    // --- no_identity_override ----------------------------------------------------------------

    #[test]
    fn identity_override_compares_digests() {
        let same = no_identity_override(&full_ctx());
        assert!(same.upheld && same.runtime_checkable);
        let r = no_identity_override(&SafetyContext {
            identity_after: Some(identity_digest("other-model", "sys")),
            ..full_ctx()
        });
        assert!(!r.upheld && r.runtime_checkable);
        assert_eq!(
            evidence(&r, "identity_after"),
            Some(identity_digest("other-model", "sys").as_str())
        );
        for (ctx, name) in [
            (
                SafetyContext {
                    identity_before: None,
                    ..full_ctx()
                },
                "identity_before not provided",
            ),
            (
                SafetyContext {
                    identity_after: None,
                    ..full_ctx()
                },
                "identity_after not provided",
            ),
            (
                SafetyContext::default(),
                "identity_before and identity_after not provided",
            ),
        ] {
            let r = no_identity_override(&ctx);
            assert!(r.upheld && !r.runtime_checkable);
            assert!(r.reason.contains(name), "{}", r.reason);
        }
    }

    #[test]
    fn identity_digest_separates_model_and_system_prompt() {
        let d = identity_digest("m", "sys");
        assert_eq!(d.len(), 64);
        assert_eq!(d, identity_digest("m", "sys"));
        assert_ne!(d, identity_digest("m2", "sys"));
        assert_ne!(d, identity_digest("m", "sys2"));
        // Length prefixes: moving bytes between the fields changes the digest.
        assert_ne!(identity_digest("ab", "c"), identity_digest("a", "bc"));
    }

    #[test]
    fn system_prompt_takes_system_and_developer_messages() {
        let body = json!({"model": "m", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "developer", "content": [{"type": "text", "text": "no tools"}]},
            {"role": "assistant", "content": "hello"}
        ]});
        assert_eq!(system_prompt(&body), "be brief\nno tools");
        assert_eq!(system_prompt(&json!({"prompt": "x"})), "");
    }

    // --- no_hot_path_repair ------------------------------------------------------------------

    #[test]
    fn hot_path_repair_is_never_runtime_checkable() {
        for ctx in [SafetyContext::default(), full_ctx()] {
            let r = no_hot_path_repair(&ctx);
            assert!(r.upheld && !r.runtime_checkable);
            assert_eq!(r.status(), CheckStatus::NotCheckable);
            assert!(r.reason.contains("static analysis and code review"));
        }
    }

    // --- the registry ------------------------------------------------------------------------

    #[test]
    fn absent_inputs_uphold_everything_with_no_evidence() {
        let v = SafetyCheck::new().check(&SafetyContext::default(), &SafetyPack::v1());
        assert!(v.upheld);
        assert_eq!(v.runtime_checkable_count, 0);
        assert!(v.violated_boundaries.is_empty() && v.unknown_boundaries.is_empty());
        assert_eq!(v.results.len(), 5);
        assert!(v
            .results
            .iter()
            .all(|r| r.status() == CheckStatus::NotCheckable));
    }

    #[test]
    fn default_pack_with_full_context() {
        let v = SafetyCheck::new().check(&full_ctx(), &SafetyPack::v1());
        assert!(v.upheld);
        assert_eq!(v.pack_id, DEFAULT_PACK_ID);
        // Three of five are checkable in haltd; versor closure and hot-path repair are not.
        assert_eq!(v.runtime_checkable_count, 3);
        let ids: Vec<&str> = v.results.iter().map(|r| r.boundary_id.as_str()).collect();
        assert_eq!(ids, V1_BOUNDARIES);
    }

    #[test]
    fn unknown_boundary_is_recorded_upheld_and_not_checkable() {
        let pack = SafetyPack::new("p", ["custom_boundary", NO_SILENT_CORRECTION]);
        let v = SafetyCheck::new().check(&full_ctx(), &pack);
        assert!(v.upheld);
        assert_eq!(
            v.unknown_boundaries,
            set(&["custom_boundary"]).expect("set")
        );
        let r = v.result("custom_boundary").expect("result");
        assert!(r.upheld && !r.runtime_checkable);
        assert_eq!(r.reason, NO_PREDICATE_REASON);
        assert_eq!(v.runtime_checkable_count, 1);
    }

    #[test]
    fn custom_predicates_register_and_replace() {
        let mut check = SafetyCheck::new();
        assert!(!check.is_registered("robot_speed"));
        let old = check.register("robot_speed", |ctx: &SafetyContext| {
            if ctx.versor_condition.is_some_and(|v| v > 1.0) {
                SafetyCheckResult::violated("robot_speed", "too fast")
            } else {
                SafetyCheckResult::upheld("robot_speed", "slow enough")
            }
        });
        assert!(old.is_none());
        // Replacing a default.
        let old = check.register(NO_HOT_PATH_REPAIR, |_: &SafetyContext| {
            SafetyCheckResult::upheld(NO_HOT_PATH_REPAIR, "audited build")
        });
        assert!(old.is_some());
        assert_eq!(check.boundary_ids().count(), 6);

        let pack = SafetyPack::new("robots", ["robot_speed", NO_HOT_PATH_REPAIR]);
        let fast = SafetyContext {
            versor_condition: Some(2.0),
            ..SafetyContext::default()
        };
        let v = check.check(&fast, &pack);
        assert!(!v.upheld);
        assert_eq!(v.violated_boundaries, set(&["robot_speed"]).expect("set"));
        let hot = v.result(NO_HOT_PATH_REPAIR).expect("result");
        assert!(hot.upheld && hot.runtime_checkable && hot.reason == "audited build");
        assert!(check.check(&SafetyContext::default(), &pack).upheld);
        // The other defaults stay registered.
        for id in V1_BOUNDARIES {
            assert!(check.is_registered(id));
        }
    }

    #[test]
    fn results_for_another_boundary_are_rebound_and_the_bug_stays_visible() {
        let mut check = SafetyCheck::empty();
        check.register("mine", |_: &SafetyContext| {
            SafetyCheckResult::violated("someone_else", "bad")
        });
        let v = check.check(&SafetyContext::default(), &SafetyPack::new("p", ["mine"]));
        let r = &v.results[0];
        assert_eq!(r.boundary_id, "mine");
        assert!(!r.upheld);
        assert_eq!(evidence(r, "rebound_from"), Some("someone_else"));
        assert_eq!(v.violated_boundaries, set(&["mine"]).expect("set"));
    }

    #[test]
    fn a_panicking_predicate_is_a_violation() {
        let mut check = SafetyCheck::new();
        check.register("fragile", |_: &SafetyContext| -> SafetyCheckResult {
            panic!("boom")
        });
        let v = check.check(
            &full_ctx(),
            &SafetyPack::new("p", ["fragile", NO_SILENT_CORRECTION]),
        );
        assert!(!v.upheld);
        let r = v.result("fragile").expect("result");
        assert!(!r.upheld && !r.runtime_checkable);
        assert!(r.reason.contains("panicked: boom"), "{}", r.reason);
        assert!(v.result(NO_SILENT_CORRECTION).expect("result").upheld);
    }

    #[test]
    fn aggregation_lex_order_violations_and_counts() {
        let ctx = SafetyContext {
            request_source_urls: set(&[]),
            cited_urls: set(&["https://made.up/x"]),
            last_refusal_was_typed: Some(false),
            identity_before: Some(identity_digest("a", "")),
            identity_after: Some(identity_digest("a", "")),
            versor_condition: None,
        };
        let pack = SafetyPack::new(
            "p",
            [
                PRESERVE_VERSOR_CLOSURE,
                "zz_custom",
                NO_SILENT_CORRECTION,
                NO_FABRICATED_SOURCE,
                NO_SILENT_CORRECTION,
                "aa_custom",
                NO_IDENTITY_OVERRIDE,
            ],
        );
        let v = SafetyCheck::new().check(&ctx, &pack);
        let ids: Vec<&str> = v.results.iter().map(|r| r.boundary_id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "aa_custom",
                NO_FABRICATED_SOURCE,
                NO_IDENTITY_OVERRIDE,
                NO_SILENT_CORRECTION,
                PRESERVE_VERSOR_CLOSURE,
                "zz_custom"
            ]
        );
        assert!(!v.upheld);
        assert_eq!(
            v.violated_boundaries,
            set(&[NO_FABRICATED_SOURCE, NO_SILENT_CORRECTION]).expect("set")
        );
        assert_eq!(v.runtime_checkable_count, 3);
        assert_eq!(
            v.unknown_boundaries,
            set(&["aa_custom", "zz_custom"]).expect("set")
        );
        assert_eq!(v.upheld, v.results.iter().all(|r| r.upheld));
        // An empty pack is vacuously upheld.
        let v = SafetyCheck::new().check(&ctx, &SafetyPack::new("p", Vec::<String>::new()));
        assert!(v.upheld && v.results.is_empty());
    }

    #[test]
    fn require_runtime_checkable_turns_unchecked_boundaries_into_violations() {
        let check = SafetyCheck::new().with_require_runtime_checkable(true);
        let mut pack = SafetyPack::v1();
        pack.boundary_ids.insert("custom".to_owned());
        let v = check.check(&full_ctx(), &pack);
        assert!(v.require_runtime_checkable);
        assert!(!v.upheld);
        assert_eq!(
            v.violated_boundaries,
            set(&["custom", NO_HOT_PATH_REPAIR, PRESERVE_VERSOR_CLOSURE]).expect("set")
        );
        let unknown = v.result("custom").expect("result");
        assert!(unknown.reason.starts_with("require_runtime_checkable"));
        assert!(unknown.reason.contains(NO_PREDICATE_REASON));
        assert_eq!(unknown.status(), CheckStatus::Violated);
        // Checkable, upheld boundaries are unaffected.
        assert!(v.result(NO_SILENT_CORRECTION).expect("result").upheld);
        assert_eq!(v.runtime_checkable_count, 3);
        // A missing input counts too.
        let v = check.check(
            &SafetyContext::default(),
            &SafetyPack::new("p", [NO_SILENT_CORRECTION]),
        );
        assert!(!v.upheld);
        assert!(v.results[0]
            .reason
            .contains("last_refusal_was_typed not provided"));
    }

    #[test]
    fn verdict_serialises_for_the_turn_record() {
        let v = SafetyCheck::new().check(
            &full_ctx(),
            &SafetyPack::new("p", [NO_SILENT_CORRECTION, NO_HOT_PATH_REPAIR, "x"]),
        );
        let j = serde_json::to_value(&v).expect("serialises");
        assert_eq!(j["pack_id"], "p");
        assert_eq!(j["upheld"], true);
        assert_eq!(j["runtime_checkable_count"], 1);
        assert_eq!(j["violated_boundaries"], json!([]));
        assert_eq!(j["unknown_boundaries"], json!(["x"]));
        assert_eq!(j["require_runtime_checkable"], false);
        assert_eq!(j["results"][0]["boundary_id"], NO_HOT_PATH_REPAIR);
        assert_eq!(j["results"][0]["status"], "not_checkable");
        assert_eq!(j["results"][1]["boundary_id"], NO_SILENT_CORRECTION);
        assert_eq!(j["results"][1]["status"], "upheld");
        assert_eq!(j["results"][1]["runtime_checkable"], true);
        assert_eq!(
            j["results"][1]["evidence"],
            json!([["last_refusal_was_typed", "true"]])
        );
        assert_eq!(j["results"][2]["reason"], NO_PREDICATE_REASON);
    }

    // --- URL extraction ----------------------------------------------------------------------

    #[test]
    fn urls_in_prose_and_markdown() {
        assert_eq!(
            urls("See https://a.b/c, and http://d.e/f; also https://g.h/i."),
            ["http://d.e/f", "https://a.b/c", "https://g.h/i"]
        );
        assert_eq!(urls("[x](https://a.b/c)"), ["https://a.b/c"]);
        assert_eq!(urls("[https://a.b/c](https://a.b/c)"), ["https://a.b/c"]);
        assert_eq!(urls("(see https://a.b/c)."), ["https://a.b/c"]);
        assert_eq!(urls("**https://a.b/c**!"), ["https://a.b/c"]);
        assert_eq!(urls("<https://a.b/c>"), ["https://a.b/c"]);
        assert_eq!(urls("\"https://a.b/c\""), ["https://a.b/c"]);
        assert_eq!(urls("“https://a.b/c”"), ["https://a.b/c"]);
        assert_eq!(urls("`https://a.b/c`;"), ["https://a.b/c"]);
        assert_eq!(urls("ends with https://a.b/c?"), ["https://a.b/c"]);
        assert_eq!(urls("https://a.b/c);"), ["https://a.b/c"]);
    }

    #[test]
    fn urls_keep_what_belongs_to_them() {
        assert_eq!(
            urls("https://en.wikipedia.org/wiki/Rust_(programming_language)."),
            ["https://en.wikipedia.org/wiki/Rust_(programming_language)"]
        );
        assert_eq!(
            urls("go to https://a.b/s?q=1&r=a,b#frag now"),
            ["https://a.b/s?q=1&r=a,b#frag"]
        );
        assert_eq!(
            urls("https://a.b/r?to=https://c.d/e"),
            ["https://a.b/r?to=https://c.d/e"]
        );
        assert_eq!(urls("http://[::1]:8080/x]"), ["http://[::1]:8080/x"]);
        assert_eq!(
            urls("HTTPS://Example.COM/Path"),
            ["HTTPS://Example.COM/Path"]
        );
        assert_eq!(
            urls("https://例え.jp/ページ。次"),
            ["https://例え.jp/ページ"]
        );
        assert_eq!(urls("https://a.b/c\nhttps://a.b/c"), ["https://a.b/c"]);
    }

    #[test]
    fn urls_split_by_punctuation() {
        assert_eq!(
            urls("https://a.b/c,https://d.e/f;http://g.h"),
            ["http://g.h", "https://a.b/c", "https://d.e/f"]
        );
        assert_eq!(
            urls("https://a.b/c|https://d.e"),
            ["https://a.b/c", "https://d.e"]
        );
    }

    #[test]
    fn not_urls() {
        assert!(urls("https:// nothing").is_empty());
        assert!(urls("https://").is_empty());
        assert!(urls("https:///path").is_empty());
        assert!(urls("https://.").is_empty());
        assert!(urls("xhttps://a.b/c").is_empty());
        assert!(urls("ftp://a.b/c mailto:x@y.z a.b/c").is_empty());
        assert!(urls("").is_empty());
    }

    #[test]
    fn normalize_url_rules() {
        assert_eq!(normalize_url("HTTPS://Ex.COM/A/B/#x"), "https://ex.com/A/B");
        assert_eq!(normalize_url("https://ex.com/"), "https://ex.com");
        assert_eq!(normalize_url("http://ex.com:80/a"), "http://ex.com/a");
        assert_eq!(
            normalize_url("https://ex.com:8443/a"),
            "https://ex.com:8443/a"
        );
        assert_eq!(normalize_url("http://ex.com:443/a"), "http://ex.com:443/a");
        assert_eq!(
            normalize_url("https://ex.com/a/?q=1"),
            "https://ex.com/a?q=1"
        );
        assert_eq!(normalize_url("https://ex.com/a?"), "https://ex.com/a");
        assert_eq!(
            normalize_url("https://User@Ex.com/a"),
            "https://User@ex.com/a"
        );
        assert_eq!(normalize_url("https://ex.com?q=A#f"), "https://ex.com?q=A");
        assert_eq!(normalize_url("  not a url "), "not a url");
    }

    // --- request_sources ---------------------------------------------------------------------

    #[test]
    fn request_sources_of_a_chat_request() {
        let body = json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "Use https://sys.example/policy."},
                {"role": "user", "content": [
                    {"type": "text", "text": "Read [this](https://u.example/a) and https://u.example/b"},
                    {"type": "image_url", "image_url": {"url": "https://img.example/x.png"}}
                ]},
                {"role": "assistant", "content": "I made up https://fake.example/z"},
                {"role": "tool", "content": "fetched https://tool.example/r"}
            ],
            "sources": ["https://s.example/1", "not a url", 7],
            "documents": [{"title": "d", "text": "from https://doc.example/t"}]
        });
        let got: Vec<String> = request_sources(&body).into_iter().collect();
        assert_eq!(
            got,
            [
                "https://doc.example/t",
                "https://s.example/1",
                "https://sys.example/policy",
                "https://tool.example/r",
                "https://u.example/a",
                "https://u.example/b",
            ]
        );
    }

    #[test]
    fn request_sources_of_a_completions_request() {
        let one = json!({"model": "m", "prompt": "Summarise https://c.example/p."});
        assert_eq!(
            request_sources(&one).into_iter().collect::<Vec<_>>(),
            ["https://c.example/p"]
        );
        let list = json!({"prompt": ["a https://x.example", "b https://y.example/"], "sources": ["https://z.example"]});
        assert_eq!(
            request_sources(&list).into_iter().collect::<Vec<_>>(),
            [
                "https://x.example",
                "https://y.example/",
                "https://z.example"
            ]
        );
        let tokens = json!({"prompt": [1, 2, 3]});
        assert!(request_sources(&tokens).is_empty());
        assert!(request_sources(&json!(null)).is_empty());
    }

    #[test]
    fn sources_end_to_end_through_the_check() {
        let body = json!({"messages": [{"role": "user", "content": "Cite https://Docs.example/a/ please"}]});
        let output = "According to [the docs](https://docs.example/a#s2), yes; see also https://elsewhere.example.";
        let ctx = SafetyContext {
            request_source_urls: Some(request_sources(&body)),
            cited_urls: Some(extract_urls(output)),
            ..SafetyContext::default()
        };
        let v = SafetyCheck::new().check(&ctx, &SafetyPack::v1());
        assert_eq!(
            v.violated_boundaries,
            set(&[NO_FABRICATED_SOURCE]).expect("set")
        );
        let r = v.result(NO_FABRICATED_SOURCE).expect("result");
        assert_eq!(evidence(r, "unmatched_count"), Some("1"));
        assert_eq!(
            evidence(r, "unmatched_sha256_16"),
            Some(url_digest("https://elsewhere.example").as_str())
        );
    }

    // --- configuration -----------------------------------------------------------------------

    #[test]
    fn config_defaults_and_serde() {
        let c: SafetyConfig = serde_json::from_value(json!({})).expect("defaults");
        assert_eq!(c, SafetyConfig::default());
        assert_eq!(c.mode, SafetyMode::Observe);
        assert!(!c.require_runtime_checkable);
        assert_eq!(c.pack(), SafetyPack::v1());
        let c = c.validate().expect("valid");
        assert!(!c.safety_check().require_runtime_checkable);

        let c: SafetyConfig = serde_json::from_value(
            json!({"mode": "enforce", "boundaries": ["no_fabricated_source"]}),
        )
        .expect("parses");
        assert_eq!(c.mode, SafetyMode::Enforce);
        assert!(serde_json::from_value::<SafetyConfig>(json!({"mode": "hard"})).is_err());
        assert!(serde_json::from_value::<SafetyConfig>(json!({"modes": "observe"})).is_err());
    }

    #[test]
    fn config_validation_names_the_key() {
        let bad = |c: SafetyConfig| c.validate().expect_err("invalid");
        let e = bad(SafetyConfig {
            boundaries: vec![],
            ..SafetyConfig::default()
        });
        assert_eq!(e.key, "boundaries");
        assert!(e.to_string().starts_with("invalid safety.boundaries: "));
        let e = bad(SafetyConfig {
            boundaries: vec!["a".into(), "a".into()],
            ..SafetyConfig::default()
        });
        assert!(e.reason.contains("twice"));
        let e = bad(SafetyConfig {
            boundaries: vec!["has space".into()],
            ..SafetyConfig::default()
        });
        assert_eq!(e.key, "boundaries");
        let e = bad(SafetyConfig {
            pack_id: String::new(),
            ..SafetyConfig::default()
        });
        assert_eq!(e.key, "pack_id");
        let e = bad(SafetyConfig {
            mode: SafetyMode::Enforce,
            require_runtime_checkable: true,
            ..SafetyConfig::default()
        });
        assert_eq!(e.key, "require_runtime_checkable");
        assert!(
            e.reason.contains(NO_HOT_PATH_REPAIR) && e.reason.contains(PRESERVE_VERSOR_CLOSURE)
        );
        // Fine without the never-checkable ones, and in observe mode.
        SafetyConfig {
            mode: SafetyMode::Enforce,
            require_runtime_checkable: true,
            boundaries: vec![NO_FABRICATED_SOURCE.into(), NO_SILENT_CORRECTION.into()],
            ..SafetyConfig::default()
        }
        .validate()
        .expect("valid");
        SafetyConfig {
            require_runtime_checkable: true,
            ..SafetyConfig::default()
        }
        .validate()
        .expect("valid");
    }

    #[test]
    fn enforce_trips_with_safety_boundary_violated_observe_never() {
        let violated = SafetyCheck::new().check(
            &SafetyContext {
                last_refusal_was_typed: Some(false),
                ..SafetyContext::default()
            },
            &SafetyPack::v1(),
        );
        let clean = SafetyCheck::new().check(&full_ctx(), &SafetyPack::v1());
        let enforce = SafetyConfig {
            mode: SafetyMode::Enforce,
            ..SafetyConfig::default()
        };
        assert_eq!(
            enforce.trip_code(&violated),
            Some(FailureCode::SafetyBoundaryViolated)
        );
        assert_eq!(enforce.trip_code(&clean), None);
        assert_eq!(SafetyConfig::default().trip_code(&violated), None);
    }

    proptest! {
        #[test]
        fn prop_extract_urls_is_total_and_well_formed(
            text in "(https?://|HTTP://|[ .,;:!?()\\[\\]<>\"'*_a-z0-9/#?=&]|\\PC){0,120}",
        ) {
            for u in extract_urls(&text) {
                prop_assert!(text.contains(&u));
                prop_assert!(scheme_len(&u).is_some());
                prop_assert!(!u.contains(char::is_whitespace));
                prop_assert!(!u.ends_with(['.', ',', ';', ':', '!', '?']));
            }
        }

        #[test]
        fn prop_urls_inside_prose_are_found(
            host in "[a-z]{1,10}\\.[a-z]{2,5}",
            path in "(/[A-Za-z0-9_-]{0,7}[A-Za-z0-9]){0,3}",
            before in "[ (\"\\[]",
            after in "[ .,;:!?)\"]?",
        ) {
            let url = format!("https://{host}{path}");
            let text = format!("see{before}{url}{after} more");
            let got = extract_urls(&text);
            prop_assert!(got.contains(&url), "{:?} in {:?}", got, text);
        }

        #[test]
        fn prop_normalize_is_idempotent(text in "([A-Za-z0-9@:/?#.]|:80|:443|\\PC){0,60}") {
            for u in extract_urls(&format!("x https://{text}")) {
                let n = normalize_url(&u);
                prop_assert_eq!(normalize_url(&n), n.clone());
            }
        }
    }
}
