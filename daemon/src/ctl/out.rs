//! Standard output for haltctl: a reader that closes the pipe (`haltctl ledger show | head`)
//! ends haltctl quietly with status 0, instead of the panic `println!` gives.

use std::io::{self, Write};

/// Writes `text` and a newline to standard output (see [`write`]).
pub fn line(text: &str) {
    write(text);
    write("\n");
}

/// Writes `text` to standard output. A closed pipe ends the process with status 0 and
/// nothing on stderr (the reader has what it wanted); another write error ends it with
/// status 2 and the error.
pub fn write(text: &str) {
    let mut out = io::stdout().lock();
    if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        gone(&e);
    }
}

fn gone(e: &io::Error) -> ! {
    if e.kind() == io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    eprintln!("haltctl: writing to standard output: {e}");
    std::process::exit(2);
}
