//! What the request tests of every translated surface (Messages, Responses) check alike:
//! each field of the table does what its rule says, docs/wire-format.md's section lists the
//! table, its example is what haltd sends, and arbitrary JSON either translates into a chat
//! body or is refused naming a field. Each surface's tests keep what is its own.

use proptest::prelude::*;
use serde_json::Value;

use super::{FieldRule, QUOTED_CHARS};
use crate::wire::{endpoint::MAX_MAX_TOKENS, http::HttpError, text::truncate_chars};

/// `body` with the value at JSON pointer `at` set to `v` (the parent must exist).
pub fn with(mut body: Value, at: &str, v: Value) -> Value {
    let (parent, last) = at.rsplit_once('/').expect("a pointer");
    match body.pointer_mut(parent).expect("the parent exists") {
        Value::Object(o) => {
            o.insert(last.to_owned(), v);
        }
        Value::Array(a) => a[last.parse::<usize>().expect("an index")] = v,
        other => panic!("{at}: the parent is {other}"),
    }
    body
}

/// One surface's translation, its table of fields, and its section of docs/wire-format.md.
#[derive(Debug)]
pub struct Translation {
    pub to_chat: fn(&Value) -> Result<Value, HttpError>,
    pub fields: &'static [(&'static str, FieldRule)],
    /// The heading of the section, e.g. `Messages API requests`.
    pub section: &'static str,
}

impl Translation {
    /// The message of the 400 that refuses `body`.
    pub fn refusal(&self, body: &Value) -> String {
        let e = (self.to_chat)(body).expect_err("refused");
        assert_eq!((e.status, e.kind), (400, "invalid_request_error"), "{e:?}");
        e.message
    }

    /// Each line of `table`: the JSON pointer of the value set in `full`, the value (JSON),
    /// and how the refusal's message starts, separated by ` | `.
    pub fn check_refusals(&self, full: &Value, table: &str) {
        for case in table.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let [at, v, says] = case.splitn(3, " | ").collect::<Vec<_>>()[..] else {
                panic!("a case of three cells: {case}")
            };
            let v = serde_json::from_str(v).unwrap_or_else(|e| panic!("{case}: {e}"));
            let message = self.refusal(&with(full.clone(), at, v));
            assert!(message.starts_with(says), "{case}: {message}");
        }
    }

    /// Each field of the table set to `sample(name)` in `full`: translated or accepted as
    /// its rule says, or refused with the rule's reason (and `null` is absent); no field is
    /// listed twice.
    pub fn check_every_field(&self, full: &Value, sample: fn(&str) -> Value) {
        for (name, rule) in self.fields {
            let body = with(full.clone(), &format!("/{name}"), sample(name));
            match rule {
                FieldRule::Translated(_) | FieldRule::Accepted(_) => {
                    let r = (self.to_chat)(&body);
                    assert!(r.is_ok(), "{name}: {r:?}");
                }
                FieldRule::Refused(why) => {
                    assert_eq!(self.refusal(&body), format!("{name}: not supported: {why}"));
                    let absent = with(full.clone(), &format!("/{name}"), Value::Null);
                    assert!((self.to_chat)(&absent).is_ok(), "{name}: null is absent");
                }
            }
        }
        let names: Vec<&str> = self.fields.iter().map(|(n, _)| *n).collect();
        let mut unique = names.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "a field listed twice");
    }

    /// The surface's section of docs/wire-format.md.
    pub fn documented(&self) -> &'static str {
        const DOC: &str = include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/wire-format.md"
        ));
        let heading = format!("\n## {}\n", self.section);
        let section = DOC.split_once(&heading).expect("the section").1;
        section.split("\n## ").next().unwrap_or_default()
    }

    /// The section's table lists every field of the table, in its order, each saying what
    /// its rule does (`→ `, `accepted, not sent: ` or `400: `).
    pub fn check_documented_fields(&self) {
        let documented: Vec<(String, String)> = self
            .documented()
            .lines()
            .skip_while(|l| *l != "| field | haltd |")
            .skip(2)
            .take_while(|l| l.starts_with('|'))
            .map(|row| {
                let cells: Vec<&str> = row.trim_matches('|').splitn(2, '|').collect();
                let name = cells[0].trim().trim_matches('`').to_owned();
                (name, cells.get(1).map_or("", |c| c.trim()).to_owned())
            })
            .collect();
        let names: Vec<&str> = documented.iter().map(|(n, _)| n.as_str()).collect();
        let expected: Vec<&str> = self.fields.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, expected, "docs/wire-format.md's table of fields");
        for ((name, says), (_, rule)) in documented.iter().zip(self.fields) {
            let prefix = match rule {
                FieldRule::Translated(_) => "→ ",
                FieldRule::Accepted(_) => "accepted, not sent: ",
                FieldRule::Refused(_) => "400: ",
            };
            assert!(says.starts_with(prefix), "{name}: {says:?} for {rule:?}");
        }
    }

    /// The section's two JSON examples, a request and its chat body, agree with the
    /// translation.
    pub fn check_documented_example(&self) {
        let blocks: Vec<Value> = self
            .documented()
            .split("```json\n")
            .skip(1)
            .map(|b| {
                let json = b.split_once("```").expect("a closed block").0;
                serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {json}"))
            })
            .collect();
        let [request, chat] = &blocks[..] else {
            panic!("two examples, not {}", blocks.len())
        };
        let translated = (self.to_chat)(request).unwrap_or_else(|e| panic!("{request}: {e:?}"));
        assert_eq!(&translated, chat);
    }

    /// A refusal names a field of the table (its path's first step), an unknown field of
    /// the body, or the body itself.
    pub fn check_refusal(&self, body: &Value, e: &HttpError) -> Result<(), TestCaseError> {
        prop_assert_eq!(e.status, 400);
        if e.message == "request body must be a JSON object" {
            prop_assert!(!body.is_object());
            return Ok(());
        }
        let first = e.message.split([':', '.', '[']).next().unwrap_or_default();
        let obj = body.as_object().expect("an object");
        let unknown =
            |k: &String| e.message == format!("{}: unknown field", truncate_chars(k, QUOTED_CHARS));
        prop_assert!(
            self.fields.iter().any(|(f, _)| *f == first) || obj.keys().any(unknown),
            "{} names no field of {}",
            e.message,
            body
        );
        Ok(())
    }
}

/// What every translation gives: a model, a non-empty array of message objects, and a
/// token limit in range (which a surface may leave out unless `max_tokens_required`).
pub fn check_chat(chat: &Value, max_tokens_required: bool) -> Result<(), TestCaseError> {
    let obj = chat.as_object().expect("an object");
    prop_assert!(obj
        .get("model")
        .and_then(Value::as_str)
        .is_some_and(|m| !m.is_empty()));
    let messages = obj.get("messages").and_then(Value::as_array);
    prop_assert!(messages.is_some_and(|m| !m.is_empty() && m.iter().all(Value::is_object)));
    match obj.get("max_tokens") {
        Some(max) => prop_assert!(max
            .as_u64()
            .is_some_and(|n| (1..=u64::from(MAX_MAX_TOKENS)).contains(&n))),
        None => prop_assert!(!max_tokens_required, "no max_tokens"),
    }
    Ok(())
}

/// A key or string: one of `words` (the names a translation reads, so that generated
/// objects sometimes get past its checks), or a short arbitrary one.
pub fn word(words: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop_oneof![
        proptest::sample::select(words).prop_map(str::to_owned),
        "\\PC{0,6}",
    ]
}

/// Arbitrary JSON, leaning to `words`.
pub fn any_json(words: &'static [&'static str]) -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (0u64..2_000_000).prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        word(words).prop_map(Value::from),
    ];
    leaf.prop_recursive(5, 96, 6, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::vec((word(words), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}
