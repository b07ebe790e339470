//! The encode phase of the turn pipeline (`pipeline.rs`): a token's SSE event straight from
//! the source when nothing is held, a frame the exfiltration scanner released, and the tokens
//! a batch turn keeps for its one final body. Without I/O: each writes into the connection's
//! frame buffer or the turn, and the pipeline accounts and sends.

use crate::dataplane::{
    conn::{outbox::frame, Conn},
    turn::hold::{Pending, PendingKind},
    turn::{HeldToken, Turn},
};
use crate::{
    source::{Produced, Tokens},
    wire::{Channel, Token, ToolCallDelta, MAX_TOP_LOGPROBS},
};

/// Alternatives of one token frame, on the stack.
type Tops<'a> = [(&'a str, f32); MAX_TOP_LOGPROBS as usize];

/// Copies up to `limit` alternatives into `tops`; how many.
fn fill_top<'a>(
    tops: &mut Tops<'a>,
    top: impl Iterator<Item = (&'a str, f32)>,
    limit: u32,
) -> usize {
    let mut n = 0;
    for (slot, alt) in tops.iter_mut().zip(top).take(limit as usize) {
        *slot = alt;
        n += 1;
    }
    n
}

/// Encode: the token frame of a text that is one token (of at most the frame cap), straight
/// from the source.
pub(in crate::dataplane) fn encode_token(
    turn: &Turn,
    out: &mut Vec<u8>,
    t: &Produced,
    offset: usize,
) {
    let mut tops: Tops<'_> = [("", 0.0); MAX_TOP_LOGPROBS as usize];
    let limit = turn.top_logprobs;
    let (logprob, n) = match &t.tokens {
        Tokens::Builtin { logprob, top } => {
            let n = fill_top(&mut tops, top.as_slice().iter().copied(), limit);
            (*logprob, n)
        }
        Tokens::Upstream(toks) => toks.first().map_or((f32::NEG_INFINITY, 0), |tok| {
            let alts = tok.top.iter().map(|(s, l)| (s.as_str(), *l));
            let n = fill_top(&mut tops, alts, limit);
            (tok.logprob.unwrap_or(f32::NEG_INFINITY), n)
        }),
    };
    let tok = Token {
        text: &t.text,
        logprob,
        top: &tops[..n],
    };
    turn.enc
        .token_event(out, tok, offset, !turn.first_frame_sent, t.channel);
}

/// A batch turn keeps its tokens for the final frame. (Allocates per token: the batch path
/// keeps every token for the final body.)
pub(in crate::dataplane) fn hold_for_batch(turn: &mut Turn, t: Produced, offset: usize) {
    match t.channel {
        Channel::Content => turn.held_text.push_str(&t.text),
        Channel::Reasoning => turn.held_reasoning.push_str(&t.text),
    }
    turn.note_output(&t.text);
    // Into the batch body: what the client gets if the turn completes.
    turn.trail.sent(&t.text);
    let channel = t.channel;
    match t.tokens {
        Tokens::Builtin { logprob, top } => turn.held_tokens.push(HeldToken {
            text: t.text.into_owned(),
            logprob,
            top: owned_top(top.as_slice()),
            offset,
            channel,
        }),
        Tokens::Upstream(toks) => {
            let mut off = offset;
            for t in toks {
                let len = t.text.len();
                turn.held_tokens.push(HeldToken {
                    text: t.text,
                    logprob: t.logprob.unwrap_or(f32::NEG_INFINITY),
                    top: t.top,
                    offset: off,
                    channel,
                });
                off += len;
            }
        }
    }
}

/// A built-in token's alternatives as owned strings (for a token that is kept: batch or held).
pub(in crate::dataplane) fn owned_top(top: &[(&'static str, f32)]) -> Vec<(String, f32)> {
    top.iter().map(|(t, l)| ((*t).to_owned(), *l)).collect()
}

/// Encode: one released frame into the frame buffer, as one token event; false without a
/// turn (nothing encoded).
pub(in crate::dataplane) fn encode_pending(conn: &mut Conn, mut p: Pending) -> bool {
    let Some(turn) = conn.turn.as_mut() else {
        return false;
    };
    debug_assert_eq!(
        conn.emit.staged(),
        0,
        "staged events go out before a held frame"
    );
    let out = frame(&mut conn.wbuf);
    let first = !turn.first_frame_sent;
    // The frame's text: the whole entry, or what is left of it after earlier frames.
    let started = match &mut p.kind {
        PendingKind::ToolCall {
            header: Some(h), ..
        } => std::mem::take(&mut h.started),
        _ => Vec::new(),
    };
    let text = &p.text[p.pos..];
    let offset = p.offset + p.pos;
    match p.kind {
        PendingKind::Content { logprob, ref top } => {
            let mut tops: Tops<'_> = [("", 0.0); MAX_TOP_LOGPROBS as usize];
            let alts = top.iter().map(|(s, l)| (s.as_str(), *l));
            let n = fill_top(&mut tops, alts, turn.top_logprobs);
            let tok = Token {
                text,
                logprob,
                top: &tops[..n],
            };
            turn.enc.token_event(out, tok, offset, first, p.channel);
            turn.trail.sent(text);
        }
        PendingKind::Chars => {
            turn.enc.text_event(out, text, first, p.channel);
            turn.trail.sent(text);
        }
        PendingKind::ToolCall {
            index, ref header, ..
        } => {
            let call = ToolCallDelta {
                index,
                id: header.as_ref().and_then(|h| h.id.as_deref()),
                name: header.as_ref().and_then(|h| h.name.as_deref()),
                arguments: if header.is_some() { "" } else { text },
            };
            turn.enc.tool_call_event(out, call, first);
        }
    }
    turn.first_frame_sent = true;
    turn.note_output(text);
    if !started.is_empty() {
        turn.tools_in_flight = started;
    }
    conn.emit.stage(p.arrived_ns);
    true
}
