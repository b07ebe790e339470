//! Tests of the exfiltration scanner: one module per concern, shared rules and helpers here.

use super::*;
use proptest::prelude::*;
use std::sync::{Arc, LazyLock};

const CUSTOM: &str = r"ACME-[0-9]{8}";

static RULES: LazyLock<Arc<ExfilRules>> = LazyLock::new(|| {
    let cfg = ExfilConfig {
        extra_patterns: vec![CUSTOM.to_owned()],
        ..ExfilConfig::default()
    };
    Arc::new(ExfilRules::new(&cfg).expect("default rules build"))
});

/// What scanning `chunks` produced.
#[derive(Debug, Default)]
struct Outcome {
    /// Released bytes (absolute) after each push, before the first breach.
    released_before_breach: usize,
    hits: Vec<ExfilHit>,
    released_total: usize,
    max_held_after_release: usize,
    held_per_push: Vec<usize>,
}

fn scan_chunks<'a>(rules: &Arc<ExfilRules>, chunks: impl IntoIterator<Item = &'a str>) -> Outcome {
    let chunks: Vec<&str> = chunks.into_iter().collect();
    scan_chunks_with(rules, &chunks, false)
}

/// [`scan_chunks`], and with `ahead`, after each push that releases, a
/// [`ExfilScanner::look_ahead`] at the next chunk (or the end): what the data plane does with
/// the built-in model. `held_per_push` is then what is held after the look-ahead.
fn scan_chunks_with(rules: &Arc<ExfilRules>, chunks: &[&str], ahead: bool) -> Outcome {
    let mut sc = ExfilScanner::new(Arc::clone(rules));
    let mut out = Outcome::default();
    let mut released = 0;
    let mut step = |st: ExfilStep, out: &mut Outcome, held: usize, from_push: bool| match st {
        ExfilStep::Release(n) => {
            released += n;
            if out.hits.is_empty() {
                out.released_before_breach = released;
            }
            if from_push {
                out.max_held_after_release = out.max_held_after_release.max(held);
                out.held_per_push.push(held);
            }
            true
        }
        ExfilStep::Breach(h) => {
            out.hits.push(h);
            false
        }
    };
    for (i, c) in chunks.iter().enumerate() {
        let mut st = sc.push(c);
        if ahead {
            if let ExfilStep::Release(n) = st {
                let next = chunks.get(i + 1).map_or(Ahead::End, |t| Ahead::Text(t));
                st = ExfilStep::Release(n + sc.look_ahead(next));
            }
        }
        let held = sc.held_bytes();
        if !step(st, &mut out, held, true) {
            // Drain further breaches decided by the same bytes.
            while !step(sc.push(""), &mut out, sc.held_bytes(), true) {}
        }
    }
    loop {
        let st = sc.finish();
        if step(st, &mut out, 0, false) {
            break;
        }
    }
    assert_eq!(sc.held_bytes(), 0);
    out.released_total = released;
    out
}

fn scan_all(text: &str) -> Outcome {
    scan_chunks(&RULES, [text])
}

fn bytewise(text: &str) -> Vec<&str> {
    let mut v = Vec::new();
    let mut last = 0;
    for (i, _) in text.char_indices().skip(1) {
        v.push(&text[last..i]);
        last = i;
    }
    v.push(&text[last..]);
    v
}

/// Asserts `secret` inside `text` is found by `rule` (possibly after another rule that
/// also matches), byte by byte and at once, and that nothing from the secret's start on was
/// released before the first breach.
fn assert_secret(text: &str, secret: &str, rule: &str) {
    let at = text.find(secret).expect("secret in text");
    for out in [scan_all(text), scan_chunks(&RULES, bytewise(text))] {
        let first = out
            .hits
            .first()
            .unwrap_or_else(|| panic!("no breach in {text:?}"));
        assert!(
            out.released_before_breach <= first.start.min(at),
            "{text:?}: released {}",
            out.released_before_breach
        );
        let hit = out
            .hits
            .iter()
            .find(|h| h.rule == rule)
            .unwrap_or_else(|| panic!("{text:?}: {rule} not in {:?}", out.hits));
        assert!(
            hit.start <= at && at < hit.start + hit.len,
            "{hit:?} vs {at}"
        );
    }
}

fn assert_innocent(text: &str) {
    for out in [scan_all(text), scan_chunks(&RULES, bytewise(text))] {
        assert!(out.hits.is_empty(), "{text:?}: {:?}", out.hits);
        assert_eq!(out.released_total, text.len());
    }
}

mod ahead;
mod measure;
mod props;
mod rules;
