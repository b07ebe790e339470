use super::*;
use crate::source::{resume::BuiltinSource, Peek, Polled, TokenSource};

fn generate(prompt: &str, seed: Option<u64>, max: u32) -> (Vec<TokenSample>, FinishReason) {
    let mut s = BuiltinModel::get().stream(prompt, seed, max);
    let mut out = Vec::new();
    while let Some(t) = s.next_token(5) {
        out.push(t);
    }
    assert_eq!(s.tokens_generated() as usize, out.len());
    (out, s.finish_reason().expect("finished"))
}

fn text(tokens: &[TokenSample]) -> String {
    tokens.iter().map(|t| t.text).collect()
}

#[test]
fn deterministic_for_same_prompt_and_seed() {
    for seed in [None, Some(0), Some(42), Some(u64::MAX)] {
        let (a, fa) = generate("hello", seed, 200);
        let (b, fb) = generate("hello", seed, 200);
        assert_eq!(text(&a), text(&b));
        assert_eq!(fa, fb);
        let la: Vec<f32> = a.iter().map(|t| t.logprob).collect();
        let lb: Vec<f32> = b.iter().map(|t| t.logprob).collect();
        assert_eq!(la, lb);
    }
}

#[test]
fn a_peek_is_the_next_poll_whatever_the_alternatives() {
    // Every token, the end by length and by the model's own stop: the peeked text is what
    // the next poll returns, and peeking (any number of times) changes nothing.
    for (seed, max, ignore_eos) in [(1, 40, true), (2, 400, false), (3, 1, false)] {
        let stream = || {
            BuiltinModel::get()
                .stream("Explain the tides", Some(seed), max)
                .with_ignore_eos(ignore_eos)
        };
        let mut plain = stream();
        let mut src = BuiltinSource {
            stream: stream(),
            top_n: 5,
            history: Default::default(),
            reading: Default::default(),
        };
        // The peek as owned text (`None`: the end).
        let peek = |src: &mut BuiltinSource| match src.peek() {
            Peek::Text(t) => Some(t.to_owned()),
            Peek::End => None,
            Peek::Unknown => panic!("the built-in model always knows"),
        };
        loop {
            let peeked = peek(&mut src);
            assert_eq!(peek(&mut src), peeked);
            let expected = plain.next_token(0).map(|t| t.text);
            match (src.poll(), expected) {
                (Polled::Text(p), Some(t)) => {
                    assert_eq!(peeked.as_deref(), Some(t));
                    assert_eq!(p.text, t);
                }
                (Polled::End, None) => {
                    assert_eq!(peeked, None);
                    break;
                }
                (got, want) => panic!("{got:?} vs {want:?}"),
            }
        }
        assert_eq!(src.stream.finish_reason(), plain.finish_reason());
    }
}

#[test]
fn different_seeds_and_prompts_differ() {
    let base = text(&generate("hello", Some(1), 60).0);
    let distinct_seeds = (2..12)
        .filter(|s| text(&generate("hello", Some(*s), 60).0) != base)
        .count();
    assert!(
        distinct_seeds >= 9,
        "only {distinct_seeds} of 10 seeds differ"
    );
    let distinct_prompts = ["a", "b", "tell me about rivers", "tea?", ""]
        .iter()
        .filter(|p| text(&generate(p, Some(1), 60).0) != base)
        .count();
    assert!(distinct_prompts >= 4);
}

#[test]
fn probabilities_are_real() {
    for seed in 0..50 {
        let mut s = BuiltinModel::get().stream("probabilities", Some(seed), 100);
        while let Some(t) = s.next_token(MAX_TOP_LOGPROBS) {
            assert!(t.logprob <= 0.0 && t.logprob.is_finite(), "{t:?}");
            let top = t.top.as_slice();
            assert!(!top.is_empty());
            let mass: f64 = top.iter().map(|(_, lp)| f64::from(*lp).exp()).sum();
            assert!(mass <= 1.0 + 1e-5, "top mass {mass}");
            assert!(
                top.windows(2).all(|w| w[0].1 >= w[1].1),
                "not sorted: {top:?}"
            );
            // The sampled token's logprob is its entry in the same distribution.
            if let Some((_, lp)) = top.iter().find(|(tx, _)| *tx == t.text) {
                assert_eq!(*lp, t.logprob);
            } else {
                // Not among the top: then it is no more likely than the least likely shown.
                assert_eq!(top.len(), MAX_TOP_LOGPROBS);
                assert!(t.logprob <= top[top.len() - 1].1);
            }
        }
    }
}

#[test]
fn distribution_sums_to_one() {
    let m = BuiltinModel::get();
    for u in 0..m.vocab.len() as u32 {
        for v in 1..m.vocab.len() as u32 {
            if u != BOS && v == BOS {
                continue;
            }
            let d = Distribution::new(m, (u, v));
            let mut total = 0.0;
            d.for_each(|_, p| total += p);
            assert!((total - 1.0).abs() < 1e-9, "({u},{v}) sums to {total}");
        }
    }
}

#[test]
fn top_n_honoured() {
    let mut s = BuiltinModel::get().stream("top", Some(3), 30);
    for n in [0, 1, 3, 20, 50] {
        let t = s.next_token(n).expect("token");
        assert!(t.top.len() <= n.min(MAX_TOP_LOGPROBS));
        if n == 0 {
            assert!(t.top.is_empty());
        }
    }
}

#[test]
fn ignore_eos_runs_to_max_tokens_with_a_renormalised_distribution() {
    for seed in 0..10 {
        let mut s = BuiltinModel::get()
            .stream("limits", Some(seed), 600)
            .with_ignore_eos(true);
        let mut n = 0;
        while let Some(t) = s.next_token(MAX_TOP_LOGPROBS) {
            assert!(t.logprob <= 0.0);
            let mass: f64 = t
                .top
                .as_slice()
                .iter()
                .map(|(_, lp)| f64::from(*lp).exp())
                .sum();
            assert!(mass <= 1.0 + 1e-4, "alternatives sum to {mass}");
            n += 1;
        }
        assert_eq!(n, 600);
        assert_eq!(s.finish_reason(), Some(FinishReason::Length));
    }
}

#[test]
fn max_tokens_honoured() {
    for max in [0, 1, 2, 7, 40] {
        for seed in 0..20 {
            let (toks, finish) = generate("limits", Some(seed), max);
            assert!(toks.len() <= max as usize);
            if toks.len() < max as usize {
                assert_eq!(finish, FinishReason::Stop);
            } else {
                assert_eq!(finish, FinishReason::Length);
            }
        }
    }
    let mut s = BuiltinModel::get().stream("x", None, 0);
    assert!(s.next_token(3).is_none());
    assert_eq!(s.finish_reason(), Some(FinishReason::Length));
    assert!(s.next_token(3).is_none());
}

#[test]
fn stops_by_itself() {
    let stops = (0..50)
        .filter(|s| generate("stop", Some(*s), 10_000).1 == FinishReason::Stop)
        .count();
    assert_eq!(stops, 50);
    // A natural stop comes after a sentence end.
    let (toks, _) = generate("stop", Some(7), 10_000);
    let last = toks.last().expect("some tokens").text;
    assert!([".", "!", "?"].contains(&last), "ended on {last:?}");
}

#[test]
fn tokens_look_like_words() {
    for seed in 0..30 {
        let (toks, _) = generate("words", Some(seed), 200);
        for t in &toks {
            assert!(!t.text.is_empty());
            let is_word = t.text.starts_with(' ')
                && t.text.len() > 1
                && t.text[1..]
                    .chars()
                    .all(|c| c.is_alphanumeric() || c == '\'' || c == '-');
            let is_punct =
                t.text.len() == 1 && PUNCTUATION.contains(&(t.text.as_bytes()[0] as char));
            assert!(is_word || is_punct, "odd token {:?}", t.text);
            for (alt, _) in t.top.as_slice() {
                assert!(!alt.is_empty());
            }
        }
    }
}

#[test]
fn first_token_starts_a_sentence() {
    for seed in 0..20 {
        let (toks, _) = generate("start", Some(seed), 1);
        let first = toks[0].text;
        assert!(first[1..].starts_with(char::is_uppercase), "{first:?}");
    }
}

#[test]
fn tokenizer_counts() {
    let m = BuiltinModel::get();
    assert_eq!(m.count_tokens("Hello, world."), 4);
    assert_eq!(m.count_tokens(""), 0);
    assert_eq!(m.count_tokens("it's a well-known river!"), 5);
    assert!(m.vocab_size() > 200);
    assert_eq!(FinishReason::Stop.as_str(), "stop");
    assert_eq!(FinishReason::Length.as_str(), "length");
}

/// The proxy splits tokens longer than the frame cap; the built-in source needs no
/// splitting: every token it can emit (its vocabulary, alternatives included) fits one
/// frame, so its token frames stay within `ChunkEncoder::max_event_bytes`.
#[test]
fn every_vocabulary_token_fits_one_frame() {
    let m = BuiltinModel::get();
    let longest = m.vocab.iter().map(|t| t.len()).max().unwrap_or(0);
    assert!(
        longest <= crate::wire::MAX_TOKEN_TEXT_BYTES,
        "a built-in token of {longest} bytes"
    );
    assert!(longest > 8, "the vocabulary has real words: {longest}");
}

#[test]
fn top_logprobs_insertion_keeps_order() {
    let mut t = TopLogprobs::new();
    for (i, lp) in [-3.0f32, -1.0, -2.0, -1.0, -0.5, -4.0]
        .into_iter()
        .enumerate()
    {
        let names = ["a", "b", "c", "d", "e", "f"];
        t.offer(4, names[i], lp);
    }
    assert_eq!(
        t.as_slice(),
        &[("e", -0.5), ("b", -1.0), ("d", -1.0), ("c", -2.0)]
    );
}

#[test]
fn temperature_one_is_the_plain_stream_and_raised_temperature_is_more_surprising() {
    let run = |t: Option<f64>, seed: u64| {
        let mut s = BuiltinModel::get()
            .stream("temperature", Some(seed), 200)
            .with_ignore_eos(true);
        if let Some(t) = t {
            s.set_temperature(t);
        }
        let mut out = Vec::new();
        while let Some(tok) = s.next_token(MAX_TOP_LOGPROBS) {
            // The reported logprob is still the model's own: its entry among the
            // alternatives, when it is there.
            if let Some((_, lp)) = tok.top.as_slice().iter().find(|(tx, _)| *tx == tok.text) {
                assert_eq!(*lp, tok.logprob);
            }
            assert!(tok.logprob <= 0.0 && tok.logprob.is_finite());
            out.push((tok.text, tok.logprob));
        }
        out
    };
    let mut plain = 0.0;
    let mut hot = 0.0;
    for seed in 0..20 {
        let a = run(None, seed);
        assert_eq!(a, run(Some(1.0), seed));
        // Not finite or not positive: ignored.
        assert_eq!(a, run(Some(f64::NAN), seed));
        assert_eq!(a, run(Some(0.0), seed));
        plain += a.iter().map(|(_, lp)| -f64::from(*lp)).sum::<f64>();
        hot += run(Some(2.5), seed)
            .iter()
            .map(|(_, lp)| -f64::from(*lp))
            .sum::<f64>();
    }
    assert!(hot > 1.3 * plain, "hot {hot} vs plain {plain}");
}

/// Prints a sample for eyeballing: `cargo test -p haltd builtin_sample -- --nocapture`.
#[test]
fn builtin_sample() {
    let (toks, finish) = generate("Tell me about the node.", Some(42), 40);
    println!("{}", text(&toks));
    for t in &toks {
        println!("{:>14?} {:8.4}", t.text, t.logprob);
    }
    println!("finish: {finish}");
}
