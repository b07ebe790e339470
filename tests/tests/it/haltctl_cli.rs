//! Issue 29 point 7: haltctl as an operator meets it. Every command prints a table and takes
//! `--json`; it finds the daemon through haltd's own config file; `status` names the daemon;
//! a closed pipe ends it quietly; `key fingerprint` gives haltd's fingerprint; and `ledger
//! verify` answers with one exit code per verdict (docs/operations.md "Verifying the ledger").

use std::{
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    sync::mpsc,
    time::Duration,
};

use anyhow::{anyhow, ensure, Context, Result};
use haltd_tests::{haltctl_bin, spawn_in_netns, sse, temp_dir, Haltd, NetPair, TEST_SAMPLING};
use serde_json::Value;

/// Runs haltctl with `args` in namespace `ns` (the admin API is reachable from the client's),
/// `stdin` on its standard input.
fn haltctl_in(ns: &str, args: &[&str], stdin: Option<&str>) -> Result<Output> {
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns])
        .arg(haltctl_bin()?)
        .args(args)
        .env_remove("HALTD_ADMIN")
        .env_remove("HALTD_ADMIN_TOKEN_FILE")
        .env_remove("HALTD_STATE_DIR")
        .env_remove("HALTD_CONFIG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running haltctl")?;
    if let Some(text) = stdin {
        use std::io::Write;
        child
            .stdin
            .take()
            .context("stdin")?
            .write_all(text.as_bytes())?;
    }
    drop(child.stdin.take());
    Ok(child.wait_with_output()?)
}

fn ok(o: &Output, what: &str) -> Result<String> {
    ensure!(
        o.status.success(),
        "{what}: {} {}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(String::from_utf8(o.stdout.clone())?)
}

/// A streamed turn that ends normally.
fn one_turn(haltd: &Haltd, ns: &str) -> Result<()> {
    let (tx, _rx) = mpsc::channel();
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    let o = spawn_in_netns(ns, move || {
        sse::stream(
            &url,
            &sse::chat_body("haltctl", 4, true),
            Duration::from_secs(30),
            sse::report_stream_id(tx),
        )
    })
    .join()
    .map_err(|_| anyhow!("streamer thread"))??;
    ensure!(o.status == 200, "status {}", o.status);
    Ok(())
}

/// `haltctl key fingerprint`: haltd's own fingerprint, for the key and for `Bearer KEY`; a
/// header value differs; a credential haltd refuses is refused.
fn key_fingerprints_are_haltds(haltd: &Haltd, ns: &str, cfg: &str) -> Result<()> {
    // key fingerprint: haltd's own, for the key and for `Bearer KEY`; a header value differs.
    let want = haltd.bearer_fingerprint("Bearer sk-haltctl-7")?;
    for input in ["sk-haltctl-7\n", "Bearer sk-haltctl-7\n"] {
        let got = ok(
            &haltctl_in(ns, &["--config", cfg, "key", "fingerprint"], Some(input))?,
            "key fingerprint",
        )?;
        ensure!(got.trim() == want, "{input:?}: {got} != {want}");
    }
    let header = ok(
        &haltctl_in(
            ns,
            &["--config", cfg, "key", "fingerprint", "--header"],
            Some("sk-haltctl-7\n"),
        )?,
        "key fingerprint --header",
    )?;
    ensure!(
        header.trim() != want && header.trim().len() == 16,
        "{header}"
    );
    let refused = haltctl_in(
        ns,
        &["--config", cfg, "key", "fingerprint"],
        Some("Basic x\n"),
    )?;
    ensure!(refused.status.code() == Some(2), "{refused:?}");

    Ok(())
}

#[test]
fn haltctl_reads_haltds_config_names_the_daemon_and_prints_tables() -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &TEST_SAMPLING)?;
    let dir = temp_dir("haltctl-config")?;
    let config = dir.join("haltd.toml");
    fs::write(
        &config,
        format!(
            "admin = \"{}\"\nadmin_token_file = \"{}\"\nstate_dir = \"{}\"\nbudget = 5\n",
            haltd.admin,
            haltd.admin_token_file().display(),
            haltd.state_dir.display()
        ),
    )?;
    let cfg = config.display().to_string();
    let ns = pair.cli.as_str();

    // status: the table names the daemon; --json is the admin API's answer.
    let table = ok(
        &haltctl_in(ns, &["--config", &cfg, "status"], None)?,
        "status",
    )?;
    let pid = haltd.pid().context("haltd's pid")?;
    let row = |name: &str| {
        table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .map(|l| l.split_whitespace().nth(1).unwrap_or_default().to_owned())
    };
    ensure!(row("pid") == Some(pid.to_string()), "{table}");
    ensure!(row("listen") == Some(haltd.api.to_string()), "{table}");
    ensure!(
        row("version") == Some(haltd::build_info::VERSION.to_owned()) && row("commit").is_some(),
        "{table}"
    );
    let json: Value = serde_json::from_str(&ok(
        &haltctl_in(ns, &["--config", &cfg, "status", "--json"], None)?,
        "status --json",
    )?)?;
    ensure!(
        json["pid"] == pid && json["listen"] == haltd.api.to_string(),
        "{json}"
    );

    // Every admin command: a table by default, JSON with --json.
    for (cmd, header) in [
        (&["streams"][..], "no open streams"),
        (&["mode"], "a halt degrades"),
        (&["conversations"], "no conversation"),
        (&["circuit", "show"], ""),
    ] {
        let mut args = vec!["--config", cfg.as_str()];
        args.extend_from_slice(cmd);
        let text = ok(&haltctl_in(ns, &args, None)?, &format!("{cmd:?}"))?;
        ensure!(text.contains(header), "{cmd:?}: {text}");
        ensure!(
            serde_json::from_str::<Value>(&text).is_err(),
            "{cmd:?} printed JSON: {text}"
        );
        args.push("--json");
        let json = ok(&haltctl_in(ns, &args, None)?, &format!("{cmd:?} --json"))?;
        serde_json::from_str::<Value>(&json).with_context(|| format!("{cmd:?} --json: {json}"))?;
    }

    key_fingerprints_are_haltds(&haltd, ns, &cfg)?;

    // Without --config (and HALTD_ADMIN), haltctl does not find this daemon: the default
    // socket is another one's, and status would name it.
    let elsewhere = haltctl_in(
        ns,
        &["--admin", "unix:/nonexistent/admin.sock", "status"],
        None,
    )?;
    ensure!(elsewhere.status.code() == Some(2), "{elsewhere:?}");
    Ok(())
}

#[test]
fn a_closed_pipe_ends_haltctl_quietly() -> Result<()> {
    let dir = temp_dir("haltctl-pipe")?;
    let ledger = dir.join("big.jsonl");
    let record = r#"{"seq":0,"prev_hash":"x","kind":"turn","ts":"2026-12-06T00:00:00.000Z","stream_id":"hs_0000000100000001","outcome":"completed","tokens_emitted":5}"#;
    fs::write(&ledger, format!("{record}\n").repeat(50_000))?;
    for json in ["", "--json"] {
        let script = format!(
            "{} ledger show {} {json} | head -n 1 >/dev/null; echo \"${{PIPESTATUS[0]}}\"",
            haltctl_bin()?.display(),
            ledger.display()
        );
        let out = Command::new("bash").args(["-c", &script]).output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        let status = String::from_utf8_lossy(&out.stdout);
        ensure!(
            status.trim() == "0" && err.is_empty(),
            "haltctl ledger show {json} | head: exit {status}, stderr {err}"
        );
    }
    Ok(())
}

/// The head file haltd keeps for its ledger in `state_dir`.
fn head_file(state_dir: &Path) -> Result<PathBuf> {
    fs::read_dir(state_dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "head"))
        .context("no head file")
}

/// `haltctl ledger verify` with `args`: its exit code and what it said.
fn verify(args: &[&str]) -> Result<(i32, String)> {
    let out = Command::new(haltctl_bin()?)
        .args(["ledger", "verify"])
        .args(args)
        .env_remove("HALTD_STATE_DIR")
        .output()?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("verify {args:?}: {} {}", out.status, said.trim());
    Ok((out.status.code().unwrap_or(-1), said))
}

#[test]
fn ledger_verify_has_one_exit_code_per_verdict() -> Result<()> {
    let pair = NetPair::new()?;
    let mut haltd = Haltd::start(&pair, &TEST_SAMPLING)?;
    one_turn(&haltd, &pair.cli)?;
    one_turn(&haltd, &pair.cli)?;
    haltd.stop()?;
    let first: Value = serde_json::from_str(
        fs::read_to_string(&haltd.ledger)?
            .lines()
            .next()
            .context("empty ledger")?,
    )?;
    ensure!(
        first["ledger_key_id"].as_str().map(str::len) == Some(16),
        "{first}"
    );
    let state = haltd.state_dir.display().to_string();
    let ledger = haltd.ledger.display().to_string();

    // 0: intact, its end matches its head.
    let (code, said) = verify(&["--state-dir", &state, &ledger])?;
    ensure!(code == 0 && said.contains("matches its head"), "{said}");

    // 4: a copy cut short, without its head: the end cannot be checked...
    let dir = temp_dir("haltctl-verify")?;
    let text = fs::read_to_string(&haltd.ledger)?;
    let lines: Vec<&str> = text.lines().collect();
    ensure!(lines.len() >= 4, "{} records", lines.len());
    let cut = dir.join("cut.jsonl");
    fs::write(&cut, format!("{}\n", lines[..lines.len() - 1].join("\n")))?;
    let cut_s = cut.display().to_string();
    let (code, said) = verify(&["--state-dir", &state, &cut_s])?;
    ensure!(code == 4 && said.contains("--no-end-check"), "{said}");
    // ... accepted with --no-end-check, and caught against the original's head.
    let (code, _) = verify(&["--state-dir", &state, "--no-end-check", &cut_s])?;
    ensure!(code == 0, "--no-end-check: {code}");
    let head = head_file(&haltd.state_dir)?.display().to_string();
    let (code, said) = verify(&["--state-dir", &state, "--head", &head, &cut_s])?;
    ensure!(code == 1, "a cut copy against its head: {code} {said}");

    // 1: a changed record.
    let tampered = dir.join("tampered.jsonl");
    fs::write(&tampered, text.replacen("\"turn\"", "\"incident\"", 1))?;
    let (code, _) = verify(&["--state-dir", &state, &tampered.display().to_string()])?;
    ensure!(code == 1, "tampered: {code}");

    // 3: another state directory's key, on an intact ledger: a mismatch, not tampering.
    let other = dir.join("other-state");
    fs::create_dir_all(&other)?;
    fs::set_permissions(&other, fs::Permissions::from_mode(0o700))?;
    let key = other.join(haltd::ledger::KEY_FILE);
    fs::write(&key, format!("{}\n", "ab".repeat(32)))?;
    fs::set_permissions(&key, fs::Permissions::from_mode(0o600))?;
    let (code, said) = verify(&["--state-dir", &other.display().to_string(), &ledger])?;
    ensure!(
        code == 3 && said.contains("not a broken chain") && !said.contains("BROKEN"),
        "{said}"
    );

    // 2: no key at all.
    let empty = dir.join("empty-state");
    fs::create_dir_all(&empty)?;
    let (code, _) = verify(&["--state-dir", &empty.display().to_string(), &ledger])?;
    ensure!(code == 2, "no key: {code}");
    Ok(())
}
