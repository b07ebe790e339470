//! The access log: one structured line per request, written when the request ends, from the
//! same summary the request metrics take (`dataplane/conn/summary.rs`).
//!
//! `--access-log` says where: `stderr` (the default: an event of target `haltd::access` at
//! `--access-log-level`, in the format of haltd's other logs, so a JSON log has it as one
//! flat object), a file (JSON Lines, appended; reopened on SIGHUP, so logrotate can move it
//! away), or `off`. A line is written by the data-plane worker that served the request, once
//! per request, never per token; a file takes a lock and one `write` per line.

use std::{
    fs::{File, OpenOptions},
    io::{self, Write as _},
    path::PathBuf,
    str::FromStr,
    sync::Mutex,
};

use serde::Serialize;

/// Where access log lines go (`--access-log`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Destination {
    /// haltd's log on stderr, at `--access-log-level`.
    Stderr,
    /// A file, JSON Lines.
    File(PathBuf),
    /// No access log.
    Off,
}

impl FromStr for Destination {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "" => Err("empty: say stderr, off or a file path".to_owned()),
            "stderr" => Ok(Destination::Stderr),
            "off" => Ok(Destination::Off),
            path => Ok(Destination::File(PathBuf::from(path))),
        }
    }
}

/// The level of stderr access log lines (`--access-log-level`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Level {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

/// One request as the access log tells it. Optional fields are left out when absent.
#[derive(Debug, Serialize)]
pub struct Entry<'a> {
    /// The stream id (`-` for a connection refused before it had one).
    pub stream_id: &'a str,
    pub request_id: &'a str,
    /// The API key's fingerprint (never the key).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<&'a str>,
    /// With `--client-keys store`: the name of the key the request authenticated with (`key`
    /// is then its id).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_name: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<&'a str>,
    /// The profile and route a turn ran under (issue 37); absent for requests that were no
    /// turn.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub route: Option<&'a str>,
    /// Whose API the request spoke (`openai`, `anthropic`, `haltd`, `other`).
    pub surface: &'a str,
    pub endpoint: &'a str,
    pub status: u16,
    pub tokens: u64,
    /// Time to the first token reaching the client, ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    pub duration_ms: f64,
    pub outcome: &'a str,
    /// The failure code of a halted request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub halt_code: Option<&'a str>,
    /// Who tripped a halted request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub initiator: Option<&'a str>,
    /// The `x-request-id` haltd sent upstream for the request (`--upstream-request-id`):
    /// what the backend's logs name it by.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_request_id: Option<&'a str>,
}

/// The open access log.
#[derive(Debug)]
pub struct AccessLog {
    destination: Destination,
    level: Level,
    file: Mutex<Option<File>>,
}

fn open_file(path: &PathBuf) -> io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

impl AccessLog {
    /// Opens the destination (a file is created if need be and appended to).
    pub fn open(destination: Destination, level: Level) -> io::Result<Self> {
        let file = match &destination {
            Destination::File(p) => Some(open_file(p)?),
            Destination::Stderr | Destination::Off => None,
        };
        Ok(AccessLog {
            destination,
            level,
            file: Mutex::new(file),
        })
    }

    /// No access log (tests, tools).
    pub fn off() -> Self {
        AccessLog {
            destination: Destination::Off,
            level: Level::Info,
            file: Mutex::new(None),
        }
    }

    /// SIGHUP: a file destination is opened again at its path (after logrotate moved it);
    /// the file in use stays if that fails. Returns the path reopened, `None` for stderr
    /// and off.
    pub fn reopen(&self) -> io::Result<Option<&PathBuf>> {
        let Destination::File(path) = &self.destination else {
            return Ok(None);
        };
        let file = open_file(path)?;
        *self
            .file
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(file);
        Ok(Some(path))
    }

    /// [`AccessLog::reopen`] on SIGHUP, logged; what the SIGHUP's lifecycle record says of
    /// it (`None`: no file to reopen).
    pub fn reopen_on_hangup(&self) -> Option<String> {
        match self.reopen() {
            Ok(None) => None,
            Ok(Some(path)) => {
                tracing::info!(path = %path.display(), "access log reopened on SIGHUP");
                Some(format!("access log {} reopened", path.display()))
            }
            Err(e) => {
                tracing::warn!(error = %e, "reopening the access log on SIGHUP failed; it goes on in the file it had");
                Some(format!(
                    "reopening the access log failed ({e}); it goes on in the file it had"
                ))
            }
        }
    }

    /// Writes one request's line.
    pub fn write(&self, e: &Entry<'_>) {
        match self.destination {
            Destination::Off => {}
            Destination::Stderr => self.event(e),
            Destination::File(_) => self.append(e),
        }
    }

    fn append(&self, e: &Entry<'_>) {
        #[derive(Serialize)]
        struct Line<'a> {
            timestamp: String,
            #[serde(flatten)]
            entry: &'a Entry<'a>,
        }
        let line = Line {
            timestamp: crate::clock::rfc3339_now(),
            entry: e,
        };
        let Ok(mut text) = serde_json::to_vec(&line) else {
            return;
        };
        text.push(b'\n');
        let mut file = self
            .file
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(f) = file.as_mut() {
            if let Err(err) = f.write_all(&text) {
                tracing::warn!(error = %err, "writing the access log failed");
            }
        }
    }

    fn event(&self, e: &Entry<'_>) {
        macro_rules! at {
            ($level:expr) => {
                tracing::event!(
                    target: "haltd::access",
                    $level,
                    stream_id = e.stream_id,
                    request_id = e.request_id,
                    key = e.key,
                    model = e.model,
                    profile = e.profile,
                    route = e.route,
                    surface = e.surface,
                    endpoint = e.endpoint,
                    status = e.status,
                    tokens = e.tokens,
                    ttft_ms = e.ttft_ms,
                    duration_ms = e.duration_ms,
                    outcome = e.outcome,
                    halt_code = e.halt_code,
                    initiator = e.initiator,
                    upstream_request_id = e.upstream_request_id,
                    "request"
                )
            };
        }
        match self.level {
            Level::Error => at!(tracing::Level::ERROR),
            Level::Warn => at!(tracing::Level::WARN),
            Level::Info => at!(tracing::Level::INFO),
            Level::Debug => at!(tracing::Level::DEBUG),
            Level::Trace => at!(tracing::Level::TRACE),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> Entry<'static> {
        Entry {
            stream_id: "s-1",
            request_id: "r-1",
            key: Some("00000000000000ab"),
            key_name: None,
            model: Some("builtin"),
            profile: Some("full"),
            route: Some("default"),
            surface: "openai",
            endpoint: "chat",
            status: 200,
            tokens: 13,
            ttft_ms: Some(1.5),
            duration_ms: 20.0,
            outcome: "completed",
            halt_code: None,
            initiator: None,
            upstream_request_id: None,
        }
    }

    #[test]
    fn destinations_parse() {
        assert_eq!("stderr".parse(), Ok(Destination::Stderr));
        assert_eq!("off".parse(), Ok(Destination::Off));
        assert_eq!(
            "/var/log/haltd/access.log".parse(),
            Ok(Destination::File("/var/log/haltd/access.log".into()))
        );
        assert!("".parse::<Destination>().is_err());
    }

    #[test]
    fn a_file_gets_one_json_line_per_request_and_is_reopened() {
        let dir = std::env::temp_dir().join(format!("haltd-access-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("access.log");
        let log = AccessLog::open(Destination::File(path.clone()), Level::Info).expect("open");
        log.write(&entry());
        let rotated = dir.join("access.log.1");
        std::fs::rename(&path, &rotated).expect("rotate");
        assert_eq!(log.reopen().expect("reopen"), Some(&path));
        log.write(&Entry {
            outcome: "halted",
            halt_code: Some("OPERATOR_TRIP"),
            initiator: Some("operator"),
            upstream_request_id: None,
            ..entry()
        });
        let old = std::fs::read_to_string(&rotated).expect("rotated");
        let new = std::fs::read_to_string(&path).expect("new");
        let first: serde_json::Value = serde_json::from_str(old.trim_end()).expect("json");
        assert_eq!(first["request_id"], "r-1");
        assert_eq!(first["tokens"], 13);
        assert!(first.get("halt_code").is_none(), "{first}");
        assert!(first["timestamp"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')));
        let second: serde_json::Value = serde_json::from_str(new.trim_end()).expect("json");
        assert_eq!(second["halt_code"], "OPERATOR_TRIP");
        assert_eq!(second["initiator"], "operator");
        assert_eq!(old.lines().count() + new.lines().count(), 2);
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
