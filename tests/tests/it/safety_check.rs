//! Root-only tests of SafetyCheck (spec 004, issue 37 point 4): every v1 predicate that haltd
//! can check fails end to end on a real stream (`no_fabricated_source` in `detectors.rs`);
//! `no_identity_override` holds for the names real backends answer with; an operator's
//! declarative predicate judges, and replaces a v1 one on the record; `POST
//! /admin/safety/check` judges a record again.

use anyhow::{ensure, Context, Result};
use haltd_tests::{agent, in_netns, rig::Rig, sse, StreamOutcome};
use serde_json::{json, Value};

use crate::UPSTREAM_BIN;

fn rig(config: &str, extra: &[&str]) -> Result<Rig> {
    Rig::with_config(UPSTREAM_BIN, config, extra)
}

/// Streams a chat turn naming `model`, with a key of its own.
fn turn(rig: &Rig, model: &str, directive: &str) -> Result<StreamOutcome> {
    let body = json!({
        "model": model,
        "stream": true,
        "messages": [{"role": "user", "content": directive}],
    });
    rig.stream(
        "/v1/chat/completions",
        &body,
        Some(&sse::fresh_key()),
        |_, _| {},
    )
}

/// The turn completed, and its record's verdict upheld.
fn upheld(rig: &Rig, o: &StreamOutcome) -> Result<Value> {
    ensure!(o.finish_reason.as_deref() == Some("stop"), "{:?}", o.events);
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(rec["safety_verdict"]["upheld"] == true, "{rec}");
    Ok(rec)
}

/// The turn was tripped by SafetyCheck for exactly `boundaries`; its record.
fn tripped(rig: &Rig, o: &StreamOutcome, boundaries: &[&str]) -> Result<Value> {
    o.halted_cleanly("SAFETY_BOUNDARY_VIOLATED")
        .with_context(|| format!("events: {:?}", o.events))?;
    let err = o.error.clone().unwrap_or_default();
    ensure!(err["detector"]["name"] == "safety", "{err}");
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(rec["turn_status"] == "failed", "{rec}");
    ensure!(
        rec["safety_verdict"]["violated_boundaries"] == json!(boundaries),
        "{rec}"
    );
    Ok(rec)
}

fn result<'a>(rec: &'a Value, id: &str) -> Result<&'a Value> {
    rec["safety_verdict"]["results"]
        .as_array()
        .and_then(|rs| rs.iter().find(|r| r["boundary_id"] == id))
        .with_context(|| format!("no result for {id}: {rec}"))
}

fn evidence(r: &Value, key: &str) -> Option<String> {
    r["evidence"]
        .as_array()?
        .iter()
        .find_map(|kv| (kv[0] == key).then(|| kv[1].as_str().unwrap_or_default().to_owned()))
}

/// `POST /admin/safety/check` with `body` as is: (status, answer).
fn admin_check(rig: &Rig, body: &str) -> Result<(u16, Value)> {
    let url = format!("{}/admin/safety/check", rig.haltd.admin_url());
    let body = body.to_owned();
    in_netns(&rig.haltd.client_ns, move || -> Result<(u16, Value)> {
        let mut resp = agent(std::time::Duration::from_secs(10))
            .post(&url)
            .header("content-type", "application/json")
            .send(body.as_bytes())
            .with_context(|| format!("POST {url}"))?;
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        Ok((status, serde_json::from_str(&text).unwrap_or(Value::Null)))
    })
}

#[test]
fn identity_override_fires_on_another_model_never_on_real_aliases() -> Result<()> {
    let rig = rig(
        "[safety]\nmode = \"enforce\"\nmodel_aliases = [[\"served-a\", \"alias-b\"]]\n",
        &[],
    )?;
    for (model, answered, rule) in [
        ("scripted", None, "exact"),
        ("gpt-4o", Some("gpt-4o-2024-08-06"), "dated_snapshot"),
        ("tiny", Some("/models/tiny-q8_0.gguf"), "gguf_file"),
        ("llama3", Some("llama3:latest"), "ollama_latest"),
        ("alias-b", Some("served-a"), "configured"),
    ] {
        let key = answered
            .map(|a| format!(" model=\"{a}\""))
            .unwrap_or_default();
        let o = turn(&rig, model, &format!("[[script:normal tokens=4{key}]]"))?;
        let rec = upheld(&rig, &o).with_context(|| format!("{model} -> {answered:?}"))?;
        let r = result(&rec, "no_identity_override")?;
        ensure!(r["status"] == "upheld", "{r}");
        ensure!(evidence(r, "alias").as_deref() == Some(rule), "{r}");
        ensure!(
            evidence(r, "model_answered").as_deref() == Some(answered.unwrap_or(model)),
            "{r}"
        );
    }
    // Another model, and a GGUF file of another model.
    for (model, answered) in [
        ("gpt-4o", "gpt-4o-mini"),
        ("tiny", "/models/tiny-evil.gguf"),
    ] {
        let o = turn(
            &rig,
            model,
            &format!("[[script:normal tokens=4 model=\"{answered}\"]]"),
        )?;
        let rec = tripped(&rig, &o, &["no_identity_override"])?;
        let r = result(&rec, "no_identity_override")?;
        ensure!(
            r["status"] == "violated" && r["runtime_checkable"] == true,
            "{r}"
        );
    }
    Ok(())
}

#[test]
fn silent_correction_fails_when_the_text_sent_is_not_the_text_produced() -> Result<()> {
    // The fault rewrites "42" into "43" on the hot path and says nothing.
    let rig = rig(
        "[safety]\nmode = \"enforce\"\n",
        &["--fault", "silent-rewrite=42>43"],
    )?;
    let o = turn(
        &rig,
        "scripted",
        "[[script:normal tokens=4 words=\"The, answer, is, 42\"]]",
    )?;
    let rec = tripped(&rig, &o, &["no_silent_correction"])?;
    ensure!(
        o.text.contains("43") && !o.text.contains("42"),
        "{:?}",
        o.text
    );
    let r = result(&rec, "no_silent_correction")?;
    ensure!(r["runtime_checkable"] == true, "{r}");
    ensure!(
        r["reason"]
            .as_str()
            .is_some_and(|s| s.contains("at byte 15")),
        "{r}"
    );
    // Text the fault leaves alone is delivered as produced.
    let o = turn(
        &rig,
        "scripted",
        "[[script:normal tokens=4 words=\"The, answer, is, 7\"]]",
    )?;
    let rec = upheld(&rig, &o)?;
    ensure!(
        result(&rec, "no_silent_correction")?["status"] == "upheld",
        "{rec}"
    );
    Ok(())
}

#[test]
fn declarative_predicates_judge_and_replace_v1_on_the_record() -> Result<()> {
    let rig = rig(
        "[safety]\nmode = \"enforce\"\n\n\
         [[safety.predicates]]\nname = \"short_answers\"\nfield = \"produced_bytes\"\nop = \"max\"\nvalue = 40\n\n\
         [[safety.predicates]]\nname = \"no_identity_override\"\nreplace = true\n\
         field = \"model_answered\"\nop = \"matches\"\nvalue = \"^(scripted|other-model)$\"\n",
        &[],
    )?;
    // The replacement accepts what the v1 predicate would not: it judges instead.
    let o = turn(
        &rig,
        "scripted",
        "[[script:normal tokens=4 model=\"other-model\"]]",
    )?;
    let rec = upheld(&rig, &o)?;
    ensure!(
        rec["safety_verdict"]["replaced_boundaries"] == json!(["no_identity_override"]),
        "{rec}"
    );
    let r = result(&rec, "no_identity_override")?;
    ensure!(r["predicate"] == "config" && r["status"] == "upheld", "{r}");
    ensure!(
        result(&rec, "no_silent_correction")?["predicate"] == "v1",
        "{rec}"
    );
    // The operator's own boundary fails a long answer; the replacement a third model.
    let o = turn(&rig, "scripted", "[[script:normal tokens=30]]")?;
    let rec = tripped(&rig, &o, &["short_answers"])?;
    ensure!(
        result(&rec, "short_answers")?["predicate"] == "config",
        "{rec}"
    );
    let o = turn(
        &rig,
        "scripted",
        "[[script:normal tokens=4 model=\"third\"]]",
    )?;
    tripped(&rig, &o, &["no_identity_override"])?;
    Ok(())
}

#[test]
fn a_verdict_on_demand_for_a_turn_record() -> Result<()> {
    let rig = rig("", &[])?;
    let o = turn(
        &rig,
        "gpt-4o",
        "[[script:normal tokens=4 model=\"gpt-4o-2024-08-06\"]]",
    )?;
    let rec = upheld(&rig, &o)?;
    // The record's own not_checkable boundaries say why.
    for (id, why) in [
        ("no_hot_path_repair", "code-path boundary"),
        ("preserve_versor_closure", "no field state"),
    ] {
        let r = result(&rec, id)?;
        ensure!(r["status"] == "not_checkable", "{r}");
        ensure!(r["reason"].as_str().is_some_and(|s| s.contains(why)), "{r}");
    }
    let (status, v) = admin_check(&rig, &rec.to_string())?;
    ensure!(status == 200, "{status} {v}");
    ensure!(
        v == rec["safety_verdict"],
        "judged again: {v}\nrecorded: {rec}"
    );
    // The same record with the system prompt changed under the turn, and with another model.
    let mut changed = rec.clone();
    changed["safety_verdict"]["inputs"]["identity_after"]["system_prompt_sha256"] = json!("00");
    let (status, v) = admin_check(&rig, &changed.to_string())?;
    ensure!(
        status == 200 && v["violated_boundaries"] == json!(["no_identity_override"]),
        "{v}"
    );
    let r = result(&json!({"safety_verdict": v}), "no_identity_override")?.clone();
    ensure!(
        r["reason"]
            .as_str()
            .is_some_and(|s| s.contains("system prompt")),
        "{r}"
    );
    let mut other = rec.clone();
    other["safety_verdict"]["inputs"]["identity_after"]["model"] = json!("gpt-4o-mini");
    let (_, v) = admin_check(&rig, &other.to_string())?;
    ensure!(
        v["violated_boundaries"] == json!(["no_identity_override"]),
        "{v}"
    );
    // What is not a turn record gets a precise 400.
    let incident = json!({"kind": "incident", "stream_id": o.stream_id});
    for (body, says) in [
        ("{\"kind\": \"turn\",", "body is not JSON: "),
        (
            incident.to_string().as_str(),
            "\"kind\" is \"incident\", not \"turn\"",
        ),
        ("{\"kind\": \"turn\"}", "no \"safety_verdict\" object"),
    ] {
        let (status, v) = admin_check(&rig, body)?;
        ensure!(status == 400, "{body}: {status} {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        ensure!(msg.contains(says), "{body}: {msg}");
    }
    Ok(())
}
