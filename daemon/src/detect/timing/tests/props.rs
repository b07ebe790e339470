//! Property tests, the tuning table and the per-token cost measurement.

use super::*;

fn assert_finite_summary(s: &TimingSummary) {
    for v in [
        s.cusum_up_max,
        s.cusum_down_max,
        s.ewma_up_max,
        s.ewma_down_max,
        s.baseline.mean_log_gap,
        s.baseline.var_within,
        s.baseline.var_between,
        s.turn_allowance_sd,
    ] {
        assert!(v.is_finite(), "{s:?}");
    }
}

fn arb_gap() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0_u64),
        Just(1_u64),
        Just(u64::MAX),
        0_u64..1_000,
        0_u64..10_000_000_000,
        any::<u64>(),
    ]
}

fn arb_config() -> impl Strategy<Value = LatencyAnomalyConfig> {
    (
        prop_oneof![Just(Method::Cusum), Just(Method::Ewma)],
        prop_oneof![
            Just(Direction::Up),
            Just(Direction::Down),
            Just(Direction::Both)
        ],
        0.0..3.0_f64,
        0.01..20.0_f64,
        0.001..=1.0_f64,
        0.1..10.0_f64,
        (2_u64..50, 2_u64..5),
        1e-6..0.999_f64,
        1e-6..0.999_f64,
        0.0..5.0_f64,
        1e-6..1.0_f64,
    )
        .prop_map(
            |(
                method,
                direction,
                k,
                h,
                lambda,
                l,
                (warmup_samples, warmup_turns),
                baseline_alpha,
                turn_alpha,
                turn_allowance,
                min_sigma,
            )| {
                LatencyAnomalyConfig {
                    method,
                    direction,
                    k,
                    h,
                    lambda,
                    l,
                    warmup_samples,
                    warmup_turns,
                    baseline_alpha,
                    turn_alpha,
                    turn_allowance,
                    z_clip: k + 0.5,
                    min_sigma,
                }
            },
        )
}

/// The numbers behind the defaults (release: `cargo test --release -p haltd -- --ignored
/// tuning_table --nocapture`): false alarms per turn on several synthetic nodes, and
/// detection delays of step changes, for the defaults and a few alternatives.
#[test]
#[ignore = "prints a tuning table; run in release"]
fn tuning_table() {
    let d = LatencyAnomalyConfig::default();
    let configs = [
        ("defaults", d.clone()),
        ("k 0.5 h 8", LatencyAnomalyConfig { k: 0.5, ..d }),
        (
            "k 0.5 h 10",
            LatencyAnomalyConfig {
                k: 0.5,
                h: 10.0,
                ..d
            },
        ),
        (
            "allowance 0",
            LatencyAnomalyConfig {
                turn_allowance: 0.0,
                ..d
            },
        ),
        ("z_clip 5", LatencyAnomalyConfig { z_clip: 5.0, ..d }),
        (
            "ewma",
            LatencyAnomalyConfig {
                method: Method::Ewma,
                ..d
            },
        ),
    ];
    let nodes = [
        ("256", STATIONARY),
        (
            "1024",
            Node {
                turn_gaps: 1023,
                ..STATIONARY
            },
        ),
        (
            "4096",
            Node {
                turn_gaps: 4095,
                ..STATIONARY
            },
        ),
        (
            "256 spread 0.2",
            Node {
                between: 0.2,
                ..STATIONARY
            },
        ),
        (
            "256 spread 0.3",
            Node {
                between: 0.3,
                ..STATIONARY
            },
        ),
        (
            "256 outliers 1%",
            Node {
                outliers: 0.01,
                ..STATIONARY
            },
        ),
    ];
    for (name, cfg) in configs {
        let mut line = format!("{name:12}");
        for (node_name, node) in nodes {
            let turns = 2_000_000 / (node.turn_gaps + 1);
            let fa = false_alarm_rate(&cfg, node, turns, 5);
            line += &format!(" | fa[{node_name}] {:.2} %", fa * 100.0);
        }
        for f in [4.0, 2.0, 0.25] {
            let (m, mean, max) = delay_stats(&detection_delays(&cfg, f, 500, 3));
            line += &format!(" | x{f}: missed {m}, delay mean {mean:.1} max {max}");
        }
        eprintln!("{line}");
    }
}

proptest! {
    /// Arbitrary gaps (zeros, huge values, u64 overflow of the clock) in several turns,
    /// arbitrary valid configuration: every statistic and the baseline stay finite, the
    /// detector never answers `Failed`, and the summary serialises.
    #[test]
    fn statistics_stay_finite(
        cfg in arb_config(),
        turns in proptest::collection::vec(proptest::collection::vec(arb_gap(), 0..80), 1..6),
        clean in proptest::collection::vec(any::<bool>(), 6),
    ) {
        prop_assert_eq!(cfg.clone().validate(), Ok(cfg.clone()));
        let base = Arc::new(LatencyBaseline::new());
        for (t, gaps) in turns.into_iter().enumerate() {
            let mut d = LatencyAnomaly::new(&cfg, Arc::clone(&base));
            let mut now = 0_u64;
            for (i, g) in std::iter::once(0).chain(gaps).enumerate() {
                now = now.saturating_add(g);
                let f = d.observe(&tok(i as u64, now));
                prop_assert!(!matches!(f, Finding::Failed { .. }), "Failed: {:?}", f);
            }
            if clean[t] {
                d.end_of_turn(now);
            }
            let s = d.timing_summary();
            assert_finite_summary(&s);
            prop_assert!(s.mean_gap_ns.is_none() == (s.gaps == 0));
            prop_assert!(d.summary().is_object());
            let b = base.snapshot();
            prop_assert!(b.mean_log_gap.is_finite());
            prop_assert!(b.var_within.is_finite() && b.var_within >= 0.0);
            prop_assert!(b.var_between.is_finite() && b.var_between >= 0.0);
        }
    }

    /// Clocks that go backwards or jump are taken as they come (saturating), never a
    /// panic or a non-finite statistic; a budget breach, once there, holds.
    #[test]
    fn arbitrary_timestamps(
        stamps in proptest::collection::vec(any::<u64>(), 1..100),
        max_tokens in 0_u64..50,
        max_wall_ms in 0_u64..1_000_000,
    ) {
        let cfg = LatencyAnomalyConfig {
            warmup_samples: 2,
            warmup_turns: 2,
            ..LatencyAnomalyConfig::default()
        };
        let base = Arc::new(LatencyBaseline::new());
        run_turn(&cfg, &base, [10 * MS, 12 * MS, 9 * MS], true);
        run_turn(&cfg, &base, [11 * MS, 14 * MS, 8 * MS], true);
        let mut d = LatencyAnomaly::new(&cfg, Arc::clone(&base));
        let mut b = ComputeBudget::new(&ComputeBudgetConfig { max_tokens, max_wall_ms });
        let mut breached = false;
        for (i, &now) in stamps.iter().enumerate() {
            d.observe(&tok(i as u64, now));
            let f = b.observe(&tok(i as u64, now));
            prop_assert!(!breached || is_breach(&f), "breach did not hold");
            breached |= is_breach(&f);
            if max_tokens != 0 && i as u64 >= max_tokens {
                prop_assert!(breached);
            }
        }
        assert_finite_summary(&d.timing_summary());
        prop_assert_eq!(b.budget_summary().breached, breached);
    }

    /// Token budget: breach exactly from index max_tokens on, whatever the timing.
    #[test]
    fn budget_token_limit_is_exact(max_tokens in 1_u64..200, n in 0_u64..400) {
        let mut b = ComputeBudget::new(&ComputeBudgetConfig { max_tokens, max_wall_ms: 0 });
        for i in 0..n {
            prop_assert_eq!(is_breach(&b.observe(&tok(i, i))), i >= max_tokens);
        }
    }
}

/// Per-token cost of `observe` on the judged path (release: `cargo test --release -p haltd
/// -- --ignored per_token_cost --nocapture`). The `Clear` path does no allocation: it
/// touches only the detector's fields (the histogram is an inline array).
#[test]
#[ignore = "timing measurement; run in release"]
fn per_token_cost() {
    use std::time::Instant;
    let mut rng = StdRng::seed_from_u64(17);
    for method in [Method::Cusum, Method::Ewma] {
        let cfg = LatencyAnomalyConfig {
            method,
            ..LatencyAnomalyConfig::default()
        };
        let base = warmed(&cfg, &mut rng);
        const N: usize = 1 << 20;
        let stamps: Vec<u64> = {
            let mut now = 0_u64;
            (0..N)
                .map(|_| {
                    now += lognormal_gap(&mut rng, MEDIAN_NS, SIGMA);
                    now
                })
                .collect()
        };
        let mut samples = Vec::with_capacity(64);
        for _ in 0..64 {
            let mut d = LatencyAnomaly::new(&cfg, Arc::clone(&base));
            let chunk = N / 64;
            let start = Instant::now();
            let mut breaches = 0_u64;
            for (i, &now) in stamps.iter().take(chunk).enumerate() {
                breaches += u64::from(is_breach(&d.observe(&tok(i as u64, now))));
            }
            let ns = start.elapsed().as_nanos() as f64 / chunk as f64;
            samples.push(ns);
            std::hint::black_box((breaches, d.timing_summary()));
        }
        samples.sort_by(f64::total_cmp);
        // Chunks of 16384 tokens; the fastest chunk is the cost without interference from
        // other processes, the median the typical one.
        eprintln!(
            "latency_anomaly ({method:?}) observe: ns/token over 64 chunks: min {:.1}, \
             median {:.1}, max {:.1}",
            samples[0], samples[32], samples[63]
        );
        let mut b = ComputeBudget::new(&ComputeBudgetConfig {
            max_tokens: u64::MAX,
            max_wall_ms: ComputeBudgetConfig::MAX_WALL_MS,
        });
        let start = Instant::now();
        for (i, &now) in stamps.iter().enumerate() {
            std::hint::black_box(b.observe(&tok(i as u64, now)));
        }
        eprintln!(
            "compute_budget observe: {:.1} ns/token",
            start.elapsed().as_nanos() as f64 / N as f64
        );
    }
}
