//! The dispatched tool calls of failed turns, and their reconciliation (docs/tokencircuit.md
//! §1b).
//!
//! A turn that fails after the client got a tool call leaves an effect haltd cannot know: the
//! agent may have run the call. TURN-ACID records the call `dispatched` with
//! `"reconciliation": "required"`; this registry keeps it until an operator says what happened
//! (`haltctl reconcile REF --outcome done|not_done|compensated`, each outcome an `admin`
//! ledger record with the operator's identity), and it survives restarts (the state store's
//! `dispatched` table, written after the turn's record).
//!
//! Until then the call is an unresolved `ambiguous_effect`: in its conversation, a retry of
//! it (the same tool with the same canonical arguments) is refused. `not_done` allows that
//! retry once; `done` (a retry would duplicate the effect) and `compensated` (it would redo
//! what was undone) keep refusing it. A call of a conversation TokenCircuit does not know
//! (`[tool_circuit]` off) is listed and reconciled the same way, and guards nothing.
//!
//! Bounded by what the operator reconciles: an unreconciled call is never dropped (the
//! `HaltdUnreconciledToolCalls` alert fires on its age). One mutex, taken per failed turn with
//! calls, per judged call of a conversation that has dispatched calls, and per admin request.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use prometheus_client::metrics::gauge::Gauge;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{canonical::CanonicalArgs, conversation::ConversationId};
use crate::state::{Change, DispatchedRow, StateStore};

/// What the operator found a dispatched call did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The effect happened: a retry would duplicate it.
    Done,
    /// The effect did not happen: one retry is allowed.
    NotDone,
    /// The effect happened and was undone: a retry would redo it.
    Compensated,
}

impl Outcome {
    pub const ALL: [Outcome; 3] = [Outcome::Done, Outcome::NotDone, Outcome::Compensated];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Done => "done",
            Outcome::NotDone => "not_done",
            Outcome::Compensated => "compensated",
        }
    }

    /// `done`, `not_done` or `compensated`.
    pub fn parse(s: &str) -> Option<Outcome> {
        Outcome::ALL.into_iter().find(|o| o.as_str() == s)
    }
}

/// A tool call a failed turn delivered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DispatchedCall {
    /// Its reference (`haltctl reconcile REF`): 12 hex digits.
    #[serde(rename = "ref")]
    pub reference: String,
    /// The caller's key fingerprint.
    pub key: String,
    /// Its conversation (`None`: TokenCircuit was off, the conversation is unknown).
    #[serde(default)]
    pub conversation: Option<ConversationId>,
    pub call_id: String,
    pub tool: String,
    /// SHA-256 of its canonical arguments, 32 hex digits (the arguments are prompt text).
    pub arguments_sha256: String,
    /// When the kernel accepted the frame that carried it to the client.
    pub delivered_unix_ms: u64,
    /// The failed turn's stream.
    pub stream_id: String,
    #[serde(default)]
    pub outcome: Option<Outcome>,
    #[serde(default)]
    pub reconciled_unix_ms: Option<u64>,
    /// Who reconciled it (the admin caller's identity).
    #[serde(default)]
    pub reconciled_by: Option<serde_json::Value>,
    /// `not_done`: its one retry went out.
    #[serde(default)]
    pub retried: bool,
}

impl DispatchedCall {
    /// The call a turn record's `tool_calls` entry `c` states, if it needs reconciliation.
    pub fn of_turn_record(rec: &serde_json::Value, c: &serde_json::Value) -> Option<Self> {
        if c.get("reconciliation")? != "required" {
            return None;
        }
        let text = |v: &serde_json::Value| v.as_str().map(str::to_owned);
        Some(DispatchedCall {
            reference: text(&c["ref"])?,
            key: text(&rec["conversation"]).unwrap_or_default(),
            conversation: serde_json::from_value(c["conversation"].clone()).ok(),
            call_id: text(&c["id"]).unwrap_or_default(),
            tool: text(&c["name"]).unwrap_or_default(),
            arguments_sha256: text(&c["arguments_sha256"])?,
            delivered_unix_ms: c["delivered_unix_ms"].as_u64().unwrap_or(0),
            stream_id: text(&rec["stream_id"]).unwrap_or_default(),
            outcome: None,
            reconciled_unix_ms: None,
            reconciled_by: None,
            retried: false,
        })
    }
}

/// The digest of a call's arguments that a retry is matched by.
pub fn arguments_digest(arguments: &str) -> String {
    let d = Sha256::digest(CanonicalArgs::of(arguments).as_str().as_bytes());
    d[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// The reference of a call: its stream, call id and delivery time (unique across restarts).
pub fn reference(stream_id: &str, call_id: &str, delivered_unix_ms: u64) -> String {
    let mut d = Sha256::new();
    for part in [stream_id, call_id, &delivered_unix_ms.to_string()] {
        d.update(part.as_bytes());
        d.update([0]);
    }
    d.finalize()[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What a retry of a dispatched call may do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Guard {
    /// No dispatched call of its conversation matches.
    Clear,
    /// It matches a call not reconciled yet, or reconciled `done` or `compensated`: refused.
    Refused(Box<DispatchedCall>),
    /// It matches a call reconciled `not_done` whose retry has not gone out: allowed once (the
    /// reference, to mark with [`Dispatched::retried`]).
    RetryOnce(String),
}

/// Why a reconciliation was not recorded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReconcileError {
    #[error("no dispatched call {0:?} (see `haltctl reconcile`)")]
    Unknown(String),
    #[error("call {reference:?} was reconciled already ({outcome}); an outcome is recorded once")]
    Already {
        reference: String,
        outcome: &'static str,
    },
}

/// `/metrics`: `haltd_tool_circuit_unreconciled_calls`,
/// `haltd_tool_circuit_unreconciled_oldest_delivered_seconds` (0 with none) and
/// `haltd_tool_circuit_reconcile_alert_after_seconds` (the configured age).
#[derive(Clone, Debug, Default)]
pub struct DispatchedGauges {
    pub unreconciled: Gauge,
    pub oldest_delivered_seconds: Gauge,
    pub alert_after_seconds: Gauge,
}

/// The registry.
#[derive(Debug, Default)]
pub struct Dispatched {
    calls: Mutex<BTreeMap<String, DispatchedCall>>,
    gauges: DispatchedGauges,
    persist: Option<Arc<StateStore>>,
}

impl Dispatched {
    /// The registry, counting into `gauges`, keeping its changes in `state` (`None`: in memory
    /// only), holding `restored` (what the state store kept).
    pub fn new(
        gauges: DispatchedGauges,
        persist: Option<Arc<StateStore>>,
        restored: &[DispatchedRow],
    ) -> Result<Self, String> {
        let mut calls = BTreeMap::new();
        for row in restored {
            let call: DispatchedCall = serde_json::from_value(row.body.clone())
                .map_err(|e| format!("dispatched call {:?}: {e}", row.reference))?;
            calls.insert(call.reference.clone(), call);
        }
        let d = Dispatched {
            calls: Mutex::new(calls),
            gauges,
            persist,
        };
        d.update_gauges(&d.lock());
        Ok(d)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, DispatchedCall>> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn update_gauges(&self, calls: &BTreeMap<String, DispatchedCall>) {
        let open = calls.values().filter(|c| c.outcome.is_none());
        let (n, oldest) = open.fold((0, u64::MAX), |(n, o), c| {
            (n + 1, o.min(c.delivered_unix_ms))
        });
        self.gauges.unreconciled.set(n);
        let oldest = if n == 0 { 0 } else { oldest / 1000 };
        self.gauges
            .oldest_delivered_seconds
            .set(i64::try_from(oldest).unwrap_or(i64::MAX));
    }

    /// The state store's change that keeps `call`.
    pub fn change(call: &DispatchedCall) -> Change {
        Change::Dispatched(DispatchedRow {
            reference: call.reference.clone(),
            body: serde_json::to_value(call).unwrap_or_default(),
        })
    }

    /// A failed turn delivered `calls`: held from now on. Returns the state store's changes,
    /// to apply once the turn's record is written (a call held already is left as it is).
    pub fn add(&self, calls: Vec<DispatchedCall>) -> Vec<Change> {
        let mut held = self.lock();
        let mut changes = Vec::new();
        for c in calls {
            if !held.contains_key(&c.reference) {
                changes.push(Dispatched::change(&c));
                held.insert(c.reference.clone(), c);
            }
        }
        self.update_gauges(&held);
        changes
    }

    /// The calls held, delivered first: the unreconciled ones, or with `all` every one.
    pub fn list(&self, all: bool) -> Vec<DispatchedCall> {
        let mut out: Vec<DispatchedCall> = self
            .lock()
            .values()
            .filter(|c| all || c.outcome.is_none())
            .cloned()
            .collect();
        out.sort_by(|a, b| {
            (a.delivered_unix_ms, &a.reference).cmp(&(b.delivered_unix_ms, &b.reference))
        });
        out
    }

    /// Records the operator's `outcome` for call `reference`. Returns the call as it is now;
    /// the caller writes the ledger record, then [`Self::keep`]s it.
    pub fn reconcile(
        &self,
        reference: &str,
        outcome: Outcome,
        by: serde_json::Value,
        now_unix_ms: u64,
    ) -> Result<DispatchedCall, ReconcileError> {
        let mut held = self.lock();
        let call = held
            .get_mut(reference)
            .ok_or_else(|| ReconcileError::Unknown(reference.to_owned()))?;
        if let Some(o) = call.outcome {
            return Err(ReconcileError::Already {
                reference: reference.to_owned(),
                outcome: o.as_str(),
            });
        }
        call.outcome = Some(outcome);
        call.reconciled_unix_ms = Some(now_unix_ms);
        call.reconciled_by = Some(by);
        let call = call.clone();
        self.update_gauges(&held);
        Ok(call)
    }

    /// Queues `call` for the state store (after the ledger record that states it).
    pub fn keep(&self, call: &DispatchedCall) {
        if let Some(state) = &self.persist {
            state.apply(None, vec![Dispatched::change(call)]);
        }
    }

    /// What a call of tool `tool` with arguments digest `digest` may do in `conv`.
    pub fn guard(&self, conv: &ConversationId, tool: &str, digest: &str) -> Guard {
        let held = self.lock();
        let mut matching = held.values().filter(|c| {
            c.conversation.as_ref() == Some(conv) && c.tool == tool && c.arguments_sha256 == digest
        });
        let mut once = None;
        for c in matching.by_ref() {
            match c.outcome {
                Some(Outcome::NotDone) if c.retried => {}
                Some(Outcome::NotDone) => once = once.or(Some(c.reference.clone())),
                None | Some(Outcome::Done | Outcome::Compensated) => {
                    return Guard::Refused(Box::new(c.clone()))
                }
            }
        }
        once.map_or(Guard::Clear, Guard::RetryOnce)
    }

    /// Takes in what the ledger states after the store's point (`records`, in order: a crash
    /// came between a record and the store's write): a failed turn's dispatched calls not
    /// held yet, and outcomes not recorded yet. Returns the state store's changes.
    pub fn replay(&self, records: &[serde_json::Value]) -> Vec<Change> {
        let mut changes = Vec::new();
        for rec in records {
            if let Some(call) = rec.pointer("/admin/call").filter(|c| c.is_object()) {
                let Ok(call) = serde_json::from_value::<DispatchedCall>(call.clone()) else {
                    continue;
                };
                let mut held = self.lock();
                let known = held
                    .get(&call.reference)
                    .is_some_and(|c| c.outcome.is_some());
                if !known && call.outcome.is_some() {
                    changes.push(Dispatched::change(&call));
                    held.insert(call.reference.clone(), call);
                }
                continue;
            }
            let calls = rec["tool_calls"].as_array().into_iter().flatten();
            let from_turn = calls.filter_map(|c| DispatchedCall::of_turn_record(rec, c));
            changes.extend(self.add(from_turn.collect()));
        }
        self.update_gauges(&self.lock());
        changes
    }

    /// The one retry `not_done` allowed went out.
    pub fn retried(&self, reference: &str) {
        let mut held = self.lock();
        if let Some(c) = held.get_mut(reference) {
            c.retried = true;
            let c = c.clone();
            drop(held);
            self.keep(&c);
        }
    }
}

#[cfg(test)]
mod tests;
