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

/// Share of the built-in model's tokens (`ignore_eos` streams of 400 tokens over many
/// prompts and seeds) after which the scanner still holds text: each such token waits for
/// the next one before it is sent (the data plane releases whole tokens).
fn builtin_tokens_left_held(streams: u64) -> (usize, usize) {
    use crate::source::builtin::BuiltinModel;
    let model = BuiltinModel::get();
    let (mut tokens, mut held) = (0, 0);
    for seed in 0..streams {
        let prompt =
            ["Tell me about rivers", "Explain the tides", "Write a story"][(seed % 3) as usize];
        let mut stream = model.stream(prompt, Some(seed), 400).with_ignore_eos(true);
        let mut sc = ExfilScanner::new(Arc::clone(&RULES));
        while let Some(tok) = stream.next_token(0) {
            assert!(matches!(sc.push(tok.text), ExfilStep::Release(_)));
            tokens += 1;
            held += usize::from(sc.held_bytes() > 0);
        }
    }
    (tokens, held)
}

/// Few built-in tokens leave text held: 6.0 % of 51,200 (`holdback_distribution_on_corpus`),
/// down from 61 % before the letter-starting rules got their look-behind. What remains is
/// mostly the article ` a` / ` A` (which could begin `api_key`, `aws`, `AKIA`...) and ` to`
/// (`token`): held until the next byte rules them out.
#[test]
fn few_builtin_tokens_leave_text_held() {
    let (tokens, held) = builtin_tokens_left_held(16);
    let share = held as f64 / tokens as f64;
    assert!(
        share <= 0.07,
        "{held} of {tokens} built-in tokens left text held ({:.1} %)",
        share * 100.0
    );
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
    let (tokens, held) = builtin_tokens_left_held(128);
    println!(
            "exfil hold-back over the built-in model ({tokens} tokens): tokens leaving text held: {held} ({:.1}%)",
            100.0 * held as f64 / tokens as f64
        );
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
