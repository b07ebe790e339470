//! The post-hoc fallback (spec 003: "On provider streams without decode control, the
//! fallback is post-hoc: finish the stream, then run one grounded revise pass gated by the
//! same threshold"; issue 16 point 4) for an upstream configured with
//! `[grounding] continuation = "none"`.
//!
//! Nothing is held back (there is nothing to rewind with), so the client reads the reply as
//! it comes. The first intervene-mode breach notes its span (the last `hold_back` tokens'
//! text, which the client has already); once the text is complete and every frame went out,
//! the turn pauses for one grounding round (the same thread, deadline and halt rules as a
//! mid-stream round, `ground.rs`), and what it finds goes out **after** the reply, in one
//! more chunk before the final one: no choices, the evidence under `haltd_grounding`
//! ([`annotation`]; docs/wire-format.md). Text the client already has is never rewritten.

use std::io;

use serde_json::{json, Value};

use crate::dataplane::ground;
use crate::dataplane::turn::Turn;
use crate::dataplane::Step;
use crate::grounding::Round;

/// The first breach of a post-hoc turn: its span (the window's text) is kept for the round
/// after the reply. Later breaches change nothing (one revise pass).
pub(in crate::dataplane) fn note_span(turn: &mut Turn) {
    let Some(start) = turn.hold.back.as_ref().map(|b| b.start()) else {
        return;
    };
    if turn.out_text_truncated || !turn.tool_calls.is_empty() {
        return;
    }
    // The turn's text so far: what went out and what waits in the queue (one copy, once per
    // turn).
    let mut text = turn.out_text.clone();
    let sent = text.len();
    text.push_str(&ground::queued_text(turn, sent, turn.hold.scanned).unwrap_or_default());
    let Some(g) = turn.grounding.as_mut() else {
        return;
    };
    if g.post_hoc_span.is_some() || g.rounds > 0 {
        return;
    }
    if let Some(span) = text.get(start..).filter(|s| !s.is_empty()) {
        g.post_hoc_span = Some(span.to_owned());
    }
}

/// What goes after the reply: the round's evidence and where it came from.
pub(in crate::dataplane) fn annotation(round: &Round) -> Value {
    let arm = round
        .attempts
        .iter()
        .find(|a| a.outcome == crate::grounding::ArmOutcome::Grounded)
        .map(|a| a.arm);
    json!({
        "revision": "post_hoc",
        "class": round.class,
        "arm": arm,
        "evidence": round.snippets,
    })
}

impl Step<'_> {
    /// At the end of a post-hoc turn's text: the round about the noted span, if one is due
    /// (`true`: the turn is parked until it answers; the final frame follows then).
    pub(in crate::dataplane) fn post_hoc_round(&mut self) -> io::Result<bool> {
        let Some(turn) = self.conn.turn.as_mut() else {
            return Ok(false);
        };
        let Some(g) = turn.grounding.as_mut().filter(|g| g.post_hoc) else {
            return Ok(false);
        };
        let Some(span) = g.post_hoc_span.take() else {
            return Ok(false);
        };
        if self.io.shared.grounding.is_none() {
            return Ok(false);
        }
        let context = turn.out_text.clone();
        self.start_round(span, context)?;
        Ok(true)
    }
}
