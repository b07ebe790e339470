//! The model's kernel does what `tcp_bpf` and TCP do, step by step: fixed action sequences,
//! checked state by state.

use haltd_model::kernel::Segment;
use haltd_model::{Action, Config, Emitter, Eval, GateModel, Heartbeat, State};
use stateright::Model;

/// Replays `actions` from the initial state; every one must be enabled and change the state.
fn replay(model: &GateModel, actions: &[Action]) -> State {
    let mut s = model.init_states().remove(0);
    for &a in actions {
        let mut enabled = Vec::new();
        model.actions(&s, &mut enabled);
        assert!(enabled.contains(&a), "{a:?} is not enabled in {s:?}");
        s = model
            .next_state(&s, a)
            .unwrap_or_else(|| panic!("{a:?} does nothing in {s:?}"));
    }
    s
}

fn send(size: u8, accept: u8) -> Action {
    Action::Send { size, accept }
}

fn transmit(len: u8) -> Action {
    Action::Transmit {
        kind: Segment::New,
        len,
        alt: false,
    }
}

#[test]
fn a_kept_pass_lets_a_different_send_through_without_the_program() {
    let model = GateModel::new(Config::adversarial_wide(1, Heartbeat::Live));
    let mut steps = vec![Action::Begin(1), send(1, 1)];
    // A whole send runs the program; the verdict is not kept.
    let s = replay(&model, &steps);
    assert_eq!((s.sock.frames, s.eval, s.accepted), (1, Eval::None, 1));
    // The trip: F = 1, ceiling = 1 + B × E + T = 5. A post-trip token frame of 2 is
    // short-written: PASS is kept.
    steps.extend([transmit(1), Action::Trip, send(2, 1)]);
    let s = replay(&model, &steps);
    assert_eq!(s.policy.egress_ceiling, 5);
    assert_eq!(s.eval, Eval::Pass);
    assert_eq!((s.sock.frames, s.sock.post_trip_frames), (2, 1));
    // The next send is a new frame of 3 (larger than E, beyond the budget): it passes
    // without the program, and again after the next short write.
    steps.extend([transmit(1), send(3, 2)]);
    let s = replay(&model, &steps);
    assert_eq!((s.sock.frames, s.eval, s.accepted), (2, Eval::Pass, 4));
    steps.extend([transmit(2), send(3, 2)]);
    let s = replay(&model, &steps);
    assert_eq!((s.sock.frames, s.eval, s.accepted), (2, Eval::Pass, 6));
    // The egress check stops the bytes at the ceiling: a segment ending beyond it is dropped,
    // one ending at it passes.
    let dropped = model.next_state(&s, transmit(2)).expect("a step");
    assert_eq!((dropped.snd_nxt, dropped.left), (4, 4));
    steps.push(transmit(1));
    let s = replay(&model, &steps);
    assert_eq!((s.delivered(), s.left), (5, 5));
    let dropped = model.next_state(&s, transmit(1)).expect("a step");
    assert_eq!((dropped.delivered(), dropped.left), (5, 5));
}

#[test]
fn a_drop_fails_every_later_send_without_the_program() {
    let model = GateModel::new(Config::adversarial(0, Heartbeat::Live));
    let s = replay(&model, &[Action::Trip, send(1, 1)]);
    assert_eq!(
        s.eval,
        Eval::Drop,
        "B = 0: the first post-trip frame is dropped"
    );
    assert_eq!(s.accepted, 0);
    // Later sends fail without the program; the halter's terminal too.
    let s = replay(&model, &[Action::Trip, send(1, 1), send(2, 0)]);
    assert_eq!((s.sock.frames, s.accepted), (1, 0));
    let s = replay(
        &model,
        &[Action::Trip, send(1, 1), Action::Terminal { accept: 0 }],
    );
    assert_eq!((s.sock.frames, s.sock.terminal_sent, s.accepted), (1, 0, 0));
}

#[test]
fn an_honest_halt_gets_the_frame_in_progress_and_the_terminal_out() {
    let model = GateModel::new(Config::small(0, Emitter::Honest, Heartbeat::Live));
    let s = replay(
        &model,
        &[
            Action::Begin(2),
            send(2, 1), // short write: the rest is in progress
            Action::Trip,
            send(1, 1), // the rest passes on the kept verdict
            transmit(2),
            Action::Terminal { accept: 3 },
            transmit(2),
            transmit(1),
        ],
    );
    assert_eq!(s.policy.egress_ceiling, 5);
    assert_eq!(s.sock.terminal_sent, 1);
    assert_eq!(s.terminal_end, 5);
    assert_eq!(
        s.delivered(),
        5,
        "the frame and the terminal reached the peer"
    );
    assert!(!s.honest_drop);
}

#[test]
fn the_first_lost_heartbeat_a_program_sees_is_the_trip_point() {
    let model = GateModel::new(Config::small(1, Emitter::Disciplined, Heartbeat::Sticky));
    let mut steps = vec![
        Action::Begin(2),
        send(2, 2),
        Action::HeartbeatStale,
        Action::Begin(1),
    ];
    let s = replay(&model, &steps);
    assert!(
        s.trip.is_none(),
        "no program ran since the heartbeat went stale"
    );
    steps.push(send(1, 1));
    let s = replay(&model, &steps);
    let trip = s.trip.expect("the send check saw it");
    assert_eq!((trip.accepted, trip.pending, trip.by_user), (2, 1, false));
    assert_eq!(s.sock.trip_reason, haltd_common::trip_reason::HEARTBEAT);
    assert_eq!(s.post_trip_passes, 1);
    // The next frame is over the budget the send check set itself: dropped, for good.
    steps.extend([transmit(2), Action::Begin(1), send(1, 1)]);
    let s = replay(&model, &steps);
    assert_eq!(s.eval, Eval::Drop);
    assert!(s.send_failed);
    assert_eq!(s.post_trip_passes, 1);
}
