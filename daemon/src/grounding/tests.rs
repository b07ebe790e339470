//! `Grounding::from_config`: the router it builds, end to end over real arms.

use std::time::{Duration, Instant};

use super::memory::tests::store;
use super::*;

fn query(span: &str, context: &str) -> SpanQuery {
    SpanQuery {
        span: span.into(),
        context: context.into(),
        prompt: String::new(),
    }
}

#[test]
fn the_configured_router_grounds_from_memory_and_the_evaluator() {
    let dir = store();
    let cfg = GroundingConfig {
        memory: config::MemoryConfig {
            dir: Some(dir.clone()),
            floor: 0.5,
            max_results: 2,
        },
        ..GroundingConfig::default()
    };
    let metrics = crate::metrics::Metrics::new();
    let g = Grounding::from_config(&cfg, Some(metrics.grounding.clone())).expect("built");
    let deadline = Instant::now() + Duration::from_secs(5);

    let round = g.ground(&query("is 2850 km long", "The Danube"), deadline);
    assert_eq!(round.class, SpanClass::EntityShaped);
    assert_eq!(round.attempts[0].arm, ArmKind::Memory);
    assert_eq!(round.attempts[0].outcome, ArmOutcome::Grounded);
    assert_eq!(round.snippets[0].source, "rivers/danube.md:3");

    let round = g.ground(&query("= 400", "So 17 × 23"), deadline);
    assert_eq!(round.class, SpanClass::Computable);
    let tried: Vec<_> = round.attempts.iter().map(|a| (a.arm, a.outcome)).collect();
    assert_eq!(
        tried,
        [
            (ArmKind::Memory, ArmOutcome::Empty),
            (ArmKind::Tool, ArmOutcome::Grounded)
        ]
    );
    assert_eq!(round.snippets[0].confidence, 1.0);
    assert!(round.snippets[0].evidence.contains("391"));

    // The web arm is off by default: skipped.
    let round = g.ground(&query("the weather in Oslo", ""), deadline);
    assert!(round
        .attempts
        .iter()
        .any(|a| a.arm == ArmKind::Web && a.outcome == ArmOutcome::Skipped));
    assert_eq!(
        metrics.grounding.count(ArmKind::Web, ArmOutcome::Skipped),
        1
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_store_that_cannot_be_read_is_an_error() {
    let cfg = GroundingConfig {
        memory: config::MemoryConfig {
            dir: Some("/nonexistent/haltd-grounding".into()),
            ..config::MemoryConfig::default()
        },
        ..GroundingConfig::default()
    };
    let Err(e) = Grounding::from_config(&cfg, None) else {
        panic!("built without a store");
    };
    assert!(
        e.to_string()
            .starts_with("grounding.memory.dir: reading /nonexistent/haltd-grounding"),
        "{e}"
    );
}
