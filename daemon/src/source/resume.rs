//! Continuation of the built-in source with grounding in context (spec 003, "Resume
//! semantics"; issue 16 point 4): the model's state before each of the turn's last tokens,
//! so that a rewind can go back to the window start, and the salt that makes the resumed
//! text depend on the grounding.
//!
//! The built-in model is a trigram model: its state is its last two tokens and how many it
//! returned. [`History`] keeps that state before each token in a ring allocated once, at turn
//! start, and only for a turn that may be rewound (intervene mode); the per-token cost is one
//! store. The resumed generation is deterministic: the same kept prefix and the same evidence
//! always give the same text ([`salt`]), so a test can tell a resumed reply from an
//! unmodified one and check it byte for byte.

use crate::grounding::Snippet;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{
        builtin::{BuiltinModel, BuiltinSource},
        Polled, TokenSource,
    };

    fn source() -> BuiltinSource {
        BuiltinSource {
            stream: BuiltinModel::get()
                .stream("tell me about the river", Some(7), 40)
                .with_ignore_eos(true),
            top_n: 0,
            history: History::with_capacity(16),
        }
    }

    fn take(src: &mut BuiltinSource, n: usize) -> String {
        let mut out = String::new();
        for _ in 0..n {
            match src.poll() {
                Polled::Text(t) => out.push_str(&t.text),
                other => panic!("{other:?}"),
            }
        }
        out
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
    fn a_rewind_keeps_the_prefix_and_the_resumed_text_depends_on_the_evidence() {
        let mut plain = source();
        let baseline = take(&mut plain, 20);
        let resumed = |evidence: &str| {
            let mut src = source();
            let first = take(&mut src, 12);
            let kept = take(&mut BuiltinSource { ..source() }, 8);
            assert!(first.starts_with(&kept), "deterministic prefix");
            assert!(
                src.resume(4, salt(&[snippet(evidence)])),
                "within the history"
            );
            assert_eq!(src.stream.tokens_generated(), 8);
            kept + &take(&mut src, 12)
        };
        let a = resumed("the river is long");
        assert_eq!(a, resumed("the river is long"), "same evidence, same text");
        assert_ne!(
            a,
            resumed("the river is short"),
            "other evidence, other text"
        );
        let kept = take(&mut source(), 8);
        assert!(a.starts_with(&kept) && baseline.starts_with(&kept));
        assert_ne!(a, baseline, "the resumed text is not the unmodified one");
    }

    #[test]
    fn a_rewind_beyond_the_history_is_refused() {
        let mut src = source();
        take(&mut src, 30);
        assert!(!src.resume(17, 1), "16 tokens of history");
        assert!(!src.resume(31, 1));
        assert!(src.resume(16, 1));
    }

    #[test]
    fn no_history_no_rewind() {
        let mut src = BuiltinSource {
            history: History::default(),
            ..source()
        };
        take(&mut src, 5);
        assert!(!src.resume(1, 1));
    }
}
