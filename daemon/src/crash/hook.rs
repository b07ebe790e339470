//! The panic hook: one crash line, two `write(2)`s, `_exit`. See the module above for why.

use std::{
    ffi::CString,
    fmt::{self, Write as _},
    os::unix::ffi::OsStrExt,
    panic::PanicHookInfo,
    path::{Path, PathBuf},
    sync::OnceLock,
    time::{SystemTime, UNIX_EPOCH},
};

use super::containment::contained;

/// Exit status of a process ended by an uncontained panic: 101, what Rust itself uses for a
/// panic that ends `main`, so it means "panic" whichever path took the process down.
/// (70 is a data-plane worker whose io_uring ring failed; 1 a start-up error; 2 invalid flags.)
pub const EXIT_CODE: i32 = 101;

/// The crash file of the ledger at `ledger`: the same path with `.crash` appended
/// (`haltd-ledger.jsonl` → `haltd-ledger.jsonl.crash`), so it lives where the ledger lives and
/// the next haltd on that ledger finds it.
pub fn file_for(ledger: &Path) -> PathBuf {
    let mut s = ledger.as_os_str().to_owned();
    s.push(".crash");
    PathBuf::from(s)
}

/// The crash file, set once by [`install`] before any worker or watchdog thread exists.
static CRASH_FILE: OnceLock<CString> = OnceLock::new();

/// Bytes of one crash line at most (on the panicking thread's stack). A longer message is cut
/// and the line says `"truncated":true`.
pub(super) const LINE_MAX: usize = 4096;

/// Room kept for what follows the message: its closing quote and
/// `,"truncated":false}` plus the newline.
const TAIL: usize = 32;

/// Why the hook could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("crash file path {0:?} contains a NUL byte")]
    Nul(std::path::PathBuf),
    #[error("the panic hook is already installed")]
    Twice,
}

/// Installs the process-wide panic hook with `crash_file` as the crash file (see
/// [`file_for`]). Call once, from `main`, before starting any thread.
pub fn install(crash_file: &Path) -> Result<(), InstallError> {
    let path = CString::new(crash_file.as_os_str().as_bytes())
        .map_err(|_| InstallError::Nul(crash_file.to_owned()))?;
    CRASH_FILE.set(path).map_err(|_| InstallError::Twice)?;
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if contained() {
            default(info);
        } else {
            fatal(info);
        }
    }));
    Ok(())
}

/// Records the panic and ends the process. Never returns.
fn fatal(info: &PanicHookInfo<'_>) -> ! {
    let mut line = Line::new();
    crash_line(&mut line, info, SystemTime::now());
    let bytes = line.as_bytes();
    if let Some(path) = CRASH_FILE.get() {
        // SAFETY: `path` is a NUL-terminated C string that lives for the whole process.
        let fd = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_APPEND | libc::O_CLOEXEC,
                0o640,
            )
        };
        if fd >= 0 {
            // SAFETY: `bytes` is a valid buffer of that length; `fd` was just opened. One
            // write: with O_APPEND the line lands whole at the end of the file.
            unsafe {
                libc::write(fd, bytes.as_ptr().cast(), bytes.len());
                libc::close(fd);
            }
        }
    }
    const PREFIX: &[u8] = b"haltd: uncontained panic, the process exits now: ";
    // SAFETY: plain writes of valid buffers to stderr; a failure changes nothing here.
    unsafe {
        libc::write(2, PREFIX.as_ptr().cast(), PREFIX.len());
        libc::write(2, bytes.as_ptr().cast(), bytes.len());
    }
    // SAFETY: `_exit` ends the process without running anything else of it (no atexit, no
    // destructors, no flush that could take a lock this thread's panic left held).
    unsafe { libc::_exit(EXIT_CODE) }
}

/// Fills `line` with the crash line of `info`: one JSON object and a newline,
/// `{"haltd_crash":1,"pid":..,"tid":..,"unix_ns":..,"exit_code":101,"thread":"..",
/// "location":"file:line:col","message":"..","truncated":false}`. Allocation-free.
pub(super) fn crash_line(line: &mut Line, info: &PanicHookInfo<'_>, now: SystemTime) {
    let mut name = [0u8; 17];
    let name = thread_name(&mut name);
    // SAFETY: getpid and gettid cannot fail.
    let (pid, tid) = unsafe { (libc::getpid(), libc::gettid()) };
    let unix_ns = now
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let message = info
        .payload_as_str()
        .unwrap_or("(non-string panic payload)");
    let _ = write!(
        line,
        "{{\"haltd_crash\":1,\"pid\":{pid},\"tid\":{tid},\"unix_ns\":{unix_ns},\"exit_code\":{EXIT_CODE},\"thread\":"
    );
    line.json_str(name);
    line.raw(",\"location\":\"");
    if let Some(loc) = info.location() {
        line.escaped(loc.file());
        let _ = write!(line, ":{}:{}", loc.line(), loc.column());
    }
    line.close_quote();
    line.raw(",\"message\":");
    line.json_str(message);
    line.finish();
}

/// The calling thread's name as the kernel keeps it (`prctl(PR_GET_NAME)`, at most 15 bytes;
/// std sets it for named threads: `haltd-dp-0`, `haltd-watchdog`; the main thread's is the
/// program's name). `"?"` if it cannot be read.
fn thread_name(buf: &mut [u8; 17]) -> &str {
    // SAFETY: PR_GET_NAME writes at most 16 bytes, NUL included, into `buf`.
    let rc = unsafe {
        libc::prctl(
            libc::PR_GET_NAME,
            buf.as_mut_ptr() as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    if rc != 0 {
        return "?";
    }
    let len = buf.iter().position(|&b| b == 0).unwrap_or(16);
    std::str::from_utf8(&buf[..len]).unwrap_or("?")
}

/// A fixed-size line buffer: writes past its limit are dropped whole (never half an escape or
/// half a character) and mark the line truncated. The last [`TAIL`] bytes are kept for the
/// closing quote and the end of the object, so the line is always valid JSON.
pub(super) struct Line {
    buf: [u8; LINE_MAX],
    len: usize,
    truncated: bool,
}

impl Line {
    pub(super) fn new() -> Self {
        Line {
            buf: [0; LINE_MAX],
            len: 0,
            truncated: false,
        }
    }

    pub(super) fn as_bytes(&self) -> &[u8] {
        self.buf.get(..self.len).unwrap_or_default()
    }

    /// Appends `s` whole if it fits below `limit`, else nothing.
    fn push(&mut self, s: &[u8], limit: usize) -> bool {
        let end = self.len + s.len();
        match self.buf.get_mut(self.len..end) {
            Some(dst) if end <= limit => {
                dst.copy_from_slice(s);
                self.len = end;
                true
            }
            _ => {
                self.truncated = true;
                false
            }
        }
    }

    fn raw(&mut self, s: &str) {
        self.push(s.as_bytes(), LINE_MAX - TAIL);
    }

    /// `s` as a JSON string, quotes included, cut where the room ends.
    fn json_str(&mut self, s: &str) {
        self.raw("\"");
        self.escaped(s);
        self.close_quote();
    }

    /// `s` escaped for a JSON string, character by character until the room ends.
    fn escaped(&mut self, s: &str) {
        for c in s.chars() {
            let mut tmp = [0u8; 6];
            let e: &[u8] = match c {
                '"' => b"\\\"",
                '\\' => b"\\\\",
                '\n' => b"\\n",
                '\r' => b"\\r",
                '\t' => b"\\t",
                c if (c as u32) < 0x20 => {
                    const HEX: &[u8; 16] = b"0123456789abcdef";
                    let b = c as usize;
                    tmp = [b'\\', b'u', b'0', b'0', HEX[b >> 4], HEX[b & 15]];
                    &tmp
                }
                c => c.encode_utf8(&mut tmp).as_bytes(),
            };
            if !self.push(e, LINE_MAX - TAIL) {
                return;
            }
        }
    }

    /// A closing quote, in the kept room if need be.
    fn close_quote(&mut self) {
        self.push(b"\"", LINE_MAX);
    }

    /// Ends the object (in the kept room) with the truncation flag and a newline.
    fn finish(&mut self) {
        let tail: &[u8] = if self.truncated {
            b",\"truncated\":true}\n"
        } else {
            b",\"truncated\":false}\n"
        };
        self.push(tail, LINE_MAX);
    }
}

impl fmt::Write for Line {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if self.push(s.as_bytes(), LINE_MAX - TAIL) {
            Ok(())
        } else {
            Err(fmt::Error)
        }
    }
}

impl fmt::Debug for Line {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Line")
            .field("len", &self.len)
            .field("truncated", &self.truncated)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::{
        path::PathBuf,
        process::{Command, Stdio},
    };

    use serde_json::Value;

    use super::*;

    #[test]
    fn crash_file_sits_next_to_the_ledger() {
        assert_eq!(
            file_for(Path::new("/var/lib/haltd/ledger.jsonl")),
            PathBuf::from("/var/lib/haltd/ledger.jsonl.crash")
        );
        assert_eq!(
            file_for(Path::new("haltd-ledger.jsonl")),
            PathBuf::from("haltd-ledger.jsonl.crash")
        );
    }
    use crate::safety::{SafetyCheck, SafetyCheckResult, SafetyContext, SafetyPack};

    /// Set (to a directory) only in the child process of
    /// [`an_uncontained_panic_ends_the_process_and_a_contained_one_does_not`].
    const CHILD_ENV: &str = "HALTD_CRASH_HOOK_CHILD";

    fn line_of(message: &str) -> (Value, usize) {
        let mut line = Line::new();
        line.raw("{\"message\":");
        line.json_str(message);
        line.finish();
        let bytes = line.as_bytes();
        assert!(bytes.len() <= LINE_MAX);
        assert_eq!(bytes.last(), Some(&b'\n'));
        let v = serde_json::from_slice(bytes).expect("the line is JSON");
        (v, bytes.len())
    }

    #[test]
    fn the_line_is_json_whatever_the_message() {
        let nasty = "a \"quote\", a \\ backslash,\n\r\t\u{1}\u{1f} and ✓";
        let (v, _) = line_of(nasty);
        assert_eq!(v["message"], nasty);
        assert_eq!(v["truncated"], false);
        // Too long, with multi-byte characters at every possible cut.
        for pad in 0..4 {
            let long = format!("{}{}", "x".repeat(pad), "é✓\"".repeat(3000));
            let (v, len) = line_of(&long);
            assert_eq!(v["truncated"], true);
            let kept = v["message"].as_str().expect("a string");
            assert!(long.starts_with(kept), "a prefix of the message");
            assert!(
                kept.len() > 3000 && len > LINE_MAX - TAIL,
                "the room is used"
            );
        }
    }

    /// The child process's part (a no-op in a normal test run): installs the hook; a panic in
    /// a SafetyCheck predicate is a violation and the process goes on; then a thread named like
    /// a data-plane worker panics, and the hook ends the process with [`EXIT_CODE`].
    #[test]
    fn child_process() {
        let Some(dir) = std::env::var_os(CHILD_ENV).map(PathBuf::from) else {
            return;
        };
        install(&dir.join("ledger.jsonl.crash")).expect("install");
        let mut check = SafetyCheck::empty();
        check.register("fragile", |_: &SafetyContext| -> SafetyCheckResult {
            panic!("predicate boom")
        });
        let v = check.check(
            &SafetyContext::default(),
            &SafetyPack::new("p", ["fragile"]),
        );
        let r = v.result("fragile").expect("a result");
        assert!(!v.upheld && !r.upheld, "{r:?}");
        std::fs::write(dir.join("survived"), &r.reason).expect("write");
        let long = "y".repeat(2 * LINE_MAX);
        let worker = std::thread::Builder::new()
            .name("haltd-dp-7".to_owned())
            .spawn(move || panic!("worker boom \"{}\"\n{long}", 1))
            .expect("spawn");
        let _ = worker.join();
        // Not reached when the hook works.
        std::fs::write(dir.join("not-reached"), "").expect("write");
    }

    #[test]
    fn an_uncontained_panic_ends_the_process_and_a_contained_one_does_not() {
        let dir = std::env::temp_dir().join(format!("haltd-crash-hook-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let child = Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "--exact",
                "crash::hook::tests::child_process",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, &dir)
            .env("RUST_BACKTRACE", "0")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the child");
        let pid = child.id();
        let out = child.wait_with_output().expect("child output");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(EXIT_CODE), "{stderr}");
        let survived = std::fs::read_to_string(dir.join("survived")).expect("survived");
        assert!(survived.contains("panicked: predicate boom"), "{survived}");
        assert!(!dir.join("not-reached").exists());
        // The contained panic got the default hook's message, the fatal one the crash line.
        assert!(stderr.contains("predicate boom"), "{stderr}");
        assert!(stderr.contains("haltd: uncontained panic"), "{stderr}");
        let text = std::fs::read_to_string(dir.join("ledger.jsonl.crash")).expect("crash file");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1, "{text}");
        assert!(text.len() <= LINE_MAX && text.ends_with('\n'));
        let v: Value = serde_json::from_str(lines[0]).expect("JSON");
        assert_eq!(v["haltd_crash"], 1);
        assert_eq!(v["pid"], pid);
        assert_eq!(v["exit_code"], EXIT_CODE);
        assert_eq!(v["thread"], "haltd-dp-7");
        assert_eq!(v["truncated"], true);
        let msg = v["message"].as_str().expect("message");
        assert!(msg.starts_with("worker boom \"1\"\nyyy"), "{msg}");
        let loc = v["location"].as_str().expect("location");
        assert!(loc.starts_with("daemon/src/crash/hook.rs:"), "{loc}");
        let now = SystemTime::now().duration_since(UNIX_EPOCH).expect("time");
        let at = v["unix_ns"].as_u64().expect("unix_ns");
        assert!(now.as_nanos() as u64 - at < 60_000_000_000, "{at}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
