//! Canonical tool-call arguments: two calls whose arguments differ only in key order,
//! whitespace or the spacing inside string values are the same call.
//!
//! The rules (docs/tokencircuit.md, "Canonical arguments"):
//! * the arguments string is parsed as JSON; object keys are sorted, whitespace between
//!   tokens is dropped (serialized compactly);
//! * string values are trimmed and every run of whitespace inside them becomes one space;
//!   case is kept (identifiers are case-sensitive);
//! * a number with an integral value (`1.0`) is written as the integer (`1`);
//! * arguments that are not JSON are normalized like a string value and kept as text, so a
//!   malformed call still has a stable form.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

/// The canonical form of a call's arguments.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CanonicalArgs(String);

impl CanonicalArgs {
    /// Canonicalizes the `arguments` string of a tool call.
    pub fn of(arguments: &str) -> Self {
        match serde_json::from_str::<Value>(arguments) {
            Ok(value) => CanonicalArgs(normalize(value).to_string()),
            Err(_) => CanonicalArgs(format!("!{}", normalize_text(arguments))),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The parsed, normalized arguments (`None` for arguments that are not JSON).
    pub fn value(&self) -> Option<Value> {
        serde_json::from_str(&self.0).ok()
    }
}

/// Normalizes a JSON value: sorted keys, normalized strings and integral numbers. The keys
/// are sorted explicitly, so the form does not depend on serde_json's `preserve_order`.
pub fn normalize(value: Value) -> Value {
    match value {
        Value::String(s) => Value::String(normalize_text(&s)),
        Value::Number(n) => Value::Number(integral(&n).unwrap_or(n)),
        Value::Array(items) => Value::Array(items.into_iter().map(normalize).collect()),
        Value::Object(map) => {
            let sorted: BTreeMap<String, Value> =
                map.into_iter().map(|(k, v)| (k, normalize(v))).collect();
            Value::Object(sorted.into_iter().collect::<Map<String, Value>>())
        }
        other => other,
    }
}

/// A float with an integral value as an integer; `None` when it is not one.
fn integral(n: &serde_json::Number) -> Option<serde_json::Number> {
    if n.is_i64() || n.is_u64() {
        return None;
    }
    let f = n.as_f64()?;
    const LIMIT: f64 = 9_007_199_254_740_992.0; // 2^53: every integer below is exact
    (f.fract() == 0.0 && f.abs() < LIMIT).then(|| serde_json::Number::from(f as i64))
}

/// Trims and collapses each whitespace run to one space.
pub fn normalize_text(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for word in s.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(word);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        let a = CanonicalArgs::of(r#"{"b": 1, "a": {"y": "x  y", "x": [1.0, 2]}}"#);
        let b = CanonicalArgs::of("{\"a\":{\"x\":[1,2],\n \"y\":\" x y \"},\"b\":1.0}");
        assert_eq!(a, b);
        assert_eq!(a.as_str(), r#"{"a":{"x":[1,2],"y":"x y"},"b":1}"#);
    }

    #[test]
    fn a_changed_value_or_case_is_a_different_call() {
        let a = CanonicalArgs::of(r#"{"id": "Abc"}"#);
        assert_ne!(a, CanonicalArgs::of(r#"{"id": "abc"}"#));
        assert_ne!(a, CanonicalArgs::of(r#"{"id": "Abc", "limit": 1}"#));
    }

    #[test]
    fn arguments_that_are_not_json_still_have_a_stable_form() {
        let a = CanonicalArgs::of("{id: 1 ");
        assert_eq!(a, CanonicalArgs::of("  {id:   1"));
        assert_eq!(a.value(), None);
        assert_ne!(a, CanonicalArgs::of(r#"{"id": 1}"#));
    }
}
