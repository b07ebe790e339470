//! The scripted OpenAI-compatible upstream (`scripted-upstream`, this crate's binary) as a
//! process next to haltd, with its request log.

use std::{
    fs, io,
    path::PathBuf,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

use crate::{netns::NetPair, temp_dir};

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
    /// `http://127.0.0.1:9000` (`https://` when it speaks TLS), as haltd's `--upstream`.
    pub url: String,
}

impl ScriptedUpstream {
    /// The upstream's process (`ip netns exec` execs it), for its CPU time; `None` once
    /// stopped.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

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
        if extra.contains(&"--tls-cert") {
            up.url = format!("https://{listen}");
        }
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
