//! Per-scope limits on one node (issue 36): turns in flight, requests per minute and tokens
//! per minute, per degraded-mode scope (`scope.rs`: the key store's key, else the
//! `--identity-header` value, else the client address group).
//!
//! - **Concurrency** counts the governed turns a scope has open: a turn takes a place when it
//!   is admitted and gives it back when it is dropped ([`Place`]), however it ended.
//! - **Requests per minute** counts admitted turns in a fixed one-minute window that starts
//!   with the scope's first request after the last window ended.
//! - **Tokens per minute** counts prompt and output tokens in the same window, charged when a
//!   turn ends and its usage is known ([`LimitTable::charge`]): a turn that starts under the
//!   limit runs to its end, and the next request after the window is full is refused.
//!
//! Over a limit a request is refused before any upstream work, with 429 and `Retry-After`
//! (the seconds until the window ends; 1 for concurrency). The counts are this node's: a
//! fleet of N nodes admits up to N times a limit until limits are shared between nodes.
//!
//! One mutex guards the table: taken at admission, at a turn's end and when its place is
//! given back, never per token. Scopes with nothing in flight and an ended window are
//! removed by a sweep ([`LimitTable::sweep`]) that admission runs whenever the table has
//! doubled since the last one (at least [`SWEEP_FLOOR`] scopes): amortised constant work per
//! request, no timer waking an idle haltd, and memory bounded by twice the scopes of the
//! last minute, plus the key store's keys, whose totals are kept.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use crate::scope::Scope;

/// The table size under which admission never sweeps.
pub const SWEEP_FLOOR: usize = 1024;

/// One minute, the window of the per-minute limits.
pub const WINDOW_NS: u64 = 60_000_000_000;

/// The limits of one scope; 0 means none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Limits {
    /// Governed turns open at once.
    pub concurrency: u32,
    /// Governed turns admitted per minute.
    pub requests_per_minute: u32,
    /// Prompt and output tokens per minute.
    pub tokens_per_minute: u64,
}

impl Limits {
    pub fn is_none(&self) -> bool {
        *self == Limits::default()
    }
}

/// Which limit refused a request (the `limit` label of `haltd_limit_refusals_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Limit {
    Concurrency,
    RequestsPerMinute,
    TokensPerMinute,
}

impl Limit {
    pub const ALL: [Limit; 3] = [
        Limit::Concurrency,
        Limit::RequestsPerMinute,
        Limit::TokensPerMinute,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            Limit::Concurrency => "concurrency",
            Limit::RequestsPerMinute => "requests_per_minute",
            Limit::TokensPerMinute => "tokens_per_minute",
        }
    }
}

/// A refusal: the limit, its value, and when to retry (whole seconds, at least 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refused {
    pub limit: Limit,
    pub value: u64,
    pub retry_after_s: u64,
}

impl Refused {
    /// What the client is told.
    pub fn message(&self) -> String {
        let what = match self.limit {
            Limit::Concurrency => "turns open at once",
            Limit::RequestsPerMinute => "requests per minute",
            Limit::TokensPerMinute => "tokens per minute",
        };
        format!(
            "over this node's limit of {} {what} for your scope; retry after {} s",
            self.value, self.retry_after_s
        )
    }
}

/// What one scope used.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Usage {
    pub in_flight: u32,
    /// Requests and tokens in the current window.
    pub requests: u32,
    pub tokens: u64,
    /// Requests admitted and tokens charged since the scope was first seen (a key's survive
    /// restarts in the state store; others start at zero).
    pub requests_total: u64,
    pub tokens_total: u64,
    /// When the current window ends (the monotonic clock).
    #[serde(skip)]
    window_end_ns: u64,
}

/// A scope's counts as the state store keeps them (keys of the key store only): the window
/// by the wall clock, so that a restart resumes it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoredUsage {
    pub window_start_unix_ms: u64,
    pub requests: u32,
    pub tokens: u64,
    pub requests_total: u64,
    pub tokens_total: u64,
}

impl Usage {
    /// Starts a new window if the current one ended by `now_ns`.
    fn roll(&mut self, now_ns: u64) {
        if now_ns >= self.window_end_ns {
            self.window_end_ns = now_ns.saturating_add(WINDOW_NS);
            self.requests = 0;
            self.tokens = 0;
        }
    }

    fn retry_after_s(&self, now_ns: u64) -> u64 {
        self.window_end_ns
            .saturating_sub(now_ns)
            .div_ceil(1_000_000_000)
            .max(1)
    }
}

/// The counts of every scope, under the node's limits.
#[derive(Debug)]
pub struct LimitTable {
    limits: Limits,
    usage: Mutex<HashMap<Scope, Usage>>,
    /// The table size at which admission sweeps next.
    sweep_at: std::sync::atomic::AtomicUsize,
}

/// A turn's place in its scope's concurrency: given back when dropped.
#[derive(Debug)]
pub struct Place {
    table: Arc<LimitTable>,
    scope: Scope,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut usage = self.table.lock();
        if let Some(u) = usage.get_mut(&self.scope) {
            u.in_flight = u.in_flight.saturating_sub(1);
        }
    }
}

impl Place {
    pub fn scope(&self) -> Scope {
        self.scope
    }
}

impl LimitTable {
    pub fn new(limits: Limits) -> Arc<LimitTable> {
        Arc::new(LimitTable {
            limits,
            usage: Mutex::new(HashMap::new()),
            sweep_at: std::sync::atomic::AtomicUsize::new(SWEEP_FLOOR),
        })
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Scope, Usage>> {
        // Every update is a few counter changes: consistent across a panic.
        self.usage.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits a turn of `scope` under its limits `l` (the node's, or a key's own) at `now_ns`
    /// (the monotonic clock), or says which limit refuses it. An admitted turn holds its [`Place`] until it is dropped.
    pub fn admit(self: &Arc<Self>, scope: Scope, l: Limits, now_ns: u64) -> Result<Place, Refused> {
        let mut usage = self.lock();
        if usage.len() >= self.sweep_at.load(std::sync::atomic::Ordering::Relaxed) {
            Self::sweep_locked(&mut usage, now_ns);
            let next = (usage.len() * 2).max(SWEEP_FLOOR);
            self.sweep_at
                .store(next, std::sync::atomic::Ordering::Relaxed);
        }
        let u = usage.entry(scope).or_default();
        u.roll(now_ns);
        let refused = |limit, value: u64, retry_after_s| {
            Err(Refused {
                limit,
                value,
                retry_after_s,
            })
        };
        if l.concurrency > 0 && u.in_flight >= l.concurrency {
            return refused(Limit::Concurrency, u64::from(l.concurrency), 1);
        }
        if l.requests_per_minute > 0 && u.requests >= l.requests_per_minute {
            let retry = u.retry_after_s(now_ns);
            return refused(
                Limit::RequestsPerMinute,
                u64::from(l.requests_per_minute),
                retry,
            );
        }
        if l.tokens_per_minute > 0 && u.tokens >= l.tokens_per_minute {
            return refused(
                Limit::TokensPerMinute,
                l.tokens_per_minute,
                u.retry_after_s(now_ns),
            );
        }
        u.requests += 1;
        u.requests_total += 1;
        u.in_flight += 1;
        Ok(Place {
            table: Arc::clone(self),
            scope,
        })
    }

    /// Charges a turn's prompt and output tokens to its scope's window, once its usage is
    /// known (at its end).
    pub fn charge(&self, scope: Scope, tokens: u64, now_ns: u64) -> Usage {
        let mut usage = self.lock();
        let u = usage.entry(scope).or_default();
        u.roll(now_ns);
        u.tokens = u.tokens.saturating_add(tokens);
        u.tokens_total = u.tokens_total.saturating_add(tokens);
        *u
    }

    /// `usage` as the state store keeps it, `now` being `now_ns` on the monotonic clock and
    /// `now_unix_ms` on the wall clock.
    pub fn stored(usage: &Usage, now_ns: u64, now_unix_ms: u64) -> StoredUsage {
        let left_ms = usage.window_end_ns.saturating_sub(now_ns) / 1_000_000;
        let age_ms = (WINDOW_NS / 1_000_000).saturating_sub(left_ms);
        StoredUsage {
            window_start_unix_ms: now_unix_ms.saturating_sub(age_ms),
            requests: usage.requests,
            tokens: usage.tokens,
            requests_total: usage.requests_total,
            tokens_total: usage.tokens_total,
        }
    }

    /// Puts back a key's counts the state store kept (at start): its window goes on if it has
    /// not ended by `now_unix_ms`.
    pub fn restore(&self, scope: Scope, kept: &StoredUsage, now_ns: u64, now_unix_ms: u64) {
        let age_ns = now_unix_ms
            .saturating_sub(kept.window_start_unix_ms)
            .saturating_mul(1_000_000);
        let mut u = Usage {
            in_flight: 0,
            requests: kept.requests,
            tokens: kept.tokens,
            requests_total: kept.requests_total,
            tokens_total: kept.tokens_total,
            window_end_ns: now_ns.saturating_add(WINDOW_NS.saturating_sub(age_ns)),
        };
        u.roll(now_ns);
        self.lock().insert(scope, u);
    }

    /// Removes the scopes with nothing in flight whose window ended, but for keys of the store.
    pub fn sweep(&self, now_ns: u64) {
        Self::sweep_locked(&mut self.lock(), now_ns);
    }

    fn sweep_locked(usage: &mut HashMap<Scope, Usage>, now_ns: u64) {
        // A key of the store keeps its totals (stored, shown by `haltctl key list`); the keys
        // are as many as the store holds, so they do not grow the table without bound.
        usage.retain(|scope, u| {
            u.in_flight > 0
                || now_ns < u.window_end_ns
                || scope.kind == crate::scope::ScopeKind::Apikey
        });
    }

    /// What each scope used, for the admin API (its window's counts as of `now_ns`).
    pub fn view(&self, now_ns: u64) -> Vec<(Scope, Usage)> {
        let mut all: Vec<(Scope, Usage)> = self
            .lock()
            .iter()
            .map(|(s, u)| {
                let mut u = *u;
                u.roll(now_ns);
                (*s, u)
            })
            .collect();
        all.sort_unstable_by_key(|(s, _)| *s);
        all
    }
}

#[cfg(test)]
mod tests;
