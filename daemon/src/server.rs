//! `haltd serve`: builds the shared state, loads the kernel gate, starts the watchdog, the
//! data-plane workers and the control plane, and reports readiness.

mod restore;
mod takeover;

use std::{
    os::fd::{FromRawFd, OwnedFd},
    sync::{atomic::AtomicU64, Arc},
};

use crate::{
    admin, build_info,
    config::{Config, LogFormat},
    dataplane,
    gate::{GateConfig, GateObject, KernelGate},
    halt::HaltCore,
    ledger::{Ledger, Record, RecordKind},
    lifecycle,
    metrics::Metrics,
    stream::StreamTable,
    watchdog,
};

/// Why `haltd serve` could not start. Each is fatal: haltd does not serve half-configured.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(
        "cannot load the kernel halt gate: {0}\n\
         haltd refuses to serve unpoliced streams. Fix the cause (root or CAP_BPF + CAP_NET_ADMIN, \
         a kernel with BTF and sk_msg, a binary built from this tree), or pass \
         --no-kernel-gate to run with the userspace watchdog alone (stated in every record)"
    )]
    Gate(#[source] crate::gate::GateError),
    #[error("opening the flight recorder: {0}")]
    Ledger(#[source] crate::ledger::LedgerError),
    #[error("{0}; haltd does not start with a crash it cannot record")]
    Crash(#[source] crate::crash::RecoverError),
    #[error("invalid --config: {0}")]
    Config(String),
    #[error("the node secret (--state-dir): {0}")]
    Identity(#[source] crate::identity::IdentityError),
    #[error("{0}")]
    State(#[source] crate::state::StateError),
    #[error("the state store {path} does not match the ledger: {why}. haltd does not start with state it cannot trust, and never resets it silently: restore the store that belongs to this ledger, or start once with --state-mismatch degrade-node (the node runs degraded until `haltctl mode full`)")]
    StateMismatch { path: String, why: String },
    #[error("{0}; the running haltd serves on")]
    TakeOver(String),
    #[error("dropping privileges: {0}")]
    Privileges(#[source] crate::privs::PrivError),
    #[error("{0}")]
    Watchdog(#[source] watchdog::SpawnError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

impl StartError {
    /// haltd's exit status for this error: [`crate::ledger::TAMPERED_EXIT_CODE`] for a ledger
    /// refused as tampered with, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            StartError::Ledger(e) if e.is_tampering() => crate::ledger::TAMPERED_EXIT_CODE,
            StartError::StateMismatch { .. } => crate::state::restore::MISMATCH_EXIT_CODE,
            _ => 1,
        }
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> StartError {
    let what = what.into();
    move |source| StartError::Io { what, source }
}

/// Loads the gate as `cfg` asks and runs its self-test (see `gate::selftest`): a gate that
/// does not refuse what it must refuse is not used.
pub fn load_gate(cfg: &Config) -> Result<KernelGate, crate::gate::GateError> {
    let max_streams = cfg.args.max_streams;
    let gate = KernelGate::load(&GateConfig {
        object: cfg
            .args
            .bpf_object
            .clone()
            .map_or(GateObject::Embedded, GateObject::Path),
        // Open streams, plus the connections waiting in the accept queue (governed at
        // establishment), plus those being refused at capacity.
        max_sockets: max_streams.saturating_mul(2).saturating_add(1024),
        heartbeat_deadline: cfg.heartbeat_deadline,
    })?;
    gate.beat()?;
    let report = crate::gate::selftest::run(&gate, cfg.args.listen.ip())
        .map_err(|e| crate::gate::GateError::SelfTest(Box::new(e)))?;
    tracing::info!(
        cgroup = %gate.cgroup().display(),
        egress_held_bytes = report.egress_held_bytes,
        heartbeat_age_us = report.heartbeat_age.as_micros() as u64,
        took_ms = report.took.as_millis() as u64,
        "kernel gate self-test passed: a send after a trip was refused with EACCES, and the egress check held back bytes beyond a stream's ceiling"
    );
    Ok(gate)
}

/// Says what degraded mode keys on (`scope.rs`): the operator must know whether one halt
/// degrades one tenant or everyone behind one address.
fn say_scope_rule(cfg: &Config) {
    let rule = if cfg.args.client_keys == crate::keys::ClientKeys::Store {
        crate::scope::ScopeRule::Store
    } else if cfg.args.identity_header.is_some() {
        crate::scope::ScopeRule::HeaderThenAddr
    } else {
        crate::scope::ScopeRule::Addr
    };
    tracing::info!(
        scope = rule.describe(),
        degraded_scope = ?cfg.args.degraded_scope,
        "degraded mode and limits are kept per scope: never the raw credential, which a client can respell"
    );
}

/// The policy set a start serves under: the configuration with the switches the state store
/// kept. A kept `haltctl profile set mkp` whose floor this configuration breaks stops the
/// start (fail closed), naming the key.
fn policy_set(
    cfg: &Config,
    overrides: crate::policy::Overrides,
) -> Result<(crate::policy::PolicyInputs, crate::policy::PolicySet), StartError> {
    let inputs = cfg.policy_inputs(overrides);
    for r in inputs.unknown_routes() {
        tracing::warn!(route = %r, "a runtime detector mode kept in the state store names a route the configuration no longer has; it applies to nothing");
    }
    let set = inputs.build(None).map_err(|e| {
        StartError::Config(format!("the policy (profile {}): {e}", inputs.profile()))
    })?;
    Ok((inputs, set))
}

/// Runs the daemon; returns only on a start-up error.
pub fn run(cfg: Config, log: crate::logging::LogControl) -> Result<(), StartError> {
    warn_if_test_build();
    let gate = gate_as_asked(&cfg)?;
    let (predecessor, sharing) = predecessor(&cfg)?;
    // What needs a privilege, or the gate's cgroup, is done now, while this is the only
    // thread: the listeners are bound (the client listener inside the cgroup, a port below
    // 1024, the admin socket's directory and group) before every capability goes.
    let listener = bind_listener(&cfg, gate.as_ref(), sharing)?;
    warn_about_exposed_listeners(&cfg);
    // Every listener is bound before the first stream is served: a busy admin or metrics port
    // fails the start, and a client that sees /healthz answer can also scrape /metrics.
    let control = bind_control(&cfg, sharing)?;
    // From here on as --user, without capabilities: the ledger, the state directory and every
    // thread started below.
    let watchdog = drop_privileges(&cfg)?;
    warn_about_sampling(&cfg);
    say_scope_rule(&cfg);
    let gate_label = gate.as_ref().map_or("disabled", |_| "enforcing");
    let ledger = open_ledger(&cfg, gate_label, predecessor.as_ref())?;
    let metrics = new_metrics(&cfg, gate.is_some());
    // An earlier haltd on this ledger that panicked left a crash file: record it before this
    // start's own record, so the ledger reads in order.
    let crashes = crate::crash::recover(
        &crate::crash::file_for(&cfg.args.ledger),
        &ledger,
        gate_label,
    )
    .map_err(StartError::Crash)?;
    metrics.ledger.crashes_recovered.inc_by(crashes);
    let node_secret = crate::identity::NodeSecret::load_or_create(&cfg.args.state_dir)
        .map_err(StartError::Identity)?;
    let (state, mismatch) = restore::open_state(&cfg, &node_secret, predecessor.is_some())?;
    let wakers = worker_wakers(cfg.workers)?;
    let grounding = grounding_plan(&cfg, &metrics)?;
    let (policy_inputs, policy) = policy_set(&cfg, state.overrides.clone())?;
    let (escalations, escalated) = cfg
        .escalation
        .as_ref()
        .map(|_| crate::escalation::queue())
        .unzip();
    let shared = Arc::new(HaltCore {
        labels: restore::incident_labels(&metrics, &state),
        circuits: restore::conversation_store(&cfg, &metrics, &state)?,
        escalations,
        table: StreamTable::new(cfg.args.max_streams),
        gate,
        metrics,
        ledger,
        heartbeat_ns: AtomicU64::new(0),
        pulse: crate::pulse::Pulse::default(),
        ungovernable_logged_ns: AtomicU64::new(0),
        wakers,
        workers: crate::progress::WorkerBeats::new(cfg.workers),
        recorder_failed: std::sync::atomic::AtomicBool::new(false),
        draining: std::sync::atomic::AtomicBool::new(false),
        shutting_down: std::sync::atomic::AtomicBool::new(false),
        handover: crate::halt::handover::Handover::default(),
        modes: state.modes,
        state: state.store,
        policy: arc_swap::ArcSwap::from_pointee(policy),
        policy_inputs: std::sync::Mutex::new(policy_inputs),
        turn_meta: (0..cfg.args.max_streams)
            .map(|_| std::sync::Mutex::default())
            .collect(),
        node_secret,
        keys: crate::keys::KeyStore::new(state.client_keys),
        limits: restore::limit_table(&cfg, &state.key_usage),
        access_log: open_access_log(&cfg)?,
        admission: admission(&cfg),
        upstream_health: upstream_health(&cfg),
        grounding,
        cfg,
    });
    shared.metrics.policy.show(&shared.policy.load());
    shared.handover.set_peer(predecessor.is_some());
    let source = match &shared.cfg.upstream {
        Some(u) => format!("openai upstream={u}"),
        None => "builtin".to_owned(),
    };
    restore::record_start(&shared, start_record(&shared, &source), mismatch)?;
    crate::upstream_watch::start(&shared).map_err(io("starting the upstream watch thread"))?;
    crate::escalation::start(&shared, escalated).map_err(io("starting the escalation thread"))?;
    watchdog.start(Arc::clone(&shared));
    wait_for_first_heartbeat(&shared)?;
    let listener = start_workers(&shared, listener)?;
    let hand_over = HandOver {
        listener: listener.into(),
        predecessor,
    };
    serve_control_plane(shared, control, source, log, hand_over)
}

/// The kernel gate, loaded and self-tested, unless `--no-kernel-gate`.
fn gate_as_asked(cfg: &Config) -> Result<Option<KernelGate>, StartError> {
    if cfg.args.no_kernel_gate {
        tracing::warn!("--no-kernel-gate: the kernel halt gate is OFF; only the userspace watchdog enforces the budget");
        return Ok(None);
    }
    load_gate(cfg).map(Some).map_err(StartError::Gate)
}

/// With `--take-over`, the running haltd, asked only now that this one's gate passed its
/// self-test (`server/takeover.rs`); and whether the listeners join its ports.
fn predecessor(
    cfg: &Config,
) -> Result<(Option<takeover::Predecessor>, crate::reuseport::Sharing), StartError> {
    let predecessor = if cfg.args.take_over {
        takeover::ask(cfg)?
    } else {
        None
    };
    let sharing = match predecessor {
        Some(_) => crate::reuseport::Sharing::TakeOver,
        None => crate::reuseport::Sharing::Alone,
    };
    Ok((predecessor, sharing))
}

/// Listens on the client socket and starts the data-plane workers on it; checks that no
/// thread holds a capability.
fn start_workers(
    shared: &Arc<HaltCore>,
    listener: socket2::Socket,
) -> Result<std::net::TcpListener, StartError> {
    // Listening only now: until this moment the socket is in no SO_REUSEPORT group, and no
    // connection waits on a process that is not about to serve it.
    let backlog = i32::try_from(shared.cfg.args.max_streams).unwrap_or(i32::MAX);
    let listener = crate::reuseport::listen(listener, backlog).map_err(io(format!(
        "listening on --listen {}",
        shared.cfg.args.listen
    )))?;
    dataplane::spawn_workers(shared, &listener).map_err(io("starting the data-plane workers"))?;
    // A thread that escaped the drop (one started before it) fails the start.
    let threads = crate::privs::check_process().map_err(StartError::Privileges)?;
    tracing::debug!(threads, "no thread holds a capability");
    Ok(listener)
}

/// What client connections may hold (`admission.rs`).
fn admission(cfg: &Config) -> crate::admission::Admission {
    crate::admission::Admission::new(
        cfg.args.max_conns_per_addr,
        crate::admission::AddrGroups {
            v4: cfg.args.addr_prefix_v4,
            v6: cfg.args.addr_prefix_v6,
        },
        crate::admission::Admission::request_cap(
            cfg.args.max_streams,
            cfg.args.request_phase_share,
        ),
    )
}

/// The state of `--upstream` that the watch thread keeps (none with the built-in source).
fn upstream_health(cfg: &Config) -> Option<crate::upstream::health::UpstreamHealth> {
    let url = cfg.upstream.as_ref()?;
    Some(crate::upstream::health::UpstreamHealth::new(
        url.authority(),
        cfg.upstream_watch.probe.is_some(),
    ))
}

/// The admin and metrics listeners.
fn bind_control(
    cfg: &Config,
    sharing: crate::reuseport::Sharing,
) -> Result<ControlListeners, StartError> {
    Ok(ControlListeners {
        admin: admin::bind_admin(&cfg.args.admin, cfg.args.admin_group.as_deref(), sharing)
            .map_err(io("admin listener"))?,
        metrics: admin::bind(cfg.args.metrics, "metrics", sharing)
            .map_err(io("metrics listener"))?,
    })
}

/// The grounder and its plan (spec 003's intervention): built when the surprise detector
/// starts in `intervene` mode (indexing the memory store takes the start's time, not a
/// turn's), else `None`.
fn grounding_plan(
    cfg: &Config,
    metrics: &Metrics,
) -> Result<Option<crate::grounding::plan::GroundPlan>, StartError> {
    if cfg.detectors.surprise.policy.mode != crate::detect::DetectorMode::Intervene {
        return Ok(None);
    }
    crate::grounding::plan::GroundPlan::from_config(&cfg.grounding, Some(metrics.grounding.clone()))
        .map(Some)
        .map_err(|e| StartError::Config(e.to_string()))
}

/// The daemon's metrics: the gate's state, and the model names `--metric-models` fixes.
fn new_metrics(cfg: &Config, gate: bool) -> Metrics {
    let mut metrics = Metrics::new();
    metrics.gate.enabled.set(i64::from(gate));
    metrics.requests.models = crate::metrics::models::ModelLabels::new(&cfg.args.metric_models);
    metrics.detectors.operating_point(&cfg.detectors);
    metrics
}

/// `--access-log`, opened as the user haltd serves as (a file it cannot write stops the
/// start).
fn open_access_log(cfg: &Config) -> Result<crate::access_log::AccessLog, StartError> {
    crate::access_log::AccessLog::open(cfg.args.access_log.clone(), cfg.args.access_log_level)
        .map_err(io("access log"))
}

/// Switches to `--user` if asked and drops every capability: the watchdog thread's first
/// (started now so that it can take its real-time priority), then this thread's. Every thread
/// started after this, by haltd or by a library, inherits empty capability sets.
fn drop_privileges(cfg: &Config) -> Result<watchdog::Waiting, StartError> {
    crate::privs::only_thread().map_err(StartError::Privileges)?;
    if let Some(account) = &cfg.account {
        crate::privs::account::switch_to(account).map_err(StartError::Privileges)?;
    }
    let watchdog = watchdog::spawn_unprivileged().map_err(StartError::Watchdog)?;
    let bounding = crate::privs::drop_thread().map_err(StartError::Privileges)?;
    // SAFETY: getuid and getgid cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    match bounding {
        crate::privs::Bounding::Cleared => tracing::info!(
            uid,
            gid,
            "capabilities dropped in every thread (effective, permitted, inheritable, ambient and bounding sets empty, no_new_privs)"
        ),
        crate::privs::Bounding::Kept => tracing::info!(
            uid,
            gid,
            "capabilities dropped in every thread (effective, permitted, inheritable and ambient sets empty, no_new_privs); the bounding set stays (no CAP_SETPCAP to shrink it), and nothing in it can be regained"
        ),
    }
    if uid == 0 {
        tracing::info!("haltd keeps uid 0 without capabilities: it still owns root's files; --user (or the unit's User=) takes that away too");
    }
    Ok(watchdog)
}

/// Metrics are read-only but tell who is streaming what: a bind beyond loopback is allowed,
/// and said.
fn warn_about_exposed_listeners(cfg: &Config) {
    if !cfg.args.metrics.ip().is_loopback() {
        tracing::warn!(metrics = %cfg.args.metrics, "--metrics listens beyond loopback: anyone who can reach it reads haltd's metrics (read-only); restrict it with a firewall or bind 127.0.0.1");
    }
    if let crate::config::AdminAddr::Tcp(a) = &cfg.args.admin {
        tracing::warn!(admin = %a, "the admin API listens on TCP (bearer token of --admin-token-file required); the default unix:{} is attributable to a uid", crate::config::DEFAULT_ADMIN_SOCKET);
    }
}

/// Opens the flight recorder (its lifecycle: `ledger` module doc), saying so when it runs
/// without fsync.
fn open_ledger(
    cfg: &Config,
    gate_label: &'static str,
    predecessor: Option<&takeover::Predecessor>,
) -> Result<Ledger, StartError> {
    if cfg.args.ledger_no_fsync {
        tracing::warn!("--ledger-no-fsync: records are not fsync'd before haltd answers; a crash or power loss can lose records that clients saw answered, and the ledger's crash guarantees do not hold (every record says \"no_fsync\":true)");
    }
    let ledger_cfg = crate::ledger::LedgerConfig {
        path: &cfg.args.ledger,
        state_dir: &cfg.args.state_dir,
        fsync: !cfg.args.ledger_no_fsync,
        kernel_gate: gate_label,
        slow_write: cfg.faults.ledger_slow_write,
        fail_writes_from: cfg.faults.ledger_write_fails_after,
    };
    let Some(pred) = predecessor else {
        return Ledger::open(&ledger_cfg).map_err(StartError::Ledger);
    };
    // A fresh segment, its first record linked to the old process's hand-over record.
    let link = crate::ledger::SegmentLink {
        segment: pred.segment.clone(),
        seq: pred.seq,
        hash: pred.hash.clone(),
        from_pid: pred.pid,
    };
    let (ledger, first) = Ledger::open_linked(&ledger_cfg, &link).map_err(StartError::Ledger)?;
    tracing::info!(
        segment = %cfg.args.ledger.display(),
        seq = first.seq,
        from = %pred.segment.display(),
        from_seq = pred.seq,
        "a new ledger segment continues the old haltd's from its hand-over record"
    );
    Ok(ledger)
}

/// Warns when the flight recorder keeps more than spec 000 asks for.
fn warn_about_sampling(cfg: &Config) {
    let sampling = cfg.sampling;
    if sampling.above_spec() {
        tracing::warn!(
            turn_sample_rate = sampling.turn_sample_rate,
            "the flight recorder keeps more than the 1-5 % of normal turns of spec 000 §6.2 (for audits and tests); production runs at 0.01 to 0.05"
        );
    }
    if sampling.record_token_text {
        tracing::warn!("--record-token-text: turn records carry the text of the turns (up to 64 KiB each); the ledger now holds generated content");
    }
}

/// One eventfd per data-plane worker: writing it makes the worker look at its streams.
fn worker_wakers(workers: usize) -> Result<Vec<Arc<OwnedFd>>, StartError> {
    let mut wakers = Vec::new();
    for _ in 0..workers {
        // SAFETY: eventfd returns a new descriptor we own, or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io("creating a worker eventfd")(
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: `fd` is a fresh descriptor owned by nobody else.
        wakers.push(Arc::new(unsafe { OwnedFd::from_raw_fd(fd) }));
    }
    Ok(wakers)
}

/// Binds `--listen` (inside the gate's cgroup, which the caller entered by loading the gate)
/// and has the gate govern its connections from their establishment. It listens later
/// (`reuseport::listen`, just before the workers start).
fn bind_listener(
    cfg: &Config,
    gate: Option<&KernelGate>,
    sharing: crate::reuseport::Sharing,
) -> Result<socket2::Socket, StartError> {
    let listener = crate::reuseport::bind(cfg.args.listen, sharing)
        .map_err(io(format!("binding --listen {}", cfg.args.listen)))?;
    if let Some(gate) = gate {
        let port = listener
            .local_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .ok_or_else(|| {
                io("reading the --listen address")(std::io::Error::other("not an IP socket"))
            })?
            .port();
        // Connections to the client port are governed the moment they are established,
        // before a client that half-closes could make a later insertion fail.
        gate.govern_port(port).map_err(StartError::Gate)?;
    }
    Ok(listener)
}

/// The `lifecycle` record of this start.
fn start_record(shared: &HaltCore, source: &str) -> Record {
    let mut start = Record {
        kind: RecordKind::Lifecycle,
        rts_mode: "normal".to_owned(),
        runtime_mode: "full".to_owned(),
        kernel_gate: shared.kernel_gate_label().to_owned(),
        budget: Some(shared.cfg.args.budget),
        ..Record::default()
    };
    start.message = Some(format!(
        "haltd {} (commit {}, features: {}) started: source={source} listen={} budget={} hard_limit={} heartbeat_deadline_ms={} kernel_gate={} degraded_scope={:?} degraded_for_s={} turn_sample_rate={} record_token_text={}{}",
        build_info::VERSION,
        build_info::COMMIT,
        build_info::FEATURES,
        shared.cfg.args.listen,
        shared.cfg.args.budget,
        shared.cfg.args.hard_limit,
        shared.cfg.heartbeat_deadline.as_millis(),
        shared.kernel_gate_label(),
        shared.cfg.args.degraded_scope,
        shared.cfg.args.degraded_for_s,
        shared.cfg.sampling.turn_sample_rate,
        shared.cfg.sampling.record_token_text,
        if shared.cfg.args.faults.is_empty() { String::new() } else { format!(" faults={:?}", shared.cfg.args.faults) },
    ));
    if let Some(leaves) = removed_leaves(shared) {
        start.message = start.message.map(|m| m + &leaves);
    }
    start
}

/// ` removed_cgroup_leaves=[NAME (owner WHY), ...]`: the leftover cgroup leaves of earlier
/// haltd processes this start removed (`gate/cgroup/leftovers.rs`); `None` when it removed none.
fn removed_leaves(shared: &HaltCore) -> Option<String> {
    let removed = shared.gate.as_ref()?.removed_leaves();
    if removed.is_empty() {
        return None;
    }
    let names: Vec<String> = removed.iter().map(ToString::to_string).collect();
    Some(format!(" removed_cgroup_leaves=[{}]", names.join(", ")))
}

/// Serve nothing before the first heartbeat: until then every stream would halt with
/// HEARTBEAT_LOST (fail closed, but a needless one at start-up).
fn wait_for_first_heartbeat(shared: &HaltCore) -> Result<(), StartError> {
    let deadline = std::time::Instant::now()
        + shared
            .cfg
            .heartbeat_deadline
            .max(std::time::Duration::from_secs(1));
    while shared
        .heartbeat_ns
        .load(std::sync::atomic::Ordering::SeqCst)
        == 0
    {
        if std::time::Instant::now() > deadline {
            return Err(io("waiting for the first watchdog heartbeat")(
                std::io::Error::other(
                    "the watchdog wrote no heartbeat in time (see the log for a gate error)",
                ),
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    Ok(())
}

/// The line on stdout that says haltd serves: `haltd ready k=v ...`, or with `--log-format
/// json` one JSON object whose `message` is `haltd ready`, with the same keys.
fn ready_line(shared: &HaltCore, source: &str) -> String {
    let args = &shared.cfg.args;
    let fields = [
        ("listen", args.listen.to_string()),
        ("admin", args.admin.to_string()),
        ("metrics", args.metrics.to_string()),
        ("kernel_gate", shared.kernel_gate_label().to_owned()),
        ("budget", args.budget.to_string()),
        ("ledger", args.ledger.display().to_string()),
        ("source", source.to_owned()),
        ("version", build_info::VERSION.to_owned()),
        ("commit", build_info::COMMIT.to_owned()),
        ("features", build_info::FEATURES.to_owned()),
    ];
    match args.log_format {
        LogFormat::Text => {
            let mut line = "haltd ready".to_owned();
            for (k, v) in fields {
                line.push_str(&format!(" {k}={v}"));
            }
            line
        }
        LogFormat::Json => {
            let mut obj = serde_json::Map::new();
            obj.insert("timestamp".into(), crate::clock::rfc3339_now().into());
            obj.insert("level".into(), "INFO".into());
            obj.insert("message".into(), "haltd ready".into());
            for (k, v) in fields {
                obj.insert(k.into(), v.into());
            }
            serde_json::Value::Object(obj).to_string()
        }
    }
}

/// A test build (`fault-injection`) says so before anything else.
fn warn_if_test_build() {
    if build_info::FAULT_INJECTION {
        tracing::warn!(
            features = build_info::FEATURES,
            "this is a TEST build with fault injection: it accepts --fault, which breaks the halt guarantee on purpose; install a production build (`cargo xtask build --release`) on nodes"
        );
    }
}

/// The control plane's listeners, bound before the data plane starts.
struct ControlListeners {
    admin: admin::AdminListener,
    metrics: std::net::TcpListener,
}

/// What the control plane needs for a hand-over: the client listener (to steer to it, or to
/// shut it down), and the haltd this one takes over from.
struct HandOver {
    listener: OwnedFd,
    predecessor: Option<takeover::Predecessor>,
}

/// The control plane (admin API, `/metrics`) on a current-thread runtime, until a signal:
/// then haltd drains and stops, or hands over (`lifecycle.rs`).
fn serve_control_plane(
    shared: Arc<HaltCore>,
    listeners: ControlListeners,
    source: String,
    log: crate::logging::LogControl,
    hand_over: HandOver,
) -> Result<(), StartError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(io("starting the control-plane runtime"))?;
    rt.block_on(async move {
        let metrics_l =
            tokio::net::TcpListener::from_std(listeners.metrics).map_err(io("metrics listener"))?;
        let mut signals =
            lifecycle::StopSignals::install().map_err(io("installing the signal handlers"))?;
        let hangups = lifecycle::reload_on_hangup(Arc::clone(&shared), log)
            .map_err(io("installing the SIGHUP handler"))?;
        if hand_over.predecessor.is_some() {
            if let Err(e) = admin::take_staged_socket(&shared.cfg.args.admin) {
                tracing::warn!(admin = %shared.cfg.args.admin, error = %e, "taking over the admin socket's name failed; haltctl reaches the old haltd there until it exits");
            }
        }
        println!("{}", ready_line(&shared, &source));
        lifecycle::notify_ready();
        if let Some(pred) = hand_over.predecessor {
            let listener = hand_over
                .listener
                .try_clone()
                .map_err(io("duplicating the --listen socket"))?;
            tokio::spawn(takeover::complete(Arc::clone(&shared), pred, listener));
        }
        let control = admin::serve(Arc::clone(&shared), listeners.admin, metrics_l);
        tokio::select! {
            r = control => r.map_err(io("control plane")),
            () = lifecycle::feed_systemd_watchdog(Arc::clone(&shared)) => Ok(()),
            () = hangups => Ok(()),
            stop = signals.next(&shared) => match stop {
                lifecycle::Stop::Drain => lifecycle::stop(&shared, &mut signals).await,
                lifecycle::Stop::HandOver => {
                    lifecycle::hand_over(&shared, &mut signals, &hand_over.listener).await
                }
            },
        }
    })
}
