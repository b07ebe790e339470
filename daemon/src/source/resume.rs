//! The built-in source ([`BuiltinSource`]: the built-in model's stream as a [`TokenSource`]),
//! and its continuation with grounding in context (spec 003, "Resume semantics"): the model's
//! state before each of the turn's last tokens,
//! so that a rewind can go back to the window start, the words it reads, and the salt that
//! makes the resumed text depend on the grounding.
//!
//! The built-in model is a trigram model: its state is its last two tokens and how many it
//! returned. [`History`] keeps that state before each token in a ring allocated once, at turn
//! start, and only for a turn that may be rewound (intervene mode); the per-token cost is one
//! store.
//!
//! After a rewind the source first **reads its grounding**: it says the words of the round's
//! evidence (the first snippet's), each a token `" word"` with a confident logprob
//! ([`READ_LOGPROB`]), then samples again from the kept context, its draws salted by the
//! evidence ([`salt`]). So a resumed reply states the evidence, which is how the built-in
//! model "answers": it knows nothing, every correct answer in it comes from the evidence. The
//! same kept prefix and the same evidence always give the same text, so a test can tell a
//! resumed reply from an unmodified one and check it byte for byte. With
//! `--builtin-restate-prompt` the source also reads at turn start: the request's last user
//! message ([`Reading::restate`]).

use std::borrow::Cow;

use super::{
    builtin::{BuiltinModel, BuiltinStream, FinishReason},
    Ending, Peek, Polled, Produced, TokenSource, Tokens,
};
use crate::{
    clock::monotonic_ns,
    grounding::Snippet,
    upstream::{framing::Split, UpToken},
    wire::{BuiltinTurn, Channel},
};

/// The logprob of a word the source reads rather than samples: ln 0.9 (0.15 bits), so that
/// the surprise detector does not breach on it.
pub const READ_LOGPROB: f32 = -0.105_360_5;

/// The model's context (last two token ids) and tokens returned, before each of the last
/// tokens.
#[derive(Debug, Default)]
pub struct History {
    ring: Box<[((u32, u32), u32)]>,
    head: usize,
    len: usize,
}

impl History {
    /// A history of the last `n` tokens (the one allocation).
    pub fn with_capacity(n: usize) -> Self {
        History {
            ring: vec![((0, 0), 0); n.max(1)].into_boxed_slice(),
            head: 0,
            len: 0,
        }
    }

    /// The state before the next token: its context and the tokens returned so far. No-op
    /// for an empty history (a turn that is never rewound).
    pub fn push(&mut self, ctx: (u32, u32), generated: u32) {
        let cap = self.ring.len();
        if cap == 0 {
            return;
        }
        self.ring[self.head] = (ctx, generated);
        self.head = (self.head + 1) % cap;
        self.len = (self.len + 1).min(cap);
    }

    /// The context the model had when it had returned `generated` tokens, if the history
    /// still holds it.
    pub fn before(&self, generated: u32) -> Option<(u32, u32)> {
        let cap = self.ring.len();
        (1..=self.len)
            .map(|back| self.ring[(self.head + cap - back) % cap])
            .find(|&(_, g)| g == generated)
            .map(|(ctx, _)| ctx)
    }
}

/// The salt a grounding round's evidence gives the resumed generation: a hash of the
/// snippets, in order.
pub fn salt(snippets: &[Snippet]) -> u64 {
    let mut h = 0u64;
    for s in snippets {
        for part in [&s.claim, &s.evidence, &s.source] {
            h = h.rotate_left(7) ^ super::builtin::hash(part.as_bytes());
        }
        h ^= u64::from(s.confidence.to_bits());
    }
    h
}

/// Words the built-in source says before it samples again, one token each: `" word"` with
/// [`READ_LOGPROB`] and, when the client asked for alternatives, just itself as one.
#[derive(Debug, Default)]
pub struct Reading {
    /// The words, each after one space (`" w1 w2"`): a token is a word with its space.
    text: String,
    /// Byte offset of the next token.
    pos: usize,
}

impl Reading {
    /// The words of `text` (split on white space).
    pub fn new(text: &str) -> Self {
        let mut words = String::with_capacity(text.len() + 1);
        for w in text.split_whitespace() {
            words.push(' ');
            words.push_str(w);
        }
        Reading {
            text: words,
            pos: 0,
        }
    }

    /// A question restated (`--builtin-restate-prompt`): its words, a trailing `?` dropped
    /// so that the question does not end a sentence and the text sampled after it continues
    /// the question's sentence (the grounding router reads a span with that sentence).
    pub fn restate(question: &str) -> Self {
        Reading::new(question.trim_end().trim_end_matches('?'))
    }

    /// The next token, if any words are left.
    fn next_word(&self) -> Option<&str> {
        let rest = self.text.get(self.pos..).filter(|r| !r.is_empty())?;
        let end = rest[1..].find(' ').map_or(rest.len(), |i| i + 1);
        Some(&rest[..end])
    }

    /// The next poll's word: `None` when none is left or the stream may not say one more
    /// token (it then ends).
    pub fn peek(&self, stream: &BuiltinStream) -> Option<&str> {
        let word = self.next_word()?;
        stream.clone().count_read().then_some(word)
    }

    /// The next word as a token, counted as generated (`max_tokens` holds); `None` when
    /// none is left or the stream is at its end. The text is owned: this allocation happens
    /// only for read words (after a grounding round, or a restated question when asked),
    /// never on the model's per-token path.
    pub fn poll(&mut self, stream: &mut BuiltinStream, top_n: usize) -> Option<Polled> {
        let word = self.next_word()?;
        if !stream.count_read() {
            return None;
        }
        let text = word.to_owned();
        self.pos += text.len();
        let top = if top_n > 0 {
            vec![(text.clone(), READ_LOGPROB)]
        } else {
            Vec::new()
        };
        Some(Polled::Text(Produced {
            text: Cow::Owned(text.clone()),
            tokens: Tokens::Upstream(vec![UpToken {
                text,
                logprob: Some(READ_LOGPROB),
                top,
            }]),
            split: Split::Token,
            channel: Channel::Content,
            arrived_ns: monotonic_ns(),
        }))
    }
}

impl BuiltinSource {
    /// The source of a built-in turn: the model's stream for the request, the alternatives
    /// it asked for, no history yet (intervene mode gives it one), and, with `restate`
    /// (`--builtin-restate-prompt`), its question to read first.
    pub fn for_turn(req: &BuiltinTurn, restate: bool) -> Self {
        BuiltinSource {
            stream: BuiltinModel::get()
                .stream(&req.prompt, req.seed, req.max_tokens)
                .with_ignore_eos(req.ignore_eos),
            top_n: if req.ask.logprobs {
                req.ask.top_logprobs as usize
            } else {
                0
            },
            history: History::default(),
            reading: if restate {
                Reading::restate(req.question())
            } else {
                Reading::default()
            },
        }
    }

    /// Continuation with grounding in context (issue 16): the last `dropped` tokens are taken
    /// back; the source reads the first snippet's evidence, then samples from the kept
    /// prefix, its draws salted by the snippets ([`salt`]). `false` (nothing changed) when
    /// the history does not reach that far back.
    pub fn resume(&mut self, dropped: usize, snippets: &[Snippet]) -> bool {
        let now = self.stream.tokens_generated();
        let Some(target) = u32::try_from(dropped).ok().and_then(|d| now.checked_sub(d)) else {
            return false;
        };
        let Some(ctx) = self.history.before(target) else {
            return false;
        };
        self.stream.resume_at(ctx, target, salt(snippets));
        self.reading = Reading::new(snippets.first().map_or("", |s| s.evidence.as_str()));
        true
    }
}

/// A built-in stream as the data plane's [`TokenSource`]: one token per poll, with the
/// `top_n` alternatives the client asked for; no allocation, except for the words it reads
/// ([`Reading`]: after a grounding round, or a restated question when asked).
#[derive(Debug)]
pub struct BuiltinSource {
    pub stream: BuiltinStream,
    pub top_n: usize,
    /// The model's context before each of the last tokens, for a rewind (intervene mode);
    /// empty otherwise.
    pub history: History,
    /// Words said before sampling goes on: the restated question, a round's evidence.
    pub reading: Reading,
}

impl TokenSource for BuiltinSource {
    fn poll(&mut self) -> Polled {
        self.history
            .push(self.stream.context(), self.stream.tokens_generated());
        if let Some(read) = self.reading.poll(&mut self.stream, self.top_n) {
            return read;
        }
        match self.stream.next_token(self.top_n) {
            Some(tok) => Polled::Text(Produced {
                text: Cow::Borrowed(tok.text),
                tokens: Tokens::Builtin {
                    logprob: tok.logprob,
                    top: tok.top,
                },
                split: Split::Token,
                channel: Channel::Content,
                arrived_ns: monotonic_ns(),
            }),
            None => Polled::End,
        }
    }

    /// [`BuiltinStream::peek_text`]: the next poll's token, sampled on a copy of the stream.
    fn peek(&mut self) -> Peek<'_> {
        if let Some(word) = self.reading.peek(&self.stream) {
            return Peek::Text(word);
        }
        match self.stream.peek_text() {
            Some(text) => Peek::Text(text),
            None => Peek::End,
        }
    }

    fn paced(&self) -> bool {
        true
    }

    fn ending(&self) -> Ending {
        Ending {
            reason: Cow::Borrowed(
                self.stream
                    .finish_reason()
                    .map_or("stop", FinishReason::as_str),
            ),
            usage: None,
            tools: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{Peek, TokenSource};

    fn source_of(max_tokens: u32, top_n: usize) -> BuiltinSource {
        BuiltinSource {
            stream: BuiltinModel::get()
                .stream("tell me about the river", Some(7), max_tokens)
                .with_ignore_eos(true),
            top_n,
            history: History::with_capacity(16),
            reading: Reading::default(),
        }
    }

    fn source() -> BuiltinSource {
        source_of(40, 0)
    }

    /// The next token's text and logprob, `None` at the end; the peek before it must say
    /// the same.
    fn next(src: &mut BuiltinSource) -> Option<(String, f32)> {
        let peeked = match src.peek() {
            Peek::Text(t) => Some(t.to_owned()),
            Peek::End => None,
            Peek::Unknown => panic!("the built-in source always knows"),
        };
        let got = match src.poll() {
            Polled::Text(t) => {
                let mut lp = None;
                t.tokens.for_each(&t.text, |_, l| {
                    lp = l;
                    true
                });
                Some((t.text.into_owned(), lp.expect("a logprob")))
            }
            Polled::End => None,
            other => panic!("{other:?}"),
        };
        assert_eq!(peeked, got.as_ref().map(|g| g.0.clone()), "peek = poll");
        got
    }

    fn take(src: &mut BuiltinSource, n: usize) -> String {
        (0..n)
            .map(|_| next(src).expect("a token").0)
            .collect::<String>()
    }

    fn snippet(evidence: &str) -> Snippet {
        Snippet {
            claim: "river".into(),
            evidence: evidence.into(),
            confidence: 0.8,
            source: "doc.txt".into(),
        }
    }

    #[test]
    fn a_rewind_reads_the_evidence_then_samples_on_salted_by_it() {
        let mut plain = source();
        let baseline = take(&mut plain, 20);
        let resumed = |evidence: &str| {
            let mut src = source();
            let first = take(&mut src, 12);
            let kept = take(&mut source(), 8);
            assert!(first.starts_with(&kept), "deterministic prefix");
            assert!(
                src.resume(4, &[snippet(evidence), snippet("second snippet")]),
                "within the history"
            );
            assert_eq!(src.stream.tokens_generated(), 8);
            kept + &take(&mut src, 16)
        };
        let kept = take(&mut source(), 8);
        let a = resumed("the river  is\nlong");
        assert_eq!(
            a,
            resumed("the river  is\nlong"),
            "same evidence, same text"
        );
        // The first snippet's words, one token each with its space, then the model again.
        let read = format!("{kept} the river is long");
        assert!(a.starts_with(&read), "{a:?}");
        assert!(a.len() > read.len() && !a.contains("second"), "{a:?}");
        let b = resumed("the river is short");
        assert!(
            b.starts_with(&format!("{kept} the river is short")),
            "{b:?}"
        );
        assert_ne!(
            a[read.len()..],
            b[read.len() + 1..],
            "the evidence salts the rest"
        );
        assert!(baseline.starts_with(&kept));
        assert_ne!(a, baseline, "the resumed text is not the unmodified one");
    }

    #[test]
    fn read_words_are_confident_tokens_counted_against_max_tokens() {
        for top_n in [0, 3] {
            let mut src = source_of(10, top_n);
            take(&mut src, 6);
            assert!(src.resume(2, &[snippet("one two three four five six")]));
            let mut words = Vec::new();
            while let Some((text, lp)) = next(&mut src) {
                assert_eq!(lp, READ_LOGPROB, "{text:?}");
                words.push(text);
            }
            // 4 kept + 6 read would be 10: every token is a read word, the 6th at the cap.
            assert_eq!(words, [" one", " two", " three", " four", " five", " six"]);
            assert_eq!(src.stream.tokens_generated(), 10);
            assert_eq!(src.ending().reason, "length");
        }
        // The alternatives: just the word, when the client asked for any.
        let mut src = source_of(10, 3);
        take(&mut src, 2);
        assert!(src.resume(1, &[snippet("alpha")]));
        let Polled::Text(t) = src.poll() else {
            panic!("a token")
        };
        let Tokens::Upstream(toks) = &t.tokens else {
            panic!("owned tokens")
        };
        assert_eq!(toks.len(), 1);
        assert_eq!(toks[0].top, [(" alpha".to_owned(), READ_LOGPROB)]);
        // With the cap reached mid-reading the stream ends; nothing more is read.
        let mut src = source_of(3, 0);
        take(&mut src, 3);
        assert!(src.resume(1, &[snippet("a b c")]));
        assert_eq!(next(&mut src).map(|t| t.0).as_deref(), Some(" a"));
        assert_eq!(next(&mut src), None);
    }

    #[test]
    fn a_restated_question_is_read_first_and_only_when_asked() {
        let req = |content: &str| {
            let body = serde_json::json!({"model": "builtin", "max_tokens": 12, "seed": 7,
                "messages": [{"role": "system", "content": "be brief"},
                    {"role": "user", "content": content}]});
            crate::wire::ClientRequest::parse(
                crate::wire::Endpoint::Chat,
                body.to_string().as_bytes(),
            )
            .and_then(|r| r.builtin_turn("builtin"))
            .expect("a valid request")
        };
        let q = req("What is 17 times 23? ");
        let mut on = BuiltinSource::for_turn(&q, true);
        let mut off = BuiltinSource::for_turn(&q, false);
        let mut plain = BuiltinModel::get().stream(&q.prompt, Some(7), 12);
        let expected: String = std::iter::from_fn(|| plain.next_token(0).map(|t| t.text)).collect();
        let off_text: String = std::iter::from_fn(|| next(&mut off).map(|t| t.0)).collect();
        assert_eq!(off_text, expected, "off: the model's usual text");
        let read: Vec<_> = (0..5).map(|_| next(&mut on).expect("a word")).collect();
        assert!(read.iter().all(|(_, lp)| *lp == READ_LOGPROB));
        let words: String = read.into_iter().map(|(t, _)| t).collect();
        assert_eq!(
            words, " What is 17 times 23",
            "the question, its `?` dropped"
        );
        let rest: String = std::iter::from_fn(|| next(&mut on).map(|t| t.0)).collect();
        assert_eq!(on.stream.tokens_generated(), 12, "the read words count");
        assert!(
            expected.starts_with(&rest),
            "then the model, from its start"
        );
    }

    #[test]
    fn a_rewind_beyond_the_history_is_refused() {
        let mut src = source();
        take(&mut src, 30);
        assert!(!src.resume(17, &[]), "16 tokens of history");
        assert!(!src.resume(31, &[]));
        assert!(src.resume(16, &[]));
        assert_eq!(src.stream.tokens_generated(), 14);
    }

    #[test]
    fn no_history_no_rewind() {
        let mut src = BuiltinSource {
            history: History::default(),
            ..source()
        };
        take(&mut src, 5);
        assert!(!src.resume(1, &[]));
    }
}
