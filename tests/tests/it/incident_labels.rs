//! Issue 37 point 5: an operator labels a stream's incident a true or a false positive
//! (`haltctl incident label STREAM_ID tp|fp [--note TEXT]`, docs/operations.md "Labelling
//! incidents"). The label is an `admin` record naming the operator and the incident (its seq
//! and hash); `haltd_incident_labels{detector, route, label}` counts it; a relabel moves the
//! count; an unknown stream is a 404 and a malformed id a 400; the counts survive a restart,
//! and a start without the state store takes them back from the ledger.

use std::{
    fs,
    process::{Command, Output},
    time::Duration,
};

use anyhow::{ensure, Context, Result};
use haltd_tests::{agent, haltctl_bin, in_netns, Haltd, NetPair};
use serde_json::Value;

/// `haltctl ARGS` against `haltd` from its client namespace.
fn haltctl(haltd: &Haltd, args: &[&str]) -> Result<Output> {
    Command::new("ip")
        .args(["netns", "exec", &haltd.client_ns])
        .arg(haltctl_bin()?)
        .arg("--admin")
        .arg(haltd.admin.to_string())
        .arg("--admin-token-file")
        .arg(haltd.admin_token_file())
        .args(args)
        .env_remove("HALTD_CONFIG")
        .output()
        .context("running haltctl")
}

/// The `/metrics` text as haltd serves it (for the transcript the test prints).
fn raw_metrics(haltd: &Haltd) -> Result<String> {
    let url = format!("http://{}/metrics", haltd.metrics);
    in_netns(&haltd.client_ns, move || -> Result<String> {
        let mut resp = agent(Duration::from_secs(10)).get(&url).call()?;
        Ok(resp.body_mut().read_to_string()?)
    })
}

/// The count of incidents tripped by `detector` on the default route labelled `label`.
fn count(haltd: &Haltd, detector: &str, label: &str) -> Result<f64> {
    haltd.metrics()?.value(
        "haltd_incident_labels",
        &[
            ("detector", detector),
            ("route", "default"),
            ("label", label),
        ],
    )
}

/// Labels `id` through haltctl (`--json`); its answer.
fn label(haltd: &Haltd, id: &str, label: &str, note: Option<&str>) -> Result<Value> {
    let mut args = vec!["incident", "label", id, label];
    if let Some(n) = note {
        args.extend(["--note", n]);
    }
    haltd.haltctl_json(&args)
}

fn check_refusals(haltd: &Haltd) -> Result<()> {
    let unknown = "hs_00000000000000ff";
    let out = haltctl(haltd, &["incident", "label", unknown, "tp"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(1)
            && err.contains("404")
            && err.contains(&format!("no incident record of stream {unknown}")),
        "an unknown stream: {:?} {err}",
        out.status
    );
    let out = haltctl(haltd, &["incident", "label", "hs_nope", "fp"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(1) && err.contains("400") && err.contains("malformed stream id"),
        "a malformed id: {:?} {err}",
        out.status
    );
    let out = haltctl(haltd, &["incident", "label", unknown, "maybe"])?;
    ensure!(
        out.status.code() == Some(2),
        "clap refuses a label that is neither tp nor fp: {:?}",
        out.status
    );
    Ok(())
}

/// The first label: its answer, its count and its `admin` record (with the operator).
fn check_first_label(haltd: &Haltd, id: &str, incident: &Value) -> Result<()> {
    ensure!(
        count(haltd, "OPERATOR_TRIP", "tp").is_err(),
        "no series before a label"
    );
    ensure!(
        count(haltd, "latency_anomaly", "fp")? == 0.0,
        "detectors' series exist at 0"
    );
    let given = label(haltd, id, "tp", Some("checked by hand"))?;
    ensure!(
        given["incident_seq"] == incident["seq"]
            && given["incident_hash"] == incident["hash"]
            && given["detector"] == "OPERATOR_TRIP"
            && given["route"] == "default"
            && given["label"] == "tp"
            && given["previous"].is_null()
            && given["note"] == "checked by hand",
        "the answer: {given}"
    );
    ensure!(count(haltd, "OPERATOR_TRIP", "tp")? == 1.0);
    let rec = haltd.wait_record("the label's admin record", |r| {
        r["admin"]["action"] == "label" && r["admin"]["status"] == 200
    })?;
    ensure!(
        rec["kind"] == "admin"
            && rec["stream_id"] == id
            && rec["admin"]["actor"].is_object()
            && rec["admin"]["labelled"]["incident_seq"] == incident["seq"]
            && rec["admin"]["request"]["note"] == "checked by hand",
        "the record: {rec}"
    );
    println!("the label's record: {rec}");
    Ok(())
}

/// Labelling again: the latest label wins and the count moves; the table form names the
/// incident and the label it replaced.
fn check_relabel(haltd: &Haltd, id: &str) -> Result<()> {
    let again = label(haltd, id, "fp", None)?;
    println!("$ haltctl --json incident label {id} fp\n{again}");
    ensure!(
        again["previous"] == "tp" && again["label"] == "fp",
        "{again}"
    );
    ensure!(count(haltd, "OPERATOR_TRIP", "tp")? == 0.0);
    ensure!(count(haltd, "OPERATOR_TRIP", "fp")? == 1.0);
    let out = haltctl(haltd, &["incident", "label", id, "fp", "--note", "benign"])?;
    let text = String::from_utf8_lossy(&out.stdout);
    println!("$ haltctl incident label {id} fp --note benign\n{text}");
    for line in raw_metrics(haltd)?
        .lines()
        .filter(|l| l.starts_with("haltd_incident_labels{detector=\"OPERATOR_TRIP\""))
    {
        println!("{line}");
    }
    ensure!(
        out.status.success() && text.contains("previous") && text.contains(id),
        "{text}"
    );
    Ok(())
}

/// The counts of an instance after the test's labels: one `fp`, no `tp`.
fn check_counts_kept(haltd: &Haltd, after: &str) -> Result<()> {
    ensure!(count(haltd, "OPERATOR_TRIP", "fp")? == 1.0, "{after}");
    ensure!(count(haltd, "OPERATOR_TRIP", "tp")? == 0.0, "{after}");
    Ok(())
}

#[test]
fn an_incident_label_is_recorded_counted_moved_and_kept_across_restarts() -> Result<()> {
    let pair = NetPair::new()?;
    let mut haltd = Haltd::start(&pair, &[])?;
    let id = haltd.trip_stream_from(&haltd.client_ns, &[])?;
    let incident = haltd.wait_record("incident", |r| {
        r["kind"] == "incident" && r["stream_id"] == id.as_str()
    })?;
    check_first_label(&haltd, &id, &incident)?;
    check_relabel(&haltd, &id)?;
    check_refusals(&haltd)?;

    // A restart keeps the counts (the state store).
    haltd.stop()?;
    let ledger = haltd.ledger.clone();
    let mut restarted = Haltd::start_with_ledger(&pair, Some(&ledger), &[])?;
    check_counts_kept(&restarted, "after a restart")?;
    let state = restarted.haltctl_json(&["state", "show"])?;
    let held = &state["held"]["incident_labels"];
    ensure!(
        held.as_array().map(Vec::len) == Some(1)
            && held[0]["body"]["label"] == "fp"
            && held[0]["incident_seq"] == incident["seq"],
        "the store: {state}"
    );

    // Without the state store, a start takes the labels back from the ledger.
    restarted.stop()?;
    for f in ["state.db", "state.db-wal", "state.db-shm"] {
        let _ = fs::remove_file(restarted.state_dir.join(f));
    }
    let rebuilt = Haltd::start_with_ledger(&pair, Some(&ledger), &[])?;
    check_counts_kept(&rebuilt, "rebuilt from the ledger")?;
    drop(rebuilt);
    drop(restarted);
    drop(haltd);
    Ok(())
}
