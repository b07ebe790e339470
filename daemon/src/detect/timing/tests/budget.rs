//! The compute budget.

use super::*;

// ---- compute budget ----

#[test]
fn budget_trips_exactly_at_max_tokens_plus_one() {
    let cfg = ComputeBudgetConfig {
        max_tokens: 10,
        max_wall_ms: 0,
    };
    let mut d = ComputeBudget::new(&cfg);
    for i in 0..10 {
        assert_eq!(d.observe(&tok(i, i * MS)), Finding::Clear, "token {i}");
    }
    let f = d.observe(&tok(10, 10 * MS));
    assert!(is_breach(&f), "{f:?}");
    assert!(is_breach(&d.observe(&tok(11, 11 * MS))), "the breach holds");
    let s = d.budget_summary();
    assert!(s.breached);
    assert_eq!(s.breach_limit, Some(BudgetLimit::Tokens));
    assert_eq!(s.breach_token_index, Some(10));
    assert_eq!(s.tokens, 12);
    assert_eq!(d.code(), FailureCode::ComputeBudgetExceeded);
    assert_eq!(d.summary()["breach_limit"], "tokens");
}

#[test]
fn budget_trips_first_token_after_max_wall_from_first_token() {
    let cfg = ComputeBudgetConfig {
        max_tokens: 0,
        max_wall_ms: 100,
    };
    let mut d = ComputeBudget::new(&cfg);
    let t0 = 5_000 * MS;
    assert_eq!(d.observe(&tok(0, t0)), Finding::Clear);
    assert_eq!(d.deadline_ns(), Some(t0 + 100 * MS));
    assert_eq!(d.observe(&tok(1, t0 + 50 * MS)), Finding::Clear);
    // Exactly at the limit is within it.
    assert_eq!(d.observe(&tok(2, t0 + 100 * MS)), Finding::Clear);
    assert!(is_breach(&d.observe(&tok(3, t0 + 100 * MS + 1))));
    let s = d.budget_summary();
    assert_eq!(s.breach_limit, Some(BudgetLimit::WallTime));
    assert_eq!(s.breach_token_index, Some(3));
}

#[test]
fn budget_wall_time_counts_from_given_start() {
    let cfg = ComputeBudgetConfig {
        max_tokens: 0,
        max_wall_ms: 100,
    };
    let start = 1_000 * MS;
    let mut d = ComputeBudget::starting_at(&cfg, start);
    assert_eq!(d.deadline_ns(), Some(start + 100 * MS));
    // The first token comes 101 ms after the request: already past the budget.
    let f = d.observe(&tok(0, start + 101 * MS));
    assert!(is_breach(&f), "{f:?}");
    if let Finding::Breach { detail } = f {
        assert!(detail.contains("max_wall_ms 100"), "{detail}");
    }
}

#[test]
fn budget_unlimited_never_trips() {
    let cfg = ComputeBudgetConfig::default();
    assert!(cfg.is_unlimited());
    let mut d = ComputeBudget::new(&cfg);
    for i in 0..10_000 {
        assert_eq!(d.observe(&tok(i, i * 1_000 * MS)), Finding::Clear);
    }
    assert_eq!(d.deadline_ns(), None);
    assert_eq!(d.end_of_turn(u64::MAX), Finding::Clear);
}

#[test]
fn budget_config_serde_and_validation() {
    let cfg: ComputeBudgetConfig = serde_json::from_str(r#"{"max_tokens": 5}"#).expect("valid");
    assert_eq!(
        cfg,
        ComputeBudgetConfig {
            max_tokens: 5,
            max_wall_ms: 0
        }
    );
    assert!(serde_json::from_str::<ComputeBudgetConfig>(r#"{"max_token": 5}"#).is_err());
    let err = ComputeBudgetConfig {
        max_tokens: 0,
        max_wall_ms: u64::MAX,
    }
    .validate()
    .expect_err("invalid");
    assert_eq!(err.key, "detectors.compute_budget.max_wall_ms");
    assert!(err
        .to_string()
        .starts_with("detectors.compute_budget.max_wall_ms = "));
    assert!(ComputeBudgetConfig {
        max_tokens: 1,
        max_wall_ms: ComputeBudgetConfig::MAX_WALL_MS
    }
    .validate()
    .is_ok());
}
