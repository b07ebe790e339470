//! The detectors: streams they tripped, findings they only observed.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};

use crate::{codes::FailureCode, detect::DetectorId};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DetectorLabels {
    pub detector: DetectorId,
    pub code: FailureCode,
}

/// `haltd_detector_trips_total`, `haltd_detector_observed_total`.
#[derive(Debug)]
pub struct DetectorMetrics {
    pub trips: Family<DetectorLabels, Counter>,
    pub observed: Family<DetectorLabels, Counter>,
}

impl DetectorMetrics {
    /// Registers on `reg` (prefix `haltd`), on the detectors' `detector_` sub-registry.
    pub fn register(reg: &mut Registry) -> Self {
        let detector = reg.sub_registry_with_prefix("detector");
        let trips = Family::<DetectorLabels, Counter>::default();
        detector.register(
            "trips",
            "Streams tripped by a detector, by detector and failure code (DETECTOR_FAILURE: it could not judge)",
            trips.clone(),
        );
        let observed = Family::<DetectorLabels, Counter>::default();
        detector.register(
            "observed",
            "Observe-mode detector findings (breaches, or DETECTOR_FAILURE when it could not judge); nothing was tripped",
            observed.clone(),
        );
        DetectorMetrics { trips, observed }
    }

    /// A stream tripped by `detector` with `code`.
    pub fn tripped(&self, detector: DetectorId, code: FailureCode) {
        self.trips
            .get_or_create(&DetectorLabels { detector, code })
            .inc();
    }

    /// An observe-mode finding of `detector` with `code`.
    pub fn observed(&self, detector: DetectorId, code: FailureCode) {
        self.observed
            .get_or_create(&DetectorLabels { detector, code })
            .inc();
    }
}
