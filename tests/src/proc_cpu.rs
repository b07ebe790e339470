//! A process's CPU time, the two ways the benches read it: the kernel's per-process CPU clock
//! (ns, all threads) and `/proc/PID/stat` (clock ticks, a cross-check).

use std::fs;

use anyhow::{bail, ensure, Context, Result};

/// User + system time of all of `pid`'s threads so far, in ns (`clock_getcpuclockid`).
pub fn process_cpu_ns(pid: u32) -> Result<u64> {
    let pid = libc::pid_t::try_from(pid).context("pid fits pid_t")?;
    let mut clock: libc::clockid_t = 0;
    // SAFETY: clock_getcpuclockid only writes into `clock`, which outlives the call.
    let rc = unsafe { libc::clock_getcpuclockid(pid, &mut clock) };
    ensure!(
        rc == 0,
        "clock_getcpuclockid({pid}): {}",
        std::io::Error::from_raw_os_error(rc)
    );
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes into `ts`, which outlives the call.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        bail!(
            "clock_gettime(CPU clock of {pid}): {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(u64::try_from(ts.tv_sec)? * 1_000_000_000 + u64::try_from(ts.tv_nsec)?)
}

/// utime + stime of `pid` from `/proc/PID/stat`, in clock ticks.
pub fn proc_stat_ticks(pid: u32) -> Result<u64> {
    let path = format!("/proc/{pid}/stat");
    let stat = fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    // The fields after the command name, which is in parentheses and may contain anything:
    // rest[0] is field 3 (state); utime and stime are fields 14 and 15.
    let rest: Vec<&str> = stat
        .rsplit_once(')')
        .with_context(|| format!("{path}: no command name"))?
        .1
        .split_whitespace()
        .collect();
    let field = |i: usize| -> Result<u64> {
        rest.get(i - 3)
            .with_context(|| format!("{path}: no field {i}"))?
            .parse()
            .with_context(|| format!("{path}: field {i}"))
    };
    Ok(field(14)? + field(15)?)
}
