//! `haltctl ledger reanchor`: takes a ledger whose head is missing as it stands, on the
//! operator's word, recorded in the chain (`haltd::ledger::Ledger::reanchor`). haltd must be
//! stopped (it holds the ledger's lock). One exit code per answer (docs/operations.md, "The
//! ledger refused"):
//!
//! | code | meaning |
//! |---|---|
//! | 0 | re-anchored: the record is written, then the new head |
//! | 1 | refused: the head is present, the ledger holds no record, or its chain does not verify |
//! | 2 | cannot: an invalid `--operator`, no ledger key, the ledger locked by a running haltd, an I/O error |
//!
//! Who ran it is recorded as the admin API records its callers (`admin.actor`): the process's
//! uid, gid and pid (`"transport": "local"`: no socket in between), plus the name the operator
//! gives with `--operator`, since the uid of such a command is root's more often than not.

use std::path::Path;

use serde::Serialize;
use serde_json::json;

use crate::ledger::{Ledger, LedgerConfig, LedgerError};

/// The longest `--operator` name.
const MAX_OPERATOR: usize = 128;

/// What to re-anchor, and who does it.
#[derive(Debug)]
pub struct ReanchorRequest<'a> {
    pub state_dir: &'a Path,
    pub ledger: &'a Path,
    pub operator: &'a str,
}

/// The answer, and its exit code.
#[derive(Debug, Serialize)]
pub struct Outcome {
    pub reanchored: bool,
    pub exit_code: u8,
    pub message: String,
    /// The re-anchor record's seq, when written.
    pub seq: Option<u64>,
}

impl Outcome {
    fn failed(exit_code: u8, message: String) -> Self {
        Outcome {
            reanchored: false,
            exit_code,
            message,
            seq: None,
        }
    }
}

/// Checks `--operator`: a name a reader of the ledger can act on.
pub fn check_operator(name: &str) -> Result<(), String> {
    if name.trim().is_empty() {
        return Err("--operator: give your name (it goes into the ledger's record)".to_owned());
    }
    if name.chars().count() > MAX_OPERATOR || name.chars().any(char::is_control) {
        return Err(format!(
            "--operator: at most {MAX_OPERATOR} characters, none of them a control character"
        ));
    }
    Ok(())
}

/// This process, as the re-anchor record names it.
fn actor(operator: &str) -> serde_json::Value {
    // SAFETY: getuid and getgid cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    json!({
        "transport": "local",
        "uid": uid,
        "gid": gid,
        "pid": std::process::id(),
        "operator": operator,
    })
}

/// Re-anchors what `req` names.
pub fn run(req: &ReanchorRequest<'_>) -> Outcome {
    if let Err(e) = check_operator(req.operator) {
        return Outcome::failed(2, e);
    }
    let cfg = LedgerConfig {
        path: req.ledger,
        state_dir: req.state_dir,
        fsync: true,
        // No haltd runs while the chain is re-anchored: no gate enforces anything then.
        kernel_gate: "disabled",
        slow_write: None,
        fail_writes_from: None,
    };
    match Ledger::reanchor(&cfg, req.operator, actor(req.operator)) {
        Ok(done) => {
            let a = &done.anchor;
            let torn = done.torn.as_ref().map_or_else(String::new, |t| {
                format!(
                    "; a torn last line of {} bytes was cut and recorded",
                    t.bytes
                )
            });
            Outcome {
                reanchored: true,
                exit_code: 0,
                message: format!(
                    "re-anchored {}: {} records taken as they stand (last seq {}, hash {}), \
                     recorded as seq {} with operator {:?}; new head {}{torn}",
                    req.ledger.display(),
                    a.records,
                    a.end.next_seq.saturating_sub(1),
                    a.end.hash,
                    done.seq,
                    req.operator,
                    a.head.display(),
                ),
                seq: Some(done.seq),
            }
        }
        Err(e) => {
            let code = match e {
                LedgerError::NotReanchored { .. }
                | LedgerError::ChainBroken { .. }
                | LedgerError::Tampered { .. } => 1,
                _ => 2,
            };
            Outcome::failed(code, e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operator_names_are_checked() {
        assert!(check_operator("alice").is_ok());
        assert!(check_operator("Alice Smith (on call)").is_ok());
        assert!(check_operator("").is_err());
        assert!(check_operator("   ").is_err());
        assert!(check_operator("a\nb").is_err());
        assert!(check_operator(&"x".repeat(MAX_OPERATOR + 1)).is_err());
    }
}
