//! What haltd knows of its upstream between turns, shared by the thread that watches it
//! (`watch.rs`) and its readers: where the upstream is (the latest resolution of its host
//! name, which every new upstream connection of the data plane uses), whether it answers (the
//! probe's verdict, one of `/readyz`'s checks) and the model ids it lists (`GET /v1/models`).
//!
//! Readers never wait: each value is an atomic or an [`ArcSwap`], so a connect on the data
//! plane costs one lock-free load and a copy of the address.

use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use arc_swap::ArcSwap;
use serde::Serialize;

use crate::wire::HttpError;

/// The latest resolution of the upstream's host name.
#[derive(Debug, Default)]
struct Resolution {
    /// The addresses of the last resolution that gave any (a later failure keeps them).
    addrs: Vec<SocketAddr>,
    /// Why the last resolution failed; `None` once one succeeded after it.
    error: Option<String>,
}

/// The probe's verdict, as `/readyz` shows it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Verdict {
    /// Whether the upstream counts as up (the probe's thresholds applied).
    pub up: bool,
    /// Probes that failed in a row (0 after a success).
    pub consecutive_failures: u32,
    /// Probes that succeeded in a row (0 after a failure).
    pub consecutive_successes: u32,
    /// Why the last probe failed (kept until one succeeds).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// The upstream as the data plane and `/readyz` see it (see the module doc).
#[derive(Debug)]
pub struct UpstreamHealth {
    /// `host:port` of `--upstream`, for messages; empty with the built-in source.
    host: String,
    /// Whether the probe runs (`--no-upstream-probe` turns it off).
    probing: bool,
    resolved: ArcSwap<Resolution>,
    up: AtomicBool,
    verdict: ArcSwap<Verdict>,
    models: ArcSwap<Vec<String>>,
    /// When a turn last received bytes from the upstream (`CLOCK_MONOTONIC` ns; 0: never):
    /// a probe that times out meanwhile met a busy backend, not a dead one.
    last_bytes_ns: AtomicU64,
}

/// The upstream's part of `/readyz`.
#[derive(Debug, Serialize)]
pub struct Readiness {
    pub ok: bool,
    /// `host:port` of `--upstream`.
    pub upstream: String,
    /// The addresses new connections go to (empty: the name does not resolve yet).
    pub addresses: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resolve_error: Option<String>,
    /// `false` with `--no-upstream-probe`: then resolving is all that is checked.
    pub probing: bool,
    /// How many model ids the last successful probe of `/v1/models` listed.
    pub models: usize,
    #[serde(flatten)]
    pub verdict: Verdict,
}

impl UpstreamHealth {
    /// The state of an upstream at `host:port` not resolved nor probed yet (down until a
    /// probe answers, or, without the probe, until the name resolves).
    pub fn new(host: String, probing: bool) -> Self {
        UpstreamHealth {
            host,
            probing,
            resolved: ArcSwap::from_pointee(Resolution {
                addrs: Vec::new(),
                error: Some("not resolved yet".to_owned()),
            }),
            up: AtomicBool::new(false),
            verdict: ArcSwap::from_pointee(Verdict {
                last_error: probing.then(|| "no probe answered yet".to_owned()),
                ..Verdict::default()
            }),
            models: ArcSwap::from_pointee(Vec::new()),
            last_bytes_ns: AtomicU64::new(0),
        }
    }

    /// A turn received bytes from the upstream at `now_ns`: one relaxed store per receive.
    pub fn note_bytes(&self, now_ns: u64) {
        self.last_bytes_ns.store(now_ns, Ordering::Relaxed);
    }

    /// Whether some turn received upstream bytes within `window` before `now_ns`.
    pub fn busy_within(&self, now_ns: u64, window: Duration) -> bool {
        let last = self.last_bytes_ns.load(Ordering::Relaxed);
        last != 0 && now_ns.saturating_sub(last) <= window.as_nanos() as u64
    }

    /// The address a new upstream connection goes to: the first of the latest resolution.
    /// On the data plane: one lock-free load, no allocation unless the name never resolved.
    pub fn addr(&self) -> Result<SocketAddr, HttpError> {
        let resolved = self.resolved.load();
        resolved.addrs.first().copied().ok_or_else(|| {
            HttpError::new(
                503,
                "server_error",
                format!(
                    "the upstream host {} does not resolve (yet): {}; haltd retries",
                    self.host,
                    resolved.error.as_deref().unwrap_or("no addresses")
                ),
            )
            .with_code("upstream_unresolved")
        })
    }

    /// Stores a resolution's result; a failure keeps the addresses of an earlier success.
    /// Returns whether the addresses changed.
    pub fn set_resolution(&self, result: Result<Vec<SocketAddr>, String>) -> bool {
        let old = self.resolved.load();
        let next = match result {
            Ok(addrs) => Resolution { addrs, error: None },
            Err(error) => Resolution {
                addrs: old.addrs.clone(),
                error: Some(error),
            },
        };
        let changed = next.addrs != old.addrs;
        self.resolved.store(Arc::new(next));
        if !self.probing {
            self.up.store(self.is_resolved(), Ordering::Release);
        }
        changed
    }

    /// Whether the name resolved at least once.
    pub fn is_resolved(&self) -> bool {
        !self.resolved.load().addrs.is_empty()
    }

    /// Stores the probe's verdict.
    pub fn set_verdict(&self, verdict: Verdict) {
        self.up.store(verdict.up, Ordering::Release);
        self.verdict.store(Arc::new(verdict));
    }

    /// The probe's verdict so far.
    pub fn verdict(&self) -> Arc<Verdict> {
        self.verdict.load_full()
    }

    /// Whether the upstream counts as up: the probe's verdict, or without the probe whether
    /// the name resolved.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// The model ids the upstream listed at its last successful probe of `/v1/models`
    /// (empty before one, or without the probe).
    pub fn models(&self) -> Arc<Vec<String>> {
        self.models.load_full()
    }

    /// Stores the model ids of a successful probe.
    pub fn set_models(&self, models: Vec<String>) {
        if **self.models.load() != models {
            self.models.store(Arc::new(models));
        }
    }

    /// The upstream's part of `/readyz`. `ok` comes from the same snapshot as the counters
    /// it is shown with (the verdict, or without the probe the resolution), never from the
    /// `up` flag read apart: a probe landing between two reads would otherwise give a
    /// `/readyz` whose status disagrees with its own `consecutive_failures`.
    pub fn readiness(&self) -> Readiness {
        let resolved = self.resolved.load();
        let verdict = Verdict::clone(&self.verdict.load());
        Readiness {
            ok: if self.probing {
                verdict.up
            } else {
                !resolved.addrs.is_empty()
            },
            upstream: self.host.clone(),
            addresses: resolved.addrs.iter().map(ToString::to_string).collect(),
            resolve_error: resolved.error.clone(),
            probing: self.probing,
            models: self.models.load().len(),
            verdict,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unresolved_name_is_a_precise_503_until_it_resolves() {
        let h = UpstreamHealth::new("vllm.internal:8000".to_owned(), true);
        let e = h.addr().expect_err("nothing resolved yet");
        assert_eq!(e.status, 503);
        assert!(e.message.contains("vllm.internal:8000"), "{}", e.message);
        h.set_resolution(Err("Name or service not known".to_owned()));
        let e = h.addr().expect_err("still nothing");
        assert!(
            e.message.contains("Name or service not known"),
            "{}",
            e.message
        );
        let a: SocketAddr = "10.0.0.7:8000".parse().expect("addr");
        assert!(h.set_resolution(Ok(vec![a])));
        assert_eq!(h.addr().expect("resolved"), a);
        // A later failure keeps the addresses it had, and says why it could not refresh them.
        assert!(!h.set_resolution(Err("timeout".to_owned())));
        assert_eq!(h.addr().expect("kept"), a);
        assert_eq!(h.readiness().resolve_error.as_deref(), Some("timeout"));
        // Probing: resolving alone does not make it up.
        assert!(!h.is_up());
    }

    #[test]
    fn busy_means_bytes_within_the_window() {
        let h = UpstreamHealth::new("up:80".into(), true);
        let s = Duration::from_secs(1);
        assert!(!h.busy_within(5_000_000_000, s), "never received");
        h.note_bytes(4_500_000_000);
        assert!(h.busy_within(5_000_000_000, s));
        assert!(h.busy_within(5_500_000_000, s));
        assert!(!h.busy_within(5_500_000_001, s));
    }

    #[test]
    fn without_the_probe_up_means_resolved() {
        let h = UpstreamHealth::new("localhost:8000".to_owned(), false);
        assert!(!h.is_up());
        h.set_resolution(Ok(vec!["127.0.0.1:8000".parse().expect("addr")]));
        assert!(h.is_up());
        assert!(h.readiness().ok);
    }

    #[test]
    fn readiness_ok_always_agrees_with_the_counters_it_shows() {
        // A reader racing the prober: every snapshot must be self-consistent.
        let h = Arc::new(UpstreamHealth::new("127.0.0.1:9".to_owned(), true));
        h.set_verdict(Verdict {
            up: true,
            consecutive_successes: 1,
            ..Verdict::default()
        });
        let writer = {
            let h = Arc::clone(&h);
            std::thread::spawn(move || {
                for i in 0..20_000u32 {
                    let up = i % 3 != 0;
                    h.set_verdict(Verdict {
                        up,
                        consecutive_failures: u32::from(!up) * 2,
                        consecutive_successes: u32::from(up),
                        last_error: None,
                    });
                }
            })
        };
        let mut seen = 0u32;
        while !writer.is_finished() {
            let r = h.readiness();
            assert_eq!(r.ok, r.verdict.up, "{r:?}");
            assert_eq!(r.ok, r.verdict.consecutive_failures == 0, "{r:?}");
            seen += 1;
        }
        writer.join().expect("writer");
        assert!(seen > 0);
    }
}
