//! The A/B figures of one backend, from the pairs of turns ([`super::Pair`]); the
//! definitions are in `docs/grounding.md` ("The A/B harness"):
//!
//! - a reply is **correct** when it contains the item's `answer` (case and runs of white
//!   space ignored);
//! - an item was **intervened on** when its intervene-mode turn has a round that changed or
//!   annotated the reply (outcome `rewound` or `annotated`); rounds that found nothing
//!   (`empty`, `timeout`, `cancelled`) are breaches without an intervention;
//! - **precision**: of the items intervened on, the share whose canary reply was wrong;
//! - **changed**: the intervene reply's text differs from the canary's; split into the
//!   items intervened on and the others (a backend that does not give the same reply to the
//!   same request twice changes replies without any intervention);
//! - **no regression**: no item correct in the canary is wrong in intervene mode;
//! - **arm latency**: each arm attempt's `took_ms` (the receipts' `rounds[].attempts`; an
//!   arm `skipped` as not configured left out), and each round's (`rounds[].took_ms`), p50
//!   and p99 by nearest rank;
//! - **hold-back**: over the items with no round in intervene mode (haltd's only difference
//!   is then the window), per token index present in both turns, its arrival after the
//!   request in intervene mode less the same in the canary.

use std::{collections::BTreeMap, fmt::Write as _};

use serde::Serialize;
use serde_json::Value;

use super::{Backend, Continuation, Pair, Turn};
use crate::quantile;

/// p50 and p99 of some milliseconds.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Latency {
    pub n: usize,
    pub p50_ms: Option<u64>,
    pub p99_ms: Option<u64>,
}

impl Latency {
    fn of(v: &[u64]) -> Self {
        Latency {
            n: v.len(),
            p50_ms: quantile(v, 0.5),
            p99_ms: quantile(v, 0.99),
        }
    }
}

/// What the hold-back window added per token.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct HoldBack {
    /// Items compared (no round in intervene mode), those of them with the same text in
    /// both modes, and the tokens compared.
    pub items: usize,
    pub same_text_items: usize,
    pub tokens: usize,
    pub added_us_p50: Option<f64>,
    pub added_us_mean: Option<f64>,
    /// The canary's median gap between tokens, for scale (added ≈ hold_back × gap while
    /// the reply is longer than the window).
    pub canary_gap_us_p50: Option<f64>,
}

/// One item's outcome.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ItemReport {
    pub id: String,
    pub play: Option<&'static str>,
    pub canary_correct: bool,
    pub intervene_correct: bool,
    pub intervened: bool,
    pub changed: bool,
    /// Each round's outcome, in order.
    pub rounds: Vec<String>,
    /// The arm that grounded the first intervening round.
    pub arm: Option<String>,
    pub canary_text: String,
    pub intervene_text: String,
    /// Halt or error codes of the two turns.
    pub errors: Vec<String>,
    /// When the first and the last token arrived, µs after the request: canary, intervene.
    pub first_token_us: [Option<f64>; 2],
    pub last_token_us: [Option<f64>; 2],
}

/// One backend's figures.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BackendReport {
    pub backend: String,
    pub continuation: &'static str,
    pub items: usize,
    pub canary_correct: usize,
    pub intervene_correct: usize,
    pub interventions: usize,
    pub interventions_on_wrong: usize,
    /// `interventions_on_wrong / interventions`; null with no intervention.
    pub precision: Option<f64>,
    /// Wrong in the canary, correct in intervene mode.
    pub fixed: usize,
    pub changed: usize,
    pub changed_rate: f64,
    /// Changed, among the items intervened on and among the others.
    pub changed_intervened: usize,
    pub changed_not_intervened: usize,
    pub regressions: usize,
    pub no_regression: bool,
    /// Rounds by outcome, over all items.
    pub rounds: BTreeMap<String, usize>,
    /// Turns that ended in a halt or an error, both modes.
    pub errored_turns: usize,
    /// Arm attempts' latency by arm, and whole rounds'.
    pub arm_latency: BTreeMap<String, Latency>,
    pub round_latency: Latency,
    pub hold_back: HoldBack,
    pub per_item: Vec<ItemReport>,
}

/// Lower case, runs of white space as one space.
fn norm(s: &str) -> String {
    s.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .to_lowercase()
}

pub fn correct(text: &str, answer: &str) -> bool {
    norm(text).contains(&norm(answer))
}

fn rounds(t: &Turn) -> &[Value] {
    t.receipt["rounds"].as_array().map_or(&[], Vec::as_slice)
}

fn intervening(r: &Value) -> bool {
    r["outcome"] == "rewound" || r["outcome"] == "annotated"
}

fn item_report(p: &Pair) -> ItemReport {
    let rs = rounds(&p.intervene);
    let first = rs.iter().find(|r| intervening(r));
    let errors = [&p.canary.error, &p.intervene.error]
        .into_iter()
        .flatten()
        .cloned()
        .collect();
    ItemReport {
        id: p.item.id.clone(),
        play: p.play.map(|pl| pl.as_str()),
        canary_correct: correct(&p.canary.text, &p.item.answer),
        intervene_correct: correct(&p.intervene.text, &p.item.answer),
        intervened: first.is_some(),
        changed: p.canary.text != p.intervene.text,
        rounds: rs
            .iter()
            .map(|r| r["outcome"].as_str().unwrap_or("?").to_owned())
            .collect(),
        arm: first.and_then(|r| r["arm"].as_str().map(str::to_owned)),
        canary_text: p.canary.text.clone(),
        intervene_text: p.intervene.text.clone(),
        errors,
        first_token_us: [&p.canary, &p.intervene].map(|t| t.token_us.first().copied()),
        last_token_us: [&p.canary, &p.intervene].map(|t| t.token_us.last().copied()),
    }
}

fn latencies(pairs: &[Pair]) -> (BTreeMap<String, Latency>, Latency) {
    let mut by_arm: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut whole = Vec::new();
    for r in pairs.iter().flat_map(|p| rounds(&p.intervene)) {
        whole.extend(r["took_ms"].as_u64());
        for a in r["attempts"].as_array().into_iter().flatten() {
            // An arm not configured is `skipped` at once: not a latency of that arm.
            if a["outcome"] == "skipped" {
                continue;
            }
            if let (Some(arm), Some(ms)) = (a["arm"].as_str(), a["took_ms"].as_u64()) {
                by_arm.entry(arm.to_owned()).or_default().push(ms);
            }
        }
    }
    let arms = by_arm
        .into_iter()
        .map(|(k, v)| (k, Latency::of(&v)))
        .collect();
    (arms, Latency::of(&whole))
}

fn hold_back(pairs: &[Pair]) -> HoldBack {
    let same: Vec<&Pair> = pairs
        .iter()
        .filter(|p| rounds(&p.intervene).is_empty())
        .filter(|p| p.canary.error.is_none() && p.intervene.error.is_none())
        .collect();
    let mut added = Vec::new();
    let mut gaps = Vec::new();
    for p in &same {
        let (c, i) = (&p.canary.token_us, &p.intervene.token_us);
        added.extend(c.iter().zip(i).map(|(c, i)| i - c));
        gaps.extend(c.windows(2).map(|w| w[1] - w[0]));
    }
    let mean = (!added.is_empty()).then(|| added.iter().sum::<f64>() / added.len() as f64);
    HoldBack {
        items: same.len(),
        same_text_items: same
            .iter()
            .filter(|p| p.canary.text == p.intervene.text)
            .count(),
        tokens: added.len(),
        added_us_p50: quantile(&added, 0.5),
        added_us_mean: mean,
        canary_gap_us_p50: quantile(&gaps, 0.5),
    }
}

/// The figures of `pairs`, run against `backend`.
pub fn report(backend: &Backend, pairs: &[Pair]) -> BackendReport {
    let per_item: Vec<ItemReport> = pairs.iter().map(item_report).collect();
    let count = |f: &dyn Fn(&ItemReport) -> bool| per_item.iter().filter(|i| f(i)).count();
    let interventions = count(&|i| i.intervened);
    let on_wrong = count(&|i| i.intervened && !i.canary_correct);
    let regressions = count(&|i| i.canary_correct && !i.intervene_correct);
    let changed = count(&|i| i.changed);
    let mut by_outcome = BTreeMap::new();
    for o in per_item.iter().flat_map(|i| &i.rounds) {
        *by_outcome.entry(o.clone()).or_insert(0) += 1;
    }
    let (arm_latency, round_latency) = latencies(pairs);
    BackendReport {
        backend: backend.name(),
        continuation: backend
            .continuation()
            .map_or("built-in (its own)", Continuation::as_str),
        items: per_item.len(),
        canary_correct: count(&|i| i.canary_correct),
        intervene_correct: count(&|i| i.intervene_correct),
        interventions,
        interventions_on_wrong: on_wrong,
        precision: (interventions > 0).then(|| on_wrong as f64 / interventions as f64),
        fixed: count(&|i| !i.canary_correct && i.intervene_correct),
        changed,
        changed_rate: changed as f64 / per_item.len().max(1) as f64,
        changed_intervened: count(&|i| i.changed && i.intervened),
        changed_not_intervened: count(&|i| i.changed && !i.intervened),
        regressions,
        no_regression: regressions == 0,
        rounds: by_outcome,
        errored_turns: per_item.iter().map(|i| i.errors.len()).sum(),
        arm_latency,
        round_latency,
        hold_back: hold_back(pairs),
        per_item,
    }
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "–".to_owned(), |v| v.to_string())
}

/// The reports as a text table, then each backend's arm latencies.
pub fn table(reports: &[BackendReport]) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "{:<24} {:>5} {:>9} {:>9} {:>6} {:>9} {:>5} {:>7} {:>9} {:>5} {:>11} {:>12}",
        "backend",
        "items",
        "canary ok",
        "interv ok",
        "interv",
        "precision",
        "fixed",
        "changed",
        "(not int)",
        "regr",
        "hold p50 µs",
        "hold mean µs"
    );
    for r in reports {
        let _ = writeln!(
            t,
            "{:<24} {:>5} {:>9} {:>9} {:>6} {:>9} {:>5} {:>7} {:>9} {:>5} {:>11} {:>12}",
            r.backend,
            r.items,
            r.canary_correct,
            r.intervene_correct,
            r.interventions,
            opt(r.precision.map(|p| format!("{p:.2}"))),
            r.fixed,
            format!("{:.0} %", r.changed_rate * 100.0),
            r.changed_not_intervened,
            r.regressions,
            opt(r.hold_back.added_us_p50.map(|v| format!("{v:.0}"))),
            opt(r.hold_back.added_us_mean.map(|v| format!("{v:.0}"))),
        );
    }
    for r in reports {
        let _ = write!(t, "\n{}: rounds {:?}; round", r.backend, r.rounds);
        let lat = |l: &Latency| {
            format!(
                " n={} p50={} ms p99={} ms",
                l.n,
                opt(l.p50_ms),
                opt(l.p99_ms)
            )
        };
        t.push_str(&lat(&r.round_latency));
        for (arm, l) in &r.arm_latency {
            let _ = write!(t, "; {arm}{}", lat(l));
        }
        t.push('\n');
    }
    t
}
