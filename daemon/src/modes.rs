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

/// A conversation's key: the first 8 bytes of HMAC-SHA-256, under the node secret, of the
/// request's credential (`credential.rs`, `identity.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyId(pub u64);

impl KeyId {
    /// The key of a request with this credential (`None`: it had none).
    pub fn of(
        secret: &crate::identity::NodeSecret,
        credential: crate::credential::Credential<'_>,
    ) -> KeyId {
        KeyId(secret.key_id(credential))
    }

    /// The 16-hex-digit fingerprint used in records, metrics-free views and `haltctl`.
    pub fn fingerprint(self) -> String {
        format!("{:016x}", self.0)
    }

    pub fn parse_fingerprint(s: &str) -> Option<KeyId> {
        (s.len() == 16)
            .then(|| u64::from_str_radix(s, 16).ok())
            .flatten()
            .map(KeyId)
    }
}

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

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
    Key(KeyId),
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
}

impl ChangedBy {
    pub const fn as_str(self) -> &'static str {
        match self {
            ChangedBy::Halt => "halt",
            ChangedBy::Operator => "operator",
            ChangedBy::Timer => "timer",
            ChangedBy::Start => "start",
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
    fn to_full(key: Option<KeyId>, by: ChangedBy) -> Self {
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
    keys: HashMap<KeyId, Degraded>,
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

fn scope_name(key: Option<KeyId>) -> String {
    key.map_or_else(|| "node".to_owned(), |k| format!("key:{k}"))
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

/// `node` is `Some(None)`, `key:<fingerprint>` is `Some(Some(key))`.
fn parse_scope(s: &str) -> Option<Option<KeyId>> {
    if s == "node" {
        return Some(None);
    }
    s.strip_prefix("key:")
        .and_then(KeyId::parse_fingerprint)
        .map(Some)
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
        let mut keys: Vec<KeyId> = inner
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

    /// Whether a turn of this conversation runs degraded (the timer is checked by
    /// [`Modes::expire`], which callers run first).
    pub fn is_degraded(&self, key: KeyId) -> bool {
        let inner = self.lock();
        inner.node.is_some() || inner.keys.contains_key(&key)
    }

    /// A halt of `cause` on a turn of `key`: degrade the configured scope. Returns the change
    /// to record: to degraded, or, for a scope already degraded whose timer the halt
    /// restarts, degraded to degraded with the new end; `None` if the cause does not degrade
    /// or nothing changes (already degraded, no timer).
    pub fn enter(&self, key: KeyId, cause: FailureCode, stream_id: &str) -> Option<ModeChange> {
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
            // Already degraded: without a timer nothing changes; else the halt restarts it.
            d.until_ns?;
            cur.until_unix_ms = d.until_unix_ms;
            cur.until_ns = d.until_ns;
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
        let mut ended: Vec<Option<KeyId>> = Vec::new();
        if matches!(sel, ScopeSel::All | ScopeSel::Node) && inner.node.take().is_some() {
            ended.push(None);
        }
        match sel {
            ScopeSel::All => {
                let mut keys: Vec<KeyId> = inner.keys.drain().map(|(k, _)| k).collect();
                keys.sort_unstable();
                ended.extend(keys.into_iter().map(Some));
            }
            ScopeSel::Key(k) => {
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
                    "the stored scope {:?} is not node or key:<fingerprint>",
                    row.scope
                )
            })?;
            let d = Degraded {
                since_unix_ms: row.since_unix_ms,
                until_unix_ms: row.until_unix_ms,
                cause: row.cause.clone(),
                stream_id: row.stream_id.clone(),
                until_ns: row.until_unix_ms.map(|u| {
                    now_ns.saturating_add(u.saturating_sub(now_ms).saturating_mul(1_000_000))
                }),
            };
            match key {
                None => inner.node = Some(d),
                Some(k) => {
                    inner.keys.insert(k, d);
                }
            }
        }
        if rows.iter().any(|r| r.until_unix_ms.is_some()) {
            self.timer_set.notify_one();
        }
        Ok(())
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
        let mut keys: Vec<(&KeyId, &Degraded)> = inner.keys.iter().collect();
        keys.sort_unstable_by_key(|(k, _)| **k);
        serde_json::json!({
            "scope_on_halt": self.scope,
            "degraded_for_s": self.hold.map(|h| h.as_secs_f64()),
            "node": inner.node,
            "keys": keys.into_iter().map(|(k, d)| {
                let mut v = serde_json::to_value(d).unwrap_or_default();
                v["key"] = serde_json::Value::String(k.fingerprint());
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
mod tests {
    use super::*;

    fn secret() -> crate::identity::NodeSecret {
        crate::identity::NodeSecret::from_bytes([3; 32])
    }

    fn key(s: &str) -> KeyId {
        KeyId::of(&secret(), crate::credential::Credential::Bearer(s))
    }

    #[test]
    fn key_ids_are_stable_and_distinct() {
        assert_eq!(key("a"), key("a"));
        assert_ne!(key("a"), key("b"));
        let none = crate::credential::Credential::None;
        assert_eq!(KeyId::of(&secret(), none), KeyId::of(&secret(), none));
        let k = key("secret");
        assert_eq!(KeyId::parse_fingerprint(&k.fingerprint()), Some(k));
        assert!(!k.fingerprint().contains("secret"));
        assert_eq!(KeyId::parse_fingerprint("xyz"), None);
    }

    #[test]
    fn key_scope_degrades_only_that_key_until_the_operator_ends_it() {
        let m = Modes::new(DegradedScope::Key, None);
        let (a, b) = (key("a"), key("b"));
        let ch = m
            .enter(a, FailureCode::OperatorTrip, "1.1")
            .expect("change");
        assert_eq!(
            (ch.from, ch.to, ch.by),
            (RuntimeMode::Full, RuntimeMode::Degraded, ChangedBy::Halt)
        );
        assert_eq!(
            serde_json::to_value(&ch).expect("json")["by"],
            serde_json::json!("halt")
        );
        assert!(m.is_degraded(a));
        assert!(!m.is_degraded(b));
        // A second halt on a degraded scope is no change.
        assert_eq!(m.enter(a, FailureCode::ExfilAlert, "1.2"), None);
        // Timers never end it without --degraded-for-s.
        assert!(m.expire(monotonic_ns() + (1 << 50)).is_empty());
        let ended = m.set_full(ScopeSel::Key(a));
        assert_eq!(ended.len(), 1);
        assert_eq!(ended[0].by, ChangedBy::Operator);
        assert!(!m.is_degraded(a));
        assert!(m.set_full(ScopeSel::Key(a)).is_empty());
    }

    #[test]
    fn upstream_failures_do_not_degrade() {
        let m = Modes::new(DegradedScope::Node, None);
        assert_eq!(m.enter(key("a"), FailureCode::UpstreamFailure, "1.1"), None);
        assert!(!m.is_degraded(key("a")));
    }

    /// README's and the guide's statement: every halt degrades its scope except an upstream
    /// failure, an open tool circuit and a client that stopped reading (a shutdown's halts
    /// never reach `enter`: `halt.rs` skips it once `shutting_down` is set).
    #[test]
    fn every_cause_degrades_but_upstream_failures_open_circuits_and_stalled_clients() {
        let spared = [
            FailureCode::UpstreamFailure,
            FailureCode::ToolCircuitOpen,
            FailureCode::ClientStalled,
        ];
        for (i, code) in FailureCode::ALL.into_iter().enumerate() {
            let m = Modes::new(DegradedScope::Key, None);
            let change = m.enter(key("a"), code, &format!("{i}.1"));
            let degrades = !spared.contains(&code);
            assert_eq!(change.is_some(), degrades, "{code}");
            assert_eq!(m.is_degraded(key("a")), degrades, "{code}");
            assert!(
                !m.is_degraded(key("b")),
                "{code}: key scope is the key only"
            );
        }
    }

    #[test]
    fn node_scope_degrades_everyone_and_the_timer_ends_it() {
        let m = Modes::new(DegradedScope::Node, Some(Duration::from_secs(10)));
        m.enter(key("a"), FailureCode::CoherenceBelowThreshold, "2.1")
            .expect("change");
        assert!(m.is_degraded(key("zzz")));
        assert!(m.expire(monotonic_ns()).is_empty());
        let ended = m.expire(monotonic_ns() + 11_000_000_000);
        assert_eq!(ended.len(), 1);
        assert_eq!(
            (ended[0].scope.as_str(), ended[0].by),
            ("node", ChangedBy::Timer)
        );
        assert!(!m.is_degraded(key("a")));
        assert_eq!(m.degraded_count(), 0);
    }

    #[test]
    fn the_timer_task_sleeps_until_the_first_expiry_and_is_told_of_new_timers() {
        let m = Modes::new(DegradedScope::Key, Some(Duration::from_secs(10)));
        let now = monotonic_ns();
        assert_eq!(m.next_expiry(now), None, "no timer: the task waits for one");
        m.enter(key("a"), FailureCode::CoherenceBelowThreshold, "3.1")
            .expect("change");
        // The permit is kept for the task's next wait.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), m.timer_set())
                .await
                .expect("told of the new timer");
        });
        let left = m.next_expiry(now).expect("a timer runs");
        assert!(left > Duration::from_secs(9) && left <= Duration::from_secs(11));
        assert_eq!(m.next_expiry(now + 20_000_000_000), Some(Duration::ZERO));
        m.set_full(ScopeSel::All);
        assert_eq!(m.next_expiry(now), None);
        // Without a hold nothing has a timer, and nobody is told.
        let forever = Modes::new(DegradedScope::Node, None);
        forever.enter(key("b"), FailureCode::CoherenceBelowThreshold, "3.2");
        assert_eq!(forever.next_expiry(now), None);
    }

    #[test]
    fn a_halt_restarts_a_timer_and_a_restore_keeps_each_end() {
        let m = Modes::new(DegradedScope::Key, Some(Duration::from_secs(60)));
        let first = m
            .enter(key("a"), FailureCode::ExfilAlert, "4.1")
            .expect("change");
        let again = m
            .enter(key("a"), FailureCode::ExfilAlert, "4.2")
            .expect("restart");
        assert_eq!(
            (again.from, again.to),
            (RuntimeMode::Degraded, RuntimeMode::Degraded)
        );
        assert_eq!(again.since_unix_ms, first.since_unix_ms);
        assert!(again.until_unix_ms >= first.until_unix_ms);
        // What the store keeps is what a restart restores: 60 s left stays about 60 s, on
        // the monotonic clock of the new process, however the wall clock reads.
        let row = match again.store_change() {
            crate::state::Change::Degrade(row) => row,
            other => panic!("{other:?}"),
        };
        let restored = Modes::new(DegradedScope::Node, None);
        let (now, now_ns) = (SystemTime::now(), monotonic_ns());
        restored
            .restore(std::slice::from_ref(&row), now, now_ns)
            .expect("restore");
        assert!(restored.is_degraded(key("a")) && !restored.is_degraded(key("b")));
        let left = restored.next_expiry(now_ns).expect("its timer");
        assert!(
            left > Duration::from_secs(58) && left <= Duration::from_secs(60),
            "{left:?}"
        );
        assert_eq!(restored.expire(now_ns + 61_000_000_000).len(), 1);
        let bad = ScopeRow {
            scope: "key:nothex".into(),
            ..row
        };
        assert!(restored.restore(&[bad], now, now_ns).is_err());
    }

    #[test]
    fn failed_turns_leave_committed_state_alone() {
        let m = Modes::new(DegradedScope::Key, None);
        let a = key("a");
        m.commit_turn(a, "1.1", 10, 1);
        let before = m.conversation(a).expect("state");
        m.fail_turn(a);
        let after = m.conversation(a).expect("state");
        assert_eq!(after.turns_committed, before.turns_committed);
        assert_eq!(after.tokens_committed, before.tokens_committed);
        assert_eq!(after.last_committed_turn, before.last_committed_turn);
        assert_eq!(after.turns_failed, 1);
    }
}
