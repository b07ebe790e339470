//! The typed read of one upstream chunk: serde visitors that walk the event's JSON once and
//! write what the proxy needs straight into a reused [`UpstreamChunk`], with no DOM.
//!
//! Reading the chunk into a `serde_json::Value` first cost a `BTreeMap` per object and a
//! `String` per key and per string on every token (a profile of the proxy put serde_json and
//! malloc at a fifth of the data plane's user time). Here each position of the chunk shape
//! has a visitor ([`Shape`]) that takes whatever JSON value is there and decides: the strings
//! it keeps are copied into the chunk's buffers (reused from the previous chunk, so the
//! steady state allocates nothing), and everything else is skipped.
//!
//! The read must accept and refuse exactly what reading a `Value` and then checking it did,
//! with the same errors, so:
//!
//! - every value, kept or skipped, goes through `deserialize_any` ([`Skip`]), as `Value`'s
//!   did: the same syntax, number range, string escape and nesting checks, in the same
//!   places, so a broken chunk gives the same `Json` error;
//! - a visitor never fails the parse for a value of the wrong kind: it records what is wrong
//!   and reads on, and each object checks its fields at its end in the order the `Value` code
//!   checked them, so that a syntax error anywhere wins over a shape error (as a `Value` parse
//!   failed before any check) and of several shape errors the same one is reported;
//! - a key given twice counts once, the last (a `Value` map kept the last): a field's outputs
//!   are reset each time its key is read.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use super::{ChunkError, UpToken, LOGPROB_EPSILON, NEG_INF_SENTINEL};
use crate::wire::{truncate_chars, MAX_TOP_LOGPROBS};

pub(super) const TOP_MAX: usize = MAX_TOP_LOGPROBS as usize;

/// Buffers a read needs besides the chunk, kept between reads.
#[derive(Debug, Default)]
pub(super) struct Scratch {
    /// Tokens no longer in `chunk.tokens`, kept with their buffers for the next chunks.
    pub(super) spare: Vec<UpToken>,
    /// The completions shape's tokens, built from three arrays.
    pub(super) comp: Vec<UpToken>,
    /// `delta.reasoning`, used when `delta.reasoning_content` is empty.
    pub(super) reasoning: String,
    /// Completions alternatives whose logprob was refused: (token, value as written).
    pub(super) bad_alts: Vec<(String, String)>,
}

/// What the chunk's top level was.
pub(super) enum Top {
    /// A chunk, read into the output.
    Chunk,
    /// An error object (`error` not null, or `object: "error"`): to read as an error.
    Error,
    /// Not a JSON object.
    NotObject,
}

/// A scalar JSON value, or the mark of an array or object.
#[derive(Clone, Copy)]
pub(super) enum Scalar<'s> {
    Null,
    Bool(bool),
    U64(u64),
    I64(i64),
    F64(f64),
    Str(&'s str),
    /// An array or object (already skipped).
    Compound,
}

impl Scalar<'_> {
    /// `Value::as_u64`.
    pub(super) fn as_u64(self) -> Option<u64> {
        match self {
            Scalar::U64(n) => Some(n),
            Scalar::I64(n) => u64::try_from(n).ok(),
            _ => None,
        }
    }
}

/// How one position of the chunk is read, by the kind of value found there.
pub(super) trait Shape<'de>: Sized {
    type Out;
    fn scalar(self, v: Scalar<'_>) -> Self::Out;
    fn map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Out, A::Error> {
        while map.next_key::<Skip>()?.is_some() {
            map.next_value::<Skip>()?;
        }
        Ok(self.scalar(Scalar::Compound))
    }
    fn seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Out, A::Error> {
        while seq.next_element::<Skip>()?.is_some() {}
        Ok(self.scalar(Scalar::Compound))
    }
}

/// A [`Shape`] as a serde seed and visitor: every value through `deserialize_any`.
pub(super) struct Any<S>(pub(super) S);

impl<'de, S: Shape<'de>> DeserializeSeed<'de> for Any<S> {
    type Value = S::Out;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<S::Out, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, S: Shape<'de>> Visitor<'de> for Any<S> {
    type Value = S::Out;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_unit<E>(self) -> Result<S::Out, E> {
        Ok(self.0.scalar(Scalar::Null))
    }
    fn visit_none<E>(self) -> Result<S::Out, E> {
        Ok(self.0.scalar(Scalar::Null))
    }
    fn visit_bool<E>(self, v: bool) -> Result<S::Out, E> {
        Ok(self.0.scalar(Scalar::Bool(v)))
    }
    fn visit_u64<E>(self, v: u64) -> Result<S::Out, E> {
        Ok(self.0.scalar(Scalar::U64(v)))
    }
    fn visit_i64<E>(self, v: i64) -> Result<S::Out, E> {
        Ok(self.0.scalar(Scalar::I64(v)))
    }
    fn visit_f64<E>(self, v: f64) -> Result<S::Out, E> {
        Ok(self.0.scalar(Scalar::F64(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<S::Out, E> {
        Ok(self.0.scalar(Scalar::Str(v)))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<S::Out, A::Error> {
        self.0.seq(seq)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<S::Out, A::Error> {
        self.0.map(map)
    }
}

/// Any value, checked as `Value` would check it, kept nowhere.
pub(super) struct Skip;

impl<'de> serde::Deserialize<'de> for Skip {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Any(SkipShape)).map(|()| Skip)
    }
}

struct SkipShape;

impl Shape<'_> for SkipShape {
    type Out = ();
    fn scalar(self, _: Scalar<'_>) {}
}

/// A map key, read (unescaped) for the length of a call.
pub(super) struct Key<F>(pub(super) F);

impl<'de, T, F: FnOnce(&str) -> T> DeserializeSeed<'de> for Key<F> {
    type Value = T;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
        d.deserialize_str(self)
    }
}

impl<T, F: FnOnce(&str) -> T> Visitor<'_> for Key<F> {
    type Value = T;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a key")
    }
    fn visit_str<E>(self, v: &str) -> Result<T, E> {
        Ok((self.0)(v))
    }
}

/// The next key of `map`, as the index of `names` it is (`names.len()` for any other).
pub(super) fn next_field<'de, A: MapAccess<'de>>(
    map: &mut A,
    names: &[&str],
) -> Result<Option<usize>, A::Error> {
    map.next_key_seed(Key(|k: &str| {
        names.iter().position(|n| *n == k).unwrap_or(names.len())
    }))
}

/// `s` into `dst`, reusing its buffer.
pub(super) fn set(dst: &mut String, s: &str) {
    dst.clear();
    dst.push_str(s);
}

/// `s` cut to `max` characters into `dst` (`truncate_chars`, without allocating).
pub(super) fn set_opt_chars(dst: &mut Option<String>, s: Option<&str>, max: usize) {
    match s {
        Some(s) => {
            let s = s.char_indices().nth(max).map_or(s, |(i, _)| &s[..i]);
            set(dst.get_or_insert_with(String::new), s);
        }
        None => *dst = None,
    }
}

/// Slot `i` of `v` (the next one, or one already there), reusing a spare token's buffers.
/// A new slot's text is empty and its logprob `None`; its alternatives are left for the
/// reader of `top_logprobs` to overwrite (clearing them would free their strings).
pub(super) fn token_slot<'v>(
    v: &'v mut Vec<UpToken>,
    spare: &mut Vec<UpToken>,
    i: usize,
) -> &'v mut UpToken {
    if i == v.len() {
        let mut t = spare.pop().unwrap_or_default();
        t.text.clear();
        t.logprob = None;
        v.push(t);
    }
    &mut v[i]
}

/// Ends `v` after `used` tokens; the rest go to `spare`.
pub(super) fn keep_tokens(v: &mut Vec<UpToken>, spare: &mut Vec<UpToken>, used: usize) {
    if v.len() > used {
        spare.extend(v.drain(used..));
    }
}

/// Slot `i` of an alternatives list, reusing the string of one already there.
pub(super) fn alt_slot(v: &mut Vec<(String, f32)>, i: usize) -> &mut (String, f32) {
    if i == v.len() {
        v.push((String::new(), 0.0));
    }
    &mut v[i]
}

/// `truncate_chars(&value.to_string(), 32)`: how a refused logprob is quoted.
fn excerpt(v: &Value) -> String {
    truncate_chars(&v.to_string(), 32)
}

fn scalar_value(v: Scalar<'_>) -> Value {
    match v {
        Scalar::Null | Scalar::Compound => Value::Null,
        Scalar::Bool(b) => Value::Bool(b),
        Scalar::U64(n) => n.into(),
        Scalar::I64(n) => n.into(),
        Scalar::F64(x) => x.into(),
        Scalar::Str(s) => s.into(),
    }
}

/// A logprob: `Ok(None)` for null; `Err` holds the refused value as the error quotes it.
pub(super) struct Logprob;

impl<'de> Shape<'de> for Logprob {
    type Out = Result<Option<f32>, String>;
    fn scalar(self, v: Scalar<'_>) -> Self::Out {
        let x = match v {
            Scalar::Null => return Ok(None),
            Scalar::U64(n) => n as f64,
            Scalar::I64(n) => n as f64,
            Scalar::F64(x) => x,
            other => return Err(excerpt(&scalar_value(other))),
        };
        if x.is_nan() || x > LOGPROB_EPSILON {
            Err(x.to_string())
        } else if x <= NEG_INF_SENTINEL {
            Ok(Some(f32::NEG_INFINITY))
        } else {
            // `as` saturates: a finite f64 below f32::MIN becomes -inf, which it is in effect.
            Ok(Some(x.min(0.0) as f32))
        }
    }
    // A refused array or object is quoted: read it whole (an error path).
    fn map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Out, A::Error> {
        let v: Value =
            serde::Deserialize::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
        Ok(Err(excerpt(&v)))
    }
    fn seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Out, A::Error> {
        let v: Value =
            serde::Deserialize::deserialize(serde::de::value::SeqAccessDeserializer::new(seq))?;
        Ok(Err(excerpt(&v)))
    }
}

/// A refused logprob at `field`.
pub(super) fn bad_logprob(field: String, value: String) -> ChunkError {
    ChunkError::BadLogprob { field, value }
}

/// A string kept in `dst` (null: empty); `false` when the value is another kind.
pub(super) struct TextInto<'o>(pub(super) &'o mut String);

impl Shape<'_> for TextInto<'_> {
    type Out = bool;
    fn scalar(self, v: Scalar<'_>) -> bool {
        self.0.clear();
        match v {
            Scalar::Null => true,
            Scalar::Str(s) => {
                self.0.push_str(s);
                true
            }
            _ => false,
        }
    }
}

/// A string read for the length of a call (`None` for any other kind).
pub(super) struct StrWith<F>(F);

impl<T, F: FnOnce(Option<&str>) -> T> Shape<'_> for StrWith<F> {
    type Out = T;
    fn scalar(self, v: Scalar<'_>) -> T {
        match v {
            Scalar::Str(s) => (self.0)(Some(s)),
            _ => (self.0)(None),
        }
    }
}

/// [`StrWith`] as a seed (the bound makes the closure take a string of any lifetime).
pub(super) fn str_with<T, F: FnOnce(Option<&str>) -> T>(f: F) -> Any<StrWith<F>> {
    Any(StrWith(f))
}

/// [`Kind`] as a seed (the bound makes the closure take a value of any lifetime).
pub(super) fn kind<T, F: FnOnce(Scalar<'_>) -> T>(f: F) -> Any<Kind<F>> {
    Any(Kind(f))
}

/// A value that is only looked at as a scalar (`Compound` for an array or object).
pub(super) struct Kind<F>(F);

impl<T, F: FnOnce(Scalar<'_>) -> T> Shape<'_> for Kind<F> {
    type Out = T;
    fn scalar(self, v: Scalar<'_>) -> T {
        (self.0)(v)
    }
}
