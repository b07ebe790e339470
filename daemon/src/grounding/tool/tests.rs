use std::{collections::BTreeMap, time::Duration};

use super::*;
use crate::grounding::config::HttpToolConfig;
use crate::grounding::test_server::{Reply, Server};

fn query(span: &str) -> SpanQuery {
    SpanQuery {
        span: span.into(),
        context: String::new(),
        prompt: "what is the status?".into(),
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

fn arm(evaluator: bool, tools: &[(&str, &str, HttpMethod, &str)]) -> ToolArm {
    let http: BTreeMap<String, HttpToolConfig> = tools
        .iter()
        .map(|(name, url, method, pattern)| {
            (
                (*name).to_owned(),
                HttpToolConfig {
                    url: (*url).to_owned(),
                    method: *method,
                    pattern: (*pattern).to_owned(),
                },
            )
        })
        .collect();
    ToolArm::new(&ToolConfig { evaluator, http }, http::agent())
        .expect("patterns compile")
        .expect("something to run")
}

#[test]
fn the_evaluator_grounds_a_computable_span() {
    let got = arm(true, &[])
        .search(
            &query("so 17 × 23 = 400 in total"),
            SpanClass::Computable,
            soon(),
        )
        .expect("evaluated");
    assert_eq!(got.len(), 1);
    assert_eq!(
        got[0].evidence,
        "17 * 23 = 391 (the text's 400 does not match)"
    );
    assert_eq!(got[0].confidence, 1.0, "observable: 1.0");
    assert_eq!(got[0].source, evaluator::SOURCE);
}

#[test]
fn nothing_to_check_is_empty_and_nothing_to_run_is_no_arm() {
    let got = arm(true, &[])
        .search(&query("the sky is blue"), SpanClass::Other, soon())
        .expect("answered");
    assert!(got.is_empty());
    let none = ToolArm::new(
        &ToolConfig {
            evaluator: false,
            http: BTreeMap::new(),
        },
        http::agent(),
    )
    .expect("compiles");
    assert!(none.is_none());
}

#[test]
fn http_tools_are_called_when_their_pattern_matches() {
    let server = Server::start(vec![Reply::Json(
        200,
        r#"{"evidence": "api.example is up since 09:00", "confidence": 7}"#.into(),
    )]);
    let url = format!("{}/status", server.url());
    let a = arm(
        false,
        &[
            (
                "other",
                "http://127.0.0.1:9/never",
                HttpMethod::Get,
                "(?i)weather",
            ),
            ("status", &url, HttpMethod::Get, "(?i)\\bis (down|up)\\b"),
        ],
    );
    let got = a
        .search(&query("api.example is down"), SpanClass::Computable, soon())
        .expect("answered");
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].evidence, "api.example is up since 09:00");
    assert_eq!(got[0].claim, "api.example is down");
    assert_eq!(got[0].confidence, 1.0, "clamped");
    assert_eq!(got[0].source, "tool:status");
    let seen = server.seen();
    assert_eq!(seen.len(), 1, "only the matching tool was called");
    assert!(
        seen[0].target.starts_with("/status?q=api.example"),
        "{}",
        seen[0].target
    );
    assert!(a
        .search(&query("nothing matches"), SpanClass::Other, soon())
        .expect("ok")
        .is_empty());
}

#[test]
fn post_tools_get_the_span_and_may_answer_a_list() {
    let server = Server::start(vec![Reply::Json(
        200,
        r#"[{"evidence": "v2.3.1", "claim": "latest version", "confidence": 0.8}, {"evidence": ""}]"#.into(),
    )]);
    let a = arm(
        false,
        &[("versions", &server.url(), HttpMethod::Post, "version")],
    );
    let got = a
        .search(
            &query("the latest version is 2.3"),
            SpanClass::Computable,
            soon(),
        )
        .expect("answered");
    assert_eq!(got.len(), 1, "the empty item is dropped");
    assert_eq!(
        (got[0].claim.as_str(), got[0].confidence),
        ("latest version", 0.8)
    );
    let seen = server.seen();
    assert_eq!(seen[0].method, "POST");
    let body: serde_json::Value = serde_json::from_str(&seen[0].body).expect("json body");
    assert_eq!(body["span"], "the latest version is 2.3");
    assert_eq!(body["prompt"], "what is the status?");
}

#[test]
fn a_failing_tool_fails_the_arm_unless_another_grounds() {
    let bad = Server::start(vec![Reply::Json(503, "{}".into())]);
    let good = Server::start(vec![Reply::Json(200, r#"{"evidence": "up"}"#.into())]);
    let only_bad = arm(false, &[("a", &bad.url(), HttpMethod::Get, "status")]);
    let e = only_bad
        .search(&query("status"), SpanClass::Computable, soon())
        .expect_err("503");
    assert!(e.to_string().starts_with("tool a: "), "{e}");
    let both = arm(
        false,
        &[
            ("a", &bad.url(), HttpMethod::Get, "status"),
            ("b", &good.url(), HttpMethod::Get, "status"),
        ],
    );
    let got = both
        .search(&query("status"), SpanClass::Computable, soon())
        .expect("b answers");
    assert_eq!(got[0].source, "tool:b");
}
