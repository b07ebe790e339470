//! What the timing detectors share: the latency buckets, the gap floor, config errors.

use thiserror::Error;

/// Every value [`latency_bucket`] gives.
pub const LATENCY_BUCKETS: [&str; 4] = ["le_1ms", "le_10ms", "le_100ms", "gt_100ms"];

/// Mean inter-token latency bucket of a turn (FHR `latency_bucket`): `le_1ms`, `le_10ms`,
/// `le_100ms` or `gt_100ms`.
pub fn latency_bucket(mean_gap_ns: u64) -> &'static str {
    match mean_gap_ns {
        0..=1_000_000 => "le_1ms",
        1_000_001..=10_000_000 => "le_10ms",
        10_000_001..=100_000_000 => "le_100ms",
        _ => "gt_100ms",
    }
}

/// Gaps are floored here before their log is taken: below it, tokens arrived together.
pub const GAP_FLOOR_NS: u64 = 1_000;

pub(super) const NS_PER_MS: u64 = 1_000_000;

/// A configuration value out of range; `key` is the config key (`section.field`).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("{key} = {value}: {expected}")]
pub struct TimingConfigError {
    pub key: &'static str,
    pub value: String,
    pub expected: &'static str,
}

pub(super) fn check_f64(
    key: &'static str,
    value: f64,
    ok: bool,
    expected: &'static str,
) -> Result<(), TimingConfigError> {
    if value.is_finite() && ok {
        Ok(())
    } else {
        Err(TimingConfigError {
            key,
            value: value.to_string(),
            expected,
        })
    }
}
