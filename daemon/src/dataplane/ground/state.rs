//! A turn's grounding as state, without the steps that act on it: what its rounds were, the
//! round in flight, and what a proxied turn's request is re-issued from. The turn holds it
//! (`turn.grounding`); the steps are in `ground.rs` and `ground/continuation.rs`.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Instant,
};

use serde_json::Value;

use crate::grounding::plan::{RoundOutcome, RoundRecord};

/// What a proxied turn needs to re-issue its request.
#[derive(Debug)]
pub(in crate::dataplane) struct ResumeSeed {
    /// The upstream request body as first sent.
    pub(in crate::dataplane) body: Vec<u8>,
    pub(in crate::dataplane) endpoint: crate::wire::Endpoint,
    pub(in crate::dataplane) api_path: &'static str,
    pub(in crate::dataplane) authorization: Option<String>,
    pub(in crate::dataplane) system_prompt: String,
}

/// A round in flight for a turn.
#[derive(Debug)]
pub(in crate::dataplane) struct Waiting {
    pub(super) cancel: Arc<AtomicBool>,
    pub(super) span: String,
    pub(super) started: Instant,
}

/// A turn's grounding: its rounds so far and the one in flight.
#[derive(Debug, Default)]
pub(in crate::dataplane) struct TurnGrounding {
    /// Rounds started (at most `max_rounds`).
    pub(in crate::dataplane) rounds: u32,
    pub(in crate::dataplane) records: Vec<RoundRecord>,
    pub(in crate::dataplane) waiting: Option<Waiting>,
    /// The user's last message, for the query's context.
    pub(in crate::dataplane) prompt: String,
    /// A proxied turn: what its request is re-issued from (`ground/continuation.rs`).
    pub(in crate::dataplane) seed: Option<ResumeSeed>,
    /// The continuation request, waiting until the old upstream socket is idle.
    pub(in crate::dataplane) reissue: Option<Vec<u8>>,
    /// No continuation: the post-hoc fallback (`ground/post_hoc.rs`). Nothing is held; the
    /// first breach's span is grounded once the text is complete.
    pub(in crate::dataplane) post_hoc: bool,
    pub(in crate::dataplane) post_hoc_span: Option<String>,
    /// The post-hoc round's evidence, sent after the reply.
    pub(in crate::dataplane) annotation: Option<Value>,
}

impl TurnGrounding {
    /// Drops the round in flight, if any: it is recorded as cancelled (a halt came first).
    pub(in crate::dataplane) fn cancel(&mut self) {
        if let Some(w) = self.waiting.take() {
            w.cancel.store(true, Ordering::Release);
            let rec =
                RoundRecord::without_result(&w.span, w.started.elapsed(), RoundOutcome::Cancelled);
            self.records.push(rec);
        }
    }
}
