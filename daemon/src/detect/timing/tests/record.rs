//! The FHR timing fields and latency buckets.

use super::*;

/// A latency summary of a three-token turn, for `fhr_timing_fields`.
fn timing_summary(rts_mode: RtsMode, tig_breach: bool) -> TimingSummary {
    TimingSummary {
        rts_mode,
        latency_bucket: Some("le_10ms"),
        tig_breach,
        judged: true,
        note: None,
        method: Method::Cusum,
        direction: Direction::Both,
        tokens: 3,
        gaps: 2,
        mean_gap_ns: Some(5 * MS),
        p99_gap_ns: Some(5 * MS),
        max_gap_ns: Some(5 * MS),
        cusum_up_max: 0.0,
        cusum_down_max: 0.0,
        ewma_up_max: 0.0,
        ewma_down_max: 0.0,
        turn_allowance_sd: 0.0,
        breaches: 0,
        first_breach_index: None,
        baseline: BaselineSnapshot::default(),
    }
}

/// A budget summary of a two-token turn, breached or not, for `fhr_timing_fields`.
fn budget_summary(breached: bool) -> BudgetSummary {
    BudgetSummary {
        max_tokens: 1,
        max_wall_ms: 0,
        tokens: 2,
        wall_ms: Some(1.0),
        breached,
        breach_limit: breached.then_some(BudgetLimit::Tokens),
        breach_token_index: breached.then_some(1),
    }
}

#[test]
fn fhr_timing_fields() {
    let normal = timing_summary(RtsMode::Normal, false);
    let warming = timing_summary(RtsMode::WarmingUp, false);
    let breach = timing_summary(RtsMode::Breach, true);
    let f = fhr_timing(Some(&normal), Some(&budget_summary(false)));
    assert_eq!(
        f,
        FhrTiming {
            rts_mode: RtsMode::Normal,
            latency_bucket: Some("le_10ms"),
            tig_breach: false
        }
    );
    assert_eq!(
        fhr_timing(Some(&warming), None).rts_mode,
        RtsMode::WarmingUp
    );
    let f = fhr_timing(Some(&breach), None);
    assert_eq!((f.rts_mode, f.tig_breach), (RtsMode::Breach, true));
    let f = fhr_timing(Some(&normal), Some(&budget_summary(true)));
    assert_eq!((f.rts_mode, f.tig_breach), (RtsMode::Breach, true));
    let f = fhr_timing(None, None);
    assert_eq!(
        (f.rts_mode, f.tig_breach, f.latency_bucket),
        (RtsMode::Off, false, None)
    );
    let f = fhr_timing(None, Some(&budget_summary(true)));
    assert_eq!((f.rts_mode, f.tig_breach), (RtsMode::Breach, true));
    // The same from the serialised summaries.
    let json = |s: &TimingSummary| serde_json::to_value(s).expect("valid");
    let bjson = |b: bool| serde_json::to_value(budget_summary(b)).expect("valid");
    for (l, b) in [
        (Some(&normal), Some(false)),
        (Some(&warming), None),
        (Some(&breach), Some(false)),
        (Some(&normal), Some(true)),
        (None, None),
        (None, Some(true)),
    ] {
        let from_json = fhr_timing_from_json(l.map(json).as_ref(), b.map(bjson).as_ref());
        assert_eq!(
            from_json,
            fhr_timing(l, b.map(budget_summary).as_ref()),
            "{l:?} {b:?}"
        );
    }
    let odd = serde_json::json!({"rts_mode": "weird", "tig_breach": true});
    assert_eq!(
        fhr_timing_from_json(Some(&odd), None).rts_mode,
        RtsMode::Off
    );
    let names: Vec<&str> = RtsMode::ALL.iter().map(|m| m.as_str()).collect();
    assert_eq!(names, ["normal", "warming_up", "breach", "off"]);
    assert_eq!(
        serde_json::to_value(RtsMode::WarmingUp).expect("valid"),
        "warming_up"
    );
}
