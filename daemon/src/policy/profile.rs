//! The architecture profile (spec 000 §4, §7): `full` or `mkp`, the Minimal Kernel Profile.
//!
//! A profile is a floor, not a set of detectors: `mkp` keeps the watchdog and the kernel gate
//! and a budget B of at most 5 on every route ([`Floor`]). A configuration or a runtime
//! switch that would break the floor is refused, naming what breaks it. Routes may apply in
//! one profile only (`profiles = ["mkp"]`), which is how a deployment makes `mkp` stricter
//! (batch-only sensitive routes, B = 0) without a second config file.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The largest B the Minimal Kernel Profile allows (spec 000 §7: the same ≤ 5 budget).
pub const MKP_MAX_BUDGET: u32 = 5;

/// The architecture profile in force.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Profile {
    /// Every feature haltd has; B up to `MAX_BUDGET`, the kernel gate may be off.
    #[default]
    Full,
    /// The Minimal Kernel Profile: the watchdog and the kernel gate stay on, and B ≤ 5 on
    /// every route.
    Mkp,
}

impl Profile {
    pub const ALL: [Profile; 2] = [Profile::Full, Profile::Mkp];

    pub const fn as_str(self) -> &'static str {
        match self {
            Profile::Full => "full",
            Profile::Mkp => "mkp",
        }
    }

    pub fn parse(s: &str) -> Option<Profile> {
        Profile::ALL.into_iter().find(|p| p.as_str() == s)
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a setting breaks a profile's floor: the key (a flag, or `routes.<name>.budget`) and
/// what it asks for.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {reason} (profile {profile} keeps the watchdog and the kernel gate and B <= {MKP_MAX_BUDGET}, spec 000 §7)")]
pub struct FloorBreach {
    pub profile: Profile,
    pub key: String,
    pub reason: String,
}

/// What a profile's floor is checked against.
#[derive(Clone, Copy, Debug)]
pub struct Floor<'a> {
    /// Whether the kernel gate runs (`--no-kernel-gate` unset).
    pub kernel_gate: bool,
    /// Whether the watchdog runs: always in a release build; a test fault may stall it.
    pub watchdog: bool,
    /// `--budget`.
    pub budget: u32,
    /// Each route's name and B (its own, or `--budget`).
    pub routes: &'a [(&'a str, u32)],
}

impl Profile {
    /// The first setting that breaks this profile's floor, if any.
    pub fn check(self, floor: &Floor<'_>) -> Result<(), FloorBreach> {
        if self == Profile::Full {
            return Ok(());
        }
        let breach = |key: String, reason: String| FloorBreach {
            profile: self,
            key,
            reason,
        };
        if !floor.kernel_gate {
            return Err(breach(
                "no-kernel-gate".into(),
                "turns the kernel gate off".into(),
            ));
        }
        if !floor.watchdog {
            return Err(breach("fault".into(), "stalls the watchdog".into()));
        }
        if floor.budget > MKP_MAX_BUDGET {
            return Err(breach(
                "budget".into(),
                format!("B = {} is above {MKP_MAX_BUDGET}", floor.budget),
            ));
        }
        for (name, b) in floor.routes {
            if *b > MKP_MAX_BUDGET {
                return Err(breach(
                    format!("routes.{name}.budget"),
                    format!("B = {b} is above {MKP_MAX_BUDGET}"),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn floor(kernel_gate: bool, budget: u32, routes: &[(&str, u32)]) -> Result<(), FloorBreach> {
        Profile::Mkp.check(&Floor {
            kernel_gate,
            watchdog: true,
            budget,
            routes,
        })
    }

    #[test]
    fn mkp_names_what_breaks_its_floor() {
        assert_eq!(floor(true, 5, &[("a", 0)]), Ok(()));
        assert_eq!(
            floor(false, 5, &[]).expect_err("gate").key,
            "no-kernel-gate"
        );
        assert_eq!(floor(true, 6, &[]).expect_err("budget").key, "budget");
        let e = floor(true, 5, &[("a", 2), ("wide", 9)]).expect_err("route");
        assert_eq!(e.key, "routes.wide.budget");
        assert!(e.to_string().contains("B = 9 is above 5"), "{e}");
        let stalled = Profile::Mkp.check(&Floor {
            kernel_gate: true,
            watchdog: false,
            budget: 5,
            routes: &[],
        });
        assert_eq!(stalled.expect_err("watchdog").key, "fault");
        let full = Profile::Full.check(&Floor {
            kernel_gate: false,
            watchdog: true,
            budget: 1000,
            routes: &[("wide", 1000)],
        });
        assert_eq!(full, Ok(()));
    }

    #[test]
    fn names_round_trip() {
        for p in Profile::ALL {
            assert_eq!(Profile::parse(p.as_str()), Some(p));
        }
        assert_eq!(Profile::parse("MKP"), None);
    }
}
