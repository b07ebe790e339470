//! The detector part of the config file (`haltd serve --config FILE`, TOML): one table per
//! detector under `[detectors.<name>]`.
//!
//! Every detector table takes three common keys: `mode` (`"hard"`, `"observe"` or `"off"`;
//! the surprise detector also `"intervene"`, spec 003),
//! `debounce` (K consecutive breaching tokens before a hard trip, ≥ 1) and `deadline_us`
//! (most time one check may take; over it is a `DETECTOR_FAILURE`; 0 = none). Every other
//! key belongs to the detector and is checked by its own config type, which refuses keys it
//! does not know: a typo is an error naming the key, never a silently ignored setting.

use serde::de::DeserializeOwned;

use super::{DetectorMode, Policy};

/// A config-file error, naming where.
#[derive(Debug, thiserror::Error)]
#[error("config {at}: {reason}")]
pub struct ConfigFileError {
    /// E.g. `detectors.surprise.window`.
    pub at: String,
    pub reason: String,
}

pub(crate) fn err(at: impl Into<String>, reason: impl Into<String>) -> ConfigFileError {
    ConfigFileError {
        at: at.into(),
        reason: reason.into(),
    }
}

/// One detector's policy and its own settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry<C> {
    pub policy: Policy,
    pub cfg: C,
}

/// Reads `[detectors.<name>]` from `table` (absent: the defaults, with `default_mode`).
pub fn entry<C: DeserializeOwned + Default>(
    detectors: Option<&toml::Table>,
    name: &str,
    default_mode: DetectorMode,
) -> Result<Entry<C>, ConfigFileError> {
    let at = format!("detectors.{name}");
    let mut policy = Policy {
        mode: default_mode,
        ..Policy::default()
    };
    let Some(value) = detectors.and_then(|d| d.get(name)) else {
        return Ok(Entry {
            policy,
            cfg: C::default(),
        });
    };
    let toml::Value::Table(table) = value else {
        return Err(err(at, "must be a table"));
    };
    let mut rest = table.clone();
    if let Some(v) = rest.remove("mode") {
        policy.mode = match v.as_str() {
            Some("hard") => DetectorMode::Hard,
            Some("observe") => DetectorMode::Observe,
            Some("off") => DetectorMode::Off,
            Some("intervene") if name == "surprise" => DetectorMode::Intervene,
            _ if name == "surprise" => {
                return Err(err(
                    format!("{at}.mode"),
                    format!("{v} is not one of \"hard\", \"observe\", \"intervene\", \"off\""),
                ))
            }
            _ => {
                return Err(err(
                    format!("{at}.mode"),
                    format!("{v} is not one of \"hard\", \"observe\", \"off\""),
                ))
            }
        };
    }
    if let Some(v) = rest.remove("debounce") {
        policy.debounce = v
            .as_integer()
            .filter(|k| (1..=1_000_000).contains(k))
            .ok_or_else(|| {
                err(
                    format!("{at}.debounce"),
                    format!("{v} is not a whole number of tokens in 1..=1000000"),
                )
            })? as u32;
    }
    if let Some(v) = rest.remove("deadline_us") {
        policy.deadline_ns = v
            .as_integer()
            .filter(|us| (0..=10_000_000).contains(us))
            .ok_or_else(|| {
                err(
                    format!("{at}.deadline_us"),
                    format!("{v} is not a whole number of microseconds in 0..=10000000"),
                )
            })? as u64
            * 1000;
    }
    let cfg = C::deserialize(toml::Value::Table(rest)).map_err(|e| err(&at, e.to_string()))?;
    Ok(Entry { policy, cfg })
}

/// Refuses detector tables whose name is not one of `known`.
pub fn check_names(detectors: Option<&toml::Table>, known: &[&str]) -> Result<(), ConfigFileError> {
    for name in detectors.into_iter().flat_map(|d| d.keys()) {
        if !known.contains(&name.as_str()) {
            return Err(err(
                format!("detectors.{name}"),
                format!("unknown detector (known: {})", known.join(", ")),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[derive(Debug, Default, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields, default)]
    struct Demo {
        window: u32,
    }

    fn parse(text: &str) -> toml::Table {
        text.parse::<toml::Table>().expect("toml")
    }

    #[test]
    fn common_keys_and_own_keys() {
        let t = parse("[demo]\nmode = \"observe\"\ndebounce = 3\ndeadline_us = 50\nwindow = 16\n");
        let e: Entry<Demo> = entry(Some(&t), "demo", DetectorMode::Hard).expect("valid");
        assert_eq!(e.policy.mode, DetectorMode::Observe);
        assert_eq!(e.policy.debounce, 3);
        assert_eq!(e.policy.deadline_ns, 50_000);
        assert_eq!(e.cfg.window, 16);
    }

    #[test]
    fn absent_tables_take_defaults() {
        let e: Entry<Demo> = entry(None, "demo", DetectorMode::Observe).expect("valid");
        assert_eq!(e.policy.mode, DetectorMode::Observe);
        assert_eq!(e.cfg, Demo::default());
    }

    #[test]
    fn mistakes_name_their_key() {
        for (text, at) in [
            ("[demo]\nmode = \"loud\"\n", "detectors.demo.mode"),
            ("[demo]\ndebounce = 0\n", "detectors.demo.debounce"),
            ("[demo]\nwindw = 3\n", "detectors.demo"),
            ("demo = 3\n", "detectors.demo"),
        ] {
            let t = parse(text);
            let e = entry::<Demo>(Some(&t), "demo", DetectorMode::Hard).expect_err(text);
            assert_eq!(e.at, at, "{text}: {e}");
        }
        let t = parse("[demo]\nmode = \"intervene\"\n");
        let e = entry::<Demo>(Some(&t), "demo", DetectorMode::Hard).expect_err("surprise only");
        assert_eq!(e.at, "detectors.demo.mode");
        let t = parse("[surprise]\nmode = \"intervene\"\n");
        let e: Entry<Demo> = entry(Some(&t), "surprise", DetectorMode::Observe).expect("valid");
        assert_eq!(e.policy.mode, DetectorMode::Intervene);
        let t = parse("[demo]\n[dmeo]\n");
        assert_eq!(
            check_names(Some(&t), &["demo"]).expect_err("typo").at,
            "detectors.dmeo"
        );
    }
}
