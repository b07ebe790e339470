//! The haltd process harness: a `haltd serve` in a pair's server namespace ([`Haltd`]), the
//! ports it listens on, and the haltd and haltctl binaries the tests run.

use std::{
    env, fs,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

use crate::{
    api::{ApiClient, ServedTls, Transport},
    http::{agent, get_json_here, header, trip_here, TEST_ADMIN_TOKEN},
    ledger::read_ledger,
    metrics::Metrics,
    netns::{in_netns, NetPair},
    temp_dir, wait_for,
};

/// Ports haltd listens on inside the server namespace.
pub const PORT_API: u16 = 8080;
pub const PORT_ADMIN: u16 = 8081;
pub const PORT_METRICS: u16 = 9464;

/// Path of a binary that `cargo xtask test` names in an environment variable.
fn bin_from_env(var: &str, name: &str) -> Result<PathBuf> {
    if let Some(p) = env::var_os(var) {
        return Ok(PathBuf::from(p));
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for profile in ["release", "debug"] {
        let p = root.join("target").join(profile).join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!("{var} is not set and no target/*/{name} exists: run the tests with `cargo xtask test`")
}

pub fn haltd_bin() -> Result<PathBuf> {
    bin_from_env("HALTD_BIN", "haltd")
}

/// A production haltd (no `fault-injection`), which `cargo xtask test` builds when the
/// integration tests that need it run (`HALTD_PRODUCTION_BIN`).
pub fn production_haltd_bin() -> Result<PathBuf> {
    env::var_os("HALTD_PRODUCTION_BIN")
        .map(PathBuf::from)
        .context("HALTD_PRODUCTION_BIN is not set: run the tests with `cargo xtask test` (with no filter, or one that matches `build_info::`)")
}

pub fn haltctl_bin() -> Result<PathBuf> {
    bin_from_env("HALTCTL_BIN", "haltctl")
}

/// A running `haltd serve` in a pair's server namespace. Drop stops it (SIGTERM, then SIGKILL
/// after 10 s) and removes its directory, unless the thread is panicking (then the directory
/// with the logs and the ledger stays and its path is printed).
#[derive(Debug)]
pub struct Haltd {
    child: Option<Child>,
    dir: PathBuf,
    pub api: SocketAddr,
    pub admin: SocketAddr,
    pub metrics: SocketAddr,
    pub ledger: PathBuf,
    /// Namespace the clients of this instance run in.
    pub client_ns: String,
    /// Its `--state-dir` (the node secret).
    pub state_dir: PathBuf,
    /// It runs with `--identity-header` [`TEST_TENANT_HEADER`] ([`test_tenant`]).
    pub tenant_header: bool,
    /// The certificate its API serves, when started over [`Transport::Tls`].
    tls: Option<ServedTls>,
}

impl Haltd {
    /// Starts haltd with `extra` arguments after the address and ledger flags, and waits until
    /// it is ready (a `haltd ready` line on stdout, or `/healthz` answering 200), at most 20 s.
    ///
    /// Every turn is recorded (`--turn-sample-rate 1`, [`TEST_SAMPLING`]) unless `extra` sets
    /// `--turn-sample-rate` itself: the tests read the records of normal turns, which haltd
    /// samples at 5 % by default.
    pub fn start(pair: &NetPair, extra: &[&str]) -> Result<Self> {
        Self::start_with_ledger(pair, None, extra)
    }

    /// Like [`Haltd::start`], its API served over `transport`: with [`Transport::Tls`], a
    /// certificate made for the test (`--tls-cert`/`--tls-key` before `extra`), which
    /// [`Haltd::client`] trusts.
    pub fn start_over(pair: &NetPair, transport: Transport, extra: &[&str]) -> Result<Self> {
        let Transport::Tls = transport else {
            return Self::start(pair, extra);
        };
        let tls = ServedTls::new(pair.srv_ip.into())?;
        let mut args = tls.haltd_args();
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut haltd = Self::start(pair, &args)?;
        haltd.tls = Some(tls);
        Ok(haltd)
    }

    /// The base URL of its API as a client names it: `http://ADDR`, or `https://ADDR` when
    /// started over TLS (its certificate names the address).
    pub fn api_base(&self) -> String {
        match self.tls {
            Some(_) => format!("https://{}", self.api),
            None => self.api_url(),
        }
    }

    /// The CA that signed the certificate its API serves, when started over TLS.
    pub fn api_ca_file(&self) -> Option<&Path> {
        self.tls.as_ref().map(ServedTls::ca_file)
    }

    /// A client of this instance's API, over the transport it was started with.
    pub fn client(&self) -> ApiClient {
        match &self.tls {
            Some(tls) => ApiClient::Tls {
                addr: self.api,
                cfg: tls.client_config(),
            },
            None => ApiClient::Plain {
                base: self.api_url(),
            },
        }
    }

    /// Like [`Haltd::start`], on an existing ledger file (e.g. one a killed instance left).
    pub fn start_with_ledger(
        pair: &NetPair,
        ledger: Option<&Path>,
        extra: &[&str],
    ) -> Result<Self> {
        Self::start_wrapped(pair, ledger, &[], extra)
    }

    /// Like [`Haltd::start_with_ledger`], with haltd run through `wrapper` (a command that
    /// execs its arguments, e.g. `unshare -T --monotonic N`), so its pid is still haltd's.
    pub fn start_wrapped(
        pair: &NetPair,
        ledger: Option<&Path>,
        wrapper: &[&str],
        extra: &[&str],
    ) -> Result<Self> {
        let mut haltd = Self::spawn(pair, ledger, wrapper, extra)?;
        haltd
            .wait_ready(Duration::from_secs(20))
            .with_context(|| format!("haltd {extra:?} did not become ready"))?;
        Ok(haltd)
    }

    /// Starts haltd as [`Haltd::start_with_ledger`] does, where it must refuse to start:
    /// returns its exit status and its stderr, or fails if it became ready (or ran on) instead.
    pub fn start_refused(
        pair: &NetPair,
        ledger: &Path,
        extra: &[&str],
    ) -> Result<(ExitStatus, String)> {
        let mut haltd = Self::spawn(pair, Some(ledger), &[], extra)?;
        let status = haltd
            .wait_exit(Duration::from_secs(20))
            .context("haltd was to refuse to start")?;
        Ok((status, haltd.log_file("stderr.log")?))
    }

    /// Spawns `haltd serve` (through `wrapper`) and returns at once.
    fn spawn(
        pair: &NetPair,
        ledger: Option<&Path>,
        wrapper: &[&str],
        extra: &[&str],
    ) -> Result<Self> {
        Self::spawn_on(pair, ledger, wrapper, extra, (PORT_ADMIN, PORT_METRICS))
    }

    /// [`Haltd::spawn`] with its admin API and metrics on `(admin, metrics)` ports (a
    /// successor beside a running haltd, `handover.rs`).
    pub(crate) fn spawn_on(
        pair: &NetPair,
        ledger: Option<&Path>,
        wrapper: &[&str],
        extra: &[&str],
        (admin_port, metrics_port): (u16, u16),
    ) -> Result<Self> {
        let bin = haltd_bin()?;
        let dir = temp_dir("haltd")?;
        let api = pair.srv_addr(PORT_API);
        let admin = pair.srv_addr(admin_port);
        let metrics = pair.srv_addr(metrics_port);
        let ledger = ledger.map_or_else(|| dir.join("ledger.jsonl"), Path::to_path_buf);
        // The ledger's key and head live in the state directory: next to the ledger, so a
        // haltd restarted on it finds them.
        let state_dir = state_dir_of(extra, &ledger);
        let token_file = write_admin_token(&dir)?;
        let stdout = fs::File::create(dir.join("stdout.log")).context("creating stdout.log")?;
        let stderr = fs::File::create(dir.join("stderr.log")).context("creating stderr.log")?;
        // `ip netns exec` joins the namespace and execs haltd, so the child is haltd itself.
        let child = Command::new("ip")
            .args(["netns", "exec", &pair.srv])
            .args(wrapper)
            .arg(&bin)
            .arg("serve")
            .args(["--listen", &api.to_string()])
            .args(admin_args(extra, &admin, &token_file))
            .args(["--metrics", &metrics.to_string()])
            .arg("--ledger")
            .arg(&ledger)
            .args(test_sampling(extra))
            .args(test_drain(extra))
            .args(test_probe(extra))
            .args(state_dir_args(extra, &state_dir))
            .args(test_tenant(extra))
            .args(extra.iter().filter(|a| **a != ADDR_SCOPED))
            .env("RUST_BACKTRACE", "1")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("starting {} in {}", bin.display(), pair.srv))?;
        Ok(Haltd {
            child: Some(child),
            dir,
            api,
            admin,
            metrics,
            ledger,
            client_ns: pair.cli.clone(),
            state_dir,
            tenant_header: test_tenant(extra).len() == 2,
            tls: None,
        })
    }

    /// Whether it printed its `haltd ready` line; an error once it exited.
    fn printed_ready(&mut self) -> Result<bool> {
        if let Some(status) = self
            .child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
        {
            bail!(
                "haltd exited during start-up ({status}); log tail:\n{}",
                self.log_tail(40)
            );
        }
        Ok(fs::read_to_string(self.dir.join("stdout.log"))
            .is_ok_and(|s| s.lines().any(|l| l.starts_with("haltd ready"))))
    }

    /// Waits for its `haltd ready` line alone (another haltd may answer on the same port).
    pub(crate) fn wait_ready_line(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.printed_ready()? {
                return Ok(());
            }
            ensure!(
                Instant::now() < deadline,
                "not ready after {timeout:?}; log tail:\n{}",
                self.log_tail(40)
            );
            thread::sleep(Duration::from_millis(10));
        }
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let health = format!("http://{}/healthz", self.api);
        loop {
            if self.printed_ready()? {
                return Ok(());
            }
            let url = health.clone();
            let healthy = in_netns(&self.client_ns, move || {
                agent(Duration::from_millis(500))
                    .get(&url)
                    .call()
                    .is_ok_and(|r| r.status() == 200)
            });
            if healthy {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "not ready after {timeout:?}; log tail:\n{}",
                    self.log_tail(40)
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills haltd with SIGKILL (a crash) and waits for it; its directory stays until drop.
    pub fn crash(&mut self) -> Result<ExitStatus> {
        let mut child = self.child.take().context("haltd already stopped")?;
        child.kill()?;
        Ok(child.wait()?)
    }

    /// Waits at most `timeout` for haltd to exit by itself (a crash) and returns how it ended;
    /// its directory (logs, ledger, crash file) stays until drop.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            let child = self.child.as_mut().context("haltd already stopped")?;
            if let Some(status) = child.try_wait()? {
                self.child = None;
                return Ok(status);
            }
            ensure!(
                Instant::now() < deadline,
                "haltd still running {timeout:?} later; log tail:\n{}",
                self.log_tail(30)
            );
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// Process id of the haltd process (for signals).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Base URL of the client API, e.g. `http://198.18.1.1:8080`.
    pub fn api_url(&self) -> String {
        format!("http://{}", self.api)
    }

    /// The admin token file of this haltd (for `haltctl --admin-token-file`).
    pub fn admin_token_file(&self) -> PathBuf {
        self.dir.join(ADMIN_TOKEN_FILE)
    }

    /// Base URL of the admin API.
    pub fn admin_url(&self) -> String {
        format!("http://{}", self.admin)
    }

    /// The last `n` lines of haltd's stdout and stderr.
    pub fn log_tail(&self, n: usize) -> String {
        let mut out = String::new();
        for name in ["stdout.log", "stderr.log"] {
            let text = fs::read_to_string(self.dir.join(name)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!(
                "--- {name} (last {} of {} lines)\n",
                n.min(lines.len()),
                lines.len()
            ));
            for l in &lines[lines.len().saturating_sub(n)..] {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }

    /// The whole of haltd's `stdout.log` or `stderr.log` so far.
    pub fn log_file(&self, name: &str) -> Result<String> {
        fs::read_to_string(self.dir.join(name)).with_context(|| format!("reading {name}"))
    }

    /// The leftover cgroup leaves this instance said it removed at its start (one log line
    /// each, `gate/cgroup/leftovers.rs`): their paths as haltd named them.
    pub fn removed_leaves(&self) -> Result<Vec<String>> {
        Ok(self
            .log_file("stderr.log")?
            .lines()
            .filter(|l| l.contains("removed the cgroup leaf of a haltd that is gone"))
            .filter_map(|l| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix("leaf="))
                    .map(|p| p.trim_matches('"').to_owned())
            })
            .collect())
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Fetches and strictly parses `/metrics` (from the client namespace).
    pub fn metrics(&self) -> Result<Metrics> {
        let url = format!("http://{}/metrics", self.metrics);
        let (content_type, text) =
            in_netns(&self.client_ns, move || -> Result<(String, String)> {
                let mut resp = agent(Duration::from_secs(10))
                    .get(&url)
                    .call()
                    .with_context(|| format!("GET {url}"))?;
                ensure!(resp.status() == 200, "GET {url}: status {}", resp.status());
                let ct = header(&resp, "content-type").unwrap_or_default();
                let body = resp
                    .body_mut()
                    .read_to_string()
                    .context("reading /metrics")?;
                Ok((ct, body))
            })?;
        Metrics::parse(&text, &content_type)
            .with_context(|| format!("parsing /metrics (content-type {content_type:?})"))
    }

    /// Trips a stream through the admin API; returns (status, JSON body or Null).
    pub fn trip(&self, stream_id: &str, cause: Option<&str>) -> Result<(u16, Value)> {
        let url = format!("{}/admin/streams/{stream_id}/trip", self.admin_url());
        let ns = self.client_ns.clone();
        let cause = cause.map(str::to_owned);
        in_netns(&ns, move || trip_here(&url, cause.as_deref()))
    }

    /// Streams a long chat turn from namespace `ns` with `headers`, trips it through the admin
    /// API as it starts, and returns its stream id once the halt ended it cleanly
    /// (`OPERATOR_TRIP`).
    pub fn trip_stream_from(&self, ns: &str, headers: &[(&str, &str)]) -> Result<String> {
        let (tx, rx) = std::sync::mpsc::channel();
        let url = format!("{}/v1/chat/completions", self.api_url());
        let owned: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let streamer = crate::netns::spawn_in_netns(ns, move || {
            let h: Vec<(&str, &str)> = owned
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            crate::sse::stream_with(
                &url,
                &crate::sse::chat_body("victim", 400, true),
                &h,
                Duration::from_secs(30),
                crate::sse::report_stream_id(tx),
            )
        });
        let id = rx.recv_timeout(Duration::from_secs(10))?;
        let (status, _) = self.trip(&id, None)?;
        ensure!(status == 200, "trip answered {status}");
        streamer
            .join()
            .map_err(|_| anyhow::anyhow!("the streamer thread panicked"))??
            .halted_cleanly("OPERATOR_TRIP")?;
        Ok(id)
    }

    /// `GET /admin/streams`.
    pub fn list_streams(&self) -> Result<Value> {
        let url = format!("{}/admin/streams", self.admin_url());
        in_netns(&self.client_ns, move || get_json_here(&url))
    }

    /// The ledger's records, in order.
    pub fn ledger_records(&self) -> Result<Vec<Value>> {
        read_ledger(&self.ledger)
    }

    /// Waits (at most 5 s) until the ledger holds a record matching `pred` and returns it:
    /// records land asynchronously, just after the client saw the end.
    pub fn wait_record(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Result<Value> {
        wait_for(Duration::from_secs(5), what, || {
            Ok(self.ledger_records()?.into_iter().find(|r| pred(r)))
        })
        .with_context(|| {
            format!(
                "no ledger record {what}; records: {:#?}",
                self.ledger_records()
            )
        })
    }

    /// The fingerprint this instance gives the `Authorization` value `auth` (keyed with its
    /// node secret, which it created at start).
    pub fn key_fingerprint(&self, auth: &str) -> Result<String> {
        // Behind the harness's gateway the tenant header, which carries `auth`, names it.
        self.fingerprint_of(auth, self.tenant_header)
    }

    /// The degraded scope (`header:<fp>`) of requests carrying `auth` behind the harness's
    /// gateway ([`TEST_TENANT_HEADER`]): what `haltctl mode` and mode changes name.
    pub fn scope_of(&self, auth: &str) -> Result<String> {
        anyhow::ensure!(self.tenant_header, "this instance keys scopes by address");
        let secret = haltd::identity::NodeSecret::load_or_create(&self.state_dir)
            .context("reading the instance's node secret")?;
        Ok(haltd::scope::Scope::of_header(&secret, auth).name())
    }

    /// The fingerprint of `auth` as a bearer credential, whatever the harness's tenant header
    /// says (what `haltctl key fingerprint` prints for it).
    pub fn bearer_fingerprint(&self, auth: &str) -> Result<String> {
        self.fingerprint_of(auth, false)
    }

    fn fingerprint_of(&self, auth: &str, as_tenant: bool) -> Result<String> {
        let secret = haltd::identity::NodeSecret::load_or_create(&self.state_dir)
            .context("reading the instance's node secret")?;
        let token = haltd::credential::bearer(Some(auth), None)
            .map_err(|e| anyhow::anyhow!("{auth:?}: {e}"))?;
        let header = as_tenant.then_some(auth);
        let credential = haltd::credential::Credential::of(header, token);
        Ok(haltd::modes::KeyId::of(&secret, credential).fingerprint())
    }

    /// Runs `haltctl --json ARGS` against this haltd from its client namespace; its standard
    /// output as JSON, or the error with its standard error.
    pub fn haltctl_json(&self, args: &[&str]) -> Result<Value> {
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", &self.client_ns])
            .arg(crate::haltctl_bin()?)
            .arg("--admin")
            .arg(self.admin.to_string())
            .arg("--admin-token-file")
            .arg(self.admin_token_file())
            .arg("--json")
            .args(args)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "haltctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(serde_json::from_slice(&out.stdout)?)
    }

    /// Stops haltd with SIGTERM (SIGKILL after 10 s) and returns how it ended.
    pub fn stop(&mut self) -> Result<ExitStatus> {
        let mut child = self.child.take().context("haltd already stopped")?;
        terminate(&mut child)
    }
}

impl Drop for Haltd {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Err(e) = terminate(&mut child) {
                eprintln!("Haltd: stopping pid {}: {e:#}", child.id());
            }
        }
        if thread::panicking() {
            eprintln!("Haltd: logs and ledger kept in {}", self.dir.display());
        } else {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// The sampling flags the harness adds: record every turn, so that tests can wait for the
/// record of any turn (production samples 5 % of normal turns).
pub const TEST_SAMPLING: [&str; 2] = ["--turn-sample-rate", "1"];

/// The `--state-dir` of an instance: the one `extra` names (a restart that keeps the node
/// secret), else `dir/state` (the secret stays out of `/var/lib/haltd`).
fn state_dir_of(extra: &[&str], ledger: &Path) -> PathBuf {
    extra
        .iter()
        .position(|a| *a == "--state-dir")
        .and_then(|i| extra.get(i + 1))
        .map_or_else(|| crate::ledger::state_dir_for(ledger), PathBuf::from)
}

/// `--state-dir` unless `extra` names one.
fn state_dir_args(extra: &[&str], state_dir: &Path) -> Vec<String> {
    if extra.contains(&"--state-dir") {
        return Vec::new();
    }
    vec!["--state-dir".to_owned(), state_dir.display().to_string()]
}

/// The header by which the harness names each request's tenant, as a trusted gateway would
/// (docs/operations.md "Who a request is"): the test clients (`sse.rs`, `api.rs`) send it with
/// the request's `Authorization` value, so that each test key is its own scope and a trip in
/// one test stream degrades that key only, not every stream from the client namespace's one
/// address. Requests without it (other clients) fall back to the address group.
pub const TEST_TENANT_HEADER: &str = "x-haltd-test-tenant";

/// The [`TEST_TENANT_HEADER`] value a test client sends with `headers`: their
/// `Authorization` value, unless they carry a tenant header themselves.
pub fn tenant_of<'a>(headers: &[(&'a str, &'a str)]) -> Option<&'a str> {
    let own = headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case(TEST_TENANT_HEADER));
    let auth = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("authorization"))
        .map(|(_, v)| *v);
    auth.filter(|_| !own)
}

/// An argument that starts haltd without [`TEST_TENANT_HEADER`]: scopes by address group, as
/// haltd's default is (removed from the arguments haltd gets).
pub const ADDR_SCOPED: &str = "--harness-addr-scoped";

/// `--identity-header` [`TEST_TENANT_HEADER`], unless `extra` names an identity header, the
/// key store or [`ADDR_SCOPED`].
pub fn test_tenant(extra: &[&str]) -> &'static [&'static str] {
    let own = extra.iter().any(|a| {
        *a == ADDR_SCOPED || a.starts_with("--identity-header") || a.starts_with("--client-keys")
    });
    if own {
        &[]
    } else {
        &["--identity-header", TEST_TENANT_HEADER]
    }
}

/// [`TEST_SAMPLING`], unless `extra` sets the rate itself.
pub fn test_sampling(extra: &[&str]) -> &'static [&'static str] {
    let own = extra
        .iter()
        .any(|a| *a == "--turn-sample-rate" || a.starts_with("--turn-sample-rate="));
    if own {
        &[]
    } else {
        &TEST_SAMPLING
    }
}

/// The drain the harness gives haltd unless `extra` sets one: 1 s, so that an instance dropped
/// with streams open stops quickly (production drains for 30 s).
pub fn test_drain(extra: &[&str]) -> &'static [&'static str] {
    let own = extra
        .iter()
        .any(|a| *a == "--drain-timeout-ms" || a.starts_with("--drain-timeout-ms="));
    if own {
        &[]
    } else {
        &["--drain-timeout-ms", "1000"]
    }
}

fn terminate(child: &mut Child) -> Result<ExitStatus> {
    if let Some(status) = child.try_wait()? {
        return Ok(status);
    }
    let pid = libc::pid_t::try_from(child.id()).context("pid fits pid_t")?;
    // SAFETY: plain kill(2) on our own child, which has not been reaped yet.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    // A stop writes its record behind every record still queued, each fsync'd: on a busy disk
    // that takes seconds after a campaign of hundreds of turns. Slow stops are reported.
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait()? {
            if t0.elapsed() > Duration::from_secs(2) {
                eprintln!(
                    "Haltd: pid {pid} took {:.1?} to stop on SIGTERM",
                    t0.elapsed()
                );
            }
            return Ok(status);
        }
        thread::sleep(Duration::from_millis(20));
    }
    eprintln!("Haltd: pid {pid} ignored SIGTERM for 10 s; SIGKILL");
    child.kill()?;
    Ok(child.wait()?)
}

/// The admin flags: TCP with the test token, unless `extra` sets its own `--admin`.
fn admin_args(extra: &[&str], admin: &SocketAddr, token_file: &Path) -> Vec<String> {
    if extra
        .iter()
        .any(|a| *a == "--admin" || a.starts_with("--admin="))
    {
        return Vec::new();
    }
    vec![
        "--admin".into(),
        admin.to_string(),
        "--admin-token-file".into(),
        token_file.to_string_lossy().into_owned(),
    ]
}

/// The admin token file's name in a test haltd's directory.
const ADMIN_TOKEN_FILE: &str = "admin.token";

/// Writes [`TEST_ADMIN_TOKEN`] to a file only root can read, as `--admin-token-file` requires.
fn write_admin_token(dir: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(ADMIN_TOKEN_FILE);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    std::io::Write::write_all(&mut f, TEST_ADMIN_TOKEN.as_bytes())?;
    Ok(path)
}

/// `--no-upstream-probe` unless `extra` sets an `--upstream-probe-*` flag: the probe's
/// `GET /v1/models` every second would land in the scripted upstream's request log, which the
/// tests count (the readiness tests turn it on; production probes by default).
pub fn test_probe(extra: &[&str]) -> &'static [&'static str] {
    let own = extra
        .iter()
        .any(|a| a.starts_with("--upstream-probe") || *a == "--no-upstream-probe");
    if own {
        &[]
    } else {
        &["--no-upstream-probe"]
    }
}
