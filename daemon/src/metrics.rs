//! Prometheus metrics (prometheus-client), served on `--metrics ADDR` at `/metrics`.
//!
//! Handles are created once; the per-token path touches only `tokens_emitted` and
//! `token_overhead` (relaxed atomic adds, no lock: [`NsHistogram`]). Kernel verdict counters live in per-CPU BPF maps; they are summed at scrape time and
//! the difference since the last scrape is added to `haltd_kernel_frames_total`, so the
//! counter stays monotonic and BPF remains their only writer.

use std::sync::{
    atomic::{AtomicU64, Ordering::Relaxed},
    Arc, Mutex,
};

use prometheus_client::{
    encoding::{text::encode, EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram, MetricType},
    registry::{Registry, Unit},
};

use crate::{
    codes::FailureCode,
    detect::DetectorId,
    upstream::{CancelReason, UpstreamFailureKind},
};

/// Post-trip token buckets: every value up to 10 (B is usually ≤ 5), then coarse.
pub const POST_TRIP_TOKEN_BUCKETS: [f64; 14] = [
    0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 20.0, 50.0, 100.0,
];
/// Halt latency buckets, 50 µs to 5 s.
pub const HALT_LATENCY_BUCKETS: [f64; 14] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0,
];

/// `haltd_token_overhead_seconds` bucket bounds in ns: 5 µs doubling to 164 ms.
pub const TOKEN_OVERHEAD_BUCKETS_NS: [u64; 16] = {
    let mut b = [0; 16];
    let mut i = 0;
    while i < b.len() {
        b[i] = 5_000 << i;
        i += 1;
    }
    b
};

/// A histogram of durations for the per-token path. prometheus-client's `Histogram` takes a
/// mutex per observation; this one is lock-free and allocation-free: an observation is two
/// relaxed atomic adds (its bucket and the sum, in integer ns). A scrape reads the buckets one
/// by one, so one taken during observations may be a few observations behind in some buckets
/// (`_count` is always the sum of the buckets it read). Clones share the counts.
#[derive(Clone, Debug)]
pub struct NsHistogram {
    inner: Arc<NsInner>,
}

#[derive(Debug)]
struct NsInner {
    /// Upper bounds (inclusive), ascending.
    bounds_ns: Box<[u64]>,
    /// One count per bound, then the +Inf bucket (not cumulative).
    counts: Box<[AtomicU64]>,
    sum_ns: AtomicU64,
}

impl NsHistogram {
    pub fn new(bounds_ns: &[u64]) -> Self {
        debug_assert!(
            bounds_ns.windows(2).all(|w| w[0] < w[1]),
            "ascending bounds"
        );
        NsHistogram {
            inner: Arc::new(NsInner {
                bounds_ns: bounds_ns.into(),
                counts: (0..=bounds_ns.len()).map(|_| AtomicU64::new(0)).collect(),
                sum_ns: AtomicU64::new(0),
            }),
        }
    }

    /// Records one duration.
    pub fn observe_ns(&self, ns: u64) {
        let i = self.inner.bounds_ns.partition_point(|&b| b < ns);
        self.inner.counts[i].fetch_add(1, Relaxed);
        self.inner.sum_ns.fetch_add(ns, Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.inner.counts.iter().map(|c| c.load(Relaxed)).sum()
    }
}

impl EncodeMetric for NsHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        // At scrape time, not per token: allocating here is fine.
        let buckets: Vec<(f64, u64)> = self
            .inner
            .bounds_ns
            .iter()
            .map(|&b| b as f64 / 1e9)
            .chain(std::iter::once(f64::INFINITY))
            .zip(self.inner.counts.iter().map(|c| c.load(Relaxed)))
            .collect();
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = self.inner.sum_ns.load(Relaxed) as f64 / 1e9;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CauseLabels {
    pub cause: FailureCode,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerdictLabels {
    pub verdict: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HalterLabels {
    pub halted_by: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabels {
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeChangeLabels {
    pub to: &'static str,
    pub by: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CancelLabels {
    pub reason: CancelReason,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamFailureLabels {
    pub kind: UpstreamFailureKind,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub decision: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DetectorLabels {
    pub detector: DetectorId,
    pub code: FailureCode,
}

/// Kinds of `haltd_ring_events_total`, every one a series from the start.
pub const RING_EVENT_KINDS: [&str; 5] = [
    "cq_overflow",
    "cq_dropped",
    "sq_dropped",
    "sq_full",
    "submit_error",
];

/// All metric handles of the daemon.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub halt_tokens_post_trip: Histogram,
    pub halt_latency_seconds: Histogram,
    pub watchdog_trips: Family<CauseLabels, Counter>,
    pub halts_by: Family<HalterLabels, Counter>,
    pub kernel_frames: Family<VerdictLabels, Counter>,
    pub kernel_segments: Family<VerdictLabels, Counter>,
    pub kernel_adoptions: Family<VerdictLabels, Counter>,
    pub kernel_halt_events: Counter,
    pub streams_active: Gauge,
    pub streams_total: Family<OutcomeLabels, Counter>,
    pub requests_rejected: Family<StatusLabels, Counter>,
    pub tokens_emitted: Counter,
    pub heartbeat_age_seconds: Gauge<f64, AtomicU64>,
    pub kernel_gate_enabled: Gauge,
    pub gate_errors: Counter,
    pub ungovernable_connections: Counter,
    pub ledger_errors: Counter,
    pub ledger_records: Gauge,
    pub mode_changes: Family<ModeChangeLabels, Counter>,
    pub degraded_scopes: Gauge,
    pub upstream_failures: Family<UpstreamFailureLabels, Counter>,
    pub upstream_cancels: Family<CancelLabels, Counter>,
    pub tool_calls: Family<KindLabels, Counter>,
    pub detector_trips: Family<DetectorLabels, Counter>,
    pub detector_observed: Family<DetectorLabels, Counter>,
    pub turn_records: Family<DecisionLabels, Counter>,
    pub token_overhead: NsHistogram,
    pub ring_events: Family<KindLabels, Counter>,
    pub crashes_recovered: Counter,
    /// Last per-verdict totals read from BPF, to turn them into increments.
    kernel_last: Mutex<Vec<u64>>,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("haltd");
        let halt_tokens_post_trip = Histogram::new(POST_TRIP_TOKEN_BUCKETS);
        registry.register(
            "halt_tokens_post_trip",
            "Token frames that reached the client after the trip point, per halted stream",
            halt_tokens_post_trip.clone(),
        );
        let halt_latency_seconds = Histogram::new(HALT_LATENCY_BUCKETS);
        registry.register_with_unit(
            "halt_latency",
            "Time from the trip to the terminal frame (or close), per halted stream",
            Unit::Seconds,
            halt_latency_seconds.clone(),
        );
        let watchdog_trips = Family::<CauseLabels, Counter>::default();
        registry.register(
            "watchdog_trips",
            "Streams halted, by trip cause (WATCHDOG_TRIP events)",
            watchdog_trips.clone(),
        );
        let halts_by = Family::<HalterLabels, Counter>::default();
        registry.register(
            "halts",
            "Halts by who completed them (emitter or watchdog)",
            halts_by.clone(),
        );
        let kernel_frames = Family::<VerdictLabels, Counter>::default();
        registry.register(
            "kernel_frames",
            "Sends seen by the kernel halt gate, by verdict (summed BPF per-CPU counters)",
            kernel_frames.clone(),
        );
        let kernel_segments = Family::<VerdictLabels, Counter>::default();
        registry.register(
            "kernel_segments",
            "TCP segments of governed sockets judged by the kernel egress check, by verdict: pass, drop_ceiling (ends beyond the stream's post-trip byte ceiling; each retransmission counts), drop_unparsed (a tripped stream's segment whose TCP header could not be read)",
            kernel_segments.clone(),
        );
        let kernel_adoptions = Family::<VerdictLabels, Counter>::default();
        registry.register(
            "kernel_adoptions",
            "Connections on the client port the kernel governed at establishment (adopted), or could not (failed: its socket map was full; haltd refuses those)",
            kernel_adoptions.clone(),
        );
        let kernel_halt_events = Counter::default();
        registry.register(
            "kernel_halt_events",
            "Sockets on which the kernel gate dropped a send",
            kernel_halt_events.clone(),
        );
        let streams_active = Gauge::default();
        registry.register(
            "streams_active",
            "Open client connections (governed streams)",
            streams_active.clone(),
        );
        let streams_total = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "streams",
            "Finished streams by outcome",
            streams_total.clone(),
        );
        let requests_rejected = Family::<StatusLabels, Counter>::default();
        registry.register(
            "requests_rejected",
            "Requests answered with an error status",
            requests_rejected.clone(),
        );
        let tokens_emitted = Counter::default();
        registry.register(
            "tokens_emitted",
            "Token frames the kernel accepted for clients",
            tokens_emitted.clone(),
        );
        let heartbeat_age_seconds = Gauge::<f64, AtomicU64>::default();
        registry.register_with_unit(
            "heartbeat_age",
            "Age of the watchdog heartbeat at scrape time",
            Unit::Seconds,
            heartbeat_age_seconds.clone(),
        );
        let kernel_gate_enabled = Gauge::default();
        registry.register(
            "kernel_gate_enabled",
            "1 when the kernel halt gate enforces budgets; 0 under --no-kernel-gate",
            kernel_gate_enabled.clone(),
        );
        let gate_errors = Counter::default();
        registry.register(
            "gate_errors",
            "Failed kernel gate operations (each one halts or refuses its stream)",
            gate_errors.clone(),
        );
        let ungovernable_connections = Counter::default();
        registry.register(
            "ungovernable_connections",
            "Accepted connections the kernel gate could not govern (its socket map full, or the connection no longer established); each is reset, never served",
            ungovernable_connections.clone(),
        );
        let ledger_errors = Counter::default();
        registry.register(
            "ledger_errors",
            "Flight-recorder records that could not be written",
            ledger_errors.clone(),
        );
        // Every series exists from the start, so dashboards and alerts see zeros, not gaps.
        for cause in FailureCode::ALL {
            drop(watchdog_trips.get_or_create(&CauseLabels { cause }));
        }
        for halted_by in ["emitter", "watchdog"] {
            drop(halts_by.get_or_create(&HalterLabels { halted_by }));
        }
        for i in 0..haltd_common::verdict::COUNT {
            let (family, verdict) =
                kernel_counter(&kernel_frames, &kernel_segments, &kernel_adoptions, i);
            drop(family.get_or_create(&VerdictLabels { verdict }));
        }
        let ledger_records = Gauge::default();
        registry.register(
            "ledger_records",
            "Flight-recorder records written since start (compare with the file to spot a cut-off tail)",
            ledger_records.clone(),
        );
        let mode_changes = Family::<ModeChangeLabels, Counter>::default();
        registry.register(
            "runtime_mode_changes",
            "Changes of runtime_mode (degraded safe mode), by new mode and by whom",
            mode_changes.clone(),
        );
        let degraded_scopes = Gauge::default();
        registry.register(
            "degraded_scopes",
            "Scopes (API keys, or the node) currently in degraded safe mode",
            degraded_scopes.clone(),
        );
        let upstream_failures = Family::<UpstreamFailureLabels, Counter>::default();
        registry.register(
            "upstream_failures",
            "Proxied turns that failed because of the upstream, by kind",
            upstream_failures.clone(),
        );
        let upstream_cancels = Family::<CancelLabels, Counter>::default();
        registry.register(
            "upstream_cancels",
            "Upstream generations cancelled (connection closed) before they ended, by reason",
            upstream_cancels.clone(),
        );
        let tool_calls = Family::<KindLabels, Counter>::default();
        registry.register(
            "tool_calls",
            "Tool calls seen in upstream streams: committed, dispatched (needs reconciliation) or suppressed (degraded mode)",
            tool_calls.clone(),
        );
        for (to, by) in [
            ("degraded", "halt"),
            ("full", "operator"),
            ("full", "timer"),
        ] {
            drop(mode_changes.get_or_create(&ModeChangeLabels { to, by }));
        }
        for kind in UpstreamFailureKind::ALL {
            drop(upstream_failures.get_or_create(&UpstreamFailureLabels { kind }));
        }
        for reason in CancelReason::ALL {
            drop(upstream_cancels.get_or_create(&CancelLabels { reason }));
        }
        for kind in ["committed", "dispatched", "suppressed"] {
            drop(tool_calls.get_or_create(&KindLabels { kind }));
        }
        let detector_trips = Family::<DetectorLabels, Counter>::default();
        registry.register(
            "detector_trips",
            "Streams tripped by a detector, by detector and failure code (DETECTOR_FAILURE: it could not judge)",
            detector_trips.clone(),
        );
        let detector_observed = Family::<DetectorLabels, Counter>::default();
        registry.register(
            "detector_observed",
            "Observe-mode detector findings (breaches, or DETECTOR_FAILURE when it could not judge); nothing was tripped",
            detector_observed.clone(),
        );
        let turn_records = Family::<DecisionLabels, Counter>::default();
        registry.register(
            "turn_records",
            "Finished turns by what the flight recorder did with their record: always (not a normal turn: incident, failure, finding), sampled (a normal turn drawn at --turn-sample-rate), skipped (a normal turn not drawn: no record)",
            turn_records.clone(),
        );
        for decision in crate::sampling::Decision::LABELS {
            drop(turn_records.get_or_create(&DecisionLabels { decision }));
        }
        let token_overhead = NsHistogram::new(&TOKEN_OVERHEAD_BUCKETS_NS);
        registry.register_with_unit(
            "token_overhead",
            "Streaming overhead per token frame: from the token's arrival at haltd (the upstream receive that carried it, or the built-in source producing it) to the completion of the send that carried its frame to the client",
            Unit::Seconds,
            token_overhead.clone(),
        );
        let ring_events = Family::<KindLabels, Counter>::default();
        registry.register(
            "ring_events",
            "Data-plane io_uring trouble, by kind: cq_overflow (loop passes that found the completion ring full, completions waiting in the kernel's backlog), cq_dropped (completions the kernel lost), sq_dropped (submissions the kernel rejected as invalid), sq_full (pushes that found the submission ring full and submitted early), submit_error (io_uring_enter failed; EBUSY and EAGAIN are retried, anything else stops the daemon)",
            ring_events.clone(),
        );
        for kind in RING_EVENT_KINDS {
            drop(ring_events.get_or_create(&KindLabels { kind }));
        }
        let crashes_recovered = Counter::default();
        registry.register(
            "crashes_recovered",
            "Uncontained panics of an earlier haltd on this ledger (each ended that process at once), recorded at this start from the crash file",
            crashes_recovered.clone(),
        );
        Metrics {
            crashes_recovered,
            ring_events,
            token_overhead,
            turn_records,
            detector_observed,
            detector_trips,
            mode_changes,
            degraded_scopes,
            upstream_failures,
            upstream_cancels,
            tool_calls,
            registry,
            halt_tokens_post_trip,
            halt_latency_seconds,
            watchdog_trips,
            halts_by,
            kernel_frames,
            kernel_segments,
            kernel_adoptions,
            kernel_halt_events,
            streams_active,
            streams_total,
            requests_rejected,
            tokens_emitted,
            heartbeat_age_seconds,
            kernel_gate_enabled,
            gate_errors,
            ungovernable_connections,
            ledger_errors,
            ledger_records,
            kernel_last: Mutex::new(vec![0; haltd_common::verdict::COUNT as usize]),
        }
    }

    /// Folds fresh BPF verdict totals into `haltd_kernel_frames_total`.
    pub fn observe_kernel_totals(&self, totals: &[u64]) {
        let mut last = self.kernel_last.lock().unwrap_or_else(|p| p.into_inner());
        for (i, (&now, prev)) in (0u32..).zip(totals.iter().zip(last.iter_mut())) {
            let (family, verdict) = kernel_counter(
                &self.kernel_frames,
                &self.kernel_segments,
                &self.kernel_adoptions,
                i,
            );
            let counter = family.get_or_create(&VerdictLabels { verdict });
            if now > *prev {
                counter.inc_by(now - *prev);
            }
            *prev = now.max(*prev);
        }
    }

    /// Records one completed halt.
    pub fn observe_halt(
        &self,
        cause: FailureCode,
        post_trip_tokens: u64,
        latency_s: f64,
        by: &'static str,
    ) {
        self.halt_tokens_post_trip.observe(post_trip_tokens as f64);
        self.halt_latency_seconds.observe(latency_s);
        self.watchdog_trips
            .get_or_create(&CauseLabels { cause })
            .inc();
        self.halts_by
            .get_or_create(&HalterLabels { halted_by: by })
            .inc();
    }

    /// The exposition text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Encoding into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Which metric family and label a kernel counter index belongs to: send verdicts go to
/// `haltd_kernel_frames_total`, egress verdicts to `haltd_kernel_segments_total`, adoptions
/// to `haltd_kernel_adoptions_total`.
fn kernel_counter<'a>(
    frames: &'a Family<VerdictLabels, Counter>,
    segments: &'a Family<VerdictLabels, Counter>,
    adoptions: &'a Family<VerdictLabels, Counter>,
    index: u32,
) -> (&'a Family<VerdictLabels, Counter>, &'static str) {
    use haltd_common::verdict;
    let name = verdict::NAMES
        .get(index as usize)
        .copied()
        .unwrap_or("unknown");
    match index {
        verdict::EGRESS_PASS | verdict::EGRESS_DROP_CEILING | verdict::EGRESS_DROP_UNPARSED => {
            (segments, name.trim_start_matches("egress_"))
        }
        verdict::ADOPTED => (adoptions, "adopted"),
        verdict::ADOPT_FAILED => (adoptions, "failed"),
        _ => (frames, name),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_the_contract_names() {
        let m = Metrics::new();
        m.observe_halt(FailureCode::OperatorTrip, 2, 0.001, "emitter");
        m.observe_kernel_totals(&[5, 1, 1, 0, 0, 0, 0]);
        m.observe_kernel_totals(&[7, 1, 1, 2, 0, 0, 0]);
        let text = m.encode();
        for name in [
            "haltd_halt_tokens_post_trip_bucket",
            "haltd_halt_latency_seconds_bucket",
            "haltd_watchdog_trips_total{cause=\"OPERATOR_TRIP\"} 1",
            "haltd_kernel_frames_total{verdict=\"pass\"} 7",
            "haltd_kernel_frames_total{verdict=\"drop_budget\"} 2",
            "haltd_streams_active",
            "haltd_tokens_emitted_total",
            "haltd_heartbeat_age_seconds",
            "haltd_turn_records_total{decision=\"skipped\"} 0",
            "haltd_token_overhead_seconds_count 0",
            "haltd_ring_events_total{kind=\"cq_overflow\"} 0",
            "haltd_ring_events_total{kind=\"submit_error\"} 0",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
    }

    #[test]
    fn the_lock_free_histogram_buckets_like_prometheus() {
        let m = Metrics::new();
        let h = &m.token_overhead;
        assert_eq!(TOKEN_OVERHEAD_BUCKETS_NS[0], 5_000);
        assert_eq!(TOKEN_OVERHEAD_BUCKETS_NS[15], 163_840_000);
        // On a bound counts in that bucket (le), above the last in +Inf.
        for ns in [
            0,
            5_000,
            5_001,
            10_000,
            163_840_000,
            163_840_001,
            u64::MAX / 4,
        ] {
            h.observe_ns(ns);
        }
        assert_eq!(h.count(), 7);
        let text = m.encode();
        let line = |le: &str| {
            let prefix = format!("haltd_token_overhead_seconds_bucket{{le=\"{le}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&prefix))
                .unwrap_or_else(|| panic!("no bucket {le} in\n{text}"))
                .parse::<u64>()
                .expect("count")
        };
        assert_eq!(line("0.000005"), 2);
        assert_eq!(line("0.00001"), 4);
        assert_eq!(line("0.08192"), 4);
        assert_eq!(line("0.16384"), 5);
        assert_eq!(line("+Inf"), 7);
        assert!(
            text.contains("haltd_token_overhead_seconds_count 7"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE haltd_token_overhead_seconds histogram"),
            "{text}"
        );
        assert!(
            text.contains("# UNIT haltd_token_overhead_seconds seconds"),
            "{text}"
        );
    }
}
