//! What this binary is: its version, the commit it was built from and its compiled-in
//! features (set by `daemon/build.rs`). `--version`, the ready line, the start record and the
//! `haltd_build_info` metric all say it, so a test build (`fault-injection`, which accepts
//! `--fault`) can never pass for a production one.

/// The crate version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The commit the binary was built from (12 hex digits), or `unknown`.
pub const COMMIT: &str = env!("HALTD_GIT_COMMIT");

/// The compiled-in features that change behaviour: `fault-injection` or `none`.
pub const FEATURES: &str = env!("HALTD_FEATURES");

/// `VERSION (commit COMMIT, features: FEATURES)`, what `--version` prints.
pub const LONG_VERSION: &str = env!("HALTD_LONG_VERSION");

/// Whether this is a test build that accepts `--fault`.
pub const FAULT_INJECTION: bool = cfg!(feature = "fault-injection");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_long_version_names_the_commit_and_the_features() {
        assert_eq!(
            LONG_VERSION,
            format!("{VERSION} (commit {COMMIT}, features: {FEATURES})")
        );
        assert_eq!(FEATURES == "fault-injection", FAULT_INJECTION);
        assert!(
            COMMIT == "unknown"
                || (COMMIT.len() == 12 && COMMIT.bytes().all(|b| b.is_ascii_hexdigit())),
            "{COMMIT}"
        );
    }
}
