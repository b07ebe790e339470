//! The watchdog and the halts it and the emitters complete: post-trip tokens, halt latency,
//! trips by cause, halts by halter, the heartbeat's age.

use std::sync::atomic::AtomicU64;

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::{Registry, Unit},
};

use crate::{
    codes::FailureCode,
    stream::{Halter, Initiator},
};

/// Post-trip token buckets: every value up to 10 (B is usually ≤ 5), then coarse.
pub const POST_TRIP_TOKEN_BUCKETS: [f64; 14] = [
    0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 20.0, 50.0, 100.0,
];
/// Halt latency buckets, 50 µs to 5 s.
pub const HALT_LATENCY_BUCKETS: [f64; 14] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CauseLabels {
    pub cause: FailureCode,
    /// Who tripped: an operator may trip with any cause.
    pub initiator: Initiator,
}

impl prometheus_client::encoding::EncodeLabelValue for Initiator {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder<'_>,
    ) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HalterLabels {
    pub halted_by: Halter,
}

/// `haltd_halt_*`, `haltd_watchdog_trips_total`, `haltd_halts_total`,
/// `haltd_heartbeat_age_seconds`, `haltd_watchdog_idle`.
#[derive(Debug)]
pub struct HaltMetrics {
    pub tokens_post_trip: Histogram,
    pub latency_seconds: Histogram,
    pub watchdog_trips: Family<CauseLabels, Counter>,
    pub halts_by: Family<HalterLabels, Counter>,
    pub heartbeat_age_seconds: Gauge<f64, AtomicU64>,
    /// 1 while the watchdog is in idle mode (set at scrape time).
    pub watchdog_idle: Gauge,
}

impl HaltMetrics {
    /// Registers on `reg` (prefix `haltd`); the `halt_` families on a sub-registry of their
    /// own, the watchdog's trips on `watchdog_`.
    pub fn register(reg: &mut Registry) -> Self {
        let halt = reg.sub_registry_with_prefix("halt");
        let tokens_post_trip = Histogram::new(POST_TRIP_TOKEN_BUCKETS);
        halt.register(
            "tokens_post_trip",
            "Token frames that reached the client after the trip point, per halted stream",
            tokens_post_trip.clone(),
        );
        let latency_seconds = Histogram::new(HALT_LATENCY_BUCKETS);
        halt.register_with_unit(
            "latency",
            "Time from the trip to the terminal frame (or close), per halted stream",
            Unit::Seconds,
            latency_seconds.clone(),
        );
        let watchdog_trips = Family::<CauseLabels, Counter>::default();
        let watchdog = reg.sub_registry_with_prefix("watchdog");
        watchdog.register(
            "trips",
            "Streams halted, by trip cause and initiator (operator, detector, watchdog, kernel, shutdown, upstream, recorder, client) (WATCHDOG_TRIP events)",
            watchdog_trips.clone(),
        );
        let watchdog_idle = Gauge::default();
        watchdog.register(
            "idle",
            "1 while the watchdog is in idle mode (no stream open; it beats once a second and at once for a new connection)",
            watchdog_idle.clone(),
        );
        let halts_by = Family::<HalterLabels, Counter>::default();
        reg.register(
            "halts",
            "Halts by who completed them (emitter or watchdog)",
            halts_by.clone(),
        );
        let heartbeat_age_seconds = Gauge::<f64, AtomicU64>::default();
        reg.register_with_unit(
            "heartbeat_age",
            "Age of the watchdog heartbeat at scrape time",
            Unit::Seconds,
            heartbeat_age_seconds.clone(),
        );
        // Every series exists from the start, so dashboards and alerts see zeros, not gaps.
        // Each cause with the initiator it normally has, and a detector's cause also with the
        // operator, who may give one (other pairs appear when they happen). DETECTOR_FAILURE
        // and TOOL_CIRCUIT_OPEN are haltd's own: an operator cannot give them.
        for cause in FailureCode::ALL {
            let initiator = Initiator::of(cause);
            drop(watchdog_trips.get_or_create(&CauseLabels { cause, initiator }));
            let own = matches!(
                cause,
                FailureCode::DetectorFailure | FailureCode::ToolCircuitOpen
            );
            if initiator == Initiator::Detector && !own {
                let initiator = Initiator::Operator;
                drop(watchdog_trips.get_or_create(&CauseLabels { cause, initiator }));
            }
        }
        for halted_by in Halter::ALL {
            drop(halts_by.get_or_create(&HalterLabels { halted_by }));
        }
        HaltMetrics {
            tokens_post_trip,
            latency_seconds,
            watchdog_trips,
            halts_by,
            heartbeat_age_seconds,
            watchdog_idle,
        }
    }

    /// Records one completed halt.
    pub fn observe(
        &self,
        (cause, initiator): (FailureCode, Initiator),
        post_trip_tokens: u64,
        latency_s: f64,
        by: Halter,
    ) {
        self.tokens_post_trip.observe(post_trip_tokens as f64);
        self.latency_seconds.observe(latency_s);
        self.watchdog_trips
            .get_or_create(&CauseLabels { cause, initiator })
            .inc();
        self.halts_by
            .get_or_create(&HalterLabels { halted_by: by })
            .inc();
    }
}
