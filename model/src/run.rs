//! Running the checker on a configuration and summarising what it found.

use std::time::{Duration, Instant};

use stateright::{Checker, HasDiscoveries, Model};

use crate::config::Config;
use crate::model::{Action, GateModel};
use crate::state::State;

/// What one exhaustive run found.
#[derive(Debug)]
pub struct Outcome {
    pub cfg: Config,
    /// States the checker generated (with repeats) and distinct states.
    pub states: usize,
    pub unique_states: usize,
    pub max_depth: usize,
    pub elapsed: Duration,
    /// Whether the search ran to completion (it may stop early when asked to).
    pub complete: bool,
    /// Per property: its name, whether it is an `always` (a discovery is a counterexample), and
    /// the discovery's actions if any. `stateright` keeps the last discovery it met, so a run to
    /// completion may give a long one; a run stopped at the property's first discovery gives
    /// one found breadth-first (with one thread, at most a step longer than the shortest).
    pub discoveries: Vec<(&'static str, bool, Option<Vec<Action>>)>,
    /// The last state of each discovery, in the same order.
    pub last_states: Vec<Option<State>>,
}

impl Outcome {
    /// The counterexample of an `always` property, if the run found one.
    pub fn counterexample(&self, name: &str) -> Option<&[Action]> {
        self.discoveries
            .iter()
            .find(|(n, always, _)| *n == name && *always)
            .and_then(|(_, _, path)| path.as_deref())
    }

    /// Names of the `always` properties the run found violated.
    pub fn violated(&self) -> Vec<&'static str> {
        self.discoveries
            .iter()
            .filter(|(_, always, path)| *always && path.is_some())
            .map(|(n, _, _)| *n)
            .collect()
    }

    /// Names of the `sometimes` properties the run found no example for.
    pub fn unreached(&self) -> Vec<&'static str> {
        self.discoveries
            .iter()
            .filter(|(_, always, path)| !*always && path.is_none())
            .map(|(n, _, _)| *n)
            .collect()
    }

    /// One line for the test output.
    pub fn summary(&self) -> String {
        let c = &self.cfg;
        format!(
            "B={} E={} T={} sndbuf={} mss={} stream<={} frames<={} loss={} {:?} hb={:?} mistake={:?}: \
             {} states ({} unique), depth {}, {:.2?}{}",
            c.budget,
            c.max_event,
            c.terminal_len,
            c.sndbuf,
            c.mss,
            c.max_stream,
            c.max_frames,
            c.net_loss,
            c.emitter,
            c.heartbeat,
            c.mistake,
            self.states,
            self.unique_states,
            self.max_depth,
            self.elapsed,
            if self.complete { "" } else { " (stopped at the counterexample)" },
        )
    }
}

/// Checks `cfg` breadth-first with `threads` threads (with one, a counterexample is a
/// shortest one), to completion, or until a counterexample of `stop_at` is found.
pub fn check(cfg: Config, threads: usize, stop_at: Option<&'static str>) -> Outcome {
    let model = GateModel::new(cfg);
    let properties = model.properties();
    let mut builder = model.checker().threads(threads);
    if let Some(name) = stop_at {
        builder = builder.finish_when(HasDiscoveries::AnyOf([name].into()));
    }
    let t0 = Instant::now();
    let checker = builder.spawn_bfs().join();
    let elapsed = t0.elapsed();
    let mut discoveries = Vec::new();
    let mut last_states = Vec::new();
    for p in &properties {
        let always = p.expectation.discovery_is_failure();
        let found = checker.discovery(p.name);
        last_states.push(found.as_ref().map(|path| path.last_state().clone()));
        discoveries.push((p.name, always, found.map(|path| path.into_actions())));
    }
    let failed = discoveries
        .iter()
        .any(|(_, always, path)| *always && path.is_some());
    Outcome {
        cfg,
        states: checker.state_count(),
        unique_states: checker.unique_state_count(),
        max_depth: checker.max_depth(),
        elapsed,
        complete: !(stop_at.is_some() && failed),
        discoveries,
        last_states,
    }
}
