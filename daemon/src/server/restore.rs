//! The start's side of the state store (`crate::state`): opened after the ledger, checked
//! against it, and restored into degraded safe mode before any turn is served; then linked to
//! the start's own record.

use std::sync::{mpsc, Arc};

use super::StartError;
use crate::{
    circuit::{
        dispatched::Dispatched,
        policy::DEFAULT_RECONCILE_ALERT_AFTER_S,
        store::{persist::WallClock, ConversationStore},
    },
    config::Config,
    halt::HaltCore,
    identity::NodeSecret,
    ledger::Record,
    modes::{KeyId, Modes},
    state::{
        restore::{self, OnMismatch, Verdict},
        Change, CircuitRow, DispatchedRow, Snapshot, StateError, StateStore,
    },
};

/// What the start runs with.
pub(super) struct Opened {
    pub(super) store: Arc<StateStore>,
    pub(super) modes: Modes,
    /// TokenCircuit's memory and the dispatched calls, for the conversation store.
    pub(super) circuits: Vec<CircuitRow>,
    pub(super) dispatched: Vec<DispatchedRow>,
    /// The ledger's records after the store's point that state dispatched calls.
    pub(super) dispatched_records: Vec<serde_json::Value>,
    /// The key store's keys (`keys.rs`) and their counts.
    pub(super) client_keys: Vec<crate::keys::ClientKey>,
    pub(super) key_usage: Vec<crate::state::ClientKeyRow>,
    /// The runtime policy switches the store kept (`haltctl detector mode`, `profile set`).
    pub(super) overrides: crate::policy::Overrides,
    /// The operators' incident labels, and the ledger's records after the store's point that
    /// state labels.
    pub(super) incident_labels: Vec<crate::state::IncidentLabelRow>,
    pub(super) label_records: Vec<serde_json::Value>,
}

/// The fingerprint of this node's key that the store keeps: the key id of a request without
/// a credential (`identity.rs`), which changes with the key and reveals nothing of it.
fn node_check(secret: &NodeSecret) -> String {
    KeyId::of(secret, crate::credential::Credential::None).fingerprint()
}

/// Opens the store, checks it against the ledger and restores the degraded scopes. Returns,
/// with them, the reason a mismatched store was accepted under `--state-mismatch
/// degrade-node` (the node is then degraded, recorded by the caller).
///
/// `took_over`: a haltd that handed over to this one still serves and writes the store; it
/// committed everything up to its hand-over record before it answered (`admin/handover.rs`),
/// so the store is taken as it is (no check against this process's new segment, which starts
/// after that record) and is never replaced.
pub(super) fn open_state(
    cfg: &Config,
    secret: &NodeSecret,
    took_over: bool,
) -> Result<(Opened, Option<String>), StartError> {
    let t = std::time::Instant::now();
    let fault = cfg.faults.state_write_fails_after;
    let (store, held) =
        StateStore::open_with_fault(&cfg.args.state_dir, fault).map_err(StartError::State)?;
    let check = node_check(secret);
    let mut restored = if took_over {
        restore::taken_over(&held, &check).map_err(StartError::State)?
    } else {
        restore::check(&held, &cfg.args.ledger, &check).map_err(StartError::State)?
    };
    let dispatched_records = std::mem::take(&mut restored.dispatched_records);
    let label_records = std::mem::take(&mut restored.label_records);
    let (scopes, mismatch) = scopes_to_run(
        cfg,
        &store,
        restored.verdict,
        (held.scopes.clone(), restored.scopes),
    )?;
    let modes = Modes::new(cfg.args.degraded_scope, cfg.degraded_for);
    let now = (std::time::SystemTime::now(), crate::clock::monotonic_ns());
    modes
        .restore(&scopes, now.0, now.1)
        .and_then(|()| modes.restore_conversations(&held.conversations))
        .map_err(|why| StartError::StateMismatch {
            path: store.path().display().to_string(),
            why,
        })?;
    tracing::info!(
        store = %store.path().display(),
        degraded_scopes = scopes.len(),
        conversations = held.conversations.len(),
        tool_circuit_conversations = held.circuits.len(),
        dispatched_calls = held.dispatched.len(),
        client_keys = held.client_keys.len(),
        took_ms = t.elapsed().as_millis() as u64,
        "state restored"
    );
    let client_keys = client_keys(&store, &held.client_keys)?;
    let overrides = kept_overrides(
        &store,
        held.runtime_policy.as_ref(),
        &restored.policy_records,
    )?;
    let (circuits, dispatched) = (held.circuits.clone(), held.dispatched.clone());
    if !took_over {
        replace(&store, check, &held, &overrides, scopes);
    }
    let store = Arc::new(store);
    let opened = Opened {
        store,
        modes,
        circuits,
        dispatched,
        dispatched_records,
        client_keys,
        key_usage: held.key_usage,
        overrides,
        incident_labels: held.incident_labels,
        label_records,
    };
    Ok((opened, mismatch))
}

/// Writes the state this start runs with over what the store held (with the changes the
/// ledger replayed).
fn replace(
    store: &StateStore,
    check: String,
    held: &Snapshot,
    overrides: &crate::policy::Overrides,
    scopes: Vec<crate::state::ScopeRow>,
) {
    store.replace(Snapshot {
        ledger: None,
        node_check: Some(check),
        scopes,
        conversations: held.conversations.clone(),
        circuits: held.circuits.clone(),
        dispatched: held.dispatched.clone(),
        client_keys: held.client_keys.clone(),
        key_usage: held.key_usage.clone(),
        // With the switches the ledger replayed.
        runtime_policy: serde_json::to_value(overrides).ok(),
        incident_labels: held.incident_labels.clone(),
    });
}

/// The degraded scopes to start with, by the store's verdict: what the ledger says, or on a
/// mismatch (with `--state-mismatch degrade-node`) what the store held, failing closed.
fn scopes_to_run(
    cfg: &Config,
    store: &StateStore,
    verdict: Verdict,
    (held, found): (Vec<crate::state::ScopeRow>, Vec<crate::state::ScopeRow>),
) -> Result<(Vec<crate::state::ScopeRow>, Option<String>), StartError> {
    Ok(match verdict {
        Verdict::Mismatch(why) => {
            if cfg.args.state_mismatch == OnMismatch::Refuse {
                return Err(StartError::StateMismatch {
                    path: store.path().display().to_string(),
                    why,
                });
            }
            tracing::error!(store = %store.path().display(), reason = %why, "the state store does not match the ledger; --state-mismatch degrade-node: the whole node runs degraded until the operator ends it");
            // Fail closed: what the store held is kept too.
            (held, Some(format!("state store mismatch: {why}")))
        }
        Verdict::Matched { replayed } => {
            if replayed > 0 {
                tracing::warn!(replayed, "the state store was behind the ledger (a crash between a record and its store write): the ledger's mode changes after it were applied");
            }
            (found, None)
        }
        Verdict::Rebuilt { replayed } => {
            tracing::warn!(replayed, ledger = %cfg.args.ledger.display(), "no state store: the degraded scopes were rebuilt from the ledger, whose current segment is the whole chain");
            (found, None)
        }
        Verdict::New => (found, None),
    })
}

/// The runtime policy switches the store kept. Fail closed: a switch that does not read could
/// have made a detector stricter, so the start stops.
/// Then the switches recorded after the store's point (a crash between a switch's record and
/// its store write): the ledger has them, so they apply.
fn kept_overrides(
    store: &StateStore,
    kept: Option<&serde_json::Value>,
    after: &[serde_json::Value],
) -> Result<crate::policy::Overrides, StartError> {
    let mut overrides = match kept {
        None => crate::policy::Overrides::default(),
        Some(v) => serde_json::from_value(v.clone()).map_err(|e| {
            StartError::State(crate::state::StateError::Corrupt {
                path: store.path().to_owned(),
                reason: format!("its runtime_policy does not read ({e}); move the file aside knowing its state is lost"),
            })
        })?,
    };
    for rec in after {
        if let Err(why) = overrides.replay(rec) {
            tracing::warn!(seq = %rec["seq"], reason = %why, "a policy switch record does not read; skipped");
        }
    }
    Ok(overrides)
}

/// The per-scope limits, with the keys' counts the state store kept (their minute goes on
/// across a restart). A row that does not read is skipped, logged: counts are not governance.
pub(super) fn limit_table(
    cfg: &Config,
    kept: &[crate::state::ClientKeyRow],
) -> std::sync::Arc<crate::limits::LimitTable> {
    let table = crate::limits::LimitTable::new(crate::limits::Limits {
        concurrency: cfg.args.limit_concurrency,
        requests_per_minute: cfg.args.limit_requests_per_minute,
        tokens_per_minute: cfg.args.limit_tokens_per_minute,
    });
    let now = (
        crate::clock::monotonic_ns(),
        crate::clock::unix_ms(std::time::SystemTime::now()),
    );
    for row in kept {
        let id = KeyId::parse_fingerprint(&row.id);
        let usage = serde_json::from_value::<crate::limits::StoredUsage>(row.body.clone());
        match (id, usage) {
            (Some(id), Ok(u)) => {
                table.restore(crate::scope::Scope::of_api_key(id), &u, now.0, now.1);
            }
            _ => {
                tracing::warn!(key = %row.id, "a key's stored counts do not read; they start at zero")
            }
        }
    }
    table
}

/// The key store's keys the state store holds.
fn client_keys(
    store: &StateStore,
    rows: &[crate::state::ClientKeyRow],
) -> Result<Vec<crate::keys::ClientKey>, StartError> {
    rows.iter()
        .map(|row| {
            serde_json::from_value::<crate::keys::ClientKey>(row.body.clone()).map_err(|e| {
                StartError::State(StateError::Corrupt {
                    path: store.path().to_owned(),
                    reason: format!("client key {}: {e}", row.id),
                })
            })
        })
        .collect()
}

/// TokenCircuit's conversation store, counting into `/metrics`, holding what the state store
/// kept and keeping every change there from now on.
pub(super) fn conversation_store(
    cfg: &Config,
    metrics: &crate::metrics::Metrics,
    opened: &Opened,
) -> Result<ConversationStore, StartError> {
    let corrupt = |reason: String| {
        StartError::State(StateError::Corrupt {
            path: opened.store.path().to_owned(),
            reason,
        })
    };
    let policy = cfg.tool_circuit.as_deref();
    let store = ConversationStore::for_policy(policy).counting_into(metrics.circuit.store.clone());
    store
        .restore(&opened.circuits, &WallClock::now())
        .map_err(corrupt)?;
    let gauges = metrics.circuit.dispatched.clone();
    let alert_after = policy.map_or(DEFAULT_RECONCILE_ALERT_AFTER_S, |p| {
        p.reconcile_alert_after_s
    });
    gauges
        .alert_after_seconds
        .set(i64::try_from(alert_after).unwrap_or(i64::MAX));
    let persist = Some(Arc::clone(&opened.store));
    let dispatched = Dispatched::new(gauges, persist, &opened.dispatched).map_err(corrupt)?;
    // A crash between a failed turn's record (or a reconciliation's) and the store's write:
    // the ledger has it, the store catches up.
    let caught_up = dispatched.replay(&opened.dispatched_records);
    if !caught_up.is_empty() {
        tracing::warn!(
            calls = caught_up.len(),
            "the state store was behind the ledger: dispatched calls were taken from it"
        );
        opened.store.apply(None, caught_up);
    }
    Ok(store
        .with_dispatched(dispatched)
        .persisting_to(Arc::clone(&opened.store)))
}

/// The operators' incident labels the store kept, with those the ledger states after the
/// store's point (a crash between a label's record and its store write), counted into
/// `/metrics`; the store catches up.
pub(super) fn incident_labels(
    metrics: &crate::metrics::Metrics,
    opened: &Opened,
) -> crate::labels::Labels {
    let labels = crate::labels::Labels::restored(&metrics.labels, &opened.incident_labels);
    let caught_up = labels.replay(&opened.label_records);
    if !caught_up.is_empty() {
        tracing::warn!(
            labels = caught_up.len(),
            "the state store was behind the ledger: incident labels were taken from it"
        );
        let rows = caught_up.iter().map(|l| Change::IncidentLabel(l.row()));
        opened.store.apply(None, rows.collect());
    }
    labels
}

/// Records the node degraded for a mismatched store (`mismatch`: why), then writes the start
/// record and links the store to it, once every change before it is stored: from here the
/// store reflects the ledger up to this start.
pub(super) fn record_start(
    shared: &HaltCore,
    rec: Record,
    mismatch: Option<String>,
) -> Result<(), StartError> {
    if let Some(why) = mismatch {
        let ch = shared.modes.degrade_node_at_start(&why);
        shared.record_mode_change(&ch);
    }
    let (tx, rx) = mpsc::sync_channel(1);
    shared
        .ledger
        .append_linked(rec, move |written| {
            let _ = tx.send(written);
        })
        .map_err(StartError::Ledger)?;
    let written = rx
        .recv()
        .map_err(|_| StartError::Ledger(shared.ledger.writer_gone()))?
        .map_err(StartError::Ledger)?;
    shared.state.link(written.into());
    shared
        .metrics
        .modes
        .degraded_scopes
        .set(shared.modes.degraded_count() as i64);
    Ok(())
}
