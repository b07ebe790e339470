//! The checks of `haltd serve`'s flags that need more than a type: ranges, flags that go
//! together or exclude each other, and the files read at start (the admin token, the upstream
//! key, TLS material, the account to run as). Each error names its flag.

use super::{err, ConfigError, ServeArgs, SourceKind, MAX_BUDGET, MAX_POOL_IDLE};

impl ServeArgs {
    /// The admin token: required for a TCP admin listener, read from a file no other user can
    /// read. A token-less TCP admin would let any local user (and any web page a browser on the
    /// node opens) trip streams and end degraded mode.
    pub(super) fn admin_token(&self) -> Result<Option<super::AdminToken>, ConfigError> {
        use std::os::unix::fs::PermissionsExt;
        let Some(path) = &self.admin_token_file else {
            return match self.admin {
                super::AdminAddr::Tcp(a) => Err(err(
                    "admin",
                    format!("{a}: a TCP admin listener needs --admin-token-file (or use the default unix:{})", super::DEFAULT_ADMIN_SOCKET),
                )),
                super::AdminAddr::Unix(_) => Ok(None),
            };
        };
        if let super::AdminAddr::Unix(_) = self.admin {
            return Err(err(
                "admin-token-file",
                "is only used with a TCP --admin (the Unix socket is guarded by its mode and group)",
            ));
        }
        let shown = path.display();
        let meta = std::fs::metadata(path)
            .map_err(|e| err("admin-token-file", format!("{shown}: {e}")))?;
        if meta.permissions().mode() & 0o077 != 0 {
            return Err(err(
                "admin-token-file",
                format!(
                    "{shown}: readable or writable by group or others (mode {:o}); chmod 600 it",
                    meta.permissions().mode() & 0o777
                ),
            ));
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| err("admin-token-file", format!("{shown}: {e}")))?;
        super::AdminToken::from_file_contents(&text)
            .map(Some)
            .map_err(|e| err("admin-token-file", format!("{shown}: {e}")))
    }

    /// `--upstream-api-key-file`, read now (before privileges are dropped).
    pub(super) fn upstream_api_key(
        &self,
    ) -> Result<Option<crate::upstream::UpstreamApiKey>, ConfigError> {
        let Some(path) = &self.upstream_api_key_file else {
            return Ok(None);
        };
        if self.source != SourceKind::Openai {
            return Err(err(
                "upstream-api-key-file",
                "is only used with --source openai",
            ));
        }
        crate::upstream::UpstreamApiKey::read(path)
            .map(Some)
            .map_err(|e| err("upstream-api-key-file", e))
    }

    /// `--upstream-surfaces`: only a backend can serve a surface natively.
    pub(super) fn upstream_surfaces(&self) -> Result<crate::upstream::NativeSurfaces, ConfigError> {
        let set = crate::upstream::NativeSurfaces::of(&self.upstream_surfaces);
        if !set.is_empty() && self.source != SourceKind::Openai {
            return Err(err(
                "upstream-surfaces",
                "is only used with --source openai (the built-in source serves every surface itself)",
            ));
        }
        Ok(set)
    }

    /// `--user` and `--group`, looked up now: a missing user is a configuration error.
    pub(super) fn account(&self) -> Result<Option<crate::privs::Account>, ConfigError> {
        let Some(user) = &self.user else {
            return Ok(None);
        };
        crate::privs::Account::resolve(user, self.group.as_deref())
            .map(Some)
            .map_err(|e| {
                let flag = match e {
                    crate::privs::account::LookupError::NoGroup(_) => "group",
                    _ => "user",
                };
                err(flag, e.to_string())
            })
    }

    /// The watchdog's timings: heartbeat, halt grace, worker stall.
    fn check_watchdog(&self) -> Result<(), ConfigError> {
        if self.heartbeat_interval_ms == 0 {
            return Err(err("heartbeat-interval-ms", "must be at least 1"));
        }
        if self.heartbeat_deadline_ms < 2 * self.heartbeat_interval_ms {
            return Err(err(
                "heartbeat-deadline-ms",
                format!(
                    "{} must be at least twice --heartbeat-interval-ms ({})",
                    self.heartbeat_deadline_ms, self.heartbeat_interval_ms
                ),
            ));
        }
        if self.halt_grace_ms == 0 {
            return Err(err("halt-grace-ms", "must be at least 1"));
        }
        if self.worker_stall_ms < 10 * self.heartbeat_interval_ms {
            return Err(err(
                "worker-stall-ms",
                format!(
                    "{} must be at least ten times --heartbeat-interval-ms ({}): the watchdog looks once per beat",
                    self.worker_stall_ms, self.heartbeat_interval_ms
                ),
            ));
        }
        Ok(())
    }

    /// The limits of the plain flags, in the order they are reported.
    pub(super) fn check_limits(&self) -> Result<(), ConfigError> {
        if self.budget > MAX_BUDGET {
            return Err(err(
                "budget",
                format!("{} exceeds the maximum of {MAX_BUDGET}", self.budget),
            ));
        }
        if !self.hard_limit.is_finite() || !(0.0..=1.0).contains(&self.hard_limit) {
            return Err(err(
                "hard-limit",
                format!("{} is not a probability in [0, 1]", self.hard_limit),
            ));
        }
        self.check_watchdog()?;
        if self.max_streams == 0 || self.max_streams > 1 << 20 {
            return Err(err("max-streams", "must be between 1 and 1048576"));
        }
        if self.max_body_bytes == 0 || self.max_body_bytes > 64 << 20 {
            return Err(err("max-body-bytes", "must be between 1 and 67108864"));
        }
        if self.builtin_token_interval_us > 60_000_000 {
            return Err(err("builtin-token-interval-us", "must be at most 60 s"));
        }
        if self.request_timeout_ms == 0 {
            return Err(err("request-timeout-ms", "must be at least 1"));
        }
        if self.client_idle_timeout_ms == 0 {
            return Err(err("client-idle-timeout-ms", "must be at least 1"));
        }
        if self.max_turns_per_conn == 0 {
            return Err(err("max-turns-per-conn", "must be at least 1"));
        }
        if !(100..=3_600_000).contains(&self.send_stall_timeout_ms) {
            return Err(err(
                "send-stall-timeout-ms",
                "must be between 100 (0.1 s) and 3600000 (an hour)",
            ));
        }
        if !(1..=32).contains(&self.addr_prefix_v4) {
            return Err(err("addr-prefix-v4", "must be between 1 and 32 (bits)"));
        }
        if !(1..=128).contains(&self.addr_prefix_v6) {
            return Err(err("addr-prefix-v6", "must be between 1 and 128 (bits)"));
        }
        if self.group.is_some() && self.user.is_none() {
            return Err(err("group", "is only used with --user"));
        }
        if let Some(h) = &self.identity_header {
            let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
            if h.is_empty() || !h.bytes().all(token) {
                return Err(err("identity-header", "must be an HTTP header name"));
            }
        }
        if !(1..=100).contains(&self.request_phase_share) {
            return Err(err(
                "request-phase-share",
                "must be between 1 and 100 (percent)",
            ));
        }
        if self.no_kernel_gate && self.bpf_object.is_some() {
            return Err(err(
                "bpf-object",
                "makes no sense together with --no-kernel-gate",
            ));
        }
        Ok(())
    }

    /// `--upstream`, parsed (not resolved: a name that does not resolve yet is retried), for `--source openai`; `None` for the built-in
    /// source.
    pub(super) fn upstream_url(
        &self,
    ) -> Result<Option<crate::upstream::url::UpstreamUrl>, ConfigError> {
        let upstream = match (self.source, self.upstream.as_deref()) {
            (SourceKind::Openai, None) => {
                return Err(err(
                    "upstream",
                    "--source openai needs --upstream URL (e.g. http://127.0.0.1:8000)",
                ))
            }
            (SourceKind::Openai, Some(u)) => {
                let url = crate::upstream::url::UpstreamUrl::parse(u)
                    .map_err(|e| err("upstream", format!("{u:?}: {e}")))?;
                Some(url)
            }
            (SourceKind::Builtin, Some(_)) => {
                return Err(err(
                    "upstream",
                    "is only used with --source openai (the builtin source needs no upstream)",
                ))
            }
            (SourceKind::Builtin, None) => None,
        };
        Ok(upstream)
    }

    /// The TLS configuration of an `https://` upstream (`--upstream-ca-file` or the system's
    /// roots); `--upstream-ca-file` without an `https://` upstream is refused, since it would
    /// suggest TLS where there is none.
    pub(super) fn upstream_tls(
        &self,
        url: Option<&crate::upstream::url::UpstreamUrl>,
    ) -> Result<Option<std::sync::Arc<crate::upstream::UpstreamTls>>, ConfigError> {
        let ca = self.upstream_ca_file.as_deref();
        match url {
            Some(u) if u.tls => crate::upstream::UpstreamTls::load(u, ca)
                .map(|t| Some(std::sync::Arc::new(t)))
                .map_err(|e| err("upstream-ca-file", e.to_string())),
            _ if ca.is_some() => Err(err(
                "upstream-ca-file",
                "is only used with an https:// --upstream",
            )),
            _ => Ok(None),
        }
    }

    /// TLS for clients: `--tls-cert` and `--tls-key` together, or neither.
    pub(super) fn client_tls(
        &self,
    ) -> Result<Option<std::sync::Arc<crate::client_tls::ClientTlsConfig>>, ConfigError> {
        match (self.tls_cert.as_deref(), self.tls_key.as_deref()) {
            (None, None) => Ok(None),
            (Some(cert), Some(key)) => crate::client_tls::ClientTlsConfig::load(cert, key)
                .map(|c| Some(std::sync::Arc::new(c)))
                .map_err(|e| err("tls-cert", e.to_string())),
            (Some(_), None) => Err(err("tls-key", "is required with --tls-cert")),
            (None, Some(_)) => Err(err("tls-cert", "is required with --tls-key")),
        }
    }

    /// The upstream timeouts and pool, `--degraded-for-s` and `--degraded-instruction`.
    pub(super) fn check_upstream_timeouts(&self) -> Result<(), ConfigError> {
        for (flag, v) in [
            (
                "upstream-connect-timeout-ms",
                self.upstream_connect_timeout_ms,
            ),
            (
                "upstream-first-token-timeout-ms",
                self.upstream_first_token_timeout_ms,
            ),
            ("upstream-stall-timeout-ms", self.upstream_stall_timeout_ms),
            (
                "upstream-pool-idle-timeout-ms",
                self.upstream_pool_idle_timeout_ms,
            ),
        ] {
            if v == 0 || v > 3_600_000 {
                return Err(err(flag, format!("{v} must be between 1 and 3600000")));
            }
        }
        if self.upstream_pool_idle > MAX_POOL_IDLE {
            return Err(err(
                "upstream-pool-idle",
                format!(
                    "{} must be at most {MAX_POOL_IDLE}",
                    self.upstream_pool_idle
                ),
            ));
        }
        if self.degraded_for_s > 30 * 86_400 {
            return Err(err("degraded-for-s", "must be at most 30 days"));
        }
        if self.degraded_ask_first.len() > super::MAX_DEGRADED_INSTRUCTION {
            return Err(err(
                "degraded-ask-first",
                format!(
                    "{} bytes: at most {}",
                    self.degraded_ask_first.len(),
                    super::MAX_DEGRADED_INSTRUCTION
                ),
            ));
        }
        if self.degraded_instruction.len() > super::MAX_DEGRADED_INSTRUCTION {
            return Err(err(
                "degraded-instruction",
                format!(
                    "{} bytes: at most {} (the model reads it before every degraded turn)",
                    self.degraded_instruction.len(),
                    super::MAX_DEGRADED_INSTRUCTION
                ),
            ));
        }
        Ok(())
    }

    /// `--workers`, or the CPUs (at most 8).
    pub(super) fn worker_count(&self) -> Result<usize, ConfigError> {
        let workers = match self.workers {
            Some(0) => return Err(err("workers", "must be at least 1")),
            Some(n) if n > 256 => return Err(err("workers", "must be at most 256")),
            Some(n) => n,
            None => std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(8),
        };
        Ok(workers)
    }
}
