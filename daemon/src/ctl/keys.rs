//! The admin requests of `haltctl key add|revoke|rotate|list`, and how their answers print
//! (`admin/keys.rs` serves them).

use hyper::Method;
use serde_json::{json, Value};

use super::{
    circuit::AdminRequest,
    render::{rows, table},
};

/// A key id as the path takes it: 16 hex digits, else the refusal.
fn id_path(id: &str, action: &str) -> Result<AdminRequest, String> {
    if id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok((Method::POST, format!("/admin/keys/{id}/{action}"), None))
    } else {
        Err(format!(
            "{id:?} is no key id (16 hex digits, as `haltctl key list` shows)"
        ))
    }
}

/// `haltctl key add NAME [--concurrency N] [--rpm N] [--tpm N]`.
pub fn add(
    name: &str,
    concurrency: Option<u32>,
    rpm: Option<u32>,
    tpm: Option<u64>,
) -> AdminRequest {
    let limits = json!({
        "concurrency": concurrency,
        "requests_per_minute": rpm,
        "tokens_per_minute": tpm,
    });
    (
        Method::POST,
        "/admin/keys".to_owned(),
        Some(json!({"name": name, "limits": limits})),
    )
}

/// `haltctl key rotate ID [--overlap-s S]`.
pub fn rotate(id: &str, overlap_s: Option<u64>) -> Result<AdminRequest, String> {
    let (m, p, _) = id_path(id, "rotate")?;
    Ok((m, p, Some(json!({ "overlap_s": overlap_s }))))
}

/// `haltctl key revoke ID`.
pub fn revoke(id: &str) -> Result<AdminRequest, String> {
    id_path(id, "revoke")
}

/// `haltctl key add` and `rotate`: the secret, said once, then the key.
pub fn render_secret(v: &Value) -> String {
    format!(
        "key {} ({}): {}\nsecret (shown once, never again; haltd keeps only its SHA-256):\n{}\n",
        v["id"].as_str().unwrap_or("?"),
        v["name"].as_str().unwrap_or("?"),
        v["state"].as_str().unwrap_or("?"),
        v["secret"].as_str().unwrap_or("?"),
    )
}

/// `haltctl key revoke`: what changed, and the turns tripped.
pub fn render_revoked(v: &Value) -> String {
    let tripped = v["tripped"].as_array().map_or(0, Vec::len);
    if v["changed"] == true {
        format!(
            "key {} revoked; {tripped} open turn(s) halted\n",
            v["key"]["id"].as_str().unwrap_or("?")
        )
    } else {
        format!(
            "key {} was already revoked\n",
            v["key"]["id"].as_str().unwrap_or("?")
        )
    }
}

/// `haltctl key list`: a row per key, with its limits in force and its use of the minute.
pub fn render_list(v: &Value) -> String {
    let mut out = String::new();
    if v["client_keys"] != true {
        out.push_str("the key store is off (--client-keys off): keys are kept but not required\n");
    }
    let list = v["keys"].as_array().map_or(&[][..], Vec::as_slice);
    if list.is_empty() {
        out.push_str("no key\n");
        return out;
    }
    let limit = |l: &Value, k: &str| match l[k].as_u64() {
        Some(0) | None => "-".to_owned(),
        Some(n) => n.to_string(),
    };
    let flat: Vec<Value> = list
        .iter()
        .map(|k| {
            let (l, u) = (&k["limits_in_force"], &k["usage"]);
            json!({
                "id": k["id"], "name": k["name"], "state": k["state"],
                "concurrency": format!("{}/{}", u["in_flight"].as_u64().unwrap_or(0), limit(l, "concurrency")),
                "requests/min": format!("{}/{}", u["requests"].as_u64().unwrap_or(0), limit(l, "requests_per_minute")),
                "tokens/min": format!("{}/{}", u["tokens"].as_u64().unwrap_or(0), limit(l, "tokens_per_minute")),
            })
        })
        .collect();
    let columns = [
        "id",
        "name",
        "state",
        "concurrency",
        "requests/min",
        "tokens/min",
    ];
    out.push_str(&table(&columns, &rows(&flat, &columns)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_bodies_and_what_is_printed() {
        let (m, p, b) = add("ci", Some(2), None, Some(1000));
        assert_eq!((m, p.as_str()), (Method::POST, "/admin/keys"));
        let b = b.expect("body");
        assert_eq!(b["limits"]["concurrency"], 2);
        assert!(b["limits"]["requests_per_minute"].is_null());
        let (_, p, _) = rotate("0123456789abcdef", Some(60)).expect("rotate");
        assert_eq!(p, "/admin/keys/0123456789abcdef/rotate");
        assert!(revoke("nope").is_err());
        assert!(revoke("0123456789abcdeg").is_err());
        let shown = render_list(&json!({"client_keys": true, "keys": [{
            "id": "0123456789abcdef", "name": "ci", "state": "active",
            "limits_in_force": {"concurrency": 2, "requests_per_minute": 0, "tokens_per_minute": 0},
            "usage": {"in_flight": 1, "requests": 7, "tokens": 90},
        }]}));
        assert!(shown.contains("1/2") && shown.contains("7/-"), "{shown}");
        let secret =
            render_secret(&json!({"id": "x", "name": "ci", "state": "active", "secret": "hk-x-y"}));
        assert!(secret.contains("hk-x-y") && secret.contains("shown once"));
    }
}
