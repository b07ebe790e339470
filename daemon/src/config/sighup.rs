//! What SIGHUP does with each setting: the "on SIGHUP" column of docs/configuration.md, and the
//! keys a reload names because they changed in `--config` but apply only at the next start.
//!
//! Every setting says one of three things ([`OnSighup`]); a flag of `haltd serve` that is not
//! listed in [`SETTINGS`] fails a unit test, so a new setting cannot ship without its answer.

use std::fmt;

/// What SIGHUP does with a setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnSighup {
    /// Re-read from `--config` and applied to turns (or connections) that start afterwards.
    Applied,
    /// Read once, at start: a change applies at the next start (SIGHUP names it in a WARN line
    /// and in its ledger record).
    Restart,
    /// Applied as `Applied`, except that with `--lock-policy` a change that loosens
    /// enforcement (`policy::lock`) is refused, and the whole reload with it.
    Refused,
}

impl OnSighup {
    pub const fn as_str(self) -> &'static str {
        match self {
            OnSighup::Applied => "applied",
            OnSighup::Restart => "restart",
            OnSighup::Refused => "refused",
        }
    }
}

impl fmt::Display for OnSighup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

use OnSighup::{Applied, Refused, Restart};

/// Every setting of `haltd serve`, by its flag's name. Flags and variables are the process's
/// own and never change under it; what SIGHUP re-reads is the config file, and of its
/// settings only the sections below. `hard-limit` is one of them: its file form is
/// `[detectors.halt_monitor] hard_limit` (the flag or variable, if given, still wins).
pub const SETTINGS: &[(&str, OnSighup)] = &[
    ("listen", Restart),
    ("admin", Restart),
    ("admin-group", Restart),
    ("admin-token-file", Restart),
    ("metrics", Restart),
    ("source", Restart),
    ("config", Restart),
    ("upstream", Restart),
    ("upstream-api-key-file", Restart),
    ("upstream-request-id", Restart),
    ("upstream-surfaces", Restart),
    ("upstream-ca-file", Restart),
    // The certificate and key files are read again; their paths are fixed at start.
    ("tls-cert", Restart),
    ("tls-key", Restart),
    ("upstream-connect-timeout-ms", Restart),
    ("upstream-first-token-timeout-ms", Restart),
    ("upstream-stall-timeout-ms", Restart),
    ("upstream-pool-idle", Restart),
    ("upstream-pool-idle-timeout-ms", Restart),
    ("upstream-probe-path", Restart),
    ("upstream-probe-interval-ms", Restart),
    ("upstream-probe-timeout-ms", Restart),
    ("upstream-probe-failures", Restart),
    ("upstream-probe-successes", Restart),
    ("no-upstream-probe", Restart),
    ("upstream-resolve-interval-ms", Restart),
    ("degraded-scope", Restart),
    ("identity-header", Restart),
    ("state-dir", Restart),
    ("state-mismatch", Restart),
    ("user", Restart),
    ("group", Restart),
    ("degraded-for-s", Restart),
    ("degraded-instruction", Restart),
    ("degraded-ask-first", Restart),
    ("escalation-url", Restart),
    ("escalation-token-file", Restart),
    ("escalation-ca-file", Restart),
    ("escalation-attempts", Restart),
    ("escalation-deadline-ms", Restart),
    ("builtin-token-interval-us", Restart),
    ("builtin-restate-prompt", Restart),
    ("budget", Restart),
    ("hard-limit", Refused),
    ("profile", Restart),
    ("lock-policy", Restart),
    ("ledger", Restart),
    ("ledger-no-fsync", Restart),
    ("turn-sample-rate", Restart),
    ("record-token-text", Restart),
    ("no-kernel-gate", Restart),
    ("bpf-object", Restart),
    ("heartbeat-interval-ms", Restart),
    ("heartbeat-deadline-ms", Restart),
    ("halt-grace-ms", Restart),
    ("max-streams", Restart),
    ("max-body-bytes", Restart),
    ("request-timeout-ms", Restart),
    ("drain-timeout-ms", Restart),
    ("take-over", Restart),
    ("take-over-from", Restart),
    ("take-over-overlap-ms", Restart),
    ("max-conns-per-addr", Restart),
    ("client-keys", Restart),
    ("limit-concurrency", Restart),
    ("limit-requests-per-minute", Restart),
    ("limit-tokens-per-minute", Restart),
    ("addr-prefix-v4", Restart),
    ("addr-prefix-v6", Restart),
    ("send-stall-timeout-ms", Restart),
    ("request-phase-share", Restart),
    ("client-idle-timeout-ms", Restart),
    ("max-turns-per-conn", Restart),
    ("workers", Restart),
    ("worker-stall-ms", Restart),
    ("fault", Restart),
    ("log-format", Restart),
    // The file is reopened at its path (after logrotate); the destination is fixed.
    ("access-log", Restart),
    ("access-log-level", Restart),
    ("metric-models", Restart),
];

/// The sections of the config file, with what SIGHUP does with them.
pub const SECTIONS: &[(&str, OnSighup)] = &[
    ("detectors", Refused),
    ("safety", Refused),
    ("routes", Refused),
    ("log", Applied),
    ("flight_recorder", Restart),
    ("tool_circuit", Restart),
    ("grounding", Restart),
];

/// What SIGHUP does with the setting whose flag is `--name`; `None` for a name not listed.
pub fn of(name: &str) -> Option<OnSighup> {
    SETTINGS.iter().find(|(n, _)| *n == name).map(|(_, o)| *o)
}

/// The keys of the config file that differ between `at_start` (as haltd read it at start) and
/// `now` (as SIGHUP reads it) and that apply only at the next start: top-level settings (by
/// their file key) and whole `restart` sections (by their name), in the file's order. A key
/// added or removed counts as changed.
pub fn changed_restart_keys(
    at_start: Option<&toml::Table>,
    now: Option<&toml::Table>,
) -> Vec<String> {
    let empty = toml::Table::new();
    let (old, new) = (at_start.unwrap_or(&empty), now.unwrap_or(&empty));
    let restart = |key: &str| match SECTIONS.iter().find(|(s, _)| *s == key) {
        Some((_, on)) => *on == Restart,
        // A top-level setting: none of them is re-read (`hard_limit` lives in a section).
        None => true,
    };
    let mut changed: Vec<String> = Vec::new();
    for k in new.keys().chain(old.keys()) {
        if restart(k) && old.get(k) != new.get(k) && !changed.contains(k) {
            changed.push(k.clone());
        }
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_setting_says_what_sighup_does() {
        let settings = super::super::layers::settings(&super::super::ServeArgs::command());
        let missing: Vec<&str> = settings
            .iter()
            .map(|s| s.name.as_str())
            .filter(|n| of(n).is_none())
            .collect();
        assert!(
            missing.is_empty(),
            "settings without an \"on SIGHUP\" answer in config/sighup.rs: {missing:?}"
        );
        let names: Vec<&str> = settings.iter().map(|s| s.name.as_str()).collect();
        let stale: Vec<&str> = SETTINGS
            .iter()
            .map(|(n, _)| *n)
            .filter(|n| !names.contains(n))
            .collect();
        assert!(stale.is_empty(), "listed but no such setting: {stale:?}");
        for s in super::super::layers::SECTIONS {
            assert!(
                SECTIONS.iter().any(|(n, _)| *n == s),
                "section [{s}] has no answer"
            );
        }
    }

    #[test]
    fn changed_restart_keys_names_top_level_settings_and_restart_sections_only() {
        let old: toml::Table = toml::from_str(
            "budget = 5\nmax_streams = 10\n[detectors.exfil]\nmode = \"observe\"\n[grounding]\nenabled = false\n",
        )
        .expect("toml");
        let new: toml::Table = toml::from_str(
            "budget = 8\nmax_streams = 10\nworkers = 2\n[detectors.exfil]\nmode = \"hard\"\n[grounding]\nenabled = true\n",
        )
        .expect("toml");
        assert_eq!(
            changed_restart_keys(Some(&old), Some(&new)),
            ["budget", "grounding", "workers"]
        );
        assert!(changed_restart_keys(Some(&old), Some(&old)).is_empty());
        // A file given at start and gone now: everything it set at the top changed.
        assert_eq!(
            changed_restart_keys(Some(&old), None),
            ["budget", "grounding", "max_streams"]
        );
    }
}
