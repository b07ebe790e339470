//! `[detectors.halt_monitor] scorer`: which scorer feeds the HaltMonitor, its serde form and
//! its checks (see the module docs above).

use std::{fmt, path::PathBuf};

use serde::{
    de::{self, Unexpected},
    ser::SerializeMap,
    Deserialize, Deserializer, Serialize, Serializer,
};

use crate::detect::scorer::{
    score::{
        check_socket_path, ProbabilityScorer, Scorer, ScorerConfigError, DEFAULT_DEADLINE_US,
        MAX_DEADLINE_US,
    },
    unix::UnixScorer,
};

/// Which scorer feeds the HaltMonitor. Serialized as `"probability"` or
/// `{ unix = PATH, deadline_us = N }` (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ScorerConfig {
    /// The token's probability, `exp(logprob)`.
    #[default]
    Probability,
    /// An external scorer process on a Unix stream socket.
    Unix {
        /// The scorer's listening socket (absolute path).
        path: PathBuf,
        /// Per-token round-trip deadline in microseconds (default [`DEFAULT_DEADLINE_US`]).
        deadline_us: u64,
    },
}

impl ScorerConfig {
    /// Checks what the serde representation cannot (see the module docs).
    pub fn validate(self) -> Result<Self, ScorerConfigError> {
        if let ScorerConfig::Unix { path, deadline_us } = &self {
            check_socket_path(path)?;
            if !(1..=MAX_DEADLINE_US).contains(deadline_us) {
                return Err(ScorerConfigError::DeadlineOutOfRange {
                    value: *deadline_us,
                    max: MAX_DEADLINE_US,
                });
            }
        }
        Ok(self)
    }

    /// A scorer for one stream (or one worker: scorers are reusable across turns). The Unix
    /// scorer does not connect here but at [`Scorer::begin_turn`].
    pub fn build(&self) -> Result<Box<dyn Scorer>, ScorerConfigError> {
        Ok(match self {
            ScorerConfig::Probability => Box::new(ProbabilityScorer),
            ScorerConfig::Unix { path, deadline_us } => {
                Box::new(UnixScorer::new(path.clone(), *deadline_us)?)
            }
        })
    }
}

const PROBABILITY: &str = "probability";
const KEY_UNIX: &str = "unix";
const KEY_DEADLINE: &str = "deadline_us";

impl Serialize for ScorerConfig {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ScorerConfig::Probability => s.serialize_str(PROBABILITY),
            ScorerConfig::Unix { path, deadline_us } => {
                let mut m = s.serialize_map(Some(2))?;
                m.serialize_entry(KEY_UNIX, path)?;
                m.serialize_entry(KEY_DEADLINE, deadline_us)?;
                m.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for ScorerConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ConfigVisitor)
    }
}

/// The keys of the `{ unix = .., deadline_us = .. }` form; anything else is refused.
#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum UnixKey {
    Unix,
    DeadlineUs,
}

struct ConfigVisitor;

impl<'de> de::Visitor<'de> for ConfigVisitor {
    type Value = ScorerConfig;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(r#""probability" or { unix = "/path/to/scorer.sock", deadline_us = N }"#)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<ScorerConfig, E> {
        if v == PROBABILITY {
            Ok(ScorerConfig::Probability)
        } else {
            Err(E::invalid_value(Unexpected::Str(v), &self))
        }
    }

    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<ScorerConfig, A::Error> {
        let mut path: Option<PathBuf> = None;
        let mut deadline_us: Option<u64> = None;
        while let Some(key) = map.next_key::<UnixKey>()? {
            match key {
                UnixKey::Unix if path.is_some() => {
                    return Err(de::Error::duplicate_field(KEY_UNIX))
                }
                UnixKey::Unix => path = Some(map.next_value()?),
                UnixKey::DeadlineUs if deadline_us.is_some() => {
                    return Err(de::Error::duplicate_field(KEY_DEADLINE))
                }
                UnixKey::DeadlineUs => deadline_us = Some(map.next_value()?),
            }
        }
        Ok(ScorerConfig::Unix {
            path: path.ok_or_else(|| de::Error::missing_field(KEY_UNIX))?,
            deadline_us: deadline_us.unwrap_or(DEFAULT_DEADLINE_US),
        })
    }
}
