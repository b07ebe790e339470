//! How `haltctl detector list|mode` and `haltctl profile set` print their answers
//! (`admin/policy.rs` serves them).

use serde_json::{json, Value};

use super::render::{rows, table};

/// `haltctl detector list`: the profile, then one row per route and detector with its mode
/// and what it did in that mode (as Tetragon's policy list shows each policy's counters).
pub fn render_list(v: &Value) -> String {
    let lock = if v["lock_policy"] == true {
        ", --lock-policy: changes that loosen are refused"
    } else {
        ""
    };
    let mut out = format!("profile {}{lock}\n", v["profile"].as_str().unwrap_or("?"));
    let mut flat = Vec::new();
    for r in v["routes"].as_array().into_iter().flatten() {
        let batch = if r["batch_only"] == true {
            " batch"
        } else {
            ""
        };
        for d in r["detectors"].as_array().into_iter().flatten() {
            flat.push(json!({
                "route": r["name"], "b": format!("{}{batch}", r["budget"]),
                "detector": d["name"], "mode": d["mode"],
                "judged": d["judged"], "findings": d["findings"], "trips": d["trips"],
            }));
        }
    }
    let cols = [
        "route", "b", "detector", "mode", "judged", "findings", "trips",
    ];
    out.push_str(&table(&cols, &rows(&flat, &cols)));
    out
}

/// `haltctl detector mode NAME MODE [--route R]`.
pub fn render_mode(v: &Value) -> String {
    let before: Vec<String> = v["before"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(route, mode)| format!("{route}: {}", mode.as_str().unwrap_or("?")))
        .collect();
    format!(
        "{} is {} on route {} for turns that start from now (before: {}); open streams keep their mode\n",
        v["detector"].as_str().unwrap_or("?"),
        v["mode"].as_str().unwrap_or("?"),
        v["route"].as_str().unwrap_or("?"),
        before.join(", "),
    )
}

/// `haltctl profile set P`.
pub fn render_profile(v: &Value) -> String {
    let routes: Vec<&str> = v["routes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    format!(
        "profile {} (was {}) for turns that start from now; routes {}\n",
        v["profile"].as_str().unwrap_or("?"),
        v["before"].as_str().unwrap_or("?"),
        routes.join(", "),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_shows_each_route_and_detector() {
        let v = json!({"profile": "mkp", "lock_policy": true, "routes": [
            {"name": "strict", "budget": 0, "batch_only": true, "detectors": [
                {"name": "surprise", "mode": "hard", "judged": 4, "findings": 2, "trips": 1}]},
            {"name": "default", "budget": 5, "batch_only": false, "detectors": [
                {"name": "surprise", "mode": "observe", "judged": 9, "findings": 3, "trips": 0}]}]});
        let text = render_list(&v);
        assert!(text.starts_with("profile mkp, --lock-policy"), "{text}");
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[1].starts_with("ROUTE"), "{text}");
        for (line, want) in [
            (2, ["strict", "0 batch", "surprise", "hard", "4", "2", "1"]),
            (3, ["default", "5", "surprise", "observe", "9", "3", "0"]),
        ] {
            for w in want {
                assert!(lines[line].contains(w), "{w} not in {}", lines[line]);
            }
        }
        let m = render_mode(
            &json!({"detector": "surprise", "mode": "hard", "route": "*",
            "before": {"strict": "observe", "default": "observe"}}),
        );
        assert!(m.starts_with("surprise is hard on route * for turns that start from now (before: default: observe, strict: observe)"), "{m}");
    }
}
