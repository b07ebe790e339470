//! haltd's logs on stderr: text (colour only on a terminal) or JSON, one flat object per line
//! (`timestamp`, `level`, `target`, `message`, then the event's own fields; no span data).
//!
//! The level is `HALTD_LOG` when set (an `EnvFilter` directive), else the config file's
//! `[log] level`, else `info`. It sits behind a reload handle, so SIGHUP applies a changed
//! `[log] level` without a restart (`lifecycle.rs`). Uses nothing else of haltd: the configuration checks a level with
//! [`check_level`].

use std::io::IsTerminal;

use tracing_subscriber::{
    fmt, layer::SubscriberExt, reload, util::SubscriberInitExt, EnvFilter, Registry,
};

/// Log output format (`--log-format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// The environment variable that sets the level, over the config file.
pub const LEVEL_ENV: &str = "HALTD_LOG";

/// The level when neither `HALTD_LOG` nor `[log] level` gives one.
pub const DEFAULT_LEVEL: &str = "info";

/// Changes the log level of the running process.
#[derive(Debug)]
pub struct LogControl {
    handle: reload::Handle<EnvFilter, Registry>,
    /// `HALTD_LOG` was set: it wins over the config file, at start and on reload.
    from_env: bool,
}

impl LogControl {
    /// Applies the config file's `[log] level` (`None`: the default), unless `HALTD_LOG` set
    /// the level; returns the directive now in force, or why `level` is not one.
    pub fn apply_file_level(&self, level: Option<&str>) -> Result<String, String> {
        if self.from_env {
            return Ok(std::env::var(LEVEL_ENV).unwrap_or_default());
        }
        let level = level.unwrap_or(DEFAULT_LEVEL);
        let filter = EnvFilter::try_new(level).map_err(|e| format!("log.level {level:?}: {e}"))?;
        self.handle
            .reload(filter)
            .map_err(|e| format!("setting the log level: {e}"))?;
        Ok(level.to_owned())
    }
}

/// Installs the global subscriber; call once, before anything logs.
pub fn init(format: LogFormat) -> LogControl {
    let env = EnvFilter::try_from_env(LEVEL_ENV).ok();
    let from_env = env.is_some();
    let (filter, handle) = reload::Layer::new(env.unwrap_or_else(|| DEFAULT_LEVEL.into()));
    let layer = fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let registry = tracing_subscriber::registry().with(filter);
    match format {
        LogFormat::Text => registry.with(layer).init(),
        LogFormat::Json => registry
            .with(
                layer
                    .json()
                    .flatten_event(true)
                    .with_current_span(false)
                    .with_span_list(false),
            )
            .init(),
    }
    LogControl { handle, from_env }
}

/// Checks a `[log] level` directive without applying it (`haltd check-config`, start-up).
pub fn check_level(level: &str) -> Result<(), String> {
    EnvFilter::try_new(level)
        .map(drop)
        .map_err(|e| format!("{level:?} is not a log level or EnvFilter directive: {e}"))
}
