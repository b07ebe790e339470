//! SafetyCheck (spec 004, ADR-0032): a registry of named predicates, one per safety-pack
//! boundary id, that turns what a turn provides ([`SafetyContext`]) into one auditable
//! [`SafetyVerdict`] for the turn record's `safety_verdict` field.
//!
//! This module is pure: no I/O, no clocks, no globals. The data plane fills a
//! [`SafetyContext`] (with [`request_sources`], [`extract_urls`], [`system_prompt`] and
//! [`identity::identity_digest`]), calls [`SafetyCheck::check`] and decides, from [`SafetyConfig`], what
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
//! | `no_fabricated_source` | cited URLs ⊆ request source URLs, after [`inputs::normalize_url`] | both sets are known |
//! | `no_silent_correction` | every byte sent is the byte the model produced there; a completed turn sent all of it (`delivery.rs`) | at most 256 KiB of produced text waits unsent |
//! | `no_identity_override` | identity digest as requested = as answered | both digests are known |
//! | `no_hot_path_repair` | nothing: a code-path boundary | never (static analysis and code review) |
//!
//! The flight recorder holds no prompt or output text, so evidence names URLs by
//! [`inputs::url_digest`] and counts, never by their text.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    panic::AssertUnwindSafe,
    sync::Arc,
};

use serde::{ser::SerializeStruct, Serialize, Serializer};

mod config;
mod declarative;
mod delivery;
mod identity;
mod inputs;
mod record;

pub use config::{SafetyConfig, SafetyConfigError, SafetyMode};
pub use declarative::Declarative;
pub use delivery::{no_silent_correction, TextDelivery, TextTrail};
#[cfg(test)]
use identity::identity_digest;
pub use identity::{ModelAliases, ModelIdentity};
pub use inputs::{extract_urls, request_sources, system_prompt, url_keys, UrlKeys};
#[cfg(test)]
use inputs::{normalize_url, url_digest};
pub use record::{context_from_record, RecordedInputs};

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

/// Whether haltd can ever check a v1 boundary at runtime with its default predicate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checkability {
    /// Runtime evidence decides it whenever the turn provides the inputs.
    Runtime,
    /// Never, for the reason given (the predicate's `reason`, verbatim).
    NotCheckable(&'static str),
}

/// Reason of `no_hot_path_repair` (never runtime-checkable).
pub const HOT_PATH_REPAIR_REASON: &str = "not runtime-checkable: a code-path boundary (no \
    normalisation or drift repair on the token hot path); enforced by static analysis and code \
    review, no runtime evidence exists";

/// Reason of `preserve_versor_closure` without a supplied condition (always, in haltd).
pub const VERSOR_CLOSURE_REASON: &str =
    "not checkable: haltd keeps no field state, so there is no versor_condition to read";

/// The v1 registry: each boundary and whether haltd can check it at runtime.
pub const V1_REGISTRY: [(&str, Checkability); 5] = [
    (NO_FABRICATED_SOURCE, Checkability::Runtime),
    (
        NO_HOT_PATH_REPAIR,
        Checkability::NotCheckable(HOT_PATH_REPAIR_REASON),
    ),
    (NO_IDENTITY_OVERRIDE, Checkability::Runtime),
    (NO_SILENT_CORRECTION, Checkability::Runtime),
    (
        PRESERVE_VERSOR_CLOSURE,
        Checkability::NotCheckable(VERSOR_CLOSURE_REASON),
    ),
];

/// Most URL digests one result lists in its evidence (the count is always complete).
const MAX_EVIDENCE_URLS: usize = 16;

// ---------------------------------------------------------------------------------------------
// Context, results, verdict
// ---------------------------------------------------------------------------------------------

/// What one turn provides to the predicates. Every field is optional: leave `None` what the
/// data plane does not know, and the predicates that need it say "not checkable".
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SafetyContext {
    /// The URLs the request gave the model as sources, as [`url_keys`]: [`request_sources`]
    /// of the client's body (message contents except the assistant's, the completions
    /// prompt, `sources`, `documents`). `Some(empty)` means "the request gave no sources",
    /// which is evidence.
    pub request_source_urls: Option<UrlKeys>,
    /// The URLs cited in the turn's output text, as [`url_keys`] of [`extract_urls`].
    pub cited_urls: Option<UrlKeys>,
    /// The text the model produced against the text haltd sent for it ([`TextTrail`]);
    /// `None` when the turn's text went past what is kept to compare.
    pub text_delivery: Option<TextDelivery>,
    /// The identity the client asked for: the request's `model` and its [`system_prompt`].
    /// Leave `None` when the request named no model.
    pub identity_before: Option<ModelIdentity>,
    /// The identity the turn was answered under: the `model` the token source reported (an
    /// upstream's chunks; `builtin` for the built-in source) and the [`system_prompt`] of the
    /// body haltd actually sent.
    pub identity_after: Option<ModelIdentity>,
    /// The field state's versor condition. haltd keeps no field state: always `None` there;
    /// the field exists for deployments that register a source of one.
    pub versor_condition: Option<f64>,
}

/// Which predicate judged a boundary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PredicateOrigin {
    /// haltd's default predicate of a v1 boundary.
    V1,
    /// An operator's declarative predicate (`[[safety.predicates]]`).
    Config,
    /// A predicate registered in code ([`SafetyCheck::register`]).
    #[default]
    Library,
    /// No predicate is registered for the boundary.
    None,
}

/// One boundary's result (spec 004 `SafetyCheckResult`).
#[derive(Clone, Debug, PartialEq)]
pub struct SafetyCheckResult {
    pub boundary_id: String,
    /// Which predicate judged it (set by [`SafetyCheck::check`]).
    pub predicate: PredicateOrigin,
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
            predicate: PredicateOrigin::default(),
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
    /// `{"boundary_id","predicate","status","upheld","runtime_checkable","reason",
    /// "evidence":[[k,v],..]}`.
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut s = serializer.serialize_struct("SafetyCheckResult", 7)?;
        s.serialize_field("boundary_id", &self.boundary_id)?;
        s.serialize_field("predicate", &self.predicate)?;
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
    /// v1 boundaries whose default predicate an operator's predicate replaced.
    pub replaced_boundaries: BTreeSet<String>,
    /// What the predicates read, as the record keeps it (`POST /admin/safety/check` judges
    /// a record again from it).
    pub inputs: RecordedInputs,
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

/// One registered predicate and where it came from.
#[derive(Clone)]
struct Registered {
    predicate: SafetyPredicate,
    origin: PredicateOrigin,
}

/// The registry of boundary predicates (spec 004 `SafetyCheck`).
#[derive(Clone)]
pub struct SafetyCheck {
    predicates: BTreeMap<String, Registered>,
    /// Deployment policy: a boundary not decided by runtime evidence (no predicate, or a
    /// predicate without evidence) counts as violated. Default `false` (spec 004).
    pub require_runtime_checkable: bool,
}

impl fmt::Debug for SafetyCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let entries: Vec<(&String, PredicateOrigin)> =
            self.predicates.iter().map(|(k, r)| (k, r.origin)).collect();
        f.debug_struct("SafetyCheck")
            .field("predicates", &entries)
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
    /// A registry with the five v1 default predicates (no model alias groups).
    pub fn new() -> Self {
        let mut check = Self::empty();
        check.register_v1(PRESERVE_VERSOR_CLOSURE, preserve_versor_closure);
        check.register_v1(NO_FABRICATED_SOURCE, no_fabricated_source);
        check.register_v1(NO_SILENT_CORRECTION, no_silent_correction);
        check.register_v1(NO_IDENTITY_OVERRIDE, no_identity_override);
        check.register_v1(NO_HOT_PATH_REPAIR, no_hot_path_repair);
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

    fn insert<F>(
        &mut self,
        id: String,
        predicate: F,
        origin: PredicateOrigin,
    ) -> Option<SafetyPredicate>
    where
        F: Fn(&SafetyContext) -> SafetyCheckResult + Send + Sync + 'static,
    {
        let entry = Registered {
            predicate: Arc::new(predicate),
            origin,
        };
        self.predicates.insert(id, entry).map(|r| r.predicate)
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
        self.insert(boundary_id.into(), predicate, PredicateOrigin::Library)
    }

    /// Registers haltd's own predicate of a v1 boundary.
    pub(crate) fn register_v1<F>(&mut self, boundary_id: &str, predicate: F)
    where
        F: Fn(&SafetyContext) -> SafetyCheckResult + Send + Sync + 'static,
    {
        self.insert(boundary_id.to_owned(), predicate, PredicateOrigin::V1);
    }

    /// Registers an operator's declarative predicate under its name.
    pub fn register_declarative(&mut self, d: Declarative) {
        let name = d.name.clone();
        self.insert(name, move |ctx| d.evaluate(ctx), PredicateOrigin::Config);
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
        let mut replaced_boundaries = BTreeSet::new();
        // `boundary_ids` is a BTreeSet: iteration is already lex order, without duplicates.
        for id in &pack.boundary_ids {
            let mut result = match self.predicates.get(id) {
                Some(r) => {
                    if r.origin != PredicateOrigin::V1 && V1_BOUNDARIES.contains(&id.as_str()) {
                        replaced_boundaries.insert(id.clone());
                    }
                    let mut result = run_predicate(id, &r.predicate, ctx);
                    result.predicate = r.origin;
                    result
                }
                None => {
                    unknown_boundaries.insert(id.clone());
                    let mut r = SafetyCheckResult::not_checkable(id.as_str(), NO_PREDICATE_REASON);
                    r.predicate = PredicateOrigin::None;
                    r
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
            replaced_boundaries,
            inputs: RecordedInputs::of(ctx),
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
        return SafetyCheckResult::not_checkable(id, VERSOR_CLOSURE_REASON);
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

/// `no_fabricated_source`: holds iff every cited URL, after [`inputs::normalize_url`], is one of the
/// request's source URLs after [`inputs::normalize_url`]. Checkable only when both sets are known; an
/// empty cited set holds, and citing anything when the request gave no source violates. The
/// evidence has the counts and the [`inputs::url_digest`]s of the unmatched URLs (at most 16).
pub fn no_fabricated_source(ctx: &SafetyContext) -> SafetyCheckResult {
    let id = NO_FABRICATED_SOURCE;
    let (allowed, cited) = match (&ctx.request_source_urls, &ctx.cited_urls) {
        (Some(a), Some(c)) => (a, c),
        (None, Some(_)) => return missing(id, "request_source_urls"),
        (Some(_), None) => return missing(id, "cited_urls"),
        (None, None) => return missing(id, "request_source_urls and cited_urls"),
    };
    // Keys are digests of the normal form: equal keys, equal normalised URLs.
    let unmatched: Vec<&String> = cited.difference(allowed).collect();
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
        let digests: Vec<&str> = unmatched
            .iter()
            .take(MAX_EVIDENCE_URLS)
            .map(|u| u.as_str())
            .collect();
        result = result.with_evidence("unmatched_sha256_16", digests.join(","));
    }
    result
}

/// `no_identity_override` without alias groups: see [`identity`] for what counts as the
/// same model; the config's registry passes its `model_aliases`.
pub fn no_identity_override(ctx: &SafetyContext) -> SafetyCheckResult {
    identity::no_identity_override(ctx, &ModelAliases::default())
}

/// `no_hot_path_repair`: a code-path boundary. No runtime evidence can prove or disprove it,
/// so it is never runtime-checkable, whatever the context holds.
pub fn no_hot_path_repair(_ctx: &SafetyContext) -> SafetyCheckResult {
    SafetyCheckResult::not_checkable(NO_HOT_PATH_REPAIR, HOT_PATH_REPAIR_REASON)
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod inputs_tests;

#[cfg(test)]
mod config_tests;

#[cfg(test)]
mod identity_tests;
