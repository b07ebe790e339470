//! What a haltd binary says it is: the production build (what `cargo xtask build --release`
//! and `cargo xtask run` give) refuses `--fault`, and a test build (`fault-injection`, what
//! these tests run) says so at start, in the ready line, in the start record and on
//! `/metrics`. Both name their commit and features in `--version`.

use std::{path::Path, process::Command, time::Duration};

use anyhow::{ensure, Context, Result};
use haltd_tests::{
    daemon::production_haltd_bin, haltd_bin, require_root, wait_for, Haltd, NetPair,
};

/// `haltd --version`'s one line.
fn version_of(bin: &Path) -> Result<String> {
    let out = Command::new(bin)
        .arg("--version")
        .output()
        .with_context(|| format!("running {} --version", bin.display()))?;
    ensure!(out.status.success(), "{} --version: {out:?}", bin.display());
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

/// The commit in `haltd 0.1.0 (commit C, features: F)`, checked for shape.
fn commit_in(version: &str) -> Result<&str> {
    let commit = version
        .split("(commit ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .with_context(|| format!("no commit in {version:?}"))?;
    ensure!(
        commit.len() == 12 && commit.bytes().all(|b| b.is_ascii_hexdigit()),
        "the commit in {version:?} is not 12 hex digits (this test runs in a git checkout)"
    );
    Ok(commit)
}

#[test]
fn production_build_refuses_faults() -> Result<()> {
    let bin = production_haltd_bin()?;
    let version = version_of(&bin)?;
    ensure!(
        version.starts_with("haltd ") && version.ends_with(", features: none)"),
        "{version}"
    );
    commit_in(&version)?;
    let out = Command::new(&bin)
        .args(["serve", "--fault", "emitter-ignores-halt"])
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(2) && stderr.contains("this build has no fault injection"),
        "a production haltd given --fault: {:?}, stderr: {stderr}",
        out.status
    );
    Ok(())
}

#[test]
fn a_test_build_says_so() -> Result<()> {
    require_root()?;
    let version = version_of(&haltd_bin()?)?;
    ensure!(
        version.ends_with(", features: fault-injection)"),
        "{version}"
    );
    let commit = commit_in(&version)?;
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &[])?;
    // `Haltd::start` returns once `/healthz` answers, which can be just before the ready line
    // is printed: wait for the line.
    let ready = wait_for(Duration::from_secs(5), "the ready line", || {
        Ok(haltd
            .log_tail(100)
            .lines()
            .find(|l| l.starts_with("haltd ready"))
            .map(str::to_owned))
    })
    .with_context(|| format!("no ready line:\n{}", haltd.log_tail(100)))?;
    let log = haltd.log_tail(100);
    ensure!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("TEST build with fault injection")),
        "no WARN line at start:\n{log}"
    );
    ensure!(
        ready.ends_with(&format!(" commit={commit} features=fault-injection")),
        "{ready}"
    );
    let start = haltd.wait_record("the start record", |r| r["kind"] == "lifecycle")?;
    let message = start["message"].as_str().unwrap_or_default();
    ensure!(
        message.contains(&format!(
            "(commit {commit}, features: fault-injection) started"
        )),
        "{message}"
    );
    let metrics = haltd.metrics()?;
    let info = metrics.value(
        "haltd_build_info",
        &[("commit", commit), ("features", "fault-injection")],
    )?;
    ensure!(info == 1.0, "haltd_build_info = {info}");
    Ok(())
}
