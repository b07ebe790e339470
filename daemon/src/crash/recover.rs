//! At start: the crash file of an earlier haltd becomes ledger records, once.

use std::{
    io,
    path::{Path, PathBuf},
    time::{Duration, UNIX_EPOCH},
};

use serde_json::{json, Map, Value};

use crate::{
    clock::rfc3339,
    ledger::{Ledger, LedgerError, Record, RecordKind},
};

/// Why the crash file could not be recorded. haltd does not start then: the crash would go
/// unrecorded (or be recorded again and again).
#[derive(Debug, thiserror::Error)]
pub enum RecoverError {
    #[error("reading the crash file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("recording the crash file {}: {source}", path.display())]
    Ledger {
        path: PathBuf,
        #[source]
        source: LedgerError,
    },
}

/// Crash-file bytes taken into a record for a line that is not a crash line (a torn write).
const UNPARSED_MAX: usize = 4096;

/// Turns every line of `crash_file` into a `crash` record in `ledger` (written and fsync'd
/// before this returns), logs each at ERROR, then removes the file. Returns how many crashes
/// it recorded: 0 when there is no file. `kernel_gate` is this start's gate state (the ledger
/// requires one on every record).
///
/// If the file cannot be removed after its records are written, haltd logs it and carries
/// on: the next start would record the same crashes again (same `pid` and `unix_ns`), which is
/// better than not serving.
pub fn recover(crash_file: &Path, ledger: &Ledger, kernel_gate: &str) -> Result<u64, RecoverError> {
    let bytes = match std::fs::read(crash_file) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(source) => {
            return Err(RecoverError::Read {
                path: crash_file.to_owned(),
                source,
            })
        }
    };
    let mut recorded = 0;
    for line in bytes.split(|&b| b == b'\n') {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let rec = crash_record(line, kernel_gate);
        let what = rec.message.clone().unwrap_or_default();
        tracing::error!(
            crash_file = %crash_file.display(),
            crash = %what,
            "the previous haltd ended on an uncontained panic; recorded in the flight recorder"
        );
        ledger
            .append_sync(rec)
            .map_err(|source| RecoverError::Ledger {
                path: crash_file.to_owned(),
                source,
            })?;
        recorded += 1;
    }
    if let Err(e) = std::fs::remove_file(crash_file) {
        tracing::error!(
            crash_file = %crash_file.display(),
            error = %e,
            "cannot remove the recorded crash file; the next start records its crashes again"
        );
    }
    Ok(recorded)
}

/// The `crash` record of one crash-file line.
fn crash_record(line: &[u8], kernel_gate: &str) -> Record {
    let crash = match serde_json::from_slice::<Value>(line) {
        Ok(Value::Object(mut o)) if o.get("haltd_crash") == Some(&json!(1)) => {
            o.remove("haltd_crash");
            if let Some(ns) = o.get("unix_ns").and_then(Value::as_u64) {
                o.insert(
                    "at".to_owned(),
                    Value::String(rfc3339(UNIX_EPOCH + Duration::from_nanos(ns))),
                );
            }
            o
        }
        _ => {
            let cut = line.get(..UNPARSED_MAX).unwrap_or(line);
            let mut o = Map::new();
            o.insert(
                "unparsed".to_owned(),
                Value::String(String::from_utf8_lossy(cut).into_owned()),
            );
            o
        }
    };
    let field = |k: &str| crash.get(k).map_or_else(|| "?".to_owned(), plain);
    let message = if crash.contains_key("unparsed") {
        "haltd ended on a crash whose crash-file line cannot be read (see crash.unparsed)"
            .to_owned()
    } else {
        format!(
            "haltd pid {} panicked in thread {} at {}: {} (exit {}, {})",
            field("pid"),
            field("thread"),
            field("location"),
            field("message"),
            field("exit_code"),
            field("at"),
        )
    };
    Record {
        kind: RecordKind::Crash,
        kernel_gate: kernel_gate.to_owned(),
        message: Some(message),
        crash: Some(Value::Object(crash)),
        ..Record::default()
    }
}

/// A JSON value as text: strings without their quotes.
fn plain(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> Self {
            let p = std::env::temp_dir()
                .join(format!("haltd-crash-recover-{}-{tag}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).expect("temp dir");
            TempDir(p)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    const LINE: &str = r#"{"haltd_crash":1,"pid":42,"tid":43,"unix_ns":1700000000123456789,"exit_code":101,"thread":"haltd-dp-1","location":"daemon/src/x.rs:1:2","message":"boom \"q\"","truncated":false}"#;

    #[test]
    fn every_line_becomes_one_record_and_the_file_goes() {
        let dir = TempDir::new("lines");
        let ledger_path = dir.0.join("ledger.jsonl");
        let crash = super::super::hook::file_for(&ledger_path);
        // Two crashes (a crash loop) and a torn line.
        std::fs::write(&crash, format!("{LINE}\n{LINE}\n{{\"haltd_cra")).expect("write");
        let ledger = crate::ledger::testing::open(&ledger_path, false).expect("ledger");
        assert_eq!(recover(&crash, &ledger, "enforcing").expect("recover"), 3);
        assert!(!crash.exists(), "the crash file is removed once recorded");
        assert_eq!(recover(&crash, &ledger, "enforcing").expect("again"), 0);
        drop(ledger);
        let report = crate::ledger::testing::verify(&ledger_path);
        assert!(report.is_intact(), "{report}");
        let recs: Vec<Value> = std::fs::read_to_string(&ledger_path)
            .expect("read")
            .lines()
            .map(|l| serde_json::from_str(l).expect("json"))
            .collect();
        assert_eq!(recs.len(), 3);
        let r = &recs[0];
        assert_eq!(r["kind"], "crash");
        assert_eq!(r["kernel_gate"], "enforcing");
        assert_eq!(r["crash"]["thread"], "haltd-dp-1");
        assert_eq!(r["crash"]["pid"], 42);
        assert_eq!(r["crash"]["exit_code"], 101);
        assert_eq!(r["crash"]["message"], "boom \"q\"");
        assert_eq!(r["crash"]["at"], "2023-11-14T22:13:20.123Z");
        assert!(r["crash"].get("haltd_crash").is_none());
        assert_eq!(
            r["message"],
            "haltd pid 42 panicked in thread haltd-dp-1 at daemon/src/x.rs:1:2: boom \"q\" (exit 101, 2023-11-14T22:13:20.123Z)"
        );
        assert_eq!(recs[2]["crash"]["unparsed"], "{\"haltd_cra");
    }

    #[test]
    fn no_file_is_no_crash() {
        let dir = TempDir::new("none");
        let ledger_path = dir.0.join("ledger.jsonl");
        let ledger = crate::ledger::testing::open(&ledger_path, false).expect("ledger");
        let crash = super::super::hook::file_for(&ledger_path);
        assert_eq!(recover(&crash, &ledger, "disabled").expect("recover"), 0);
        assert_eq!(ledger.records_written(), 0);
    }
}
