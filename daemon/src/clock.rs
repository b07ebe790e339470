//! The daemon's clocks: this process's `CLOCK_MONOTONIC` (streams, the in-process heartbeat,
//! deadlines) and the wall clock (Unix time for records and the OpenAI `created` field, RFC 3339
//! for the flight recorder).
//!
//! The kernel gate compares its heartbeat in the kernel's own clock, not in these: that API
//! stays with the gate ([`crate::gate::KernelGate::beat`], `KernelGate::clock`).

use std::time::{SystemTime, UNIX_EPOCH};

/// `CLOCK_MONOTONIC` in nanoseconds, in this process's time namespace. Userspace's own clock:
/// it times streams and the in-process heartbeat, never what the kernel gate compares (the
/// gate has its own clock, see [`crate::gate::KernelGate::beat`]).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux, so
    // the call cannot fail.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    // Both fields are non-negative for CLOCK_MONOTONIC.
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64)
}

/// Whole seconds since the Unix epoch now (0 before it).
pub fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Milliseconds since the Unix epoch at `t` (0 before it).
pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Milliseconds since the Unix epoch now.
pub fn unix_ms_now() -> u64 {
    unix_ms(SystemTime::now())
}

/// Current time as RFC 3339 UTC with milliseconds, e.g. `2026-05-01T12:34:56.789Z`.
pub fn rfc3339_now() -> String {
    rfc3339(SystemTime::now())
}

/// `t` as RFC 3339 UTC with milliseconds (times before 1970 clamp to the epoch).
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, day) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_millis()
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
pub(crate) fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn rfc3339_formatting() {
        let at = |s: u64, ms: u64| {
            rfc3339(UNIX_EPOCH + Duration::from_secs(s) + Duration::from_millis(ms))
        };
        assert_eq!(at(0, 0), "1970-01-01T00:00:00.000Z");
        assert_eq!(at(951_782_400, 5), "2000-02-29T00:00:00.005Z");
        assert_eq!(at(1_709_251_199, 999), "2024-02-29T23:59:59.999Z");
        assert_eq!(at(1_709_251_200, 0), "2024-03-01T00:00:00.000Z");
        assert_eq!(at(4_102_444_800, 120), "2100-01-01T00:00:00.120Z");
        let now = rfc3339_now();
        assert!(now.ends_with('Z') && now.len() == 24, "{now}");
    }

    #[test]
    fn clocks_move_forward_and_agree_with_each_other() {
        let a = monotonic_ns();
        let b = monotonic_ns();
        assert!(b >= a);
        let ms = unix_ms_now();
        assert!(ms / 1000 >= unix_secs().saturating_sub(1));
        assert_eq!(
            unix_ms(UNIX_EPOCH - Duration::from_secs(1)),
            0,
            "before the epoch"
        );
    }
}
