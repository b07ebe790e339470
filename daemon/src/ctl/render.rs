//! The human tables haltctl prints for the admin API's answers. Every command also takes
//! `--json`, which prints the answer as haltd sent it (docs/wire-format.md "Admin API").

use serde_json::Value;

/// A value as a table cell: `-` for null, strings bare, anything nested as compact JSON.
fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".to_owned(),
        Value::String(s) => s.clone(),
        Value::Number(_) | Value::Bool(_) => v.to_string(),
        other => other.to_string(),
    }
}

/// Rows under a header, each column as wide as its widest cell, two spaces apart.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = headers.iter().map(|h| h.to_uppercase()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (i, (c, w)) in row.iter().zip(&widths).enumerate() {
            if i + 1 == row.len() {
                line.push_str(c);
            } else {
                line.push_str(&format!("{c:<w$}  "));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// The rows of the objects in `list`, one column per key in `columns`.
pub fn rows(list: &[Value], columns: &[&str]) -> Vec<Vec<String>> {
    list.iter()
        .map(|o| columns.iter().map(|c| cell(&o[*c])).collect())
        .collect()
}

/// An object as a two-column table of its fields: `first` in that order, then the rest.
pub fn object(v: &Value, first: &[&str]) -> String {
    let Some(map) = v.as_object() else {
        return format!("{}\n", cell(v));
    };
    let mut keys: Vec<&str> = first
        .iter()
        .copied()
        .filter(|k| map.contains_key(*k))
        .collect();
    keys.extend(
        map.keys()
            .map(String::as_str)
            .filter(|k| !first.contains(k)),
    );
    let rows: Vec<Vec<String>> = keys
        .into_iter()
        .map(|k| vec![k.to_owned(), cell(&map[k])])
        .collect();
    table(&["field", "value"], &rows)
}

/// `haltctl status`: which daemon answered first (pid, addresses, version, commit).
pub fn status(v: &Value) -> String {
    object(
        v,
        &[
            "pid",
            "listen",
            "admin",
            "version",
            "commit",
            "ledger",
            "kernel_gate",
        ],
    )
}

/// `haltctl streams`.
pub fn streams(v: &Value) -> String {
    let list = v["streams"].as_array().map_or(&[][..], Vec::as_slice);
    if list.is_empty() {
        return "no open streams\n".to_owned();
    }
    let columns = [
        "stream_id",
        "state",
        "mode",
        "endpoint",
        "tokens",
        "tokens_delivered",
        "trip_cause",
        "age_ms",
    ];
    table(&columns, &rows(list, &columns))
}

/// The columns of a degraded scope, in `haltctl mode` and `haltctl state show`.
const SCOPE_COLUMNS: [&str; 5] = [
    "scope",
    "cause",
    "stream_id",
    "since_unix_ms",
    "until_unix_ms",
];

/// `haltctl mode`: the policy, then the degraded scopes.
pub fn mode(v: &Value) -> String {
    let hold = match v["degraded_for_s"].as_f64() {
        Some(s) => format!("{s} s"),
        None => "until the operator ends it".to_owned(),
    };
    let mut out = format!(
        "a halt degrades: {}; for: {hold}\n",
        cell(&v["scope_on_halt"])
    );
    let mut scopes: Vec<Value> = Vec::new();
    if let Some(node) = v.get("node").filter(|n| !n.is_null()) {
        let mut n = node.clone();
        n["scope"] = "node".into();
        scopes.push(n);
    }
    for k in v["keys"].as_array().into_iter().flatten() {
        let mut k = k.clone();
        if k["scope"].is_null() {
            k["scope"] = format!("key:{}", cell(&k["key"])).into();
        }
        scopes.push(k);
    }
    if scopes.is_empty() {
        out.push_str("no scope is degraded\n");
        return out;
    }
    out.push_str(&table(&SCOPE_COLUMNS, &rows(&scopes, &SCOPE_COLUMNS)));
    out
}

/// `haltctl mode full`: what changed, then the mode now.
pub fn mode_changed(v: &Value) -> String {
    let changed = v["changed"].as_array().map_or(&[][..], Vec::as_slice);
    let mut out = if changed.is_empty() {
        "nothing was degraded in that scope: nothing changed\n".to_owned()
    } else {
        let columns = ["scope", "from", "to", "by"];
        table(&columns, &rows(changed, &columns))
    };
    out.push_str(&mode(&v["mode"]));
    out
}

/// `haltctl state show`.
pub fn state(v: &Value) -> String {
    let held = &v["held"];
    let point = match held.get("ledger").filter(|p| !p.is_null()) {
        Some(p) => format!("ledger seq {} (hash {})", cell(&p["seq"]), cell(&p["hash"])),
        None => "no ledger record yet".to_owned(),
    };
    let count = |field: &str| held[field].as_array().map_or(0, Vec::len);
    let mut out = format!(
        "store: {} (schema {}), reflects {point}; committed state of {} conversations (haltctl conversations); TokenCircuit's memory of {} conversations (haltctl circuit show); {} dispatched calls of failed turns (haltctl reconcile)\n",
        cell(&v["path"]),
        cell(&v["schema_version"]),
        count("conversations"),
        count("circuits"),
        count("dispatched"),
    );
    let scopes = held["scopes"].as_array().map_or(&[][..], Vec::as_slice);
    if scopes.is_empty() {
        out.push_str("no degraded scope is held\n");
        return out;
    }
    out.push_str(&table(&SCOPE_COLUMNS, &rows(scopes, &SCOPE_COLUMNS)));
    out
}

/// `haltctl conversations`.
pub fn conversations(v: &Value) -> String {
    let list = v["conversations"].as_array().map_or(&[][..], Vec::as_slice);
    if list.is_empty() {
        return "no conversation has committed state\n".to_owned();
    }
    let columns = [
        "key",
        "turns_committed",
        "tokens_committed",
        "tool_calls_committed",
        "turns_failed",
        "last_committed_turn",
    ];
    table(&columns, &rows(list, &columns))
}

/// `haltctl limits`: the limits, then each scope's use of its current minute.
pub fn limits(v: &Value) -> String {
    let l = &v["limits"];
    let shown = |k: &str| match l[k].as_u64() {
        Some(0) | None => "none".to_owned(),
        Some(n) => n.to_string(),
    };
    let mut out = format!(
        "limits per scope, on this node: concurrency {}, requests per minute {}, tokens per minute {}\n",
        shown("concurrency"),
        shown("requests_per_minute"),
        shown("tokens_per_minute")
    );
    let list = v["scopes"].as_array().map_or(&[][..], Vec::as_slice);
    if list.is_empty() {
        out.push_str("no scope used anything in the last minute\n");
        return out;
    }
    let columns = ["scope", "in_flight", "requests", "tokens"];
    out.push_str(&table(&columns, &rows(list, &columns)));
    out
}

/// `haltctl trip`: the tripped stream.
/// `haltctl trip`: the trip, then what it did to degraded mode (`degrade`), and the scope's
/// degraded state after it, flattened into its name and end.
pub fn trip(v: &Value) -> String {
    let mut v = v.clone();
    if let Some(d) = v.get("degraded_scope").filter(|d| d.is_object()).cloned() {
        v["degraded_scope"] = d["scope"].clone();
        v["degraded_until_unix_ms"] = match &d["until_unix_ms"] {
            Value::Null => "until the operator ends it".into(),
            until => until.clone(),
        };
    }
    object(
        &v,
        &[
            "stream_id",
            "cause",
            "degrade",
            "degraded_scope",
            "degraded_until_unix_ms",
        ],
    )
}

/// `haltctl incident label`: the incident labelled, the label, and the one it replaced.
pub fn labelled(v: &Value) -> String {
    object(
        v,
        &[
            "stream_id",
            "incident_seq",
            "detector",
            "route",
            "label",
            "previous",
            "note",
        ],
    )
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_trip_says_which_scope_it_degraded_and_until_when() {
        let t = trip(
            &json!({"stream_id": "hs_1", "cause": "OPERATOR_TRIP", "budget": 5,
            "degrade": "degraded", "degraded_scope": {"scope": "addr:00112233aabbccdd",
            "since_unix_ms": 1, "until_unix_ms": 3_600_001, "cause": "OPERATOR_TRIP",
            "stream_id": "hs_1"}}),
        );
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[3].starts_with("degrade ") && lines[3].ends_with(" degraded"),
            "{t}"
        );
        assert!(lines[4].ends_with(" addr:00112233aabbccdd"), "{t}");
        assert!(lines[5].ends_with(" 3600001"), "{t}");
        let t = trip(&json!({"stream_id": "hs_1", "cause": "OPERATOR_TRIP",
            "degrade": "declined", "degraded_scope": null}));
        assert!(t.contains("declined") && !t.contains("until"), "{t}");
        let t = trip(&json!({"stream_id": "hs_1", "degrade": "degraded",
            "degraded_scope": {"scope": "node", "until_unix_ms": null}}));
        assert!(t.contains("until the operator ends it"), "{t}");
    }

    #[test]
    fn tables_align_and_name_the_daemon_first() {
        let s = status(
            &json!({"kernel_gate": "enforcing", "pid": 42, "listen": "0.0.0.0:8080",
                               "version": "0.1.0", "commit": "abc", "budget": 5}),
        );
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(
            lines[0].split_whitespace().collect::<Vec<_>>(),
            ["FIELD", "VALUE"]
        );
        assert!(
            lines[1].starts_with("pid ") && lines[1].ends_with(" 42"),
            "{s}"
        );
        assert!(lines[2].contains("0.0.0.0:8080"), "{s}");
        let t = streams(&json!({"streams": [
            {"stream_id": "hs_1", "state": "open", "mode": "stream", "endpoint": "chat",
             "tokens": 3, "tokens_delivered": 3, "trip_cause": null, "age_ms": 12}]}));
        assert!(t.starts_with("STREAM_ID"), "{t}");
        assert!(
            t.lines().nth(1).is_some_and(|l| l.starts_with("hs_1  ")),
            "{t}"
        );
        assert_eq!(streams(&json!({"streams": []})), "no open streams\n");
        let m = mode(
            &json!({"scope_on_halt": "key", "degraded_for_s": null, "node": null,
                             "keys": [{"key": "49d4b86b01011bd0", "cause": "OPERATOR_TRIP",
                                       "since_unix_ms": 1, "stream_id": "hs_2",
                                       "until_unix_ms": null}]}),
        );
        assert!(
            m.contains("key:49d4b86b01011bd0") && m.contains("OPERATOR_TRIP"),
            "{m}"
        );
        let st = state(
            &json!({"path": "/s/state.db", "schema_version": 3, "held": {
            "ledger": {"seq": 4, "hash": "ab"}, "scopes": [], "conversations": [{}],
            "circuits": [{}, {}], "dispatched": [{}, {}, {}]}}),
        );
        assert!(
            st.contains("reflects ledger seq 4")
                && st.contains("committed state of 1 conversations")
                && st.contains("TokenCircuit's memory of 2 conversations")
                && st.contains("3 dispatched calls of failed turns")
                && st.ends_with("no degraded scope is held\n"),
            "{st}"
        );
    }
}
