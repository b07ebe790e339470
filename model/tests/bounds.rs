//! The unmodified gate, checked exhaustively: every property holds where the heartbeat stays
//! fresh or, once stale, stays stale; where it can come back, the bounds counted from the
//! kernel's own trip point break (a known gap, see the crate doc), and everything else holds.
//!
//! Run with `--nocapture` to see the state counts and durations.

use std::time::Instant;

use haltd_model::{check, prop, Config, Emitter, Heartbeat, Outcome};

/// One exhaustive run, one thread (so a counterexample is a shortest one), printed.
fn exhaustive(cfg: Config) -> Outcome {
    let o = check(cfg, 1, None);
    println!("{}", o.summary());
    o
}

fn describe_violations(o: &Outcome) -> String {
    let mut out = String::new();
    for name in o.violated() {
        let path = o.counterexample(name).unwrap_or_default();
        out += &format!("\n{name} ({} steps):", path.len());
        for a in path {
            out += &format!("\n  {a:?}");
        }
    }
    out
}

fn assert_holds(o: &Outcome) {
    assert!(
        o.violated().is_empty(),
        "{}: counterexamples:{}",
        o.summary(),
        describe_violations(o)
    );
    assert!(
        o.unreached().is_empty(),
        "{}: no example of {:?}",
        o.summary(),
        o.unreached()
    );
}

#[test]
fn haltds_emitters_keep_every_bound_while_the_heartbeat_lives_or_stays_lost() {
    let t0 = Instant::now();
    let mut states = 0;
    for budget in 0..=2 {
        for emitter in [Emitter::Honest, Emitter::Disciplined] {
            for hb in [Heartbeat::Live, Heartbeat::Sticky] {
                let o = exhaustive(Config::small(budget, emitter, hb));
                assert_holds(&o);
                states += o.unique_states;
            }
        }
    }
    println!(
        "honest and disciplined emitters: {states} unique states in all, {:.2?}",
        t0.elapsed()
    );
}

#[test]
fn an_adversarial_emitter_gets_no_more_bytes_out_while_the_heartbeat_lives_or_stays_lost() {
    let t0 = Instant::now();
    let mut states = 0;
    for hb in [Heartbeat::Live, Heartbeat::Sticky] {
        for budget in 0..=2 {
            let o = exhaustive(Config::adversarial(budget, hb));
            assert_holds(&o);
            states += o.unique_states;
        }
        for budget in 0..=1 {
            let o = exhaustive(Config::adversarial_wide(budget, hb));
            assert_holds(&o);
            states += o.unique_states;
        }
    }
    println!(
        "adversarial emitter: {states} unique states in all, {:.2?}",
        t0.elapsed()
    );
}

/// Known gap: a heartbeat that goes stale and comes back. A program that saw it stale latched
/// its own limit, but the other program did not, and userspace's later trip counts as pre-trip
/// what was handed over in between. Relative to the trip userspace wrote (P2u, P3u) every bound
/// still holds, as do P1 and the no-false-drop properties; relative to the first kernel
/// observation, P3 (haltd's emitters: one frame too many) and P2 (adversarial: bytes beyond the
/// allowance) break. When the gate closes the gap this test fails: move these configurations
/// into the tests above.
#[test]
fn a_heartbeat_that_comes_back_breaks_the_bounds_counted_from_the_kernels_observation() {
    let t0 = Instant::now();
    let mut states = 0;
    let mut found: Vec<(Config, &'static str, usize)> = Vec::new();
    for hb in [Heartbeat::Flicker, Heartbeat::RecoverAfterTrip] {
        for budget in 0..=2 {
            for cfg in [
                Config::small(budget, Emitter::Honest, hb),
                Config::small(budget, Emitter::Disciplined, hb),
                Config::adversarial(budget, hb),
            ] {
                let o = exhaustive(cfg);
                states += o.unique_states;
                let gap = if cfg.emitter == Emitter::Adversarial {
                    prop::P2
                } else {
                    prop::P3
                };
                for name in o.violated() {
                    assert_eq!(
                        name,
                        gap,
                        "{}: a property outside the known gap broke:{}",
                        o.summary(),
                        describe_violations(&o)
                    );
                    // A full run keeps the last counterexample it met; one stopped at its first
                    // gives one found breadth-first (within a step of the shortest).
                    let first = check(cfg, 1, Some(name));
                    found.push((
                        cfg,
                        name,
                        first.counterexample(name).unwrap_or_default().len(),
                    ));
                }
                assert!(o.unreached().is_empty(), "{}", o.summary());
            }
        }
    }
    for (cfg, name, steps) in &found {
        println!(
            "gap: B={} {:?} hb={:?}: {name}: counterexample of {steps} steps",
            cfg.budget, cfg.emitter, cfg.heartbeat
        );
    }
    for (emitter, gap) in [
        (Emitter::Honest, prop::P3),
        (Emitter::Disciplined, prop::P3),
        (Emitter::Adversarial, prop::P2),
    ] {
        for hb in [Heartbeat::Flicker, Heartbeat::RecoverAfterTrip] {
            assert!(
                found
                    .iter()
                    .any(|(c, n, _)| c.emitter == emitter && c.heartbeat == hb && *n == gap),
                "{emitter:?} hb={hb:?}: no counterexample of {gap:?} any more: the gap is closed, \
                 move these configurations into the tests that expect every property to hold"
            );
        }
    }
    println!(
        "heartbeat that comes back: {states} unique states in all, {:.2?}",
        t0.elapsed()
    );
}

/// The known gap's shortest counterexamples, in full, for the record.
#[test]
fn the_known_gaps_shortest_counterexamples() {
    for cfg in [
        Config::small(0, Emitter::Honest, Heartbeat::RecoverAfterTrip),
        Config::adversarial(1, Heartbeat::RecoverAfterTrip),
    ] {
        let gap = if cfg.emitter == Emitter::Adversarial {
            prop::P2
        } else {
            prop::P3
        };
        let o = check(cfg, 1, Some(gap));
        let path = o
            .counterexample(gap)
            .unwrap_or_else(|| panic!("{}: no counterexample of {gap:?}", o.summary()));
        println!("{}\n{gap}: {} steps:", o.summary(), path.len());
        for a in path {
            println!("  {a:?}");
        }
        let i = o
            .discoveries
            .iter()
            .position(|(n, _, _)| *n == gap)
            .unwrap_or_default();
        println!("  last state: {:?}", o.last_states[i]);
    }
}

/// Larger bounds, a few minutes with one thread: haltd's emitters with a lossy network under
/// every heartbeat, the wider adversarial bounds. Run with
/// `cargo test --release -p haltd-model --test bounds -- --ignored --nocapture`.
#[test]
#[ignore = "minutes; run by hand when the gate's decisions change"]
fn larger_bounds() {
    let t0 = Instant::now();
    let mut states = 0;
    let known_gap = |o: &Outcome| {
        let gap = if o.cfg.emitter == Emitter::Adversarial {
            prop::P2
        } else {
            prop::P3
        };
        let comes_back = matches!(
            o.cfg.heartbeat,
            Heartbeat::Flicker | Heartbeat::RecoverAfterTrip
        );
        for name in o.violated() {
            assert!(
                comes_back && name == gap,
                "{}: counterexamples:{}",
                o.summary(),
                describe_violations(o)
            );
        }
        assert!(o.unreached().is_empty(), "{}", o.summary());
    };
    let mut configs = Vec::new();
    for hb in [
        Heartbeat::Live,
        Heartbeat::Sticky,
        Heartbeat::Flicker,
        Heartbeat::RecoverAfterTrip,
    ] {
        for budget in 0..=2 {
            for emitter in [Emitter::Honest, Emitter::Disciplined] {
                configs.push(Config {
                    net_loss: true,
                    ..Config::small(budget, emitter, hb)
                });
            }
        }
    }
    configs.push(Config::adversarial_wide(2, Heartbeat::Live));
    configs.push(Config::adversarial_wide(0, Heartbeat::Flicker));
    configs.push(Config::adversarial_wide(1, Heartbeat::Flicker));
    configs.push(Config::adversarial_wide(1, Heartbeat::RecoverAfterTrip));
    for cfg in configs {
        let o = check(cfg, 1, None);
        println!("{} violated: {:?}", o.summary(), o.violated());
        known_gap(&o);
        states += o.unique_states;
    }
    println!(
        "larger bounds: {states} unique states in all, {:.2?}",
        t0.elapsed()
    );
}
