//! Prometheus metrics (prometheus-client), served on `--metrics ADDR` at `/metrics`.
//!
//! Each subsystem defines its own families next to its code (`halt/metrics.rs`,
//! `gate/metrics.rs`, ...) and registers them on a sub-registry of the daemon's (prefix
//! `haltd`), and on a further prefixed one where its names share a prefix (`haltd_kernel_`,
//! `haltd_ledger_`, `haltd_upstream_`, `haltd_detector_`, `haltd_halt_`, `haltd_watchdog_`).
//! This module holds the registry, the families of the data plane and of requests (the data
//! plane is a driver above the halt core that holds every family, so its families stay with
//! the registry), and `build_info`:
//!
//! | subsystem | module | families |
//! |---|---|---|
//! | watchdog and halts | [`crate::halt::metrics`] | `halt_tokens_post_trip`, `halt_latency_seconds`, `watchdog_trips`, `halts`, `heartbeat_age_seconds` |
//! | kernel gate | [`crate::gate::metrics`] | `kernel_frames`, `kernel_segments`, `kernel_adoptions`, `kernel_halt_events`, `kernel_gate_enabled`, `gate_errors`, `ungovernable_connections` |
//! | data plane | [`dataplane`] | `streams_active`, `streams`, `requests_rejected`, `tokens_emitted`, `token_overhead_seconds`, `ring_events`, `keepalive_turns`, `keepalive_closes`, `client_tls_handshakes`, `client_tls_handshake_failures` |
//! | flight recorder | [`crate::ledger::metrics`] | `ledger_errors`, `ledger_records`, `turn_records`, `crashes_recovered` |
//! | degraded mode | [`crate::modes::metrics`] | `runtime_mode_changes`, `degraded_scopes` |
//! | upstream | [`crate::upstream::metrics`] | `upstream_failures`, `upstream_cancels`, `tool_calls` |
//! | detectors | [`crate::detect::metrics`] | `detector_trips`, `detector_observed` |
//! | TokenCircuit | [`crate::circuit::metrics`] | `tool_circuit_trips` |
//! | grounding | [`crate::grounding::metrics`] | `grounding_rounds`, `grounding_arm_seconds` |
//! | incident labels | [`crate::labels`] | `incident_labels` |
//! | requests | [`requests`] | `requests`, `time_to_first_token_seconds`, `inter_token_latency_seconds`, `request_duration_seconds`, `client_errors` (model labels bounded by [`models`]) |
//! | the binary | here | `build_info` (always 1; labels `version`, `commit`, `features`) |
//!
//! Handles are created once, at start. Label values are enums (each writes the spelling the
//! exposition always had), and every series of a fixed label set exists from the start. The
//! per-token path touches only `tokens_emitted`, `token_overhead` and the turn's own
//! `inter_token_latency` handle (relaxed atomic adds, no lock, no lookup: [`crate::histogram::NsHistogram`]);
//! everything else counts per turn, per halt or per scrape.

use prometheus_client::{
    encoding::{text::encode, EncodeLabelSet},
    metrics::{family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::build_info;

pub mod dataplane;
pub mod models;
pub mod requests;

/// The prefix of every metric name.
const PREFIX: &str = "haltd";

/// Every metric of the daemon, by subsystem.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub halts: crate::halt::metrics::HaltMetrics,
    pub gate: crate::gate::metrics::GateMetrics,
    pub dataplane: dataplane::DataPlaneMetrics,
    pub ledger: crate::ledger::metrics::LedgerMetrics,
    pub modes: crate::modes::metrics::ModeMetrics,
    pub upstream: crate::upstream::metrics::UpstreamMetrics,
    pub detectors: crate::detect::metrics::DetectorMetrics,
    pub requests: requests::RequestMetrics,
    pub circuit: crate::circuit::metrics::CircuitMetrics,
    pub grounding: crate::grounding::metrics::GroundingMetrics,
    pub policy: crate::policy::metrics::PolicyMetrics,
    pub labels: crate::labels::LabelMetrics,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let halts =
            crate::halt::metrics::HaltMetrics::register(registry.sub_registry_with_prefix(PREFIX));
        let gate =
            crate::gate::metrics::GateMetrics::register(registry.sub_registry_with_prefix(PREFIX));
        let dataplane =
            dataplane::DataPlaneMetrics::register(registry.sub_registry_with_prefix(PREFIX));
        let ledger = crate::ledger::metrics::LedgerMetrics::register(
            registry.sub_registry_with_prefix(PREFIX),
        );
        let modes =
            crate::modes::metrics::ModeMetrics::register(registry.sub_registry_with_prefix(PREFIX));
        let upstream = crate::upstream::metrics::UpstreamMetrics::register(
            registry.sub_registry_with_prefix(PREFIX),
        );
        let detectors = crate::detect::metrics::DetectorMetrics::register(
            registry.sub_registry_with_prefix(PREFIX),
        );
        let requests =
            requests::RequestMetrics::register(registry.sub_registry_with_prefix(PREFIX));
        let circuit = crate::circuit::metrics::CircuitMetrics::register(
            registry.sub_registry_with_prefix(PREFIX),
        );
        let grounding = crate::grounding::metrics::GroundingMetrics::register(
            registry.sub_registry_with_prefix(PREFIX),
        );
        let policy = crate::policy::metrics::PolicyMetrics::register(
            registry.sub_registry_with_prefix(PREFIX),
        );
        let labels =
            crate::labels::LabelMetrics::register(registry.sub_registry_with_prefix(PREFIX));
        register_build_info(registry.sub_registry_with_prefix(PREFIX));
        Metrics {
            policy,
            labels,
            requests,
            circuit,
            grounding,
            registry,
            halts,
            gate,
            dataplane,
            ledger,
            modes,
            upstream,
            detectors,
        }
    }

    /// A failed upstream exchange: an upstream failure by kind, unless the upstream refused
    /// the client's own request (its 4xx: an unknown model, a bad parameter), which is the
    /// client's error (`haltd_client_errors_total{reason="upstream_refused"}`).
    pub fn upstream_failed(&self, failure: &crate::upstream::UpstreamFailure) {
        if failure.source() == crate::upstream::FailureSource::Client {
            self.requests
                .client_error(requests::ClientError::UpstreamRefused);
        } else {
            self.upstream.failed(failure.kind);
        }
    }

    /// The exposition text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Encoding into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// The labels of `haltd_build_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
    commit: String,
    features: String,
}

/// `haltd_build_info{version, commit, features} 1`: what this binary is, so a dashboard shows
/// a test build (`features="fault-injection"`) for what it is.
fn register_build_info(registry: &mut Registry) {
    let family = Family::<BuildLabels, Gauge>::default();
    family
        .get_or_create(&BuildLabels {
            version: build_info::VERSION.to_owned(),
            commit: build_info::COMMIT.to_owned(),
            features: build_info::FEATURES.to_owned(),
        })
        .set(1);
    registry.register(
        "build_info",
        "Always 1; the labels say haltd's version, commit and compiled-in features",
        family,
    );
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        codes::FailureCode,
        stream::{Halter, Initiator},
    };

    fn op_trip() -> (FailureCode, Initiator) {
        (FailureCode::OperatorTrip, Initiator::Operator)
    }

    #[test]
    fn exposition_has_the_contract_names() {
        let m = Metrics::new();
        m.halts.observe(op_trip(), 2, 0.001, Halter::Emitter);
        m.gate.observe_kernel_totals(&[5, 1, 1, 0, 0, 0, 0]);
        m.gate.observe_kernel_totals(&[7, 1, 1, 2, 0, 0, 0]);
        let text = m.encode();
        for name in [
            "haltd_halt_tokens_post_trip_bucket",
            "haltd_halt_latency_seconds_bucket",
            "haltd_watchdog_trips_total{cause=\"OPERATOR_TRIP\",initiator=\"operator\"} 1",
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
    fn an_upstream_4xx_is_a_client_error_and_no_upstream_failure() {
        use crate::upstream::{UpstreamFailure, UpstreamFailureKind::HttpStatus};
        let m = Metrics::new();
        m.upstream_failed(&UpstreamFailure::new(
            HttpStatus,
            "no such model".into(),
            Some(404),
        ));
        let text = m.encode();
        assert!(
            text.contains("haltd_client_errors_total{reason=\"upstream_refused\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("haltd_upstream_failures_total{kind=\"http_status\"} 0"),
            "{text}"
        );
        m.upstream_failed(&UpstreamFailure::new(HttpStatus, "boom".into(), Some(500)));
        assert!(m
            .encode()
            .contains("haltd_upstream_failures_total{kind=\"http_status\"} 1"));
    }

    #[test]
    fn the_lock_free_histogram_buckets_like_prometheus() {
        let m = Metrics::new();
        let h = &m.dataplane.token_overhead;
        assert_eq!(dataplane::TOKEN_OVERHEAD_BUCKETS_NS[0], 5_000);
        assert_eq!(dataplane::TOKEN_OVERHEAD_BUCKETS_NS[15], 163_840_000);
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

    /// The exposition of the metrics as they were registered before each subsystem had its
    /// own sub-registry (sorted lines: prometheus-client writes a family's series in hash
    /// order, and the families now come subsystem by subsystem): every name, label, HELP
    /// text, unit and type is unchanged. Families added since (`haltd_upstream_pool_*`) are
    /// in the golden file too; `haltd_build_info`'s series, whose labels change with every
    /// commit, stands there as `haltd_build_info{BUILD} 1`. `UPDATE_DOCS=1` rewrites the file.
    #[test]
    fn the_exposition_is_unchanged_line_for_line() {
        let m = Metrics::new();
        m.halts.observe(op_trip(), 2, 0.001, Halter::Emitter);
        m.gate
            .observe_kernel_totals(&[5, 1, 1, 0, 0, 0, 0, 3, 1, 1, 2, 1, 0]);
        m.dataplane.token_overhead.observe_ns(12_000);
        let build = format!(
            "haltd_build_info{{version=\"{}\",commit=\"{}\",features=\"{}\"}} 1",
            build_info::VERSION,
            build_info::COMMIT,
            build_info::FEATURES
        );
        let mut lines: Vec<String> = m
            .encode()
            .lines()
            .map(|l| {
                if l == build {
                    "haltd_build_info{BUILD} 1".to_owned()
                } else {
                    l.to_owned()
                }
            })
            .collect();
        lines.sort();
        if std::env::var_os("UPDATE_DOCS").is_some() {
            // As docs/configuration.md: regenerate with `UPDATE_DOCS=1 cargo test -p haltd
            // metrics::`, then read the diff.
            let path = concat!(env!("CARGO_MANIFEST_DIR"), "/src/metrics/exposition.golden");
            std::fs::write(path, lines.join("\n") + "\n").expect("writing the golden file");
            return;
        }
        let golden: Vec<&str> = include_str!("metrics/exposition.golden").lines().collect();
        assert_eq!(lines, golden);
    }
}
