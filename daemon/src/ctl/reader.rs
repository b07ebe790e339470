//! `haltctl ledger show` and `haltctl ledger tail`: a ledger's records as a table or as the
//! JSON lines they are, oldest first; `tail` follows the file across rotations.

use std::{path::PathBuf, process::ExitCode};

use super::out;
use crate::ledger::show;

/// `ledger show` and `ledger tail`: the file, what they print and how.
#[derive(Debug)]
pub struct Reader {
    pub path: PathBuf,
    pub sel: show::Selection,
    /// Each record as its JSON line, as written, instead of a table row.
    pub json: bool,
}

impl Reader {
    /// Whether `line` is printed: matching records, and every line that is not a record.
    fn keeps(&self, line: &show::Line) -> bool {
        match line {
            show::Line::Record(_, v, _) => self.sel.matches(v),
            show::Line::NotARecord(..) => true,
        }
    }

    fn print(&self, line: &show::Line) {
        match line {
            show::Line::Record(_, _, text) if self.json => out::line(text),
            show::Line::Record(_, v, _) => out::line(&show::table_row(v)),
            show::Line::NotARecord(n, why) => {
                eprintln!("haltctl: {} line {n}: {why}; skipped", self.path.display());
            }
        }
    }

    fn print_header(&self) {
        if !self.json {
            out::line(&show::table_header());
        }
    }

    fn fail(&self, e: &std::io::Error) -> ExitCode {
        eprintln!("haltctl: {}: {e}", self.path.display());
        ExitCode::from(2)
    }
}

/// `haltctl ledger show`.
pub fn ledger_show(r: &Reader, last: Option<usize>) -> ExitCode {
    r.print_header();
    let read = match last {
        Some(n) => show::last_lines(&r.path, n, |l| r.keeps(l))
            .map(|lines| lines.iter().for_each(|l| r.print(l))),
        None => show::read_lines(&r.path, |l| {
            if r.keeps(&l) {
                r.print(&l);
            }
        }),
    };
    match read {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => r.fail(&e),
    }
}

/// `haltctl ledger tail`: runs until interrupted, or until the file cannot be read.
pub fn ledger_tail(r: &Reader, lines: usize, interval_ms: u64) -> ExitCode {
    // Open the follower first: a record appended while the last ones print is not lost.
    let mut follower = match show::Follower::at_end(&r.path) {
        Ok(f) => f,
        Err(e) => return r.fail(&e),
    };
    r.print_header();
    match show::last_lines(&r.path, lines, |l| r.keeps(l)) {
        Ok(last) => last.iter().for_each(|l| r.print(l)),
        Err(e) => return r.fail(&e),
    }
    loop {
        std::thread::sleep(std::time::Duration::from_millis(interval_ms.max(10)));
        let polled = match follower.poll() {
            Ok(p) => p,
            Err(e) => return r.fail(&e),
        };
        for l in polled.lines.iter().filter(|l| r.keeps(l)) {
            r.print(l);
        }
        if polled.rotated {
            eprintln!(
                "haltctl: {} was rotated; following the new file",
                r.path.display()
            );
        }
    }
}
