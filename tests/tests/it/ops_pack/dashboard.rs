//! Every query of the Grafana dashboard (`deploy/grafana/haltd-timing-and-halt.json`) returns
//! data from a real Prometheus that scraped haltd through a scripted run: every target of
//! every panel, read from the file, so a panel added later is covered on arrival.
//!
//! "Data" is what Grafana draws: over the run's range, at the dashboard's resolution, at least
//! one series with at least one finite point. A target whose metric or labels do not exist
//! returns nothing; a quantile over a histogram that got no observation in its window is NaN
//! at every point. Both fail, naming the panel.
//!
//! The dashboard's variables are substituted as Grafana does for "All": `$job` and `$instance`
//! by the regex alternation of the values their `label_values(...)` queries find in this
//! Prometheus, `$__rate_interval` by Grafana's rule, max(4 × scrape interval, step + scrape
//! interval), with a step of one scrape interval (1 s). Any other `$` in an expression fails.
//!
//! The scripted run, in three haltd configurations scraped by one Prometheus (a restart of
//! haltd is a counter reset, which `rate` and `increase` handle):
//! 1. the compute budget hard at 30 tokens and surprise in intervene mode with a memory
//!    grounder: two finished turns (grounding rounds), one turn over the budget (a detector
//!    trip), one operator trip (post-trip tokens, halt latency, a degraded key) that the operator
//!    labels a false positive (`haltctl incident label`: the TP/FP panels), a request for an
//!    unknown model (a rejected request, a client error);
//! 2. surprise in observe mode at threshold 0: a finished turn with observed findings;
//! 3. the halt monitor scored by an external scorer that is not there: a `DETECTOR_FAILURE`.

use std::{
    collections::BTreeMap,
    fs,
    path::Path,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{bail, ensure, Context, Result};
use haltd_tests::{agent, in_netns, require_root, sse, temp_dir, Haltd, NetPair};
use serde_json::Value;

use super::{deploy, prom_get, turn, Prometheus, PROMETHEUS};

/// The dashboard, from the repository root.
const DASHBOARD: &str = "grafana/haltd-timing-and-halt.json";

/// Prometheus's scrape interval in [`Prometheus::start`], seconds.
const SCRAPE_S: u64 = 1;

/// One query of one panel.
#[derive(Debug)]
struct Target {
    panel: String,
    ref_id: String,
    expr: String,
}

/// Every target of every panel, rows' nested panels included.
fn targets(dashboard: &Value) -> Result<Vec<Target>> {
    fn walk(panels: &[Value], out: &mut Vec<Target>) -> Result<()> {
        for p in panels {
            let title = p["title"].as_str().unwrap_or("(untitled)").to_owned();
            for t in p["targets"].as_array().into_iter().flatten() {
                let expr = t["expr"]
                    .as_str()
                    .with_context(|| format!("panel {title:?}: a target without expr: {t}"))?;
                out.push(Target {
                    panel: title.clone(),
                    ref_id: t["refId"].as_str().unwrap_or("?").to_owned(),
                    expr: expr.to_owned(),
                });
            }
            if let Some(nested) = p["panels"].as_array() {
                walk(nested, out)?;
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(
        dashboard["panels"].as_array().context("no panels")?,
        &mut out,
    )?;
    Ok(out)
}

/// The dashboard's query variables: name → the regex alternation of the values its
/// `label_values(SELECTOR, LABEL)` query finds (Grafana's "All"), in the order they are
/// declared, each substituted into the next ones' selectors.
fn variables(ns: &str, dashboard: &Value) -> Result<BTreeMap<String, String>> {
    let mut vars = BTreeMap::new();
    for v in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let name = v["name"].as_str().context("a variable without a name")?;
        match v["type"].as_str() {
            Some("datasource") => continue,
            Some("query") => {}
            other => bail!("variable {name}: type {other:?} is not substituted by this test"),
        }
        let def = v["definition"]
            .as_str()
            .context("query without definition")?;
        let inner = def
            .strip_prefix("label_values(")
            .and_then(|d| d.strip_suffix(')'))
            .with_context(|| format!("variable {name}: {def} is not label_values(...)"))?;
        let (selector, label) = inner
            .rsplit_once(',')
            .with_context(|| format!("variable {name}: {def}"))?;
        let selector = substitute(selector.trim(), &vars, 0)?;
        let path = format!("label/{}/values", label.trim());
        let values = label_values(ns, &path, &selector)?;
        ensure!(
            !values.is_empty(),
            "variable {name}: {def} found no value in Prometheus"
        );
        let alternation = values
            .iter()
            .map(|x| regex_escape(x))
            .collect::<Vec<_>>()
            .join("|");
        vars.insert(name.to_owned(), format!("({alternation})"));
    }
    Ok(vars)
}

/// `GET /api/v1/label/<label>/values?match[]=<selector>`.
fn label_values(ns: &str, path: &str, selector: &str) -> Result<Vec<String>> {
    let url = format!("http://127.0.0.1:9090/api/v1/{path}");
    let selector = selector.to_owned();
    let v = in_netns(ns, move || -> Result<Value> {
        let mut resp = agent(Duration::from_secs(5))
            .get(&url)
            .query("match[]", &selector)
            .call()
            .with_context(|| format!("GET {url}"))?;
        let body = resp.body_mut().read_to_string()?;
        serde_json::from_str(&body).with_context(|| format!("GET {url}: {body}"))
    })?;
    ensure!(v["status"] == "success", "{path}: {v}");
    Ok(v["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| x.as_str().map(str::to_owned))
        .collect())
}

/// A value as Grafana puts it into a regex matcher of a PromQL query: its regex
/// metacharacters escaped, each backslash doubled for PromQL's double-quoted string.
fn regex_escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            let special = "\\^$.|?*+()[]{}".contains(c);
            let escape = if special { "\\\\" } else { "" };
            escape.chars().chain([c])
        })
        .collect()
}

/// `expr` with the variables and `$__rate_interval` for a step of `step_s` seconds.
fn substitute(expr: &str, vars: &BTreeMap<String, String>, step_s: u64) -> Result<String> {
    let rate_interval = (4 * SCRAPE_S).max(step_s + SCRAPE_S);
    let mut out = expr.replace("$__rate_interval", &format!("{rate_interval}s"));
    // Longest names first, so `$instance` is not taken for `$in...`.
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort_by_key(|n| std::cmp::Reverse(n.len()));
    for name in names {
        let value = &vars[name];
        out = out.replace(&format!("${{{name}}}"), value);
        out = out.replace(&format!("${name}"), value);
    }
    ensure!(
        !out.contains('$'),
        "{expr}: a variable this test does not know"
    );
    Ok(out)
}

/// The largest finite value of any series of a range query, or `None` when there is none.
fn range_max(ns: &str, expr: &str, start: f64, end: f64) -> Result<Option<f64>> {
    let url = "http://127.0.0.1:9090/api/v1/query_range".to_owned();
    let q = expr.to_owned();
    let v = in_netns(ns, move || -> Result<Value> {
        let mut resp = agent(Duration::from_secs(10))
            .get(&url)
            .query("query", &q)
            .query("start", format!("{start:.3}"))
            .query("end", format!("{end:.3}"))
            .query("step", format!("{SCRAPE_S}s"))
            .call()
            .with_context(|| format!("GET {url}"))?;
        let body = resp.body_mut().read_to_string()?;
        serde_json::from_str(&body).with_context(|| format!("GET {url}: {body}"))
    })?;
    ensure!(v["status"] == "success", "query {expr}: {v}");
    let points = v["data"]["result"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|series| series["values"].as_array().into_iter().flatten())
        .filter_map(|p| p[1].as_str().and_then(|x| x.parse::<f64>().ok()))
        .filter(|x| x.is_finite());
    Ok(points.fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x)))))
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// haltd on `pair` with `config`, a 2 ms token interval and degraded mode ended by a 1 s
/// timer (so each round of a phase starts with the key in full mode).
fn start_haltd(pair: &NetPair, config: &str) -> Result<Haltd> {
    let dir = temp_dir("dashboard")?;
    let path = dir.join("haltd.toml");
    fs::write(&path, config)?;
    let path = path.display().to_string();
    Haltd::start(
        pair,
        &[
            "--config",
            &path,
            "--builtin-token-interval-us",
            "2000",
            "--degraded-for-s",
            "1",
        ],
    )
}

/// Waits until Prometheus has scraped haltd (`up` is 1) at least `scrapes` times from now.
fn wait_scraped(ns: &str, scrapes: u64) -> Result<()> {
    std::thread::sleep(Duration::from_secs(scrapes * SCRAPE_S) + Duration::from_millis(200));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v = prom_get(ns, "query", Some(r#"up{job="haltd"}"#))?;
        if v["data"]["result"][0]["value"][1] == "1" {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "haltd not scraped: {v}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// One phase: haltd with `config`, scraped, then `round` twice with scrapes between. Twice,
/// because a series that haltd creates at its first event enters Prometheus with that event
/// already counted, and `rate` sees only what moves between two scrapes.
fn phase(pair: &NetPair, config: &str, round: impl Fn(&Haltd) -> Result<()>) -> Result<()> {
    let haltd = start_haltd(pair, config)?;
    wait_scraped(&pair.cli, 2)?;
    for _ in 0..2 {
        round(&haltd)?;
        wait_scraped(&pair.cli, 3)?;
    }
    Ok(())
}

/// Phase 1's round: grounding, a detector trip, an operator trip and a rejected request.
fn grounding_and_trips(haltd: &Haltd) -> Result<()> {
    for _ in 0..2 {
        let o = turn(haltd, 12, 0)?;
        ensure!(
            o.status == 200 && o.error.is_none(),
            "a finished turn: {o:?}"
        );
    }
    let over = turn(haltd, 60, 0)?;
    ensure!(
        over.error.is_some(),
        "60 tokens under a budget of 30: {over:?}"
    );
    let tripped = turn(haltd, 200, 2)?;
    ensure!(tripped.tokens < 200, "the operator trip: {tripped:?}");
    // The operator labels the incident (the TP/FP panels), once it is recorded.
    let id = tripped.stream_id.as_str();
    haltd.wait_record("the trip's incident", |r| {
        r["kind"] == "incident" && r["stream_id"] == id
    })?;
    let labelled = haltd.haltctl_json(&["incident", "label", id, "fp"])?;
    ensure!(
        labelled["label"] == "fp",
        "haltctl incident label: {labelled}"
    );
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    let status = in_netns(&haltd.client_ns, move || -> Result<u16> {
        let mut body = sse::chat_body("dashboard", 3, false);
        body["model"] = Value::from("no-such-model");
        Ok(sse::post(&url, &body, Duration::from_secs(10))?.0)
    })?;
    ensure!(status == 404, "unknown model answered {status}");
    Ok(())
}

/// The three phases of the scripted run (the module's doc).
fn scripted_run(pair: &NetPair) -> Result<()> {
    let store = temp_dir("dashboard-memory")?;
    fs::write(store.join("notes.md"), "The river runs past the town.\n")?;
    phase(
        pair,
        &format!(
            "[detectors.compute_budget]\nmode = \"hard\"\nmax_tokens = 30\n\n\
             [detectors.surprise]\nmode = \"intervene\"\nwindow = 4\nmin_tokens = 4\n\
             threshold_bits = 0.0\nhold_back = 2\n\n[grounding]\nmax_rounds = 1\n\n\
             [grounding.memory]\ndir = \"{}\"\nfloor = 0.01\n",
            store.display()
        ),
        grounding_and_trips,
    )?;
    let _ = fs::remove_dir_all(&store);
    phase(
        pair,
        "[detectors.surprise]\nmode = \"observe\"\nwindow = 1\nmin_tokens = 1\nthreshold_bits = 0.0\n",
        |haltd| {
            let o = turn(haltd, 6, 0)?;
            ensure!(o.status == 200 && o.error.is_none(), "observe mode: {o:?}");
            Ok(())
        },
    )?;
    let missing = temp_dir("dashboard-scorer")?.join("absent.sock");
    phase(
        pair,
        &format!(
            "[detectors.halt_monitor]\nhard_limit = 0.5\n\
             scorer = {{ unix = \"{}\", deadline_us = 5000 }}\n",
            missing.display()
        ),
        |haltd| {
            let o = turn(haltd, 6, 0)?;
            ensure!(
                o.error.is_some() && o.tokens == 0,
                "an unreachable scorer fails closed: {o:?}"
            );
            Ok(())
        },
    )
}

#[test]
fn every_dashboard_panel_has_data_after_a_scripted_run() -> Result<()> {
    require_root()?;
    ensure!(
        Path::new(PROMETHEUS).is_file(),
        "{PROMETHEUS} is missing: run `cargo xtask setup` (Debian package `prometheus`)"
    );
    let dashboard: Value = serde_json::from_str(&fs::read_to_string(deploy(DASHBOARD))?)?;
    let targets = targets(&dashboard)?;
    ensure!(!targets.is_empty(), "{DASHBOARD} has no targets");
    let pair = NetPair::new()?;
    let prom = Prometheus::start(&pair)?;
    let start = unix_now();
    if let Err(e) = scripted_run(&pair) {
        bail!(
            "the scripted run: {e:#}\nprometheus log:\n{}",
            prom.log_tail(20)
        );
    }
    let end = unix_now();
    let vars = variables(&pair.cli, &dashboard)?;
    let mut empty = Vec::new();
    for t in &targets {
        let expr = substitute(&t.expr, &vars, SCRAPE_S)?;
        let max = range_max(&pair.cli, &expr, start, end)?;
        println!(
            "HALTD_RESULT {}",
            serde_json::json!({"panel": t.panel, "target": t.ref_id, "max": max})
        );
        if max.is_none() {
            empty.push(format!("{:?} target {}: {expr}", t.panel, t.ref_id));
        }
    }
    ensure!(
        empty.is_empty(),
        "dashboard panels with no data over the run ({:.0} s):\n  {}",
        end - start,
        empty.join("\n  ")
    );
    drop(prom);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_are_substituted_and_unknown_ones_refused() -> Result<()> {
        let vars = BTreeMap::from([
            ("job".to_owned(), "(haltd)".to_owned()),
            ("instance".to_owned(), r"(10\\.0\\.0\\.1:9464)".to_owned()),
        ]);
        let e = substitute(
            r#"rate(x{job=~"$job",instance=~"${instance}"}[$__rate_interval])"#,
            &vars,
            1,
        )?;
        assert_eq!(
            e,
            r#"rate(x{job=~"(haltd)",instance=~"(10\\.0\\.0\\.1:9464)"}[4s])"#
        );
        assert_eq!(substitute("x[$__rate_interval]", &vars, 10)?, "x[11s]");
        assert!(substitute("x{a=\"$other\"}", &vars, 1).is_err());
        assert_eq!(regex_escape("10.0.0.1:9464"), r"10\\.0\\.0\\.1:9464");
        Ok(())
    }
}
