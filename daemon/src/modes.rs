//! Degraded safe mode (spec 000 §4.2 step 4 and §7) and the per-conversation state that turn
//! atomicity protects (TURN-ACID, spec 000 §10 item 3).
//!
//! After a halt caused by a safety or integrity breach, `runtime_mode` becomes `degraded` for
//! a configured scope: the conversation's API key (`--degraded-scope key`, the default) or
//! the whole node (`--degraded-scope node`). While a turn's scope is degraded, the data plane
//! forwards no tool definitions and emits no tool-call deltas, serves streaming requests as
//! batch (held until complete, all or nothing), forces B = 0, and marks every response with
//! `x-haltd-mode: degraded`. The operator ends it (`haltctl mode full`), or a timer
//! (`--degraded-for-s`) does; every change is a flight-recorder record.
//!
//! A conversation is named by its [`KeyId`]: the first 8 bytes of HMAC-SHA-256, under the
//! per-node secret, of the request's credential (the header `--identity-header` names, else
//! the bearer token of `Authorization` or `x-api-key`; requests without one share one key;
//! `credential.rs`, `identity.rs`).
//! The key itself is never stored or logged; records and the admin API show its fingerprint
//! (16 hex digits).
//!
//! Committed conversation state ([`Conversation`]) changes only when a turn ends cleanly; a
//! failed turn (halted, upstream failure, client gone) leaves it as it was. Both the degraded
//! scopes and this state survive a restart in the state store (`state.rs`): each change
//! returns the store's change, which the caller queues after the ledger record that states
//! it, if there is one.
//!
//! One mutex guards all of it: it is taken at turn start and turn end, never per token.

pub mod metrics;

use std::{
    collections::HashMap,
    fmt,
    sync::Mutex,
    time::{Duration, SystemTime},
};

use clap::ValueEnum;
use prometheus_client::encoding::{EncodeLabelValue, LabelValueEncoder};
use serde::Serialize;

use crate::{
    clock::{monotonic_ns, unix_ms},
    codes::FailureCode,
    state::{ConversationRow, ScopeRow},
};

pub use crate::identity::KeyId;
use crate::scope::{Identity, Scope};

/// What a halt puts into degraded mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DegradedScope {
    /// Only the halted turn's conversation (its API key).
    Key,
    /// Every conversation on this node.
    Node,
}

/// Which scope an operator's `mode full` ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScopeSel {
    /// Every degraded scope (node and keys).
    All,
    Node,
    /// One scope (`addr:`, `header:`, `apikey:` or a legacy `key:`, `scope.rs`).
    Scope(Scope),
}

/// Whether a halt of this cause degrades its scope. Safety and integrity breaches do; an
/// upstream failure (the backend broke, nothing unsafe was seen) and a shutdown do not, nor
/// does an open tool circuit (`TOOL_CIRCUIT_OPEN`: one tool's key is open, not the
/// conversation), nor a client that stopped reading (`CLIENT_STALLED`).
pub fn cause_degrades(cause: FailureCode) -> bool {
    !matches!(
        cause,
        FailureCode::UpstreamFailure | FailureCode::ToolCircuitOpen | FailureCode::ClientStalled
    )
}

/// Why a scope is degraded.
#[derive(Clone, Debug, Serialize)]
pub struct Degraded {
    pub since_unix_ms: u64,
    /// When the timer ends it (Unix ms, what is stored and shown); `None`: only the operator
    /// does.
    pub until_unix_ms: Option<u64>,
    pub cause: String,
    pub stream_id: String,
    /// The same end on the monotonic clock, which the timer follows while haltd runs (a
    /// wall-clock step changes no timer).
    #[serde(skip)]
    until_ns: Option<u64>,
    /// Its first turn was answered with `--degraded-ask-first` ([`Modes::ask_first`]). Not
    /// stored: after a restart the scope's first turn is asked again.
    #[serde(skip)]
    asked: bool,
}

/// A scope's `runtime_mode` (records, the `to` label of `haltd_runtime_mode_changes_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RuntimeMode {
    Full,
    /// Degraded safe mode.
    Degraded,
}

impl RuntimeMode {
    /// The mode of a turn that runs degraded or not.
    pub fn of(degraded: bool) -> Self {
        if degraded {
            RuntimeMode::Degraded
        } else {
            RuntimeMode::Full
        }
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            RuntimeMode::Full => "full",
            RuntimeMode::Degraded => "degraded",
        }
    }
}

/// Who changed a scope's `runtime_mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ChangedBy {
    /// A halt degraded it.
    Halt,
    /// The operator ended it (`POST /admin/mode`).
    Operator,
    /// Its `--degraded-for-s` timer ended it.
    Timer,
    /// The start found a state store that does not match the ledger, and
    /// `--state-mismatch degrade-node` degraded the node.
    Start,
    /// A request whose credential named a scope degraded before issue 36 (`scope.rs`): its
    /// new scope is degraded with the old one's cause and end.
    Migration,
    /// The other haltd of a hand-over degraded it (`halt/handover.rs`).
    Peer,
}

impl ChangedBy {
    pub const fn as_str(self) -> &'static str {
        match self {
            ChangedBy::Halt => "halt",
            ChangedBy::Operator => "operator",
            ChangedBy::Timer => "timer",
            ChangedBy::Start => "start",
            ChangedBy::Migration => "migration",
            ChangedBy::Peer => "peer",
        }
    }
}

impl fmt::Display for RuntimeMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl EncodeLabelValue for RuntimeMode {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        fmt::Write::write_str(encoder, self.as_str())
    }
}

impl fmt::Display for ChangedBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl EncodeLabelValue for ChangedBy {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        fmt::Write::write_str(encoder, self.as_str())
    }
}

/// One change of `runtime_mode`, to be recorded.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct ModeChange {
    /// `"node"` or `"key:<fingerprint>"`.
    pub scope: String,
    pub from: RuntimeMode,
    pub to: RuntimeMode,
    pub by: ChangedBy,
    pub cause: Option<String>,
    pub stream_id: Option<String>,
    /// A change to degraded: since when, and until when its timer runs (Unix ms), as the
    /// state store keeps them (a restart replays the change from the ledger).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since_unix_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub until_unix_ms: Option<u64>,
}

impl ModeChange {
    /// A scope back to full.
    fn to_full(key: Option<Scope>, by: ChangedBy) -> Self {
        ModeChange {
            scope: scope_name(key),
            from: RuntimeMode::Degraded,
            to: RuntimeMode::Full,
            by,
            cause: None,
            stream_id: None,
            since_unix_ms: None,
            until_unix_ms: None,
        }
    }

    /// The state store's change for this one.
    pub fn store_change(&self) -> crate::state::Change {
        match self.to {
            RuntimeMode::Full => crate::state::Change::End(self.scope.clone()),
            RuntimeMode::Degraded => crate::state::Change::Degrade(ScopeRow {
                scope: self.scope.clone(),
                since_unix_ms: self.since_unix_ms.unwrap_or(0),
                until_unix_ms: self.until_unix_ms,
                cause: self.cause.clone().unwrap_or_default(),
                stream_id: self.stream_id.clone().unwrap_or_default(),
            }),
        }
    }
}

/// Committed state of one conversation: changed only by turns that ended cleanly.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Conversation {
    pub turns_committed: u64,
    pub tokens_committed: u64,
    pub tool_calls_committed: u64,
    pub last_committed_turn: Option<String>,
    /// Turns that failed (recorded as such; they changed nothing above).
    pub turns_failed: u64,
}

#[derive(Debug, Default)]
struct Inner {
    node: Option<Degraded>,
    keys: HashMap<Scope, Degraded>,
    conversations: HashMap<KeyId, Conversation>,
}

/// The degraded-mode registry and the committed conversation state.
#[derive(Debug)]
pub struct Modes {
    scope: DegradedScope,
    hold: Option<Duration>,
    inner: Mutex<Inner>,
    /// Signalled when a scope's timer is set, so the control plane's timer task, which sleeps
    /// until the next expiry (or for good with none), looks again.
    timer_set: tokio::sync::Notify,
}

impl Inner {
    /// Holds `d` for the node (`None`) or a scope, replacing what was held.
    fn hold(&mut self, key: Option<Scope>, d: Degraded) {
        match key {
            None => self.node = Some(d),
            Some(k) => {
                self.keys.insert(k, d);
            }
        }
    }
}

impl Degraded {
    /// A stored scope's state; what remains of its timer is its `until_unix_ms` − `now_ms`.
    fn of_row(row: &ScopeRow, now_ms: u64, now_ns: u64) -> Degraded {
        Degraded {
            since_unix_ms: row.since_unix_ms,
            until_unix_ms: row.until_unix_ms,
            cause: row.cause.clone(),
            stream_id: row.stream_id.clone(),
            until_ns: row
                .until_unix_ms
                .map(|u| now_ns.saturating_add(u.saturating_sub(now_ms).saturating_mul(1_000_000))),
            asked: false,
        }
    }
}

fn scope_name(key: Option<Scope>) -> String {
    key.map_or_else(|| "node".to_owned(), Scope::name)
}

fn conversation_change(key: KeyId, c: &Conversation) -> crate::state::Change {
    crate::state::Change::Conversation(ConversationRow {
        key: key.fingerprint(),
        turns_committed: c.turns_committed,
        tokens_committed: c.tokens_committed,
        tool_calls_committed: c.tool_calls_committed,
        last_committed_turn: c.last_committed_turn.clone(),
        turns_failed: c.turns_failed,
    })
}

/// `node` is `Some(None)`, `<kind>:<fingerprint>` is `Some(Some(scope))`.
fn parse_scope(s: &str) -> Option<Option<Scope>> {
    if s == "node" {
        return Some(None);
    }
    Scope::parse(s).map(Some)
}

fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Modes {
    /// `hold`: how long a degraded scope lasts before the timer ends it (`None`: until the
    /// operator does).
    pub fn new(scope: DegradedScope, hold: Option<Duration>) -> Modes {
        Modes {
            scope,
            hold,
            inner: Mutex::new(Inner::default()),
            timer_set: tokio::sync::Notify::new(),
        }
    }

    /// How long until the first scope's timer runs out (zero if one already has); `None` when
    /// no scope has a timer. `now_ns`: the monotonic clock.
    pub fn next_expiry(&self, now_ns: u64) -> Option<Duration> {
        let inner = self.lock();
        inner
            .node
            .iter()
            .chain(inner.keys.values())
            .filter_map(|d| d.until_ns)
            .min()
            .map(|u| Duration::from_nanos(u.saturating_sub(now_ns)))
    }

    /// Resolves once a scope's timer was set after the last wait (a permit is kept when nobody
    /// waits, so a timer set between [`Modes::next_expiry`] and this wait is not missed).
    pub async fn timer_set(&self) {
        self.timer_set.notified().await;
    }

    pub fn scope(&self) -> DegradedScope {
        self.scope
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // The state stays consistent across a panic (every update is one insert or remove).
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Ends the scopes whose timer ran out by `now_ns` (the monotonic clock); returns the
    /// changes to record.
    pub fn expire(&self, now_ns: u64) -> Vec<ModeChange> {
        let mut inner = self.lock();
        let mut out = Vec::new();
        let due = |d: &Degraded| d.until_ns.is_some_and(|u| u <= now_ns);
        if inner.node.as_ref().is_some_and(due) {
            inner.node = None;
            out.push(ModeChange::to_full(None, ChangedBy::Timer));
        }
        let mut keys: Vec<Scope> = inner
            .keys
            .iter()
            .filter(|(_, d)| due(d))
            .map(|(k, _)| *k)
            .collect();
        keys.sort_unstable();
        for k in keys {
            inner.keys.remove(&k);
            out.push(ModeChange::to_full(Some(k), ChangedBy::Timer));
        }
        out
    }

    /// Whether a turn of this identity runs degraded (the timer is checked by
    /// [`Modes::expire`], which callers run first): the node is, its scope is, or its
    /// credential's legacy scope (`scope.rs`) is. In the last case its scope is degraded
    /// too, until the legacy scope's end: the change to record is returned.
    pub fn admit(&self, who: &Identity) -> (bool, Option<ModeChange>) {
        let mut inner = self.lock();
        if inner.node.is_some() || inner.keys.contains_key(&who.scope) {
            return (true, None);
        }
        let Some(legacy) = inner.keys.get(&who.legacy).cloned() else {
            return (false, None);
        };
        let change = ModeChange {
            scope: who.scope.name(),
            from: RuntimeMode::Full,
            to: RuntimeMode::Degraded,
            by: ChangedBy::Migration,
            cause: Some(legacy.cause.clone()),
            stream_id: Some(legacy.stream_id.clone()),
            since_unix_ms: Some(legacy.since_unix_ms),
            until_unix_ms: legacy.until_unix_ms,
        };
        inner.keys.insert(who.scope, legacy);
        (true, Some(change))
    }

    /// Degraded mode's "ask first": whether this turn of `who` is the first of its degraded
    /// scope (the node's, when the node is degraded) since the scope entered degraded mode,
    /// and so is answered with the clarification instead of the model. Marks it asked.
    pub fn ask_first(&self, who: &Identity) -> bool {
        let mut inner = self.lock();
        let Inner { node, keys, .. } = &mut *inner;
        let Some(d) = node.as_mut().or_else(|| keys.get_mut(&who.scope)) else {
            return false;
        };
        !std::mem::replace(&mut d.asked, true)
    }

    /// Whether `scope` (or the node) is degraded now.
    pub fn is_degraded(&self, scope: Scope) -> bool {
        let inner = self.lock();
        inner.node.is_some() || inner.keys.contains_key(&scope)
    }

    /// The degraded state that applies to `scope` now: the node's when the node is degraded,
    /// else the scope's own; `None` when neither is.
    pub fn degraded_state(&self, scope: Scope) -> Option<serde_json::Value> {
        let inner = self.lock();
        let (name, d) = match &inner.node {
            Some(d) => ("node".to_owned(), d),
            None => (scope.name(), inner.keys.get(&scope)?),
        };
        let mut v = serde_json::json!(d);
        v["scope"] = name.into();
        Some(v)
    }

    /// A halt of `cause` on a turn of `key`: degrade the configured scope. Returns the change
    /// to record: to degraded, or, for a scope already degraded whose timer the halt
    /// restarts, degraded to degraded with the new end; `None` if the cause does not degrade
    /// or nothing changes (already degraded, no timer).
    pub fn enter(&self, key: Scope, cause: FailureCode, stream_id: &str) -> Option<ModeChange> {
        if !cause_degrades(cause) {
            return None;
        }
        let (now, now_ns) = (SystemTime::now(), monotonic_ns());
        let d = Degraded {
            since_unix_ms: unix_ms(now),
            until_unix_ms: self.hold.map(|h| unix_ms(now + h)),
            cause: cause.as_str().to_owned(),
            stream_id: stream_id.to_owned(),
            until_ns: self.hold.map(|h| now_ns.saturating_add(duration_ns(h))),
            asked: false,
        };
        let mut inner = self.lock();
        if d.until_ns.is_some() {
            self.timer_set.notify_one();
        }
        let key = (self.scope == DegradedScope::Key).then_some(key);
        let current = match key {
            None => inner.node.as_mut(),
            Some(k) => inner.keys.get_mut(&k),
        };
        let (from, since) = if let Some(cur) = current {
            // Already degraded: the halt restarts its timer. Never shortens it: a scope
            // without an end (`--degraded-for-s 0` when it was degraded, a node degraded at
            // start) keeps none, and an end later than the new one (a longer hold before a
            // restart) stays.
            let (cur_until, new_until) = (cur.until_ns?, d.until_ns?);
            if new_until < cur_until {
                return None;
            }
            cur.until_unix_ms = d.until_unix_ms;
            cur.until_ns = Some(new_until);
            (RuntimeMode::Degraded, cur.since_unix_ms)
        } else {
            (RuntimeMode::Full, d.since_unix_ms)
        };
        let change = ModeChange {
            scope: scope_name(key),
            from,
            to: RuntimeMode::Degraded,
            by: ChangedBy::Halt,
            cause: Some(cause.as_str().to_owned()),
            stream_id: Some(stream_id.to_owned()),
            since_unix_ms: Some(since),
            until_unix_ms: d.until_unix_ms,
        };
        if from == RuntimeMode::Full {
            match key {
                None => inner.node = Some(d),
                Some(k) => {
                    inner.keys.insert(k, d);
                }
            }
        }
        Some(change)
    }

    /// The operator's `mode full`: ends the selected degraded scopes; returns the changes.
    pub fn set_full(&self, sel: ScopeSel) -> Vec<ModeChange> {
        let mut inner = self.lock();
        let mut ended: Vec<Option<Scope>> = Vec::new();
        if matches!(sel, ScopeSel::All | ScopeSel::Node) && inner.node.take().is_some() {
            ended.push(None);
        }
        match sel {
            ScopeSel::All => {
                let mut keys: Vec<Scope> = inner.keys.drain().map(|(k, _)| k).collect();
                keys.sort_unstable();
                ended.extend(keys.into_iter().map(Some));
            }
            ScopeSel::Scope(k) => {
                if inner.keys.remove(&k).is_some() {
                    ended.push(Some(k));
                }
            }
            ScopeSel::Node => {}
        }
        ended
            .into_iter()
            .map(|k| ModeChange::to_full(k, ChangedBy::Operator))
            .collect()
    }

    /// The degraded scopes a start restores from the state store, before any turn is served.
    /// What remains of a timer is its `until_unix_ms` − `now` (a scope whose end passed ends
    /// at the timer's first look, recorded). Fails on a scope it cannot name, leaving the
    /// scopes before it restored.
    pub fn restore(&self, rows: &[ScopeRow], now: SystemTime, now_ns: u64) -> Result<(), String> {
        let now_ms = unix_ms(now);
        let mut inner = self.lock();
        for row in rows {
            let key = parse_scope(&row.scope).ok_or_else(|| {
                format!(
                    "the stored scope {:?} is not node or <kind>:<fingerprint>",
                    row.scope
                )
            })?;
            inner.hold(key, Degraded::of_row(row, now_ms, now_ns));
        }
        if rows.iter().any(|r| r.until_unix_ms.is_some()) {
            self.timer_set.notify_one();
        }
        Ok(())
    }

    /// The degraded scopes a peer stored (`halt/handover.rs`) that this process does not hold
    /// (and whose end has not passed), held from now on: returns the changes to record.
    pub fn adopt_peer(&self, rows: &[ScopeRow], now: SystemTime, now_ns: u64) -> Vec<ModeChange> {
        let now_ms = unix_ms(now);
        let mut out = Vec::new();
        let mut inner = self.lock();
        for row in rows
            .iter()
            .filter(|r| r.until_unix_ms.is_none_or(|u| u > now_ms))
        {
            let Some(key) = parse_scope(&row.scope) else {
                continue;
            };
            let held = match key {
                None => inner.node.is_some(),
                Some(k) => inner.keys.contains_key(&k),
            };
            if held {
                continue;
            }
            inner.hold(key, Degraded::of_row(row, now_ms, now_ns));
            out.push(ModeChange {
                scope: row.scope.clone(),
                from: RuntimeMode::Full,
                to: RuntimeMode::Degraded,
                by: ChangedBy::Peer,
                cause: Some(row.cause.clone()),
                stream_id: Some(row.stream_id.clone()),
                since_unix_ms: Some(row.since_unix_ms),
                until_unix_ms: row.until_unix_ms,
            });
        }
        if out.iter().any(|c| c.until_unix_ms.is_some()) {
            self.timer_set.notify_one();
        }
        out
    }

    /// The start found a state store that does not match, and `--state-mismatch
    /// degrade-node` was given: the whole node runs degraded until the operator ends it.
    pub fn degrade_node_at_start(&self, why: &str) -> ModeChange {
        let since = unix_ms(SystemTime::now());
        self.lock().node = Some(Degraded {
            since_unix_ms: since,
            until_unix_ms: None,
            cause: why.to_owned(),
            stream_id: String::new(),
            until_ns: None,
            asked: false,
        });
        ModeChange {
            scope: scope_name(None),
            from: RuntimeMode::Full,
            to: RuntimeMode::Degraded,
            by: ChangedBy::Start,
            cause: Some(why.to_owned()),
            stream_id: None,
            since_unix_ms: Some(since),
            until_unix_ms: None,
        }
    }

    /// The degraded scopes, for the admin API.
    pub fn degraded_view(&self) -> serde_json::Value {
        let inner = self.lock();
        let mut keys: Vec<(&Scope, &Degraded)> = inner.keys.iter().collect();
        keys.sort_unstable_by_key(|(k, _)| **k);
        serde_json::json!({
            "scope_on_halt": self.scope,
            "degraded_for_s": self.hold.map(|h| h.as_secs_f64()),
            "node": inner.node,
            "keys": keys.into_iter().map(|(k, d)| {
                let mut v = serde_json::to_value(d).unwrap_or_default();
                v["key"] = serde_json::Value::String(k.id.fingerprint());
                v["scope"] = serde_json::Value::String(k.name());
                v
            }).collect::<Vec<_>>(),
        })
    }

    /// How many scopes are degraded (node counts as one), for the gauge.
    pub fn degraded_count(&self) -> usize {
        let inner = self.lock();
        usize::from(inner.node.is_some()) + inner.keys.len()
    }

    /// Commits a cleanly ended turn into its conversation's state; returns the state
    /// store's change.
    pub fn commit_turn(
        &self,
        key: KeyId,
        turn_id: &str,
        tokens: u64,
        tool_calls: u64,
    ) -> crate::state::Change {
        let mut inner = self.lock();
        let c = inner.conversations.entry(key).or_default();
        c.turns_committed += 1;
        c.tokens_committed += tokens;
        c.tool_calls_committed += tool_calls;
        c.last_committed_turn = Some(turn_id.to_owned());
        conversation_change(key, c)
    }

    /// Notes a failed turn: the count of failures moves, the committed state does not.
    /// Returns the state store's change.
    pub fn fail_turn(&self, key: KeyId) -> crate::state::Change {
        let mut inner = self.lock();
        let c = inner.conversations.entry(key).or_default();
        c.turns_failed += 1;
        conversation_change(key, c)
    }

    /// The committed conversation state a start restores from the state store.
    pub fn restore_conversations(&self, rows: &[ConversationRow]) -> Result<(), String> {
        let mut inner = self.lock();
        for r in rows {
            let key = KeyId::parse_fingerprint(&r.key).ok_or_else(|| {
                format!("the stored conversation key {:?} is no fingerprint", r.key)
            })?;
            inner.conversations.insert(
                key,
                Conversation {
                    turns_committed: r.turns_committed,
                    tokens_committed: r.tokens_committed,
                    tool_calls_committed: r.tool_calls_committed,
                    last_committed_turn: r.last_committed_turn.clone(),
                    turns_failed: r.turns_failed,
                },
            );
        }
        Ok(())
    }

    pub fn conversation(&self, key: KeyId) -> Option<Conversation> {
        self.lock().conversations.get(&key).cloned()
    }

    pub fn conversations_view(&self) -> serde_json::Value {
        let inner = self.lock();
        let mut all: Vec<(&KeyId, &Conversation)> = inner.conversations.iter().collect();
        all.sort_unstable_by_key(|(k, _)| **k);
        serde_json::Value::Array(
            all.into_iter()
                .map(|(k, c)| {
                    let mut v = serde_json::to_value(c).unwrap_or_default();
                    v["key"] = serde_json::Value::String(k.fingerprint());
                    v
                })
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests;
