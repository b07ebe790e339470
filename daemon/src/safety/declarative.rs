//! Declarative predicates (`[[safety.predicates]]`): an operator's boundary check, written in
//! the config file, over one field of the check context, without a rebuild.
//!
//! ```toml
//! [[safety.predicates]]
//! name = "answered_by_gpt_4o"           # the boundary id it judges
//! field = "model_answered"              # a field of the check context (Field)
//! op = "matches"                        # max min equals not_equals matches not_matches contains not_contains
//! value = "^gpt-4o(-[0-9]{4}-[0-9]{2}-[0-9]{2})?$"
//! ```
//!
//! Everything is checked at start like user input: an unknown field or operator, an operator
//! the field's type does not take, a value of the wrong type, a bad regex, a bad or duplicate
//! name: each a [`SafetyConfigError`] naming `predicates[i].<key>`. A field the turn did not
//! provide makes the check not checkable (absence of evidence, as for the v1 predicates).

use regex_automata::meta::Regex;
use serde::{Deserialize, Serialize};

use super::{SafetyCheckResult, SafetyConfigError, SafetyContext};

/// A field of the check context a declarative predicate reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    /// The model the request named (`identity_before`).
    ModelRequested,
    /// The model the backend answered as (`identity_after`).
    ModelAnswered,
    /// The system prompt the turn was answered under is not the one requested.
    SystemPromptChanged,
    /// How many source URLs the request gave.
    RequestSourceCount,
    /// How many URLs the output cited.
    CitedUrlCount,
    /// How many cited URLs are not among the request's sources.
    UnmatchedSourceCount,
    /// Bytes of text the model produced.
    ProducedBytes,
    /// Bytes of that text haltd sent.
    SentBytes,
    /// The turn completed (not halted).
    TextCompleted,
    /// The field state's versor condition.
    VersorCondition,
}

/// The type of a [`Field`]'s value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Number,
    Text,
    Bool,
}

impl Field {
    pub const ALL: [Field; 10] = [
        Field::ModelRequested,
        Field::ModelAnswered,
        Field::SystemPromptChanged,
        Field::RequestSourceCount,
        Field::CitedUrlCount,
        Field::UnmatchedSourceCount,
        Field::ProducedBytes,
        Field::SentBytes,
        Field::TextCompleted,
        Field::VersorCondition,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Field::ModelRequested => "model_requested",
            Field::ModelAnswered => "model_answered",
            Field::SystemPromptChanged => "system_prompt_changed",
            Field::RequestSourceCount => "request_source_count",
            Field::CitedUrlCount => "cited_url_count",
            Field::UnmatchedSourceCount => "unmatched_source_count",
            Field::ProducedBytes => "produced_bytes",
            Field::SentBytes => "sent_bytes",
            Field::TextCompleted => "text_completed",
            Field::VersorCondition => "versor_condition",
        }
    }

    fn kind(self) -> Kind {
        match self {
            Field::ModelRequested | Field::ModelAnswered => Kind::Text,
            Field::SystemPromptChanged | Field::TextCompleted => Kind::Bool,
            _ => Kind::Number,
        }
    }

    /// The field's value in `ctx`, if the turn provided it.
    fn read(self, ctx: &SafetyContext) -> Option<Value> {
        let count = |n: usize| Value::Number(n as f64);
        let (before, after) = (ctx.identity_before.as_ref(), ctx.identity_after.as_ref());
        let urls = ctx
            .request_source_urls
            .as_ref()
            .zip(ctx.cited_urls.as_ref());
        let d = ctx.text_delivery.as_ref();
        match self {
            Field::ModelRequested => before.map(|i| Value::Text(i.model.clone())),
            Field::ModelAnswered => after.map(|i| Value::Text(i.model.clone())),
            Field::SystemPromptChanged => before
                .zip(after)
                .map(|(b, a)| Value::Bool(b.system_prompt_sha256 != a.system_prompt_sha256)),
            Field::RequestSourceCount => ctx.request_source_urls.as_ref().map(|s| count(s.len())),
            Field::CitedUrlCount => ctx.cited_urls.as_ref().map(|s| count(s.len())),
            Field::UnmatchedSourceCount => urls.map(|(a, c)| count(c.difference(a).count())),
            Field::ProducedBytes => d.map(|d| count(d.produced_bytes)),
            Field::SentBytes => d.map(|d| count(d.sent_bytes)),
            Field::TextCompleted => d.map(|d| Value::Bool(d.completed)),
            Field::VersorCondition => ctx.versor_condition.map(Value::Number),
        }
    }
}

/// A value read from the context, or given in the config.
#[derive(Clone, Debug, PartialEq)]
enum Value {
    Number(f64),
    Text(String),
    Bool(bool),
}

impl std::fmt::Display for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::Number(n) => write!(f, "{n}"),
            Value::Text(s) => write!(f, "{s:?}"),
            Value::Bool(b) => write!(f, "{b}"),
        }
    }
}

/// The comparison of a declarative predicate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Upheld while the field is at most the value.
    Max,
    /// Upheld while the field is at least the value.
    Min,
    Equals,
    NotEquals,
    /// Upheld while the field matches the regex (unanchored, as `grep -E`).
    Matches,
    NotMatches,
    /// Upheld while the field contains the value.
    Contains,
    NotContains,
}

impl Op {
    pub const ALL: [Op; 8] = [
        Op::Max,
        Op::Min,
        Op::Equals,
        Op::NotEquals,
        Op::Matches,
        Op::NotMatches,
        Op::Contains,
        Op::NotContains,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Op::Max => "max",
            Op::Min => "min",
            Op::Equals => "equals",
            Op::NotEquals => "not_equals",
            Op::Matches => "matches",
            Op::NotMatches => "not_matches",
            Op::Contains => "contains",
            Op::NotContains => "not_contains",
        }
    }

    /// Whether the op takes a field of this kind.
    fn takes(self, kind: Kind) -> bool {
        match self {
            Op::Max | Op::Min => kind == Kind::Number,
            Op::Equals | Op::NotEquals => true,
            _ => kind == Kind::Text,
        }
    }
}

/// A `[[safety.predicates]]` entry as written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PredicateSpec {
    /// The boundary id it judges: a new boundary, or, with `replace = true`, a v1 one whose
    /// default predicate it replaces.
    pub name: String,
    #[serde(default)]
    pub replace: bool,
    pub field: String,
    pub op: String,
    pub value: SpecValue,
}

/// A config value: TOML's integer, float, boolean or string.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SpecValue {
    Bool(bool),
    Int(i64),
    Float(f64),
    Text(String),
}

/// The check a declarative predicate makes, compiled.
#[derive(Clone, Debug)]
enum Check {
    Max(f64),
    Min(f64),
    Equals(Value),
    NotEquals(Value),
    Matches(Regex, String),
    NotMatches(Regex, String),
    Contains(String),
    NotContains(String),
}

/// A validated declarative predicate.
#[derive(Clone, Debug)]
pub struct Declarative {
    pub name: String,
    pub replace: bool,
    field: Field,
    check: Check,
}

fn spec_err(i: usize, key: &str, reason: impl Into<String>) -> SafetyConfigError {
    SafetyConfigError {
        key: format!("predicates[{i}].{key}"),
        reason: reason.into(),
    }
}

fn parse_value(i: usize, field: Field, v: &SpecValue) -> Result<Value, SafetyConfigError> {
    let want = match field.kind() {
        Kind::Number => "a number",
        Kind::Text => "a string",
        Kind::Bool => "true or false",
    };
    #[expect(
        clippy::cast_precision_loss,
        reason = "config numbers are counts and limits far below 2^53"
    )]
    let value = match (field.kind(), v) {
        (Kind::Number, SpecValue::Int(n)) => Value::Number(*n as f64),
        (Kind::Number, SpecValue::Float(x)) if x.is_finite() => Value::Number(*x),
        (Kind::Text, SpecValue::Text(s)) => Value::Text(s.clone()),
        (Kind::Bool, SpecValue::Bool(b)) => Value::Bool(*b),
        _ => {
            return Err(spec_err(
                i,
                "value",
                format!("{} takes {want}, got {v:?}", field.as_str()),
            ))
        }
    };
    Ok(value)
}

impl Declarative {
    /// Validates entry `i` of `[[safety.predicates]]` (its name is checked by the caller).
    pub fn compile(i: usize, spec: &PredicateSpec) -> Result<Self, SafetyConfigError> {
        let field = Field::ALL
            .into_iter()
            .find(|f| f.as_str() == spec.field)
            .ok_or_else(|| {
                let known: Vec<&str> = Field::ALL.iter().map(|f| f.as_str()).collect();
                spec_err(
                    i,
                    "field",
                    format!(
                        "unknown field {:?} (known: {})",
                        spec.field,
                        known.join(", ")
                    ),
                )
            })?;
        let op = Op::ALL
            .into_iter()
            .find(|o| o.as_str() == spec.op)
            .ok_or_else(|| {
                let known: Vec<&str> = Op::ALL.iter().map(|o| o.as_str()).collect();
                spec_err(
                    i,
                    "op",
                    format!("unknown op {:?} (known: {})", spec.op, known.join(", ")),
                )
            })?;
        if !op.takes(field.kind()) {
            return Err(spec_err(
                i,
                "op",
                format!(
                    "{} does not apply to {} ({:?})",
                    op.as_str(),
                    field.as_str(),
                    field.kind()
                ),
            ));
        }
        let value = parse_value(i, field, &spec.value)?;
        let text = |v: Value| match v {
            Value::Text(s) => s,
            other => other.to_string(),
        };
        let regex = |s: &str| {
            Regex::new(s).map_err(|e| spec_err(i, "value", format!("bad regex {s:?}: {e}")))
        };
        let check = match (op, value) {
            (Op::Max, Value::Number(n)) => Check::Max(n),
            (Op::Min, Value::Number(n)) => Check::Min(n),
            (Op::Equals, v) => Check::Equals(v),
            (Op::NotEquals, v) => Check::NotEquals(v),
            (Op::Matches, v) => {
                let s = text(v);
                Check::Matches(regex(&s)?, s)
            }
            (Op::NotMatches, v) => {
                let s = text(v);
                Check::NotMatches(regex(&s)?, s)
            }
            (Op::Contains, v) => Check::Contains(text(v)),
            (Op::NotContains, v) => Check::NotContains(text(v)),
            (op, v) => {
                return Err(spec_err(
                    i,
                    "value",
                    format!("{} takes a number, got {v}", op.as_str()),
                ))
            }
        };
        Ok(Declarative {
            name: spec.name.clone(),
            replace: spec.replace,
            field,
            check,
        })
    }

    /// The predicate's result on `ctx`.
    pub fn evaluate(&self, ctx: &SafetyContext) -> SafetyCheckResult {
        let name = self.field.as_str();
        let Some(actual) = self.field.read(ctx) else {
            return SafetyCheckResult::not_checkable(
                self.name.as_str(),
                format!("not checkable: {name} not provided (absence of evidence is not evidence of violation)"),
            );
        };
        let (holds, want) = match (&self.check, &actual) {
            (Check::Max(m), Value::Number(n)) => (n <= m, format!("at most {m}")),
            (Check::Min(m), Value::Number(n)) => (n >= m, format!("at least {m}")),
            (Check::Equals(v), a) => (a == v, format!("equal to {v}")),
            (Check::NotEquals(v), a) => (a != v, format!("not equal to {v}")),
            (Check::Matches(r, s), Value::Text(t)) => (r.is_match(t), format!("matching /{s}/")),
            (Check::NotMatches(r, s), Value::Text(t)) => {
                (!r.is_match(t), format!("not matching /{s}/"))
            }
            (Check::Contains(s), Value::Text(t)) => {
                (t.contains(s.as_str()), format!("containing {s:?}"))
            }
            (Check::NotContains(s), Value::Text(t)) => {
                (!t.contains(s.as_str()), format!("not containing {s:?}"))
            }
            // `compile` pairs every op with a field of its type.
            _ => (false, "a value of another type (deny on error)".to_owned()),
        };
        let result = if holds {
            SafetyCheckResult::upheld(self.name.as_str(), format!("{name} is {want}"))
        } else {
            SafetyCheckResult::violated(
                self.name.as_str(),
                format!("{name} {actual} is not {want}"),
            )
        };
        result
            .with_evidence("field", name)
            .with_evidence("value", actual.to_string())
    }
}
