//! `haltctl ledger verify`: the chain of a ledger (one file, or segments oldest first), the
//! key it was written under, and its end against the head. One exit code per answer
//! (docs/operations.md "Verifying the ledger"):
//!
//! | code | [`Verdict`] | meaning |
//! |---|---|---|
//! | 0 | `intact` | the chain is intact, and its end matches the head (or `--no-end-check`) |
//! | 1 | `broken` | the chain breaks: where and why are printed |
//! | 2 | `cannot_check` | an I/O error, no ledger key, or a `--head` file that does not read |
//! | 3 | `key_mismatch` | a segment was written under another ledger key: the wrong `--state-dir` |
//! | 4 | `end_not_checkable` | the chain is intact but there is no head to check its end against |
//!
//! A series may hold hand-over links (issue 38: a segment that continues the previous one from
//! its hand-over record while that one went on, its drain): one line each, and the old
//! segment's end is checked against its own head when the state directory has it.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::ledger::{self, head, HandoverLink, Head, HeadMatch, LedgerKey, VerifyReport};

/// The answer of a check, and its exit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Intact,
    Broken,
    CannotCheck,
    KeyMismatch,
    EndNotCheckable,
}

impl Verdict {
    pub fn exit_code(self) -> u8 {
        match self {
            Verdict::Intact => 0,
            Verdict::Broken => 1,
            Verdict::CannotCheck => 2,
            Verdict::KeyMismatch => 3,
            Verdict::EndNotCheckable => 4,
        }
    }
}

/// What to check.
#[derive(Debug)]
pub struct VerifyRequest<'a> {
    pub state_dir: &'a Path,
    /// The segments, oldest first.
    pub paths: &'a [PathBuf],
    /// A head file to check the end against, instead of the state directory's.
    pub head: Option<&'a Path>,
    /// Accept a ledger whose end cannot be checked.
    pub no_end_check: bool,
}

/// The answer: its verdict, what to print, and the records found intact.
#[derive(Debug, Serialize)]
pub struct Outcome {
    pub verdict: Verdict,
    pub exit_code: u8,
    pub message: String,
    pub records: Option<u64>,
    /// The hand-over links between segments.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub handovers: Vec<HandoverLink>,
}

impl Outcome {
    fn new(verdict: Verdict, message: String, report: Option<&VerifyReport>) -> Self {
        Outcome {
            verdict,
            exit_code: verdict.exit_code(),
            message,
            records: report.map(|r| r.records),
            handovers: report.map(|r| r.handovers.clone()).unwrap_or_default(),
        }
    }
}

/// Checks what `req` names.
pub fn run(req: &VerifyRequest<'_>) -> Outcome {
    let cannot = |m: String| Outcome::new(Verdict::CannotCheck, m, None);
    let key = match LedgerKey::read(req.state_dir) {
        Ok(k) => k,
        Err(e) => {
            return cannot(format!(
                "the ledger key: {e} (run as the user haltd runs as, or give --state-dir or \
                 --config)"
            ))
        }
    };
    match key_mismatch(req, &key) {
        Ok(Some(o)) => return o,
        Ok(None) => {}
        Err(e) => return cannot(e),
    }
    let Some(last) = req.paths.last() else {
        return cannot("no ledger file given".to_owned());
    };
    let head = match end_head(req, last, &key) {
        Ok(h) => h,
        Err(e) => return cannot(e),
    };
    let report = match ledger::verify_series(req.paths, &key, head.as_ref()) {
        Ok(r) => r,
        Err(e) => return cannot(e.to_string()),
    };
    let handovers = match handover_lines(req, &key, &report) {
        Ok(lines) => lines,
        Err(lines) => {
            return Outcome::new(Verdict::Broken, format!("{report}{lines}"), Some(&report))
        }
    };
    if !report.is_intact() {
        return Outcome::new(
            Verdict::Broken,
            format!("{report}{handovers}"),
            Some(&report),
        );
    }
    match (head.is_some(), req.no_end_check) {
        (true, _) => Outcome::new(
            Verdict::Intact,
            format!("{report}{handovers}"),
            Some(&report),
        ),
        (false, true) => Outcome::new(
            Verdict::Intact,
            format!("{report}; its end was not checked (--no-end-check){handovers}"),
            Some(&report),
        ),
        (false, false) => Outcome::new(
            Verdict::EndNotCheckable,
            format!(
                "{report}, but its end cannot be checked: there is no head for {} in {} (a copy \
                 of a ledger has none), so records cut off its end would go unnoticed. Give \
                 --head FILE (the ledger-<id>.head haltd keeps in its state directory), or \
                 --no-end-check to accept that{handovers}",
                last.display(),
                req.state_dir.display()
            ),
            Some(&report),
        ),
    }
}

/// A segment whose first record names another ledger key than `key`'s: the wrong key, which
/// would otherwise look like tampering.
fn key_mismatch(req: &VerifyRequest<'_>, key: &LedgerKey) -> Result<Option<Outcome>, String> {
    let ids = ledger::first_key_ids(req.paths).map_err(|e| e.to_string())?;
    let ours = key.id();
    for (path, id) in req.paths.iter().zip(ids) {
        if let Some(id) = id.filter(|id| *id != ours) {
            let m = format!(
                "{} was written under ledger key {id}, but the key in {} is {ours}: the wrong \
                 --state-dir (or --config), not a broken chain",
                path.display(),
                req.state_dir.display()
            );
            return Ok(Some(Outcome::new(Verdict::KeyMismatch, m, None)));
        }
    }
    Ok(None)
}

/// The head to check the end of `last` against: `--head FILE`'s, else the state directory's.
fn end_head(req: &VerifyRequest<'_>, last: &Path, key: &LedgerKey) -> Result<Option<Head>, String> {
    match req.head {
        Some(file) => match head::read_head_file(file, key) {
            Ok(Some(h)) => Ok(Some(h)),
            Ok(None) => Err(format!(
                "--head {}: no slot of it is valid under this ledger key",
                file.display()
            )),
            Err(e) => Err(format!("--head {}: {e}", file.display())),
        },
        None => head::read_head(req.state_dir, last, key)
            .map_err(|e| format!("the head of {}: {e}", last.display())),
    }
}

/// A line (each after a newline) per hand-over link of the series, each saying where the old
/// segment ended and whether that is where its own head says; `Err` with the lines up to an old
/// segment that does not end at its head, and a last line saying so.
fn handover_lines(
    req: &VerifyRequest<'_>,
    key: &LedgerKey,
    report: &VerifyReport,
) -> Result<String, String> {
    let mut out = String::new();
    for link in &report.handovers {
        let (new, old) = (&req.paths[link.segment], &req.paths[link.segment - 1]);
        let went_on = if link.old_segment_last_seq > link.from_seq {
            format!("went on to seq {} (its drain)", link.old_segment_last_seq)
        } else {
            "ended there".to_owned()
        };
        let (end, broken) = own_end(req.state_dir, old, key);
        out.push_str(&format!(
            "\nsegment {} continues {} from its hand-over record seq {}; {} {went_on}{end}",
            new.display(),
            old.display(),
            link.from_seq,
            old.display()
        ));
        if let Some(reason) = broken {
            out.push_str(&format!(
                "\nBROKEN: {} does not end at its own head: {reason}",
                old.display()
            ));
            return Err(out);
        }
    }
    Ok(out)
}

/// The end of `old`, a segment a hand-over forked from, against its own head in `state_dir`:
/// what to say of it, and the reason when it does not end there.
fn own_end(state_dir: &Path, old: &Path, key: &LedgerKey) -> (String, Option<String>) {
    let head = match head::read_head(state_dir, old, key) {
        Ok(Some(h)) => h,
        Ok(None) => {
            let m = format!(
                ", its end not checked (no head for it in {})",
                state_dir.display()
            );
            return (m, None);
        }
        Err(e) => return (format!(", its end not checked (its head: {e})"), None),
    };
    match ledger::verify(old, key, Some(&head)) {
        Ok(r) => match (r.broken, r.head) {
            (Some(b), _) => (String::new(), Some(b.reason)),
            (None, Some(HeadMatch::AheadByOne)) => (
                ", one record past its own head (a crash before the head was written)".to_owned(),
                None,
            ),
            (None, _) => (", where its own head says".to_owned(), None),
        },
        Err(e) => (format!(", its end not checked ({e})"), None),
    }
}

#[cfg(test)]
mod tests;
