//! `/readyz`: whether this haltd should get new turns, and which check says no. Unlike
//! `/healthz` (liveness: the watchdog and the recorder), readiness also fails while the
//! upstream is down or unresolved (`upstream_watch.rs`) and while haltd drains, so that a load
//! balancer sends turns elsewhere instead of to 502s.
//!
//! Checks, each with its `reasons[]` entry when it fails:
//!
//! | check | fails when | reason |
//! |---|---|---|
//! | `heartbeat` | the watchdog's heartbeat is lost | `heartbeat_lost` |
//! | `gate` | the kernel gate's maps cannot be read (`--no-kernel-gate`: `disabled`, not a failure) | `gate_unreadable` |
//! | `ledger` | the flight recorder failed (a write, an fsync, a refused rotation) | `recorder_failed` |
//! | `upstream` | its name does not resolve, or its probe failed `--upstream-probe-failures` times in a row | `upstream_unresolved`, `upstream_down` |
//! | `draining` | SIGTERM: haltd drains | `draining` |
//!
//! A health check, not a token: the JSON built here allocates.

use std::sync::atomic::Ordering::SeqCst;

use serde_json::json;

use crate::{clock::monotonic_ns, halt::HaltCore, pulse::HeartbeatState};

/// Runs the checks: whether haltd is ready, and the JSON body that says why.
pub(in crate::dataplane) fn check(shared: &HaltCore) -> (bool, String) {
    let hb = shared.heartbeat_view(monotonic_ns());
    let mut reasons = Vec::new();
    let heartbeat_ok = hb.state != HeartbeatState::Lost;
    if !heartbeat_ok {
        reasons.push("heartbeat_lost");
    }
    let gate_ok = shared.gate.is_none() || hb.error.is_none();
    if !gate_ok {
        reasons.push("gate_unreadable");
    }
    let ledger_error = shared.ledger.failure().or_else(|| {
        shared
            .recorder_failed
            .load(SeqCst)
            .then(|| "the flight recorder failed".to_owned())
    });
    if ledger_error.is_some() {
        reasons.push("recorder_failed");
    }
    let upstream = match &shared.upstream_health {
        Some(h) => {
            let r = h.readiness();
            if r.addresses.is_empty() {
                reasons.push("upstream_unresolved");
            } else if !r.ok {
                reasons.push("upstream_down");
            }
            json!(r)
        }
        None => json!({"ok": true, "source": "builtin"}),
    };
    let draining = shared.draining.load(SeqCst) || shared.shutting_down.load(SeqCst);
    if draining {
        reasons.push("draining");
    }
    let ready = reasons.is_empty();
    let body = json!({
        "status": if ready { "ready" } else { "not_ready" },
        "reasons": reasons,
        "kernel_gate": shared.kernel_gate_label(),
        "heartbeat_state": hb.state,
        "checks": {
            "heartbeat": {"ok": heartbeat_ok, "state": hb.state, "age_ms": hb.age_ms_json(), "clock": hb.clock},
            "gate": {"ok": gate_ok, "state": shared.kernel_gate_label(), "error": hb.error},
            "ledger": {"ok": ledger_error.is_none(), "path": shared.ledger.path().display().to_string(), "error": ledger_error},
            "upstream": upstream,
            "draining": {"ok": !draining},
        },
    });
    (ready, body.to_string())
}
