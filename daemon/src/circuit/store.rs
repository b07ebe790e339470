//! What TokenCircuit remembers per conversation: only what the transcript cannot carry.
//!
//! The circuit's state is rebuilt from each request's own transcript (`transcript.rs`), so
//! it is right after a restart with no store at all. Three things are not in a transcript:
//! time (when haltd let a call out to the client, when a request carrying a call's result
//! arrived: the backoff clock), which of the calls it let out the kernel accepted (a call
//! halted before its first frame was delivered was never dispatched), and the artifacts of
//! haltd's interventions (the operator's view, `haltctl circuit show`). This store keeps
//! them, in memory only:
//!
//! * a conversation is named by [`ConversationId`]: the client's `x-haltd-conversation-id`
//!   header, else a digest of the transcript's stable prefix (the messages before the first
//!   assistant message), both under the caller's key fingerprint;
//! * at most `capacity` conversations (`[tool_circuit] conversations`, default
//!   [`DEFAULT_CONVERSATIONS`]); a new one evicts the one used least recently;
//! * per conversation at most [`MAX_CALLS`] instants of each kind (the oldest dropped) and
//!   the last [`MAX_ARTIFACTS`] intervention artifacts.
//!
//! It also remembers each failed call a transcript showed ([`Memory`]), so that a later
//! transcript that trimmed or flattened it away does not restore a budget.
//!
//! A conversation evicted or lost in a restart loses its clock: its past retries are then
//! charged one unit each, never the premature-retry surcharge (its artifacts stay in the
//! ledger), and every call of it counts as dispatched (fails closed:
//! [`Timeline::dispatched`]). Eviction never re-opens a refused key: a conversation evicted
//! while one of its keys is exhausted keeps the failed calls of that key's tool in a separate
//! set of at most [`MAX_RETAINED`] conversations, which it gets back when it returns. When
//! that set is full, the conversation retained longest ago is dropped, counted in
//! `haltd_tool_circuit_refusals_forgotten_total` and logged. One mutex, taken when a request
//! arrives and when a turn's calls are judged, never per token.

pub mod persist;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::Serialize;

use prometheus_client::metrics::{counter::Counter, gauge::Gauge};

use super::artifact::DiagnosticArtifact;
pub use super::conversation::{ConversationId, IdSource};
use super::memory::{FailedCall, Memory};
use super::transcript::Timeline;
use crate::state::{Change, CircuitRow, StateStore};
use persist::WallClock;

/// The request header that names a conversation.
pub const CONVERSATION_HEADER: &str = "x-haltd-conversation-id";
pub use super::policy::DEFAULT_CONVERSATIONS;
/// The most conversations `[tool_circuit] conversations` may ask for.
pub const MAX_CONVERSATIONS: usize = 1_000_000;
/// Instants kept per conversation and kind (emitted, arrived).
pub const MAX_CALLS: usize = 512;
/// Intervention artifacts kept per conversation.
pub const MAX_ARTIFACTS: usize = 8;
/// Evicted conversations whose refused keys are kept.
pub const MAX_RETAINED: usize = 4096;

/// One conversation's memory.
#[derive(Debug)]
struct Entry {
    timeline: Timeline,
    /// The failed calls its transcripts showed.
    memory: Memory,
    /// haltd's interventions (halts, answers without the model), oldest first.
    artifacts: VecDeque<DiagnosticArtifact>,
    /// The open keys as of the last request or judged turn.
    open: Vec<DiagnosticArtifact>,
    last_seen: Instant,
    tick: u64,
    /// Turns haltd streamed in it, and their generated tokens (the tokens-saved estimate).
    turns: u64,
    tokens: u64,
    /// Tokens not generated because haltd answered without the model.
    tokens_saved: u64,
}

impl Entry {
    fn empty(now: Instant) -> Self {
        Entry {
            timeline: Timeline::default(),
            memory: Memory::default(),
            artifacts: VecDeque::new(),
            open: Vec::new(),
            last_seen: now,
            tick: 0,
            turns: 0,
            tokens: 0,
            tokens_saved: 0,
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    tick: u64,
    map: HashMap<ConversationId, Entry>,
    /// Least recently used first.
    lru: BTreeMap<u64, ConversationId>,
    evicted: u64,
    /// Evicted conversations that held an exhausted key: the failed calls of its tools.
    retained: HashMap<ConversationId, Memory>,
    /// `retained`'s conversations, retained longest ago first.
    retained_order: VecDeque<ConversationId>,
}

/// What the store counts for `/metrics` (`circuit/metrics.rs` registers them).
#[derive(Clone, Debug, Default)]
pub struct StoreCounters {
    /// `haltd_tool_circuit_refusals_retained`: evicted conversations kept for their refused
    /// keys.
    pub retained: Gauge,
    /// `haltd_tool_circuit_refusals_forgotten_total`: retained conversations dropped because
    /// the set was full.
    pub forgotten: Counter,
}

/// The operator's view of one conversation.
#[derive(Clone, Debug, Serialize)]
pub struct ConversationView {
    #[serde(flatten)]
    pub id: ConversationId,
    /// Seconds since its last request or judged turn.
    pub idle_s: f64,
    /// Its open keys: class, budget, units charged, receipts.
    pub open: Vec<DiagnosticArtifact>,
    /// haltd's last interventions in it, oldest first.
    pub artifacts: Vec<DiagnosticArtifact>,
    /// Calls haltd let out whose instant it keeps (the backoff clock).
    pub calls_timed: usize,
    /// Tokens not generated because haltd answered without the model (an estimate).
    pub tokens_saved: u64,
}

/// The bounded in-memory store.
#[derive(Debug)]
pub struct ConversationStore {
    capacity: usize,
    inner: Mutex<Inner>,
    counters: StoreCounters,
    /// Where each change is kept (`None`: in memory only, as in unit tests).
    persist: Option<Arc<StateStore>>,
    /// The dispatched calls of failed turns, until reconciled.
    pub dispatched: super::dispatched::Dispatched,
}

impl Default for ConversationStore {
    fn default() -> Self {
        ConversationStore::new(DEFAULT_CONVERSATIONS)
    }
}

/// Inserts an instant, dropping the oldest one past [`MAX_CALLS`]; the id dropped, if any.
fn note(map: &mut HashMap<String, Instant>, id: &str, at: Instant) -> Option<String> {
    if map.contains_key(id) {
        return None;
    }
    let mut dropped = None;
    if map.len() >= MAX_CALLS {
        let oldest = map.iter().min_by_key(|(_, t)| **t).map(|(k, _)| k.clone());
        if let Some(k) = oldest {
            map.remove(&k);
            dropped = Some(k);
        }
    }
    map.insert(id.to_owned(), at);
    dropped
}

impl ConversationStore {
    /// The store `[tool_circuit]` asks for (the default size without one).
    pub fn for_policy(policy: Option<&super::CircuitPolicy>) -> Self {
        ConversationStore::new(policy.map_or(DEFAULT_CONVERSATIONS, |p| p.conversations))
    }

    pub fn new(capacity: usize) -> Self {
        ConversationStore {
            capacity: capacity.max(1),
            inner: Mutex::new(Inner::default()),
            counters: StoreCounters::default(),
            persist: None,
            dispatched: super::dispatched::Dispatched::default(),
        }
    }

    /// The store, with `dispatched` as its registry of dispatched calls.
    #[must_use]
    pub fn with_dispatched(mut self, dispatched: super::dispatched::Dispatched) -> Self {
        self.dispatched = dispatched;
        self
    }

    /// The store, keeping every change of what it remembers in `state` from now on (TokenCircuit
    /// forgets nothing in a restart).
    #[must_use]
    pub fn persisting_to(mut self, state: Arc<StateStore>) -> Self {
        self.persist = Some(state);
        self
    }

    /// Takes back what the state store kept (at start, before any request): the conversations
    /// used most recently, up to the capacity (the others evicted as usual), and the evicted
    /// ones kept for their refused keys. Writes nothing. `Err`: a row it cannot read.
    pub fn restore(&self, rows: &[CircuitRow], clock: &WallClock) -> Result<(), String> {
        let mut kept = Vec::new();
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        for row in rows {
            let conv = persist::conversation(row)?;
            if row.retained {
                let memory = persist::retained(row)?;
                inner.retained_order.push_back(conv.clone());
                inner.retained.insert(conv, memory);
            } else {
                let (entry, seen) = persist::entry(row, clock)?;
                kept.push((seen, conv, entry));
            }
        }
        kept.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
        for (_, conv, mut entry) in kept {
            inner.tick += 1;
            entry.tick = inner.tick;
            inner.lru.insert(entry.tick, conv.clone());
            inner.map.insert(conv, entry);
            while inner.map.len() > self.capacity && self.evict_lru(&mut inner) {}
        }
        self.counters.retained.set(inner.retained.len() as i64);
        Ok(())
    }

    /// Queues a change for the state store (under the store's lock, once per request or judged
    /// turn, never per token: the row is serialized here).
    fn keep(&self, change: impl FnOnce() -> Change) {
        if let Some(state) = &self.persist {
            state.apply(None, vec![change()]);
        }
    }

    fn forget(&self, conv: &ConversationId) {
        self.keep(|| {
            let source = persist::source_str(conv.source).to_owned();
            Change::CircuitGone(conv.key.clone(), conv.id.clone(), source)
        });
    }

    /// The store, counting into `counters` (the ones `/metrics` shows).
    #[must_use]
    pub fn counting_into(mut self, counters: StoreCounters) -> Self {
        self.counters = counters;
        self
    }

    /// Runs `f` on the conversation's entry, created (evicting the least recently used one
    /// when full) if absent, and marks it used.
    fn with<R>(&self, conv: &ConversationId, now: Instant, f: impl FnOnce(&mut Entry) -> R) -> R {
        self.with_kept(conv, now, false, f)
    }

    /// [`Self::with`] for a change the state store keeps (`f` changes the clock, the failed
    /// calls or the counts; the open keys and the artifacts are the operator's view, and are
    /// kept with the next such change).
    fn with_saved<R>(
        &self,
        conv: &ConversationId,
        now: Instant,
        f: impl FnOnce(&mut Entry) -> R,
    ) -> R {
        self.with_kept(conv, now, true, f)
    }

    fn with_kept<R>(
        &self,
        conv: &ConversationId,
        now: Instant,
        save: bool,
        f: impl FnOnce(&mut Entry) -> R,
    ) -> R {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let inner = &mut *inner;
        inner.tick += 1;
        let tick = inner.tick;
        if !inner.map.contains_key(conv) {
            while inner.map.len() >= self.capacity && self.evict_lru(inner) {
                inner.evicted += 1;
            }
            let memory = inner.retained.remove(conv).unwrap_or_default();
            if !memory.is_empty() {
                inner.retained_order.retain(|c| c != conv);
                self.counters.retained.set(inner.retained.len() as i64);
            }
            inner.map.insert(
                conv.clone(),
                Entry {
                    memory,
                    tick,
                    ..Entry::empty(now)
                },
            );
        }
        let entry = inner.map.get_mut(conv).expect("present: inserted above");
        inner.lru.remove(&entry.tick);
        inner.lru.insert(tick, conv.clone());
        entry.tick = tick;
        entry.last_seen = entry.last_seen.max(now);
        let r = f(entry);
        if save {
            self.keep(|| Change::Circuit(persist::row(conv, entry, &WallClock::now())));
        }
        r
    }

    /// Evicts the conversation used least recently, keeping its refused keys; false when none
    /// is left.
    fn evict_lru(&self, inner: &mut Inner) -> bool {
        let Some((_, victim)) = inner.lru.pop_first() else {
            return false;
        };
        if let Some(gone) = inner.map.remove(&victim) {
            self.retain_refusals(inner, victim, &gone);
        }
        true
    }

    /// Keeps what an evicted conversation knows of its exhausted keys (the failed calls of
    /// their tools), dropping the conversation retained longest ago when the set is full.
    fn retain_refusals(&self, inner: &mut Inner, conv: ConversationId, gone: &Entry) {
        let tools: Vec<&str> = gone
            .open
            .iter()
            .filter(|a| a.budget_exhausted)
            .map(|a| a.equivalence_key.tool_name.as_str())
            .collect();
        let kept = gone.memory.only_tools(&tools);
        if kept.is_empty() {
            self.forget(&conv);
            return;
        }
        while inner.retained.len() >= MAX_RETAINED {
            let Some(oldest) = inner.retained_order.pop_front() else {
                break;
            };
            inner.retained.remove(&oldest);
            self.forget(&oldest);
            self.counters.forgotten.inc();
            tracing::warn!(
                conversation = %oldest.id,
                key = %oldest.key,
                "TokenCircuit forgot the refused keys of an evicted conversation: {MAX_RETAINED} \
                 evicted conversations with refused keys are kept; raise [tool_circuit] \
                 conversations"
            );
        }
        self.keep(|| Change::Circuit(persist::retained_row(&conv, &kept)));
        inner.retained_order.push_back(conv.clone());
        inner.retained.insert(conv, kept);
        self.counters.retained.set(inner.retained.len() as i64);
    }

    /// A request arrived at `now` carrying the results `answered`: each one not seen before
    /// arrived now. Returns the conversation's clock and the failed calls it remembers, to
    /// rebuild its circuit with.
    pub fn arrive(
        &self,
        conv: &ConversationId,
        answered: &[&str],
        now: Instant,
    ) -> (Timeline, Memory) {
        self.with_saved(conv, now, |e| {
            for id in answered {
                let _ = note(&mut e.timeline.arrived, id, now);
            }
            (e.timeline.clone(), e.memory.clone())
        })
    }

    /// A request's transcript showed the failed calls `failed`: remembered from now on.
    pub fn remember(&self, conv: &ConversationId, failed: Vec<FailedCall>, now: Instant) {
        if failed.is_empty() {
            return;
        }
        self.with_saved(conv, now, |e| {
            for f in failed {
                e.memory.remember(f);
            }
        });
    }

    /// haltd let the calls `ids` out to the client at `now`.
    pub fn emitted<'a>(
        &self,
        conv: &ConversationId,
        ids: impl IntoIterator<Item = &'a str>,
        now: Instant,
    ) {
        self.with_saved(conv, now, |e| {
            for id in ids {
                // A call forgotten is no longer known delivered either: it fails closed.
                if let Some(old) = note(&mut e.timeline.emitted, id, now) {
                    e.timeline.delivered.remove(&old);
                }
            }
        });
    }

    /// The kernel accepted the frame that started the calls `ids` (the turn's dispatched
    /// calls): they reached the client. Only calls haltd let out count (the others are
    /// unknown, and count as dispatched anyway).
    pub fn delivered<'a>(
        &self,
        conv: &ConversationId,
        ids: impl IntoIterator<Item = &'a str>,
        now: Instant,
    ) {
        self.with_saved(conv, now, |e| {
            for id in ids {
                if e.timeline.emitted.contains_key(id) && !e.timeline.delivered.contains(id) {
                    e.timeline.delivered.insert(id.to_owned());
                }
            }
        });
    }

    /// A turn of it generated `tokens` (its text and tool calls).
    pub fn generated(&self, conv: &ConversationId, tokens: u64, now: Instant) {
        self.with_saved(conv, now, |e| {
            e.turns += 1;
            e.tokens += tokens;
        });
    }

    /// haltd answers a request of it without the model: the tokens that saves, estimated as
    /// its mean tokens per turn so far (`None` before its first turn), added to its total.
    pub fn answered(&self, conv: &ConversationId, now: Instant) -> Option<u64> {
        self.with_saved(conv, now, |e| {
            let saved = e.tokens.checked_div(e.turns)?;
            e.tokens_saved += saved;
            Some(saved)
        })
    }

    /// The conversation's open keys now.
    pub fn observe(&self, conv: &ConversationId, open: Vec<DiagnosticArtifact>, now: Instant) {
        self.with(conv, now, |e| e.open = open);
    }

    /// haltd intervened (a halt, or an answer without the model).
    pub fn intervened(&self, conv: &ConversationId, artifact: DiagnosticArtifact, now: Instant) {
        self.with(conv, now, |e| {
            if e.artifacts.len() >= MAX_ARTIFACTS {
                e.artifacts.pop_front();
            }
            e.artifacts.push_back(artifact);
        });
    }

    /// The conversations whose id (header value or digest) is `id`, or all with `None`,
    /// most recently used first. Does not mark them used.
    pub fn view(&self, id: Option<&str>, now: Instant) -> Vec<ConversationView> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner
            .lru
            .values()
            .rev()
            .filter(|c| id.is_none_or(|id| c.id == id))
            .filter_map(|c| inner.map.get(c).map(|e| (c, e)))
            .map(|(c, e)| ConversationView {
                id: c.clone(),
                idle_s: now.saturating_duration_since(e.last_seen).as_secs_f64(),
                open: e.open.clone(),
                artifacts: e.artifacts.iter().cloned().collect(),
                calls_timed: e.timeline.emitted.len(),
                tokens_saved: e.tokens_saved,
            })
            .collect()
    }

    /// Conversations kept, and evicted so far.
    pub fn counts(&self) -> (usize, u64) {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        (inner.map.len(), inner.evicted)
    }
}

#[cfg(test)]
mod tests;
