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
}
