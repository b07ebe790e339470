//! Every file `docs/`, `README.md` and `deploy/README.md` cite is in the repository.
//!
//! What counts as a citation of a file (fenced code blocks are commands and output, not
//! citations, and are left out):
//! - the target of an inline link `[text](target)` that is not a URL (`scheme:`) or an anchor
//!   in the same page (`#...`): relative to the document's directory, the `#anchor` dropped, it
//!   must be a file or a directory of the repository;
//! - a code span that is a path: no whitespace, no `::`, no `scheme://`, and none of
//!   `< > * { } … $ = , ;` (placeholders, globs, settings), not starting with `/` or `~`
//!   (the host's paths at run time, such as `/run/haltd/...`, are not the repository's):
//!   - with its first component one of the repository's top-level entries (`daemon/`,
//!     `deploy/`, `docs/`, `tests/`, ...): a path from the root, which must be a file or a
//!     directory there;
//!   - else a Rust source, a path ending in `.rs`: relative to some directory, as the docs
//!     name a module's file from `daemon/src/` or from its parent module
//!     (`dataplane/turn/pipeline.rs`, `turn/end.rs`, `stream.rs`), which must end the path of
//!     some file (`mod.rs` excepted: the docs name it as what the workspace does not have);
//!   - anything else is not a citation of the repository: other files not from the root
//!     (`etc/haltd/haltd.toml` in a package, `config.toml`), build outputs (a `target`
//!     component), media types and versions (`text/event-stream`, `http/1.1`).
//!
//! `docs/bench/history.md` is left out: it is the log of past bench runs, and names files as
//! they were when each run was made.

use std::collections::BTreeSet;

use crate::{
    markdown::{code_spans, link_targets, prose_lines},
    Repo,
};

/// Documents under `docs/` that are logs of the past, not statements about the repository.
const LOGS: [&str; 1] = ["docs/bench/history.md"];

/// Characters that make a span a pattern, a placeholder or a setting, not a path.
const NOT_IN_PATHS: [char; 11] = ['<', '>', '*', '{', '}', '…', '$', '=', ',', ';', '|'];

/// The documents this check reads.
fn documents(repo: &Repo) -> Vec<String> {
    let mut docs: Vec<String> = repo
        .files_under("docs")
        .filter(|f| f.ends_with(".md") && !LOGS.contains(&f.as_str()))
        .cloned()
        .collect();
    docs.extend(["README.md".to_owned(), "deploy/README.md".to_owned()]);
    docs
}

/// How a code span cites the repository, if it does.
#[derive(Debug, PartialEq, Eq)]
enum Cited<'a> {
    /// From the root.
    FromRoot(&'a str),
    /// From some directory: the end of a file's path.
    Tail(&'a str),
}

fn classify<'a>(span: &'a str, top: &BTreeSet<&str>) -> Option<Cited<'a>> {
    if span.is_empty()
        || span.contains(char::is_whitespace)
        || span.contains("::")
        || span.contains("://")
        || span.contains(NOT_IN_PATHS)
        || span.starts_with(['/', '~', '-'])
        || span.split('/').any(|c| c == "target")
        || span == "mod.rs"
    {
        return None;
    }
    match span.split_once('/') {
        Some((first, _)) if top.contains(first) => Some(Cited::FromRoot(span)),
        _ if span.ends_with(".rs") && span.len() > 3 => Some(Cited::Tail(span)),
        _ => None,
    }
}

/// `a/b/../c` → `a/c`; `None` when it climbs out of the root.
fn normalize(path: &str) -> Option<String> {
    let mut parts: Vec<&str> = Vec::new();
    for p in path.split('/') {
        match p {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            p => parts.push(p),
        }
    }
    Some(parts.join("/"))
}

/// Every citation of a missing file in document `doc`, as `doc:line: what`; and how many
/// citations it checked.
fn check_doc(repo: &Repo, doc: &str, top: &BTreeSet<&str>) -> (Vec<String>, usize) {
    let dir = doc.rsplit_once('/').map_or("", |(d, _)| d);
    let text = repo.read(doc);
    let mut errors = Vec::new();
    let mut checked = 0;
    for (n, line) in prose_lines(&text) {
        for target in link_targets(line) {
            if target.starts_with('#') || target.contains(':') {
                continue;
            }
            checked += 1;
            let path = target.split('#').next().unwrap_or("");
            let ok = normalize(&format!("{dir}/{path}"))
                .is_some_and(|p| repo.is_file(&p) || repo.is_dir(&p));
            if !ok {
                errors.push(format!("{doc}:{n}: link to `{target}`: no such file"));
            }
        }
        for span in code_spans(line) {
            let ok = match classify(&span.text, top) {
                None => continue,
                Some(Cited::FromRoot(p)) => {
                    let p = p.trim_end_matches('/');
                    repo.is_file(p) || repo.is_dir(p)
                }
                Some(Cited::Tail(p)) => repo
                    .files
                    .iter()
                    .any(|f| f == p || f.ends_with(&format!("/{p}"))),
            };
            checked += 1;
            if !ok {
                errors.push(format!("{doc}:{n}: `{}`: no such file", span.text));
            }
        }
    }
    (errors, checked)
}

/// Every citation of a missing file in the documents, and how many citations were checked.
fn check(repo: &Repo) -> (Vec<String>, usize) {
    let top: BTreeSet<&str> = repo
        .files
        .iter()
        .map(|f| f.split('/').next().unwrap_or(f))
        .collect();
    let mut errors = Vec::new();
    let mut checked = 0;
    for doc in documents(repo) {
        let (e, n) = check_doc(repo, &doc, &top);
        errors.extend(e);
        checked += n;
    }
    (errors, checked)
}

#[test]
fn every_file_the_docs_cite_is_in_the_repository() {
    let repo = Repo::here();
    let (errors, checked) = check(&repo);
    assert!(
        errors.is_empty(),
        "the docs cite files that are not in the repository:\n  {}",
        errors.join("\n  ")
    );
    println!("{checked} citations of files checked");
    // A reader that finds nothing passes nothing: the docs cite hundreds of files.
    assert!(checked >= 300, "only {checked} citations found");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_told_from_prose_and_runtime_paths() {
        let top: BTreeSet<&str> = ["daemon", "deploy", "docs", "tests"].into();
        for (span, want) in [
            ("deploy/grafana/", Some(Cited::FromRoot("deploy/grafana/"))),
            ("daemon/src/x.rs", Some(Cited::FromRoot("daemon/src/x.rs"))),
            ("turn/end.rs", Some(Cited::Tail("turn/end.rs"))),
            ("stream.rs", Some(Cited::Tail("stream.rs"))),
            ("grafana/a.json", None),
            ("etc/haltd/haltd.toml", None),
            ("ebpf/haltd-ebpf/target", None),
            ("mod.rs", None),
            ("daemon/src/<module>.rs", None),
            ("/run/haltd/haltd.sock", None),
            ("text/event-stream", None),
            ("http/1.1", None),
            ("config.toml", None),
            ("target/release/haltd", None),
            ("stream.rs::a_test", None),
            ("cargo test -p haltd", None),
            ("https://example.com/a.md", None),
        ] {
            assert_eq!(classify(span, &top), want, "{span}");
        }
    }

    #[test]
    fn a_missing_file_is_reported_with_its_line() {
        let repo = Repo::of(&[
            ("docs/a.md", "x\n[ok](b.md#h) [up](../daemon/src/x.rs) [web](https://e.org/y.md)\n```\n`nope/x.rs`\n```\n`daemon/src/x.rs` `src/x.rs` `gone.rs` [bad](c.md) `deploy/none/`\n"),
            ("docs/b.md", ""),
            ("daemon/src/x.rs", ""),
        ]);
        let top: BTreeSet<&str> = ["daemon", "docs"].into();
        let (errors, checked) = check_doc(&repo, "docs/a.md", &top);
        assert_eq!(
            errors,
            [
                "docs/a.md:6: link to `c.md`: no such file",
                "docs/a.md:6: `gone.rs`: no such file",
            ]
        );
        // `deploy/` is not a top-level entry of this repository: not a citation.
        assert_eq!(checked, 6);
    }
}
