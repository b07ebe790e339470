//! Checking a ledger's hash chain: at start (`Ledger::open` refuses a broken chain) and on
//! demand (`haltctl ledger verify`).

use std::{
    fmt,
    fs::File,
    io::{BufRead, BufReader},
    path::Path,
};

use sha2::{Digest, Sha256};

use crate::ledger::{
    error::{fmt_seq, LedgerError},
    record::{Record, GENESIS_HASH},
};

/// Where and why a chain breaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainBreak {
    /// 1-based line number in the file.
    pub line: u64,
    /// The record's `seq`, when the line parsed.
    pub seq: Option<u64>,
    pub reason: String,
}

/// Result of [`verify`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    /// Records with an intact chain (before the break, if any).
    pub records: u64,
    pub broken: Option<ChainBreak>,
}

impl VerifyReport {
    pub fn is_intact(&self) -> bool {
        self.broken.is_none()
    }
}

impl fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.broken {
            None => write!(f, "ok: {} records, chain intact", self.records),
            Some(b) => write!(
                f,
                "BROKEN at line {}{}: {} ({} records intact before it)",
                b.line,
                fmt_seq(b.seq),
                b.reason,
                self.records
            ),
        }
    }
}

/// Checks the whole chain of the ledger at `path`. I/O errors are errors; a broken chain is a
/// report with `broken` set.
pub fn verify(path: &Path) -> Result<VerifyReport, LedgerError> {
    let file = File::open(path).map_err(|source| LedgerError::Open {
        path: path.to_owned(),
        source,
    })?;
    let scan = scan(path, BufReader::new(file))?;
    Ok(VerifyReport {
        records: scan.next_seq,
        broken: scan.broken,
    })
}

/// Chain state after reading a file.
pub(super) struct Scan {
    pub(super) next_seq: u64,
    pub(super) last_hash: String,
    pub(super) len: u64,
    pub(super) broken: Option<ChainBreak>,
}

pub(super) fn scan(path: &Path, mut reader: impl BufRead) -> Result<Scan, LedgerError> {
    let mut s = Scan {
        next_seq: 0,
        last_hash: GENESIS_HASH.to_owned(),
        len: 0,
        broken: None,
    };
    let mut buf = Vec::new();
    let mut line_no = 0u64;
    loop {
        buf.clear();
        line_no += 1;
        let n = reader
            .read_until(b'\n', &mut buf)
            .map_err(|source| LedgerError::Read {
                path: path.to_owned(),
                line: line_no,
                source,
            })?;
        if n == 0 {
            return Ok(s);
        }
        let brk = |seq: Option<u64>, reason: String| ChainBreak {
            line: line_no,
            seq,
            reason,
        };
        let Some(line) = buf.strip_suffix(b"\n") else {
            s.broken = Some(brk(
                None,
                "truncated line (no trailing newline; torn write?)".to_owned(),
            ));
            return Ok(s);
        };
        let rec: Record = match serde_json::from_slice(line) {
            Ok(r) => r,
            Err(e) if e.is_data() => {
                s.broken = Some(brk(None, format!("not a record: {e}")));
                return Ok(s);
            }
            Err(e) => {
                s.broken = Some(brk(None, format!("not JSON: {e}")));
                return Ok(s);
            }
        };
        let seq = Some(rec.seq);
        if rec.seq != s.next_seq {
            s.broken = Some(brk(
                seq,
                format!("seq gap (expected {}, found {})", s.next_seq, rec.seq),
            ));
            return Ok(s);
        }
        if rec.prev_hash != s.last_hash {
            s.broken = Some(brk(seq, "prev_hash mismatch".to_owned()));
            return Ok(s);
        }
        // The hash is checked over the line's own bytes with the `hash` field cut out, not
        // over a re-serialisation of the parsed record: serde_json's default float parsing
        // does not always round-trip the last bit, and any byte the writer did not hash
        // (an extra field, reformatting) must count as tampering.
        let Some(unhashed) = strip_hash_field(line, rec.seq, &rec.prev_hash, &rec.hash) else {
            s.broken = Some(brk(
                seq,
                "non-canonical encoding (fields reordered, added or reformatted)".to_owned(),
            ));
            return Ok(s);
        };
        if hex::encode(Sha256::digest(&unhashed)) != rec.hash {
            s.broken = Some(brk(seq, "hash mismatch".to_owned()));
            return Ok(s);
        }
        s.next_seq += 1;
        s.last_hash = rec.hash;
        s.len += n as u64;
    }
}

/// The bytes the writer hashed for `line`: the line without its `"hash":"…",` field, which
/// the writer's serialisation always places right after `seq` and `prev_hash`. `None` when the
/// line does not start that way.
fn strip_hash_field(line: &[u8], seq: u64, prev_hash: &str, hash: &str) -> Option<Vec<u8>> {
    let quote = |v: &str| serde_json::to_string(v).ok();
    let head = format!("{{\"seq\":{seq},\"prev_hash\":{},", quote(prev_hash)?);
    let field = format!("\"hash\":{},", quote(hash)?);
    let rest = line
        .strip_prefix(head.as_bytes())?
        .strip_prefix(field.as_bytes())?;
    let mut unhashed = Vec::with_capacity(head.len() + rest.len());
    unhashed.extend_from_slice(head.as_bytes());
    unhashed.extend_from_slice(rest);
    Some(unhashed)
}
