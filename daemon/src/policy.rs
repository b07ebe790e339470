//! The operator's policy (issue 37): the architecture profile ([`Profile`]: `full` or
//! `mkp`), the routes ([`route`]: which turns, and their B, batch-only, detector modes and
//! thresholds, TokenCircuit budgets and sampling rate) and the runtime switches of
//! `haltctl detector mode` and `haltctl profile set` ([`Overrides`]).
//!
//! [`PolicySet`] is what a turn starts under: built from the configuration and the
//! overrides, swapped whole (by SIGHUP or a switch), and looked up once per turn start. A
//! turn keeps the route (and the detectors) it started with, so a switch applies to new
//! turns and never touches an open stream. `--lock-policy` refuses any change that
//! [`lock::loosenings`] finds.

pub mod lock;
pub mod metrics;
pub mod profile;
pub mod route;

use std::sync::Arc;

use serde::{Deserialize, Serialize};

pub use profile::{Floor, FloorBreach, Profile, MKP_MAX_BUDGET};
pub use route::{RouteConfig, RouteMatch, TurnKey, DEFAULT_ROUTE};

use crate::{
    circuit::CircuitPolicy,
    detect::{
        config::ConfigFileError,
        pipeline::{Detectors, DetectorsConfig, DETECTORS},
        DetectorId, DetectorMode,
    },
};

/// A route in force.
#[derive(Debug)]
pub struct Route {
    pub name: Arc<str>,
    /// `None`: the default route, which takes every turn.
    pub matcher: Option<RouteMatch>,
    pub budget: u32,
    pub batch_only: bool,
    /// `None`: `--turn-sample-rate`.
    pub turn_sample_rate: Option<f64>,
    /// TokenCircuit's policy with the route's budgets (`None`: TokenCircuit is off).
    pub circuit: Option<Arc<CircuitPolicy>>,
    /// The detectors with the route's settings and the runtime modes applied.
    pub detectors: Arc<Detectors>,
}

/// Every route in force, the profile, and whether changes that loosen are refused.
#[derive(Debug)]
pub struct PolicySet {
    pub profile: Profile,
    /// The configured routes that apply under `profile`, in file order, then `default`.
    pub routes: Vec<Arc<Route>>,
}

/// A runtime detector mode, set by `haltctl detector mode` (persisted in the state store).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModeOverride {
    pub detector: DetectorId,
    /// `None`: every route.
    pub route: Option<String>,
    pub mode: DetectorMode,
}

/// The runtime switches, applied over the configuration: what the state store keeps.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Overrides {
    /// `haltctl profile set` (`None`: `--profile`).
    pub profile: Option<Profile>,
    /// In the order they were set; a later one for the same detector and route replaces it.
    pub modes: Vec<ModeOverride>,
}

impl Overrides {
    /// Sets a detector's mode on one route (or every one, which clears the per-route ones).
    pub fn set_mode(&mut self, detector: DetectorId, route: Option<&str>, mode: DetectorMode) {
        self.modes
            .retain(|m| m.detector != detector || (route.is_some() && m.route.as_deref() != route));
        self.modes.push(ModeOverride {
            detector,
            route: route.map(str::to_owned),
            mode,
        });
    }

    /// Applies the switch an applied `admin` record states (`detector_mode` or `profile`,
    /// as `admin/policy.rs` writes it): what a start replays from the ledger records after
    /// the state store's point, in order. Replaying a switch the store already holds changes
    /// nothing (each switch assigns). `Err`: the record does not read as one.
    pub fn replay(&mut self, rec: &serde_json::Value) -> Result<(), String> {
        let admin = &rec["admin"];
        let request = &admin["request"];
        match admin["action"].as_str() {
            Some("detector_mode") => {
                let detector = DETECTORS
                    .into_iter()
                    .find(|d| admin["detector"] == d.as_str())
                    .ok_or_else(|| format!("no detector {}", admin["detector"]))?;
                let mode = match request["mode"].as_str() {
                    Some("hard") => DetectorMode::Hard,
                    Some("observe") => DetectorMode::Observe,
                    _ => return Err(format!("no mode {}", request["mode"])),
                };
                self.set_mode(detector, request["route"].as_str(), mode);
                Ok(())
            }
            Some("profile") => {
                let p = request["profile"].as_str().and_then(Profile::parse);
                self.profile = Some(p.ok_or_else(|| format!("no profile {}", request["profile"]))?);
                Ok(())
            }
            _ => Err(format!("not a policy switch: {}", admin["action"])),
        }
    }

    /// The mode set for `detector` on `route`, if any: the route's own, else every route's.
    pub fn mode(&self, detector: DetectorId, route: &str) -> Option<DetectorMode> {
        let own = self
            .modes
            .iter()
            .find(|m| m.detector == detector && m.route.as_deref() == Some(route));
        let all = self
            .modes
            .iter()
            .find(|m| m.detector == detector && m.route.is_none());
        own.or(all).map(|m| m.mode)
    }
}

/// What the policy set is built from: the configuration (start or SIGHUP) and the switches.
#[derive(Clone, Debug)]
pub struct PolicyInputs {
    /// `--profile` (the file's `profile`).
    pub profile: Profile,
    /// The top-level detectors: the default route's.
    pub detectors: DetectorsConfig,
    pub routes: Vec<RouteConfig>,
    /// `--budget`.
    pub budget: u32,
    /// `[tool_circuit]` (fixed at start).
    pub circuit: Option<Arc<CircuitPolicy>>,
    /// Whether the kernel gate runs; whether the watchdog does.
    pub kernel_gate: bool,
    pub watchdog: bool,
    pub overrides: Overrides,
}

/// Why a policy set cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error(transparent)]
    Floor(#[from] FloorBreach),
    #[error(transparent)]
    Config(#[from] ConfigFileError),
}

/// The mutable policy of a detector's config entry, for the detectors a route runs.
pub fn policy_mut(cfg: &mut DetectorsConfig, id: DetectorId) -> Option<&mut crate::detect::Policy> {
    match id {
        DetectorId::HaltMonitor => Some(&mut cfg.halt_monitor.policy),
        DetectorId::Surprise => Some(&mut cfg.surprise.policy),
        DetectorId::ComputeBudget => Some(&mut cfg.compute_budget.policy),
        DetectorId::LatencyAnomaly => Some(&mut cfg.latency_anomaly.policy),
        DetectorId::Exfil => Some(&mut cfg.exfil.policy),
        DetectorId::Safety => None,
    }
}

/// A detector's policy in a config.
pub fn policy_of(cfg: &DetectorsConfig, id: DetectorId) -> Option<crate::detect::Policy> {
    let mut c = cfg.clone();
    policy_mut(&mut c, id).copied()
}

impl PolicyInputs {
    /// The profile in force: the switch's, else the configured one.
    pub fn profile(&self) -> Profile {
        self.overrides.profile.unwrap_or(self.profile)
    }

    /// Every route name a switch may name: the configured ones and `default`.
    pub fn route_names(&self) -> Vec<&str> {
        self.routes
            .iter()
            .map(|r| r.name.as_str())
            .chain([DEFAULT_ROUTE])
            .collect()
    }

    /// Checks the profile's floor over every route that applies under it.
    pub fn check_floor(&self, profile: Profile) -> Result<(), FloorBreach> {
        let routes: Vec<(&str, u32)> = self
            .routes
            .iter()
            .filter(|r| r.applies_in(profile))
            .map(|r| (r.name.as_str(), r.budget.unwrap_or(self.budget)))
            .collect();
        profile.check(&Floor {
            kernel_gate: self.kernel_gate,
            watchdog: self.watchdog,
            budget: self.budget,
            routes: &routes,
        })
    }

    /// The route names no configured route has among `overrides` (a switch for a route a
    /// later configuration dropped applies to nothing; start-up warns about it).
    pub fn unknown_routes(&self) -> Vec<String> {
        let names = self.route_names();
        self.overrides
            .modes
            .iter()
            .filter_map(|m| m.route.clone())
            .filter(|r| !names.contains(&r.as_str()))
            .collect()
    }

    /// Builds the set in force. `previous` lends its latency baseline (what the node learnt
    /// from its traffic), so a rebuild does not reset it.
    pub fn build(&self, previous: Option<&Detectors>) -> Result<PolicySet, PolicyError> {
        let profile = self.profile();
        self.check_floor(profile)?;
        let default_cfg = self.with_modes(self.detectors.clone(), DEFAULT_ROUTE);
        let default_detectors = match previous {
            Some(p) => Detectors::reloaded(default_cfg, p)?,
            None => Detectors::new(default_cfg)?,
        };
        let mut routes = Vec::with_capacity(self.routes.len() + 1);
        for r in self.routes.iter().filter(|r| r.applies_in(profile)) {
            let cfg = self.with_modes(r.detectors.clone(), &r.name);
            routes.push(Arc::new(Route {
                name: r.name.as_str().into(),
                matcher: Some(r.matcher.clone()),
                budget: r.budget.unwrap_or(self.budget),
                batch_only: r.batch_only,
                turn_sample_rate: r.turn_sample_rate,
                circuit: self.circuit.as_ref().map(|c| match &r.circuit_budgets {
                    Some(b) => Arc::new(CircuitPolicy {
                        budgets: b.over(c.budgets),
                        ..(**c).clone()
                    }),
                    None => Arc::clone(c),
                }),
                detectors: Arc::new(Detectors::reloaded(cfg, &default_detectors)?),
            }));
        }
        routes.push(Arc::new(Route {
            name: DEFAULT_ROUTE.into(),
            matcher: None,
            budget: self.budget,
            batch_only: false,
            turn_sample_rate: None,
            circuit: self.circuit.clone(),
            detectors: Arc::new(default_detectors),
        }));
        Ok(PolicySet { profile, routes })
    }

    fn with_modes(&self, mut cfg: DetectorsConfig, route: &str) -> DetectorsConfig {
        for id in DETECTORS {
            if let (Some(mode), Some(p)) =
                (self.overrides.mode(id, route), policy_mut(&mut cfg, id))
            {
                p.mode = mode;
            }
        }
        cfg
    }
}

/// What one turn runs under: the profile and its route (the turn keeps both).
#[derive(Clone, Debug)]
pub struct TurnPolicy {
    pub profile: Profile,
    pub route: Arc<Route>,
}

impl TurnPolicy {
    /// The default route of profile `full` over `detectors`, with B = `budget` (for tests and
    /// tools that drive one turn without a configuration).
    pub fn default_with(detectors: Arc<Detectors>, budget: u32) -> TurnPolicy {
        TurnPolicy {
            profile: Profile::Full,
            route: Arc::new(Route {
                name: DEFAULT_ROUTE.into(),
                matcher: None,
                budget,
                batch_only: false,
                turn_sample_rate: None,
                circuit: None,
                detectors,
            }),
        }
    }

    /// The detectors the turn is governed by.
    pub fn detectors(&self) -> Arc<Detectors> {
        Arc::clone(&self.route.detectors)
    }
}

impl PolicySet {
    /// What a turn starts under.
    pub fn for_turn(&self, t: &TurnKey<'_>) -> TurnPolicy {
        TurnPolicy {
            profile: self.profile,
            route: Arc::clone(self.route(t)),
        }
    }

    /// The route a turn runs under: the first configured one that matches, else `default`.
    /// Called once per turn start (a walk of at most [`route::MAX_ROUTES`]).
    pub fn route(&self, t: &TurnKey<'_>) -> &Arc<Route> {
        self.routes
            .iter()
            .find(|r| r.matcher.as_ref().is_none_or(|m| m.matches(t)))
            .unwrap_or_else(|| self.default_route())
    }

    /// The default route (always the last).
    pub fn default_route(&self) -> &Arc<Route> {
        self.routes
            .last()
            .expect("the default route is always built")
    }

    /// A route by name.
    pub fn named(&self, name: &str) -> Option<&Arc<Route>> {
        self.routes.iter().find(|r| &*r.name == name)
    }
}

#[cfg(test)]
mod tests;
