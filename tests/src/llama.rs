//! llama.cpp's OpenAI-compatible server (`python -m llama_cpp.server`, PyPI package
//! `llama-cpp-python`, pinned by `cargo xtask setup`) as haltd's upstream: a real inference
//! server that nobody here wrote, serving the tiny model that `tests/llama/make_model.py`
//! made from a seed (`HALTD_LLAMA_MODEL`). It runs in the server namespace on the port of the
//! scripted upstream, so a [`Rig`] holds it the same way.
//!
//! Its stdout and stderr go to one log file: the server prints there when a client went away
//! (`Disconnected from client`), which the cancellation tests read, beside its CPU time.

use std::{
    env, fs,
    path::PathBuf,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};

use crate::{
    daemon::Haltd,
    http::get_json_here,
    netns::{in_netns, NetPair},
    proc_cpu::process_cpu_ns,
    rig::Rig,
    temp_dir,
    upstream::PORT_UPSTREAM,
};

/// The model name the server answers to (`--model_alias`).
pub const LLAMA_MODEL_ALIAS: &str = "tiny-llama";

/// The context window the tests give the server (`--n_ctx`): long streams fit, and a prompt
/// of more tokens is an oversized request.
pub const LLAMA_N_CTX: usize = 4096;

/// How long the server may take to import, load the model and answer `/v1/models`.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// llama.cpp's server on the server namespace's loopback; killed on drop. The log is kept
/// when the test fails.
#[derive(Debug)]
pub struct LlamaServer {
    child: Option<Child>,
    dir: PathBuf,
    /// The server's stdout and stderr.
    pub log: PathBuf,
    /// `http://127.0.0.1:9000`, as haltd's `--upstream`.
    pub url: String,
    /// The server process (`ip netns exec` execs it), for its CPU time.
    pub pid: u32,
}

/// What follows `python -m llama_cpp.server`: the model, its alias, the address, the context
/// window, one thread (a 2-core CI machine keeps a core for haltd and the client), and
/// `--interrupt_requests False`. By default the server interrupts the generation it is running
/// whenever another request arrives, `GET /v1/models` included: haltd's upstream probe (every
/// second) then cut replies short, with no error (measured by the grounding A/B harness: half
/// the replies differed between two identical runs). docs/operations.md tells operators the
/// same.
pub fn server_args(model: &std::path::Path, port: u16, n_ctx: usize) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = vec!["--model".into(), model.into()];
    let (port, n_ctx) = (port.to_string(), n_ctx.to_string());
    for a in [
        "--model_alias",
        LLAMA_MODEL_ALIAS,
        "--host",
        "127.0.0.1",
        "--port",
        &port,
        "--n_ctx",
        &n_ctx,
        "--n_threads",
        "1",
        "--n_threads_batch",
        "1",
        "--interrupt_requests",
        "False",
    ] {
        args.push(a.into());
    }
    args
}

/// The model file `cargo xtask setup` made (`HALTD_LLAMA_MODEL`).
pub fn llama_model() -> Result<PathBuf> {
    let path = PathBuf::from(env::var_os("HALTD_LLAMA_MODEL").context(
        "HALTD_LLAMA_MODEL is not set: run the tests with `cargo xtask test` (its setup makes the model)",
    )?);
    ensure!(
        path.is_file(),
        "{} is missing: run `cargo xtask setup`",
        path.display()
    );
    Ok(path)
}

impl LlamaServer {
    /// Starts the server in `pair.srv` with `extra` after its usual arguments, and waits until
    /// it answers `GET /v1/models`.
    pub fn start(pair: &NetPair, extra: &[&str]) -> Result<Self> {
        let python = env::var("HALTD_PYTHON")
            .context("HALTD_PYTHON is not set: run the tests with `cargo xtask test`")?;
        let model = llama_model()?;
        let dir = temp_dir("llama")?;
        let log = dir.join("server.log");
        let out = fs::File::create(&log).context("creating server.log")?;
        let err = out.try_clone().context("cloning the log's handle")?;
        let child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &pair.srv,
                &python,
                "-u",
                "-m",
                "llama_cpp.server",
            ])
            .args(server_args(&model, PORT_UPSTREAM, LLAMA_N_CTX))
            .args(extra)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {python} -m llama_cpp.server in {}", pair.srv))?;
        let pid = child.id();
        let mut server = LlamaServer {
            child: Some(child),
            dir,
            log,
            url: format!("http://127.0.0.1:{PORT_UPSTREAM}"),
            pid,
        };
        server.wait_ready(&pair.srv)?;
        Ok(server)
    }

    fn wait_ready(&mut self, ns: &str) -> Result<()> {
        let url = format!("{}/v1/models", self.url);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let probe = url.clone();
            if in_netns(ns, move || get_json_here(&probe)).is_ok() {
                return Ok(());
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!(
                    "llama_cpp.server exited during start-up ({status}): {}",
                    self.log_text()
                );
            }
            ensure!(
                Instant::now() < deadline,
                "llama_cpp.server did not answer /v1/models within {START_TIMEOUT:?}: {}",
                self.log_text()
            );
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// The server's output so far.
    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The server's CPU time so far (all threads), in ns.
    pub fn cpu_ns(&self) -> Result<u64> {
        process_cpu_ns(self.pid)
    }

    /// Kills the server (SIGKILL) and reaps it: a backend that dies mid-stream.
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill().context("killing llama_cpp.server")?;
            child.wait().context("reaping llama_cpp.server")?;
        }
        Ok(())
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.kill();
        if thread::panicking() {
            eprintln!("LlamaServer: log kept in {}", self.dir.display());
        } else {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

impl Rig<LlamaServer> {
    /// llama.cpp's server (with `server_extra`) and haltd proxying it, with `haltd_extra`
    /// after `--source openai --upstream URL`.
    pub fn start_llama(server_extra: &[&str], haltd_extra: &[&str]) -> Result<Self> {
        let pair = NetPair::new()?;
        let up = LlamaServer::start(&pair, server_extra)?;
        let mut args = vec!["--source", "openai", "--upstream", up.url.as_str()];
        args.extend_from_slice(haltd_extra);
        let haltd = Haltd::start(&pair, &args)?;
        Ok(Rig {
            haltd,
            up,
            pair,
            config_dir: None,
        })
    }
}
