//! Replays every committed corpus file (`fuzz/corpus/<target>/`, `fuzz/regressions/<target>/`)
//! through its harness, so that what the fuzzer once found, and the inputs that cover each
//! parser, are checked by every `cargo test` on stable.

use std::{fs, path::PathBuf};

/// The files of `fuzz/<dir>/<target>/`, sorted; none when the directory is missing.
fn files(dir: &str, target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz")
        .join(dir)
        .join(target);
    let Ok(entries) = fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut files: Vec<_> = entries
        .map(|e| e.expect("a directory entry").path())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let data = fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, data)
        })
        .collect()
}

/// The corpus (`fuzz/corpus/`, minimized by `cargo xtask fuzz --cmin`), which must not be
/// empty, and the inputs kept for good (`fuzz/regressions/`: what a fuzz run once failed on).
fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let mut all = files("corpus", target);
    assert!(!all.is_empty(), "fuzz/corpus/{target}: no corpus");
    all.extend(files("regressions", target));
    all
}

/// Runs every file of `target`'s corpus; names each file that failed.
fn replay(target: &str, harness: fn(&[u8])) {
    let failed: Vec<String> = corpus(target)
        .into_iter()
        .filter(|(_, data)| std::panic::catch_unwind(|| harness(data)).is_err())
        .map(|(p, _)| p.display().to_string())
        .collect();
    assert!(failed.is_empty(), "{target}: failed on {failed:#?}");
}

#[test]
fn request_head_corpus() {
    replay("request_head", super::request_head);
}

#[test]
fn request_body_corpus() {
    replay("request_body", super::request_body);
}

#[test]
fn messages_request_corpus() {
    replay("messages_request", super::messages_request);
}

#[test]
fn responses_request_corpus() {
    replay("responses_request", super::responses_request);
}

#[test]
fn upstream_response_corpus() {
    replay("upstream_response", super::upstream_response);
}

#[test]
fn upstream_sse_corpus() {
    replay("upstream_sse", super::upstream_sse);
}

#[test]
fn config_file_corpus() {
    replay("config_file", super::config_file);
}

#[test]
fn ledger_verify_corpus() {
    replay("ledger_verify", super::ledger_verify);
}

/// Found by `upstream_response` (a harness false alarm, kept as the rule it taught): a
/// malformed head longer than the limit is refused either way, as too large when it arrives
/// in pieces (the limit is passed before its bad byte arrives) and as malformed when it
/// arrives whole. The harness compares the two as one refusal.
#[test]
fn a_malformed_head_over_the_limit_is_refused_however_it_arrives() {
    use crate::upstream::{ResponseError, ResponseReader};
    let data = files("regressions", "upstream_response")
        .into_iter()
        .find(|(p, _)| p.ends_with("malformed-head-over-the-limit"))
        .expect("the regression input")
        .1;
    let mut body = Vec::new();
    let whole = ResponseReader::new(512).feed(&data, &mut body);
    assert!(
        matches!(whole, Err(ResponseError::MalformedHead { .. })),
        "{whole:?}"
    );
    let mut r = ResponseReader::new(512);
    let bytewise = data
        .chunks(1)
        .map(|b| r.feed(b, &mut body))
        .find(Result::is_err)
        .expect("refused");
    assert_eq!(bytewise, Err(ResponseError::HeadTooLarge { limit: 512 }));
    assert!(body.is_empty());
    super::upstream_response(&data);
}

/// Found by reading `messages_request`'s harness (no run reached it): a tool's schema nested
/// to serde_json's limit is one level deeper once translated (`tools[].function.parameters`),
/// so the chat body could not be read again from its bytes, as grounding's resume reads it.
/// The translation now refuses such a body with a 400 that says so.
#[test]
fn a_tool_schema_at_the_depth_limit_is_refused_once_translated() {
    let data = files("regressions", "messages_request")
        .into_iter()
        .find(|(p, _)| p.ends_with("tool-schema-at-the-depth-limit"))
        .expect("the regression input")
        .1;
    let body: serde_json::Value = serde_json::from_slice(&data).expect("the client's body parses");
    let e = crate::wire::messages::request::to_chat(&body).expect_err("refused");
    assert_eq!(e.status, 400);
    assert!(e.message.contains("nests 128 levels deep"), "{}", e.message);
    super::messages_request(&data);
}
