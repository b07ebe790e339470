//! A child process of the harness on loopback (haltd, the scripted upstream, llama.cpp's
//! server): started with its output in files, ready when its stdout says so, killed on drop.

use std::{
    fs,
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};

/// How long a process may take to say it is ready (llama.cpp's server loads a model).
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// A free loopback port (bound, read and released: the child binds it a moment later).
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")
        .context("binding 127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A running child; killed and reaped on drop.
#[derive(Debug)]
pub struct Proc {
    name: String,
    child: Child,
    /// Its stdout and its stderr.
    pub stdout: PathBuf,
    pub log: PathBuf,
}

impl Proc {
    /// Spawns `cmd` with stdout and stderr in `dir` (`NAME.stdout`, `NAME.log`) and waits
    /// until `ready` holds for the stdout so far.
    pub fn spawn(
        mut cmd: Command,
        dir: &Path,
        name: &str,
        ready: impl Fn(&str) -> bool,
    ) -> Result<Self> {
        let stdout = dir.join(format!("{name}.stdout"));
        let log = dir.join(format!("{name}.log"));
        let child = cmd
            .stdin(Stdio::null())
            .stdout(fs::File::create(&stdout).context("creating the stdout file")?)
            .stderr(fs::File::create(&log).context("creating the log file")?)
            .spawn()
            .with_context(|| format!("starting {name} ({cmd:?})"))?;
        let mut p = Proc {
            name: name.to_owned(),
            child,
            stdout,
            log,
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if ready(&fs::read_to_string(&p.stdout).unwrap_or_default()) {
                return Ok(p);
            }
            p.check_alive()?;
            ensure!(
                Instant::now() < deadline,
                "{name} was not ready in {READY_TIMEOUT:?}; its log:\n{}",
                p.log_tail()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Fails if the process has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited ({status}); its log:\n{}",
                self.name,
                self.log_tail()
            );
        }
        Ok(())
    }

    /// The last 40 lines of its stderr.
    pub fn log_tail(&self) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
