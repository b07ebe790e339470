//! A ledger file as `haltctl ledger verify` reads it (the same scan `Ledger::open` runs at
//! start).

use std::{cell::RefCell, fs, path::PathBuf};

use crate::ledger;

thread_local! {
    /// One scratch file per thread (the replay test runs threads in parallel), removed when
    /// the thread ends.
    static SCRATCH: RefCell<Option<Scratch>> = const { RefCell::new(None) };
}

struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

fn scratch_path() -> PathBuf {
    SCRATCH.with(|s| {
        s.borrow_mut()
            .get_or_insert_with(|| {
                let id = format!("{:?}", std::thread::current().id());
                let digits: String = id.chars().filter(char::is_ascii_digit).collect();
                Scratch(std::env::temp_dir().join(format!(
                    "haltd-fuzz-ledger-{}-{digits}.jsonl",
                    std::process::id()
                )))
            })
            .0
            .clone()
    })
}

/// A ledger file's bytes, verified.
///
/// Checks: a verdict for any bytes (an I/O error only if the scratch file cannot be
/// written); the records counted intact are at most the file's lines, the break (if any) is
/// on the line right after them, and an intact file is whole lines that all count, or those
/// and a torn last line.
pub fn ledger_verify(data: &[u8]) {
    let path = scratch_path();
    fs::write(&path, data).expect("write the scratch ledger");
    // A fixed key, no head: the chain's shape is what the bytes can break.
    let key = ledger::LedgerKey::from_bytes([7; 32]);
    let report = ledger::verify(&path, &key, None).expect("a readable file gets a verdict");
    let lines = data.iter().filter(|&&b| b == b'\n').count() as u64;
    assert!(report.records <= lines, "{report:?}");
    match &report.broken {
        Some(b) => assert_eq!(b.line, report.records + 1, "{report:?}"),
        None => {
            // Whole lines that all count, but for a torn last line (no newline), which is
            // reported apart: the next start cuts it.
            let whole = data.is_empty() || data.ends_with(b"\n");
            assert_eq!(whole, report.torn_tail == 0, "{report:?}");
            assert_eq!(report.records, lines, "{report:?}");
        }
    }
}
