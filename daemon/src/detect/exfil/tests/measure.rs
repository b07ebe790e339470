//! Measurements (ignored): hold-back on the corpus, the cost per token.

use super::*;

// ---- measurements (cargo test --release -p haltd exfil -- --ignored --nocapture) ----

const CORPUS: &str = include_str!("../../../source/corpus.txt");

fn percentiles(mut v: Vec<usize>) -> (usize, usize, usize) {
    v.sort_unstable();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99), v[v.len() - 1])
}

fn words(text: &str) -> Vec<&str> {
    text.split_inclusive(char::is_whitespace).collect()
}

const CODE: &str = "fn main() {\n    let token = next_token(&mut lexer);\n    let password = std::env::var(\"DB_PASSWORD\").unwrap_or_default();\n    // the api_key is read from the vault: secret = vault.get(\"api_key\")\n    println!(\"tokens: {} in {:?}\", count, elapsed);\n    let id = \"123e4567-e89b-12d3-a456-426614174000\"; // request id, sha 3f9a2c1\n}\n";

/// The built-in model's text as the data plane gets it: `ignore_eos` streams of 400 tokens
/// over a few prompts and seeds. Ordinary text: no rule matches it (checked where it is
/// scanned).
fn builtin_streams(streams: u64) -> Vec<Vec<&'static str>> {
    use crate::source::builtin::BuiltinModel;
    let model = BuiltinModel::get();
    (0..streams)
        .map(|seed| {
            let prompt =
                ["Tell me about rivers", "Explain the tides", "Write a story"][(seed % 3) as usize];
            let mut stream = model.stream(prompt, Some(seed), 400).with_ignore_eos(true);
            std::iter::from_fn(|| stream.next_token(0).map(|t| t.text)).collect()
        })
        .collect()
}

/// How many built-in tokens leave text held, of how many.
#[derive(Debug, Clone, Copy)]
struct HeldShare {
    tokens: usize,
    /// After the token's push: each such token would wait for the next one before it is sent
    /// (the data plane releases whole tokens).
    after_push: usize,
    /// After the push and a look-ahead at the next token (or the end of the text), as the
    /// data plane does for the built-in model: each such token does wait for the next one.
    after_look_ahead: usize,
}

impl HeldShare {
    fn pct(n: usize, of: usize) -> f64 {
        100.0 * n as f64 / of as f64
    }
}

/// The share of the built-in model's tokens after which the scanner (with `rules`) still
/// holds text, without and with the look-ahead.
fn builtin_tokens_left_held(rules: &Arc<ExfilRules>, streams: u64) -> HeldShare {
    let mut share = HeldShare {
        tokens: 0,
        after_push: 0,
        after_look_ahead: 0,
    };
    let mut sc = ExfilScanner::new(Arc::clone(rules));
    for toks in builtin_streams(streams) {
        sc.reset();
        for (i, tok) in toks.iter().enumerate() {
            assert!(matches!(sc.push(tok), ExfilStep::Release(_)));
            share.tokens += 1;
            share.after_push += usize::from(sc.held_bytes() > 0);
            let next = toks.get(i + 1).map_or(Ahead::End, |t| Ahead::Text(t));
            sc.look_ahead(next);
            share.after_look_ahead += usize::from(sc.held_bytes() > 0);
        }
        assert_eq!(sc.finish(), ExfilStep::Release(0));
    }
    share
}

/// The default rules (no custom pattern): what haltd runs unless configured otherwise.
fn default_rules() -> Arc<ExfilRules> {
    Arc::new(ExfilRules::new(&ExfilConfig::default()).expect("default rules build"))
}

/// Few built-in tokens leave text held after their push: 6.0 % of 51,200
/// (`holdback_distribution_on_corpus`), down from 61 % before the letter-starting rules got
/// their look-behind. What remains is mostly the article ` a` / ` A` (which could begin
/// `api_key`, `aws`, `AKIA`...) and ` to` (`token`): held until the next byte rules them out.
#[test]
fn few_builtin_tokens_leave_text_held() {
    let s = builtin_tokens_left_held(&RULES, 16);
    let share = s.after_push as f64 / s.tokens as f64;
    assert!(
        share <= 0.07,
        "{} of {} built-in tokens left text held ({:.1} %)",
        s.after_push,
        s.tokens,
        share * 100.0
    );
}

/// With the look-ahead at the next token, at most 5 % of the built-in model's tokens wait
/// for the next one (issue 11): with the rules the tests use and with the default ones.
#[test]
fn at_most_five_percent_of_builtin_tokens_wait_with_the_look_ahead() {
    for rules in [Arc::clone(&RULES), default_rules()] {
        let s = builtin_tokens_left_held(&rules, 16);
        assert!(s.after_look_ahead <= s.after_push, "{s:?}");
        assert!(
            HeldShare::pct(s.after_look_ahead, s.tokens) <= 5.0,
            "{} of {} built-in tokens wait for the next one ({:.1} %)",
            s.after_look_ahead,
            s.tokens,
            HeldShare::pct(s.after_look_ahead, s.tokens)
        );
    }
}

#[test]
#[ignore = "measurement: prints the hold-back distribution"]
fn holdback_distribution_on_corpus() {
    for (name, text) in [
        ("corpus.txt", CORPUS.to_owned()),
        ("code-like", CODE.repeat(20)),
    ] {
        let toks = words(&text);
        let out = scan_chunks(&RULES, toks.iter().copied());
        assert!(out.hits.is_empty(), "{:?}", out.hits);
        let held = out.held_per_push.clone();
        let nonzero = held.iter().filter(|&&h| h > 0).count();
        let (p50, p99, max) = percentiles(held);
        println!(
                "exfil hold-back over {name} ({} tokens): held bytes after each token p50={p50} p99={p99} max={max}; tokens leaving text held: {nonzero} ({:.1}%)",
                toks.len(),
                100.0 * nonzero as f64 / toks.len() as f64
            );
    }
    for (name, rules) in [
        ("built-in rules + 1 custom", Arc::clone(&RULES)),
        ("default rules", default_rules()),
    ] {
        let s = builtin_tokens_left_held(&rules, 128);
        println!(
            "exfil hold-back over the built-in model ({name}, {} tokens): tokens leaving text held after their push: {} ({:.1}%); after the look-ahead at the next token: {} ({:.1}%)",
            s.tokens,
            s.after_push,
            HeldShare::pct(s.after_push, s.tokens),
            s.after_look_ahead,
            HeldShare::pct(s.after_look_ahead, s.tokens)
        );
    }
    println!(
        "bound: max_match_len={} max_holdback_bytes={} dfa={} bytes",
        RULES.max_match_len(),
        RULES.max_holdback_bytes(),
        RULES.dfa_memory_usage()
    );
}

/// The texts `push_cost_per_token` measures, each cut into tokens.
fn cost_cases() -> Vec<(&'static str, Vec<String>)> {
    let secrets = "password=Xk9#mP2vR7qL4wZ8tN3s and AKIAIOSFODNN7EXAMPLE and eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.abc ";
    let fixed = |text: &str, n: usize| -> Vec<String> {
        text.as_bytes()
            .chunks(n)
            .map(|c| String::from_utf8_lossy(c).into_owned())
            .collect()
    };
    vec![
        (
            "corpus.txt, words",
            words(CORPUS).into_iter().map(str::to_owned).collect(),
        ),
        (
            "code-like, words",
            words(&CODE.repeat(5))
                .into_iter()
                .map(str::to_owned)
                .collect(),
        ),
        (
            "base64 blob, 4-byte tokens",
            fixed(&"TWFueSBoYW5kcyBtYWtlIGxpZ2h0IHdvcmsu".repeat(40), 4),
        ),
        (
            "key words, words",
            words(&"token tokens password secret key is = ".repeat(40))
                .into_iter()
                .map(str::to_owned)
                .collect(),
        ),
        // Worst case found for the built-in rules: every "token" keeps a candidate alive.
        (
            "tokentoken..., 5-byte tokens",
            fixed(&"token".repeat(200), 5),
        ),
        (
            "corpus + secrets (observe mode)",
            words(&format!("{CORPUS}{}", secrets.repeat(10)))
                .into_iter()
                .map(str::to_owned)
                .collect(),
        ),
    ]
}

/// Times pushing `toks` through a scanner: the mean per token, and the distribution of
/// single pushes.
fn print_push_cost(name: &str, toks: &[String]) {
    use std::time::Instant;
    let mut sc = ExfilScanner::new(Arc::clone(&RULES));
    let rounds = 300;
    // Mean per token without per-token timers: the median over rounds of the round's
    // time / tokens (the median, so that a preempted round does not count).
    let mut per_round = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t0 = Instant::now();
        sc.reset();
        for t in toks {
            std::hint::black_box(sc.push(t));
        }
        std::hint::black_box(sc.finish());
        per_round.push(t0.elapsed().as_nanos() as usize / toks.len());
    }
    let (mean, _, _) = percentiles(per_round);
    // Distribution, timing each push (includes ~20-40 ns of timer overhead).
    let mut samples = Vec::with_capacity(rounds * toks.len());
    for _ in 0..rounds {
        sc.reset();
        for t in toks {
            let s = Instant::now();
            std::hint::black_box(sc.push(t));
            samples.push(s.elapsed().as_nanos() as usize);
        }
        std::hint::black_box(sc.finish());
    }
    let (p50, p99, _) = percentiles(samples.clone());
    samples.sort_unstable();
    let p999 = samples[(samples.len() - 1) * 999 / 1000];
    println!(
            "exfil push cost, {name} ({} tokens x {rounds}): mean {mean} ns/token; timed per push p50={p50} ns p99={p99} ns p99.9={p999} ns",
            toks.len()
        );
}

#[test]
#[ignore = "measurement: prints the push cost per token (run in release mode)"]
fn push_cost_per_token() {
    use std::time::Instant;
    for (name, toks) in &cost_cases() {
        print_push_cost(name, toks);
    }
    let t0 = Instant::now();
    for _ in 0..10_000 {
        std::hint::black_box(ExfilScanner::new(Arc::clone(&RULES)));
    }
    println!(
        "exfil ExfilScanner::new: {:.0} ns",
        t0.elapsed().as_nanos() as f64 / 10_000.0
    );
    let t0 = Instant::now();
    let rules = ExfilRules::new(&ExfilConfig::default()).expect("rules");
    println!(
        "exfil ExfilRules::new (default): {:?}, DFA {} bytes",
        t0.elapsed(),
        rules.dfa_memory_usage()
    );
}
