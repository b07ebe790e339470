//! What TokenCircuit remembers of a conversation's failures, so that a transcript that drops
//! them does not restore a budget (docs/tokencircuit.md §1).
//!
//! An agent may trim its history (keep the system and user messages and drop the tool
//! exchanges) or flatten tool messages into text: the next request's transcript then no longer
//! shows the failures that used up a key's budget, and a circuit rebuilt from it alone would
//! let the call out again. So the store keeps, per conversation, each call whose result came
//! back failed, with that result ([`FailedCall`]), as the transcript showed them; the rebuild
//! replays the ones a request no longer carries before its own messages.
//!
//! Bounded per conversation: at most [`MAX_FAILED_CALLS`] calls and [`MAX_MEMORY_BYTES`] of
//! names, arguments and results (the oldest dropped first); an argument or result longer than
//! [`MAX_FIELD_BYTES`] is kept cut (a cut argument is another call's arguments, so a call with
//! arguments that long is remembered as a different target).

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// Failed calls remembered per conversation.
pub const MAX_FAILED_CALLS: usize = 512;
/// Bytes of names, arguments and results remembered per conversation.
pub const MAX_MEMORY_BYTES: usize = 64 * 1024;
/// The longest argument string or result kept whole.
pub const MAX_FIELD_BYTES: usize = 8 * 1024;

/// A call whose result came back failed, as a transcript showed them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
    /// The result's text.
    pub result: String,
}

impl FailedCall {
    /// The call, with fields longer than [`MAX_FIELD_BYTES`] cut.
    pub fn new(id: &str, name: &str, arguments: &str, result: &str) -> Self {
        FailedCall {
            id: cut(id).to_owned(),
            name: cut(name).to_owned(),
            arguments: cut(arguments).to_owned(),
            result: cut(result).to_owned(),
        }
    }

    fn bytes(&self) -> usize {
        self.id.len() + self.name.len() + self.arguments.len() + self.result.len()
    }
}

/// `s` cut to at most [`MAX_FIELD_BYTES`], on a character boundary.
fn cut(s: &str) -> &str {
    crate::wire::text::truncate_text(s, MAX_FIELD_BYTES)
}

/// One conversation's failed calls, oldest first.
#[derive(Clone, Debug, Default)]
pub struct Memory {
    calls: VecDeque<FailedCall>,
    bytes: usize,
}

impl Memory {
    /// Remembers `call` unless a call with its id is remembered already; drops the oldest past
    /// the bounds.
    pub fn remember(&mut self, call: FailedCall) {
        if self.calls.iter().any(|c| c.id == call.id) {
            return;
        }
        self.bytes += call.bytes();
        self.calls.push_back(call);
        while self.calls.len() > MAX_FAILED_CALLS || self.bytes > MAX_MEMORY_BYTES {
            let Some(old) = self.calls.pop_front() else {
                break;
            };
            self.bytes -= old.bytes();
        }
    }

    /// The remembered calls, oldest first.
    pub fn calls(&self) -> impl Iterator<Item = &FailedCall> {
        self.calls.iter()
    }

    pub fn len(&self) -> usize {
        self.calls.len()
    }

    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// Only the calls of the tools in `tools` (what an evicted conversation keeps of its
    /// refused keys).
    pub fn only_tools(&self, tools: &[&str]) -> Memory {
        let mut kept = Memory::default();
        for c in self
            .calls
            .iter()
            .filter(|c| tools.contains(&c.name.as_str()))
        {
            kept.remember(c.clone());
        }
        kept
    }

    /// Adds what `other` remembers (a conversation revived from the retained set).
    pub fn absorb(&mut self, other: Memory) {
        for c in other.calls {
            self.remember(c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_bounded_in_calls_and_bytes() {
        let mut m = Memory::default();
        for i in 0..MAX_FAILED_CALLS + 5 {
            m.remember(FailedCall::new(&format!("c{i}"), "t", "{}", "403"));
        }
        assert_eq!(m.len(), MAX_FAILED_CALLS);
        assert_eq!(m.calls().next().map(|c| c.id.as_str()), Some("c5"));
        let big = "x".repeat(MAX_FIELD_BYTES * 2);
        let mut m = Memory::default();
        for i in 0..20 {
            m.remember(FailedCall::new(&format!("b{i}"), "t", &big, &big));
        }
        assert!(m.bytes <= MAX_MEMORY_BYTES, "{}", m.bytes);
        assert!(m.calls().all(|c| c.arguments.len() == MAX_FIELD_BYTES));
        m.remember(FailedCall::new("b19", "t", "{}", "again"));
        assert_eq!(m.calls().filter(|c| c.id == "b19").count(), 1);
    }

    #[test]
    fn a_cut_keeps_whole_characters() {
        let s = "é".repeat(MAX_FIELD_BYTES);
        let c = cut(&s);
        assert!(c.len() <= MAX_FIELD_BYTES && c.chars().all(|ch| ch == 'é'));
    }
}
