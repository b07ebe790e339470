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
//! failed turn (halted, upstream failure, client gone) leaves it as it was.
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

use crate::{clock::unix_ms, codes::FailureCode};

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
    /// When the timer ends it (Unix ms); `None`: only the operator does.
    pub until_unix_ms: Option<u64>,
    pub cause: String,
    pub stream_id: String,
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
}

impl ChangedBy {
    pub const fn as_str(self) -> &'static str {
        match self {
            ChangedBy::Halt => "halt",
            ChangedBy::Operator => "operator",
            ChangedBy::Timer => "timer",
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
    /// no scope has a timer.
    pub fn next_expiry(&self, now: SystemTime) -> Option<Duration> {
        let now_ms = unix_ms(now);
        let inner = self.lock();
        inner
            .node
            .iter()
            .chain(inner.keys.values())
            .filter_map(|d| d.until_unix_ms)
            .min()
            .map(|u| Duration::from_millis(u.saturating_sub(now_ms)))
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

    /// Ends the scopes whose timer ran out; returns the changes to record.
    pub fn expire(&self, now: SystemTime) -> Vec<ModeChange> {
        let now_ms = unix_ms(now);
        let mut inner = self.lock();
        let mut out = Vec::new();
        let due = |d: &Degraded| d.until_unix_ms.is_some_and(|u| u <= now_ms);
        if inner.node.as_ref().is_some_and(due) {
            inner.node = None;
            out.push(ModeChange {
                scope: scope_name(None),
                from: RuntimeMode::Degraded,
                to: RuntimeMode::Full,
                by: ChangedBy::Timer,
                cause: None,
                stream_id: None,
            });
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
            out.push(ModeChange {
                scope: scope_name(Some(k)),
                from: RuntimeMode::Degraded,
                to: RuntimeMode::Full,
                by: ChangedBy::Timer,
                cause: None,
                stream_id: None,
            });
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
    /// to record, or `None` if the cause does not degrade or the scope already was.
    pub fn enter(&self, key: KeyId, cause: FailureCode, stream_id: &str) -> Option<ModeChange> {
        if !cause_degrades(cause) {
            return None;
        }
        let now = SystemTime::now();
        let d = Degraded {
            since_unix_ms: unix_ms(now),
            until_unix_ms: self.hold.map(|h| unix_ms(now + h)),
            cause: cause.as_str().to_owned(),
            stream_id: stream_id.to_owned(),
        };
        let mut inner = self.lock();
        if d.until_unix_ms.is_some() {
            self.timer_set.notify_one();
        }
        let key = match self.scope {
            DegradedScope::Node => {
                if let Some(cur) = inner.node.as_mut() {
                    // Already degraded: a new halt restarts the timer, no mode change.
                    cur.until_unix_ms = d.until_unix_ms;
                    return None;
                }
                inner.node = Some(d);
                None
            }
            DegradedScope::Key => {
                if let Some(cur) = inner.keys.get_mut(&key) {
                    cur.until_unix_ms = d.until_unix_ms;
                    return None;
                }
                inner.keys.insert(key, d);
                Some(key)
            }
        };
        Some(ModeChange {
            scope: scope_name(key),
            from: RuntimeMode::Full,
            to: RuntimeMode::Degraded,
            by: ChangedBy::Halt,
            cause: Some(cause.as_str().to_owned()),
            stream_id: Some(stream_id.to_owned()),
        })
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
            .map(|k| ModeChange {
                scope: scope_name(k),
                from: RuntimeMode::Degraded,
                to: RuntimeMode::Full,
                by: ChangedBy::Operator,
                cause: None,
                stream_id: None,
            })
            .collect()
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

    /// Commits a cleanly ended turn into its conversation's state.
    pub fn commit_turn(&self, key: KeyId, turn_id: &str, tokens: u64, tool_calls: u64) {
        let mut inner = self.lock();
        let c = inner.conversations.entry(key).or_default();
        c.turns_committed += 1;
        c.tokens_committed += tokens;
        c.tool_calls_committed += tool_calls;
        c.last_committed_turn = Some(turn_id.to_owned());
    }

    /// Notes a failed turn: the count of failures moves, the committed state does not.
    pub fn fail_turn(&self, key: KeyId) {
        self.lock()
            .conversations
            .entry(key)
            .or_default()
            .turns_failed += 1;
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
        assert!(m
            .expire(SystemTime::now() + Duration::from_secs(1 << 30))
            .is_empty());
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

    #[test]
    fn node_scope_degrades_everyone_and_the_timer_ends_it() {
        let m = Modes::new(DegradedScope::Node, Some(Duration::from_secs(10)));
        m.enter(key("a"), FailureCode::CoherenceBelowThreshold, "2.1")
            .expect("change");
        assert!(m.is_degraded(key("zzz")));
        assert!(m.expire(SystemTime::now()).is_empty());
        let ended = m.expire(SystemTime::now() + Duration::from_secs(11));
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
        let now = SystemTime::now();
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
        assert_eq!(
            m.next_expiry(now + Duration::from_secs(20)),
            Some(Duration::ZERO)
        );
        m.set_full(ScopeSel::All);
        assert_eq!(m.next_expiry(now), None);
        // Without a hold nothing has a timer, and nobody is told.
        let forever = Modes::new(DegradedScope::Node, None);
        forever.enter(key("b"), FailureCode::CoherenceBelowThreshold, "3.2");
        assert_eq!(forever.next_expiry(now), None);
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
