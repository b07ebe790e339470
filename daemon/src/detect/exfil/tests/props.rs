//! Property tests: innocent text passes, secrets never pass, chunking does not matter.

use super::*;

// ---- property tests ----

const WORDS: &[&str] = &[
    "the",
    "model",
    "reads",
    "a",
    "prompt",
    "and",
    "chooses",
    "next",
    "word",
    "token",
    "tokens",
    "password",
    "secret",
    "key",
    "api_key",
    "is",
    "=",
    ":",
    "Bearer",
    "bearer",
    "AKIA",
    "ASIA",
    "ghp_",
    "github_pat_",
    "sk-",
    "sk_live_",
    "xoxb-",
    "eyJ",
    "eyJhbGciOiJIUzI1Ni",
    "-----BEGIN",
    "-----BEGIN RSA PRIVATE KEY-----",
    "-----BEGIN PUBLIC KEY-----",
    "PRIVATE",
    "KEY-----",
    "AccountKey=",
    "Authorization:",
    "\"private_key\":",
    "aws_secret",
    "fn",
    "let",
    "mut",
    "x = 42;",
    "foo_bar(baz)",
    "{",
    "}",
    "->",
    "0x1f3a",
    "a3f9c2",
    "deadbeef",
    "v1.2.3",
    "naïve",
    "東京",
    "µs",
    "—",
    "README.md",
    "/usr/bin/env",
    "ACME-",
    "ACME-1234",
    "12:30",
    "e3b0c442",
    "MIIEow",
    "https://example.com/a?b=c",
    "get_secret()",
    "hunter2",
];

fn innocent_text() -> impl Strategy<Value = String> {
    let word = prop_oneof![
        4 => proptest::sample::select(WORDS).prop_map(str::to_owned),
        1 => "[0-9]{1,30}",
        1 => "[a-z]{1,12}",
        1 => "[0-9a-f]{4,12}",
    ];
    let sep = proptest::sample::select(&[" ", " ", " ", "\n", ", ", ". ", " = ", ": ", "\t"][..]);
    proptest::collection::vec((word, sep), 0..120).prop_map(|v| {
        v.into_iter().fold(String::new(), |mut s, (w, sep)| {
            s.push_str(&w);
            s.push_str(sep);
            s
        })
    })
}

/// A random secret for a random rule (all of them, the custom one included), as (label,
/// value): the label (a key word, a header name) may be released, the value never.
fn secret() -> impl Strategy<Value = (String, String)> {
    let core = "Qx7pL2vR9mZ4kT8w"; // guarantees a letter, a digit and the entropy
    let bare = |re: &'static str| re.prop_map(|v: String| (String::new(), v));
    let labelled =
        |label: &'static str, re: &'static str| re.prop_map(move |v: String| (label.to_owned(), v));
    prop_oneof![
            bare("(AKIA|ASIA)[A-Z0-9]{16}"),
            bare("gh[pousr]_[A-Za-z0-9]{36}"),
            bare("github_pat_[A-Za-z0-9_]{82}"),
            bare("xox[abpr]-[0-9]{12}-[A-Za-z0-9]{24}"),
            bare("(sk|rk)_live_[A-Za-z0-9]{24,40}"),
            "[A-Za-z0-9_-]{0,40}".prop_map(move |v| (String::new(), format!("sk-{core}{v}{core}"))),
            "[A-Za-z0-9._~+/=-]{0,30}".prop_map(move |v| ("Authorization: Bearer ".to_owned(), format!("{core}{v}{core}"))),
            labelled("Authorization: Basic ", "[A-Za-z0-9+/]{12,40}={0,2}"),
            bare("eyJ[A-Za-z0-9_-]{10,60}\\.eyJ[A-Za-z0-9_-]{10,80}\\.[A-Za-z0-9_-]{20,43}"),
            bare("-----BEGIN (RSA |EC |OPENSSH )?PRIVATE KEY-----\n[A-Za-z0-9+/]{64}\n[A-Za-z0-9+/]{64}\n"),
            labelled("\"private_key\": \"", "-----BEGIN PRIVATE KEY-----\\\\n[A-Za-z0-9+/]{64}\\\\n\""),
            labelled("\"private_key_id\": \"", "[0-9a-f]{40}\""),
            (proptest::sample::select(&["AWS_SECRET_ACCESS_KEY=", "aws_secret_access_key = "][..]), "[A-Za-z0-9/+]{40}")
                .prop_map(|(k, v)| (k.to_owned(), v)),
            labelled("AccountKey=", "[A-Za-z0-9+/]{86}=="),
            (
                proptest::sample::select(&["password=", "secret: ", "api_key = \"", "\"token\": \"", "DB_PASSWORD is "][..]),
                "[A-Za-z0-9+/!@#$%^&*]{4,30}",
            )
                .prop_map(move |(k, v)| (k.to_owned(), format!("{v}{core}"))),
            bare("ACME-[0-9]{8}"),
        ]
}

/// Splits `text` into chunks at char boundaries; `cuts` picks chunk lengths (1..=16 chars).
fn chunk(text: &str, cuts: &[u8]) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let mut k = 0;
    while i < chars.len() {
        let n = cuts
            .get(k)
            .map_or(3, |c| usize::from(c % 16) + 1)
            .min(chars.len() - i);
        out.push(chars[i..i + n].iter().collect());
        i += n;
        k += 1;
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Innocent text: no breach, everything released in the end, and after every push the
    /// held text is within the bound.
    #[test]
    fn innocent_text_is_released(text in innocent_text(), cuts in proptest::collection::vec(any::<u8>(), 0..400)) {
        let chunks = chunk(&text, &cuts);
        let out = scan_chunks(&RULES, chunks.iter().map(String::as_str));
        prop_assert!(out.hits.is_empty(), "{:?} in {:?}", out.hits, text);
        prop_assert_eq!(out.released_total, text.len());
        prop_assert!(out.max_held_after_release <= RULES.max_match_len());
        prop_assert!(out.max_held_after_release <= RULES.max_holdback_bytes());
    }

    /// A secret at a random place: never released, not even in part, and reported.
    #[test]
    fn secret_is_never_released(
        pre in innocent_text(),
        post in innocent_text(),
        (label, secret) in secret(),
        cuts in proptest::collection::vec(any::<u8>(), 0..400),
    ) {
        let text = format!("{pre} {label}{secret} {post}");
        let at = pre.len() + 1 + label.len();
        let chunks = chunk(&text, &cuts);
        let out = scan_chunks(&RULES, chunks.iter().map(String::as_str));
        prop_assert!(!out.hits.is_empty(), "no breach for {:?}", secret);
        let hit = &out.hits[0];
        prop_assert!(out.released_before_breach <= at, "released {} > {} for {:?}", out.released_before_breach, at, secret);
        prop_assert!(out.released_before_breach <= hit.start);
        prop_assert!(hit.start <= at + secret.len() && hit.start + hit.len > at, "{:?} vs {} {:?}", hit, at, secret);
        prop_assert!(out.max_held_after_release <= RULES.max_holdback_bytes());
    }

    /// Chunking does not change the decisions.
    #[test]
    fn chunking_invariance(
        pre in innocent_text(),
        secret in proptest::option::of(secret()),
        post in innocent_text(),
        cuts in proptest::collection::vec(any::<u8>(), 0..400),
    ) {
        let (label, value) = secret.unwrap_or_default();
        let text = format!("{pre} {label}{value} {post}");
        let whole = scan_all(&text);
        let chunks = chunk(&text, &cuts);
        let split = scan_chunks(&RULES, chunks.iter().map(String::as_str));
        prop_assert_eq!(&whole.hits, &split.hits);
        prop_assert_eq!(whole.released_total, split.released_total);
    }
}

/// `chunks` with a cut at byte `at` of their concatenation, so that one chunk ends there.
fn cut_at(chunks: Vec<String>, at: usize) -> Vec<String> {
    let mut out = Vec::with_capacity(chunks.len() + 1);
    let mut pos = 0;
    for c in chunks {
        if pos < at && at < pos + c.len() {
            out.push(c[..at - pos].to_owned());
            out.push(c[at - pos..].to_owned());
        } else {
            out.push(c.clone());
        }
        pos += c.len();
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// With look-ahead (the built-in model's path): a secret split at any point between the
    /// token just pushed and the next one, which the scanner looks at before it is pushed, is
    /// never released, not even in part; and the look-ahead changes no decision.
    #[test]
    fn secret_split_across_a_look_ahead_is_never_released(
        pre in innocent_text(),
        post in innocent_text(),
        (label, secret) in secret(),
        split in any::<proptest::sample::Index>(),
        cuts in proptest::collection::vec(any::<u8>(), 0..400),
    ) {
        let text = format!("{pre} {label}{secret} {post}");
        let at = pre.len() + 1 + label.len();
        let mut cut = at + split.index(secret.len() + 1);
        while !text.is_char_boundary(cut) {
            cut += 1;
        }
        let chunks = cut_at(chunk(&text, &cuts), cut);
        let chunks: Vec<&str> = chunks.iter().map(String::as_str).collect();
        let out = scan_chunks_with(&RULES, &chunks, true);
        prop_assert!(!out.hits.is_empty(), "no breach for {:?}", secret);
        let hit = &out.hits[0];
        prop_assert!(out.released_before_breach <= at, "released {} > {} for {:?} cut at {}", out.released_before_breach, at, secret, cut);
        prop_assert!(out.released_before_breach <= hit.start);
        prop_assert!(hit.start <= at + secret.len() && hit.start + hit.len > at, "{:?} vs {} {:?}", hit, at, secret);
        prop_assert!(out.max_held_after_release <= RULES.max_holdback_bytes());
        let plain = scan_chunks_with(&RULES, &chunks, false);
        prop_assert_eq!(&out.hits, &plain.hits);
        prop_assert_eq!(out.released_total, plain.released_total);
    }

    /// With look-ahead, innocent text is all released, and never later than without it; and
    /// no earlier than the next push would release it: the look-ahead only brings forward
    /// what that push decides.
    #[test]
    fn look_ahead_releases_what_the_next_push_would_only_sooner(
        text in innocent_text(),
        cuts in proptest::collection::vec(any::<u8>(), 0..400),
    ) {
        let chunks = chunk(&text, &cuts);
        let chunks: Vec<&str> = chunks.iter().map(String::as_str).collect();
        let ahead = scan_chunks_with(&RULES, &chunks, true);
        let plain = scan_chunks_with(&RULES, &chunks, false);
        prop_assert!(ahead.hits.is_empty() && plain.hits.is_empty(), "{:?}", text);
        prop_assert_eq!(ahead.released_total, text.len());
        prop_assert_eq!(ahead.held_per_push.len(), chunks.len());
        let mut pushed = 0;
        for (i, c) in chunks.iter().enumerate() {
            pushed += c.len();
            let (held, held_plain) = (ahead.held_per_push[i], plain.held_per_push[i]);
            prop_assert!(held <= held_plain, "push {}: {} held with look-ahead, {} without", i, held, held_plain);
            // Released with the look-ahead after push i <= released by push i + 1 alone.
            let next = chunks.get(i + 1).map_or((0, 0), |n| (n.len(), plain.held_per_push[i + 1]));
            prop_assert!(pushed - held <= pushed + next.0 - next.1, "push {}: released ahead of the next push", i);
        }
    }
}
