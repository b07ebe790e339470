//! The chunk's own levels (the top object, `usage`, `choices`, the first choice and its
//! `delta`), read from the entry point, [`read`], as [`super::de`] describes: fields checked
//! at their object's end, in the order the `Value` code checked them.

use serde::de::{DeserializeSeed, MapAccess, SeqAccess};
use serde_json::Value;

use super::{
    de::{
        keep_tokens, kind, next_field, set, set_opt_chars, str_with, Any, Scalar, Scratch, Shape,
        Skip, TextInto, Top,
    },
    logprobs::LogprobsShape,
    malformed, ChunkError, FinishReason, UpstreamChunk, Usage,
};
use crate::wire::Endpoint;

/// Reads `data` into `out`. `Err` is a `Json` error (the text is no JSON) or the first shape
/// error, as the `Value` code reported them.
pub(super) fn read(
    endpoint: Endpoint,
    data: &str,
    out: &mut UpstreamChunk,
    scratch: &mut Scratch,
) -> Result<Top, ChunkError> {
    let json = |e: serde_json::Error| ChunkError::Json {
        reason: e.to_string(),
    };
    let mut de = serde_json::Deserializer::from_str(data);
    let top = Any(ChunkShape {
        endpoint,
        out,
        scratch,
    })
    .deserialize(&mut de)
    .map_err(json)?;
    de.end().map_err(json)?;
    top
}

/// The top level: an object, else [`Top::NotObject`].
pub(super) struct ChunkShape<'o> {
    pub(super) endpoint: Endpoint,
    pub(super) out: &'o mut UpstreamChunk,
    pub(super) scratch: &'o mut Scratch,
}

/// What `choices` held.
enum Choices {
    /// Absent, `null` or `[]`.
    Empty,
    NotArray,
    /// `len` choices; the first one's checks.
    Array {
        len: usize,
        first: Result<(), ChunkError>,
    },
}

impl<'de> Shape<'de> for ChunkShape<'_> {
    type Out = Result<Top, ChunkError>;

    fn scalar(self, _: Scalar<'_>) -> Self::Out {
        Ok(Top::NotObject)
    }

    fn map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Out, A::Error> {
        const NAMES: [&str; 6] = ["id", "model", "usage", "choices", "error", "object"];
        let ChunkShape {
            endpoint,
            out,
            scratch,
        } = self;
        out.usage = None;
        reset_choice(out, scratch);
        // `id` and `model` keep their strings from the last chunk until known absent.
        let mut seen = [false; 2];
        let mut usage = None;
        let mut choices = Choices::Empty;
        let (mut error, mut object_error) = (false, false);
        while let Some(field) = next_field(&mut map, &NAMES)? {
            match field {
                0 | 1 => {
                    seen[field] = true;
                    let (dst, max) = match field {
                        0 => (&mut out.id, 128),
                        _ => (&mut out.model, 256),
                    };
                    map.next_value_seed(str_with(|s| set_opt_chars(dst, s, max)))?;
                }
                2 => usage = map.next_value_seed(Any(UsageShape))?,
                3 => {
                    choices = map.next_value_seed(Any(ChoicesShape {
                        endpoint,
                        out: &mut *out,
                        scratch: &mut *scratch,
                    }))?;
                }
                4 => error = map.next_value_seed(kind(|v| !matches!(v, Scalar::Null)))?,
                5 => object_error = map.next_value_seed(str_with(|s| s == Some("error")))?,
                _ => {
                    map.next_value::<Skip>()?;
                }
            }
        }
        for (seen, dst) in seen.into_iter().zip([&mut out.id, &mut out.model]) {
            if !seen {
                *dst = None;
            }
        }
        if error || object_error {
            return Ok(Ok(Top::Error));
        }
        Ok(check_chunk(out, usage, choices).map(|()| Top::Chunk))
    }
}

/// The top level's checks, in the `Value` code's order.
fn check_chunk(
    out: &mut UpstreamChunk,
    usage: Option<Result<Usage, ChunkError>>,
    choices: Choices,
) -> Result<(), ChunkError> {
    out.usage = usage.transpose()?;
    match choices {
        Choices::NotArray => Err(malformed("choices is not an array")),
        Choices::Empty | Choices::Array { len: 0, .. } if out.usage.is_none() => {
            Err(malformed("chunk has no choices and no usage"))
        }
        Choices::Empty | Choices::Array { len: 0, .. } => Ok(()),
        Choices::Array { len, first } => {
            first?;
            out.extra_choices = len > 1;
            Ok(())
        }
    }
}

/// Everything the first choice sets, back to its default.
fn reset_choice(out: &mut UpstreamChunk, scratch: &mut Scratch) {
    out.role = false;
    out.content.clear();
    out.reasoning.clear();
    out.tool_calls = None;
    keep_tokens(&mut out.tokens, &mut scratch.spare, 0);
    out.finish_reason = None;
    out.choice_index = 0;
    out.extra_choices = false;
}

/// `usage`: `None` when absent or null.
struct UsageShape;

impl<'de> Shape<'de> for UsageShape {
    type Out = Option<Result<Usage, ChunkError>>;

    fn scalar(self, v: Scalar<'_>) -> Self::Out {
        match v {
            Scalar::Null => None,
            _ => Some(Err(malformed("usage is not an object"))),
        }
    }

    fn map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Out, A::Error> {
        const NAMES: [&str; 2] = ["prompt_tokens", "completion_tokens"];
        let mut counts = [None; 2];
        while let Some(field) = next_field(&mut map, &NAMES)? {
            match counts.get_mut(field) {
                Some(c) => *c = map.next_value_seed(kind(|v| v.as_u64()))?,
                None => {
                    map.next_value::<Skip>()?;
                }
            }
        }
        let count = |i: usize| {
            counts[i].ok_or_else(|| {
                malformed(format!("usage.{} is not a non-negative integer", NAMES[i]))
            })
        };
        Ok(Some(count(0).and_then(|prompt_tokens| {
            Ok(Usage {
                prompt_tokens,
                completion_tokens: count(1)?,
            })
        })))
    }
}

/// `choices`: the first one read, the others skipped and counted.
struct ChoicesShape<'o> {
    endpoint: Endpoint,
    out: &'o mut UpstreamChunk,
    scratch: &'o mut Scratch,
}

impl<'de> Shape<'de> for ChoicesShape<'_> {
    type Out = Choices;

    fn scalar(self, v: Scalar<'_>) -> Choices {
        reset_choice(self.out, self.scratch);
        match v {
            Scalar::Null => Choices::Empty,
            _ => Choices::NotArray,
        }
    }

    fn seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Choices, A::Error> {
        reset_choice(self.out, self.scratch);
        let first = seq.next_element_seed(Any(ChoiceShape {
            endpoint: self.endpoint,
            out: self.out,
            scratch: self.scratch,
        }))?;
        let Some(first) = first else {
            return Ok(Choices::Empty);
        };
        let mut len = 1;
        while seq.next_element::<Skip>()?.is_some() {
            len += 1;
        }
        Ok(Choices::Array { len, first })
    }
}

/// `choices[0]`.
struct ChoiceShape<'o> {
    endpoint: Endpoint,
    out: &'o mut UpstreamChunk,
    scratch: &'o mut Scratch,
}

impl<'de> Shape<'de> for ChoiceShape<'_> {
    type Out = Result<(), ChunkError>;

    fn scalar(self, _: Scalar<'_>) -> Self::Out {
        Err(malformed("choices[0] is not an object"))
    }

    fn map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Out, A::Error> {
        const NAMES: [&str; 5] = ["index", "finish_reason", "delta", "text", "logprobs"];
        let ChoiceShape {
            endpoint,
            out,
            scratch,
        } = self;
        let mut index = Ok(0);
        let mut finish = Ok(None);
        let mut body = Ok(());
        let mut logprobs = Ok(());
        while let Some(field) = next_field(&mut map, &NAMES)? {
            match (field, endpoint.request_shape()) {
                (0, _) => index = map.next_value_seed(kind(read_index))?,
                (1, _) => finish = map.next_value_seed(kind(read_finish))?,
                (2, Endpoint::Chat) => {
                    body = map.next_value_seed(Any(DeltaShape {
                        out: &mut *out,
                        reasoning: &mut scratch.reasoning,
                    }))?;
                }
                (3, Endpoint::Completion) => {
                    body = map
                        .next_value_seed(Any(TextInto(&mut out.content)))?
                        .then_some(())
                        .ok_or_else(|| malformed("choices[0].text is not a string"));
                }
                (4, _) => {
                    logprobs = map.next_value_seed(Any(LogprobsShape {
                        tokens: &mut out.tokens,
                        scratch: &mut *scratch,
                    }))?;
                }
                _ => {
                    map.next_value::<Skip>()?;
                }
            }
        }
        Ok((|| {
            out.choice_index =
                index.map_err(|()| malformed("choices[0].index is not a non-negative integer"))?;
            out.finish_reason =
                finish.map_err(|()| malformed("choices[0].finish_reason is not a string"))?;
            body?;
            logprobs
        })())
    }
}

fn read_index(v: Scalar<'_>) -> Result<u32, ()> {
    match v {
        Scalar::Null => Ok(0),
        v => v.as_u64().and_then(|i| u32::try_from(i).ok()).ok_or(()),
    }
}

fn read_finish(v: Scalar<'_>) -> Result<Option<FinishReason>, ()> {
    match v {
        Scalar::Null => Ok(None),
        Scalar::Str(s) => Ok(Some(FinishReason::from_wire(s))),
        _ => Err(()),
    }
}

/// `choices[0].delta` (chat).
struct DeltaShape<'o> {
    out: &'o mut UpstreamChunk,
    /// `delta.reasoning`, kept apart until `reasoning_content` is known to be empty.
    reasoning: &'o mut String,
}

impl DeltaShape<'_> {
    fn reset(&mut self) {
        self.out.role = false;
        self.out.content.clear();
        self.out.reasoning.clear();
        self.out.tool_calls = None;
        self.reasoning.clear();
    }
}

impl<'de> Shape<'de> for DeltaShape<'_> {
    type Out = Result<(), ChunkError>;

    fn scalar(mut self, v: Scalar<'_>) -> Self::Out {
        self.reset();
        match v {
            Scalar::Null => Ok(()),
            _ => Err(malformed("choices[0].delta is not an object")),
        }
    }

    fn map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<Self::Out, A::Error> {
        const NAMES: [&str; 5] = [
            "role",
            "content",
            "reasoning_content",
            "reasoning",
            "tool_calls",
        ];
        self.reset();
        let DeltaShape { out, reasoning } = self;
        let mut ok = [true; 3];
        while let Some(field) = next_field(&mut map, &NAMES)? {
            match field {
                0 => out.role = map.next_value_seed(str_with(|s| s.is_some()))?,
                1 => ok[0] = map.next_value_seed(Any(TextInto(&mut out.content)))?,
                2 => ok[1] = map.next_value_seed(Any(TextInto(&mut out.reasoning)))?,
                3 => ok[2] = map.next_value_seed(Any(TextInto(&mut *reasoning)))?,
                // Rare (tool-call chunks): kept as a value for the framing and the record.
                4 => out.tool_calls = Some(map.next_value::<Value>()?).filter(|t| !t.is_null()),
                _ => {
                    map.next_value::<Skip>()?;
                }
            }
        }
        let at = |k: &str| malformed(format!("choices[0].delta.{k} is not a string"));
        Ok((|| {
            if !ok[0] {
                return Err(at("content"));
            }
            if !ok[1] {
                return Err(at("reasoning_content"));
            }
            if out.reasoning.is_empty() {
                if !ok[2] {
                    return Err(at("reasoning"));
                }
                set(&mut out.reasoning, reasoning);
            }
            Ok(())
        })())
    }
}
