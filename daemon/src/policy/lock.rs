//! `--lock-policy`: what counts as loosening. A change is refused (with a WARN and a ledger
//! record) when it raises B, lifts batch-only, makes a detector less strict (hard → observe →
//! off; intervene counts as observe for the halt bound), moves a threshold so that it trips
//! later, raises a debounce or a deadline, switches away from `mkp`, or ends a degraded scope.
//!
//! Routes are compared by name; a route that is new is compared with the default route it
//! would have taken turns from, and a route that disappears counts as loosening (its turns
//! would fall to a route the operator did not choose for them).

use super::{PolicySet, Profile, Route};
use crate::{
    detect::{
        pipeline::{DetectorsConfig, DETECTORS},
        DetectorMode, Policy,
    },
    safety::SafetyMode,
};

/// How strict a mode is: a lower rank enforces less.
const fn rank(m: DetectorMode) -> u8 {
    match m {
        DetectorMode::Off => 0,
        DetectorMode::Observe | DetectorMode::Intervene => 1,
        DetectorMode::Hard => 2,
    }
}

/// Every way `next` is looser than `now`, each as one line naming the route and the setting.
pub fn loosenings(now: &PolicySet, next: &PolicySet) -> Vec<String> {
    let mut out = Vec::new();
    if now.profile == Profile::Mkp && next.profile != Profile::Mkp {
        out.push(format!("profile {} -> {}", now.profile, next.profile));
    }
    for r in &now.routes {
        if next.named(&r.name).is_none() {
            out.push(format!("route {} removed", r.name));
        }
    }
    for r in &next.routes {
        let before = now.named(&r.name).unwrap_or_else(|| now.default_route());
        route(&mut out, before, r);
    }
    out
}

fn route(out: &mut Vec<String>, a: &Route, b: &Route) {
    let name = &b.name;
    if b.budget > a.budget {
        out.push(format!("route {name}: budget {} -> {}", a.budget, b.budget));
    }
    if a.batch_only && !b.batch_only {
        out.push(format!("route {name}: batch_only true -> false"));
    }
    detectors(out, name, &a.detectors.cfg, &b.detectors.cfg);
}

/// Whether `b` trips later than `a` for a limit where 0 means none and a larger one is looser.
fn later_limit(a: u64, b: u64) -> bool {
    a != 0 && (b == 0 || b > a)
}

fn detectors(out: &mut Vec<String>, route: &str, a: &DetectorsConfig, b: &DetectorsConfig) {
    for id in DETECTORS {
        let (Some(pa), Some(pb)) = (super::policy_of(a, id), super::policy_of(b, id)) else {
            continue;
        };
        policy(out, &format!("route {route}: {}", id.as_str()), pa, pb);
    }
    let (ha, hb) = (&a.halt_monitor.cfg, &b.halt_monitor.cfg);
    let (la, lb) = (ha.hard_limit.unwrap_or(0.0), hb.hard_limit.unwrap_or(0.0));
    if lb < la {
        out.push(format!(
            "route {route}: halt_monitor.hard_limit {la} -> {lb}"
        ));
    }
    let (sa, sb) = (a.surprise.cfg.threshold_bits, b.surprise.cfg.threshold_bits);
    if sb > sa {
        out.push(format!(
            "route {route}: surprise.threshold_bits {sa} -> {sb}"
        ));
    }
    let (ca, cb) = (&a.compute_budget.cfg, &b.compute_budget.cfg);
    if later_limit(ca.max_tokens, cb.max_tokens) {
        out.push(format!(
            "route {route}: compute_budget.max_tokens {} -> {}",
            ca.max_tokens, cb.max_tokens
        ));
    }
    if later_limit(ca.max_wall_ms, cb.max_wall_ms) {
        out.push(format!(
            "route {route}: compute_budget.max_wall_ms {} -> {}",
            ca.max_wall_ms, cb.max_wall_ms
        ));
    }
    let (ta, tb) = (&a.latency_anomaly.cfg, &b.latency_anomaly.cfg);
    for (key, x, y) in [("h", ta.h, tb.h), ("k", ta.k, tb.k), ("l", ta.l, tb.l)] {
        if y > x {
            out.push(format!("route {route}: latency_anomaly.{key} {x} -> {y}"));
        }
    }
    if a.safety.mode == SafetyMode::Enforce && b.safety.mode != SafetyMode::Enforce {
        out.push(format!("route {route}: safety.mode enforce -> observe"));
    }
}

fn policy(out: &mut Vec<String>, at: &str, a: Policy, b: Policy) {
    if rank(b.mode) < rank(a.mode) {
        out.push(format!(
            "{at}: mode {} -> {}",
            a.mode.as_str(),
            b.mode.as_str()
        ));
    }
    if b.debounce > a.debounce {
        out.push(format!("{at}: debounce {} -> {}", a.debounce, b.debounce));
    }
    if later_limit(a.deadline_ns, b.deadline_ns) {
        out.push(format!(
            "{at}: deadline_us {} -> {}",
            a.deadline_ns / 1000,
            b.deadline_ns / 1000
        ));
    }
}
