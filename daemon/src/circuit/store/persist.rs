//! TokenCircuit's memory in the state store (`crate::state`, table `circuits`): one row per
//! conversation, its body a JSON document, so that a restart or a crash forgets no budget and
//! no backoff clock.
//!
//! Instants are process-local: a row keeps them as Unix milliseconds, converted with the
//! clocks read together when the row is written ([`WallClock`]), and turned back into instants
//! at start. As for a degraded scope's timer, a wall-clock step while haltd was down moves
//! them: backwards, a backoff lasts longer; forwards, shorter.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, VecDeque},
    time::{Duration, Instant, SystemTime},
};

use serde::{Deserialize, Serialize};

use super::{ConversationId, Entry, IdSource};
use crate::{
    circuit::{
        memory::{FailedCall, Memory},
        transcript::Timeline,
        DiagnosticArtifact,
    },
    state::CircuitRow,
};

/// The monotonic clock and the wall clock, read together: converts between instants and Unix
/// milliseconds.
#[derive(Clone, Copy, Debug)]
pub struct WallClock {
    instant: Instant,
    unix_ms: u64,
}

impl WallClock {
    pub fn now() -> Self {
        WallClock::at(Instant::now(), SystemTime::now())
    }

    pub fn at(instant: Instant, wall: SystemTime) -> Self {
        let unix_ms = wall
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        WallClock { instant, unix_ms }
    }

    /// `t` in Unix milliseconds.
    pub fn unix_ms(&self, t: Instant) -> u64 {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        if t >= self.instant {
            self.unix_ms.saturating_add(ms(t - self.instant))
        } else {
            self.unix_ms.saturating_sub(ms(self.instant - t))
        }
    }

    /// The instant of `unix_ms`. One the monotonic clock cannot represent (too far back)
    /// becomes a day, else an hour, before now: still past every backoff (at most
    /// `MAX_BACKOFF_MS`, ten minutes); failing both, now itself (the backoff starts again:
    /// stricter, never looser).
    pub fn instant(&self, unix_ms: u64) -> Instant {
        if unix_ms >= self.unix_ms {
            return self.instant + Duration::from_millis(unix_ms - self.unix_ms);
        }
        let back = Duration::from_millis(self.unix_ms - unix_ms);
        [
            back,
            Duration::from_secs(86_400),
            Duration::from_secs(3_600),
        ]
        .into_iter()
        .find_map(|d| self.instant.checked_sub(d.min(back)))
        .unwrap_or(self.instant)
    }
}

/// A row's body. Every field has a default, so that a field added later reads from an older
/// row.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct Saved {
    emitted: BTreeMap<String, u64>,
    arrived: BTreeMap<String, u64>,
    delivered: BTreeSet<String>,
    failed: Vec<FailedCall>,
    open: Vec<DiagnosticArtifact>,
    artifacts: Vec<DiagnosticArtifact>,
    last_seen_unix_ms: u64,
    turns: u64,
    tokens: u64,
    tokens_saved: u64,
}

pub(super) fn source_str(s: IdSource) -> &'static str {
    match s {
        IdSource::Header => "header",
        IdSource::Digest => "digest",
    }
}

/// The row of a kept conversation.
pub(super) fn row(conv: &ConversationId, e: &Entry, clock: &WallClock) -> CircuitRow {
    let times = |m: &HashMap<String, Instant>| {
        m.iter()
            .map(|(id, t)| (id.clone(), clock.unix_ms(*t)))
            .collect()
    };
    let saved = Saved {
        emitted: times(&e.timeline.emitted),
        arrived: times(&e.timeline.arrived),
        delivered: e.timeline.delivered.iter().cloned().collect(),
        failed: e.memory.calls().cloned().collect(),
        open: e.open.clone(),
        artifacts: e.artifacts.iter().cloned().collect(),
        last_seen_unix_ms: clock.unix_ms(e.last_seen),
        turns: e.turns,
        tokens: e.tokens,
        tokens_saved: e.tokens_saved,
    };
    row_of(conv, false, &saved)
}

/// The row of an evicted conversation kept for its refused keys: their failed calls only.
pub(super) fn retained_row(conv: &ConversationId, memory: &Memory) -> CircuitRow {
    let saved = Saved {
        failed: memory.calls().cloned().collect(),
        ..Saved::default()
    };
    row_of(conv, true, &saved)
}

fn row_of(conv: &ConversationId, retained: bool, saved: &Saved) -> CircuitRow {
    CircuitRow {
        key: conv.key.clone(),
        id: conv.id.clone(),
        source: source_str(conv.source).to_owned(),
        retained,
        body: serde_json::to_value(saved).unwrap_or_default(),
    }
}

/// The conversation of a row.
pub(super) fn conversation(row: &CircuitRow) -> Result<ConversationId, String> {
    let source = match row.source.as_str() {
        "header" => IdSource::Header,
        "digest" => IdSource::Digest,
        other => return Err(format!("conversation {:?}: source {other:?}", row.id)),
    };
    Ok(ConversationId {
        key: row.key.clone(),
        id: row.id.clone(),
        source,
    })
}

fn saved(row: &CircuitRow) -> Result<Saved, String> {
    serde_json::from_value(row.body.clone())
        .map_err(|e| format!("TokenCircuit conversation {:?}: {e}", row.id))
}

/// A kept conversation's entry (its tick set by the caller), and when it was last seen.
pub(super) fn entry(row: &CircuitRow, clock: &WallClock) -> Result<(Entry, u64), String> {
    let s = saved(row)?;
    let times = |m: BTreeMap<String, u64>| {
        m.into_iter()
            .map(|(id, ms)| (id, clock.instant(ms)))
            .collect::<HashMap<_, _>>()
    };
    let emitted = times(s.emitted);
    // Delivered is a subset of emitted (`Timeline`): a row that says otherwise is not trusted
    // further than that.
    let delivered = s
        .delivered
        .into_iter()
        .filter(|id| emitted.contains_key(id))
        .collect();
    let entry = Entry {
        timeline: Timeline {
            emitted,
            arrived: times(s.arrived),
            delivered,
        },
        memory: memory_of(s.failed),
        artifacts: VecDeque::from(s.artifacts),
        open: s.open,
        last_seen: clock.instant(s.last_seen_unix_ms),
        tick: 0,
        turns: s.turns,
        tokens: s.tokens,
        tokens_saved: s.tokens_saved,
    };
    Ok((entry, s.last_seen_unix_ms))
}

/// A retained conversation's failed calls.
pub(super) fn retained(row: &CircuitRow) -> Result<Memory, String> {
    saved(row).map(|s| memory_of(s.failed))
}

fn memory_of(failed: Vec<FailedCall>) -> Memory {
    let mut m = Memory::default();
    for c in failed {
        m.remember(c);
    }
    m
}
