//! Changes of degraded safe mode (`modes.rs`): recorded in the ledger and the state store,
//! counted, and, for a scope entering it, queued for escalation (`--escalation-url`,
//! `escalation.rs`).

use std::sync::Arc;

use serde_json::json;

use super::HaltCore;
use crate::{
    ledger::{Record, RecordKind},
    modes::{metrics::EscalationOutcome, ChangedBy, ModeChange, RuntimeMode},
};

impl HaltCore {
    /// Records a change of `runtime_mode` and counts it.
    pub fn record_mode_change(&self, ch: &ModeChange) {
        if ch.from != ch.to {
            self.metrics.modes.changed(ch.to, ch.by);
        }
        self.metrics
            .modes
            .degraded_scopes
            .set(self.modes.degraded_count() as i64);
        tracing::warn!(scope = %ch.scope, from = %ch.from, to = %ch.to, by = %ch.by, cause = ch.cause.as_deref(), "runtime_mode changed");
        let rec = Record {
            kind: RecordKind::Lifecycle,
            runtime_mode: ch.to.as_str().to_owned(),
            kernel_gate: self.kernel_gate_label().to_owned(),
            stream_id: ch.stream_id.clone(),
            mode_change: serde_json::to_value(ch).ok(),
            message: Some(format!(
                "runtime_mode {} -> {} for {} ({})",
                ch.from, ch.to, ch.scope, ch.by
            )),
            ..Record::default()
        };
        // The state store follows the ledger: the change is stored once its record is on
        // disk, with that record's seq and hash (`state.rs`, crash order).
        let (state, change) = (Arc::clone(&self.state), ch.store_change());
        let queued = self.ledger.append_linked(rec, move |written| {
            if let Ok(w) = written {
                state.apply(Some(w.into()), vec![change]);
            }
        });
        if let Err(e) = queued {
            self.record_failed(&e);
        }
        self.escalate(ch);
    }

    /// Ends the degraded scopes whose timer ran out, recording each change.
    pub fn expire_degraded(&self) {
        for ch in self.modes.expire(crate::clock::monotonic_ns()) {
            self.record_mode_change(&ch);
        }
    }

    /// Queues a scope's entry into degraded mode (by a halt, or the start's whole-node degrade)
    /// for escalation to a human. Never waits: with the queue full the incident is dropped,
    /// counted and logged.
    fn escalate(&self, ch: &ModeChange) {
        let Some(queue) = &self.escalations else {
            return;
        };
        let entered = ch.from == RuntimeMode::Full && ch.to == RuntimeMode::Degraded;
        if !entered || !matches!(ch.by, ChangedBy::Halt | ChangedBy::Start) {
            return;
        }
        let incident = json!({
            "event": "degraded",
            "scope": ch.scope,
            "by": ch.by,
            "cause": ch.cause,
            "stream_id": ch.stream_id,
            "since_unix_ms": ch.since_unix_ms,
            "until_unix_ms": ch.until_unix_ms,
        });
        if queue.try_send(incident).is_err() {
            self.metrics.modes.escalated(EscalationOutcome::Dropped);
            tracing::error!(scope = %ch.scope, "escalation dropped: the queue of escalations waiting is full (the endpoint is slow or down)");
        }
    }
}
