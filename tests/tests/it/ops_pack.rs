//! Root-only checks of the operations pack in `deploy/`: the example config starts a real
//! haltd, the Prometheus files pass `promtool` (Debian's `prometheus` package, installed by
//! `cargo xtask setup`), the alert unit tests pass, a live haltd's `/metrics` passes
//! `promtool check metrics`, and every haltd metric the alerts and the dashboard use exists in
//! a live exposition, and a real Prometheus server scrapes haltd and answers queries on its
//! halt metrics.
//!
//! Run serially (`--test-threads=1`), like the other topics.

mod dashboard;

use std::{
    collections::BTreeSet,
    fs,
    io::Write,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use haltd_tests::{
    agent, in_netns, require_root, sse, temp_dir, trip_here, verify_ledger, Haltd, NetPair,
    StreamOutcome, PORT_METRICS,
};
use serde_json::Value;

const PROMTOOL: &str = "/usr/bin/promtool";
const PROMETHEUS: &str = "/usr/bin/prometheus";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

fn deploy(rel: &str) -> PathBuf {
    repo().join("deploy").join(rel)
}

fn promtool() -> Result<&'static str> {
    ensure!(
        Path::new(PROMTOOL).exists(),
        "{PROMTOOL} missing: run `cargo xtask setup` (Debian package prometheus)"
    );
    Ok(PROMTOOL)
}

/// Runs promtool with `args`; fails with its output unless it exits 0.
fn promtool_ok(args: &[&str]) -> Result<String> {
    let out = Command::new(promtool()?)
        .args(args)
        .current_dir(repo())
        .output()
        .context("running promtool")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        out.status.success(),
        "promtool {args:?} failed ({}):\n{text}",
        out.status
    );
    Ok(text)
}

/// `promtool check metrics` on `text` (stdin); returns (exit code, output).
fn promtool_check_metrics(text: &str) -> Result<(i32, String)> {
    let mut child = Command::new(promtool()?)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running promtool check metrics")?;
    child
        .stdin
        .take()
        .context("promtool stdin")?
        .write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    Ok((
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    ))
}

/// `(table, key)` of every `key = value` line of a TOML text (comments and continuation lines
/// of arrays skipped): enough to compare two files written in the same flat style.
fn toml_keys(text: &str) -> BTreeSet<(String, String)> {
    let mut table = String::new();
    let mut keys = BTreeSet::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or_default().trim();
        if let Some(t) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            table = t.to_owned();
        } else if let Some((k, _)) = line.split_once('=') {
            let k = k.trim();
            if !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                keys.insert((table.clone(), k.to_owned()));
            }
        }
    }
    keys
}

/// Streams one turn of `max_tokens` tokens from the client namespace; `trip_at` > 0 trips it
/// through the admin API once that many tokens arrived.
fn turn(haltd: &Haltd, max_tokens: u32, trip_at: usize) -> Result<StreamOutcome> {
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    let admin = haltd.admin_url();
    in_netns(&haltd.client_ns, move || {
        let body = sse::chat_body("ops pack", max_tokens, true);
        let mut tripped = false;
        sse::stream(&url, &body, Duration::from_secs(30), |p, _| {
            if trip_at > 0 && !tripped && p.tokens >= trip_at {
                tripped = true;
                let trip = format!("{admin}/admin/streams/{}/trip", p.stream_id);
                if let Err(e) = trip_here(&trip, Some("OPERATOR_TRIP")) {
                    eprintln!("trip failed: {e:#}");
                }
            }
        })
    })
}

/// The raw `/metrics` text, fetched from the client namespace.
fn metrics_text(haltd: &Haltd) -> Result<String> {
    let url = format!("http://{}/metrics", haltd.metrics);
    in_netns(&haltd.client_ns, move || -> Result<String> {
        let mut resp = agent(Duration::from_secs(10))
            .get(&url)
            .call()
            .with_context(|| format!("GET {url}"))?;
        ensure!(resp.status() == 200, "GET {url}: {}", resp.status());
        Ok(resp.body_mut().read_to_string()?)
    })
}

/// Sample names of an exposition (`haltd_halts_total`, `haltd_halt_latency_seconds_bucket`).
fn sample_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

/// OpenMetrics text (what prometheus-client writes) to Prometheus text 0.0.4, for promtool:
/// an OpenMetrics counter family `foo` has samples `foo_total`, while the 0.0.4 format names the
/// family after the sample, so `# HELP foo` / `# TYPE foo counter` become `# HELP foo_total` /
/// `# TYPE foo_total counter`. Nothing else changes (`# EOF` and `# UNIT` are comments there).
fn openmetrics_to_text(text: &str) -> String {
    let counters: BTreeSet<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::new();
    for line in text.lines() {
        let mut parts = line.splitn(4, ' ');
        let (hash, kind, name) = (parts.next(), parts.next(), parts.next());
        match (hash, kind, name) {
            (Some("#"), Some(k @ ("HELP" | "TYPE" | "UNIT")), Some(n)) if counters.contains(n) => {
                out.push_str(&format!("# {k} {n}_total"));
                if let Some(rest) = parts.next() {
                    out.push(' ');
                    out.push_str(rest);
                }
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// `deploy/haltd.toml` starts a real haltd (kernel gate enforcing), a turn runs under it, and
/// the detectors it configures are the ones that ran. It also holds every key of the full
/// example in docs/detectors.md.
#[test]
fn example_config_serves() -> Result<()> {
    require_root()?;
    let config = deploy("haltd.toml");
    let deploy_keys = toml_keys(&fs::read_to_string(&config)?);
    let docs = fs::read_to_string(repo().join("docs/detectors.md"))?;
    let example = docs
        .split("### Full example")
        .nth(1)
        .and_then(|s| s.split("```toml").nth(1))
        .and_then(|s| s.split("```").next())
        .context("docs/detectors.md has no full example")?;
    let missing: Vec<_> = toml_keys(example)
        .difference(&deploy_keys)
        .cloned()
        .collect();
    ensure!(
        missing.is_empty(),
        "deploy/haltd.toml lacks keys of the docs example: {missing:?}"
    );

    let pair = NetPair::new()?;
    let config = config.to_string_lossy().into_owned();
    let haltd = Haltd::start(&pair, &["--config", &config])?;
    let out = turn(&haltd, 8, 0)?;
    ensure!(
        out.status == 200 && out.tokens == 8 && out.finish_reason.as_deref() == Some("length"),
        "turn under deploy/haltd.toml: {out:?}"
    );
    // The turn's record is written as its connection closes, just after the client saw the
    // end: wait for it.
    let mut turn_rec = None;
    for _ in 0..250 {
        turn_rec = haltd
            .ledger_records()?
            .into_iter()
            .rev()
            .find(|r| r["kind"] == "turn");
        if turn_rec.is_some() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let turn_rec = &turn_rec.context("no turn record")?;
    let refs: BTreeSet<&str> = turn_rec["detector_refs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    for want in [
        "surprise:observe",
        "compute_budget:hard",
        "latency_anomaly:observe",
        "exfil:hard",
    ] {
        ensure!(refs.contains(want), "detector_refs {refs:?} lacks {want}");
    }
    Ok(())
}

/// The alert rules pass `promtool check rules` and their unit tests (`promtool test rules`).
#[test]
fn promtool_checks_rules() -> Result<()> {
    require_root()?;
    let out = promtool_ok(&["check", "rules", "deploy/prometheus/alerts.yml"])?;
    ensure!(out.contains("SUCCESS"), "promtool check rules: {out}");
    let out = promtool_ok(&["test", "rules", "deploy/prometheus/alerts_test.yml"])?;
    ensure!(out.contains("SUCCESS"), "promtool test rules: {out}");
    // The halt SLO series under spec 000 §5's names (recording rules) and their unit tests.
    let out = promtool_ok(&["check", "rules", "deploy/prometheus/recording.yml"])?;
    ensure!(
        out.contains("SUCCESS: 3 rules"),
        "promtool check rules: {out}"
    );
    let out = promtool_ok(&["test", "rules", "deploy/prometheus/recording_test.yml"])?;
    ensure!(out.contains("SUCCESS"), "promtool test rules: {out}");
    Ok(())
}

/// The scrape config (with its rule file) passes `promtool check config`.
#[test]
fn promtool_checks_config() -> Result<()> {
    require_root()?;
    let out = promtool_ok(&["check", "config", "deploy/prometheus/prometheus.yml"])?;
    ensure!(
        out.contains("SUCCESS") && out.contains("alerts.yml") && out.contains("recording.yml"),
        "promtool check config did not check the rule file: {out}"
    );
    Ok(())
}

/// A finished turn, a detector trip, an operator trip and an error answer, so that the
/// histograms, the detector families and `haltd_requests_rejected_total` have samples.
fn run_sample_turns(haltd: &Haltd) -> Result<()> {
    let short = turn(haltd, 3, 0)?;
    ensure!(
        short.status == 200 && short.tokens == 3,
        "short turn: {short:?}"
    );
    let budget = turn(haltd, 20, 0)?;
    ensure!(
        budget.error.is_some() || budget.finish_reason.is_none(),
        "a 20-token turn under max_tokens = 4 was not halted: {budget:?}"
    );
    let tripped = turn(haltd, 200, 2)?;
    ensure!(
        tripped.tokens < 200,
        "the operator trip did not halt the turn: {tripped:?}"
    );
    // An error answer, so `haltd_requests_rejected_total` has a series.
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    let status = in_netns(&haltd.client_ns, move || -> Result<u16> {
        let mut body = sse::chat_body("ops pack", 3, false);
        body["model"] = Value::from("no-such-model");
        Ok(sse::post(&url, &body, Duration::from_secs(10))?.0)
    })?;
    ensure!(status == 404, "unknown model answered {status}");
    Ok(())
}

/// `promtool check metrics` on the exposition: unconverted, its only complaints are counters'
/// `_total` samples without HELP of their own; converted to text 0.0.4, none.
fn check_promtool(text: &str) -> Result<()> {
    let counters: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .map(|n| format!("{n}_total"))
        .collect();
    let (code, raw) = promtool_check_metrics(text)?;
    ensure!(
        code == 0 || code == 3,
        "promtool check metrics ({code}):\n{raw}"
    );
    for line in raw.lines().filter(|l| !l.trim().is_empty()) {
        let ok = line
            .strip_suffix(" no help text")
            .is_some_and(|n| counters.contains(n));
        ensure!(
            ok,
            "unexpected promtool complaint on raw /metrics: {line:?}\n{raw}"
        );
    }
    // Converted to text 0.0.4: clean.
    let (code, out) = promtool_check_metrics(&openmetrics_to_text(text))?;
    ensure!(
        code == 0 && out.trim().is_empty(),
        "promtool check metrics ({code}):\n{out}"
    );

    Ok(())
}

/// Every (file, `haltd_*` name) the alert rules, their tests and the dashboard use.
fn metrics_used_by_the_pack() -> Result<BTreeSet<(&'static str, String)>> {
    let mut used = BTreeSet::new();
    for file in [
        "prometheus/alerts.yml",
        "prometheus/alerts_test.yml",
        "prometheus/recording.yml",
        "prometheus/recording_test.yml",
        "grafana/haltd-timing-and-halt.json",
    ] {
        let body = fs::read_to_string(deploy(file))?;
        let mut rest = body.as_str();
        while let Some(at) = rest.find("haltd_") {
            let tail = &rest[at..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            used.insert((file, tail[..end].to_owned()));
            rest = &tail[end..];
        }
    }
    Ok(used)
}

/// A live haltd's `/metrics`, after a finished turn, an operator trip, a detector trip and an
/// observe-mode finding (so the histograms and the detector families have samples), passes
/// `promtool check metrics` once converted from OpenMetrics to text 0.0.4
/// ([`openmetrics_to_text`]); unconverted, promtool's only complaints are the
/// "no help text" lints of the counters' `_total` samples. Every haltd metric the alert rules
/// and the dashboard name is in the exposition.
#[test]
fn live_metrics_pass_promtool_and_cover_the_pack() -> Result<()> {
    require_root()?;
    let dir = temp_dir("ops-pack")?;
    let config = dir.join("haltd.toml");
    fs::write(
        &config,
        "[detectors.compute_budget]\nmode = \"hard\"\nmax_tokens = 4\n\n\
         [detectors.surprise]\nmode = \"observe\"\nwindow = 1\nmin_tokens = 1\nthreshold_bits = 0.0\n",
    )?;
    let pair = NetPair::new()?;
    let config_arg = config.to_string_lossy().into_owned();
    let haltd = Haltd::start(
        &pair,
        &[
            "--config",
            &config_arg,
            "--builtin-token-interval-us",
            "50000",
        ],
    )?;
    run_sample_turns(&haltd)?;
    // Halts are counted when they complete; give the last one a moment.
    std::thread::sleep(Duration::from_millis(300));

    let text = metrics_text(&haltd)?;
    ensure!(
        text.trim_end().ends_with("# EOF"),
        "not OpenMetrics text (no # EOF):\n{text}"
    );
    let names = sample_names(&text);
    for want in [
        "haltd_detector_trips_total",
        "haltd_detector_observed_total",
        "haltd_halt_tokens_post_trip_bucket",
    ] {
        ensure!(names.contains(want), "{want} not in /metrics:\n{text}");
    }

    check_promtool(&text)?;

    // Every haltd metric the pack uses exists.
    let used = metrics_used_by_the_pack()?;
    let unknown: Vec<_> = used
        .iter()
        .filter(|(_, n)| !names.contains(n.as_str()))
        .collect();
    ensure!(
        unknown.is_empty(),
        "metrics used in deploy/ but not served by haltd: {unknown:?}"
    );
    let _ = fs::remove_dir_all(&dir);
    Ok(())
}

/// A Prometheus server run by a test; drop kills it and removes its directory.
struct Prometheus {
    child: Child,
    dir: PathBuf,
}

impl Prometheus {
    /// Prometheus in the client namespace of `pair`, scraping haltd's metrics port there
    /// every second (job `haltd`), its API on 127.0.0.1:9090.
    fn start(pair: &NetPair) -> Result<Self> {
        let dir = temp_dir("prometheus")?;
        let config = dir.join("prometheus.yml");
        fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: haltd\n    static_configs:\n      \
                 - targets: [\"{}\"]\n",
                pair.srv_addr(PORT_METRICS)
            ),
        )?;
        let log = fs::File::create(dir.join("prometheus.log"))?;
        let child = Command::new("ip")
            .args(["netns", "exec", &pair.cli, PROMETHEUS])
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg("--web.listen-address=127.0.0.1:9090")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("spawning prometheus")?;
        Ok(Prometheus { child, dir })
    }

    fn log_tail(&self, n: usize) -> String {
        let log = fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// `GET /api/v1/<path>` on the Prometheus in `ns`, as JSON.
fn prom_get(ns: &str, path: &str, query: Option<&str>) -> Result<Value> {
    let url = format!("http://127.0.0.1:9090/api/v1/{path}");
    in_netns(ns, move || -> Result<Value> {
        let mut req = agent(Duration::from_secs(5)).get(&url);
        if let Some(q) = query {
            req = req.query("query", q);
        }
        let mut resp = req.call().with_context(|| format!("GET {url}"))?;
        let status = resp.status();
        let body = resp.body_mut().read_to_string()?;
        ensure!(status == 200, "GET {url} ({query:?}): {status}: {body}");
        serde_json::from_str(&body).with_context(|| format!("GET {url}: not JSON: {body}"))
    })
}

/// The values of an instant query's result vector.
fn prom_values(ns: &str, query: &str) -> Result<Vec<f64>> {
    let v = prom_get(ns, "query", Some(query))?;
    ensure!(v["status"] == "success", "query {query}: {v}");
    let result = v["data"]["result"]
        .as_array()
        .with_context(|| format!("query {query}: no result vector: {v}"))?;
    result
        .iter()
        .map(|r| {
            r["value"][1]
                .as_str()
                .and_then(|x| x.parse::<f64>().ok())
                .with_context(|| format!("query {query}: bad sample {r}"))
        })
        .collect()
}

/// A real Prometheus server (Debian's 2.42) in the client namespace scrapes a live haltd every
/// second; an operator trip's counter and the post-trip token histogram come back through its
/// HTTP API, and the haltd target is up.
#[test]
fn a_real_prometheus_scrapes_haltd() -> Result<()> {
    require_root()?;
    ensure!(
        Path::new(PROMETHEUS).is_file(),
        "{PROMETHEUS} is missing: run `cargo xtask setup` (Debian package `prometheus`)"
    );
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &[])?;
    let tripped = turn(&haltd, 200, 2)?;
    ensure!(
        tripped.tokens < 200,
        "the operator trip did not halt the turn: {tripped:?}"
    );

    let prom = Prometheus::start(&pair)?;

    let trips = r#"haltd_watchdog_trips_total{cause="OPERATOR_TRIP"}"#;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let last = match prom_values(&pair.cli, trips) {
            Ok(v) if v.iter().any(|&x| x >= 1.0) => break,
            Ok(v) => format!("{trips} = {v:?}"),
            Err(e) => format!("{e:#}"),
        };
        if Instant::now() > deadline {
            let targets = prom_get(&pair.cli, "targets", None)
                .map(|v| v.to_string())
                .unwrap_or_else(|e| format!("{e:#}"));
            anyhow::bail!(
                "Prometheus did not see {trips} >= 1 in 30 s; last: {last}\n\
                 targets: {targets}\nprometheus log:\n{}\nhaltd log:\n{}",
                prom.log_tail(30),
                haltd.log_tail(30)
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }

    let up = prom_values(&pair.cli, r#"up{job="haltd"}"#)?;
    ensure!(up == [1.0], "up{{job=\"haltd\"}} = {up:?}");
    let post = prom_values(&pair.cli, "haltd_halt_tokens_post_trip_count")?;
    ensure!(
        post.iter().any(|&x| x >= 1.0),
        "haltd_halt_tokens_post_trip_count = {post:?}"
    );
    drop(prom);
    Ok(())
}

/// A word of every prompt of the sampling test, which no record may contain.
const SAMPLING_PROMPT: &str = "Tell me about the quokkasampling rivers";

/// Runs `normal` short turns (3 tokens) and `tripped` long ones tripped by the operator after
/// 2 tokens, interleaved, one after the other; returns each outcome with whether it was
/// tripped.
fn sampling_turns(
    haltd: &Haltd,
    normal: usize,
    tripped: usize,
) -> Result<Vec<(StreamOutcome, bool)>> {
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    let admin = haltd.admin_url();
    let total = normal + tripped;
    let every = total / tripped.max(1);
    in_netns(&haltd.client_ns, move || {
        let mut out = Vec::with_capacity(total);
        let mut left = tripped;
        for i in 0..total {
            let trip = left > 0 && (i % every == every - 1 || total - i == left);
            let body = sse::chat_body(SAMPLING_PROMPT, if trip { 400 } else { 3 }, true);
            let mut sent = false;
            let o = sse::stream(&url, &body, Duration::from_secs(30), |p, _| {
                if trip && !sent && p.tokens >= 2 {
                    sent = true;
                    let at = format!("{admin}/admin/streams/{}/trip", p.stream_id);
                    if let Err(e) = trip_here(&at, Some("OPERATOR_TRIP")) {
                        eprintln!("trip failed: {e:#}");
                    }
                }
            })?;
            if trip {
                left -= 1;
                o.halted_cleanly("OPERATOR_TRIP")
                    .with_context(|| format!("tripped turn {i}: {o:?}"))?;
            } else {
                ensure!(
                    o.status == 200
                        && o.tokens == 3
                        && o.finish_reason.as_deref() == Some("length"),
                    "normal turn {i}: {o:?}"
                );
            }
            out.push((o, trip));
        }
        Ok(out)
    })
}

/// `haltd_turn_records_total` by decision, once it counts `total` turns (records are written,
/// and counted, as the connections close, just after the clients saw the end).
fn turn_record_counts(haltd: &Haltd, total: usize) -> Result<[f64; 3]> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = haltd.metrics()?;
        let mut counts = [0.0; 3];
        for (c, decision) in counts.iter_mut().zip(["always", "sampled", "skipped"]) {
            *c = m.value("haltd_turn_records_total", &[("decision", decision)])?;
        }
        if counts.iter().sum::<f64>() >= total as f64 || Instant::now() > deadline {
            return Ok(counts);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The ledger once it holds `turns` turn records (the writer thread may still be behind).
fn ledger_with_turns(haltd: &Haltd, turns: usize) -> Result<Vec<Value>> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let records = haltd.ledger_records()?;
        let n = records.iter().filter(|r| r["kind"] == "turn").count();
        if n >= turns || Instant::now() > deadline {
            return Ok(records);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Every string in a JSON value (keys included).
fn strings(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::String(s) => out.push(s.clone()),
        Value::Array(a) => a.iter().for_each(|x| strings(x, out)),
        Value::Object(o) => {
            for (k, x) in o {
                out.push(k.clone());
                strings(x, out);
            }
        }
        _ => {}
    }
}

/// Normal turns of `sampling_keeps_every_incident_and_a_fraction_of_normal_turns`.
const NORMAL: usize = 400;
/// Its tripped turns.
const TRIPPED: usize = 20;
/// Its sampling rate of normal turns (`--turn-sample-rate`).
const RATE: f64 = 0.05;

/// At rate RATE: every tripped turn has its incident and turn record, normal turns are
/// recorded at about the rate, each saying so, and the metric agrees. Returns the ledger.
fn check_rate_sampling(haltd: &Haltd, outcomes: &[(StreamOutcome, bool)]) -> Result<Vec<Value>> {
    let [always, sampled, skipped] = turn_record_counts(haltd, NORMAL + TRIPPED)?;
    ensure!(
        always + sampled + skipped == (NORMAL + TRIPPED) as f64,
        "haltd_turn_records_total: always {always} + sampled {sampled} + skipped {skipped} != {} turns",
        NORMAL + TRIPPED
    );
    let records = ledger_with_turns(haltd, (always + sampled) as usize)?;
    let turns: Vec<&Value> = records.iter().filter(|r| r["kind"] == "turn").collect();
    let reasons: Vec<(&Value, &Value)> = turns
        .iter()
        .filter(|r| !r["sampling"]["reason"].is_null())
        .map(|r| (&r["stream_id"], &r["sampling"]["reason"]))
        .collect();
    ensure!(
        always == TRIPPED as f64 && reasons.len() == TRIPPED,
        "always-recorded turns: metric {always}, records {reasons:?} (expected the {TRIPPED} tripped ones)"
    );
    for (o, _) in outcomes.iter().filter(|(_, trip)| *trip) {
        let id = o.stream_id.as_str();
        let turn = turns
            .iter()
            .find(|r| r["stream_id"] == id)
            .with_context(|| format!("no turn record for tripped {id}"))?;
        ensure!(
            turn["sampling"] == serde_json::json!({"rate": 1.0, "reason": "incident"})
                && turn["trip_cause"] == "OPERATOR_TRIP",
            "{turn}"
        );
        ensure!(
            records
                .iter()
                .any(|r| r["kind"] == "incident" && r["stream_id"] == id),
            "no incident record for tripped {id}"
        );
    }
    let normal_records: Vec<&&Value> = turns
        .iter()
        .filter(|r| r["sampling"]["reason"].is_null())
        .collect();
    ensure!(
        normal_records.len() as f64 == sampled,
        "{} sampled turn records, haltd_turn_records_total{{decision=\"sampled\"}} {sampled}",
        normal_records.len()
    );
    for r in &normal_records {
        ensure!(
            r["sampling"] == serde_json::json!({"rate": RATE})
                && r["outcome"] == "completed"
                && r["text"].is_null(),
            "{r}"
        );
    }
    eprintln!(
        "sampling: {sampled} of {NORMAL} normal turns recorded at rate {RATE}, {always} always"
    );
    // Binomial(400, 0.05): mean 20, sd 4.36; 4 sd either side, and at least one.
    let (mean, sd) = (
        NORMAL as f64 * RATE,
        (NORMAL as f64 * RATE * (1.0 - RATE)).sqrt(),
    );
    ensure!(
        sampled > 0.0 && (sampled - mean).abs() <= 4.0 * sd,
        "{sampled} of {NORMAL} normal turns recorded at rate {RATE} (expected {mean} ± {:.1})",
        4.0 * sd
    );
    Ok(records)
}

/// No string of any record holds the prompt or the text of a turn.
fn check_no_text_recorded(records: &[Value], outcomes: &[(StreamOutcome, bool)]) -> Result<()> {
    let mut all = Vec::new();
    records.iter().for_each(|r| strings(r, &mut all));
    ensure!(
        !all.iter().any(|s| s.contains("quokkasampling")),
        "a record holds the prompt"
    );
    let mut checked = 0;
    for (o, _) in outcomes {
        if o.text.trim().len() < 8 {
            continue;
        }
        checked += 1;
        if let Some(s) = all.iter().find(|s| s.contains(o.text.as_str())) {
            anyhow::bail!(
                "a record holds the text {:?} of {}: {s:?}",
                o.text,
                o.stream_id
            );
        }
    }
    ensure!(
        checked > NORMAL / 2,
        "only {checked} turns had text to look for"
    );
    Ok(())
}

/// `--record-token-text --turn-sample-rate 1`: every turn record carries the text the client
/// received.
fn check_every_turn_with_text(pair: &NetPair) -> Result<()> {
    let haltd = Haltd::start(
        pair,
        &[
            "--turn-sample-rate",
            "1",
            "--record-token-text",
            "--builtin-token-interval-us",
            "2000",
        ],
    )?;
    let outcomes = sampling_turns(&haltd, 5, 1)?;
    let [always, sampled, skipped] = turn_record_counts(&haltd, 6)?;
    ensure!(
        (always, sampled, skipped) == (1.0, 5.0, 0.0),
        "haltd_turn_records_total at rate 1: always {always}, sampled {sampled}, skipped {skipped}"
    );
    let records = ledger_with_turns(&haltd, 6)?;
    for (o, trip) in &outcomes {
        let rec = records
            .iter()
            .find(|r| r["kind"] == "turn" && r["stream_id"] == o.stream_id.as_str())
            .with_context(|| format!("no turn record for {}", o.stream_id))?;
        let text = rec["text"]
            .as_str()
            .with_context(|| format!("no text: {rec}"))?;
        ensure!(rec["text_truncated"] == false, "{rec}");
        if *trip {
            // A halted turn may have produced one token the halt kept from the client.
            ensure!(text.starts_with(&o.text), "{text:?} vs {:?}", o.text);
            ensure!(rec["sampling"]["reason"] == "incident", "{rec}");
        } else {
            ensure!(
                text == o.text,
                "record text {text:?}, client got {:?}",
                o.text
            );
            ensure!(rec["sampling"] == serde_json::json!({"rate": 1.0}), "{rec}");
        }
    }
    Ok(())
}

/// Spec 000 §6.2 on a live haltd at the production rate of 5 %: every tripped turn has its
/// incident and turn record; normal turns are recorded at about the rate (binomial, 4 sd),
/// each record saying so; `haltd_turn_records_total` agrees with the ledger; no record holds
/// any turn's text or the prompt. Then `--record-token-text --turn-sample-rate 1`: every turn
/// record carries the text the client received.
#[test]
fn sampling_keeps_every_incident_and_a_fraction_of_normal_turns() -> Result<()> {
    require_root()?;
    let pair = NetPair::new()?;
    let haltd = Haltd::start(
        &pair,
        &[
            "--turn-sample-rate",
            "0.05",
            "--builtin-token-interval-us",
            "2000",
        ],
    )?;
    let outcomes = sampling_turns(&haltd, NORMAL, TRIPPED)?;
    let records = check_rate_sampling(&haltd, &outcomes)?;
    // Privacy: no string of any record holds a turn's text or the prompt.
    check_no_text_recorded(&records, &outcomes)?;
    verify_ledger(&haltd.ledger)?;
    drop(haltd);

    // Every turn, with its text.
    check_every_turn_with_text(&pair)
}

/// One (scenario, B, N) run of the smoke bench: no breach of B, every stream halted and
/// recorded, the kernel holding the adversarial emitter, a latency for every halt.
fn check_smoke_run(r: &Value) -> Result<()> {
    let name = format!("{} B={} N={}", r["scenario"], r["budget"], r["concurrency"]);
    let b = r["budget"].as_u64().context("budget")?;
    ensure!(r["breaches"] == 0, "{name}: breaches {}", r["breaches"]);
    ensure!(
        r["halted"] == r["streams"] && r["failed"] == 0,
        "{name}: {} of {} halted, {} failed",
        r["halted"],
        r["streams"],
        r["failed"]
    );
    let max = r["post_trip_tokens"]["max"]
        .as_f64()
        .context("post-trip max")?;
    ensure!(max <= b as f64, "{name}: post-trip max {max} > B");
    ensure!(
        r["ledger_incidents"].as_u64() >= r["halted"].as_u64(),
        "{name}: {} incident records for {} halts",
        r["ledger_incidents"],
        r["halted"]
    );
    if r["scenario"] == "adversarial" && b == 5 {
        // The emitter ignores the halt: the kernel lets exactly B more frames through.
        ensure!(
            max >= 1.0,
            "{name}: the emitter stopped by itself (post-trip max {max})"
        );
    }
    if r["scenario"] != "watchdog-stall" {
        ensure!(
            r["halt_latency_ms"]["n"] == r["halted"],
            "{name}: halt latencies {} for {} halts",
            r["halt_latency_ms"]["n"],
            r["halted"]
        );
    }
    Ok(())
}

/// The halt SLO bench of `cargo xtask bench`, at smoke scale, so that the harness cannot rot
/// between bench runs: every scenario and budget at 1 and 20 streams, a report with a run per
/// (scenario, B, N), no breach of B, the kernel (not the emitter) holding the adversarial
/// runs, and the summary and both plots written. The numbers themselves are the bench's
/// business, not this test's.
#[test]
fn halt_slo_bench_runs_at_smoke_scale() -> Result<()> {
    require_root()?;
    let out = temp_dir("halt-slo-smoke")?;
    let bench = env!("CARGO_BIN_EXE_bench-halt-slo");
    let t = Instant::now();
    let run = Command::new(bench)
        .args([
            "--quick",
            "--streams",
            "1,20",
            "--min-trips",
            "20",
            "--k-max",
            "8",
            "--out-dir",
        ])
        .arg(&out)
        .output()
        .with_context(|| format!("running {bench}"))?;
    let stderr = String::from_utf8_lossy(&run.stderr);
    ensure!(
        run.status.success(),
        "bench-halt-slo --quick failed ({}):\n{}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stdout),
        stderr
    );
    println!(
        "bench-halt-slo --quick took {:.1} s",
        t.elapsed().as_secs_f64()
    );
    ensure!(
        stderr.contains("[halt-slo] [12/12]"),
        "no progress lines for 12 runs on stderr:\n{stderr}"
    );
    let report: Value = serde_json::from_str(&fs::read_to_string(out.join("halt-slo.json"))?)?;
    let runs = report["runs"].as_array().context("report has no runs")?;
    ensure!(
        runs.len() == 12,
        "{} runs, expected 3 scenarios × 2 budgets × 2 counts",
        runs.len()
    );
    ensure!(
        report["problems"].as_array().is_some_and(Vec::is_empty),
        "problems: {}",
        report["problems"]
    );
    for r in runs {
        check_smoke_run(r)?;
    }
    let md = fs::read_to_string(out.join("halt-slo.md"))?;
    ensure!(
        md.contains("| scenario | B | N |"),
        "summary without its table:\n{md}"
    );
    for svg in ["post-trip-tokens.svg", "halt-latency.svg"] {
        let text = fs::read_to_string(out.join(svg)).with_context(|| svg.to_owned())?;
        ensure!(
            text.contains("<svg") && text.contains("</svg>") && text.len() > 2000,
            "{svg} is not a drawn SVG ({} bytes)",
            text.len()
        );
    }
    fs::remove_dir_all(&out).ok();
    Ok(())
}

/// The systemd units of `deploy/` (`haltd.service`, and the template `haltd@.service` as its
/// instance `haltd@blue.service`) load in systemd's own parser without a single warning
/// (`systemd-analyze verify`, with ExecStart pointed at the haltd under test, since verify
/// checks that the binary exists), and their hardening keeps systemd's exposure score in the
/// "OK" band (`systemd-analyze security --offline=yes`, at most 3.0 of 10).
#[test]
fn systemd_unit_verifies_and_is_hardened() -> Result<()> {
    require_root()?;
    check_unit("systemd/haltd.service", "haltd.service")?;
    let template = check_unit("systemd/haltd@.service", "haltd@blue.service")?;
    ensure!(
        template.contains("--take-over") && template.contains("RuntimeDirectoryPreserve=yes"),
        "the template unit no longer takes over, or lets a stopping instance remove the shared admin socket"
    );
    Ok(())
}

/// Verifies the unit file `file` of `deploy/`, installed as `name`; returns its text.
fn check_unit(file: &str, name: &str) -> Result<String> {
    let analyze = "/usr/bin/systemd-analyze";
    ensure!(
        Path::new(analyze).exists(),
        "{analyze} is missing: `cargo xtask setup` installs Debian's systemd package"
    );
    let haltd = haltd_tests::haltd_bin()?;
    let unit = fs::read_to_string(deploy(file))?;
    ensure!(
        unit.contains("ExecStart=/usr/local/bin/haltd serve"),
        "{file} no longer starts /usr/local/bin/haltd serve"
    );
    let dir = temp_dir("systemd-unit")?;
    let path = dir.join(name);
    fs::write(
        &path,
        unit.replace("/usr/local/bin/haltd", &haltd.display().to_string()),
    )?;
    let out = Command::new(analyze)
        .arg("verify")
        .arg(&path)
        .output()
        .context("running systemd-analyze verify")?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        out.status.success() && said.trim().is_empty(),
        "systemd-analyze verify {name} ({}):\n{said}",
        out.status
    );
    let score = exposure(analyze, &path, name)?;
    println!("systemd-analyze security {name}: overall exposure {score} of 10");
    ensure!(
        score <= 3.0,
        "{name}: exposure {score} is above 3.0 (systemd's OK band); the hardening options slipped"
    );
    fs::remove_dir_all(&dir).ok();
    Ok(unit)
}

/// `systemd-analyze security --offline=yes`'s overall exposure of the unit at `path`.
fn exposure(analyze: &str, path: &Path, name: &str) -> Result<f64> {
    let out = Command::new(analyze)
        .args(["security", "--offline=yes", "--no-pager"])
        .arg(path)
        .output()
        .context("running systemd-analyze security")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let prefix = format!("Overall exposure level for {name}: ");
    text.lines()
        .find_map(|l| l.split(prefix.as_str()).nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .with_context(|| {
            format!(
                "no exposure level in:\n{text}{}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
}
