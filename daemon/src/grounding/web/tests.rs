use std::{
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use ureq::unversioned::{
    resolver::{ResolvedSocketAddrs, Resolver},
    transport::{DefaultConnector, NextTimeout},
};

use super::*;
use crate::grounding::router::{Arms, Policy, Router};
use crate::grounding::test_server::{Reply, Server};
use crate::grounding::{ArmOutcome, Grounder};

const RESULTS: &str = r#"{"query": "q", "results": [
  {"title": "Danube", "url": "https://example.org/danube", "content": "The Danube is 2850 km long."},
  {"title": "Empty", "url": "https://example.org/empty", "content": "  "},
  {"title": "Rivers", "url": "https://example.org/rivers", "content": "A list of rivers."},
  {"title": "Third", "url": "https://example.org/3", "content": "More."}
]}"#;

fn query(span: &str) -> SpanQuery {
    SpanQuery {
        span: span.into(),
        context: "Facts about rivers. The Danube".into(),
        prompt: "How long is the Danube?".into(),
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

#[test]
fn results_become_ranked_snippets() {
    let server = Server::start(vec![Reply::Json(200, RESULTS.into())]);
    let arm = WebArm::new(&format!("{}/", server.url()), 2, http::agent());
    let got = arm
        .search(&query("is 2850 km long"), SpanClass::EntityShaped, soon())
        .expect("answered");
    assert_eq!(got.len(), 2, "max_results, the empty result skipped");
    assert_eq!(got[0].evidence, "Danube: The Danube is 2850 km long.");
    assert_eq!(got[0].source, "https://example.org/danube");
    assert_eq!(got[0].claim, "is 2850 km long");
    assert_eq!(got[0].confidence, TOP_CONFIDENCE);
    assert_eq!(got[1].source, "https://example.org/rivers");
    assert!(got[1].confidence < got[0].confidence);
    let seen = server.seen();
    assert_eq!(seen[0].method, "GET");
    assert!(
        seen[0]
            .target
            .starts_with("/search?q=The+Danube+is+2850+km+long&format=json")
            || seen[0]
                .target
                .starts_with("/search?q=The%20Danube%20is%202850%20km%20long&format=json"),
        "{}",
        seen[0].target
    );
}

#[test]
fn no_results_is_empty_and_errors_fail() {
    let server = Server::start(vec![
        Reply::Json(200, r#"{"results": []}"#.into()),
        Reply::Json(500, "{}".into()),
        Reply::Json(200, "not json".into()),
    ]);
    let arm = WebArm::new(&server.url(), 3, http::agent());
    let q = query("x");
    assert!(arm
        .search(&q, SpanClass::Other, soon())
        .expect("answered")
        .is_empty());
    let e = arm.search(&q, SpanClass::Other, soon()).expect_err("500");
    assert!(e.to_string().starts_with("search endpoint: "), "{e}");
    let e = arm
        .search(&q, SpanClass::Other, soon())
        .expect_err("not json");
    assert!(e.to_string().starts_with("search endpoint: "), "{e}");
}

#[test]
fn evidence_is_capped_whatever_the_endpoint_sends() {
    let long = "word ".repeat(1000);
    let body = format!(r#"{{"results": [{{"title": "t", "url": "u", "content": "{long}"}}]}}"#);
    let server = Server::start(vec![Reply::Json(200, body)]);
    let arm = WebArm::new(&server.url(), 3, http::agent());
    let got = arm
        .search(&query("x"), SpanClass::Other, soon())
        .expect("answered");
    assert_eq!(
        got[0].evidence.chars().count(),
        crate::grounding::arm::MAX_EVIDENCE_CHARS
    );
}

fn web_router(arm: WebArm, arm_ms: u64) -> Router {
    Router::new(
        Arms {
            memory: None,
            tool: None,
            web: Some(Arc::new(arm)),
        },
        Policy {
            arm_deadline: Duration::from_millis(arm_ms),
            round_deadline: Duration::from_millis(5000),
            order_computable: vec![ArmKind::Web],
            order_other: vec![ArmKind::Web],
        },
        None,
    )
}

#[test]
fn a_stalled_endpoint_times_out_mid_request() {
    let server = Server::start(vec![Reply::Stall(Duration::from_secs(3))]);
    let router = web_router(WebArm::new(&server.url(), 3, http::agent()), 300);
    let start = Instant::now();
    let round = router.ground(&query("is 2850 km long"), start + Duration::from_secs(10));
    let took = start.elapsed();
    assert!(took < Duration::from_millis(1500), "took {took:?}");
    assert_eq!(
        round.attempts[0].outcome,
        ArmOutcome::Timeout,
        "{:?}",
        round.attempts
    );
    assert_eq!(
        server.seen().len(),
        1,
        "the request was in flight when the deadline fired"
    );
}

/// A resolver that blocks like a slow `getaddrinfo`, ignoring the timeout it is given,
/// then answers loopback.
#[derive(Debug)]
struct SlowResolver {
    delay: Duration,
    to: SocketAddr,
}

impl Resolver for SlowResolver {
    fn resolve(
        &self,
        _uri: &ureq::http::Uri,
        _config: &ureq::config::Config,
        _timeout: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, ureq::Error> {
        std::thread::sleep(self.delay);
        let mut out = self.empty();
        out.push(self.to);
        Ok(out)
    }
}

#[test]
fn a_slow_name_resolution_times_out_too() {
    let server = Server::start(vec![Reply::Json(200, RESULTS.into())]);
    let slow = |delay| {
        let agent = ureq::Agent::with_parts(
            http::config(),
            DefaultConnector::default(),
            SlowResolver {
                delay,
                to: server.addr,
            },
        );
        WebArm::new(
            &format!("http://searx.invalid:{}", server.addr.port()),
            3,
            agent,
        )
    };
    // The request's own timeout does not cut this resolver short: alone, the arm blocks
    // until resolution returns, and only then notices its deadline has passed.
    let arm = slow(Duration::from_millis(1200));
    let start = Instant::now();
    let direct = arm.search(
        &query("x"),
        SpanClass::Other,
        start + Duration::from_millis(200),
    );
    assert!(
        start.elapsed() >= Duration::from_millis(1200),
        "{:?}",
        start.elapsed()
    );
    assert!(direct.is_err(), "{direct:?}");
    // Through the router, the round returns at the arm's deadline.
    let router = web_router(slow(Duration::from_secs(3)), 300);
    let start = Instant::now();
    let round = router.ground(&query("x"), start + Duration::from_secs(10));
    let took = start.elapsed();
    assert!(took < Duration::from_millis(1500), "took {took:?}");
    assert_eq!(round.attempts[0].outcome, ArmOutcome::Timeout);
    assert!(round.snippets.is_empty());
}
