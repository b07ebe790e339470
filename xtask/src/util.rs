//! Running commands and small helpers shared by the tasks.

use std::{
    fs,
    io::Read,
    os::unix::fs::MetadataExt,
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{bail, Context, Result};

/// Runs a command with inherited stdio; an error names the command and its exit status.
pub(crate) fn run(c: &mut Command) -> Result<()> {
    let shown = show(c);
    let status = c.status().with_context(|| format!("starting `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// Stdout of a command that succeeded; `None` if it could not start or failed.
pub(crate) fn capture(c: &mut Command) -> Option<String> {
    let out = c.stderr(Stdio::null()).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The command line of `c`, for messages.
pub(crate) fn show(c: &Command) -> String {
    std::iter::once(c.get_program())
        .chain(c.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

pub(crate) fn secs(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

pub(crate) fn is_root() -> bool {
    // /proc/self belongs to the effective user.
    fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

pub(crate) fn is_elf(path: &Path) -> bool {
    let mut magic = [0_u8; 4];
    fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && magic == *b"\x7fELF"
}
