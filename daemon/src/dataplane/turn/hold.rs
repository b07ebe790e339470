//! The exfiltration hold-back queue of a turn: the scanner may hold text back, so frames wait
//! here until it releases them, and go out one frame each, in order. A trip drops everything
//! held: held text is never emitted.
//!
//! The queue also frames what the proxy receives (one token per frame,
//! [`crate::upstream::framing`]): an entry is one token, a run of characters or one call's part
//! of a tool-call delta, and gives one frame per step. An entry's text is stored once; each
//! frame of an entry that makes several (a long token's pieces, one per character) is split
//! off as it goes out, one small allocation per frame.
//!
//! The common case (nothing held, one frame) skips the queue: the pipeline encodes the token
//! straight from the source, without copying it (`pipeline.rs`). A token joins the queue (an
//! owned copy of a built-in token: one allocation) only while the scanner holds text; a
//! proxied chunk's text is owned already and moves in.

use std::collections::VecDeque;

use serde_json::Value;

use crate::dataplane::turn::holdback::HoldBack;
use crate::{
    upstream::{
        framing::{self, Split, ToolCallPart},
        UpToken,
    },
    wire::Channel,
};

/// What a held frame carries.
#[derive(Debug)]
pub enum PendingKind {
    /// One token, in pieces of at most the cap when longer: the first frame carries
    /// `logprob` and `top`, later pieces logprob 0.0 (a certain continuation) and no
    /// alternatives.
    Content {
        logprob: f32,
        top: Vec<(String, f32)>,
    },
    /// Text whose tokens are not known: one frame per character, `logprobs: null`.
    Chars,
    /// One call's part of a tool-call delta: a header frame first when `header` is set, then
    /// the arguments (`text`) cut by `split`.
    ToolCall {
        index: u32,
        header: Option<ToolHeader>,
        split: Split,
    },
}

/// What a tool call's header frame carries, and the calls it starts (`{index, id, name}`),
/// dispatched once the kernel accepts the frame.
#[derive(Debug)]
pub struct ToolHeader {
    pub id: Option<String>,
    pub name: Option<String>,
    pub started: Vec<Value>,
}

/// Text waiting to go out as frames: held back by the exfiltration scanner, or the frames of
/// a proxied chunk not sent yet.
#[derive(Debug)]
pub struct Pending {
    pub text: String,
    pub kind: PendingKind,
    /// The answer or the reasoning (content and character frames; a tool call's is
    /// [`Channel::Content`]).
    pub channel: Channel,
    /// Bytes of `text` earlier frames carried.
    pub pos: usize,
    /// Byte offset in the turn's scanned text where this entry's text ends.
    pub end: usize,
    /// Byte offset of the text in the completion (for `text_offset`).
    pub offset: usize,
    /// When its token reached haltd (`haltd_token_overhead_seconds` runs from here).
    pub arrived_ns: u64,
}

impl Pending {
    pub(in crate::dataplane) fn split(&self) -> Split {
        match self.kind {
            PendingKind::Content { .. } => Split::Token,
            PendingKind::Chars => Split::Chars,
            PendingKind::ToolCall { split, .. } => split,
        }
    }

    pub(in crate::dataplane) fn has_header(&self) -> bool {
        matches!(
            self.kind,
            PendingKind::ToolCall {
                header: Some(_),
                ..
            }
        )
    }

    /// Bytes of text the next frame carries (a tool-call header carries none).
    pub(in crate::dataplane) fn next_len(&self) -> usize {
        if self.has_header() {
            0
        } else {
            self.split().next_len(&self.text[self.pos..])
        }
    }

    /// Whether the next frame, of `n` bytes, is the entry's last.
    pub(in crate::dataplane) fn is_last(&self, n: usize) -> bool {
        if self.has_header() {
            self.pos == self.text.len()
        } else {
            self.pos + n == self.text.len()
        }
    }

    /// Splits off the next frame, of `n` bytes ending at `end` (an owned copy of its text).
    pub(in crate::dataplane) fn take_frame(&mut self, n: usize, end: usize) -> Pending {
        let kind = match &mut self.kind {
            PendingKind::Content { logprob, top } => {
                let first = PendingKind::Content {
                    logprob: *logprob,
                    top: std::mem::take(top),
                };
                *logprob = 0.0;
                first
            }
            PendingKind::Chars => PendingKind::Chars,
            PendingKind::ToolCall {
                index,
                header,
                split,
            } => PendingKind::ToolCall {
                index: *index,
                header: header.take(),
                split: *split,
            },
        };
        let frame = Pending {
            text: self.text[self.pos..self.pos + n].to_owned(),
            kind,
            channel: self.channel,
            pos: 0,
            end,
            offset: self.offset + self.pos,
            arrived_ns: self.arrived_ns,
        };
        self.pos += n;
        frame
    }
}

/// The hold queue and scan positions of a turn.
#[derive(Debug, Default)]
pub struct Hold {
    pub queue: VecDeque<Pending>,
    /// Bytes pushed to the scanner so far.
    pub scanned: usize,
    /// Bytes the scanner released so far.
    pub released: usize,
    /// The source ended (and the scanner decided everything): drain, then finish.
    pub ending: bool,
    /// Intervene mode: the last W tokens held back for a possible rewind (`holdback.rs`).
    pub back: Option<HoldBack>,
}

impl Hold {
    /// Applies a release of `n` more bytes.
    pub fn release(&mut self, n: usize) {
        self.released = self.released.saturating_add(n).min(self.scanned);
    }
    /// Text up to this offset may go out: what the scanner released, within the hold-back
    /// window's limit.
    pub fn out_limit(&self) -> usize {
        self.back
            .as_ref()
            .map_or(self.released, |b| self.released.min(b.limit()))
    }
    /// The next frame that may go out: the queue's first entry when it is one frame, else
    /// that entry's next frame, split off.
    pub fn pop_released(&mut self) -> Option<Pending> {
        let limit = self.out_limit();
        let front = self.queue.front_mut()?;
        let n = front.next_len();
        let frame_end = front.end - (front.text.len() - front.pos - n);
        if frame_end > limit {
            return None;
        }
        if front.is_last(n) {
            return self.queue.pop_front();
        }
        Some(front.take_frame(n, frame_end))
    }
    /// Whether a frame whose text ends at `end` may skip the queue.
    pub fn passes(&self, end: usize) -> bool {
        self.queue.is_empty() && end <= self.out_limit()
    }

    /// Drops every queued entry whose text ends after `keep` (the held tokens of a rewind;
    /// none of them went out) and takes the scan positions back to `keep`. Returns the
    /// entries dropped, oldest first.
    pub fn rewind(&mut self, keep: usize) -> Vec<Pending> {
        let at = self.queue.iter().position(|p| p.end > keep);
        let dropped = at.map_or_else(Vec::new, |i| self.queue.split_off(i).into());
        self.scanned = keep;
        self.released = self.released.min(keep);
        dropped
    }

    /// Queues a proxied chunk's text (already scanned up to `self.scanned`) as frames cut by
    /// `split`: one token (`Split::Token`, with its logprobs) or text per character.
    pub fn push_text(
        &mut self,
        text: String,
        (split, channel): (Split, Channel),
        token: Option<UpToken>,
        offset: usize,
        arrived_ns: u64,
    ) {
        if split == Split::Chars && text.is_empty() {
            return;
        }
        let first = token.map_or((f32::NEG_INFINITY, Vec::new()), |t| {
            (t.logprob.unwrap_or(f32::NEG_INFINITY), t.top)
        });
        self.push_content(text, (split, channel), first, offset, arrived_ns);
    }

    /// Queues text (already scanned up to `self.scanned`) as frames cut by `split`: one token
    /// with its `(logprob, alternatives)` (`Split::Token`), or text per character.
    pub fn push_content(
        &mut self,
        text: String,
        (split, channel): (Split, Channel),
        (logprob, top): (f32, Vec<(String, f32)>),
        offset: usize,
        arrived_ns: u64,
    ) {
        if split == Split::Chars && text.is_empty() {
            return;
        }
        let kind = match split {
            Split::Token => PendingKind::Content { logprob, top },
            Split::Chars => PendingKind::Chars,
        };
        self.queue.push_back(Pending {
            text,
            kind,
            channel,
            pos: 0,
            end: self.scanned,
            offset,
            arrived_ns,
        });
    }

    /// Queues a tool-call delta's frames ([`framing`]): per call a header (with the calls of
    /// `started` it starts) when it has one, then its arguments per token or per character.
    /// Their text (names, then arguments, per call) ends at `self.scanned`.
    pub fn push_tool_calls(
        &mut self,
        parts: Vec<ToolCallPart>,
        tokens: Vec<UpToken>,
        started: &[Value],
        arrived_ns: u64,
    ) {
        let scanned = self.scanned;
        self.push_tool_calls_ending(parts, tokens, started, arrived_ns, scanned);
    }

    /// [`Self::push_tool_calls`] for a delta whose text ended at `scanned` (earlier than
    /// `self.scanned` when TokenCircuit held the delta back while later text was scanned).
    pub fn push_tool_calls_ending(
        &mut self,
        parts: Vec<ToolCallPart>,
        tokens: Vec<UpToken>,
        started: &[Value],
        arrived_ns: u64,
        scanned: usize,
    ) {
        let split = framing::tool_arguments_split(&parts, &tokens);
        let text_len: usize = parts
            .iter()
            .map(|p| p.name.as_ref().map_or(0, String::len) + p.arguments.len())
            .sum();
        let mut end = scanned - text_len;
        let mut tokens = Some(tokens);
        for p in parts {
            let index = p.index;
            let header = p.has_header().then(|| ToolHeader {
                started: started
                    .iter()
                    .filter(|s| s["index"].as_u64() == Some(u64::from(index)))
                    .cloned()
                    .collect(),
                id: p.id,
                name: p.name,
            });
            end += header
                .as_ref()
                .and_then(|h| h.name.as_ref())
                .map_or(0, String::len);
            let entry = |text: String, header, end| Pending {
                text,
                kind: PendingKind::ToolCall {
                    index,
                    header,
                    split,
                },
                channel: Channel::Content,
                pos: 0,
                end,
                offset: 0,
                arrived_ns,
            };
            let args = match (split, tokens.take()) {
                // One call whose tokens spell its arguments: one entry per token.
                (Split::Token, Some(toks)) => toks.into_iter().map(|t| t.text).collect(),
                _ => vec![p.arguments],
            };
            if header.is_some() {
                self.queue.push_back(entry(String::new(), header, end));
            }
            for a in args
                .into_iter()
                .filter(|a| !a.is_empty() || split == Split::Token)
            {
                end += a.len();
                self.queue.push_back(entry(a, None, end));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn token(text: &str, logprob: f32) -> UpToken {
        UpToken {
            text: text.to_owned(),
            logprob: Some(logprob),
            top: vec![("alt".to_owned(), -2.0)],
        }
    }

    /// Everything the queue lets out, given the scanner released all.
    fn drain(hold: &mut Hold) -> Vec<Pending> {
        hold.release(usize::MAX);
        std::iter::from_fn(|| hold.pop_released()).collect()
    }

    fn frame_text(p: &Pending) -> &str {
        &p.text[p.pos..]
    }

    #[test]
    fn a_long_token_goes_out_in_pieces_the_first_with_its_logprobs() {
        let mut hold = Hold::default();
        let text = "ab".repeat(50); // 100 bytes: 64 + 36
        hold.scanned = 7 + text.len();
        hold.push_text(
            text.clone(),
            (Split::Token, Channel::Content),
            Some(token(&text, -1.5)),
            7,
            42,
        );
        let frames = drain(&mut hold);
        assert_eq!(frames.len(), 2);
        assert_eq!(frame_text(&frames[0]), &text[..64]);
        assert_eq!(frame_text(&frames[1]), &text[64..]);
        match (&frames[0].kind, &frames[1].kind) {
            (
                PendingKind::Content { logprob, top },
                PendingKind::Content {
                    logprob: later,
                    top: none,
                },
            ) => {
                assert_eq!((*logprob, top.len()), (-1.5, 1));
                assert_eq!((*later, none.len()), (0.0, 0));
            }
            other => panic!("{other:?}"),
        }
        // text_offset of each piece, and when each arrived.
        assert_eq!(frames[0].offset + frames[0].pos, 7);
        assert_eq!(frames[1].offset + frames[1].pos, 7 + 64);
        assert!(frames.iter().all(|f| f.arrived_ns == 42));
        assert!(hold.queue.is_empty());
    }

    #[test]
    fn a_rewind_drops_the_held_tokens_and_keeps_the_rest_in_order() {
        let mut hold = Hold {
            back: Some(HoldBack::new(2, 0)),
            ..Hold::default()
        };
        for (i, t) in ["a", "bb", "c", "dd"].into_iter().enumerate() {
            hold.scanned += t.len();
            let offset = hold.scanned - t.len();
            hold.push_text(
                t.to_owned(),
                (Split::Token, Channel::Content),
                Some(token(t, -0.1)),
                offset,
                i as u64,
            );
            if let Some(b) = hold.back.as_mut() {
                b.push(hold.scanned);
            }
        }
        hold.release(usize::MAX);
        // The window holds "c" and "dd": only "a" and "bb" may go out.
        assert_eq!(hold.out_limit(), 3);
        let keep = hold.back.as_mut().map(HoldBack::rewind).expect("window");
        let dropped = hold.rewind(keep);
        let texts: Vec<&str> = dropped.iter().map(frame_text).collect();
        assert_eq!(texts, ["c", "dd"]);
        assert_eq!((hold.scanned, hold.released), (3, 3));
        let rest: Vec<String> = std::iter::from_fn(|| hold.pop_released())
            .map(|p| frame_text(&p).to_owned())
            .collect();
        assert_eq!(rest, ["a", "bb"], "the kept prefix goes out, nothing else");
    }

    #[test]
    fn an_empty_token_is_one_empty_frame_and_empty_chars_are_none() {
        let mut hold = Hold::default();
        hold.push_text(
            String::new(),
            (Split::Token, Channel::Content),
            Some(token("", -0.1)),
            0,
            0,
        );
        hold.push_text(String::new(), (Split::Chars, Channel::Content), None, 0, 0);
        let frames = drain(&mut hold);
        assert_eq!(frames.len(), 1);
        assert_eq!(frame_text(&frames[0]), "");
    }

    #[test]
    fn untokenised_text_goes_out_one_character_per_frame_as_the_scanner_releases_it() {
        let mut hold = Hold::default();
        let text = "aé𝄞";
        hold.scanned = text.len();
        hold.push_text(
            text.to_owned(),
            (Split::Chars, Channel::Reasoning),
            None,
            0,
            0,
        );
        // Nothing released: nothing goes out.
        assert!(hold.pop_released().is_none());
        // The first character released: exactly it.
        hold.release(1);
        let f = hold.pop_released().expect("released");
        assert_eq!(frame_text(&f), "a");
        assert!(matches!(f.kind, PendingKind::Chars));
        assert_eq!(
            f.channel,
            Channel::Reasoning,
            "a frame keeps its entry's channel"
        );
        assert!(hold.pop_released().is_none(), "é is not released yet");
        hold.release(2);
        assert_eq!(frame_text(&hold.pop_released().expect("é")), "é");
        let rest = drain(&mut hold);
        assert_eq!(rest.len(), 1);
        assert_eq!(frame_text(&rest[0]), "𝄞");
        assert_eq!(rest[0].channel, Channel::Reasoning);
        assert_eq!(rest[0].offset + rest[0].pos, 3);
    }

    #[test]
    fn a_tool_call_is_a_header_then_its_arguments() {
        let mut hold = Hold::default();
        let delta = json!([{"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"a\":1}"}}]);
        let parts = framing::tool_call_parts(&delta).expect("valid");
        hold.scanned = "get_weather".len() + "{\"a\":1}".len();
        let started = [json!({"index": 0, "id": "call_1", "name": "get_weather"})];
        hold.push_tool_calls(parts, Vec::new(), &started, 5);
        // The header waits for the scanner to release the name.
        hold.release("get_weather".len() - 1);
        assert!(hold.pop_released().is_none());
        let frames = drain(&mut hold);
        assert_eq!(frames.len(), 1 + 7, "header + one frame per character");
        match &frames[0].kind {
            PendingKind::ToolCall {
                index: 0,
                header: Some(h),
                ..
            } => {
                assert_eq!(h.id.as_deref(), Some("call_1"));
                assert_eq!(h.name.as_deref(), Some("get_weather"));
                assert_eq!(h.started.len(), 1);
            }
            other => panic!("{other:?}"),
        }
        let args: String = frames[1..].iter().map(frame_text).collect();
        assert_eq!(args, "{\"a\":1}");
        assert!(frames[1..].iter().all(|f| matches!(
            f.kind,
            PendingKind::ToolCall {
                header: None,
                split: Split::Chars,
                ..
            }
        )));
    }

    #[test]
    fn tool_call_arguments_spelled_by_their_tokens_go_out_per_token() {
        let mut hold = Hold::default();
        let delta = json!([{"index": 1, "function": {"arguments": "{\"city\":"}}]);
        let parts = framing::tool_call_parts(&delta).expect("valid");
        hold.scanned = 8;
        let toks = vec![token("{\"", -0.1), token("city", -0.2), token("\":", -0.3)];
        hold.push_tool_calls(parts, toks, &[], 0);
        let frames = drain(&mut hold);
        let texts: Vec<&str> = frames.iter().map(frame_text).collect();
        assert_eq!(texts, ["{\"", "city", "\":"]);
    }
}
