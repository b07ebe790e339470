//! Token sources: where the tokens that haltd governs come from (DESIGN §2).
//!
//! Every source implements [`TokenSource`]; the data plane's turn pipeline
//! (`dataplane/turn/pipeline.rs`) polls it and runs the same phases for whatever it produces, so a
//! new source only has to say what comes next:
//!
//! - [`builtin`]: a small deterministic language model compiled into the binary, with real
//!   per-token probabilities; used by the demo, the tests and the benchmarks, so that none of
//!   them needs a GPU, a network or model weights. Paced by haltd's token timer.
//! - [`upstream`]: the items an OpenAI-compatible upstream streams (its SSE events, parsed by
//!   [`crate::upstream`]); the socket I/O that feeds it is the data plane's
//!   (`dataplane/upstream_io.rs`). Paced by the upstream.
//!
//! A source may also [`peek`](TokenSource::peek): say what its next poll will return before
//! the pipeline takes it. The exfiltration hold-back uses it to release text that the next
//! token rules out now rather than one token later (`dataplane/turn/pipeline.rs`). The built-in
//! model answers (it samples its next token on a copy of its deterministic state); an
//! upstream answers [`Peek::Unknown`]: the pipeline takes an upstream's buffered tokens one
//! after the other without waiting, so a token already received releases what it rules out
//! at once anyway.

use std::borrow::Cow;

use serde_json::Value;

use crate::{
    upstream::{framing::Split, UpToken, UpstreamFailureKind},
    wire::Channel,
};

pub mod builtin;
pub mod fixed;
pub mod resume;
pub mod upstream;

/// A source of tokens for one turn.
pub trait TokenSource {
    /// What the source has next. Called by the pipeline whenever it can take a token; what it
    /// returns is owned (or `'static`), so the source is free again at once.
    fn poll(&mut self) -> Polled;

    /// Whether haltd paces the source (one token per `--token-interval`, the built-in model),
    /// rather than the source pacing itself (an upstream: tokens go out as they arrive).
    fn paced(&self) -> bool;

    /// Hands back text the pipeline is done with (its frame is encoded), so that the source
    /// can reuse its buffers for the next text. Sources that lend `'static` text keep the
    /// default, which drops it.
    fn recycle(&mut self, produced: Produced) {
        drop(produced);
    }

    /// How the turn ended, asked once [`Polled::End`] was returned and every held frame went
    /// out.
    fn ending(&self) -> Ending;

    /// What the next [`poll`](Self::poll) will return, without taking it, when the source
    /// has it already. A source that answers [`Peek::Text`] or [`Peek::End`] must have its
    /// next `poll` return exactly that: the text is released against it. Default: unknown.
    fn peek(&mut self) -> Peek<'_> {
        Peek::Unknown
    }
}

/// What a source's next poll will bring ([`TokenSource::peek`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peek<'a> {
    /// Text of exactly this content.
    Text(&'a str),
    /// [`Polled::End`]: the text is complete.
    End,
    /// Not known yet (or anything other than text or the end).
    Unknown,
}

/// What a source hands the pipeline.
#[derive(Debug)]
#[expect(
    clippy::large_enum_variant,
    reason = "a built-in token's alternatives stay inline so that producing it never allocates; the value lives on the stack for one step"
)]
pub enum Polled {
    /// Text, with the tokens that make it (observed by the detectors before any of it goes
    /// out).
    Text(Produced),
    /// A tool-call delta (chat, upstream only): the delta as received, the logprobs of its
    /// tokens, and when it arrived.
    ToolCalls {
        delta: Value,
        tokens: Vec<UpToken>,
        arrived_ns: u64,
    },
    /// Nothing yet: the source's I/O calls the pipeline again when something arrives.
    Pending,
    /// The text is complete ([`TokenSource::ending`] says how it ended).
    End,
    /// The source failed; the turn ends typed (`UPSTREAM_FAILURE`).
    Failed(SourceFailure),
}

/// Text a source produced.
#[derive(Debug)]
pub struct Produced {
    /// Borrowed from the built-in model's vocabulary (no allocation), owned from an upstream.
    pub text: Cow<'static, str>,
    pub tokens: Tokens,
    /// How the text is cut into frames: per token, or per character when its tokens do not
    /// spell it.
    pub split: Split,
    /// The answer or the model's reasoning (`reasoning_content`, an upstream's chat only):
    /// governed alike, forwarded each in its own field.
    pub channel: Channel,
    /// When it reached haltd (`haltd_token_overhead_seconds` runs from here).
    pub arrived_ns: u64,
}

/// The tokens that make a [`Produced`] text.
#[derive(Debug)]
#[expect(
    clippy::large_enum_variant,
    reason = "a built-in token's alternatives stay inline so that producing it never allocates; the value lives on the stack for one step"
)]
pub enum Tokens {
    /// One built-in token (its text is the `Produced` text): logprob and alternatives, no
    /// allocation.
    Builtin {
        logprob: f32,
        top: builtin::TopLogprobs,
    },
    /// The upstream's tokens; empty when it sent no logprobs.
    Upstream(Vec<UpToken>),
}

impl Tokens {
    pub fn len(&self) -> usize {
        match self {
            Tokens::Builtin { .. } => 1,
            Tokens::Upstream(t) => t.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Each token's text and logprob, in order (`text` is the produced text, which a built-in
    /// token spells alone).
    pub fn for_each<'a>(&'a self, text: &'a str, mut f: impl FnMut(&'a str, Option<f32>) -> bool) {
        match self {
            Tokens::Builtin { logprob, .. } => {
                f(text, Some(*logprob));
            }
            Tokens::Upstream(toks) => {
                for t in toks {
                    if !f(&t.text, t.logprob) {
                        return;
                    }
                }
            }
        }
    }
}

/// How a turn's text ended.
#[derive(Debug)]
pub struct Ending {
    /// The OpenAI `finish_reason`.
    pub reason: Cow<'static, str>,
    /// `(prompt, completion)` tokens as the source counted them; `None`: haltd's own count.
    pub usage: Option<(u64, u64)>,
    /// The tool calls the source streamed, merged by index (empty when none).
    pub tools: Vec<Value>,
}

/// Why a source failed.
#[derive(Debug)]
pub struct SourceFailure {
    pub kind: UpstreamFailureKind,
    pub message: String,
    /// The upstream's HTTP status, when it matters to the failure.
    pub status: Option<u16>,
    /// The end of `message` that quotes the upstream (left out of records unless
    /// `--record-token-text`).
    pub quote: Option<String>,
}
