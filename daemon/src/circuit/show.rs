//! `haltctl circuit show`: the admin API's view of TokenCircuit's conversations
//! (`GET /admin/circuit`, `circuit::store::ConversationView`) as text for a person.
//!
//! It reads the JSON the API answers, not the daemon's types, so that a haltctl prints what
//! any haltd of the same major version sends; a field it does not know is ignored and a
//! missing one prints as `-`.

use std::fmt::Write;

use serde_json::Value;

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".to_owned(),
        other => other.to_string(),
    }
}

/// One key line: tool, resource, auth, class, budget left and the next allowed action.
fn key_line(out: &mut String, a: &Value) {
    let k = &a["equivalence_key"];
    let budget = a["budget"].as_u64().unwrap_or(0);
    let used = a["retry_count"].as_u64().unwrap_or(0);
    let _ = writeln!(
        out,
        "    {} resource={} auth={} class={} side_effect_boundary={}",
        text(&k["tool_name"]),
        text(&k["resource_class"]),
        text(&k["auth_scope"]),
        text(&a["failure_class"]),
        text(&k["side_effect_boundary"]),
    );
    let _ = writeln!(
        out,
        "      budget {budget}, used {used}, left {}{}; next: {}",
        budget.saturating_sub(used),
        if a["budget_exhausted"] == true {
            " (exhausted)"
        } else {
            ""
        },
        text(&a["next_action"]),
    );
    if let Some(receipts) = a["sample_receipts"].as_array() {
        for r in receipts {
            let _ = writeln!(out, "      receipt: {}", text(r));
        }
    }
    let _ = writeln!(out, "      why: {}", text(&a["safety_justification"]));
}

/// The whole answer of `GET /admin/circuit[/{id}]` as text.
pub fn render(view: &Value) -> String {
    let mut out = String::new();
    if view["enabled"] == false {
        out.push_str("TokenCircuit is off ([tool_circuit] enabled = false)\n");
    }
    let empty = Vec::new();
    let convs = view["conversations"].as_array().unwrap_or(&empty);
    let _ = writeln!(
        out,
        "{} conversation(s) shown; {} kept, {} evicted",
        convs.len(),
        text(&view["kept"]),
        text(&view["evicted"]),
    );
    for c in convs {
        let _ = writeln!(
            out,
            "\nconversation {} ({}), key {}, idle {:.1} s, {} call(s) timed, {} token(s) saved",
            text(&c["id"]),
            text(&c["source"]),
            text(&c["key"]),
            c["idle_s"].as_f64().unwrap_or(0.0),
            text(&c["calls_timed"]),
            text(&c["tokens_saved"]),
        );
        for (title, field) in [("open keys", "open"), ("interventions", "artifacts")] {
            let list = c[field].as_array().unwrap_or(&empty);
            let _ = writeln!(out, "  {title}: {}", list.len());
            for a in list {
                key_line(&mut out, a);
            }
        }
    }
    if let Some(calls) = view["unreconciled"].as_array() {
        let _ = writeln!(out, "\n{} unreconciled dispatched call(s)", calls.len());
        for c in calls {
            call_line(&mut out, c);
        }
    }
    out
}

/// One dispatched call: reference, conversation, tool, arguments digest, delivery, outcome.
fn call_line(out: &mut String, c: &Value) {
    let delivered = c["delivered_unix_ms"].as_u64().map_or_else(
        || "-".to_owned(),
        |ms| crate::clock::rfc3339(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms)),
    );
    let _ = writeln!(
        out,
        "  {} conversation {} key {} tool {} args sha256:{} call {} delivered {} (stream {}): {}",
        text(&c["ref"]),
        text(&c["conversation"]["id"]),
        text(&c["key"]),
        text(&c["tool"]),
        text(&c["arguments_sha256"]),
        text(&c["call_id"]),
        delivered,
        text(&c["stream_id"]),
        match c["outcome"].as_str() {
            None => "unreconciled".to_owned(),
            Some(o) => format!("{o} (by {})", text(&c["reconciled_by"])),
        },
    );
}

/// `GET /admin/reconcile` as text: the dispatched calls waiting for an outcome.
pub fn render_calls(view: &Value) -> String {
    let mut out = String::new();
    let empty = Vec::new();
    let calls = view["calls"].as_array().unwrap_or(&empty);
    let _ = writeln!(out, "{} dispatched call(s)", calls.len());
    for c in calls {
        call_line(&mut out, c);
    }
    if !calls.is_empty() {
        out.push_str("record one: haltctl reconcile REF --outcome done|not_done|compensated\n");
    }
    out
}

/// `POST /admin/reconcile`'s answer as text.
pub fn render_reconciled(view: &Value) -> String {
    let mut out = String::from("reconciled:\n");
    call_line(&mut out, &view["call"]);
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn keys_budgets_and_artifacts_are_printed() {
        let a = json!({
            "equivalence_key": {"tool_name": "run_sql", "resource_class": "sql_namespace:hr",
                                "auth_scope": null, "error_class": "transient",
                                "side_effect_boundary": false},
            "failure_class": "transient", "next_action": "retry_with_backoff",
            "budget": 2, "budget_exhausted": false, "retry_count": 1,
            "sample_receipts": ["HTTP 503"], "safety_justification": "backing off",
        });
        let view = json!({"enabled": true, "kept": 1, "evicted": 0, "conversations": [
            {"key": "00000000000000aa", "id": "c-1", "source": "header", "idle_s": 2.0,
             "calls_timed": 3, "tokens_saved": 40, "open": [a], "artifacts": []}]});
        let s = render(&view);
        assert!(
            s.contains("1 conversation(s) shown; 1 kept, 0 evicted"),
            "{s}"
        );
        assert!(
            s.contains("conversation c-1 (header), key 00000000000000aa")
                && s.contains("3 call(s) timed, 40 token(s) saved"),
            "{s}"
        );
        assert!(
            s.contains("run_sql resource=sql_namespace:hr auth=- class=transient"),
            "{s}"
        );
        assert!(
            s.contains("budget 2, used 1, left 1; next: retry_with_backoff"),
            "{s}"
        );
        assert!(s.contains("receipt: HTTP 503"), "{s}");
        assert!(s.contains("interventions: 0"), "{s}");
        assert!(render(&json!({"enabled": false})).starts_with("TokenCircuit is off"));
    }

    #[test]
    fn dispatched_calls_are_printed() {
        let c = json!({"ref": "0123456789ab", "key": "00000000000000aa",
            "conversation": {"key": "00000000000000aa", "id": "c-1", "source": "header"},
            "call_id": "call_1", "tool": "send_email", "arguments_sha256": "ff00",
            "delivered_unix_ms": 0, "stream_id": "hs_9", "outcome": null});
        let s = render_calls(&json!({"calls": [c.clone()]}));
        assert!(s.starts_with("1 dispatched call(s)"), "{s}");
        assert!(
            s.contains("0123456789ab conversation c-1 key 00000000000000aa tool send_email")
                && s.contains("args sha256:ff00 call call_1 delivered 1970-01-01T00:00:00")
                && s.contains("(stream hs_9): unreconciled"),
            "{s}"
        );
        let mut done = c;
        done["outcome"] = json!("not_done");
        done["reconciled_by"] = json!("uid:0");
        let s = render_reconciled(&json!({"call": done}));
        assert!(s.contains(": not_done (by uid:0)"), "{s}");
        let s = render(&json!({"enabled": true, "conversations": [], "unreconciled": []}));
        assert!(s.contains("0 unreconciled dispatched call(s)"), "{s}");
    }
}
