//! A smoke run of the grounding A/B harness (`bench-grounding-ab`, issue 16 point 5) on a
//! few items of the shipped prompt set, against the stand-in model in vLLM's continuation
//! shape and against haltd's built-in source: the report it builds must be consistent with
//! its own items, and with what the stand-in was told to play (its ground truth is known:
//! see `haltd_tests::grounding_ab::standin`); the built-in source's grounded replies must be
//! its kept prefix and its resumed text, byte for byte.

use std::collections::BTreeMap;

use anyhow::{ensure, Context, Result};
use haltd::{
    grounding::Snippet,
    source::resume::{BuiltinSource, History},
    wire::{ClientRequest, Endpoint},
};
use haltd_tests::{
    grounding_ab::{
        load_items,
        report::{report, BackendReport, ItemReport},
        run_backend, shipped_set,
        standin::Play,
        Backend, Continuation, Settings,
    },
    haltd_bin, temp_dir,
};
use serde_json::json;

use crate::UPSTREAM_BIN;

const PACE_MS: u64 = 5;

fn settings() -> Result<Settings> {
    Ok(Settings {
        haltd_bin: haltd_bin()?,
        upstream_bin: UPSTREAM_BIN.into(),
        memory_dir: shipped_set().1,
        threshold_bits: 2.0,
        window: 4,
        min_tokens: 2,
        hold_back: 16,
        max_rounds: 2,
        max_tokens: 64,
        pace_ms: PACE_MS,
        reply_tokens: 24,
    })
}

/// The report's counts add up over its `n` items.
fn counts_add_up(r: &BackendReport, json: &serde_json::Value, n: usize) -> Result<()> {
    let items_where = |f: &dyn Fn(&ItemReport) -> bool| r.per_item.iter().filter(|i| f(i)).count();
    ensure!(r.items == n && r.per_item.len() == n, "{json}");
    ensure!(
        r.canary_correct == items_where(&|i| i.canary_correct),
        "{json}"
    );
    ensure!(
        r.intervene_correct == items_where(&|i| i.intervene_correct),
        "{json}"
    );
    ensure!(r.interventions == items_where(&|i| i.intervened), "{json}");
    ensure!(
        r.interventions_on_wrong == items_where(&|i| i.intervened && !i.canary_correct),
        "{json}"
    );
    ensure!(
        r.fixed == items_where(&|i| !i.canary_correct && i.intervene_correct),
        "{json}"
    );
    ensure!(
        r.precision == Some(r.interventions_on_wrong as f64 / r.interventions as f64),
        "{json}"
    );
    ensure!(
        r.changed == r.changed_intervened + r.changed_not_intervened,
        "{json}"
    );
    ensure!(
        r.intervene_correct == r.canary_correct + r.fixed - r.regressions,
        "{json}"
    );
    let mut outcomes = BTreeMap::new();
    for o in r.per_item.iter().flat_map(|i| &i.rounds) {
        *outcomes.entry(o.clone()).or_insert(0) += 1;
    }
    ensure!(outcomes == r.rounds, "{json}");
    ensure!(
        r.round_latency.n == r.rounds.values().sum::<usize>(),
        "{json}"
    );
    Ok(())
}

#[test]
fn the_ab_harness_reports_consistent_figures_on_the_stand_in() -> Result<()> {
    // Plays by position: wrong, right, right but surprised, wrong (memory items), then a
    // right tool item.
    let all = load_items(&shipped_set().0)?;
    let items: Vec<_> = all[..4].iter().chain(&all[7..8]).cloned().collect();
    let backend = Backend::StandIn(Continuation::Vllm);
    let pairs = run_backend(&backend, &settings()?, &items, &temp_dir("ab")?)?;
    let r = report(&backend, &pairs);
    let json = serde_json::to_value(&r)?;
    ensure!(
        json["per_item"].as_array().map(Vec::len) == Some(5),
        "{json}"
    );

    counts_add_up(&r, &json, 5)?;

    // The stand-in's ground truth: wrong plays are wrong in the canary, intervened on (by
    // memory, the store holds their facts) and fixed; right plays stay right.
    ensure!(
        r.interventions >= 1 && r.no_regression && r.regressions == 0,
        "{json}"
    );
    for (i, it) in r.per_item.iter().enumerate() {
        let play = pairs[i].play.context("a stand-in play")?;
        ensure!(it.errors.is_empty(), "{json}");
        match play {
            Play::Wrong => ensure!(
                !it.canary_correct
                    && it.intervened
                    && it.intervene_correct
                    && it.changed
                    && it.arm.as_deref() == Some("memory"),
                "{}: {json}",
                it.id
            ),
            Play::Right => ensure!(
                it.canary_correct && !it.intervened && !it.changed && it.rounds.is_empty(),
                "{}: {json}",
                it.id
            ),
            Play::RightSurprised => ensure!(
                it.canary_correct && !it.rounds.is_empty() && it.intervene_correct,
                "{}: {json}",
                it.id
            ),
        }
    }
    ensure!(r.fixed == 2 && r.changed_not_intervened == 0, "{json}");
    ensure!(r.arm_latency["memory"].n >= 3, "{json}");

    // The hold-back window: the right plays (no round) reach the client later in intervene
    // mode; a token is held until 16 more have come (at least 5 ms apart), or the end.
    let hb = &r.hold_back;
    ensure!(
        hb.items == 2 && hb.same_text_items == 2 && hb.tokens == 48,
        "{json}"
    );
    let added = hb.added_us_p50.context("no hold-back figure")?;
    ensure!(added >= 4.0 * PACE_MS as f64 * 1000.0, "{json}");
    Ok(())
}

/// What the built-in source says for `prompt` (the harness's request body, restating the
/// question) when a round keeps `kept` bytes, drops `rewound` tokens and resumes with
/// `evidence`: computed in-process with the same model.
fn builtin_resumed(
    prompt: &str,
    kept: usize,
    rewound: usize,
    evidence: &[Snippet],
) -> Result<String> {
    let body = json!({"model": "builtin", "stream": true, "max_tokens": 64, "temperature": 0,
        "seed": 7, "messages": [{"role": "user", "content": prompt}]});
    let req = ClientRequest::parse(Endpoint::Chat, body.to_string().as_bytes())
        .and_then(|r| r.builtin_turn("builtin"))
        .map_err(|e| anyhow::anyhow!("{}", e.message))?;
    let mut src = BuiltinSource::for_turn(&req, true);
    src.history = History::with_capacity(65);
    crate::intervene::resumed_from(src, kept, rewound, evidence)
}

#[test]
fn the_ab_harness_grounds_the_built_in_source_through_its_rewind() -> Result<()> {
    // Two memory and two tool items the built-in source gets wrong and grounding fixes
    // (measured: docs/bench.md, "Grounding A/B"), and one whose reply never breaches.
    let ids = [
        "mem-altitude",
        "mem-kestrel-watchdog",
        "tool-mul",
        "tool-percent",
        "mem-ferry-time",
    ];
    let items: Vec<_> = load_items(&shipped_set().0)?
        .into_iter()
        .filter(|i| ids.contains(&i.id.as_str()))
        .collect();
    let backend = Backend::Builtin;
    // One round at most: the resumed text is then the evidence read and the model salted
    // by it, which this test computes.
    let s = Settings {
        max_rounds: 1,
        ..settings()?
    };
    let pairs = run_backend(&backend, &s, &items, &temp_dir("ab-builtin")?)?;
    let r = report(&backend, &pairs);
    let json = serde_json::to_value(&r)?;
    counts_add_up(&r, &json, 5)?;
    ensure!(
        r.fixed >= 1 && r.no_regression && r.regressions == 0 && r.changed_not_intervened == 0,
        "{json}"
    );
    for (it, pair) in r.per_item.iter().zip(&pairs) {
        ensure!(it.errors.is_empty(), "{}: {json}", it.id);
        // The model restates the question (its `?` dropped), then babbles: it knows nothing.
        let question = format!(" {}", pair.item.prompt.trim_end_matches('?'));
        ensure!(pair.canary.text.starts_with(&question), "{}: {json}", it.id);
        ensure!(!it.canary_correct, "{}: {json}", it.id);
        if !it.intervened {
            ensure!(pair.intervene.text == pair.canary.text, "{}: {json}", it.id);
            continue;
        }
        // The round's receipt names the arm that grounded it: the memory store for the
        // invented facts, the evaluator for the arithmetic.
        let arm = if pair.item.kind == "memory" {
            "memory"
        } else {
            "tool"
        };
        ensure!(it.arm.as_deref() == Some(arm), "{}: {json}", it.id);
        let round = &pair.intervene.receipt["rounds"][0];
        ensure!(
            round["outcome"] == "rewound" && round["arm"] == arm,
            "{}: {round}",
            it.id
        );
        // The splice, byte for byte: the kept prefix (the canary's, the same model), then
        // the evidence's words, then the model salted by them.
        let kept = round["kept_bytes"].as_u64().context("kept_bytes")? as usize;
        let rewound = round["rewound_tokens"].as_u64().context("rewound")? as usize;
        let snippets = crate::intervene::evidence(round);
        let expected = builtin_resumed(&pair.item.prompt, kept, rewound, &snippets)?;
        ensure!(
            pair.intervene.text == expected,
            "{}: client text {:?}\n expected {expected:?}",
            it.id,
            pair.intervene.text
        );
        let read: String = snippets[0]
            .evidence
            .split_whitespace()
            .map(|w| format!(" {w}"))
            .collect();
        ensure!(
            pair.canary.text.get(..kept) == expected.get(..kept)
                && expected[kept..].starts_with(&read),
            "{}: {json}",
            it.id
        );
        ensure!(it.intervene_correct, "{}: {json}", it.id);
    }
    Ok(())
}
