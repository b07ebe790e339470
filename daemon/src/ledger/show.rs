//! `haltctl ledger show|tail`: a ledger's records for a reader, as a table or as JSON Lines.
//!
//! Reading only: nothing here checks the chain (`haltctl ledger verify` does) or needs the
//! ledger key, so whoever may read the file may look at it. A line that is not a record (the
//! torn last line of a crash, or damage) is reported by number and skipped, so a damaged file
//! still shows what it holds. `tail` follows the file as haltd appends to it, and across a
//! rotation (the path names a new file, or the file got shorter): it then reads the new
//! segment from its start.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::RecordKind;

/// Which records to print.
#[derive(Clone, Debug, Default)]
pub struct Selection {
    /// Only records of this stream (`stream_id`, as in `x-haltd-stream-id`).
    pub stream: Option<String>,
    /// Only records of this kind.
    pub kind: Option<RecordKind>,
}

impl Selection {
    /// Whether `record` is one to print.
    pub fn matches(&self, record: &Value) -> bool {
        let stream_ok = self
            .stream
            .as_deref()
            .is_none_or(|s| record["stream_id"].as_str() == Some(s));
        let kind_ok = self
            .kind
            .is_none_or(|k| serde_json::to_value(k).is_ok_and(|name| record["kind"] == name));
        stream_ok && kind_ok
    }
}

/// One line of the file: a record (its text kept as written, for `--json`), or a fault.
#[derive(Debug)]
pub enum Line {
    /// A record: its 1-based line number, the parsed value, the text without its newline.
    Record(usize, Value, String),
    /// A line that does not parse as a JSON object: its line number and why.
    NotARecord(usize, String),
}

impl Line {
    fn parse(number: usize, text: &str) -> Line {
        match serde_json::from_str::<Value>(text) {
            Ok(v) if v.is_object() => Line::Record(number, v, text.to_owned()),
            Ok(_) => Line::NotARecord(number, "not a JSON object".to_owned()),
            Err(e) => Line::NotARecord(number, format!("not JSON ({e})")),
        }
    }
}

/// The column titles of [`table_row`], aligned with it.
pub fn table_header() -> String {
    format!(
        "{:>6}  {:<24}  {:<9}  {:<19}  {:<15}  {:<23}  {:>5}  {:>4}  {:>6}  DETAIL",
        "SEQ", "TIME", "KIND", "STREAM", "OUTCOME", "CAUSE", "TRIP@", "POST", "TOKENS"
    )
}

/// Longest DETAIL cell, in characters; the rest is cut with `…`.
const DETAIL_MAX: usize = 100;

/// One record as a table row: what happened to which stream, and the detail that matters for
/// its kind. Missing values are `-`.
pub fn table_row(r: &Value) -> String {
    let text = |k: &str| r[k].as_str().unwrap_or("-").to_owned();
    let num = |k: &str| {
        r[k].as_u64()
            .map_or_else(|| "-".to_owned(), |n| n.to_string())
    };
    let outcome = match r["kind"].as_str() {
        Some("admin") => r["admin"]["action"].as_str().unwrap_or("-").to_owned(),
        _ => text("outcome"),
    };
    let cause = match r["trip_cause"].as_str() {
        Some(c) => c.to_owned(),
        None => r["admin"]["cause"].as_str().unwrap_or("-").to_owned(),
    };
    format!(
        "{:>6}  {:<24}  {:<9}  {:<19}  {:<15}  {:<23}  {:>5}  {:>4}  {:>6}  {}",
        num("seq"),
        text("ts"),
        text("kind"),
        text("stream_id"),
        outcome,
        cause,
        num("trip_token_index"),
        num("halt_tokens_post_trip"),
        num("tokens_emitted"),
        cut(&detail(r), DETAIL_MAX),
    )
}

/// The DETAIL cell: who acted (admin), whose turn and in which mode (turn), or the message.
fn detail(r: &Value) -> String {
    match r["kind"].as_str() {
        Some("admin") => {
            let a = &r["admin"];
            let actor = &a["actor"];
            let who = match actor["transport"].as_str() {
                Some("unix") => format!(
                    "uid {} pid {}",
                    actor["uid"],
                    actor["pid"]
                        .as_i64()
                        .map_or("-".to_owned(), |p| p.to_string())
                ),
                Some("tcp") => format!("tcp {}", actor["peer"].as_str().unwrap_or("?")),
                _ => "unknown actor".to_owned(),
            };
            let what = a["request"]
                .as_object()
                .map(|_| format!(" {}", a["request"]))
                .unwrap_or_default();
            let opted_out = if a["degrade"] == false {
                " (no degrade)"
            } else {
                ""
            };
            format!("by {who}: answered {}{what}{opted_out}", a["status"])
        }
        Some("turn") => {
            let mut d = format!(
                "conv {} · {} · {}",
                r["conversation"].as_str().unwrap_or("-"),
                r["runtime_mode"].as_str().unwrap_or("-"),
                r["turn_status"].as_str().unwrap_or("-"),
            );
            if let Some(by) = r["halted_by"].as_str() {
                d.push_str(&format!(" · halted by {by}"));
            }
            d
        }
        _ => r["message"].as_str().unwrap_or("").to_owned(),
    }
}

/// `s` cut to at most `max` characters, with `…` where it was cut.
fn cut(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        None => s.to_owned(),
        Some((at, _)) => format!("{}…", &s[..at]),
    }
}

/// Reads `path` whole, line by line, handing each line to `each` (`show`).
pub fn read_lines(path: &Path, mut each: impl FnMut(Line)) -> io::Result<()> {
    let reader = BufReader::new(File::open(path)?);
    for (i, line) in reader.lines().enumerate() {
        let line = line?;
        if !line.is_empty() {
            each(Line::parse(i + 1, &line));
        }
    }
    Ok(())
}

/// The last `n` lines of `path` that `keep` accepts (faults are always kept), in order.
pub fn last_lines(path: &Path, n: usize, keep: impl Fn(&Line) -> bool) -> io::Result<Vec<Line>> {
    let mut last = VecDeque::with_capacity(n.min(4096));
    read_lines(path, |l| {
        if n > 0 && keep(&l) {
            if last.len() == n {
                last.pop_front();
            }
            last.push_back(l);
        }
    })?;
    Ok(last.into())
}

/// Follows a ledger file as it grows (`tail`): whole lines only, across rotations.
#[derive(Debug)]
pub struct Follower {
    path: PathBuf,
    file: File,
    inode: u64,
    /// Bytes of the file read so far.
    offset: u64,
    /// Lines read so far (numbers of the next ones).
    lines: usize,
    /// The start of a line whose end was not written yet.
    partial: Vec<u8>,
}

/// What a [`Follower::poll`] found.
#[derive(Debug, Default)]
pub struct Polled {
    /// The lines completed since the last poll.
    pub lines: Vec<Line>,
    /// The path named a new file (rotation) or the file got shorter: reading restarted there.
    pub rotated: bool,
}

impl Follower {
    /// Starts at the end of `path` as it is now (what is there was printed already).
    pub fn at_end(path: &Path) -> io::Result<Follower> {
        let mut file = File::open(path)?;
        let meta = file.metadata()?;
        let mut f = Follower {
            path: path.to_owned(),
            inode: meta.ino(),
            offset: 0,
            lines: 0,
            partial: Vec::new(),
            file: File::open(path)?,
        };
        // Count the lines already there so that numbers in fault reports stay right.
        let mut buf = Vec::new();
        file.read_to_end(&mut buf)?;
        f.offset = buf.len() as u64;
        f.lines = buf.iter().filter(|&&b| b == b'\n').count();
        if let Some(last_nl) = buf.iter().rposition(|&b| b == b'\n') {
            f.partial = buf[last_nl + 1..].to_vec();
        } else {
            f.partial = buf;
        }
        f.file.seek(SeekFrom::Start(f.offset))?;
        Ok(f)
    }

    /// Reads what was appended since the last call. A path that now names another file, or a
    /// file shorter than what was read, is a rotation: the new file is read from its start.
    pub fn poll(&mut self) -> io::Result<Polled> {
        let mut polled = Polled::default();
        match std::fs::metadata(&self.path) {
            Ok(m) if m.ino() != self.inode || m.len() < self.offset => {
                // Finish the old file first: records written before the rename belong to it.
                self.read_new(&mut polled.lines)?;
                self.file = File::open(&self.path)?;
                self.inode = self.file.metadata()?.ino();
                self.offset = 0;
                self.lines = 0;
                self.partial.clear();
                polled.rotated = true;
            }
            // Between a rename and the new file's creation: keep reading the old one.
            Ok(_) | Err(_) => {}
        }
        self.read_new(&mut polled.lines)?;
        Ok(polled)
    }

    fn read_new(&mut self, out: &mut Vec<Line>) -> io::Result<()> {
        let mut buf = Vec::new();
        self.file.read_to_end(&mut buf)?;
        self.offset += buf.len() as u64;
        self.partial.extend_from_slice(&buf);
        while let Some(nl) = self.partial.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=nl).collect();
            self.lines += 1;
            let text = String::from_utf8_lossy(&line[..line.len() - 1]).into_owned();
            if !text.is_empty() {
                out.push(Line::parse(self.lines, &text));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
