//! Shared harness for the root-only integration tests: network namespaces, haltd processes,
//! an SSE client, the admin API, a strict Prometheus text parser and the ledger.
//!
//! Everything here needs root (CAP_SYS_ADMIN for namespaces, CAP_BPF/CAP_NET_ADMIN for haltd's
//! gate). Each test builds a [`NetPair`]: haltd runs in the server namespace, clients run in
//! the client namespace ([`in_netns`]), so every byte crosses a real veth pair and the kernel
//! gate, and the tests measure what the client really received. Addresses come from
//! 198.18.0.0/15 (RFC 2544 benchmarking) and exist only inside those namespaces.
//!
//! Guards clean up in `Drop`, also on panic: a failing assertion never leaves namespaces or
//! processes behind.

use std::{
    env, fs,
    io::{self, BufRead, BufReader, Read, Write},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream},
    os::{fd::AsRawFd, unix::fs::MetadataExt},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, ensure, Context, Result};
use serde_json::Value;

pub mod adversary;
pub mod metrics;
pub mod sse;

pub use metrics::Metrics;
pub use sse::{EventKind, SseEvent, StreamOutcome};

/// Fails unless the tests run as root (they create namespaces and load BPF).
pub fn require_root() -> Result<()> {
    let uid = fs::metadata("/proc/self").context("stat /proc/self")?.uid();
    ensure!(
        uid == 0,
        "the haltd integration tests need root (namespaces, BPF); run `cargo xtask test` as root"
    );
    Ok(())
}

/// Runs a command to completion; an error carries the command line and its stderr.
pub fn checked(cmd: &mut Command) -> Result<String> {
    let shown = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("starting `{shown}`"))?;
    if !out.status.success() {
        bail!(
            "`{shown}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn ip(args: &[&str]) -> Result<String> {
    checked(Command::new("ip").args(args))
}

/// Path of a named network namespace (as `ip netns` keeps them).
pub fn netns_path(ns: &str) -> PathBuf {
    Path::new("/var/run/netns").join(ns)
}

/// Whether a named network namespace exists.
pub fn netns_exists(ns: &str) -> bool {
    netns_path(ns).exists()
}

static NEXT_PAIR: AtomicU32 = AtomicU32::new(1);

/// Two network namespaces joined by a veth pair: `srv` holds 198.18.n.1/30, `cli` holds
/// 198.18.n.2/30, loopback up in both. Dropping it deletes both namespaces (and with them
/// the veth pair and every socket bound in them).
#[derive(Debug)]
pub struct NetPair {
    /// Pair number: the third octet of both addresses.
    pub n: u8,
    /// Server namespace name.
    pub srv: String,
    /// Client namespace name.
    pub cli: String,
    pub srv_ip: Ipv4Addr,
    pub cli_ip: Ipv4Addr,
    /// Namespaces created so far (all of them once `new` returns).
    created: Vec<String>,
}

impl NetPair {
    pub fn new() -> Result<Self> {
        require_root()?;
        remove_stale_namespaces();
        let seq = NEXT_PAIR.fetch_add(1, Ordering::Relaxed);
        let n = u8::try_from(seq % 250 + 1).context("pair number fits an octet")?;
        let pid = std::process::id();
        let mut pair = NetPair {
            n,
            srv: format!("haltd-t-{pid}-{seq}-srv"),
            cli: format!("haltd-t-{pid}-{seq}-cli"),
            srv_ip: Ipv4Addr::new(198, 18, n, 1),
            cli_ip: Ipv4Addr::new(198, 18, n, 2),
            created: Vec::new(),
        };
        for ns in [pair.srv.clone(), pair.cli.clone()] {
            ip(&["netns", "add", &ns])?;
            pair.created.push(ns);
        }
        // Created directly inside the namespaces, so the short names never meet in the root one.
        ip(&[
            "link", "add", "hv-srv", "netns", &pair.srv, "type", "veth", "peer", "name", "hv-cli",
            "netns", &pair.cli,
        ])?;
        for (ns, dev, addr) in [
            (&pair.srv, "hv-srv", pair.srv_ip),
            (&pair.cli, "hv-cli", pair.cli_ip),
        ] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/30"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(pair)
    }

    /// `srv_ip:port`.
    pub fn srv_addr(&self, port: u16) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(self.srv_ip, port))
    }
}

impl Drop for NetPair {
    fn drop(&mut self) {
        for ns in self.created.drain(..).rev() {
            if let Err(e) = ip(&["netns", "delete", &ns]) {
                eprintln!("NetPair: could not delete namespace {ns}: {e:#}");
            }
        }
    }
}

/// Deletes `haltd-t-<pid>-*` namespaces left by test processes that no longer run (a test
/// binary killed with SIGKILL cannot run its guards).
fn remove_stale_namespaces() {
    let Ok(entries) = fs::read_dir("/var/run/netns") else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("haltd-t-")
            .and_then(|r| r.split('-').next())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid).exists() {
            eprintln!("NetPair: deleting stale namespace {name}");
            let _ = ip(&["netns", "delete", &name]);
        }
    }
}

/// Runs `f` on a new thread that has joined the named network namespace (`setns` moves only
/// the calling thread), and returns its result. A panic in `f` propagates.
pub fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    let path = netns_path(ns);
    thread::scope(|s| {
        let handle = s.spawn(move || {
            enter_netns(&path).unwrap_or_else(|e| panic!("{e:#}"));
            f()
        });
        match handle.join() {
            Ok(v) => v,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}

/// Like [`in_netns`], but returns the thread's handle so that many clients run at once.
pub fn spawn_in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> thread::JoinHandle<T> {
    let path = netns_path(ns);
    thread::spawn(move || {
        enter_netns(&path).unwrap_or_else(|e| panic!("{e:#}"));
        f()
    })
}

fn enter_netns(path: &Path) -> Result<()> {
    let file = fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: `file` is an open namespace file for the whole call; setns only changes this
    // thread's network namespace.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc != 0 {
        return Err(io::Error::last_os_error())
            .with_context(|| format!("setns({})", path.display()));
    }
    Ok(())
}

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

pub fn haltctl_bin() -> Result<PathBuf> {
    bin_from_env("HALTCTL_BIN", "haltctl")
}

static NEXT_DIR: AtomicU32 = AtomicU32::new(1);

/// A fresh directory under the system temp dir.
pub fn temp_dir(tag: &str) -> Result<PathBuf> {
    let dir = env::temp_dir().join(format!(
        "haltd-t-{}-{}-{tag}",
        std::process::id(),
        NEXT_DIR.fetch_add(1, Ordering::Relaxed)
    ));
    if dir.exists() {
        fs::remove_dir_all(&dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// A running `haltd serve` in a pair's server namespace. Drop stops it (SIGTERM, then SIGKILL
/// after 2 s) and removes its directory, unless the thread is panicking (then the directory
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
        let bin = haltd_bin()?;
        let dir = temp_dir("haltd")?;
        let api = pair.srv_addr(PORT_API);
        let admin = pair.srv_addr(PORT_ADMIN);
        let metrics = pair.srv_addr(PORT_METRICS);
        let ledger = ledger.map_or_else(|| dir.join("ledger.jsonl"), Path::to_path_buf);
        let stdout = fs::File::create(dir.join("stdout.log")).context("creating stdout.log")?;
        let stderr = fs::File::create(dir.join("stderr.log")).context("creating stderr.log")?;
        // `ip netns exec` joins the namespace and execs haltd, so the child is haltd itself.
        let child = Command::new("ip")
            .args(["netns", "exec", &pair.srv])
            .args(wrapper)
            .arg(&bin)
            .arg("serve")
            .args([
                "--listen",
                &api.to_string(),
                "--admin",
                &admin.to_string(),
                "--metrics",
                &metrics.to_string(),
            ])
            .arg("--ledger")
            .arg(&ledger)
            .args(test_sampling(extra))
            .args(extra)
            .env("RUST_BACKTRACE", "1")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("starting {} in {}", bin.display(), pair.srv))?;
        let mut haltd = Haltd {
            child: Some(child),
            dir,
            api,
            admin,
            metrics,
            ledger,
            client_ns: pair.cli.clone(),
        };
        haltd
            .wait_ready(Duration::from_secs(20))
            .with_context(|| format!("haltd {extra:?} did not become ready"))?;
        Ok(haltd)
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let health = format!("http://{}/healthz", self.api);
        loop {
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
            let printed = fs::read_to_string(self.dir.join("stdout.log"))
                .is_ok_and(|s| s.lines().any(|l| l.starts_with("haltd ready")));
            if printed {
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

    /// `GET /admin/streams`.
    pub fn list_streams(&self) -> Result<Value> {
        let url = format!("{}/admin/streams", self.admin_url());
        in_netns(&self.client_ns, move || get_json_here(&url))
    }

    /// The ledger's records, in order.
    pub fn ledger_records(&self) -> Result<Vec<Value>> {
        read_ledger(&self.ledger)
    }

    /// Stops haltd with SIGTERM (SIGKILL after 2 s) and returns how it ended.
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

/// A ureq agent for talking to haltd: statuses are not errors, no proxy, a global timeout.
pub fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .max_redirects(0)
        .timeout_global(Some(timeout))
        .build()
        .into()
}

/// A response header as a string.
pub fn header<B>(resp: &ureq::http::Response<B>, name: &str) -> Option<String> {
    resp.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// POSTs a trip from the current thread's namespace.
pub fn trip_here(url: &str, cause: Option<&str>) -> Result<(u16, Value)> {
    let req = agent(Duration::from_secs(10)).post(url);
    let resp = match cause {
        Some(cause) => req.send_json(serde_json::json!({ "cause": cause })),
        None => req.send_empty(),
    };
    let mut resp = resp.with_context(|| format!("POST {url}"))?;
    let status = resp.status().as_u16();
    let body = resp.body_mut().read_to_string().unwrap_or_default();
    Ok((status, serde_json::from_str(&body).unwrap_or(Value::Null)))
}

/// GETs JSON from the current thread's namespace.
pub fn get_json_here(url: &str) -> Result<Value> {
    let mut resp = agent(Duration::from_secs(10))
        .get(url)
        .call()
        .with_context(|| format!("GET {url}"))?;
    ensure!(resp.status() == 200, "GET {url}: status {}", resp.status());
    resp.body_mut()
        .read_json()
        .with_context(|| format!("GET {url}: body is not JSON"))
}

/// Reads a JSON Lines ledger.
pub fn read_ledger(path: &Path) -> Result<Vec<Value>> {
    let mut text =
        fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    // A record being appended right now has no newline yet: not a record until it has.
    if let Some(end) = text.rfind('\n') {
        text.truncate(end + 1);
    } else {
        text.clear();
    }
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l)
                .with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))
        })
        .collect()
}

/// Runs `haltctl ledger verify PATH`; Ok if it exits 0.
pub fn verify_ledger(path: &Path) -> Result<String> {
    checked(
        Command::new(haltctl_bin()?)
            .args(["ledger", "verify"])
            .arg(path),
    )
}

/// A raw HTTP/1.1 exchange for inputs a real client would refuse to send: writes `request`,
/// half-closes nothing, and reads the response head and body (Content-Length, chunked or
/// until close). Runs in the current thread's namespace.
pub fn raw_exchange(addr: SocketAddr, request: &[u8], timeout: Duration) -> Result<RawResponse> {
    let s = TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("connecting to {addr}"))?;
    raw_exchange_on(s, request, timeout)
}

/// [`raw_exchange`] on a connection the caller opened (e.g. to send several requests at the
/// same instant on connections set up beforehand).
pub fn raw_exchange_on(mut s: TcpStream, request: &[u8], timeout: Duration) -> Result<RawResponse> {
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(request).context("writing the request")?;
    let mut r = BufReader::new(s);
    let mut status_line = String::new();
    r.read_line(&mut status_line)
        .context("reading the status line")?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("bad status line {status_line:?}"))?;
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        ensure!(
            r.read_line(&mut line)? > 0,
            "connection closed inside the response head"
        );
        let line = line.trim_end_matches(['\r', '\n']);
        if line.is_empty() {
            break;
        }
        let (k, v) = line
            .split_once(':')
            .with_context(|| format!("bad header line {line:?}"))?;
        headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
    }
    let get = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let mut body = Vec::new();
    if let Some(len) = get("content-length") {
        let len: usize = len.parse().context("bad content-length")?;
        body.resize(len, 0);
        r.read_exact(&mut body).context("reading the body")?;
    } else if get("transfer-encoding").is_some_and(|t| t.eq_ignore_ascii_case("chunked")) {
        loop {
            let mut size = String::new();
            r.read_line(&mut size)?;
            let size = usize::from_str_radix(size.trim().split(';').next().unwrap_or("0"), 16)
                .context("bad chunk size")?;
            let mut chunk = vec![0; size + 2];
            r.read_exact(&mut chunk)?;
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    } else {
        r.read_to_end(&mut body)?;
    }
    Ok(RawResponse {
        status,
        headers,
        body,
    })
}

/// What [`raw_exchange`] read.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    /// Header names in lower case.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Result<Value> {
        serde_json::from_slice(&self.body).map_err(|e| {
            anyhow!(
                "body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }
}

/// The `q`-quantile (0..=1) of `values` by nearest rank; `None` when empty.
pub fn quantile<T: Copy + PartialOrd>(values: &[T], q: f64) -> Option<T> {
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    if v.is_empty() {
        return None;
    }
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

/// Port the scripted upstream listens on, on the server namespace's loopback.
pub const PORT_UPSTREAM: u16 = 9000;

/// A scripted OpenAI-compatible upstream (`scripted-upstream`, this crate's binary) running
/// on the server namespace's loopback, next to haltd; killed on drop. Its request log
/// (JSON Lines) says what haltd forwarded and whether the generation was cancelled.
#[derive(Debug)]
pub struct ScriptedUpstream {
    child: Option<Child>,
    dir: PathBuf,
    pub log: PathBuf,
    /// `http://127.0.0.1:9000`, as haltd's `--upstream`.
    pub url: String,
}

impl ScriptedUpstream {
    /// Starts `bin` (pass `env!("CARGO_BIN_EXE_scripted-upstream")`) in `pair.srv` and waits
    /// until it listens.
    pub fn start(pair: &NetPair, bin: &str, extra: &[&str]) -> Result<Self> {
        let dir = temp_dir("upstream")?;
        let log = dir.join("requests.jsonl");
        let ready = dir.join("ready");
        let listen = format!("127.0.0.1:{PORT_UPSTREAM}");
        let stderr = fs::File::create(dir.join("stderr.log")).context("creating stderr.log")?;
        let child = Command::new("ip")
            .args(["netns", "exec", &pair.srv, bin, "--listen", &listen])
            .arg("--log")
            .arg(&log)
            .arg("--ready-file")
            .arg(&ready)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("starting {bin} in {}", pair.srv))?;
        let mut up = ScriptedUpstream {
            child: Some(child),
            dir,
            log,
            url: format!("http://{listen}"),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ready.exists() {
            if let Some(status) = up.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                bail!("scripted-upstream exited during start-up ({status})");
            }
            ensure!(
                Instant::now() < deadline,
                "scripted-upstream not ready after 10 s"
            );
            thread::sleep(Duration::from_millis(20));
        }
        Ok(up)
    }

    /// The request log so far (one JSON object per line; `event: "started"` lines included).
    pub fn requests(&self) -> Result<Vec<Value>> {
        let text = match fs::read_to_string(&self.log) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e).context("reading the upstream log"),
        };
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).with_context(|| format!("upstream log line {l:?}")))
            .collect()
    }

    /// Waits (at most `timeout`) for the end-of-request line of request `seq` (0-based count
    /// of requests) and returns it.
    pub fn wait_ended(&self, nth: usize, timeout: Duration) -> Result<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let ended: Vec<Value> = self
                .requests()?
                .into_iter()
                .filter(|r| r.get("event").is_none())
                .collect();
            if let Some(r) = ended.get(nth) {
                return Ok(r.clone());
            }
            ensure!(
                Instant::now() < deadline,
                "upstream request #{nth} did not end within {timeout:?}; log: {:?}",
                self.requests()?
            );
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ScriptedUpstream {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if thread::panicking() {
            eprintln!("ScriptedUpstream: log kept in {}", self.dir.display());
        } else {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// Runs the official OpenAI Python SDK client (`tests/py/openai_client.py` in the venv that
/// `cargo xtask setup` made) in namespace `ns`; returns its one JSON line.
pub fn openai_sdk(ns: &str, args: &[&str]) -> Result<Value> {
    let python = env::var("HALTD_PYTHON")
        .context("HALTD_PYTHON is not set: run the tests with `cargo xtask test`")?;
    let script = env::var("HALTD_OPENAI_CLIENT").unwrap_or_else(|_| {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("py/openai_client.py")
            .display()
            .to_string()
    });
    let out = Command::new("ip")
        .args(["netns", "exec", ns, &python, &script])
        .args(args)
        .output()
        .context("running the OpenAI SDK client")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "openai_client.py {args:?} failed ({}): {stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).with_context(|| format!("openai_client.py printed {stdout:?}"))
}

/// Runs curl in namespace `ns` with `args`; returns (exit status success, stdout).
pub fn curl(ns: &str, args: &[&str]) -> Result<(bool, String)> {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "curl", "-sS", "--max-time", "30"])
        .args(args)
        .output()
        .context("running curl (Debian package curl)")?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    ))
}
