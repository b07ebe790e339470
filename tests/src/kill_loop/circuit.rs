//! TokenCircuit's part of the kill loop (issue 32): with `Options::upstream_bin`, haltd proxies
//! the scripted upstream with `[tool_circuit]` enabled, and one more client makes, again and
//! again, the two things a restart must not forget:
//!
//! - a **dispatched call**: a turn whose upstream dies after its first tool call reached the
//!   client (`tool_call calls=2 die=1`), so the call waits for reconciliation;
//! - a **used-up budget**: a conversation whose permission/auth failure haltd answers itself
//!   (409);
//! - a **premature retry**: a conversation whose 503 the model retried at once, before its
//!   minute of backoff (two units of three charged).
//!
//! Each conversation is *settled* once `GET /admin/state` answered after it (the store's
//! thread wrote everything queued before it).
//!
//! After each restart: the calls haltd lists for reconciliation are exactly the failed turns'
//! dispatched calls in the ledger the killed instance wrote (the store, caught up from the
//! ledger), every used-up budget settled in the round before is still refused when its
//! transcript no longer shows the failure, and every premature retry settled then is still
//! charged two units: the next early retry is halted.

use std::{
    collections::BTreeSet,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    thread,
    time::Duration,
};

use anyhow::{ensure, Result};
use serde_json::{json, Value};

use super::Report;
use crate::{
    daemon::Haltd,
    netns::{in_netns, spawn_in_netns},
    sse,
};

/// haltd's config file in the loop's directory.
pub(super) const CONFIG: &str = "[tool_circuit]\nenabled = true\nbudgets = { transient = 3 }\n\
     backoff = { base_ms = 60000, cap_ms = 60000 }\n";

/// A conversation settled before a kill, to check after the restart.
#[derive(Debug, Clone)]
pub(super) enum Settled {
    /// Its permission/auth budget is used up.
    Denied(String),
    /// Its model retried a 503 at once; the body of the next request (the retry failed too,
    /// and the model retries again).
    Premature(String, Value),
}

const RETRY: &str = "[[script:tool_call tokens=2]]";
const FAILED: &str = "HTTP 503 Service Unavailable";

/// The messages of a `get_weather` call `id` that came back `result`.
fn exchange(id: &str, result: &str) -> [Value; 2] {
    [
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": id,
               "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}),
        json!({"role": "tool", "tool_call_id": id, "content": result}),
    ]
}

fn with_history(history: &[Value]) -> Value {
    let mut messages = vec![json!({"role": "user", "content": "weather?"})];
    messages.extend_from_slice(history);
    json!({"model": "scripted", "stream": true, "tools": tools(), "messages": messages})
}

/// Starts a premature retry in conversation `id`; the next request's body once settled.
fn premature(url: &str, id: &str) -> Option<Value> {
    let first = exchange("call_prev", &format!("{FAILED} {RETRY}"));
    let o = stream(url, &with_history(&first), id).ok()?;
    if o.error.is_some() {
        return None;
    }
    let retry = o.first_tool_call_id()?;
    let mut history = first.to_vec();
    history.extend(exchange(&retry, &format!("{FAILED} {RETRY}")));
    Some(with_history(&history))
}

const CHAT: &str = "/v1/chat/completions";

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather",
             "parameters": {"type": "object"}}}])
}

/// A conversation of one user message, `directive` scripting the model.
fn opening(directive: &str) -> Value {
    json!({"model": "scripted", "stream": true, "tools": tools(),
           "messages": [{"role": "user", "content": directive}]})
}

/// A conversation whose `get_weather` call came back 403.
fn denied() -> Value {
    with_history(&exchange(
        "call_prev",
        &format!("HTTP 403 Forbidden: permission denied {RETRY}"),
    ))
}

/// The request headers of conversation `id` (its own key: a trip of another stream never
/// degrades it).
fn headers(id: &str) -> [(&'static str, String); 2] {
    [
        ("authorization", format!("Bearer {id}")),
        ("x-haltd-conversation-id", id.to_owned()),
    ]
}

fn stream(url: &str, body: &Value, id: &str) -> Result<sse::StreamOutcome> {
    let h = headers(id);
    let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
    sse::stream_with(url, body, &h, Duration::from_secs(10), |_, _| {})
}

/// The round's TokenCircuit client; the conversations it settled go into `settled`.
pub(super) fn client(
    haltd: &Haltd,
    round: usize,
    settled: &Arc<Mutex<Vec<Settled>>>,
    stop: &Arc<AtomicBool>,
) -> thread::JoinHandle<()> {
    let url = format!("{}{CHAT}", haltd.api_url());
    let state = format!("{}/admin/state", haltd.admin_url());
    let (settled, stop) = (Arc::clone(settled), Arc::clone(stop));
    spawn_in_netns(&haltd.client_ns, move || {
        let mut n = 0;
        while !stop.load(Ordering::Acquire) {
            n += 1;
            let dying = opening("[[script:tool_call calls=2 die=1]]");
            let _ = stream(&url, &dying, &format!("kl-{round}-{n}-dispatched"));
            let id = format!("kl-{round}-{n}-denied");
            let answered = stream(&url, &denied(), &id).is_ok_and(|o| o.status == 409);
            let denied = answered.then_some(Settled::Denied(id));
            let id = format!("kl-{round}-{n}-premature");
            let early = premature(&url, &id).map(|next| Settled::Premature(id, next));
            if crate::http::get_json_here(&state).is_ok() {
                if let Ok(mut s) = settled.lock() {
                    s.extend(denied.into_iter().chain(early));
                }
            }
            thread::sleep(Duration::from_millis(5));
        }
    })
}

/// After a restart: the dispatched calls haltd holds are those of `records` (what the killed
/// instance wrote), and each `settled` conversation is still refused with a trimmed
/// transcript.
pub(super) fn check(
    haltd: &Haltd,
    records: &[Value],
    settled: &[Settled],
    report: &mut Report,
) -> Result<()> {
    let want: BTreeSet<String> = records
        .iter()
        .filter(|r| r["kind"] == "turn")
        .flat_map(|r| r["tool_calls"].as_array().into_iter().flatten())
        .filter(|c| c["reconciliation"] == "required")
        .filter_map(|c| c["ref"].as_str().map(str::to_owned))
        .collect();
    let url = format!("{}/admin/reconcile?all=true", haltd.admin_url());
    let listed = in_netns(&haltd.client_ns, move || crate::http::get_json_here(&url))?;
    let have: BTreeSet<String> = listed["calls"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["ref"].as_str().map(str::to_owned))
        .collect();
    report.circuit_checks += 1;
    report.dispatched_checked += want.len();
    ensure!(
        have == want,
        "after the restart haltd lists the dispatched calls {have:?}, the ledger says {want:?}"
    );
    let url = format!("{}{CHAT}", haltd.api_url());
    for s in settled {
        let (url, s) = (url.clone(), s.clone());
        let (o, s) = in_netns(&haltd.client_ns, move || {
            let o = match &s {
                Settled::Denied(id) => stream(&url, &opening(RETRY), id),
                Settled::Premature(id, next) => stream(&url, next, id),
            };
            o.map(|o| (o, s))
        })?;
        match s {
            Settled::Denied(_) => {
                report.budgets_checked += 1;
                ensure!(
                    o.status == 409,
                    "a used-up budget settled before the kill is not refused after the restart: {o:?}"
                );
            }
            Settled::Premature(..) => {
                report.premature_checked += 1;
                let charged = o.error.as_ref().is_some_and(|e| {
                    e["code"] == "TOOL_CIRCUIT_OPEN" && e["tool_circuit"]["retry_count"] == 2
                });
                ensure!(
                    charged,
                    "a premature retry settled before the kill is not charged two units after the restart: {o:?}"
                );
            }
        }
    }
    Ok(())
}
