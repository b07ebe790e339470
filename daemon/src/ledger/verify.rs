//! Checking a ledger's keyed hash chain: at start (`Ledger::open`) and on demand (`haltctl
//! ledger verify`), over one file or a series of segments, against the head when there is one.
//!
//! [`parse_line`] is the pure check of one line (JSON, canonical layout, MAC): what the
//! fuzzer drives. [`scan`] adds the links between lines (`seq` contiguous, `prev_hash` the
//! previous `hash`) and tells a torn last line (no newline: a crash mid-write) from a break.
//! [`verify_series`] adds the links between segments: a rotation's, which continues the
//! previous segment's last record, and a hand-over's, which forks from the previous segment's
//! hand-over record while that segment goes on (its drain).

use std::{
    fmt,
    fs::File,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
};

use serde::Serialize;

use crate::ledger::{
    error::{fmt_seq, LedgerError},
    head::Head,
    key::LedgerKey,
    record::{Record, RecordKind, GENESIS_HASH},
};

/// Where and why a chain breaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainBreak {
    /// The segment, when a series of more than one was checked.
    pub path: Option<PathBuf>,
    /// 1-based line number in the file (the line after the last one for a break at the end).
    pub line: u64,
    /// The record's `seq`, when the line parsed.
    pub seq: Option<u64>,
    pub reason: String,
}

/// Result of [`verify_series`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    /// Records with an intact chain (before the break, if any).
    pub records: u64,
    pub broken: Option<ChainBreak>,
    /// Bytes of a torn last line (a crash mid-write): not part of the chain, cut at the
    /// next start.
    pub torn_tail: u64,
    /// How the end of the chain compares with the head (`None`: no head was given).
    pub head: Option<HeadMatch>,
    /// The hand-over links found between segments, in order.
    pub handovers: Vec<HandoverLink>,
}

/// A segment that continues the previous one from its hand-over record, while the previous one
/// went on past it (the old process's drain).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HandoverLink {
    /// The segment that continues: its index in the series, 0-based (the old one is the one
    /// before it).
    pub segment: usize,
    /// The `seq` of the old segment's hand-over record, which the segment continues.
    pub from_seq: u64,
    /// The old segment's last `seq`: `from_seq`, or past it by its drain.
    pub old_segment_last_seq: u64,
}

/// The end of the chain against the head kept outside the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadMatch {
    /// The chain ends where the head says.
    Equal,
    /// One record past the head: a crash between the record's fsync and the head's.
    AheadByOne,
}

impl VerifyReport {
    pub fn is_intact(&self) -> bool {
        self.broken.is_none()
    }
}

impl fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.broken {
            None => write!(f, "ok: {} records, chain intact", self.records)?,
            Some(b) => write!(
                f,
                "BROKEN at line {}{}{}: {} ({} records intact before it)",
                b.line,
                b.path
                    .as_ref()
                    .map(|p| format!(" of {}", p.display()))
                    .unwrap_or_default(),
                fmt_seq(b.seq),
                b.reason,
                self.records
            )?,
        }
        match self.head {
            Some(HeadMatch::Equal) => write!(f, ", matches its head")?,
            Some(HeadMatch::AheadByOne) => write!(
                f,
                ", one record past its head (a crash before the head was written; the next start catches it up)"
            )?,
            None => {}
        }
        if self.torn_tail > 0 {
            write!(
                f,
                "; torn last line of {} bytes (a crash mid-write; the next start cuts it and records so)",
                self.torn_tail
            )?;
        }
        Ok(())
    }
}

/// The `ledger_key_id` of each segment's first record (`None`: no such field, or no first
/// record): which key each was written under, read without checking anything.
pub fn first_key_ids(paths: &[PathBuf]) -> Result<Vec<Option<String>>, LedgerError> {
    paths
        .iter()
        .map(|path| {
            let file = File::open(path).map_err(|source| LedgerError::Open {
                path: path.clone(),
                source,
            })?;
            let mut first = String::new();
            BufReader::new(file)
                .read_line(&mut first)
                .map_err(|source| LedgerError::Open {
                    path: path.clone(),
                    source,
                })?;
            let v: Option<serde_json::Value> = serde_json::from_str(first.trim()).ok();
            Ok(v.and_then(|v| v["ledger_key_id"].as_str().map(str::to_owned)))
        })
        .collect()
}

/// Checks the chain of one ledger file against `head` (if given).
pub fn verify(
    path: &Path,
    key: &LedgerKey,
    head: Option<&Head>,
) -> Result<VerifyReport, LedgerError> {
    verify_series(&[path.to_owned()], key, head)
}

/// Checks a series of segments, oldest first: each chain, each segment's first record linked
/// to the previous segment's last (rotation) or to its hand-over record (a hand-over:
/// [`HandoverLink`]), and the end against `head`. I/O errors are errors; a broken chain is a
/// report with `broken` set.
pub fn verify_series(
    paths: &[PathBuf],
    key: &LedgerKey,
    head: Option<&Head>,
) -> Result<VerifyReport, LedgerError> {
    let mut report = VerifyReport {
        records: 0,
        broken: None,
        torn_tail: 0,
        head: None,
        handovers: Vec::new(),
    };
    let mut last: Option<Scan> = None;
    for (i, path) in paths.iter().enumerate() {
        let in_series = |mut b: ChainBreak| {
            b.path = (paths.len() > 1).then(|| path.clone());
            b
        };
        let start = match &last {
            None => None,
            Some(prev) => match handover_start(path, key)? {
                None => Some(prev.end()),
                Some(first) => match handover_link(i, prev, &first) {
                    Ok(link) => {
                        report.handovers.push(link);
                        Some(Head {
                            next_seq: first.seq,
                            hash: first.prev_hash,
                        })
                    }
                    Err(reason) => {
                        let b = ChainBreak {
                            path: None,
                            line: 1,
                            seq: Some(first.seq),
                            reason,
                        };
                        report.broken = Some(in_series(b));
                        return Ok(report);
                    }
                },
            },
        };
        let file = File::open(path).map_err(|source| LedgerError::Open {
            path: path.clone(),
            source,
        })?;
        let s = scan(path, BufReader::new(file), key, start.as_ref())?;
        report.records += s.records;
        if let Some(b) = s.broken {
            report.broken = Some(in_series(b));
            return Ok(report);
        }
        if s.torn > 0 && i + 1 < paths.len() {
            let b = ChainBreak {
                path: None,
                line: s.lines + 1,
                seq: None,
                reason: "torn last line in a segment that is not the last".to_owned(),
            };
            report.broken = Some(in_series(b));
            return Ok(report);
        }
        report.torn_tail = s.torn;
        last = Some(s);
    }
    if let (Some(h), Some(s)) = (head, last) {
        match s.against(h) {
            Ok(m) => report.head = Some(m),
            Err(reason) => {
                report.broken = Some(ChainBreak {
                    path: (paths.len() > 1).then(|| paths[paths.len() - 1].clone()),
                    line: s.lines + 1,
                    seq: None,
                    reason,
                });
            }
        }
    }
    Ok(report)
}

/// The first record of `path` when it opens a hand-over segment (a `lifecycle` record with
/// `handover.from_seq`, authentic under `key`); `None` otherwise, also for a first line that
/// does not parse (the scan reports that).
fn handover_start(path: &Path, key: &LedgerKey) -> Result<Option<Record>, LedgerError> {
    let file = File::open(path).map_err(|source| LedgerError::Open {
        path: path.to_owned(),
        source,
    })?;
    let mut line = Vec::new();
    BufReader::new(file)
        .read_until(b'\n', &mut line)
        .map_err(|source| LedgerError::Read {
            path: path.to_owned(),
            line: 1,
            source,
        })?;
    let Some(line) = line.strip_suffix(b"\n") else {
        return Ok(None);
    };
    Ok(parse_line(line, key)
        .ok()
        .filter(|r| r.kind == RecordKind::Lifecycle && r.handover_from_seq().is_some()))
}

/// Whether `first`, the first record of segment `i`, continues the hand-over record it names
/// in `prev`, the scan of segment `i - 1`; the reason when it does not.
fn handover_link(i: usize, prev: &Scan, first: &Record) -> Result<HandoverLink, String> {
    let from = first.handover_from_seq().unwrap_or_default();
    let (new, old) = (i + 1, i);
    if from.checked_add(1) != Some(first.seq) {
        return Err(format!(
            "segment {new} names hand-over record {from} of segment {old}, but its first record              has seq {}",
            first.seq
        ));
    }
    let old_first = prev.next_seq - prev.records;
    if prev.records == 0 || from < old_first || from >= prev.next_seq {
        let held = match prev.records {
            0 => "it holds no record".to_owned(),
            _ => format!("its records are seq {old_first} to {}", prev.next_seq - 1),
        };
        return Err(format!(
            "segment {new} names hand-over record {from} of segment {old}, which does not hold \
             it ({held})"
        ));
    }
    match prev.handover_records.iter().find(|(seq, _)| *seq == from) {
        None => Err(format!(
            "segment {new} names record {from} of segment {old} as its hand-over record, but \
             that record carries no `handover` field (no hand-over was made there)"
        )),
        Some((_, hash)) if *hash != first.prev_hash => Err(format!(
            "segment {new} names hand-over record {from} of segment {old}, whose hash differs \
             ({} there, {} in its prev_hash)",
            short(hash),
            short(&first.prev_hash)
        )),
        Some(_) => Ok(HandoverLink {
            segment: i,
            from_seq: from,
            old_segment_last_seq: prev.next_seq - 1,
        }),
    }
}

/// Chain state after reading a file.
#[derive(Debug)]
pub(super) struct Scan {
    pub(super) next_seq: u64,
    pub(super) last_hash: String,
    /// The `prev_hash` of the last record: where the chain ended before it.
    pub(super) prev_of_last: String,
    /// Whole records read.
    pub(super) records: u64,
    /// Whole lines read.
    pub(super) lines: u64,
    /// Bytes of the whole records: where a torn tail begins.
    pub(super) len: u64,
    /// Bytes after the last newline (a torn write), and the first of them.
    pub(super) torn: u64,
    pub(super) torn_prefix: Vec<u8>,
    pub(super) broken: Option<ChainBreak>,
    /// The `seq` and `hash` of each hand-over record (`handover` without `from_seq`): where a
    /// successor's segment may fork off.
    pub(super) handover_records: Vec<(u64, String)>,
}

impl Scan {
    /// Where the chain ends.
    pub(super) fn end(&self) -> Head {
        Head {
            next_seq: self.next_seq,
            hash: self.last_hash.clone(),
        }
    }

    /// How the end compares with `head`; `Err` with the reason when it cannot be a crash.
    pub(super) fn against(&self, head: &Head) -> Result<HeadMatch, String> {
        if self.next_seq == head.next_seq && self.last_hash == head.hash {
            return Ok(HeadMatch::Equal);
        }
        if self.next_seq == head.next_seq + 1 && self.records > 0 && self.prev_of_last == head.hash
        {
            return Ok(HeadMatch::AheadByOne);
        }
        if self.next_seq < head.next_seq {
            return Err(format!(
                "file behind its head: the chain ends before seq {}, the head says {} records were written (records cut off or the file replaced)",
                self.next_seq, head.next_seq
            ));
        }
        Err(format!(
            "file does not end at its head: the chain ends before seq {} with hash {}, the head says before seq {} with hash {}",
            self.next_seq, short(&self.last_hash), head.next_seq, short(&head.hash)
        ))
    }
}

fn short(h: &str) -> &str {
    h.get(..16).unwrap_or(h)
}

/// Reads a file's chain. `start`: where the previous segment ended (`None`: the file starts
/// a chain, at seq 0 from the genesis hash, or is a segment whose first record says where it
/// continues).
pub(super) fn scan(
    path: &Path,
    mut reader: impl BufRead,
    key: &LedgerKey,
    start: Option<&Head>,
) -> Result<Scan, LedgerError> {
    let begin = start.cloned().unwrap_or_else(Head::genesis);
    let mut s = Scan {
        next_seq: begin.next_seq,
        last_hash: begin.hash.clone(),
        prev_of_last: begin.hash,
        records: 0,
        lines: 0,
        len: 0,
        torn: 0,
        torn_prefix: Vec::new(),
        broken: None,
        handover_records: Vec::new(),
    };
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let n = reader
            .read_until(b'\n', &mut buf)
            .map_err(|source| LedgerError::Read {
                path: path.to_owned(),
                line: s.lines + 1,
                source,
            })?;
        if n == 0 {
            return Ok(s);
        }
        let Some(line) = buf.strip_suffix(b"\n") else {
            s.torn = n as u64;
            s.torn_prefix = buf[..buf.len().min(64)].to_vec();
            return Ok(s);
        };
        s.lines += 1;
        let brk = |seq: Option<u64>, reason: String| ChainBreak {
            path: None,
            line: s.lines,
            seq,
            reason,
        };
        let rec = match parse_line(line, key) {
            Ok(r) => r,
            Err(e) => {
                let seq = e.seq;
                s.broken = Some(brk(seq, e.reason));
                return Ok(s);
            }
        };
        // A segment after the first opens with a record that says where it continues: the
        // previous segment's last record (rotation), or another's hand-over record.
        let segment_start = s.records == 0 && start.is_none() && continues(&rec);
        if segment_start && rec.kind == RecordKind::Lifecycle {
            s.next_seq = rec.seq;
            s.last_hash.clone_from(&rec.prev_hash);
        }
        if let Err(reason) = link(&rec, s.next_seq, &s.last_hash) {
            s.broken = Some(brk(Some(rec.seq), reason));
            return Ok(s);
        }
        if rec.is_handover_record() {
            s.handover_records.push((rec.seq, rec.hash.clone()));
        }
        s.next_seq += 1;
        s.prev_of_last = std::mem::replace(&mut s.last_hash, rec.hash);
        s.records += 1;
        s.len += n as u64;
    }
}

/// Whether `rec` is the record expected at `next_seq` after `last_hash`.
fn link(rec: &Record, next_seq: u64, last_hash: &str) -> Result<(), String> {
    if rec.seq != next_seq {
        return Err(format!("seq gap (expected {next_seq}, found {})", rec.seq));
    }
    if rec.prev_hash != last_hash {
        return Err("prev_hash mismatch".to_owned());
    }
    if let Some(from) = rec.handover_from_seq() {
        if from.checked_add(1) != Some(rec.seq) {
            return Err(format!(
                "hand-over segment record names from_seq {from} but has seq {}",
                rec.seq
            ));
        }
    }
    if continues(rec) && rec.seq != 0 && rec.prev_hash == GENESIS_HASH {
        return Err("segment record claims the genesis hash".to_owned());
    }
    Ok(())
}

/// Whether `rec` may open a file mid-chain: it says which record it continues.
fn continues(rec: &Record) -> bool {
    rec.segment.is_some() || rec.handover_from_seq().is_some()
}

/// Why one line is not a record of this chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineFault {
    /// The record's `seq`, when the line parsed.
    pub seq: Option<u64>,
    pub reason: String,
}

/// Parses and authenticates one ledger line (without its newline): JSON of a [`Record`],
/// laid out as the writer writes it, with a `hash` that is the MAC of its own bytes under
/// `key`. Pure: no I/O, any input (the fuzzer's entry point).
pub fn parse_line(line: &[u8], key: &LedgerKey) -> Result<Record, LineFault> {
    let rec: Record = match serde_json::from_slice(line) {
        Ok(r) => r,
        Err(e) if e.is_data() => {
            return Err(LineFault {
                seq: None,
                reason: format!("not a record: {e}"),
            })
        }
        Err(e) => {
            return Err(LineFault {
                seq: None,
                reason: format!("not JSON: {e}"),
            })
        }
    };
    let fault = |reason: &str| LineFault {
        seq: Some(rec.seq),
        reason: reason.to_owned(),
    };
    // The MAC is checked over the line's own bytes with the `hash` field cut out, not over a
    // re-serialisation of the parsed record: serde_json's default float parsing does not
    // always round-trip the last bit, and any byte the writer did not MAC (an extra field,
    // reformatting) must count as tampering.
    let Some(unhashed) = strip_hash_field(line, rec.seq, &rec.prev_hash, &rec.hash) else {
        return Err(fault(
            "non-canonical encoding (fields reordered, added or reformatted)",
        ));
    };
    if !key.verify_hex(&[&unhashed], &rec.hash) {
        return Err(fault("hash mismatch"));
    }
    Ok(rec)
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
