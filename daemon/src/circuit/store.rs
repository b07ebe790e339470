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

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Instant;

use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use prometheus_client::metrics::{counter::Counter, gauge::Gauge};

use super::artifact::DiagnosticArtifact;
use super::memory::{FailedCall, Memory};
use super::transcript::Timeline;

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

/// Where a conversation's name came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IdSource {
    /// The client's `x-haltd-conversation-id`.
    Header,
    /// The digest of the transcript's stable prefix.
    Digest,
}

/// A conversation: its name, scoped by the caller's key fingerprint (two tenants choosing
/// the same header value are two conversations).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct ConversationId {
    /// The key fingerprint (`KeyId::fingerprint`).
    pub key: String,
    /// The header's value, or 32 hex digits of the prefix digest.
    pub id: String,
    pub source: IdSource,
}

impl ConversationId {
    /// The conversation of a chat request: the header's value if the client sent one, else
    /// the digest of its `messages` before the first assistant message, with `key`.
    pub fn of(header: Option<&str>, key: &str, messages: &[Value]) -> Self {
        if let Some(h) = header {
            return ConversationId {
                key: key.to_owned(),
                id: h.to_owned(),
                source: IdSource::Header,
            };
        }
        let mut d = Sha256::new();
        d.update(key.as_bytes());
        let prefix = messages
            .iter()
            .take_while(|m| m.get("role").and_then(Value::as_str) != Some("assistant"));
        for m in prefix {
            d.update([0]);
            d.update(m.to_string().as_bytes());
        }
        let id = d.finalize()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        ConversationId {
            key: key.to_owned(),
            id,
            source: IdSource::Digest,
        }
    }
}

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
        }
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
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let inner = &mut *inner;
        inner.tick += 1;
        let tick = inner.tick;
        if !inner.map.contains_key(conv) {
            while inner.map.len() >= self.capacity {
                let Some((_, victim)) = inner.lru.pop_first() else {
                    break;
                };
                if let Some(gone) = inner.map.remove(&victim) {
                    self.retain_refusals(inner, victim, &gone);
                }
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
                    timeline: Timeline::default(),
                    memory,
                    artifacts: VecDeque::new(),
                    open: Vec::new(),
                    last_seen: now,
                    tick,
                    turns: 0,
                    tokens: 0,
                    tokens_saved: 0,
                },
            );
        }
        let entry = inner.map.get_mut(conv).expect("present: inserted above");
        inner.lru.remove(&entry.tick);
        inner.lru.insert(tick, conv.clone());
        entry.tick = tick;
        entry.last_seen = entry.last_seen.max(now);
        f(entry)
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
            return;
        }
        while inner.retained.len() >= MAX_RETAINED {
            let Some(oldest) = inner.retained_order.pop_front() else {
                break;
            };
            inner.retained.remove(&oldest);
            self.counters.forgotten.inc();
            tracing::warn!(
                conversation = %oldest.id,
                key = %oldest.key,
                "TokenCircuit forgot the refused keys of an evicted conversation: {MAX_RETAINED} \
                 evicted conversations with refused keys are kept; raise [tool_circuit] \
                 conversations"
            );
        }
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
        self.with(conv, now, |e| {
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
        self.with(conv, now, |e| {
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
        self.with(conv, now, |e| {
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
        self.with(conv, now, |e| {
            for id in ids {
                if e.timeline.emitted.contains_key(id) && !e.timeline.delivered.contains(id) {
                    e.timeline.delivered.insert(id.to_owned());
                }
            }
        });
    }

    /// A turn of it generated `tokens` (its text and tool calls).
    pub fn generated(&self, conv: &ConversationId, tokens: u64, now: Instant) {
        self.with(conv, now, |e| {
            e.turns += 1;
            e.tokens += tokens;
        });
    }

    /// haltd answers a request of it without the model: the tokens that saves, estimated as
    /// its mean tokens per turn so far (`None` before its first turn), added to its total.
    pub fn answered(&self, conv: &ConversationId, now: Instant) -> Option<u64> {
        self.with(conv, now, |e| {
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
mod tests {
    use std::time::Duration;

    use serde_json::json;

    use super::*;

    fn conv(id: &str) -> ConversationId {
        ConversationId::of(Some(id), "k", &[])
    }

    #[test]
    fn the_header_names_the_conversation_else_the_prefix_digest() {
        let first = [
            json!({"role": "system", "content": "be brief"}),
            json!({"role": "user", "content": "weather?"}),
        ];
        let mut later = first.to_vec();
        later.push(json!({"role": "assistant", "tool_calls": []}));
        later.push(json!({"role": "tool", "tool_call_id": "a", "content": "x"}));
        later.push(json!({"role": "user", "content": "and tomorrow?"}));
        let a = ConversationId::of(None, "k1", &first);
        assert_eq!(a.source, IdSource::Digest);
        assert_eq!(a.id.len(), 32);
        assert_eq!(
            a,
            ConversationId::of(None, "k1", &later),
            "prefix is stable"
        );
        assert_ne!(a, ConversationId::of(None, "k2", &first), "scoped by key");
        let other = [json!({"role": "user", "content": "weather in Rome?"})];
        assert_ne!(a, ConversationId::of(None, "k1", &other));
        let h = ConversationId::of(Some("c-1"), "k1", &first);
        assert_eq!((h.id.as_str(), h.source), ("c-1", IdSource::Header));
        assert_ne!(h, ConversationId::of(Some("c-1"), "k2", &first));
    }

    #[test]
    fn an_arrival_is_kept_from_the_first_request_that_carried_it() {
        let s = ConversationStore::new(4);
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(3);
        let c = conv("c");
        assert_eq!(s.arrive(&c, &["a"], t0).0.arrived["a"], t0);
        let t = s.arrive(&c, &["a", "b"], t1).0;
        assert_eq!((t.arrived["a"], t.arrived["b"]), (t0, t1));
        s.emitted(&c, ["x"], t1);
        assert_eq!(s.arrive(&c, &[], t1).0.emitted["x"], t1);
        assert!(s.arrive(&conv("other"), &[], t1).0.emitted.is_empty());
    }

    #[test]
    fn only_a_call_released_and_never_accepted_is_known_undelivered() {
        let s = ConversationStore::new(4);
        let (c, now) = (conv("c"), Instant::now());
        s.emitted(&c, ["sent", "halted"], now);
        s.delivered(&c, ["sent", "never-released"], now);
        let t = s.arrive(&c, &[], now).0;
        assert!(t.dispatched("sent"), "released and accepted");
        assert!(
            !t.dispatched("halted"),
            "released, its frame never accepted"
        );
        assert!(t.dispatched("unknown"), "never seen here: fails closed");
        assert!(
            !t.delivered.contains("never-released"),
            "only released calls are kept"
        );
        assert!(s.arrive(&conv("other"), &[], now).0.dispatched("halted"));
    }

    #[test]
    fn the_least_recently_used_conversation_is_evicted() {
        let s = ConversationStore::new(2);
        let now = Instant::now();
        s.emitted(&conv("a"), ["1"], now);
        s.emitted(&conv("b"), ["2"], now);
        // `a` used again: `b` is now the least recently used.
        s.arrive(&conv("a"), &[], now);
        s.arrive(&conv("c"), &[], now);
        assert_eq!(s.counts(), (2, 1));
        let ids: Vec<String> = s.view(None, now).into_iter().map(|v| v.id.id).collect();
        assert_eq!(ids, ["c", "a"]);
        assert!(
            s.arrive(&conv("b"), &[], now).0.emitted.is_empty(),
            "b forgotten"
        );
        assert_eq!(
            s.arrive(&conv("a"), &[], now).0.emitted.len(),
            0,
            "a evicted by b"
        );
    }

    /// Eviction never re-opens a refused key: an evicted conversation with an exhausted key
    /// keeps that tool's failed calls; past [`MAX_RETAINED`] the oldest is forgotten, counted.
    #[test]
    fn an_evicted_conversation_keeps_its_refused_keys() {
        use crate::circuit::{transcript::rebuild_with, CircuitPolicy, ToolCall, Verdict};
        let s = ConversationStore::new(1);
        let now = Instant::now();
        let policy = std::sync::Arc::new(CircuitPolicy::default());
        let messages = [
            json!({"role": "user", "content": "x"}),
            json!({"role": "assistant", "tool_calls": [{"id": "p1", "type": "function",
                   "function": {"name": "run_sql", "arguments": "{}"}}]}),
            json!({"role": "tool", "tool_call_id": "p1", "content": "permission denied"}),
        ];
        let (a, b) = (conv("a"), conv("b"));
        let (t, m) = s.arrive(&a, &["p1"], now);
        let (c, failed) = rebuild_with(policy.clone(), &messages, &t, &m).expect("input");
        s.remember(&a, failed, now);
        s.observe(&a, c.open_artifacts(), now);
        assert_eq!(c.exhausted().len(), 1);
        s.arrive(&b, &[], now); // evicts a
        assert_eq!(s.counts(), (1, 1));
        assert_eq!(s.counters.retained.get(), 1);
        let (t, m) = s.arrive(&a, &[], now); // a is back (evicting b), with its memory
        assert_eq!(m.len(), 1);
        assert_eq!(s.counters.retained.get(), 0);
        let (c, _) = rebuild_with(policy, &messages[..1], &t, &m).expect("input");
        let call = ToolCall {
            id: "p2",
            name: "run_sql",
            arguments: "{}",
        };
        assert!(matches!(c.judge(call, None), Verdict::Deny(_)));

        // A full retained set forgets the oldest, counted.
        let mut inner = Inner::default();
        let mut gone = Entry {
            timeline: Timeline::default(),
            memory: m,
            artifacts: VecDeque::new(),
            open: c.open_artifacts(),
            last_seen: now,
            tick: 0,
            turns: 0,
            tokens: 0,
            tokens_saved: 0,
        };
        gone.open[0].budget_exhausted = true;
        for i in 0..=MAX_RETAINED {
            s.retain_refusals(&mut inner, conv(&format!("r{i}")), &gone);
        }
        assert_eq!(inner.retained.len(), MAX_RETAINED);
        assert!(!inner.retained.contains_key(&conv("r0")));
        assert_eq!(s.counters.forgotten.get(), 1);
    }

    #[test]
    fn tokens_saved_are_the_mean_tokens_per_turn() {
        let s = ConversationStore::new(2);
        let (c, now) = (conv("c"), Instant::now());
        assert_eq!(s.answered(&c, now), None, "no turn known yet");
        s.generated(&c, 10, now);
        s.generated(&c, 20, now);
        assert_eq!(s.answered(&c, now), Some(15));
        assert_eq!(s.answered(&c, now), Some(15));
        assert_eq!(s.view(Some("c"), now)[0].tokens_saved, 30);
    }

    #[test]
    fn per_conversation_memory_is_bounded() {
        let s = ConversationStore::new(1);
        let c = conv("c");
        let t0 = Instant::now();
        for i in 0..MAX_CALLS + 10 {
            s.emitted(
                &c,
                [format!("call{i}").as_str()],
                t0 + Duration::from_millis(i as u64),
            );
        }
        // call10 is the oldest kept; a new call drops it, and its delivery with it.
        s.delivered(&c, ["call0", "call10", "call11"], t0);
        s.emitted(&c, ["late"], t0 + Duration::from_secs(1));
        let t = s.arrive(&c, &[], t0).0;
        assert_eq!(t.emitted.len(), MAX_CALLS);
        assert!(!t.emitted.contains_key("call0"), "the oldest dropped");
        assert!(t.delivered.len() == 1 && t.delivered.contains("call11"));
        assert!(t.dispatched("call10"), "forgotten: fails closed");
        assert!(!t.dispatched("late"), "released, not accepted");
        assert!(t.emitted.contains_key(&format!("call{}", MAX_CALLS + 9)));
    }
}
