//! The policy's series: B per route, each detector's mode per route, and what each detector
//! did per mode and route (turns judged, findings, trips), as Tetragon counts per policy.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use super::{PolicySet, Profile};
use crate::detect::{pipeline::DETECTORS, DetectorId, DetectorMode};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabel {
    pub route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProfileLabel {
    pub profile: String,
}

/// A detector, the mode it ran in and the route.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DetectorRoute {
    pub detector: DetectorId,
    pub mode: String,
    pub route: String,
}

/// What one turn's detectors did, counted at its end.
#[derive(Clone, Copy, Debug)]
pub struct Judged {
    pub detector: DetectorId,
    pub mode: DetectorMode,
    pub findings: u64,
    pub tripped: bool,
}

/// `haltd_budget`, `haltd_detector_mode`, `haltd_profile`, `haltd_policy_*_total`.
#[derive(Debug)]
pub struct PolicyMetrics {
    pub budget: Family<RouteLabel, Gauge>,
    pub mode: Family<DetectorRoute, Gauge>,
    pub profile: Family<ProfileLabel, Gauge>,
    pub judged: Family<DetectorRoute, Counter>,
    pub findings: Family<DetectorRoute, Counter>,
    pub trips: Family<DetectorRoute, Counter>,
    pub refused: Counter,
}

/// The modes a detector's series are kept for.
const MODES: [DetectorMode; 4] = [
    DetectorMode::Hard,
    DetectorMode::Observe,
    DetectorMode::Intervene,
    DetectorMode::Off,
];

impl PolicyMetrics {
    /// Registers on `reg` (prefix `haltd`).
    pub fn register(reg: &mut Registry) -> Self {
        let m = PolicyMetrics {
            budget: Family::default(),
            mode: Family::default(),
            profile: Family::default(),
            judged: Family::default(),
            findings: Family::default(),
            trips: Family::default(),
            refused: Counter::default(),
        };
        reg.register(
            "budget",
            "Halt budget B in force per route (tokens that may reach a client after a trip)",
            m.budget.clone(),
        );
        reg.register(
            "detector_mode",
            "1 for the mode each detector runs in on each route (runtime switches included), 0 for the others",
            m.mode.clone(),
        );
        reg.register(
            "profile",
            "1 for the architecture profile in force (full or mkp), 0 for the other",
            m.profile.clone(),
        );
        reg.register(
            "policy_judged",
            "Turns a detector judged, by detector, the mode it ran in and route",
            m.judged.clone(),
        );
        reg.register(
            "policy_findings",
            "Detector findings (breaches or failures to judge), by detector, mode and route; in observe mode counted, not acted on",
            m.findings.clone(),
        );
        reg.register(
            "policy_trips",
            "Streams a detector tripped, by detector, mode and route",
            m.trips.clone(),
        );
        reg.register(
            "policy_changes_refused",
            "Runtime or SIGHUP policy changes refused by --lock-policy or by the profile's floor",
            m.refused.clone(),
        );
        m
    }

    /// Sets the gauges to `set`: B and every detector's mode per route, and the profile.
    pub fn show(&self, set: &PolicySet) {
        for p in Profile::ALL {
            let on = i64::from(p == set.profile);
            self.profile
                .get_or_create(&ProfileLabel {
                    profile: p.as_str().to_owned(),
                })
                .set(on);
        }
        for r in &set.routes {
            let route = r.name.to_string();
            self.budget
                .get_or_create(&RouteLabel {
                    route: route.clone(),
                })
                .set(i64::from(r.budget));
            for id in DETECTORS {
                let Some(p) = super::policy_of(&r.detectors.cfg, id) else {
                    continue;
                };
                for m in MODES {
                    self.mode
                        .get_or_create(&DetectorRoute {
                            detector: id,
                            mode: m.as_str().to_owned(),
                            route: route.clone(),
                        })
                        .set(i64::from(m == p.mode));
                }
            }
        }
    }

    /// Counts what a turn's detectors did on `route`. Once per turn, at its end: a lookup
    /// per running detector (a hash and a read lock), never per token.
    pub fn judged(&self, route: &str, judged: impl IntoIterator<Item = Judged>) {
        for j in judged {
            let labels = DetectorRoute {
                detector: j.detector,
                mode: j.mode.as_str().to_owned(),
                route: route.to_owned(),
            };
            self.judged.get_or_create(&labels).inc();
            if j.findings > 0 {
                self.findings.get_or_create(&labels).inc_by(j.findings);
            }
            if j.tripped {
                self.trips.get_or_create(&labels).inc();
            }
        }
    }

    /// A detector's counts on a route in a mode: (judged, findings, trips).
    pub fn counts(&self, detector: DetectorId, mode: DetectorMode, route: &str) -> [u64; 3] {
        let labels = DetectorRoute {
            detector,
            mode: mode.as_str().to_owned(),
            route: route.to_owned(),
        };
        let get = |f: &Family<DetectorRoute, Counter>| f.get(&labels).map_or(0, |c| c.get());
        [get(&self.judged), get(&self.findings), get(&self.trips)]
    }
}
