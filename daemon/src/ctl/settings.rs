//! Where haltctl finds the daemon it talks to. Each setting comes from the first place that
//! gives it: haltctl's flag, its environment variable (the same `HALTD_*` name as haltd's),
//! the top-level key of haltd's own config file (`--config FILE` or `HALTD_CONFIG`, the file
//! haltd runs with), or the default. So `haltctl --config /etc/haltd/haltd.toml status` talks
//! to the daemon that file configures, not to whichever one answers on the default socket.

use std::path::{Path, PathBuf};

/// The admin API's default address (haltd's `--admin` default).
pub const DEFAULT_ADMIN: &str = "unix:/run/haltd/admin.sock";
/// haltd's default `--state-dir`.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/haltd";
/// haltd's default `--ledger`.
pub const DEFAULT_LEDGER: &str = "/var/lib/haltd/ledger.jsonl";

/// The settings haltctl reads from haltd's config file.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct FileSettings {
    pub admin: Option<String>,
    pub admin_token_file: Option<PathBuf>,
    pub state_dir: Option<PathBuf>,
    pub ledger: Option<PathBuf>,
}

/// Why haltd's config file gave haltctl nothing.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("--config {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--config {}: not TOML: {reason}", path.display())]
    Parse { path: PathBuf, reason: String },
    #[error("--config {}: `{key}` must be a string", path.display())]
    Type { path: PathBuf, key: &'static str },
}

impl FileSettings {
    /// The settings of the config file at `path` (other keys are haltd's, not checked here:
    /// `haltd check-config` does).
    pub fn read(path: &Path) -> Result<Self, SettingsError> {
        let text = std::fs::read_to_string(path).map_err(|source| SettingsError::Read {
            path: path.to_owned(),
            source,
        })?;
        let table: toml::Table = toml::from_str(&text).map_err(|e| SettingsError::Parse {
            path: path.to_owned(),
            reason: e.message().to_owned(),
        })?;
        let string = |key: &'static str| -> Result<Option<String>, SettingsError> {
            match table.get(key) {
                None => Ok(None),
                Some(toml::Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(SettingsError::Type {
                    path: path.to_owned(),
                    key,
                }),
            }
        };
        Ok(FileSettings {
            admin: string("admin")?,
            admin_token_file: string("admin_token_file")?.map(PathBuf::from),
            state_dir: string("state_dir")?.map(PathBuf::from),
            ledger: string("ledger")?.map(PathBuf::from),
        })
    }
}

/// The first of `given` (flag or variable), `file` and `default`.
pub fn pick<T: Clone>(given: Option<&T>, file: Option<&T>, default: T) -> T {
    given.or(file).cloned().unwrap_or(default)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_file_gives_what_flags_do_not() {
        let dir = std::env::temp_dir().join(format!("haltctl-settings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("haltd.toml");
        std::fs::write(
            &path,
            "admin = \"127.0.0.1:9091\"\nadmin_token_file = \"/etc/haltd/token\"\n\
             state_dir = \"/srv/haltd\"\nbudget = 5\n[detectors.exfil]\nmode = \"hard\"\n",
        )
        .expect("write");
        let s = FileSettings::read(&path).expect("read");
        assert_eq!(s.admin.as_deref(), Some("127.0.0.1:9091"));
        assert_eq!(s.state_dir, Some(PathBuf::from("/srv/haltd")));
        assert_eq!(s.ledger, None);
        let flag = "unix:/x".to_owned();
        assert_eq!(
            pick(Some(&flag), s.admin.as_ref(), DEFAULT_ADMIN.into()),
            flag
        );
        assert_eq!(
            pick(None, s.admin.as_ref(), DEFAULT_ADMIN.into()),
            "127.0.0.1:9091"
        );
        assert_eq!(pick(None, None, DEFAULT_ADMIN.to_owned()), DEFAULT_ADMIN);
        std::fs::write(&path, "admin = 7\n").expect("write");
        assert!(matches!(
            FileSettings::read(&path),
            Err(SettingsError::Type { key: "admin", .. })
        ));
        std::fs::write(&path, "admin = \n").expect("write");
        assert!(matches!(
            FileSettings::read(&path),
            Err(SettingsError::Parse { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
