//! A fixed answer as a token source: degraded mode's "ask first" clarification
//! (`--degraded-ask-first`, spec 000 §4.2 step 4), said word by word, each word a token with
//! the logprob of a word read ([`super::resume::READ_LOGPROB`]), then a normal end. No model
//! is asked, so nothing here waits: every poll has its token.

use std::borrow::Cow;

use crate::{
    clock::monotonic_ns,
    source::{resume::READ_LOGPROB, Ending, Peek, Polled, Produced, TokenSource, Tokens},
    upstream::{framing::Split, UpToken},
    wire::Channel,
};

/// The words of a fixed text, each after one space, as tokens.
#[derive(Debug)]
pub struct FixedSource {
    words: Vec<String>,
    next: usize,
    /// Alternatives the client asked for: the word itself, once.
    top_n: usize,
}

impl FixedSource {
    /// `text`'s words (split on white space); `top_n`: the alternatives asked for.
    pub fn new(text: &str, top_n: usize) -> Self {
        FixedSource {
            words: text.split_whitespace().map(|w| format!(" {w}")).collect(),
            next: 0,
            top_n,
        }
    }
}

impl TokenSource for FixedSource {
    fn poll(&mut self) -> Polled {
        let Some(word) = self.words.get(self.next).cloned() else {
            return Polled::End;
        };
        self.next += 1;
        let top = if self.top_n > 0 {
            vec![(word.clone(), READ_LOGPROB)]
        } else {
            Vec::new()
        };
        Polled::Text(Produced {
            text: Cow::Owned(word.clone()),
            tokens: Tokens::Upstream(vec![UpToken {
                text: word,
                logprob: Some(READ_LOGPROB),
                top,
            }]),
            split: Split::Token,
            channel: Channel::Content,
            arrived_ns: monotonic_ns(),
        })
    }

    fn peek(&mut self) -> Peek<'_> {
        self.words
            .get(self.next)
            .map_or(Peek::End, |w| Peek::Text(w))
    }

    fn paced(&self) -> bool {
        false
    }

    fn ending(&self) -> Ending {
        Ending {
            reason: Cow::Borrowed("stop"),
            usage: None,
            tools: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fixed_text_is_its_words_then_a_normal_end() {
        let mut s = FixedSource::new("  Which  account do\nyou mean? ", 2);
        let mut said = String::new();
        loop {
            if let Peek::Text(w) = s.peek() {
                let w = w.to_owned();
                match s.poll() {
                    Polled::Text(p) => {
                        assert_eq!(p.text, w);
                        let Tokens::Upstream(t) = &p.tokens else {
                            panic!("{p:?}")
                        };
                        assert_eq!(
                            (t.len(), t[0].logprob, t[0].top.len()),
                            (1, Some(READ_LOGPROB), 1)
                        );
                        said.push_str(&p.text);
                    }
                    other => panic!("{other:?}"),
                }
                continue;
            }
            assert_eq!(s.peek(), Peek::End);
            assert!(matches!(s.poll(), Polled::End));
            break;
        }
        assert_eq!(said, " Which account do you mean?");
        assert_eq!(s.ending().reason, "stop");
        assert!(!s.paced());
        assert!(matches!(FixedSource::new("", 0).poll(), Polled::End));
    }
}
