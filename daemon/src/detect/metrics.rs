//! The detectors: streams they tripped, findings they only observed, and the statistics and
//! operating points the dashboard plots next to them (spec 000 §5: PR/EWMA/CUSUM).

use std::sync::atomic::AtomicU64;

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};
use serde_json::Value;

use crate::{
    codes::FailureCode,
    detect::{pipeline::DetectorsConfig, DetectorId},
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DetectorLabels {
    pub detector: DetectorId,
    pub code: FailureCode,
}

/// A chart of the latency detector (`[detectors.latency_anomaly] method` picks the one that
/// decides; both are computed).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Chart {
    Cusum,
    Ewma,
}

impl Chart {
    pub const ALL: [Chart; 2] = [Chart::Cusum, Chart::Ewma];

    pub const fn as_str(self) -> &'static str {
        match self {
            Chart::Cusum => "cusum",
            Chart::Ewma => "ewma",
        }
    }
}

/// Which way a chart looks: latency up (slower tokens) or down (faster).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Side {
    Up,
    Down,
}

impl Side {
    pub const ALL: [Side; 2] = [Side::Up, Side::Down];

    pub const fn as_str(self) -> &'static str {
        match self {
            Side::Up => "up",
            Side::Down => "down",
        }
    }
}

impl EncodeLabelValue for Chart {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

impl EncodeLabelValue for Side {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ChartLabels {
    pub chart: Chart,
    pub direction: Side,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitLabels {
    pub chart: Chart,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// `haltd_detector_trips_total`, `haltd_detector_observed_total`, and the gauges of the
/// latency charts and the surprise detector's operating point.
#[derive(Debug)]
pub struct DetectorMetrics {
    pub trips: Family<DetectorLabels, Counter>,
    pub observed: Family<DetectorLabels, Counter>,
    /// `haltd_detector_latency_statistic{chart, direction}`.
    latency_statistic: Family<ChartLabels, FloatGauge>,
    /// `haltd_detector_latency_limit{chart}`.
    latency_limit: Family<LimitLabels, FloatGauge>,
    /// `haltd_detector_surprise_threshold`, `haltd_detector_surprise_window_tokens`,
    /// `haltd_detector_surprise_statistic` (bits: promtool takes a `_bits` suffix for a data
    /// size).
    surprise_threshold: FloatGauge,
    surprise_window: Gauge,
    surprise_statistic: FloatGauge,
}

impl DetectorMetrics {
    /// Registers on `reg` (prefix `haltd`), on the detectors' `detector_` sub-registry. Every
    /// gauge's series exist from the start (0 until a turn or the configuration sets them).
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
        let latency_statistic = Family::<ChartLabels, FloatGauge>::default();
        detector.register(
            "latency_statistic",
            "The largest value each chart of the latency_anomaly detector reached in the last turn it judged, by chart and direction: CUSUM in within-turn standard deviations (it breaches above haltd_detector_latency_limit{chart=\"cusum\"}), EWMA as a fraction of its control limit (breaches above 1)",
            latency_statistic.clone(),
        );
        let latency_limit = Family::<LimitLabels, FloatGauge>::default();
        detector.register(
            "latency_limit",
            "The limit of each latency_anomaly chart in force: [detectors.latency_anomaly] h for CUSUM, 1 for EWMA (its statistic is a fraction of the limit)",
            latency_limit.clone(),
        );
        for chart in Chart::ALL {
            drop(latency_limit.get_or_create(&LimitLabels { chart }));
            for direction in Side::ALL {
                drop(latency_statistic.get_or_create(&ChartLabels { chart, direction }));
            }
        }
        let surprise_threshold = FloatGauge::default();
        detector.register(
            "surprise_threshold",
            "The surprise detector's operating point in force, in bits: [detectors.surprise] threshold_bits (haltctl calibrate picks it)",
            surprise_threshold.clone(),
        );
        let surprise_window = Gauge::default();
        detector.register(
            "surprise_window_tokens",
            "The surprise detector's rolling window W in force ([detectors.surprise] window)",
            surprise_window.clone(),
        );
        let surprise_statistic = FloatGauge::default();
        detector.register(
            "surprise_statistic",
            "The largest value the surprise detector's statistic (mean or p90 of its window, in bits) reached in the last turn it scored; it breaches above haltd_detector_surprise_threshold",
            surprise_statistic.clone(),
        );
        DetectorMetrics {
            trips,
            observed,
            latency_statistic,
            latency_limit,
            surprise_threshold,
            surprise_window,
            surprise_statistic,
        }
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

    /// The operating points of a configuration now in force (at start, and after a reload).
    pub fn operating_point(&self, cfg: &DetectorsConfig) {
        let limit = |chart| self.latency_limit.get_or_create(&LimitLabels { chart });
        limit(Chart::Cusum).set(cfg.latency_anomaly.cfg.h);
        limit(Chart::Ewma).set(1.0);
        self.surprise_threshold.set(cfg.surprise.cfg.threshold_bits);
        self.surprise_window
            .set(i64::try_from(cfg.surprise.cfg.window).unwrap_or(i64::MAX));
    }

    /// What a turn's detectors measured (their summaries, `TurnGovernor::summary`): the
    /// latency charts' largest values if the detector judged the turn, the surprise
    /// statistic's largest value if it scored one. Once per turn.
    pub fn turn_ended(&self, summaries: &Value) {
        let latency = summaries.pointer("/latency_anomaly/summary");
        if let Some(s) = latency.filter(|s| s["judged"] == true) {
            for chart in Chart::ALL {
                for direction in Side::ALL {
                    let key = format!("{}_{}_max", chart.as_str(), direction.as_str());
                    if let Some(v) = s[key.as_str()].as_f64() {
                        self.latency_statistic
                            .get_or_create(&ChartLabels { chart, direction })
                            .set(v);
                    }
                }
            }
        }
        let Some(s) = summaries.pointer("/surprise/summary") else {
            return;
        };
        let key = match s["statistic"].as_str() {
            Some("p90") => "max_p90_bits",
            _ => "max_mean_bits",
        };
        if let Some(v) = s[key].as_f64() {
            self.surprise_statistic.set(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::metrics::Metrics;

    fn line<'a>(text: &'a str, series: &str) -> Option<&'a str> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
    }

    #[test]
    fn the_charts_and_the_operating_point_reach_the_exposition() {
        let m = Metrics::new();
        let text = m.encode();
        let cusum_up = r#"haltd_detector_latency_statistic{chart="cusum",direction="up"}"#;
        assert_eq!(line(&text, cusum_up), Some("0.0"), "{text}");
        let mut cfg = DetectorsConfig::load(None, 0.0).expect("defaults");
        cfg.surprise.cfg.threshold_bits = 2.5;
        m.detectors.operating_point(&cfg);
        // A turn the latency detector did not judge (warming up) leaves the charts alone.
        m.detectors.turn_ended(&json!({
            "latency_anomaly": {"summary": {"judged": false, "cusum_up_max": 7.0}},
            "surprise": {"summary": {"statistic": "p90", "max_mean_bits": 1.0, "max_p90_bits": 3.25}},
        }));
        let text = m.encode();
        assert_eq!(line(&text, cusum_up), Some("0.0"), "{text}");
        assert_eq!(
            line(&text, "haltd_detector_surprise_statistic"),
            Some("3.25")
        );
        assert_eq!(
            line(&text, "haltd_detector_surprise_threshold"),
            Some("2.5")
        );
        assert_eq!(
            line(&text, "haltd_detector_surprise_window_tokens"),
            Some("16")
        );
        assert_eq!(
            line(&text, r#"haltd_detector_latency_limit{chart="cusum"}"#),
            Some("8.0")
        );
        m.detectors.turn_ended(&json!({
            "latency_anomaly": {"summary": {"judged": true, "cusum_up_max": 9.5,
                "cusum_down_max": 0.25, "ewma_up_max": 1.5, "ewma_down_max": -0.5}},
        }));
        let text = m.encode();
        assert_eq!(line(&text, cusum_up), Some("9.5"));
        assert_eq!(
            line(
                &text,
                r#"haltd_detector_latency_statistic{chart="ewma",direction="down"}"#
            ),
            Some("-0.5")
        );
        // No surprise summary (the detector is off): its statistic stays.
        assert_eq!(
            line(&text, "haltd_detector_surprise_statistic"),
            Some("3.25")
        );
    }
}
