//! One configuration: a real haltd configured by the config file alone and by `HALTD_*`
//! variables alone (no flag but the subcommand), and `haltd check-config` as an unprivileged
//! user (uid 65534, through `setpriv`), which binds and loads nothing and says where each bad
//! value is.

use std::{
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use haltd_tests::{
    agent, haltd_bin, in_netns, require_root, sse, temp_dir, NetPair, PORT_API, PORT_METRICS,
};

/// A haltd started by hand, so that nothing but `args` and `env` configures it; killed on
/// drop.
struct Started {
    child: Child,
    dir: PathBuf,
}

impl Started {
    fn start(pair: &NetPair, dir: &Path, args: &[&str], env: &[(String, String)]) -> Result<Self> {
        let stdout = fs::File::create(dir.join("stdout.log"))?;
        let stderr = fs::File::create(dir.join("stderr.log"))?;
        let child = Command::new("ip")
            .args(["netns", "exec", &pair.srv])
            .arg(haltd_bin()?)
            .args(args)
            // Only the variables given: the harness's own HALTD_* must not configure it.
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .context("starting haltd")?;
        Ok(Started {
            child,
            dir: dir.to_owned(),
        })
    }

    /// The `haltd ready` line, once haltd printed it (at most 20 s).
    fn ready_line(&mut self) -> Result<String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let out = fs::read_to_string(self.dir.join("stdout.log")).unwrap_or_default();
            if let Some(line) = out.lines().find(|l| l.starts_with("haltd ready")) {
                return Ok(line.to_owned());
            }
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "haltd exited during start-up ({status}):\n{}",
                    fs::read_to_string(self.dir.join("stderr.log")).unwrap_or_default()
                );
            }
            ensure!(Instant::now() < deadline, "haltd not ready after 20 s");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The settings both tests give, as (file key, value as TOML, value as a variable).
fn settings(pair: &NetPair, dir: &Path) -> Vec<(&'static str, String, String)> {
    let api = pair.srv_addr(PORT_API).to_string();
    let ledger = dir.join("ledger.jsonl").display().to_string();
    let state = dir.join("state").display().to_string();
    let admin = format!("unix:{}", dir.join("admin.sock").display());
    let quoted = |s: &str| format!("\"{s}\"");
    vec![
        ("listen", quoted(&api), api.clone()),
        // A host name, resolved at start.
        (
            "metrics",
            quoted(&format!("localhost:{PORT_METRICS}")),
            format!("localhost:{PORT_METRICS}"),
        ),
        ("admin", quoted(&admin), admin.clone()),
        ("ledger", quoted(&ledger), ledger.clone()),
        ("state_dir", quoted(&state), state.clone()),
        ("budget", "7".into(), "7".into()),
        ("drain_timeout_ms", "1000".into(), "1000".into()),
        ("ledger_no_fsync", "true".into(), "yes".into()),
    ]
}

/// haltd serves as configured: the ready line states the file's or the variables' values
/// (the metrics name resolved), a turn streams on the configured address, `/metrics` answers
/// on the resolved loopback address, and the ledger is where the settings put it.
fn serves_as_configured(pair: &NetPair, dir: &Path, mut haltd: Started) -> Result<()> {
    let line = haltd.ready_line()?;
    let api = pair.srv_addr(PORT_API);
    for want in [
        format!("listen={api}"),
        format!("metrics=127.0.0.1:{PORT_METRICS}"),
        "budget=7".to_owned(),
        format!("ledger={}", dir.join("ledger.jsonl").display()),
    ] {
        ensure!(line.contains(&want), "ready line lacks {want}: {line}");
    }
    let url = format!("http://{api}/v1/chat/completions");
    let out = in_netns(&pair.cli, move || {
        sse::stream(
            &url,
            &sse::chat_body("configured", 6, true),
            Duration::from_secs(30),
            |_, _| {},
        )
    })?;
    ensure!(out.status == 200 && out.tokens == 6, "turn: {out:?}");
    let metrics = in_netns(&pair.srv, move || -> Result<u16> {
        let url = format!("http://127.0.0.1:{PORT_METRICS}/metrics");
        Ok(agent(Duration::from_secs(5))
            .get(&url)
            .call()?
            .status()
            .as_u16())
    })?;
    ensure!(metrics == 200, "GET /metrics: {metrics}");
    ensure!(
        dir.join("state").is_dir() && dir.join("ledger.jsonl").is_file(),
        "the ledger or the state directory is not where the settings put them"
    );
    drop(haltd);
    Ok(())
}

#[test]
fn serves_configured_by_the_file_alone() -> Result<()> {
    require_root()?;
    let pair = NetPair::new()?;
    let dir = temp_dir("config-file")?;
    let mut text: String = settings(&pair, &dir)
        .into_iter()
        .map(|(key, toml, _)| format!("{key} = {toml}\n"))
        .collect();
    text.push_str("\n[detectors.surprise]\nmode = \"observe\"\n");
    let path = dir.join("haltd.toml");
    fs::write(&path, text)?;
    let path = path.display().to_string();
    let haltd = Started::start(&pair, &dir, &["serve", "--config", &path], &[])?;
    serves_as_configured(&pair, &dir, haltd)?;
    fs::remove_dir_all(&dir).ok();
    Ok(())
}

#[test]
fn serves_configured_by_the_environment_alone() -> Result<()> {
    require_root()?;
    let pair = NetPair::new()?;
    let dir = temp_dir("config-env")?;
    let env: Vec<(String, String)> = settings(&pair, &dir)
        .into_iter()
        .map(|(key, _, value)| (format!("HALTD_{}", key.to_ascii_uppercase()), value))
        .collect();
    let haltd = Started::start(&pair, &dir, &["serve"], &env)?;
    serves_as_configured(&pair, &dir, haltd)?;
    fs::remove_dir_all(&dir).ok();
    Ok(())
}

/// `haltd check-config ARGS` as uid/gid 65534 with no supplementary group, with `env` only.
fn check_as_nobody(args: &[&str], env: &[(&str, &str)]) -> Result<Output> {
    Command::new("setpriv")
        .args([
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            "--",
        ])
        .arg(haltd_bin()?)
        .arg("check-config")
        .args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .envs(env.iter().copied())
        .output()
        .context("running setpriv")
}

#[test]
fn check_config_runs_unprivileged_and_names_each_bad_value() -> Result<()> {
    require_root()?;
    let dir = temp_dir("check-config")?;
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755))?;
    let write = |name: &str, text: &str| -> Result<String> {
        let p = dir.join(name);
        fs::write(&p, text)?;
        fs::set_permissions(&p, fs::Permissions::from_mode(0o644))?;
        Ok(p.display().to_string())
    };
    let shown = |o: &Output| {
        format!(
            "{}\nstdout:\n{}\nstderr:\n{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };
    // The shipped example, as the unit's ExecStartPre runs it (but as nobody).
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let example = fs::read_to_string(repo.join("deploy/haltd.toml"))?;
    let good = write("good.toml", &example)?;
    let o = check_as_nobody(&[&good], &[])?;
    ensure!(
        o.status.code() == Some(0)
            && String::from_utf8_lossy(&o.stdout).contains("configuration ok")
            && String::from_utf8_lossy(&o.stdout).contains("listen = 127.0.0.1:8080"),
        "the example: {}",
        shown(&o)
    );
    // A value out of range, and a section key out of range, each with its line.
    let bad = write(
        "bad.toml",
        "listen = \"127.0.0.1:8080\"\nbudget = 5000\n\n[detectors.surprise]\nwindow = 0\n",
    )?;
    let o = check_as_nobody(&[&bad], &[])?;
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    ensure!(
        o.status.code() == Some(2)
            && err.contains(&format!(
                "{bad}:2: budget: 5000 exceeds the maximum of 1000"
            )),
        "budget: {}",
        shown(&o)
    );
    let o = check_as_nobody(&[&bad, "--budget", "5"], &[])?;
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    ensure!(
        o.status.code() == Some(2) && err.contains(&format!("{bad}:5: detectors.surprise.window")),
        "window: {}",
        shown(&o)
    );
    // Bad values of the file's settings, and of a variable, all reported at once.
    let typo = write(
        "typo.toml",
        "listen = \"nowhere.invalid:80\"\nworkerz = 4\nsource = \"cloud\"\n",
    )?;
    let o = check_as_nobody(&[&typo], &[("HALTD_MAX_STREAMS", "lots")])?;
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    for want in [
        format!("{typo}:1: listen: invalid value \"nowhere.invalid:80\""),
        format!("{typo}:2: workerz: unknown setting"),
        format!("{typo}:3: source: \"cloud\" is not one of: builtin, openai"),
        "HALTD_MAX_STREAMS (environment): invalid value \"lots\"".to_owned(),
    ] {
        ensure!(
            o.status.code() == Some(2) && err.contains(&want),
            "{want}: {}",
            shown(&o)
        );
    }
    // A file the user cannot read, and no file at all.
    let secret = write("secret.toml", "budget = 5\n")?;
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o600))?;
    let o = check_as_nobody(&[&secret], &[])?;
    ensure!(
        o.status.code() == Some(2)
            && String::from_utf8_lossy(&o.stderr).contains("Permission denied"),
        "unreadable: {}",
        shown(&o)
    );
    let o = check_as_nobody(&[], &[])?;
    ensure!(o.status.code() == Some(2), "no file: {}", shown(&o));
    fs::remove_dir_all(&dir).ok();
    Ok(())
}
