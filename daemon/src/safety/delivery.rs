//! `no_silent_correction` from evidence: the text the model produced against the text haltd
//! sent for it.
//!
//! A silent correction is output changed on its way to the client with nothing typed to say
//! so: a byte sent that the model did not produce at that place, or, in a turn that completed,
//! produced text that was never sent. A halt is no silent correction: it ends the stream with
//! haltd's typed terminal event (or error object), so for a halted turn the sent text only
//! has to be a prefix of the produced one. A grounding round's rewind drops tokens that were
//! never sent, and the model's continuation replaces them: the produced text is taken back
//! with them ([`TextTrail::rewind`]).
//!
//! The data plane keeps a [`TextTrail`] per turn: the produced text (content and reasoning
//! tokens, as the source delivered them and the detectors passed them) that was not sent yet,
//! and, per sent piece, a comparison with the produced text at the same offset, after which
//! that piece is dropped. A rewind never takes back sent text, so nothing before the sent
//! offset is needed again: the trail holds only what the hold-back window and the scanner
//! hold (usually nothing), whatever the turn's length. No allocation per token once its
//! buffer has grown.

use super::{missing, SafetyCheckResult, NO_SILENT_CORRECTION};

/// Most produced text the trail holds unsent; past it the boundary is not checkable (the
/// hold-back window and the scanner hold far less).
pub const MAX_TRAIL_BYTES: usize = 256 * 1024;

/// The evidence for `no_silent_correction` ([`TextTrail::delivery`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TextDelivery {
    /// Bytes of text the model produced (after rewinds).
    pub produced_bytes: usize,
    /// Bytes of that text haltd sent (or put in the batch body).
    pub sent_bytes: usize,
    /// The first offset where a sent byte was not the produced one, if any.
    pub first_difference: Option<usize>,
    /// The turn completed: everything produced must have been sent.
    pub completed: bool,
}

/// One turn's produced text not sent yet, and how what was sent compares with it.
#[derive(Clone, Debug, Default)]
pub struct TextTrail {
    /// Produced bytes from offset `sent` on.
    unsent: Vec<u8>,
    produced: usize,
    sent: usize,
    first_difference: Option<usize>,
    /// The unsent text went past [`MAX_TRAIL_BYTES`]: no comparison.
    overflow: bool,
}

impl TextTrail {
    /// The model produced `text` (the next token's, after the detectors passed it).
    pub fn produced(&mut self, text: &str) {
        self.produced += text.len();
        if self.overflow || self.unsent.len() + text.len() > MAX_TRAIL_BYTES {
            self.overflow = true;
            return;
        }
        self.unsent.extend_from_slice(text.as_bytes());
    }

    /// haltd sent `text` as the next piece of the turn's text.
    pub fn sent(&mut self, text: &str) {
        if self.overflow {
            return;
        }
        let at = self.sent;
        self.sent += text.len();
        let n = text.len().min(self.unsent.len());
        if self.first_difference.is_none() {
            let produced = &self.unsent[..n];
            if n < text.len() || produced != text.as_bytes() {
                let off = text
                    .bytes()
                    .zip(produced)
                    .position(|(a, b)| a != *b)
                    .unwrap_or(n);
                self.first_difference = Some(at + off);
            }
        }
        // Compared: those bytes are never needed again.
        self.unsent.drain(..n);
    }

    /// The text past `keep` (a text offset at or after everything sent) was dropped unsent
    /// by a rewind.
    pub fn rewind(&mut self, keep: usize) {
        if keep < self.sent || keep > self.produced {
            return;
        }
        self.produced = keep;
        self.unsent.truncate(keep - self.sent);
    }

    /// The evidence, or `None` when the text went past [`MAX_TRAIL_BYTES`].
    pub fn delivery(&self, completed: bool) -> Option<TextDelivery> {
        (!self.overflow).then_some(TextDelivery {
            produced_bytes: self.produced,
            sent_bytes: self.sent,
            first_difference: self.first_difference,
            completed,
        })
    }
}

/// `no_silent_correction`: holds iff every sent byte is the produced byte at its offset, and,
/// for a completed turn, every produced byte was sent.
pub fn no_silent_correction(ctx: &super::SafetyContext) -> SafetyCheckResult {
    let id = NO_SILENT_CORRECTION;
    let Some(d) = ctx.text_delivery else {
        return missing(
            id,
            "text_delivery (the turn's text went past the bytes kept to compare it)",
        );
    };
    let result = if let Some(at) = d.first_difference {
        SafetyCheckResult::violated(
            id,
            format!("the text sent differs from the text the model produced at byte {at}, with no typed event saying so"),
        )
    } else if d.sent_bytes > d.produced_bytes {
        SafetyCheckResult::violated(id, "more text was sent than the model produced")
    } else if d.completed && d.sent_bytes < d.produced_bytes {
        SafetyCheckResult::violated(
            id,
            "the turn completed, but text the model produced was never sent",
        )
    } else if d.completed {
        SafetyCheckResult::upheld(id, "the text sent is the text the model produced")
    } else {
        SafetyCheckResult::upheld(
            id,
            "the text sent is the start of the text the model produced, and the turn ended with a typed terminal event or error object",
        )
    };
    result
        .with_evidence("produced_bytes", d.produced_bytes.to_string())
        .with_evidence("sent_bytes", d.sent_bytes.to_string())
        .with_evidence("completed", d.completed.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::safety::SafetyContext;

    fn verdict(trail: &TextTrail, completed: bool) -> SafetyCheckResult {
        no_silent_correction(&SafetyContext {
            text_delivery: trail.delivery(completed),
            ..SafetyContext::default()
        })
    }

    #[test]
    fn text_sent_as_produced_is_upheld_and_checkable() {
        let mut t = TextTrail::default();
        for piece in ["Hel", "lo ", "world"] {
            t.produced(piece);
            t.sent(piece);
        }
        let r = verdict(&t, true);
        assert!(r.upheld && r.runtime_checkable, "{r:?}");
    }

    #[test]
    fn a_changed_byte_is_a_silent_correction() {
        let mut t = TextTrail::default();
        t.produced("the answer is 42");
        t.sent("the answer is 43");
        let r = verdict(&t, true);
        assert!(!r.upheld && r.runtime_checkable, "{r:?}");
        assert!(r.reason.contains("at byte 15"), "{}", r.reason);
    }

    #[test]
    fn produced_text_dropped_from_a_completed_turn_is_a_silent_correction() {
        let mut t = TextTrail::default();
        t.produced("kept and dropped");
        t.sent("kept");
        assert!(!verdict(&t, true).upheld);
        // A halted turn ends typed: a prefix is what it may send.
        assert!(verdict(&t, false).upheld);
    }

    #[test]
    fn a_rewind_takes_back_unsent_text() {
        let mut t = TextTrail::default();
        t.produced("ab");
        t.sent("ab");
        t.produced("cd");
        t.rewind(2);
        t.produced("xy");
        t.sent("xy");
        assert!(verdict(&t, true).upheld);
    }

    #[test]
    fn sent_text_is_not_kept_however_long_the_turn() {
        let mut t = TextTrail::default();
        let piece = "x".repeat(4096);
        for _ in 0..(2 * MAX_TRAIL_BYTES / piece.len()) {
            t.produced(&piece);
            t.sent(&piece);
        }
        assert!(t.unsent.is_empty());
        let r = verdict(&t, true);
        assert!(r.upheld && r.runtime_checkable, "{r:?}");
    }

    #[test]
    fn past_the_bound_of_unsent_text_it_is_not_checkable() {
        let mut t = TextTrail::default();
        let big = "x".repeat(MAX_TRAIL_BYTES);
        t.produced(&big);
        t.produced("y");
        let r = verdict(&t, true);
        assert!(r.upheld && !r.runtime_checkable, "{r:?}");
        assert!(r.reason.contains("text_delivery"), "{}", r.reason);
    }
}
