//! The admin requests of `haltctl circuit show` and `haltctl reconcile`.

use hyper::Method;
use serde_json::{json, Value};

/// One admin request: method, path and body.
pub type AdminRequest = (Method, String, Option<Value>);

/// `haltctl circuit show [CONVERSATION]`: `GET /admin/circuit[/{id}]`. A header value is any
/// visible ASCII: every byte but `[A-Za-z0-9-_.~]` is escaped.
pub fn show(conversation: Option<&str>) -> AdminRequest {
    let path = match conversation {
        Some(id) => format!(
            "/admin/circuit/{}",
            id.bytes()
                .map(|b| match b {
                    b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                        char::from(b).to_string()
                    }
                    _ => format!("%{b:02X}"),
                })
                .collect::<String>()
        ),
        None => "/admin/circuit".to_owned(),
    };
    (Method::GET, path, None)
}

/// `haltctl reconcile [REF --outcome O] [--all]`: `GET /admin/reconcile[?all=true]`, or `POST
/// /admin/reconcile` with the outcome. `Err`: a reference without an outcome.
pub fn reconcile(
    reference: Option<&str>,
    outcome: Option<&str>,
    all: bool,
) -> Result<AdminRequest, &'static str> {
    match (reference, outcome) {
        (Some(r), Some(o)) => Ok((
            Method::POST,
            "/admin/reconcile".to_owned(),
            Some(json!({ "ref": r, "outcome": o })),
        )),
        (Some(_), None) => Err("reconcile REF needs --outcome done|not_done|compensated"),
        (None, _) => {
            let path = if all {
                "/admin/reconcile?all=true"
            } else {
                "/admin/reconcile"
            };
            Ok((Method::GET, path.to_owned(), None))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_bodies() {
        assert_eq!(show(Some("a b/é")).1, "/admin/circuit/a%20b%2F%C3%A9");
        assert_eq!(show(None).1, "/admin/circuit");
        let (m, p, b) = reconcile(Some("r1"), Some("done"), false).expect("valid");
        assert_eq!((m, p.as_str()), (Method::POST, "/admin/reconcile"));
        assert_eq!(b, Some(json!({"ref": "r1", "outcome": "done"})));
        assert_eq!(
            reconcile(None, None, true).expect("valid").1,
            "/admin/reconcile?all=true"
        );
        assert!(reconcile(Some("r1"), None, false).is_err());
    }
}
