//! The upstream's watch thread (`haltd-upstream`): resolves the upstream's host name and
//! probes it, off the data plane, and publishes both in [`UpstreamHealth`].
//!
//! - **Resolution.** The name is resolved once before haltd serves, then every
//!   `--upstream-resolve-interval-ms` and after each failed probe; new upstream connections
//!   use the latest addresses. A name that does not resolve (at start or later, with no
//!   earlier addresses) is retried with backoff (100 ms doubling up to 5 s), logged each time;
//!   meanwhile `/readyz` is 503 and turns get 503 `upstream_unresolved`. haltd does not exit.
//! - **Probe** (`upstream_watch/probe.rs`): every `--upstream-probe-interval-ms`; `--upstream-probe-failures`
//!   failures in a row make the upstream down (haltd not ready), `--upstream-probe-successes`
//!   successes in a row make it up again. It starts down: ready after the first success. A
//!   probe that times out while some turn received upstream bytes within the last interval ×
//!   failures does not count: the backend is busy, not gone (a backend that serves one
//!   request at a time answers nothing else while it streams a long reply).

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use crate::{
    config::ProbeSettings,
    halt::HaltCore,
    upstream::health::{UpstreamHealth, Verdict},
};

pub mod probe;

use probe::{probe, Target};

/// First wait before resolving again a name that did not resolve.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest wait between attempts to resolve a name that does not resolve.
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// How one probe went.
enum Probed {
    Answer(probe::Answer),
    /// It timed out while turns were receiving from the upstream: busy, not down.
    Busy(String),
    Failed(String),
}

/// Resolves the upstream's name once (before haltd serves, so that the first turns find it;
/// a failure is logged and retried by the thread) and starts the watch thread. Nothing to do
/// with the built-in source.
pub fn start(shared: &Arc<HaltCore>) -> std::io::Result<()> {
    let Some(health) = &shared.upstream_health else {
        return Ok(());
    };
    let mut watch = Watch {
        shared: Arc::clone(shared),
        next_resolve: Instant::now(),
        backoff: BACKOFF_MIN,
        verdict: Verdict::clone(&health.verdict()),
    };
    watch.resolve();
    std::thread::Builder::new()
        .name("haltd-upstream".to_owned())
        .spawn(move || watch.run())
        .map(drop)
}

struct Watch {
    shared: Arc<HaltCore>,
    next_resolve: Instant,
    backoff: Duration,
    verdict: Verdict,
}

impl Watch {
    fn health(&self) -> &UpstreamHealth {
        self.shared
            .upstream_health
            .as_ref()
            .expect("the watch runs with an upstream")
    }

    fn run(mut self) {
        let settings = self.shared.cfg.upstream_watch.clone();
        loop {
            if Instant::now() >= self.next_resolve {
                self.resolve();
            }
            let Some(probe) = &settings.probe else {
                std::thread::sleep(self.next_resolve.saturating_duration_since(Instant::now()));
                continue;
            };
            let started = Instant::now();
            if !self.probe_once(probe) {
                // Re-resolve before the next probe: the upstream may have moved.
                self.next_resolve = self.next_resolve.min(Instant::now());
            }
            let next_probe = started + probe.interval;
            let wake = next_probe.min(self.next_resolve.max(started + BACKOFF_MIN));
            std::thread::sleep(wake.saturating_duration_since(Instant::now()));
        }
    }

    /// Resolves the name now and schedules the next resolution.
    fn resolve(&mut self) {
        let Some(url) = self.shared.cfg.upstream.as_ref() else {
            return;
        };
        let interval = self.shared.cfg.upstream_watch.resolve_interval;
        match url.resolve() {
            Ok(addrs) => {
                let shown = addrs.clone();
                if self.health().set_resolution(Ok(addrs)) {
                    tracing::info!(upstream = %url, addresses = ?shown, "upstream name resolved; new connections use these addresses");
                }
                self.backoff = BACKOFF_MIN;
                self.next_resolve = Instant::now() + interval;
            }
            Err(e) => {
                self.shared.metrics.upstream.resolve_failures.inc();
                let resolved = self.health().is_resolved();
                let retry = if resolved {
                    interval.min(BACKOFF_MAX)
                } else {
                    self.backoff
                };
                tracing::warn!(upstream = %url, error = %e, retry_ms = retry.as_millis() as u64, kept_addresses = resolved, "cannot resolve the upstream's host name; retrying");
                self.health().set_resolution(Err(e.to_string()));
                self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
                self.next_resolve = Instant::now() + retry;
            }
        }
        if self.shared.cfg.upstream_watch.probe.is_none() {
            let up = self.health().is_up();
            self.shared.metrics.upstream.up.set(i64::from(up));
        }
    }

    /// Probes once and applies the thresholds; returns whether the probe succeeded.
    fn probe_once(&mut self, settings: &ProbeSettings) -> bool {
        let shared = Arc::clone(&self.shared);
        let (Some(url), Some(health)) = (&shared.cfg.upstream, &shared.upstream_health) else {
            return false;
        };
        let target = Target {
            url,
            tls: shared.cfg.upstream_tls.as_deref(),
            path: &settings.path,
            authorization: shared
                .cfg
                .upstream_api_key
                .as_ref()
                .map(|k| k.header_value()),
            timeout: settings.timeout,
        };
        let outcome = match health.addr() {
            Ok(addr) => probe(&target, addr).map_err(|e| (e.is_timeout(), e.to_string())),
            Err(e) => Err((false, e.message)),
        };
        // A backend that serves one request at a time (llama.cpp's server) leaves the probe
        // unanswered while it streams a long reply. A timeout while some turn received
        // upstream bytes within the failures' span is a busy backend, not a dead one: it
        // does not count (a refused connection or an error answer always does).
        let span = settings.interval * settings.failures.max(1);
        let busy = health.busy_within(crate::clock::monotonic_ns(), span);
        let outcome = match outcome {
            Ok(a) => Probed::Answer(a),
            Err((true, e)) if busy => Probed::Busy(e),
            Err((_, e)) => Probed::Failed(e),
        };
        let v = &mut self.verdict;
        let was_up = v.up;
        let ok = match outcome {
            Probed::Answer(answer) => {
                v.consecutive_successes = v.consecutive_successes.saturating_add(1);
                v.consecutive_failures = 0;
                if v.consecutive_successes >= settings.successes {
                    v.up = true;
                    v.last_error = None;
                }
                if let Some(models) = answer.models {
                    // The metrics' model labels follow the upstream's list (unless
                    // `--metric-models` fixed them): a client cannot grow the label set.
                    if *health.models() != models {
                        shared.metrics.requests.models.replace(models.clone());
                        health.set_models(models);
                    }
                }
                true
            }
            Probed::Busy(e) => {
                // Counted as a probe failure, not toward "down".
                shared.metrics.upstream.probe_failures.inc();
                tracing::debug!(upstream = %url, error = %e, "upstream probe timed out while a turn was receiving from the upstream: busy, not down");
                false
            }
            Probed::Failed(e) => {
                shared.metrics.upstream.probe_failures.inc();
                v.consecutive_failures = v.consecutive_failures.saturating_add(1);
                v.consecutive_successes = 0;
                if v.consecutive_failures >= settings.failures {
                    v.up = false;
                }
                tracing::debug!(upstream = %url, error = %e, failures = v.consecutive_failures, "upstream probe failed");
                v.last_error = Some(e);
                false
            }
        };
        if v.up != was_up {
            if v.up {
                tracing::info!(upstream = %url, path = settings.path, "upstream answers its probe: up");
            } else {
                tracing::warn!(upstream = %url, path = settings.path, failures = v.consecutive_failures, error = v.last_error.as_deref().unwrap_or_default(), "upstream is down: haltd is not ready until its probe succeeds");
            }
        }
        shared.metrics.upstream.up.set(i64::from(v.up));
        health.set_verdict(v.clone());
        ok
    }
}
