//! Canonical tool-call arguments: two calls whose arguments differ only in key order,
//! whitespace or the spacing inside string values are the same call.
//!
//! The rules (docs/tokencircuit.md, "Canonical arguments"):
//! * the arguments string is parsed as JSON; object keys are sorted, whitespace between
//!   tokens is dropped (serialized compactly);
//! * every string, object keys included, is put in Unicode NFC (a decomposed `é` is the
//!   composed one) and loses the invisible characters U+200B–U+200D (zero-width space and
//!   joiners), U+2060 (word joiner) and U+FEFF (zero-width no-break space);
//! * string values are trimmed and every run of whitespace inside them becomes one space;
//!   case is kept (identifiers are case-sensitive);
//! * an object member whose value is `null` is dropped: `{"x": null}` and `{}` are one call;
//! * a number with an integral value (`1.0`) is written as the integer (`1`);
//! * arguments that are not JSON are normalized like a string value and kept as text, so a
//!   malformed call still has a stable form.

use std::collections::BTreeMap;

use serde_json::{Map, Value};
use unicode_normalization::UnicodeNormalization;

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
            let sorted: BTreeMap<String, Value> = map
                .into_iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (visible_nfc(&k), normalize(v)))
                .collect();
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

/// The invisible characters canonical arguments drop: U+200B–U+200D, U+2060, U+FEFF.
fn invisible(c: char) -> bool {
    matches!(c, '\u{200B}'..='\u{200D}' | '\u{2060}' | '\u{FEFF}')
}

/// `s` in NFC, without the invisible characters.
fn visible_nfc(s: &str) -> String {
    s.chars().filter(|&c| !invisible(c)).nfc().collect()
}

/// NFC without the invisible characters, trimmed, each whitespace run collapsed to one space.
pub fn normalize_text(s: &str) -> String {
    let s = visible_nfc(s);
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

    /// Issue 29 point 6: three changes nobody sees were each a new call (a "repair").
    #[test]
    fn invisible_changes_are_the_same_call() {
        let a = CanonicalArgs::of(r#"{"city": "Montréal", "days": 2}"#);
        // A zero-width space, a word joiner and a BOM, in a value and in a key.
        assert_eq!(
            a,
            CanonicalArgs::of("{\"ci\u{200B}ty\": \"Mont\u{2060}réal\u{FEFF}\", \"days\": 2}")
        );
        assert_eq!(
            a,
            CanonicalArgs::of("{\"city\": \"Mont\u{200D}réal\", \"days\": 2}")
        );
        // The decomposed é (e + U+0301).
        assert_eq!(
            a,
            CanonicalArgs::of("{\"city\": \"Montre\u{301}al\", \"days\": 2}")
        );
        // A null member.
        assert_eq!(
            a,
            CanonicalArgs::of(r#"{"city": "Montréal", "days": 2, "unit": null}"#)
        );
        assert_eq!(CanonicalArgs::of(r#"{"x": null}"#), CanonicalArgs::of("{}"));
        // A null in an array is a value, not a missing member.
        assert_ne!(CanonicalArgs::of("[null]"), CanonicalArgs::of("[]"));
        assert_ne!(a, CanonicalArgs::of(r#"{"city": "Montreal", "days": 2}"#));
    }

    #[test]
    fn arguments_that_are_not_json_still_have_a_stable_form() {
        let a = CanonicalArgs::of("{id: 1 ");
        assert_eq!(a, CanonicalArgs::of("  {id:   1"));
        assert_eq!(a.value(), None);
        assert_ne!(a, CanonicalArgs::of(r#"{"id": 1}"#));
    }
}
