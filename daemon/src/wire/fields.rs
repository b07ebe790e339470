//! Reading a request body of a translated surface (the Messages API, the Responses API) field
//! by field: what haltd does with each top-level field ([`FieldRule`]), and the checked reads
//! both translations make, whose errors are 400s that start with the JSON path at fault
//! (`messages[2].content[0].type: ...`, `input[1].call_id: required`).
//!
//! A leaf of the wire layer: each surface's translation uses it, and it uses neither, so the
//! surfaces share one reading of a field (`null` counts as absent, as in the chat API) and
//! never import each other.

use std::fmt::Display;

use serde_json::{Map, Value};

use crate::wire::{http::HttpError, text::truncate_chars};

#[cfg(test)]
pub mod testing;

/// A JSON object of the client's body.
pub type Object = Map<String, Value>;

/// The most characters of a client's name or type quoted back in an error message.
pub const QUOTED_CHARS: usize = 64;

/// What haltd does with a top-level field of a translated request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldRule {
    /// Sent upstream as the chat field(s) said.
    Translated(&'static str),
    /// Checked, then left out of the chat body: why nothing the client asked for is lost.
    Accepted(&'static str),
    /// Refused with 400 (when not `null`): why haltd cannot honour it.
    Refused(&'static str),
}

/// A 400 whose message is `path: why`.
pub fn bad(path: &str, why: impl Display) -> HttpError {
    HttpError::bad_request(format!("{path}: {why}"))
}

/// A client's string as a short JSON string, for an error message.
pub fn quote(s: &str) -> String {
    Value::from(truncate_chars(s, QUOTED_CHARS)).to_string()
}

/// `path.name`, or `name` at the top level (`path` empty).
pub fn join(path: &str, name: &str) -> String {
    if path.is_empty() {
        name.to_owned()
    } else {
        format!("{path}.{name}")
    }
}

/// A field's value; `null` counts as absent.
pub fn field<'a>(obj: &'a Object, name: &str) -> Option<&'a Value> {
    obj.get(name).filter(|v| !v.is_null())
}

pub fn required<'a>(obj: &'a Object, name: &str, path: &str) -> Result<&'a Value, HttpError> {
    field(obj, name).ok_or_else(|| bad(&join(path, name), "required"))
}

pub fn as_object<'a>(v: &'a Value, path: &str) -> Result<&'a Object, HttpError> {
    v.as_object().ok_or_else(|| bad(path, "must be an object"))
}

pub fn as_str<'a>(v: &'a Value, path: &str) -> Result<&'a str, HttpError> {
    v.as_str().ok_or_else(|| bad(path, "must be a string"))
}

pub fn required_str<'a>(obj: &'a Object, name: &str, path: &str) -> Result<&'a str, HttpError> {
    as_str(required(obj, name, path)?, &join(path, name))
}

pub fn opt_str<'a>(obj: &'a Object, name: &str, path: &str) -> Result<Option<&'a str>, HttpError> {
    field(obj, name)
        .map(|v| as_str(v, &join(path, name)))
        .transpose()
}

pub fn opt_bool(obj: &Object, name: &str, path: &str) -> Result<Option<bool>, HttpError> {
    field(obj, name)
        .map(|v| {
            v.as_bool()
                .ok_or_else(|| bad(&join(path, name), "must be true or false"))
        })
        .transpose()
}

/// Refuses a member of `obj` not in `known`: one haltd does not know might change the turn.
pub fn only(obj: &Object, path: &str, known: &[&str]) -> Result<(), HttpError> {
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(bad(
            &join(path, &truncate_chars(k, QUOTED_CHARS)),
            "unknown field",
        )),
        None => Ok(()),
    }
}

/// Refuses a top-level field of `req` not in `fields`, and a refused one that is set.
pub fn check_fields(req: &Object, fields: &[(&str, FieldRule)]) -> Result<(), HttpError> {
    for (name, value) in req {
        match fields.iter().find(|(f, _)| f == name) {
            None => return Err(bad(&truncate_chars(name, QUOTED_CHARS), "unknown field")),
            Some((_, FieldRule::Refused(why))) if !value.is_null() => {
                return Err(bad(name, format!("not supported: {why}")))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// `v`, a string that must be one of `allowed`.
pub fn one_of<'a>(v: &'a Value, path: &str, allowed: &[&str]) -> Result<&'a str, HttpError> {
    let s = as_str(v, path)?;
    if allowed.contains(&s) {
        return Ok(s);
    }
    let quoted: Vec<String> = allowed.iter().map(|a| format!("\"{a}\"")).collect();
    let list = match quoted.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    };
    Err(bad(path, format!("must be {list}, not {}", quote(s))))
}

/// The most containers (objects and arrays) nested in one another that a body may have:
/// serde_json's recursion limit, the deepest body the chat path reads. A translation nests
/// some of the client's values one level deeper (a tool's schema under `function`), so a
/// client's body within the limit could become one past it.
pub const MAX_NESTING: usize = 127;

/// The translated `body` as it is, or a 400 when it nests deeper than [`MAX_NESTING`]: every
/// translation is a body the chat path could have received, which grounding's resume reads
/// again from its bytes.
pub fn within_nesting(body: Value) -> Result<Value, HttpError> {
    let depth = nesting(&body);
    if depth > MAX_NESTING {
        return Err(HttpError::bad_request(format!(
            "the request nests {depth} levels deep once translated to chat; at most {MAX_NESTING}"
        )));
    }
    Ok(body)
}

/// How many containers `v` nests: 0 for a scalar, 1 for `[]` or `{}`. Recursive, at most
/// one level past the limit of the parser that read `v` (translations add one level).
fn nesting(v: &Value) -> usize {
    let inner = |items: &mut dyn Iterator<Item = &Value>| items.map(nesting).max().unwrap_or(0);
    match v {
        Value::Array(a) => 1 + inner(&mut a.iter()),
        Value::Object(o) => 1 + inner(&mut o.values()),
        _ => 0,
    }
}
