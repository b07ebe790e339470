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
    assert_eq!(round.snippets[0].source, "rivers/danube.md:1");

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

/// One item of `tests/grounding/prompts.jsonl`.
#[derive(Debug, serde::Deserialize)]
struct Labelled {
    id: String,
    prompt: String,
    answer: String,
    span: String,
    arm: ArmKind,
    source: String,
}

/// The shipped set's items and a router over its store, as the A/B harness configures it.
fn the_ab_set() -> (Vec<Labelled>, std::sync::Arc<dyn Grounder>) {
    let set = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/grounding");
    let cfg = GroundingConfig {
        memory: config::MemoryConfig {
            dir: Some(set.join("memory")),
            ..config::MemoryConfig::default()
        },
        ..GroundingConfig::default()
    };
    let g = Grounding::from_config(&cfg, None).expect("built");
    let text = std::fs::read_to_string(set.join("prompts.jsonl")).expect("the set");
    let items: Vec<Labelled> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("an item"))
        .collect();
    assert_eq!(items.len(), 12);
    (items, g)
}

/// A round over `text` is grounded by `item`'s arm and source, its top evidence holding the
/// answer.
fn assert_grounded_as_labelled(g: &dyn Grounder, item: &Labelled, text: &str) {
    let round = g.ground(&query(text, ""), Instant::now() + Duration::from_secs(5));
    let grounded = round.attempts.last().expect("an attempt");
    assert_eq!(
        (grounded.arm, grounded.outcome),
        (item.arm, ArmOutcome::Grounded),
        "{}: {round:?}",
        item.id
    );
    let top = &round.snippets[0];
    assert!(top.source.starts_with(&item.source), "{}: {top:?}", item.id);
    assert!(top.evidence.contains(&item.answer), "{}: {top:?}", item.id);
}

#[test]
fn the_ab_prompt_set_is_grounded_as_labelled() {
    let (items, g) = the_ab_set();
    for item in &items {
        assert_grounded_as_labelled(g.as_ref(), item, &item.span);
    }
}

/// The set is written for the store and the evaluator to answer each question from its
/// words alone (`tests/grounding/README.md`): a model that restates the question, as the
/// built-in source does, is grounded by it.
#[test]
fn each_question_of_the_ab_set_is_grounded_as_labelled() {
    let (items, g) = the_ab_set();
    for item in &items {
        assert_grounded_as_labelled(g.as_ref(), item, item.prompt.trim_end_matches('?'));
    }
}
