//! Liveness for haltd's honest emitter, exhaustively over the reachable states: from every
//! state of an untripped stream with a fresh heartbeat, every frame counted so far can still
//! reach the peer without a trip; from every state after the trip write in which no program has
//! seen the heartbeat lost, the terminal can still reach the peer. With L1 and L2 (nothing is
//! ever dropped there) and TCP retransmitting what it has not got acknowledged, the frames and
//! the terminal do get there. Run with `--nocapture` to see the state counts.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use haltd_model::{Action, Config, Emitter, GateModel, Heartbeat, State};
use stateright::Model;

/// The reachable states and, per state, the actions' successors.
struct Graph {
    states: Vec<State>,
    succ: Vec<Vec<(Action, usize)>>,
}

fn explore(model: &GateModel) -> Graph {
    let mut index: HashMap<State, usize> = HashMap::new();
    let mut states = Vec::new();
    let mut succ: Vec<Vec<(Action, usize)>> = Vec::new();
    let mut queue = VecDeque::new();
    for s in model.init_states() {
        index.insert(s.clone(), states.len());
        queue.push_back(states.len());
        states.push(s);
        succ.push(Vec::new());
    }
    let mut actions = Vec::new();
    while let Some(i) = queue.pop_front() {
        actions.clear();
        model.actions(&states[i], &mut actions);
        for &a in &actions {
            let Some(next) = model.next_state(&states[i], a) else {
                continue;
            };
            let j = match index.get(&next) {
                Some(&j) => j,
                None => {
                    let j = states.len();
                    index.insert(next.clone(), j);
                    states.push(next);
                    succ.push(Vec::new());
                    queue.push_back(j);
                    j
                }
            };
            succ[i].push((a, j));
        }
    }
    Graph { states, succ }
}

impl Graph {
    /// States from which a `goal` state is reachable through `allowed` actions only.
    fn can_reach(
        &self,
        goal: impl Fn(&State) -> bool,
        allowed: impl Fn(&Action) -> bool,
    ) -> Vec<bool> {
        let mut pred: Vec<Vec<usize>> = vec![Vec::new(); self.states.len()];
        for (i, edges) in self.succ.iter().enumerate() {
            for (a, j) in edges {
                if allowed(a) {
                    pred[*j].push(i);
                }
            }
        }
        let mut ok: Vec<bool> = self.states.iter().map(goal).collect();
        let mut queue: VecDeque<usize> = (0..self.states.len()).filter(|&i| ok[i]).collect();
        while let Some(j) = queue.pop_front() {
            for &i in &pred[j] {
                if !ok[i] {
                    ok[i] = true;
                    queue.push_back(i);
                }
            }
        }
        ok
    }
}

fn all_delivered(s: &State) -> bool {
    s.pending == 0 && s.accepted == s.bytes_counted && s.delivered() == s.accepted
}

fn terminal_delivered(s: &State) -> bool {
    s.terminal_end > 0 && s.delivered() >= s.terminal_end
}

/// The emitter finishing what it began, the halter, TCP: no new frame, no trip, no heartbeat
/// change.
fn finishing(a: &Action) -> bool {
    matches!(a, Action::Send { .. } | Action::Transmit { .. })
}

fn halting(a: &Action) -> bool {
    finishing(a) || matches!(a, Action::Terminal { .. })
}

#[test]
fn an_honest_stream_can_always_deliver_its_frames_and_its_halt() {
    let t0 = Instant::now();
    for heartbeat in [Heartbeat::Live, Heartbeat::Sticky] {
        for net_loss in [false, true] {
            for budget in 0..=2 {
                let cfg = Config {
                    net_loss,
                    ..Config::small(budget, Emitter::Honest, heartbeat)
                };
                let t = Instant::now();
                let g = explore(&GateModel::new(cfg));
                let frames = g.can_reach(all_delivered, finishing);
                let halt = g.can_reach(terminal_delivered, halting);
                let (mut untripped, mut tripped) = (0, 0);
                for (i, s) in g.states.iter().enumerate() {
                    if s.trip.is_none() && s.hb_fresh {
                        untripped += 1;
                        assert!(frames[i], "{cfg:?}: stuck frames in {s:?}");
                    }
                    if s.user_tripped && !s.hb_seen && s.hb_fresh {
                        tripped += 1;
                        assert!(halt[i], "{cfg:?}: stuck halt in {s:?}");
                    }
                }
                assert!(untripped > 0 && tripped > 0);
                println!(
                    "B={budget} honest hb={heartbeat:?} loss={net_loss}: {} states ({untripped} \
                     untripped, {tripped} tripped with the heartbeat never seen lost), {:.2?}",
                    g.states.len(),
                    t.elapsed()
                );
            }
        }
    }
    println!("liveness: {:.2?}", t0.elapsed());
}

/// The check has teeth: with the egress ceiling missing the rest of the frame in progress, an
/// honest halt gets stuck (the terminal can never get out).
#[test]
fn a_ceiling_without_the_frame_in_progress_gets_an_honest_halt_stuck() {
    let cfg = Config::small(0, Emitter::Honest, Heartbeat::Live)
        .with_mistake(haltd_model::Mistake::CeilingWithoutFrameInProgress);
    let g = explore(&GateModel::new(cfg));
    let halt = g.can_reach(terminal_delivered, halting);
    let stuck = g
        .states
        .iter()
        .enumerate()
        .filter(|(i, s)| s.user_tripped && !s.hb_seen && !halt[*i])
        .count();
    println!("{stuck} of {} states have a stuck halt", g.states.len());
    assert!(stuck > 0);
}
