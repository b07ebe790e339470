//! Escalation to a human (spec 000 §4.2 step 4, "escalate to a human if configured"): each
//! scope that enters degraded mode (a halt degraded it, or a start degraded the node) is
//! posted as JSON to `--escalation-url`, over verified TLS, with `--escalation-token-file`'s
//! bearer token.
//!
//! One thread (`haltd-escalate`) delivers them in order from a bounded queue that
//! [`HaltCore::escalate`](crate::halt::HaltCore) fills without waiting; with the queue full an
//! incident is dropped, counted and logged, so a slow endpoint never holds a halt up. Each
//! incident gets up to `--escalation-attempts` attempts within `--escalation-deadline-ms`,
//! waiting 250 ms after the first failure, doubled after each, at most 8 s; any 2xx answer
//! delivers it. Its outcome, every attempt with it, is a `lifecycle` ledger record with an
//! `escalation` object (docs/fhr-schema.md) and counts in `haltd_escalations_total{outcome}`.
//! Nothing here is on the data plane.

use std::{
    sync::{
        mpsc::{sync_channel, Receiver, SyncSender},
        Arc, Weak,
    },
    thread,
    time::{Duration, Instant},
};

use serde_json::{json, Value};

use crate::{
    config::escalation::Escalation,
    halt::HaltCore,
    ledger::{Record, RecordKind},
    modes::metrics::EscalationOutcome,
    upstream::UpstreamApiKey,
    upstream_watch::probe::{self, Target},
};

/// Incidents that may wait for the thread.
pub const QUEUE: usize = 64;
/// The wait after a first failed attempt; doubled after each.
const FIRST_WAIT: Duration = Duration::from_millis(250);
/// The longest wait between two attempts.
const MAX_WAIT: Duration = Duration::from_secs(8);
/// The longest one attempt may take (connect, request, answer).
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

/// The queue's two ends: the sender goes into [`HaltCore`], the receiver to [`spawn`].
pub fn queue() -> (SyncSender<Value>, Receiver<Value>) {
    sync_channel(QUEUE)
}

/// Starts the thread of `core`'s `--escalation-url` on the queue's receiving end (nothing
/// without either).
pub fn start(core: &Arc<HaltCore>, rx: Option<Receiver<Value>>) -> std::io::Result<()> {
    if let (Some(target), Some(rx)) = (&core.cfg.escalation, rx) {
        spawn(Arc::clone(target), rx, Arc::downgrade(core))?;
    }
    Ok(())
}

/// Starts the thread that delivers what `rx` receives to `target`, recording each outcome in
/// `core`'s ledger. It ends when the sender is dropped, or `core` is gone.
pub fn spawn(
    target: Arc<Escalation>,
    rx: Receiver<Value>,
    core: Weak<HaltCore>,
) -> std::io::Result<thread::JoinHandle<()>> {
    thread::Builder::new()
        .name("haltd-escalate".to_owned())
        .spawn(move || {
            let node = node_name();
            while let Ok(mut incident) = rx.recv() {
                incident["node"] = Value::from(node.as_str());
                let delivery = deliver(&target, &incident);
                let Some(core) = core.upgrade() else {
                    return;
                };
                record(&core, &target, incident, &delivery);
            }
        })
}

/// This node's name as the kernel has it, for the receiver to tell nodes apart.
fn node_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// What the attempts of one escalation came to.
#[derive(Debug)]
pub struct Delivery {
    /// One object per attempt: `at_ms` (since the first began), and `status` or `error`.
    pub attempts: Vec<Value>,
    pub delivered: bool,
}

/// Tries to deliver `incident` as [`Escalation`] says.
pub fn deliver(t: &Escalation, incident: &Value) -> Delivery {
    let body = serde_json::to_vec(incident).unwrap_or_default();
    let start = Instant::now();
    let deadline = start + t.deadline;
    let mut attempts = Vec::new();
    let mut wait = FIRST_WAIT;
    for n in 1..=t.attempts {
        let left = deadline.saturating_duration_since(Instant::now());
        let result = attempt(t, &body, left.min(ATTEMPT_TIMEOUT));
        let at_ms = u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
        match result {
            Ok(status) => {
                attempts.push(json!({"at_ms": at_ms, "status": status}));
                return Delivery {
                    attempts,
                    delivered: true,
                };
            }
            Err((status, error)) => {
                attempts.push(json!({"at_ms": at_ms, "status": status, "error": error}));
            }
        }
        if n == t.attempts || Instant::now() + wait >= deadline {
            break;
        }
        thread::sleep(wait);
        wait = (wait * 2).min(MAX_WAIT);
    }
    Delivery {
        attempts,
        delivered: false,
    }
}

/// One `POST`: the 2xx status, or the status (if any) and why not.
fn attempt(t: &Escalation, body: &[u8], timeout: Duration) -> Result<u16, (Option<u16>, String)> {
    let addr = t
        .url
        .resolve()
        .map_err(|e| (None, e.to_string()))?
        .into_iter()
        .next()
        .ok_or_else(|| (None, format!("{} resolved to no address", t.url.host)))?;
    let target = Target {
        url: &t.url,
        tls: Some(&t.tls),
        path: &t.path,
        authorization: t.authorization.as_ref().map(UpstreamApiKey::header_value),
        timeout: timeout.max(Duration::from_millis(1)),
    };
    probe::post_json(&target, addr, body).map_err(|e| {
        let status = match &e {
            probe::ProbeError::Status { status, .. } => Some(*status),
            _ => None,
        };
        (status, e.to_string())
    })
}

/// The endpoint as records and logs show it (the token is never in it).
fn shown(t: &Escalation) -> String {
    format!("https://{}{}", t.url.authority(), t.path)
}

/// The outcome's ledger record, metric and log line.
fn record(core: &HaltCore, t: &Escalation, incident: Value, d: &Delivery) {
    let outcome = if d.delivered {
        EscalationOutcome::Delivered
    } else {
        EscalationOutcome::Failed
    };
    core.metrics.modes.escalated(outcome);
    let url = shown(t);
    let scope = incident["scope"].as_str().unwrap_or_default().to_owned();
    let tries = d.attempts.len();
    let message = if d.delivered {
        tracing::info!(%scope, %url, attempts = tries, "escalation delivered");
        format!("escalation of {scope} delivered to {url} (attempt {tries})")
    } else {
        let last = d.attempts.last().map(|a| a["error"].to_string());
        tracing::error!(%scope, %url, attempts = tries, last_error = last.as_deref(), "escalation failed");
        format!("escalation of {scope} to {url} failed after {tries} attempt(s)")
    };
    let rec = Record {
        kind: RecordKind::Lifecycle,
        kernel_gate: core.kernel_gate_label().to_owned(),
        stream_id: incident["stream_id"].as_str().map(str::to_owned),
        message: Some(message),
        escalation: Some(json!({
            "url": url,
            "outcome": outcome.as_str(),
            "attempts": d.attempts,
            "incident": incident,
        })),
        ..Record::default()
    };
    if let Err(e) = core.ledger.append(rec) {
        core.record_failed(&e);
    }
}
