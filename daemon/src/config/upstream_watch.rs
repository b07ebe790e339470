//! How the upstream is watched: the `--upstream-probe-*` and `--upstream-resolve-*` flags,
//! checked (the thread that uses them: `upstream_watch.rs`).

use std::time::Duration;

use super::{err, ConfigError, ServeArgs};

/// How the upstream is probed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeSettings {
    pub path: String,
    pub interval: Duration,
    pub timeout: Duration,
    pub failures: u32,
    pub successes: u32,
}

/// How the upstream is watched (the `--upstream-probe-*` and `--upstream-resolve-*` flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchSettings {
    /// `None`: `--no-upstream-probe`.
    pub probe: Option<ProbeSettings>,
    pub resolve_interval: Duration,
}

impl WatchSettings {
    /// The settings of `args`, checked.
    pub fn from_args(args: &ServeArgs) -> Result<Self, ConfigError> {
        let path = &args.upstream_probe_path;
        if !path.starts_with('/') || !path.bytes().all(|b| b.is_ascii_graphic()) || path.len() > 512
        {
            return Err(err(
                "upstream-probe-path",
                format!(
                    "{path:?}: an absolute path of printable ASCII (e.g. /v1/models or /health)"
                ),
            ));
        }
        for (flag, v) in [
            (
                "upstream-probe-interval-ms",
                args.upstream_probe_interval_ms,
            ),
            ("upstream-probe-timeout-ms", args.upstream_probe_timeout_ms),
            (
                "upstream-probe-failures",
                u64::from(args.upstream_probe_failures),
            ),
            (
                "upstream-probe-successes",
                u64::from(args.upstream_probe_successes),
            ),
            (
                "upstream-resolve-interval-ms",
                args.upstream_resolve_interval_ms,
            ),
        ] {
            if v == 0 {
                return Err(err(
                    flag,
                    "must be at least 1 (--no-upstream-probe turns the probe off)",
                ));
            }
        }
        let probe = (!args.no_upstream_probe).then(|| ProbeSettings {
            path: path.clone(),
            interval: Duration::from_millis(args.upstream_probe_interval_ms),
            timeout: Duration::from_millis(args.upstream_probe_timeout_ms),
            failures: args.upstream_probe_failures,
            successes: args.upstream_probe_successes,
        });
        Ok(WatchSettings {
            probe,
            resolve_interval: Duration::from_millis(args.upstream_resolve_interval_ms),
        })
    }
}
