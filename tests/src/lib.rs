//! Shared harness for the root-only integration tests (`tests/tests/it`, one test binary with a
//! module per topic) and the benches (`src/bin`): network namespaces, haltd processes, the
//! scripted upstream, an SSE client, the admin API, raw HTTP, a strict Prometheus text parser,
//! the ledger, and the kernel gate loaded in the test process itself.
//!
//! Everything here needs root (CAP_SYS_ADMIN for namespaces, CAP_BPF/CAP_NET_ADMIN for haltd's
//! gate). Each test builds a [`NetPair`]: haltd runs in the server namespace, clients run in
//! the client namespace ([`in_netns`]), so every byte crosses a real veth pair and the kernel
//! gate, and the tests measure what the client really received. Addresses come from
//! 198.18.0.0/15 (RFC 2544 benchmarking) and exist only inside those namespaces.
//!
//! Guards clean up in `Drop`, also on panic: a failing assertion never leaves namespaces,
//! processes or a gate's cgroup behind. A guard also puts back what it changed in the test
//! process (see [`gate::TestGate`]).
//!
//! Modules, one per concern:
//! - [`netns`]: the namespace pair and running code inside a namespace;
//! - [`daemon`]: the haltd process harness ([`Haltd`]) and the binaries under test;
//! - [`upstream`]: the scripted upstream process; [`llama`]: llama.cpp's server, the real one;
//!   [`rig`]: haltd in front of either; [`tls`]: test certificates for a TLS upstream;
//! - [`api`]: the API client over plain HTTP or TLS ([`api::Transport`]), for the halt tests
//!   that run over both;
//! - [`http`]: the ureq client, admin trips; [`raw_http`]: hand-written HTTP/1.1 exchanges;
//! - [`sse`]: the SSE client; [`clients`]: curl, the official OpenAI and Anthropic SDKs and
//!   the OpenAI Agents SDK; [`circuit_loops`]: spec 002's tool-call loops with and without
//!   haltd;
//! - [`metrics`]: the strict exposition parser; [`ledger`]: reading and verifying the ledger;
//! - [`gate`]: the kernel gate loaded in the test process, cgroups, socket options;
//! - [`adversary`]: the raw adversarial sender; [`slow_reader`]: a client that reads slowly
//!   through a small receive buffer.

use std::{
    env, fs,
    os::unix::fs::MetadataExt,
    path::PathBuf,
    process::{Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};

pub mod adversary;
pub mod api;
pub mod bench_files;
pub mod circuit_loops;
pub mod clients;
pub mod daemon;
pub mod gate;
pub mod grounding_ab;
pub mod handover;
pub mod http;
pub mod kill_loop;
pub mod ledger;
pub mod llama;
pub mod metrics;
pub mod netns;
pub mod proc_cpu;
pub mod raw_http;
pub mod rig;
pub mod seq_ttfb;
pub mod slow_reader;
pub mod sse;
pub mod stats;
pub mod tls;
pub mod tls_client;
pub mod upstream;

pub use api::{ApiClient, Transport};
pub use clients::{
    anthropic_client, anthropic_turns, curl, openai_agent, openai_agents_runs,
    openai_responses_turns, openai_sdk, openai_sdk_keepalive,
};
pub use daemon::{
    haltctl_bin, haltd_bin, test_sampling, Haltd, PORT_ADMIN, PORT_API, PORT_METRICS, TEST_SAMPLING,
};
pub use http::{agent, get_json_here, header, post_json_here, trip_here, TEST_ADMIN_TOKEN};
pub use ledger::{copy_ledger, read_ledger, state_dir_for, verify_ledger, verify_ledger_copy};
pub use metrics::Metrics;
pub use netns::{connect_from, in_netns, netns_exists, netns_path, spawn_in_netns, NetPair};
pub use raw_http::{dechunk_lenient, raw_exchange, raw_exchange_on, Ending, KeptConn, RawResponse};
pub use sse::{EventKind, SseEvent, StreamOutcome};
pub use upstream::{ScriptedUpstream, PORT_UPSTREAM};

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

/// Polls `f` every 20 ms until it returns `Some`, at most `timeout`.
pub fn wait_for<T>(
    timeout: Duration,
    what: &str,
    mut f: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f()? {
            return Ok(v);
        }
        ensure!(Instant::now() < deadline, "{what}: not after {timeout:?}");
        thread::sleep(Duration::from_millis(20));
    }
}
