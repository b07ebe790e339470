//! The model has teeth: with a mistake injected into the kernel's decisions (each a wrapper
//! around the real `haltd_common::decide` functions), the checker finds a counterexample of
//! the property that mistake breaks. Run with `--nocapture` to see the counterexamples.

use haltd_model::{check, prop, Config, Emitter, Heartbeat, Mistake};

/// Checks `cfg` with `mistake` until a counterexample of `property` turns up; returns its
/// length (shortest: one thread, breadth first).
fn finds(cfg: Config, mistake: Mistake, property: &'static str) -> usize {
    let cfg = cfg.with_mistake(mistake);
    let o = check(cfg, 1, Some(property));
    let path = o.counterexample(property).unwrap_or_else(|| {
        panic!(
            "{}: the checker found no counterexample of {property:?}",
            o.summary()
        )
    });
    println!(
        "{}\n  {mistake:?} breaks {property:?}: counterexample of {} steps:",
        o.summary(),
        path.len()
    );
    for a in path {
        println!("    {a:?}");
    }
    path.len()
}

/// M1: without the egress check, a send that passes on the verdict the kernel kept after a
/// short write (the backpressure bypass) gets bytes out beyond the allowance.
#[test]
fn m1_without_the_egress_check_the_backpressure_bypass_breaks_the_byte_bound() {
    for budget in 0..=1 {
        let cfg = Config::adversarial(budget, Heartbeat::Live);
        assert!(finds(cfg, Mistake::NoEgressCheck, prop::P2) > 0);
    }
    // Also through a short-written post-trip token frame (not only the terminal's short write).
    let cfg = Config::adversarial_wide(1, Heartbeat::Live);
    finds(cfg, Mistake::NoEgressCheck, prop::P2);
}

/// M2: a terminal allowance that does not ask for the nonce lets a token frame of the
/// terminal's length through as the terminal: one post-trip frame too many.
#[test]
fn m2_a_terminal_allowance_without_the_nonce_lets_one_frame_too_many_out() {
    let cfg = Config {
        terminal_len: 2, // a token frame can have the terminal's length
        ..Config::small(0, Emitter::Disciplined, Heartbeat::Live)
    };
    finds(cfg, Mistake::TerminalWithoutNonce, prop::P3_USER);
}

/// M3: a frame limit off by one lets the first post-trip frame pass as pre-trip.
#[test]
fn m3_a_frame_limit_off_by_one_lets_one_frame_too_many_out() {
    let cfg = Config::small(0, Emitter::Disciplined, Heartbeat::Live);
    finds(cfg, Mistake::PreTripOffByOne, prop::P3_USER);
}

/// M4: a heartbeat latch that forgets, once the heartbeat is fresh again, lets the send check
/// pass a second budget of post-trip frames when the heartbeat is lost again.
#[test]
fn m4_a_heartbeat_latch_that_is_not_sticky_passes_a_second_budget() {
    let cfg = Config::small(1, Emitter::Disciplined, Heartbeat::Flicker);
    finds(cfg, Mistake::LatchNotSticky, prop::P1);
}

/// M5: an egress ceiling without the whole frame in progress cuts off the rest of a pre-trip
/// frame, and so the honest halt: the terminal never gets out.
#[test]
fn m5_a_ceiling_without_the_frame_in_progress_drops_an_honest_stream() {
    let cfg = Config::small(0, Emitter::Honest, Heartbeat::Live);
    finds(
        cfg,
        Mistake::CeilingWithoutFrameInProgress,
        prop::HONEST_NO_DROP,
    );
}

/// M6: checks that latch only on what they see themselves. When the heartbeat comes back, a
/// frame the emitter began after the egress check saw the gap passes the send check as
/// pre-trip (userspace's later trip counts it so), and an adversary gets bytes out beyond the
/// allowance counted from the kernel's first observation.
#[test]
fn m6_latches_that_are_not_shared_break_the_bounds_when_the_heartbeat_comes_back() {
    finds(
        Config::small(0, Emitter::Honest, Heartbeat::RecoverAfterTrip),
        Mistake::UnsharedLatches,
        prop::P3,
    );
    finds(
        Config::adversarial(1, Heartbeat::RecoverAfterTrip),
        Mistake::UnsharedLatches,
        prop::P2,
    );
}
