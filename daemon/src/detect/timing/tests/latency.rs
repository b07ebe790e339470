//! The latency anomaly detector: configuration, false alarms, detection, warm-up and baseline.

use super::*;

// ---- latency anomaly: config ----

#[test]
fn latency_config_defaults_serde_and_validation() {
    let d = LatencyAnomalyConfig::default();
    assert_eq!(d.clone().validate(), Ok(d.clone()));
    let cfg: LatencyAnomalyConfig =
        serde_json::from_str(r#"{"method": "ewma", "direction": "up", "h": 5}"#).expect("valid");
    assert_eq!(cfg.method, Method::Ewma);
    assert_eq!(cfg.direction, Direction::Up);
    assert_eq!(cfg.h, 5.0);
    assert_eq!(cfg.k, d.k);
    assert!(serde_json::from_str::<LatencyAnomalyConfig>(r#"{"window": 3}"#).is_err());
    assert!(serde_json::from_str::<LatencyAnomalyConfig>(r#"{"method": "pr"}"#).is_err());
    let back: LatencyAnomalyConfig =
        serde_json::from_value(serde_json::to_value(&d).expect("valid")).expect("valid");
    assert_eq!(back, d);
}

#[test]
fn latency_config_validation_names_the_key() {
    let d = LatencyAnomalyConfig::default();
    let bad = |c: LatencyAnomalyConfig| c.validate().expect_err("invalid").key;
    assert_eq!(
        bad(LatencyAnomalyConfig { k: -1.0, ..d }),
        "detectors.latency_anomaly.k"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig { h: 0.0, ..d }),
        "detectors.latency_anomaly.h"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig { h: f64::NAN, ..d }),
        "detectors.latency_anomaly.h"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig { lambda: 0.0, ..d }),
        "detectors.latency_anomaly.lambda"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig { lambda: 1.5, ..d }),
        "detectors.latency_anomaly.lambda"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig {
            l: f64::INFINITY,
            ..d
        }),
        "detectors.latency_anomaly.l"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig {
            warmup_samples: 1,
            ..d
        }),
        "detectors.latency_anomaly.warmup_samples"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig {
            baseline_alpha: 1.0,
            ..d
        }),
        "detectors.latency_anomaly.baseline_alpha"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig {
            warmup_turns: 1,
            ..d
        }),
        "detectors.latency_anomaly.warmup_turns"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig {
            turn_alpha: 0.0,
            ..d
        }),
        "detectors.latency_anomaly.turn_alpha"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig {
            turn_allowance: -1.0,
            ..d
        }),
        "detectors.latency_anomaly.turn_allowance"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig { z_clip: 0.5, ..d }),
        "detectors.latency_anomaly.z_clip"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig {
            min_sigma: 0.0,
            ..d
        }),
        "detectors.latency_anomaly.min_sigma"
    );
}

// ---- latency anomaly: behaviour ----

#[test]
fn cusum_false_alarm_rate_on_stationary_lognormal_is_low() {
    let cfg = LatencyAnomalyConfig::default();
    let rate = false_alarm_rate(&cfg, STATIONARY, 2_000, 0x5eed_0001);
    eprintln!("cusum defaults: false alarms on {rate:.4} of 2000 stationary 256-token turns");
    assert!(rate < 0.02, "false-alarm rate {rate}");
    let long = Node {
        turn_gaps: 1023,
        ..STATIONARY
    };
    let rate = false_alarm_rate(&cfg, long, 500, 0x5eed_0011);
    eprintln!("cusum defaults: false alarms on {rate:.4} of 500 stationary 1024-token turns");
    assert!(rate < 0.02, "false-alarm rate {rate}");
}

#[test]
fn ewma_false_alarm_rate_on_stationary_lognormal_is_low() {
    let cfg = LatencyAnomalyConfig {
        method: Method::Ewma,
        ..LatencyAnomalyConfig::default()
    };
    let rate = false_alarm_rate(&cfg, STATIONARY, 2_000, 0x5eed_0002);
    eprintln!("ewma defaults: false alarms on {rate:.4} of 2000 stationary 256-token turns");
    assert!(rate < 0.02, "false-alarm rate {rate}");
}

/// Turns at different speeds (load) and stray long gaps are not anomalies.
#[test]
fn cusum_tolerates_speed_spread_between_turns_and_outliers() {
    let cfg = LatencyAnomalyConfig::default();
    let spread = Node {
        between: 0.2,
        ..STATIONARY
    };
    let rate = false_alarm_rate(&cfg, spread, 2_000, 0x5eed_0006);
    eprintln!("cusum defaults: false alarms on {rate:.4} of turns with speed spread 0.2");
    assert!(rate < 0.02, "false-alarm rate {rate}");
    // Without the turn allowance, the same node alarms all the time.
    let strict = LatencyAnomalyConfig {
        turn_allowance: 0.0,
        ..cfg
    };
    let rate0 = false_alarm_rate(&strict, spread, 500, 0x5eed_0006);
    eprintln!("cusum, turn_allowance 0: false alarms on {rate0:.4} of the same turns");
    assert!(rate0 > 5.0 * rate.max(0.01), "{rate0} vs {rate}");

    let hiccups = Node {
        outliers: 0.01,
        ..STATIONARY
    };
    let rate = false_alarm_rate(&cfg, hiccups, 2_000, 0x5eed_0007);
    eprintln!("cusum defaults: false alarms on {rate:.4} of turns with 1 % of gaps x20");
    assert!(rate < 0.02, "false-alarm rate {rate}");
}

#[test]
fn cusum_detects_fourfold_slowdown_within_15_tokens() {
    let cfg = LatencyAnomalyConfig::default();
    let delays = detection_delays(&cfg, 4.0, 500, 0x5eed_0003);
    let (missed, mean, max) = delay_stats(&delays);
    eprintln!("cusum, gaps x4 from token 20: missed {missed}/500, delay mean {mean:.2} max {max}");
    // A false alarm before the change counts as a miss here; allow for the rare one.
    assert!(missed <= 5, "missed {missed}");
    assert!(max <= 15, "max delay {max}");
}

#[test]
fn cusum_detects_fourfold_speedup_within_15_tokens() {
    let cfg = LatencyAnomalyConfig::default();
    let delays = detection_delays(&cfg, 0.25, 500, 0x5eed_0004);
    let (missed, mean, max) = delay_stats(&delays);
    eprintln!("cusum, gaps /4 from token 20: missed {missed}/500, delay mean {mean:.2} max {max}");
    assert!(missed <= 5, "missed {missed}");
    assert!(max <= 15, "max delay {max}");
}

#[test]
fn ewma_detects_fourfold_slowdown_within_15_tokens() {
    let cfg = LatencyAnomalyConfig {
        method: Method::Ewma,
        ..LatencyAnomalyConfig::default()
    };
    let delays = detection_delays(&cfg, 4.0, 500, 0x5eed_0005);
    let (missed, mean, max) = delay_stats(&delays);
    eprintln!("ewma, gaps x4 from token 20: missed {missed}/500, delay mean {mean:.2} max {max}");
    assert!(missed <= 5, "missed {missed}");
    assert!(max <= 15, "max delay {max}");
}

#[test]
fn direction_restricts_what_counts() {
    let mut rng = StdRng::seed_from_u64(7);
    for (direction, factor, expect) in [
        (Direction::Up, 4.0, true),
        (Direction::Up, 0.25, false),
        (Direction::Down, 4.0, false),
        (Direction::Down, 0.25, true),
    ] {
        let cfg = LatencyAnomalyConfig {
            direction,
            ..LatencyAnomalyConfig::default()
        };
        let base = warmed(&cfg, &mut rng);
        let gaps: Vec<u64> = (0..100)
            .map(|_| (lognormal_gap(&mut rng, MEDIAN_NS, SIGMA) as f64 * factor) as u64)
            .collect();
        let (d, first) = run_turn(&cfg, &base, gaps, false);
        assert_eq!(first.is_some(), expect, "{direction:?} x{factor}");
        // Both sides are still measured.
        let s = d.timing_summary();
        assert!(s.cusum_up_max > cfg.h || s.cusum_down_max > cfg.h);
    }
}

#[test]
fn warm_up_is_clear_and_says_so() {
    let cfg = LatencyAnomalyConfig {
        warmup_samples: 100,
        warmup_turns: 2,
        ..LatencyAnomalyConfig::default()
    };
    let base = Arc::new(LatencyBaseline::new());
    // Wildly varying gaps during warm-up: never a breach, never Failed.
    let gaps: Vec<u64> = (0..60)
        .map(|i| if i % 2 == 0 { 1 } else { 10_000 * MS })
        .collect();
    let (d, first) = run_turn(&cfg, &base, gaps, true);
    assert_eq!(first, None);
    let s = d.timing_summary();
    assert_eq!(s.rts_mode, RtsMode::WarmingUp);
    assert!(!s.judged);
    assert!(!s.tig_breach);
    assert_eq!(
        s.note.as_deref(),
        Some("warming up: baseline has 0 of 100 gaps, 0 of 2 turns")
    );
    assert_eq!(d.summary()["rts_mode"], "warming_up");
    assert_eq!(base.snapshot().samples, 60);

    // 60 + 60 >= 100: the third turn is judged.
    let mut rng = StdRng::seed_from_u64(9);
    base.reset();
    run_turn(&cfg, &base, stationary(&mut rng, 60), true);
    let (d, _) = run_turn(&cfg, &base, stationary(&mut rng, 60), true);
    assert_eq!(d.timing_summary().rts_mode, RtsMode::WarmingUp);
    let (d, first) = run_turn(&cfg, &base, stationary(&mut rng, 60), true);
    assert!(d.timing_summary().judged);
    assert_eq!(first, None);
    assert_eq!(d.timing_summary().rts_mode, RtsMode::Normal);
    assert_eq!(d.timing_summary().note, None);
}

#[test]
fn tripped_or_dropped_turns_do_not_teach_the_baseline() {
    let cfg = LatencyAnomalyConfig::default();
    let mut rng = StdRng::seed_from_u64(11);
    let base = warmed(&cfg, &mut rng);
    let before = base.snapshot();
    // Observe mode: the turn breaches, goes on and ends "cleanly" for the data plane.
    let slow: Vec<u64> = (0..TURN_GAPS).map(|_| 10 * MEDIAN_NS as u64).collect();
    let (d, first) = run_turn(&cfg, &base, slow.clone(), true);
    assert!(first.is_some());
    assert_eq!(base.snapshot(), before);
    let s = d.timing_summary();
    assert_eq!(s.rts_mode, RtsMode::Breach);
    assert!(s.tig_breach);
    assert!(s.breaches > 0);
    // Hard mode elsewhere: the turn is dropped without end_of_turn.
    drop(run_turn(&cfg, &base, stationary(&mut rng, 100), false));
    assert_eq!(base.snapshot(), before);
    // A clean turn does teach it, once.
    let (mut d, _) = run_turn(&cfg, &base, stationary(&mut rng, 100), true);
    let after = base.snapshot();
    assert_eq!(after.samples, before.samples + 100);
    assert_eq!(after.turns, before.turns + 1);
    d.end_of_turn(0);
    assert_eq!(base.snapshot(), after, "end_of_turn twice folds once");
    // Even many tripped turns leave the baseline as it was: a slow source cannot teach it
    // that slow is normal by tripping.
    for _ in 0..50 {
        run_turn(&cfg, &base, slow.clone(), true);
    }
    assert_eq!(base.snapshot(), after);
}

#[test]
fn baseline_learns_mean_and_spread() {
    let cfg = LatencyAnomalyConfig::default();
    let mut rng = StdRng::seed_from_u64(13);
    let base = Arc::new(LatencyBaseline::new());
    for _ in 0..40 {
        run_turn(&cfg, &base, stationary(&mut rng, TURN_GAPS), true);
    }
    let s = base.snapshot();
    let rel = (s.median_gap_ns() / MEDIAN_NS - 1.0).abs();
    assert!(rel < 0.1, "median {} vs {MEDIAN_NS}", s.median_gap_ns());
    assert!((s.sd_within() - SIGMA).abs() < 0.05, "{s:?}");
    assert!(s.sd_between() < 0.05, "{s:?}");
    // Turns at different speeds: the spread between them is learned apart.
    base.reset();
    for _ in 0..200 {
        let speed = (0.2 * normal(&mut rng)).exp();
        let gaps = (0..TURN_GAPS).map(|_| lognormal_gap(&mut rng, MEDIAN_NS * speed, SIGMA));
        run_turn(&cfg, &base, gaps.collect::<Vec<_>>(), true);
    }
    let s = base.snapshot();
    assert!((s.sd_within() - SIGMA).abs() < 0.05, "{s:?}");
    assert!((s.sd_between() - 0.2).abs() < 0.08, "{s:?}");
    // The first turn is taken as it is (no pull towards the initial zero).
    base.reset();
    run_turn(&cfg, &base, vec![5 * MS; 10], true);
    let s = base.snapshot();
    assert!((s.median_gap_ns() / (5 * MS) as f64 - 1.0).abs() < 1e-9);
    assert!(s.var_within.abs() < 1e-12 && s.var_between == 0.0);
}

#[test]
fn summary_fields() {
    let cfg = LatencyAnomalyConfig::default();
    let base = Arc::new(LatencyBaseline::new());
    let gaps: Vec<u64> = (0..99)
        .map(|i| if i == 50 { 500 * MS } else { 10 * MS })
        .collect();
    let (d, _) = run_turn(&cfg, &base, gaps, true);
    let s = d.timing_summary();
    assert_eq!(s.tokens, 100);
    assert_eq!(s.gaps, 99);
    assert_eq!(s.mean_gap_ns, Some((98 * 10 + 500) * MS / 99));
    assert_eq!(s.latency_bucket, Some("le_100ms"));
    assert_eq!(s.max_gap_ns, Some(500 * MS));
    // 99th percentile of 99 gaps is the 99th smallest: the 500 ms one (clamped to max).
    assert_eq!(s.p99_gap_ns, Some(500 * MS));
    let (d, _) = run_turn(&cfg, &base, vec![10 * MS; 200], true);
    let p99 = d.timing_summary().p99_gap_ns.expect("valid");
    assert!((10 * MS..=11 * MS).contains(&p99), "{p99}");

    let (d, _) = run_turn(&cfg, &base, [], true);
    let s = d.timing_summary();
    assert_eq!((s.tokens, s.gaps), (1, 0));
    assert_eq!(
        (s.mean_gap_ns, s.p99_gap_ns, s.latency_bucket),
        (None, None, None)
    );
    let v = d.summary();
    assert_eq!(v["latency_bucket"], serde_json::Value::Null);
    assert_eq!(v["method"], "cusum");
    assert_eq!(v["direction"], "both");
}

#[test]
fn latency_bucket_edges() {
    assert_eq!(latency_bucket(0), "le_1ms");
    assert_eq!(latency_bucket(1_000_000), "le_1ms");
    assert_eq!(latency_bucket(1_000_001), "le_10ms");
    assert_eq!(latency_bucket(10_000_000), "le_10ms");
    assert_eq!(latency_bucket(100_000_000), "le_100ms");
    assert_eq!(latency_bucket(100_000_001), "gt_100ms");
    assert_eq!(latency_bucket(u64::MAX), "gt_100ms");
    for g in [0, 5_000_000, 50_000_000, u64::MAX] {
        assert!(LATENCY_BUCKETS.contains(&latency_bucket(g)));
    }
}
