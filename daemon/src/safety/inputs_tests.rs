//! SafetyCheck's inputs: URLs found in text, and the sources a request names.

use super::tests::{evidence, set, urls};
use super::*;
use serde_json::json;

// --- URL extraction ----------------------------------------------------------------------

#[test]
fn urls_in_prose_and_markdown() {
    assert_eq!(
        urls("See https://a.b/c, and http://d.e/f; also https://g.h/i."),
        ["http://d.e/f", "https://a.b/c", "https://g.h/i"]
    );
    assert_eq!(urls("[x](https://a.b/c)"), ["https://a.b/c"]);
    assert_eq!(urls("[https://a.b/c](https://a.b/c)"), ["https://a.b/c"]);
    assert_eq!(urls("(see https://a.b/c)."), ["https://a.b/c"]);
    assert_eq!(urls("**https://a.b/c**!"), ["https://a.b/c"]);
    assert_eq!(urls("<https://a.b/c>"), ["https://a.b/c"]);
    assert_eq!(urls("\"https://a.b/c\""), ["https://a.b/c"]);
    assert_eq!(urls("“https://a.b/c”"), ["https://a.b/c"]);
    assert_eq!(urls("`https://a.b/c`;"), ["https://a.b/c"]);
    assert_eq!(urls("ends with https://a.b/c?"), ["https://a.b/c"]);
    assert_eq!(urls("https://a.b/c);"), ["https://a.b/c"]);
}

#[test]
fn urls_keep_what_belongs_to_them() {
    assert_eq!(
        urls("https://en.wikipedia.org/wiki/Rust_(programming_language)."),
        ["https://en.wikipedia.org/wiki/Rust_(programming_language)"]
    );
    assert_eq!(
        urls("go to https://a.b/s?q=1&r=a,b#frag now"),
        ["https://a.b/s?q=1&r=a,b#frag"]
    );
    assert_eq!(
        urls("https://a.b/r?to=https://c.d/e"),
        ["https://a.b/r?to=https://c.d/e"]
    );
    assert_eq!(urls("http://[::1]:8080/x]"), ["http://[::1]:8080/x"]);
    assert_eq!(
        urls("HTTPS://Example.COM/Path"),
        ["HTTPS://Example.COM/Path"]
    );
    assert_eq!(
        urls("https://例え.jp/ページ。次"),
        ["https://例え.jp/ページ"]
    );
    assert_eq!(urls("https://a.b/c\nhttps://a.b/c"), ["https://a.b/c"]);
}

#[test]
fn urls_split_by_punctuation() {
    assert_eq!(
        urls("https://a.b/c,https://d.e/f;http://g.h"),
        ["http://g.h", "https://a.b/c", "https://d.e/f"]
    );
    assert_eq!(
        urls("https://a.b/c|https://d.e"),
        ["https://a.b/c", "https://d.e"]
    );
}

#[test]
fn not_urls() {
    assert!(urls("https:// nothing").is_empty());
    assert!(urls("https://").is_empty());
    assert!(urls("https:///path").is_empty());
    assert!(urls("https://.").is_empty());
    assert!(urls("xhttps://a.b/c").is_empty());
    assert!(urls("ftp://a.b/c mailto:x@y.z a.b/c").is_empty());
    assert!(urls("").is_empty());
}

#[test]
fn normalize_url_rules() {
    assert_eq!(normalize_url("HTTPS://Ex.COM/A/B/#x"), "https://ex.com/A/B");
    assert_eq!(normalize_url("https://ex.com/"), "https://ex.com");
    assert_eq!(normalize_url("http://ex.com:80/a"), "http://ex.com/a");
    assert_eq!(
        normalize_url("https://ex.com:8443/a"),
        "https://ex.com:8443/a"
    );
    assert_eq!(normalize_url("http://ex.com:443/a"), "http://ex.com:443/a");
    assert_eq!(
        normalize_url("https://ex.com/a/?q=1"),
        "https://ex.com/a?q=1"
    );
    assert_eq!(normalize_url("https://ex.com/a?"), "https://ex.com/a");
    assert_eq!(
        normalize_url("https://User@Ex.com/a"),
        "https://User@ex.com/a"
    );
    assert_eq!(normalize_url("https://ex.com?q=A#f"), "https://ex.com?q=A");
    assert_eq!(normalize_url("  not a url "), "not a url");
}

// --- request_sources ---------------------------------------------------------------------

#[test]
fn request_sources_of_a_chat_request() {
    let body = json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": "Use https://sys.example/policy."},
            {"role": "user", "content": [
                {"type": "text", "text": "Read [this](https://u.example/a) and https://u.example/b"},
                {"type": "image_url", "image_url": {"url": "https://img.example/x.png"}}
            ]},
            {"role": "assistant", "content": "I made up https://fake.example/z"},
            {"role": "tool", "content": "fetched https://tool.example/r"}
        ],
        "sources": ["https://s.example/1", "not a url", 7],
        "documents": [{"title": "d", "text": "from https://doc.example/t"}]
    });
    let got: Vec<String> = request_sources(&body).into_iter().collect();
    assert_eq!(
        got,
        [
            "https://doc.example/t",
            "https://s.example/1",
            "https://sys.example/policy",
            "https://tool.example/r",
            "https://u.example/a",
            "https://u.example/b",
        ]
    );
}

#[test]
fn request_sources_of_a_completions_request() {
    let one = json!({"model": "m", "prompt": "Summarise https://c.example/p."});
    assert_eq!(
        request_sources(&one).into_iter().collect::<Vec<_>>(),
        ["https://c.example/p"]
    );
    let list = json!({"prompt": ["a https://x.example", "b https://y.example/"], "sources": ["https://z.example"]});
    assert_eq!(
        request_sources(&list).into_iter().collect::<Vec<_>>(),
        [
            "https://x.example",
            "https://y.example/",
            "https://z.example"
        ]
    );
    let tokens = json!({"prompt": [1, 2, 3]});
    assert!(request_sources(&tokens).is_empty());
    assert!(request_sources(&json!(null)).is_empty());
}

#[test]
fn sources_end_to_end_through_the_check() {
    let body =
        json!({"messages": [{"role": "user", "content": "Cite https://Docs.example/a/ please"}]});
    let output = "According to [the docs](https://docs.example/a#s2), yes; see also https://elsewhere.example.";
    let ctx = SafetyContext {
        request_source_urls: Some(url_keys(request_sources(&body))),
        cited_urls: Some(url_keys(extract_urls(output))),
        ..SafetyContext::default()
    };
    let v = SafetyCheck::new().check(&ctx, &SafetyPack::v1());
    assert_eq!(
        v.violated_boundaries,
        set(&[NO_FABRICATED_SOURCE]).expect("set")
    );
    let r = v.result(NO_FABRICATED_SOURCE).expect("result");
    assert_eq!(evidence(r, "unmatched_count"), Some("1"));
    assert_eq!(
        evidence(r, "unmatched_sha256_16"),
        Some(url_digest("https://elsewhere.example").as_str())
    );
}
