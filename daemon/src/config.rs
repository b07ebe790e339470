//! `haltd serve` configuration: command-line flags with documented defaults, each also
//! settable from the environment and the config file ([`layers`]), validated into a
//! [`Config`] before anything starts. An invalid value stops the daemon with an error that
//! names the flag (fail closed: haltd never serves with a configuration it doubts);
//! `haltd check-config` runs the same validation without starting anything ([`check`]).

mod addr;
mod admin;
pub mod check;
pub mod escalation;
mod faults;
pub mod file;
pub mod layers;
pub mod reference;
pub mod sighup;
mod upstream_watch;
mod validate;

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use clap::{Args, ValueEnum};
use serde::Deserialize;

pub use crate::logging::LogFormat;
pub use admin::{AdminAddr, AdminToken, DEFAULT_ADMIN_SOCKET};
use faults::parse_faults;
pub use faults::Faults;
pub use upstream_watch::{ProbeSettings, WatchSettings};

/// Where tokens come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SourceKind {
    /// The deterministic language model compiled into the binary (model name `builtin`).
    Builtin,
    /// An OpenAI-compatible backend (vLLM, llama.cpp server, Ollama, ...) at `--upstream`.
    Openai,
}

/// Flags of `haltd serve`.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Client-facing address (HTTP/1.1, OpenAI-compatible, served on io_uring): IP:PORT or HOST:PORT (a name is resolved once, at start; haltd listens on its first IPv4 address, else its first IPv6 one).
    #[arg(long, default_value = "127.0.0.1:8080", value_parser = addr::socket_addr)]
    pub listen: SocketAddr,
    /// Admin API (`POST /admin/streams/{id}/trip`, `GET /admin/streams`, ...): `unix:PATH`, a Unix socket of mode 0660 whose callers are recorded by uid and pid, or `IP:PORT`, which needs --admin-token-file.
    #[arg(long, default_value = "unix:/run/haltd/admin.sock", value_parser = clap::builder::ValueParser::new(|s: &str| s.parse::<AdminAddr>()))]
    pub admin: AdminAddr,
    /// Group of the admin socket (a name or a gid): its members may use the admin API. Default: the group haltd runs as (root).
    #[arg(long, value_name = "GROUP")]
    pub admin_group: Option<String>,
    /// File holding the bearer token a TCP admin listener requires (one line, at least 16 characters, not readable by other users).
    #[arg(long, value_name = "FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// Prometheus metrics address (`GET /metrics`): IP:PORT or HOST:PORT, as --listen.
    #[arg(long, default_value = "127.0.0.1:9464", value_parser = addr::socket_addr)]
    pub metrics: SocketAddr,
    /// Token source.
    #[arg(long, value_enum, default_value = "builtin")]
    pub source: SourceKind,
    /// Config file (TOML): any of these settings at its top (`listen = "127.0.0.1:8080"`; a flag or HALTD_* variable wins over it), then the detector and SafetyCheck settings (`[detectors.*]`, `[safety]`; see docs/detectors.md), the flight recorder's sampling (`[flight_recorder]`), TokenCircuit (`[tool_circuit]`, docs/tokencircuit.md), grounding (`[grounding]`, docs/grounding.md) and `[log] level`. Without it every detector runs with its defaults.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Upstream base URL for `--source openai`, e.g. `http://127.0.0.1:8000` or `https://api.example.com/v1` (TLS, verified; a trailing `/v1` is accepted).
    #[arg(long, value_name = "URL")]
    pub upstream: Option<String>,
    /// File holding haltd's own API key for the upstream (one line, mode 0600): haltd then sends `Authorization: Bearer <key>` upstream instead of the client's value, which still names the client's conversation. Default: the client's `Authorization` goes upstream as it came.
    #[arg(long, value_name = "FILE")]
    pub upstream_api_key_file: Option<PathBuf>,
    /// What goes upstream as `x-request-id`: `uuid`, a v4 UUID haltd makes for each request (backends such as llama-cpp-python refuse any other shape); `client`, the request's id as the access log has it (the client's, or one haltd made); `off`, none. Under `uuid` and `off` the client's own id goes as `x-haltd-client-request-id`.
    #[arg(long, value_enum, default_value = "uuid")]
    pub upstream_request_id: crate::wire::trace::UpstreamRequestId,
    /// Client surfaces the backend serves itself, comma-separated (`responses`, `messages`): their requests go to the backend's own `/v1/responses` or `/v1/messages` as they came (with `stream: true`, and logprobs asked for on Responses), and its stream in that surface's events is governed and re-encoded like any other. Default: none, every surface is translated to chat completions. Only with `--source openai`.
    #[arg(long, value_enum, value_name = "SURFACES", value_delimiter = ',')]
    pub upstream_surfaces: Vec<crate::upstream::UpstreamSurface>,
    /// PEM file of the CA certificates that vouch for an `https://` upstream; they replace the system's trust roots (default: the system store).
    #[arg(long, value_name = "FILE")]
    pub upstream_ca_file: Option<PathBuf>,
    /// PEM certificate chain (leaf first) for TLS on `--listen` (with `--tls-key`; both or neither). Clients then speak HTTPS: TLS 1.3 and 1.2, ALPN `http/1.1`; SIGHUP reads the file (and the key) again for new connections, at the path given at start.
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `--tls-cert`.
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Time to connect to the upstream (ms); past it the turn fails with UPSTREAM_FAILURE (connect_timeout).
    #[arg(long, default_value_t = 5_000)]
    pub upstream_connect_timeout_ms: u64,
    /// Time from sending the request to the upstream's first event (ms): prefill of long prompts counts here.
    #[arg(long, default_value_t = 60_000)]
    pub upstream_first_token_timeout_ms: u64,
    /// Inter-token deadline (ms): an upstream silent this long mid-stream has stalled; the turn halts with UPSTREAM_FAILURE.
    #[arg(long, default_value_t = 30_000)]
    pub upstream_stall_timeout_ms: u64,
    /// Idle upstream connections each data-plane worker keeps for the next request (HTTP/1.1 keep-alive); 0: a new connection per request.
    #[arg(long, default_value_t = 32)]
    pub upstream_pool_idle: usize,
    /// How long an idle upstream connection stays pooled (ms); keep it below the upstream's own keep-alive timeout (uvicorn, so vLLM: 5 s).
    #[arg(long, default_value_t = 4_000)]
    pub upstream_pool_idle_timeout_ms: u64,
    /// Upstream probe for `/readyz` (docs/operations.md, "Readiness"): the API path haltd GETs, below the upstream's base URL; `/v1/models` also lists the model ids.
    #[arg(long, default_value = "/v1/models", value_name = "PATH")]
    pub upstream_probe_path: String,
    /// How often the upstream is probed (ms).
    #[arg(long, default_value_t = 1_000)]
    pub upstream_probe_interval_ms: u64,
    /// Time one probe may take, connect to last byte (ms).
    #[arg(long, default_value_t = 1_000)]
    pub upstream_probe_timeout_ms: u64,
    /// Failed probes in a row that make the upstream down (haltd not ready).
    #[arg(long, default_value_t = 2)]
    pub upstream_probe_failures: u32,
    /// Successful probes in a row that make a down upstream up again.
    #[arg(long, default_value_t = 1)]
    pub upstream_probe_successes: u32,
    /// Do not probe the upstream: `/readyz` then only checks that its name resolves.
    #[arg(long)]
    pub no_upstream_probe: bool,
    /// How often the upstream's host name is resolved again (ms); also after each failed probe, and with backoff while it does not resolve.
    #[arg(long, default_value_t = 30_000)]
    pub upstream_resolve_interval_ms: u64,
    /// What a halt puts into degraded safe mode: the conversation's API key, or the whole node.
    #[arg(long, value_enum, default_value = "key")]
    pub degraded_scope: crate::modes::DegradedScope,
    /// Whether clients must hold a key haltd issued (`haltctl key add`): `store` answers every /v1/ request without a valid, unrevoked key with 401, keys degraded mode, TokenCircuit and the limits on the key's id, and never sends the client's key upstream.
    #[arg(long, value_enum, default_value = "off")]
    pub client_keys: crate::keys::ClientKeys,
    /// Name a request's scope (degraded mode, limits) and its conversation by this header's value (a header a trusted gateway sets, e.g. its user header); requests without it fall back to the address group (scope) and the bearer token (conversation).
    #[arg(long, value_name = "HEADER")]
    pub identity_header: Option<String>,
    /// Directory of haltd's persistent state (the node secret that keys key fingerprints, the ledger's key and head, the state store).
    #[arg(long, default_value = "/var/lib/haltd")]
    pub state_dir: PathBuf,
    /// What a start does when the state store (state.db in --state-dir: the degraded scopes that survive a restart) does not match the ledger: refuse to start (exit 4, with the reason), or start with the whole node degraded until the operator ends it (recorded). Never a silent reset.
    #[arg(long, value_enum, default_value = "refuse")]
    pub state_mismatch: crate::state::restore::OnMismatch,
    /// Unprivileged user (a name or a uid) haltd switches to once the gate is loaded and the listeners are bound; the ledger and --state-dir must be that user's. Default: keep the user haltd started as (every capability is dropped either way).
    #[arg(long, value_name = "USER")]
    pub user: Option<String>,
    /// Group (a name or a gid) for --user. Default: the user's primary group.
    #[arg(long, value_name = "GROUP")]
    pub group: Option<String>,
    /// Degraded mode ends by itself after this many seconds; each later halt in the scope restarts its timer (0: only `haltctl mode full` ends it). The default, an hour, is long enough for an operator to be paged and look, and short enough that an unattended node gives its honest clients streams and tools back.
    #[arg(long, default_value_t = DEFAULT_DEGRADED_FOR_S)]
    pub degraded_for_s: u64,
    /// Degraded mode's "ask first": the first turn of each scope after it entered degraded mode is answered with this text instead of the model (a question back to the user, say what they need and on what facts), in the surface's own shape; empty (the default): off. A restart asks each degraded scope's first turn again. At most 4096 bytes.
    #[arg(long, default_value = "")]
    pub degraded_ask_first: String,
    /// HTTPS endpoint that each scope's entry into degraded mode is posted to, as JSON (escalation to a human, spec 000 §4.2 step 4): retried with backoff within --escalation-deadline-ms, and every delivery, or its failure, is a ledger record. Default: none.
    #[arg(long, value_name = "URL")]
    pub escalation_url: Option<String>,
    /// File holding the bearer token sent with each escalation (one line, mode 0600).
    #[arg(long, value_name = "FILE")]
    pub escalation_token_file: Option<PathBuf>,
    /// PEM file of the CA certificates that vouch for --escalation-url; they replace the system's trust roots.
    #[arg(long, value_name = "FILE")]
    pub escalation_ca_file: Option<PathBuf>,
    /// Most attempts per escalation (1 to 20); between them haltd waits 250 ms, doubled each time, at most 8 s.
    #[arg(long, default_value_t = 5)]
    pub escalation_attempts: u32,
    /// How long one escalation may take, its attempts and their waits together (100 ms to 10 minutes).
    #[arg(long, default_value_t = 60_000)]
    pub escalation_deadline_ms: u64,
    /// Instruction a degraded turn's model reads first (fact-only literal content, spec 000 §4.2 step 4): a system message before a chat request's messages, or after a passed-through Responses or Messages request's own instructions; empty for none. A degraded turn also goes without tools and at temperature 0. At most 4096 bytes.
    #[arg(long, default_value = crate::upstream::DegradedShape::DEFAULT.instruction)]
    pub degraded_instruction: String,
    /// Pace of the built-in source: microseconds between tokens (0 = as fast as the socket takes them).
    #[arg(long, default_value_t = 20_000)]
    pub builtin_token_interval_us: u64,
    /// The built-in model starts each reply by restating the request's last user message (a trailing `?` dropped), each word a confident token, then samples as usual. For the grounding A/B harness: the model's surprising text then follows the question, so a grounding round reads the question with it (docs/grounding.md, "The A/B harness"). The model knows nothing: a correct answer can only come from the evidence it reads after a rewind.
    #[arg(long)]
    pub builtin_restate_prompt: bool,
    /// Halt budget B: token frames that may still reach a client after the trip point (the default route's; a `[[routes]]` entry may set its own).
    #[arg(long, default_value_t = 5)]
    pub budget: u32,
    /// Architecture profile (spec 000 §7): `full`, or `mkp`, the Minimal Kernel Profile, which refuses to start with --no-kernel-gate or a B above 5 on any route; `haltctl profile set` switches it at runtime (docs/operations.md "Policy at runtime").
    #[arg(long, value_enum, default_value = "full")]
    pub profile: crate::policy::Profile,
    /// Refuse every runtime or SIGHUP change that loosens the policy: a higher B, batch-only lifted, a detector less strict (hard, observe, off) or a threshold that trips later, a switch away from `mkp`, the end of a degraded scope. Each refusal is a WARN line and a ledger record.
    #[arg(long)]
    pub lock_policy: bool,
    /// HaltMonitor hard limit on the per-token score (the token's probability); a token scoring below it halts the stream and is not emitted. 0 disables.
    #[arg(long, default_value_t = 0.0)]
    pub hard_limit: f64,
    /// Flight-recorder file (JSON Lines, hash-linked, fsync'd per record).
    #[arg(long, default_value = "haltd-ledger.jsonl")]
    pub ledger: PathBuf,
    /// Skip the fsync after each record (faster, loses the last records on power loss).
    #[arg(long)]
    pub ledger_no_fsync: bool,
    /// Share of normal turns whose record the flight recorder keeps, 0.01 ..= 1 (spec 000 §6.2: 1–5 %; above 0.05 is logged as outside it). Incidents, halted and failed turns are always recorded. Overrides `[flight_recorder] turn_sample_rate` of `--config` [0.05].
    #[arg(long, value_name = "R", allow_negative_numbers = true)]
    pub turn_sample_rate: Option<f64>,
    /// Turn records carry the turn's output text (first 64 KiB); off, records hold no generated text. `--record-token-text=false` overrides `[flight_recorder] record_token_text = true` of `--config` [false].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub record_token_text: Option<bool>,
    /// Run WITHOUT the kernel halt gate: only the userspace watchdog enforces the budget. Stated in every record and in `haltd_kernel_gate_enabled`.
    #[arg(long)]
    pub no_kernel_gate: bool,
    /// Load the halt-gate BPF object from this file instead of the one embedded at build time.
    #[arg(long)]
    pub bpf_object: Option<PathBuf>,
    /// Watchdog heartbeat period in milliseconds.
    #[arg(long, default_value_t = 5)]
    pub heartbeat_interval_ms: u64,
    /// A heartbeat older than this (ms) counts as lost: every stream halts with HEARTBEAT_LOST.
    #[arg(long, default_value_t = 200)]
    pub heartbeat_deadline_ms: u64,
    /// After a trip, how long (ms) the emitter has to send the terminal event before the watchdog does it and closes the stream.
    #[arg(long, default_value_t = 50)]
    pub halt_grace_ms: u64,
    /// Most concurrently open client connections (also the size of the kernel trip map).
    #[arg(long, default_value_t = 4096)]
    pub max_streams: u32,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// Time a client has to send its whole request (ms), from accept to the end of the body, before it gets 408.
    #[arg(long, default_value_t = 10_000)]
    pub request_timeout_ms: u64,
    /// On SIGTERM/SIGINT, how long open streams may finish (ms) while new turns get 503; then what is left halts with SERVICE_SHUTDOWN. 0 halts at once.
    #[arg(long, default_value_t = 30_000)]
    pub drain_timeout_ms: u64,
    /// Hand over from the haltd already serving --listen: this one starts beside it (its own gate, cgroup leaf, SO_REUSEPORT listener and ledger segment), then tells it to stop accepting and drain (docs/operations.md "Upgrading"). With nothing to take over it starts as usual.
    #[arg(long)]
    pub take_over: bool,
    /// The admin API of the haltd to take over from (`unix:PATH` or `IP:PORT`, as --admin). Default: --admin, whose socket this one then takes.
    #[arg(long, value_name = "ADMIN", value_parser = clap::builder::ValueParser::new(|s: &str| s.parse::<AdminAddr>()))]
    pub take_over_from: Option<AdminAddr>,
    /// With --take-over: how long (ms) both processes accept new connections before the old one stops accepting and drains (a canary window); 0 hands over as soon as this one serves.
    #[arg(long, default_value_t = 0)]
    pub take_over_overlap_ms: u64,
    /// Most open connections from one source address group (more get 429); 0 = no cap. Addresses are grouped by --addr-prefix-v4 and --addr-prefix-v6.
    #[arg(long, default_value_t = 256)]
    pub max_conns_per_addr: u32,
    /// Most governed turns one scope may have open at once on this node (more get 429); 0 = no limit. A scope is the --identity-header value, else the client address group (docs/operations.md "Who a request is").
    #[arg(long, default_value_t = 0)]
    pub limit_concurrency: u32,
    /// Most governed turns one scope may start per minute on this node (more get 429 with Retry-After); 0 = no limit.
    #[arg(long, default_value_t = 0)]
    pub limit_requests_per_minute: u32,
    /// Most prompt and output tokens one scope may use per minute on this node, counted when each turn ends (a request after the minute's tokens are spent gets 429 with Retry-After); 0 = no limit.
    #[arg(long, default_value_t = 0)]
    pub limit_tokens_per_minute: u64,
    /// Prefix length (bits, 1-32) that groups IPv4 client addresses for --max-conns-per-addr: 32 counts each address alone.
    #[arg(long, default_value_t = 32)]
    pub addr_prefix_v4: u8,
    /// Prefix length (bits, 1-128) that groups IPv6 client addresses for --max-conns-per-addr: 64 counts a whole /64 (one host's usual share) as one.
    #[arg(long, default_value_t = 64)]
    pub addr_prefix_v6: u8,
    /// A client that keeps bytes waiting in its socket and acknowledges none of them for this long (ms) is cut: its stream halts with CLIENT_STALLED, the connection is reset and its slot freed.
    #[arg(long, default_value_t = 30_000)]
    pub send_stall_timeout_ms: u64,
    /// Share of --max-streams (percent, 1-100) that connections still sending their request may hold (more get 503).
    #[arg(long, default_value_t = 50)]
    pub request_phase_share: u32,
    /// How long a kept client connection may wait for its next request (ms) before haltd closes it.
    #[arg(long, default_value_t = 5_000)]
    pub client_idle_timeout_ms: u64,
    /// Most turns one client connection may carry; the last one says `connection: close` (1 = never keep a connection).
    #[arg(long, default_value_t = 1_000)]
    pub max_turns_per_conn: u32,
    /// Data-plane worker threads, one io_uring each (default: CPUs, at most 8).
    #[arg(long)]
    pub workers: Option<usize>,
    /// A data-plane worker that completes no step for this long (ms) while it has open streams is stuck (a check that never returns): the watchdog halts its streams with DETECTOR_FAILURE and haltd exits 70 for the service manager to restart it.
    #[arg(long, default_value_t = 1_000)]
    pub worker_stall_ms: u64,
    /// Test-only faults (builds with the `fault-injection` feature): `emitter-ignores-halt`, `watchdog-stall-after-ms=N`, `ledger-slow-write-ms=N`, `panic-after-tokens=N[,thread=worker|watchdog]`, `close-during-step=N`, `state-write-fails-after=N`, `detector-hang=NAME`, `ledger-write-fails-after=N`, `silent-rewrite=FROM>TO`.
    #[arg(long = "fault", value_name = "FAULT")]
    pub faults: Vec<String>,
    /// Log format on stderr.
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Where the access log goes, one line per request: `stderr` (haltd's log, target `haltd::access`, at --access-log-level), a file path (JSON Lines, appended, reopened on SIGHUP), or `off`.
    #[arg(long, value_name = "DEST", default_value = "stderr")]
    pub access_log: crate::access_log::Destination,
    /// Level of the access log's lines on stderr (a level the log filter drops writes nothing).
    #[arg(long, value_enum, default_value = "info")]
    pub access_log_level: crate::access_log::Level,
    /// Model names metrics may carry as a label, comma-separated; other names count as `other`. Default: the upstream's `GET /v1/models` ids, as the upstream probe reads them (`builtin` is always known).
    #[arg(long, value_name = "NAMES", value_delimiter = ',')]
    pub metric_models: Vec<String>,
}

/// A configuration error, naming the flag.
#[derive(Debug, thiserror::Error)]
#[error("invalid --{flag}: {reason}")]
pub struct ConfigError {
    pub flag: &'static str,
    pub reason: String,
    /// The key of the config file the error is about (`detectors.surprise.window`), if it is
    /// about one: `haltd check-config` shows its line.
    pub key: Option<String>,
}

pub(crate) fn err(flag: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        flag,
        reason: reason.into(),
        key: None,
    }
}

impl ConfigError {
    /// The same error, about the file's `key`.
    fn at(self, key: impl Into<String>) -> Self {
        ConfigError {
            key: Some(key.into()),
            ..self
        }
    }
}

/// What `--config` sets that SIGHUP reloads: the detectors and SafetyCheck, and the log level.
#[derive(Debug, Clone)]
pub struct Reloadable {
    pub detectors: crate::detect::pipeline::DetectorsConfig,
    /// `[[routes]]`, in file order.
    pub routes: Vec<crate::policy::RouteConfig>,
    /// `[log] level` (an `EnvFilter` directive); `HALTD_LOG` wins over it.
    pub log_level: Option<String>,
}

/// Validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub args: ServeArgs,
    pub token_interval: Duration,
    pub heartbeat_interval: Duration,
    pub heartbeat_deadline: Duration,
    pub halt_grace: Duration,
    /// `--worker-stall-ms`: how long a worker with open streams may take over one step.
    pub worker_stall: Duration,
    pub request_timeout: Duration,
    pub drain_timeout: Duration,
    pub client_idle_timeout: Duration,
    /// `--send-stall-timeout-ms`.
    pub send_stall_timeout: Duration,
    pub workers: usize,
    pub faults: Faults,
    /// The upstream of `--source openai`, parsed (its name is resolved by
    /// [`crate::upstream_watch`], at start and again while haltd runs).
    pub upstream: Option<crate::upstream::url::UpstreamUrl>,
    /// How the upstream is watched: its probe and the re-resolution of its name.
    pub upstream_watch: WatchSettings,
    /// The TLS configuration of an `https://` upstream (trust roots, SNI, ALPN).
    pub upstream_tls: Option<std::sync::Arc<crate::upstream::UpstreamTls>>,
    /// The key of `--upstream-api-key-file`, sent upstream instead of the client's.
    pub upstream_api_key: Option<crate::upstream::UpstreamApiKey>,
    /// `--upstream-surfaces`: the surfaces passed through to the backend as they came.
    pub upstream_surfaces: crate::upstream::NativeSurfaces,
    /// TLS for clients (`--tls-cert`, `--tls-key`), reloaded on SIGHUP.
    pub client_tls: Option<std::sync::Arc<crate::client_tls::ClientTlsConfig>>,
    /// The token of `--admin-token-file`: a TCP admin listener has one.
    pub admin_token: Option<AdminToken>,
    pub upstream_connect_timeout: Duration,
    pub upstream_first_token_timeout: Duration,
    pub upstream_stall_timeout: Duration,
    pub upstream_pool_idle_timeout: Duration,
    /// `--degraded-for-s`, `None` for 0.
    pub degraded_for: Option<Duration>,
    /// `--escalation-url` and its flags, checked.
    pub escalation: Option<std::sync::Arc<escalation::Escalation>>,
    /// The detectors' settings (config file and `--hard-limit`), validated.
    pub detectors: crate::detect::pipeline::DetectorsConfig,
    /// `[[routes]]` of the config file at start, validated.
    pub routes: Vec<crate::policy::RouteConfig>,
    /// `[log] level` of the config file at start.
    pub log_level: Option<String>,
    /// What the flight recorder keeps (`--turn-sample-rate`, `--record-token-text`, or
    /// `[flight_recorder]` of the config file).
    pub sampling: crate::sampling::SamplingPolicy,
    /// `--user` and `--group`, resolved.
    pub account: Option<crate::privs::Account>,
    /// TokenCircuit (`[tool_circuit]` of the config file, fixed at start): the policy the
    /// proxy enforces on chat turns, `None` when disabled.
    pub tool_circuit: Option<std::sync::Arc<crate::circuit::CircuitPolicy>>,
    /// Grounding (`[grounding]` of the config file, fixed at start, validated): how a
    /// grounding round grounds a span ([`crate::grounding::Grounding::from_config`]).
    pub grounding: crate::grounding::GroundingConfig,
    /// The `--config` file as read at start (`None` without one): what SIGHUP compares the
    /// file with, to name the changes that apply only at the next start ([`sighup`]).
    pub file_at_start: Option<toml::Table>,
}

impl Config {
    /// What the policy set is built from, with the runtime switches `overrides`.
    pub fn policy_inputs(
        &self,
        overrides: crate::policy::Overrides,
    ) -> crate::policy::PolicyInputs {
        crate::policy::PolicyInputs {
            profile: self.args.profile,
            detectors: self.detectors.clone(),
            routes: self.routes.clone(),
            budget: self.args.budget,
            circuit: self.tool_circuit.clone(),
            kernel_gate: !self.args.no_kernel_gate,
            watchdog: self.faults.watchdog_stall_after.is_none(),
            overrides,
        }
    }

    /// Refuses a configuration that breaks its profile's floor (`--profile mkp`), naming the
    /// key.
    pub fn check_profile_floor(&self) -> Result<(), ConfigError> {
        let inputs = self.policy_inputs(crate::policy::Overrides::default());
        inputs.check_floor(self.args.profile).map_err(|e| {
            let flag = match e.key.as_str() {
                "budget" => "budget",
                "no-kernel-gate" => "no-kernel-gate",
                "fault" => "fault",
                _ => "config",
            };
            let key = e.key.clone();
            let error = err(flag, e.to_string());
            if flag == "config" {
                error.at(key)
            } else {
                error
            }
        })
    }

    /// Whether the client's credential goes upstream as it came: not when haltd's own key
    /// replaces it, nor when it is a key of haltd's store.
    pub fn client_credential_goes_upstream(&self) -> bool {
        self.upstream_api_key.is_none() && self.args.client_keys == crate::keys::ClientKeys::Off
    }
}

/// TokenCircuit's policy as configured: `None` when disabled.
pub type ToolCircuit = Option<std::sync::Arc<crate::circuit::CircuitPolicy>>;

/// What [`ServeArgs::file_settings`] reads: the sampling policy, TokenCircuit, grounding
/// (all fixed at start) and what SIGHUP reloads.
pub type FileSettings = (
    crate::sampling::SamplingPolicy,
    ToolCircuit,
    crate::grounding::GroundingConfig,
    Reloadable,
);

/// Most B accepted: a larger budget is no halt budget.
pub const MAX_BUDGET: u32 = 1000;
/// `--degraded-for-s` by default: one hour (issue 37; it was 0, until the operator ends it).
pub const DEFAULT_DEGRADED_FOR_S: u64 = 3600;
/// Longest `--degraded-instruction`.
pub const MAX_DEGRADED_INSTRUCTION: usize = 4096;
/// Most idle upstream connections a worker may keep (`--upstream-pool-idle`).
pub const MAX_POOL_IDLE: usize = 4096;

impl ServeArgs {
    /// Every flag checked, and the files read, into the [`Config`] haltd runs with.
    pub fn validate(self) -> Result<Config, ConfigError> {
        self.check_limits()?;
        let upstream = self.upstream_url()?;
        let upstream_tls = self.upstream_tls(upstream.as_ref())?;
        let upstream_api_key = self.upstream_api_key()?;
        let upstream_surfaces = self.upstream_surfaces()?;
        let client_tls = self.client_tls()?;
        self.check_upstream_timeouts()?;
        let upstream_watch = WatchSettings::from_args(&self)?;
        let file_at_start = self.read_config_file()?;
        let (
            sampling,
            tool_circuit,
            grounding,
            Reloadable {
                detectors,
                routes,
                log_level,
            },
        ) = self.file_settings(file_at_start.clone())?;
        let faults = parse_faults(&self.faults)?;
        let workers = self.worker_count()?;
        let admin_token = self.admin_token()?;
        let account = self.account()?;
        let escalation = self.escalation()?;
        let cfg = Config {
            escalation,
            admin_token,
            account,
            token_interval: Duration::from_micros(self.builtin_token_interval_us),
            heartbeat_interval: Duration::from_millis(self.heartbeat_interval_ms),
            heartbeat_deadline: Duration::from_millis(self.heartbeat_deadline_ms),
            halt_grace: Duration::from_millis(self.halt_grace_ms),
            worker_stall: Duration::from_millis(self.worker_stall_ms),
            request_timeout: Duration::from_millis(self.request_timeout_ms),
            drain_timeout: Duration::from_millis(self.drain_timeout_ms),
            client_idle_timeout: Duration::from_millis(self.client_idle_timeout_ms),
            send_stall_timeout: Duration::from_millis(self.send_stall_timeout_ms),
            workers,
            faults,
            upstream,
            upstream_watch,
            upstream_tls,
            upstream_api_key,
            upstream_surfaces,
            client_tls,
            upstream_connect_timeout: Duration::from_millis(self.upstream_connect_timeout_ms),
            upstream_first_token_timeout: Duration::from_millis(
                self.upstream_first_token_timeout_ms,
            ),
            upstream_stall_timeout: Duration::from_millis(self.upstream_stall_timeout_ms),
            upstream_pool_idle_timeout: Duration::from_millis(self.upstream_pool_idle_timeout_ms),
            detectors,
            routes,
            log_level,
            sampling,
            tool_circuit,
            grounding,
            file_at_start,
            degraded_for: (self.degraded_for_s > 0)
                .then(|| Duration::from_secs(self.degraded_for_s)),
            args: self,
        };
        cfg.check_profile_floor()?;
        Ok(cfg)
    }
}

impl ServeArgs {
    /// These flags as a command of their own (`serve`): what [`layers`] and the reference
    /// ([`reference`]) walk.
    pub fn command() -> clap::Command {
        <Self as Args>::augment_args(clap::Command::new("serve"))
    }

    /// Reads `--config` again for SIGHUP: what can change without a restart.
    pub fn reloadable(&self) -> Result<Reloadable, ConfigError> {
        let mut file = self.read_config_file()?;
        // Sampling is fixed at start (the ledger's records of it stay true), and so are
        // TokenCircuit's policy and grounding (its memory store is indexed at start).
        file.as_mut().map(|t| t.remove("flight_recorder"));
        file.as_mut().map(|t| t.remove("tool_circuit"));
        file.as_mut().map(|t| t.remove("grounding"));
        self.reloadable_of(file)
    }

    /// The detectors, SafetyCheck and `[log] level` of a parsed config file.
    fn reloadable_of(&self, mut file: Option<toml::Table>) -> Result<Reloadable, ConfigError> {
        let log = file.as_mut().and_then(|t| t.remove("log"));
        let log_level = match log {
            None => None,
            Some(toml::Value::Table(mut t)) => {
                let level = match t.remove("level") {
                    None => None,
                    Some(toml::Value::String(s)) => {
                        crate::logging::check_level(&s)
                            .map_err(|e| err("log.level", e).at("log.level"))?;
                        Some(s)
                    }
                    Some(other) => {
                        return Err(err("log.level", format!("must be a string, not {other}"))
                            .at("log.level"))
                    }
                };
                if let Some(k) = t.keys().next() {
                    return Err(err("log", format!("unknown key {k:?} (known: level)"))
                        .at(format!("log.{k}")));
                }
                level
            }
            Some(_) => return Err(err("log", "must be a table ([log])").at("log")),
        };
        // The settings at the top of the file were read with the flags, at start.
        if let Some(t) = file.as_mut() {
            t.retain(|k, v| v.is_table() || !layers::is_serve_key(k));
        }
        if let Some(k) = file
            .iter()
            .flat_map(|t| t.keys())
            .find(|k| !["detectors", "safety", "routes"].contains(&k.as_str()))
        {
            return Err(err(
                "config",
                format!(
                    "unknown section [{k}] (known: {}; settings at the top: the flags of `haltd serve`, docs/configuration.md)",
                    layers::SECTIONS_SHOWN
                ),
            )
            .at(k.clone()));
        }
        let routes = crate::policy::route::load(file.as_ref(), self.hard_limit, MAX_BUDGET)
            .map_err(|e| err("config", e.to_string()).at(e.at.clone()))?;
        file.as_mut().map(|t| t.remove("routes"));
        let detectors =
            crate::detect::pipeline::DetectorsConfig::load(file.as_ref(), self.hard_limit)
                .map_err(|e| err("config", e.to_string()).at(e.at.clone()))?;
        Ok(Reloadable {
            detectors,
            routes,
            log_level,
        })
    }

    /// The `--config` file as a TOML table, `None` without one.
    pub fn read_config_file(&self) -> Result<Option<toml::Table>, ConfigError> {
        let file = match &self.config {
            None => None,
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| err("config", format!("{}: {e}", path.display())))?;
                Some(parse_config_text(&text, &path.display().to_string())?)
            }
        };
        Ok(file)
    }

    /// What the `--config` file (parsed; `None` without one) sets, with these flags on top:
    /// the flight recorder's sampling (`[flight_recorder]`, fixed at start) and the rest,
    /// which SIGHUP reloads (`[detectors.*]`, `[safety]`, `[log]`). [`ServeArgs::validate`]
    /// runs it; public so that the fuzz target and its corpus replay (`crate::fuzz`) run the
    /// daemon's own loader.
    pub fn file_settings(
        &self,
        mut file: Option<toml::Table>,
    ) -> Result<FileSettings, ConfigError> {
        // `[flight_recorder]`, `[tool_circuit]` and `[grounding]` are read here; the rest of
        // the file is what SIGHUP reloads.
        let recorder = file.as_mut().and_then(|t| t.remove("flight_recorder"));
        let sampling = self.sampling_policy(recorder)?;
        let circuit = file.as_mut().and_then(|t| t.remove("tool_circuit"));
        let circuit = crate::circuit::config::ToolCircuitSection::load(circuit)
            .map_err(|e| err("config", format!("config {e}")).at(e.key.clone()))?;
        let grounding = file.as_mut().and_then(|t| t.remove("grounding"));
        let grounding = crate::grounding::GroundingConfig::load(grounding)
            .map_err(|e| err("config", format!("config {e}")).at(e.key.clone()))?;
        Ok((sampling, circuit, grounding, self.reloadable_of(file)?))
    }

    /// The flight recorder's sampling policy: the flags, else `[flight_recorder]` of the
    /// config file, else the defaults (5 %, no text).
    fn sampling_policy(
        &self,
        section: Option<toml::Value>,
    ) -> Result<crate::sampling::SamplingPolicy, ConfigError> {
        use crate::sampling::{check_rate, FileSection, SamplingPolicy};
        let file = match section {
            None => FileSection::default(),
            Some(v @ toml::Value::Table(_)) => FileSection::deserialize(v).map_err(|e| {
                err("config", format!("config flight_recorder: {e}")).at("flight_recorder")
            })?,
            Some(_) => {
                return Err(err(
                    "config",
                    "config flight_recorder: must be a table ([flight_recorder])",
                )
                .at("flight_recorder"))
            }
        };
        // The file's value is checked even when the flag overrides it: a file haltd would
        // refuse on its own is not a file to keep.
        let from_file = file
            .turn_sample_rate
            .map(check_rate)
            .transpose()
            .map_err(|e| {
                err(
                    "config",
                    format!("config flight_recorder.turn_sample_rate: {e}"),
                )
                .at("flight_recorder.turn_sample_rate")
            })?;
        let turn_sample_rate = match self.turn_sample_rate {
            Some(cli) => check_rate(cli).map_err(|e| err("turn-sample-rate", e))?,
            None => from_file.unwrap_or(SamplingPolicy::default().turn_sample_rate),
        };
        Ok(SamplingPolicy {
            turn_sample_rate,
            record_token_text: self
                .record_token_text
                .or(file.record_token_text)
                .unwrap_or(false),
        })
    }
}

/// The text of a `--config` file (`shown`: its path, for the message) as a TOML table.
pub fn parse_config_text(text: &str, shown: &str) -> Result<toml::Table, ConfigError> {
    text.parse::<toml::Table>()
        .map_err(|e| err("config", format!("{shown}: not valid TOML: {e}")))
}

#[cfg(test)]
mod tests;
