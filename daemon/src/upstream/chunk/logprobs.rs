//! `choices[0].logprobs` in its two shapes, read as [`super::de`] describes: the chat shape
//! (`content[] = {token, logprob, top_logprobs[]}`) straight into the chunk's tokens, the
//! completions shape (`tokens[]`, `token_logprobs[]`, `top_logprobs[]` of `{token: logprob}`)
//! into a scratch list first, since its three arrays may come in any order.

use serde::de::{MapAccess, SeqAccess};

use super::{
    de::{
        alt_slot, bad_logprob, keep_tokens, next_field, set, str_with, token_slot, Any, Key,
        Logprob, Scalar, Scratch, Shape, Skip, TOP_MAX,
    },
    malformed, ChunkError, UpToken,
};

const CHAT: &str = "choices[0].logprobs.content";
const COMP: &str = "choices[0].logprobs";

/// `choices[0].logprobs`: the tokens, into `tokens`.
pub(super) struct LogprobsShape<'o> {
    pub(super) tokens: &'o mut Vec<UpToken>,
    pub(super) scratch: &'o mut Scratch,
}

/// What one completions-shape array held.
#[derive(Default)]
enum Arr {
    /// Absent or `null`.
    #[default]
    Absent,
    NotArray,
    /// Its length, and its first element that is refused.
    Array {
        len: usize,
        first_bad: Option<(usize, ChunkError)>,
    },
}

impl<'de> Shape<'de> for LogprobsShape<'_> {
    type Out = Result<(), ChunkError>;

    fn scalar(self, v: Scalar<'_>) -> Self::Out {
        keep_tokens(self.tokens, &mut self.scratch.spare, 0);
        match v {
            Scalar::Null => Ok(()),
            _ => Err(malformed("choices[0].logprobs is not an object")),
        }
    }

    fn map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Out, A::Error> {
        const NAMES: [&str; 4] = ["content", "tokens", "token_logprobs", "top_logprobs"];
        let LogprobsShape { tokens, scratch } = self;
        let Scratch {
            spare,
            comp,
            bad_alts,
            ..
        } = scratch;
        keep_tokens(tokens, spare, 0);
        keep_tokens(comp, spare, 0);
        // The chat shape when `content` is there (even null), else the completions shape.
        let mut chat = None;
        let mut arrays: [Arr; 3] = Default::default();
        while let Some(field) = next_field(&mut map, &NAMES)? {
            let which = match field {
                0 => {
                    chat = Some(map.next_value_seed(Any(ChatEntries {
                        tokens: &mut *tokens,
                        spare: &mut *spare,
                    }))?);
                    continue;
                }
                1 => CompField::Text,
                2 => CompField::Logprob,
                3 => CompField::Top,
                _ => {
                    map.next_value::<Skip>()?;
                    continue;
                }
            };
            arrays[which as usize] = map.next_value_seed(Any(CompArray {
                which,
                comp: &mut *comp,
                spare: &mut *spare,
                bad_alts: &mut *bad_alts,
            }))?;
        }
        let r = match chat {
            Some(r) => r,
            None => {
                // What an absent array leaves unset, or an array given twice left behind.
                let absent = |a: &Arr| !matches!(a, Arr::Array { .. });
                let (no_lps, no_tops) = (absent(&arrays[1]), absent(&arrays[2]));
                check_completion(arrays).map(|len| {
                    keep_tokens(comp, spare, len);
                    for t in comp.iter_mut() {
                        if no_lps {
                            t.logprob = None;
                        }
                        if no_tops {
                            t.top.clear();
                        }
                    }
                    std::mem::swap(tokens, comp);
                })
            }
        };
        keep_tokens(comp, spare, 0);
        Ok(r)
    }
}

/// The completions shape's checks, in the `Value` code's order; its length when accepted.
fn check_completion([texts, lps, tops]: [Arr; 3]) -> Result<usize, ChunkError> {
    let not_array = |key: &str| malformed(format!("{COMP}.{key} is not an array"));
    let len = match &texts {
        Arr::Absent => return Ok(0),
        Arr::NotArray => return Err(not_array("tokens")),
        Arr::Array { len, .. } => *len,
    };
    let others = [("token_logprobs", &lps), ("top_logprobs", &tops)];
    if let Some((key, _)) = others.iter().find(|(_, a)| matches!(a, Arr::NotArray)) {
        return Err(not_array(key));
    }
    for (key, a) in others {
        if matches!(a, Arr::Array { len: n, .. } if *n != len) {
            return Err(malformed(format!(
                "{COMP}.{key} and {COMP}.tokens differ in length"
            )));
        }
    }
    // The first refused element by index; at one index, in the order tokens, logprob, top.
    let first = [texts, lps, tops]
        .into_iter()
        .filter_map(|a| match a {
            Arr::Array { first_bad, .. } => first_bad,
            _ => None,
        })
        .min_by_key(|(i, _)| *i);
    match first {
        Some((_, e)) => Err(e),
        None => Ok(len),
    }
}

/// `choices[0].logprobs.content`: one token per entry.
struct ChatEntries<'o> {
    tokens: &'o mut Vec<UpToken>,
    spare: &'o mut Vec<UpToken>,
}

impl<'de> Shape<'de> for ChatEntries<'_> {
    type Out = Result<(), ChunkError>;

    fn scalar(self, v: Scalar<'_>) -> Self::Out {
        keep_tokens(self.tokens, self.spare, 0);
        match v {
            Scalar::Null => Ok(()),
            _ => Err(malformed(format!("{CHAT} is not an array"))),
        }
    }

    fn seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Out, A::Error> {
        let mut first_err = None;
        let mut i = 0;
        loop {
            let tok = token_slot(self.tokens, self.spare, i);
            let Some(r) = seq.next_element_seed(Any(ChatEntry { tok, i }))? else {
                break;
            };
            if let (None, Err(e)) = (&first_err, r) {
                first_err = Some(e);
            }
            i += 1;
        }
        keep_tokens(self.tokens, self.spare, i);
        Ok(first_err.map_or(Ok(()), Err))
    }
}

/// One entry of the chat shape: `{token, logprob, top_logprobs}`.
struct ChatEntry<'o> {
    tok: &'o mut UpToken,
    i: usize,
}

impl<'de> Shape<'de> for ChatEntry<'_> {
    type Out = Result<(), ChunkError>;

    fn scalar(self, _: Scalar<'_>) -> Self::Out {
        Err(malformed(format!("{CHAT}[{}] is not an object", self.i)))
    }

    fn map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Out, A::Error> {
        const NAMES: [&str; 3] = ["token", "logprob", "top_logprobs"];
        let ChatEntry { tok, i } = self;
        // The slot may hold an entry of the same chunk read before (a key given twice).
        tok.text.clear();
        let (mut text_ok, mut lp, mut top, mut top_seen) = (false, Ok(None), Ok(()), false);
        while let Some(field) = next_field(&mut map, &NAMES)? {
            match field {
                0 => {
                    text_ok = map.next_value_seed(str_with(|s: Option<&str>| {
                        s.map(|s| set(&mut tok.text, s)).is_some()
                    }))?;
                }
                1 => lp = map.next_value_seed(Any(Logprob))?,
                2 => {
                    top_seen = true;
                    top = map.next_value_seed(Any(ChatAlts {
                        top: &mut tok.top,
                        i,
                    }))?;
                }
                _ => {
                    map.next_value::<Skip>()?;
                }
            }
        }
        if !top_seen {
            tok.top.clear();
        }
        if !text_ok {
            return Ok(Err(malformed(format!("{CHAT}[{i}].token is not a string"))));
        }
        tok.logprob = match lp {
            Ok(l) => l,
            Err(v) => return Ok(Err(bad_logprob(format!("{CHAT}[{i}].logprob"), v))),
        };
        Ok(top)
    }
}

/// `top_logprobs` of a chat entry: the first [`TOP_MAX`] read, the rest skipped.
struct ChatAlts<'o> {
    top: &'o mut Vec<(String, f32)>,
    i: usize,
}

impl<'de> Shape<'de> for ChatAlts<'_> {
    type Out = Result<(), ChunkError>;

    fn scalar(self, v: Scalar<'_>) -> Self::Out {
        self.top.clear();
        match v {
            Scalar::Null => Ok(()),
            _ => Err(malformed(format!(
                "{CHAT}[{}].top_logprobs is not an array",
                self.i
            ))),
        }
    }

    fn seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Out, A::Error> {
        let mut first_err = None;
        let mut j = 0;
        while j < TOP_MAX {
            let slot = alt_slot(self.top, j);
            let at = (self.i, j);
            let Some(r) = seq.next_element_seed(Any(ChatAlt { slot, at }))? else {
                break;
            };
            if let (None, Err(e)) = (&first_err, r) {
                first_err = Some(e);
            }
            j += 1;
        }
        self.top.truncate(j);
        while seq.next_element::<Skip>()?.is_some() {}
        Ok(first_err.map_or(Ok(()), Err))
    }
}

/// One alternative of a chat entry: `{token, logprob}` (null logprob: −∞).
struct ChatAlt<'o> {
    slot: &'o mut (String, f32),
    at: (usize, usize),
}

impl<'de> Shape<'de> for ChatAlt<'_> {
    type Out = Result<(), ChunkError>;

    fn scalar(self, _: Scalar<'_>) -> Self::Out {
        let (i, j) = self.at;
        Err(malformed(format!(
            "{CHAT}[{i}].top_logprobs[{j}] is not an object"
        )))
    }

    fn map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Out, A::Error> {
        const NAMES: [&str; 2] = ["token", "logprob"];
        let ChatAlt { slot, at: (i, j) } = self;
        let (mut text_ok, mut lp) = (false, Ok(None));
        while let Some(field) = next_field(&mut map, &NAMES)? {
            match field {
                0 => {
                    text_ok = map.next_value_seed(str_with(|s: Option<&str>| {
                        s.map(|s| set(&mut slot.0, s)).is_some()
                    }))?;
                }
                1 => lp = map.next_value_seed(Any(Logprob))?,
                _ => {
                    map.next_value::<Skip>()?;
                }
            }
        }
        let at = || format!("{CHAT}[{i}].top_logprobs[{j}]");
        if !text_ok {
            return Ok(Err(malformed(format!("{}.token is not a string", at()))));
        }
        slot.1 = match lp {
            Ok(l) => l.unwrap_or(f32::NEG_INFINITY),
            Err(v) => return Ok(Err(bad_logprob(format!("{}.logprob", at()), v))),
        };
        Ok(Ok(()))
    }
}

/// Which completions-shape array.
#[derive(Clone, Copy)]
enum CompField {
    Text = 0,
    Logprob = 1,
    Top = 2,
}

/// One of the completions shape's arrays, into the tokens of `comp` by index.
struct CompArray<'o> {
    which: CompField,
    comp: &'o mut Vec<UpToken>,
    spare: &'o mut Vec<UpToken>,
    bad_alts: &'o mut Vec<(String, String)>,
}

impl<'de> Shape<'de> for CompArray<'_> {
    type Out = Arr;

    fn scalar(self, v: Scalar<'_>) -> Arr {
        match v {
            Scalar::Null => Arr::Absent,
            _ => Arr::NotArray,
        }
    }

    fn seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Arr, A::Error> {
        let mut first_bad = None;
        let mut i = 0;
        loop {
            let tok = token_slot(self.comp, self.spare, i);
            let r = match self.which {
                CompField::Text => seq
                    .next_element_seed(str_with(|s: Option<&str>| {
                        s.map(|s| set(&mut tok.text, s)).is_some()
                    }))?
                    .map(|ok| {
                        ok.then_some(())
                            .ok_or_else(|| malformed(format!("{COMP}.tokens[{i}] is not a string")))
                    }),
                CompField::Logprob => seq.next_element_seed(Any(Logprob))?.map(|r| {
                    r.map(|l| tok.logprob = l)
                        .map_err(|v| bad_logprob(format!("{COMP}.token_logprobs[{i}]"), v))
                }),
                CompField::Top => seq.next_element_seed(Any(CompAlts {
                    top: &mut tok.top,
                    i,
                    bad_alts: &mut *self.bad_alts,
                }))?,
            };
            let Some(r) = r else { break };
            if let (None, Err(e)) = (&first_bad, r) {
                first_bad = Some((i, e));
            }
            i += 1;
        }
        Ok(Arr::Array { len: i, first_bad })
    }
}

/// `top_logprobs[i]` of the completions shape: `{token: logprob}` or null.
struct CompAlts<'o> {
    top: &'o mut Vec<(String, f32)>,
    i: usize,
    bad_alts: &'o mut Vec<(String, String)>,
}

impl<'de> Shape<'de> for CompAlts<'_> {
    type Out = Result<(), ChunkError>;

    fn scalar(self, v: Scalar<'_>) -> Self::Out {
        self.top.clear();
        match v {
            Scalar::Null => Ok(()),
            _ => Err(malformed(format!(
                "{COMP}.top_logprobs[{}] is not an object",
                self.i
            ))),
        }
    }

    fn map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Out, A::Error> {
        let CompAlts { top, i, bad_alts } = self;
        bad_alts.clear();
        let mut n = 0;
        loop {
            let slot = alt_slot(top, n);
            if map
                .next_key_seed(Key(|k: &str| set(&mut slot.0, k)))?
                .is_none()
            {
                break;
            }
            slot.1 = match map.next_value_seed(Any(Logprob))? {
                Ok(l) => l.unwrap_or(f32::NEG_INFINITY),
                Err(v) => {
                    bad_alts.push((slot.0.clone(), v));
                    f32::NAN
                }
            };
            n += 1;
        }
        top.truncate(n);
        Ok(order_alts(top, i, bad_alts))
    }
}

/// As a `Value` map gave them: one per token (the last written), checked in token order;
/// then most likely first, at most [`TOP_MAX`].
fn order_alts(
    top: &mut Vec<(String, f32)>,
    i: usize,
    bad_alts: &[(String, String)],
) -> Result<(), ChunkError> {
    top.sort_by(|a, b| a.0.cmp(&b.0));
    top.dedup_by(|later, kept| {
        let same = later.0 == kept.0;
        if same {
            std::mem::swap(later, kept);
        }
        same
    });
    // A refused logprob is NaN here (no accepted one is).
    if let Some((alt, _)) = top.iter().find(|(_, l)| l.is_nan()) {
        let value = bad_alts
            .iter()
            .rev()
            .find(|(k, _)| k == alt)
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        return Err(bad_logprob(
            format!("{COMP}.top_logprobs[{i}][{alt:?}]"),
            value,
        ));
    }
    top.sort_by(|a, b| b.1.total_cmp(&a.1));
    top.truncate(TOP_MAX);
    Ok(())
}
