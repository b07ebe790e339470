use std::sync::atomic::AtomicUsize;

use super::*;
use crate::metrics::Metrics;

/// What a scripted arm does.
#[derive(Clone)]
enum Script {
    Find(&'static str),
    Nothing,
    Fail,
    Sleep(Duration),
}

struct Scripted {
    kind: ArmKind,
    script: Script,
    calls: AtomicUsize,
}

impl Arm for Scripted {
    fn kind(&self) -> ArmKind {
        self.kind
    }

    fn search(
        &self,
        query: &SpanQuery,
        _class: SpanClass,
        _deadline: Instant,
    ) -> Result<Vec<Snippet>, ArmError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        match self.script {
            Script::Find(evidence) => Ok(vec![Snippet {
                claim: query.span.clone(),
                evidence: evidence.into(),
                confidence: 0.9,
                source: format!("{:?}", self.kind),
            }]),
            Script::Nothing => Ok(Vec::new()),
            Script::Fail => Err(ArmError::BadAnswer {
                what: "scripted".into(),
                reason: "it fails".into(),
            }),
            Script::Sleep(d) => {
                std::thread::sleep(d);
                Ok(vec![Snippet {
                    claim: String::new(),
                    evidence: "too late".into(),
                    confidence: 1.0,
                    source: String::new(),
                }])
            }
        }
    }
}

fn arm(kind: ArmKind, script: Script) -> Arc<Scripted> {
    Arc::new(Scripted {
        kind,
        script,
        calls: AtomicUsize::new(0),
    })
}

fn policy(arm_ms: u64, round_ms: u64) -> Policy {
    Policy {
        arm_deadline: Duration::from_millis(arm_ms),
        round_deadline: Duration::from_millis(round_ms),
        order_computable: vec![ArmKind::Memory, ArmKind::Tool, ArmKind::Web],
        order_other: vec![ArmKind::Memory, ArmKind::Web, ArmKind::Tool],
    }
}

fn router(m: Script, t: Script, w: Script, policy: Policy) -> (Router, [Arc<Scripted>; 3]) {
    let arms = [
        arm(ArmKind::Memory, m),
        arm(ArmKind::Tool, t),
        arm(ArmKind::Web, w),
    ];
    let [a, b, c] = arms.clone();
    let r = Router::new(
        Arms {
            memory: Some(a),
            tool: Some(b),
            web: Some(c),
        },
        policy,
        None,
    );
    (r, arms)
}

fn query(span: &str) -> SpanQuery {
    SpanQuery {
        span: span.into(),
        context: String::new(),
        prompt: String::new(),
    }
}

fn far() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

fn tried(round: &Round) -> Vec<(ArmKind, ArmOutcome)> {
    round.attempts.iter().map(|a| (a.arm, a.outcome)).collect()
}

#[test]
fn computable_spans_try_memory_then_tool_then_web() {
    let (r, _) = router(
        Script::Nothing,
        Script::Nothing,
        Script::Nothing,
        policy(500, 2000),
    );
    let round = r.ground(&query("17 × 23 = 400"), far());
    assert_eq!(round.class, SpanClass::Computable);
    assert_eq!(
        tried(&round),
        [
            (ArmKind::Memory, ArmOutcome::Empty),
            (ArmKind::Tool, ArmOutcome::Empty),
            (ArmKind::Web, ArmOutcome::Empty),
        ]
    );
    assert!(round.snippets.is_empty());
}

#[test]
fn other_and_entity_spans_try_memory_then_web_then_tool() {
    for (span, class) in [
        ("was born in Ulm", SpanClass::EntityShaped),
        ("depends on what you value", SpanClass::Other),
    ] {
        let (r, _) = router(
            Script::Nothing,
            Script::Nothing,
            Script::Nothing,
            policy(500, 2000),
        );
        let round = r.ground(&query(span), far());
        assert_eq!(round.class, class);
        let order: Vec<ArmKind> = round.attempts.iter().map(|a| a.arm).collect();
        assert_eq!(
            order,
            [ArmKind::Memory, ArmKind::Web, ArmKind::Tool],
            "{span}"
        );
    }
}

#[test]
fn the_first_arm_that_grounds_ends_the_round() {
    let (r, arms) = router(
        Script::Nothing,
        Script::Find("391"),
        Script::Find("web"),
        policy(500, 2000),
    );
    let round = r.ground(&query("17 × 23 = 400"), far());
    assert_eq!(
        tried(&round),
        [
            (ArmKind::Memory, ArmOutcome::Empty),
            (ArmKind::Tool, ArmOutcome::Grounded),
        ]
    );
    assert_eq!(round.snippets.len(), 1);
    assert_eq!(round.snippets[0].evidence, "391");
    assert_eq!(arms[2].calls.load(Ordering::SeqCst), 0, "web not tried");
}

#[test]
fn failures_and_unconfigured_arms_are_recorded_and_passed() {
    let web = arm(ArmKind::Web, Script::Find("found"));
    let tool = arm(ArmKind::Tool, Script::Fail);
    let r = Router::new(
        Arms {
            memory: None,
            tool: Some(tool),
            web: Some(web),
        },
        policy(500, 2000),
        None,
    );
    let round = r.ground(&query("17 × 23"), far());
    assert_eq!(
        tried(&round),
        [
            (ArmKind::Memory, ArmOutcome::Skipped),
            (ArmKind::Tool, ArmOutcome::Failed),
            (ArmKind::Web, ArmOutcome::Grounded),
        ]
    );
    assert_eq!(round.attempts[0].detail, "not configured");
    assert_eq!(round.attempts[1].detail, "scripted: it fails");
    assert_eq!(round.attempts[2].detail, "");
}

#[test]
fn the_arm_deadline_fires_while_the_arm_runs() {
    let (r, _) = router(
        Script::Sleep(Duration::from_millis(1500)),
        Script::Find("391"),
        Script::Nothing,
        policy(200, 5000),
    );
    let start = Instant::now();
    let round = r.ground(&query("17 × 23 = 400"), far());
    let took = start.elapsed();
    assert!(took < Duration::from_millis(1000), "took {took:?}");
    assert_eq!(
        tried(&round),
        [
            (ArmKind::Memory, ArmOutcome::Timeout),
            (ArmKind::Tool, ArmOutcome::Grounded),
        ]
    );
    let timeout = &round.attempts[0];
    assert!(
        (190..1000).contains(&timeout.took_ms),
        "{}",
        timeout.took_ms
    );
    assert!(
        timeout.detail.starts_with("no answer within"),
        "{}",
        timeout.detail
    );
    assert_eq!(
        round.snippets[0].evidence, "391",
        "the late answer is dropped"
    );
    // The late arm's thread ends on its own; its answer goes nowhere.
    let wait = Instant::now() + Duration::from_secs(5);
    while r.running_arms() > 0 && Instant::now() < wait {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(r.running_arms(), 0);
}

#[test]
fn the_round_returns_by_its_deadline() {
    let sleep = Script::Sleep(Duration::from_millis(1500));
    let (r, arms) = router(sleep.clone(), sleep.clone(), sleep, policy(300, 450));
    let start = Instant::now();
    let round = r.ground(&query("17 × 23"), far());
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(440), "took {took:?}");
    assert!(took < Duration::from_millis(900), "took {took:?}");
    assert_eq!(
        tried(&round),
        [
            (ArmKind::Memory, ArmOutcome::Timeout),
            (ArmKind::Tool, ArmOutcome::Timeout),
            (ArmKind::Web, ArmOutcome::Timeout),
        ]
    );
    assert!(
        round.attempts[1].took_ms < 250,
        "the round's deadline cut the second arm"
    );
    assert_eq!(round.attempts[2].detail, "the round's deadline had passed");
    assert_eq!(arms[2].calls.load(Ordering::SeqCst), 0, "web never started");
}

#[test]
fn the_callers_deadline_wins_when_earlier() {
    let sleep = Script::Sleep(Duration::from_millis(1500));
    let (r, _) = router(sleep.clone(), sleep.clone(), sleep, policy(1000, 5000));
    let start = Instant::now();
    let round = r.ground(&query("17 × 23"), start + Duration::from_millis(150));
    assert!(
        start.elapsed() < Duration::from_millis(600),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(round.attempts[0].outcome, ArmOutcome::Timeout);
}

#[test]
fn late_arms_are_bounded() {
    let sleep = Script::Sleep(Duration::from_millis(1500));
    let (r, _) = router(sleep.clone(), sleep.clone(), sleep, policy(10, 5000));
    let mut outcomes = Vec::new();
    for _ in 0..3 {
        outcomes.extend(r.ground(&query("17 × 23"), far()).attempts);
    }
    let failed: Vec<&Attempt> = outcomes
        .iter()
        .filter(|a| a.outcome == ArmOutcome::Failed)
        .collect();
    assert_eq!(outcomes.len() - failed.len(), MAX_LATE_ARMS);
    assert_eq!(failed.len(), 9 - MAX_LATE_ARMS);
    assert!(
        failed[0].detail.contains("still running"),
        "{}",
        failed[0].detail
    );
}

#[test]
fn attempts_are_counted() {
    let metrics = Metrics::new();
    let r = Router::new(
        Arms {
            memory: None,
            tool: Some(arm(ArmKind::Tool, Script::Fail)),
            web: Some(arm(ArmKind::Web, Script::Find("x"))),
        },
        policy(500, 2000),
        Some(metrics.grounding.clone()),
    );
    r.ground(&query("Ulm"), far());
    r.ground(&query("Ulm"), far());
    let g = &metrics.grounding;
    assert_eq!(g.count(ArmKind::Memory, ArmOutcome::Skipped), 2);
    assert_eq!(g.count(ArmKind::Web, ArmOutcome::Grounded), 2);
    assert_eq!(
        g.count(ArmKind::Tool, ArmOutcome::Failed),
        0,
        "web grounded first"
    );
    let text = metrics.encode();
    assert!(
        text.contains("haltd_grounding_rounds_total{arm=\"web\",outcome=\"grounded\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("haltd_grounding_arm_seconds_count{arm=\"web\"} 2"),
        "{text}"
    );
}
