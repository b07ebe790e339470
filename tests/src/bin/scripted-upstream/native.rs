//! The script run of the native surfaces, `/v1/responses` and `/v1/messages`: pacing, the
//! reasoning / answer / tool-call phases, the scripts' ends and the token count live here once;
//! what each step looks like on the wire is a [`Shape`] (`responses.rs`, `messages.rs`).
//!
//! Events are built as `serde_json::Value`s, not written by hand like chat's chunks: these
//! surfaces serve tests, not the token-rate benches.

use std::{io, ops::Range, sync::atomic::Ordering, time::Duration};

use super::{
    call_args, load_tokens, pause, pause_aligned, split_args, Kind, Out, Outcome, Plan, Progress,
    Tok,
};

/// The SSE events of one step, written one HTTP chunk each (as uvicorn writes each event that
/// vLLM yields).
pub(super) type Events = Vec<String>;

/// One surface's events for the steps of a streamed turn. A shape keeps its own state (which
/// block is open, the text so far) and closes an open block when another kind of step comes.
pub(super) trait Shape {
    /// Before any output (Responses: `response.created`, `response.in_progress`; Messages:
    /// `message_start`).
    fn start(&mut self, ev: &mut Events);
    /// A chunk of tokens `toks` (their texts in `texts`), the model's reasoning or its answer.
    fn tokens(&mut self, ev: &mut Events, reasoning: bool, texts: &str, toks: &[Tok]);
    /// Tool call `call` begins (its name, no arguments yet).
    fn call_start(&mut self, ev: &mut Events, call: usize);
    /// A piece of the open call's arguments.
    fn call_args(&mut self, ev: &mut Events, piece: &str);
    /// Closes the open block and ends the turn; `output_tokens` were generated.
    fn finish(&mut self, ev: &mut Events, output_tokens: usize);
    /// `error_event`: the surface's error in the stream, after which it ends.
    fn error(&mut self, ev: &mut Events, output_tokens: usize);
}

async fn flush(out: &mut Out<'_>, ev: &mut Events) -> io::Result<()> {
    for e in ev.drain(..) {
        out.part(e.as_bytes()).await?;
    }
    Ok(())
}

/// A streamed turn on a native surface, as `run_stream` runs chat's.
pub(super) async fn run_stream(
    p: &Plan,
    out: &mut Out<'_>,
    prog: &Progress,
    shape: &mut impl Shape,
) -> io::Result<Outcome> {
    let s = &p.script;
    out.stream_head().await?;
    let mut ev = Events::new();
    shape.start(&mut ev);
    flush(out, &mut ev).await?;
    pause(s.first).await;
    content(p, out, prog, shape, 0..s.tokens).await?;
    match s.kind {
        // `llama_error` is refused for these surfaces (`Plan::new`).
        Kind::Normal | Kind::Bench | Kind::SlowHead | Kind::Status | Kind::LlamaError => {}
        Kind::ToolCall => {
            calls(p, out, prog, shape).await?;
            if s.die_after_tools {
                pause(Duration::from_millis(300)).await;
                return Ok(Outcome::Died);
            }
        }
        Kind::ErrorEvent => {
            shape.error(&mut ev, prog.tokens.load(Ordering::Relaxed));
            flush(out, &mut ev).await?;
            prog.finished.store(true, Ordering::Relaxed);
            out.end().await?;
            return Ok(Outcome::Completed);
        }
        Kind::Garbage => {
            out.part(b"data: {this is not json\n\n").await?;
            content(p, out, prog, shape, s.tokens..s.tokens + s.after).await?;
        }
        Kind::Stall => {
            prog.stalling.store(true, Ordering::Relaxed);
            pause(s.hold).await;
            return Ok(Outcome::Stalled);
        }
        Kind::Die => return Ok(Outcome::Died),
    }
    shape.finish(&mut ev, prog.tokens.load(Ordering::Relaxed));
    flush(out, &mut ev).await?;
    prog.finished.store(true, Ordering::Relaxed);
    out.end().await?;
    Ok(Outcome::Completed)
}

/// Tokens `range`, `per_chunk` to a step (never mixing reasoning and answer), each step after
/// `pace` (or at the next multiple of it, `align=1`).
async fn content(
    p: &Plan,
    out: &mut Out<'_>,
    prog: &Progress,
    shape: &mut impl Shape,
    range: Range<usize>,
) -> io::Result<()> {
    let s = &p.script;
    let (mut texts, mut toks) = (String::new(), Vec::new());
    let mut ev = Events::new();
    let mut i = range.start;
    while i < range.end {
        let mut end = (i + s.per_chunk).min(range.end);
        if i < s.reasoning {
            end = end.min(s.reasoning);
        }
        if s.align {
            pause_aligned(s.pace).await;
        } else {
            pause(s.pace).await;
        }
        load_tokens(s, i..end, &mut texts, &mut toks);
        shape.tokens(&mut ev, i < s.reasoning, &texts, &toks);
        flush(out, &mut ev).await?;
        prog.tokens.fetch_add(end - i, Ordering::Relaxed);
        i = end;
    }
    Ok(())
}

/// The script's tool calls: each call's start, then its arguments in `args_chunks` pieces,
/// every step after `pace`; each step counts as a token, as chat's deltas do.
async fn calls(
    p: &Plan,
    out: &mut Out<'_>,
    prog: &Progress,
    shape: &mut impl Shape,
) -> io::Result<()> {
    let s = &p.script;
    let mut ev = Events::new();
    for (call, args) in call_args(s) {
        pause(s.pace).await;
        shape.call_start(&mut ev, call);
        flush(out, &mut ev).await?;
        prog.tokens.fetch_add(1, Ordering::Relaxed);
        for piece in split_args(args, s.args_chunks) {
            pause(s.pace).await;
            shape.call_args(&mut ev, piece);
            flush(out, &mut ev).await?;
            prog.tokens.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(())
}

/// The whole turn's texts, for the batch answers: the reasoning, the answer and the answer's
/// tokens (to describe their logprobs).
#[derive(Debug)]
pub(super) struct Whole {
    pub(super) reasoning: String,
    pub(super) answer: String,
    pub(super) answer_toks: Vec<Tok>,
}

impl Whole {
    pub(super) fn of(p: &Plan) -> Self {
        let s = &p.script;
        let cut = s.reasoning.min(s.tokens);
        let (mut reasoning, mut toks) = (String::new(), Vec::new());
        load_tokens(s, 0..cut, &mut reasoning, &mut toks);
        let mut answer = String::new();
        load_tokens(s, cut..s.tokens, &mut answer, &mut toks);
        Self {
            reasoning,
            answer,
            answer_toks: toks,
        }
    }
}
