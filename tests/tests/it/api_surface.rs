//! The OpenAI API around the governed turns: `GET /v1/models/{id}`, `POST /v1/embeddings`
//! passed through without governance, `--upstream-api-key-file` (haltd's own upstream
//! credential instead of the client's), and a reasoning model's `reasoning_content`,
//! forwarded and governed like any text.

use std::{fs, os::unix::fs::PermissionsExt, time::Duration};

use anyhow::{ensure, Context, Result};
use haltd_tests::{agent, in_netns, rig::chat, rig::Rig, sse, temp_dir, EventKind, Haltd, NetPair};
use serde_json::{json, Value};

use crate::UPSTREAM_BIN;

const CLIENT_KEY: &str = "Bearer sk-client-ALICE-0042";
const NODE_KEY: &str = "sk-upstream-NODE-7781";

/// `GET url` from the current namespace: (status, body as JSON or Null).
fn get_here(url: &str) -> Result<(u16, Value)> {
    let mut resp = agent(Duration::from_secs(10))
        .get(url)
        .header("authorization", CLIENT_KEY)
        .call()
        .with_context(|| format!("GET {url}"))?;
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    Ok((
        resp.status().as_u16(),
        serde_json::from_str(&text).unwrap_or(Value::Null),
    ))
}

fn get(haltd: &Haltd, path: &str) -> Result<(u16, Value)> {
    let url = format!("{}{path}", haltd.api_url());
    in_netns(&haltd.client_ns, move || get_here(&url))
}

/// The upstream's logged requests to `path` that ended, once there are `n` of them (the
/// upstream logs a request after its answer went out, so a client can be faster than the log).
fn upstream_requests(rig: &Rig, path: &str, n: usize) -> Result<Vec<Value>> {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let ended: Vec<Value> = rig
            .up
            .requests()?
            .into_iter()
            .filter(|r| r.get("event").is_none() && r["path"] == path)
            .collect();
        if ended.len() >= n || std::time::Instant::now() > deadline {
            return Ok(ended);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Embeddings: relayed as they came, both ways, with haltd's key; the upstream's refusal is
/// the client's answer.
fn embeddings_are_relayed_with_haltd_s_key(rig: &Rig, node_auth: &str) -> Result<()> {
    let body = json!({"model": "scripted", "input": ["ab", "xyz"]});
    let (status, _, answer) = rig.post("/v1/embeddings", &body, Some(CLIENT_KEY))?;
    ensure!(status == 200, "{status} {answer}");
    ensure!(
        answer["data"][0]["embedding"] == json!([2.0, 97.0, 98.0, 0.0])
            && answer["data"][1]["embedding"] == json!([3.0, 120.0, 122.0, 1.0]),
        "{answer}"
    );
    let sent = upstream_requests(rig, "/v1/embeddings", 1)?;
    let sent = sent.first().context("no embeddings request upstream")?;
    ensure!(sent["body"] == body, "the body changed on the way: {sent}");
    ensure!(
        sent["headers"]["authorization"] == node_auth,
        "the client's key went upstream: {sent}"
    );
    // The upstream's refusal is the client's answer, status and message.
    let (status, _, refusal) = rig.post(
        "/v1/embeddings",
        &json!({"model": "scripted"}),
        Some(CLIENT_KEY),
    )?;
    ensure!(
        status == 400
            && refusal["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("'input' is required")),
        "{status} {refusal}"
    );
    Ok(())
}

#[test]
fn models_by_id_and_embeddings_reach_the_upstream_with_haltd_s_own_key() -> Result<()> {
    let dir = temp_dir("upstream-key")?;
    let key_file = dir.join("upstream.key");
    fs::write(&key_file, format!("{NODE_KEY}\n"))?;
    fs::set_permissions(&key_file, fs::Permissions::from_mode(0o600))?;
    let key_arg = key_file.display().to_string();
    let rig = Rig::start(UPSTREAM_BIN, &["--upstream-api-key-file", &key_arg])?;
    let node_auth = format!("Bearer {NODE_KEY}");

    // /v1/models/{id}: the entry of the upstream's list, or OpenAI's 404.
    let (status, model) = get(&rig.haltd, "/v1/models/scripted")?;
    ensure!(
        status == 200 && model["id"] == "scripted",
        "{status} {model}"
    );
    ensure!(model["owned_by"] == "scripted-upstream", "{model}");
    let (status, err) = get(&rig.haltd, "/v1/models/gpt-9")?;
    ensure!(
        status == 404 && err["error"]["code"] == "model_not_found",
        "{status} {err}"
    );
    let listed = upstream_requests(&rig, "/v1/models", 2)?;
    ensure!(
        listed.len() == 2,
        "the upstream's list was asked {} times",
        listed.len()
    );
    ensure!(
        listed
            .iter()
            .all(|r| r["headers"]["authorization"] == node_auth.as_str()),
        "the model list was not asked with haltd's key: {listed:?}"
    );

    embeddings_are_relayed_with_haltd_s_key(&rig, &node_auth)?;

    // A turn goes upstream with haltd's key, and is still the client's conversation.
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=4]]", true),
        Some(CLIENT_KEY),
        |_, _| {},
    )?;
    ensure!(o.status == 200 && o.tokens == 4, "{o:?}");
    let turn = upstream_requests(&rig, "/v1/chat/completions", 1)?;
    ensure!(
        turn.first()
            .is_some_and(|r| r["headers"]["authorization"] == node_auth.as_str()),
        "the turn did not carry haltd's key: {turn:?}"
    );
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(
        rec["conversation"] == rig.haltd.key_fingerprint(CLIENT_KEY)?.as_str(),
        "the turn is not the client's conversation: {rec}"
    );

    // Neither key is written down.
    let ledger = fs::read_to_string(&rig.haltd.ledger)?;
    let log = rig.haltd.log_tail(100_000);
    for secret in ["NODE-7781", "ALICE-0042"] {
        ensure!(!ledger.contains(secret), "the ledger holds {secret}");
        ensure!(!log.contains(secret), "the log holds {secret}");
    }
    Ok(())
}

#[test]
fn the_builtin_source_answers_its_model_and_has_no_embeddings() -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &[])?;
    let (status, model) = get(&haltd, "/v1/models/builtin")?;
    ensure!(
        status == 200 && model["id"] == "builtin",
        "{status} {model}"
    );
    let (status, err) = get(&haltd, "/v1/models/scripted")?;
    ensure!(
        status == 404 && err["error"]["code"] == "model_not_found",
        "{status} {err}"
    );
    let (status, err) = get(&haltd, "/v1/models/a%20b%00")?;
    ensure!(status == 404 || status == 400, "{status} {err}");
    let url = format!("{}/v1/embeddings", haltd.api_url());
    let (status, err) = in_netns(&haltd.client_ns, move || -> Result<(u16, Value)> {
        let mut resp = agent(Duration::from_secs(10))
            .post(&url)
            .send_json(json!({"model": "builtin", "input": "x"}))?;
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        Ok((resp.status().as_u16(), serde_json::from_str(&text)?))
    })?;
    ensure!(
        status == 404 && err["error"]["code"] == "model_not_found",
        "{status} {err}"
    );
    Ok(())
}

#[test]
fn an_upstream_key_file_others_can_read_is_a_configuration_error() -> Result<()> {
    let dir = temp_dir("upstream-key-mode")?;
    let key_file = dir.join("upstream.key");
    fs::write(&key_file, format!("{NODE_KEY}\n"))?;
    fs::set_permissions(&key_file, fs::Permissions::from_mode(0o644))?;
    let out = std::process::Command::new(haltd_tests::haltd_bin()?)
        .args([
            "serve",
            "--source",
            "openai",
            "--upstream",
            "http://127.0.0.1:9",
        ])
        .arg("--upstream-api-key-file")
        .arg(&key_file)
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(2) && stderr.contains("chmod 600"),
        "{:?}: {stderr}",
        out.status
    );
    Ok(())
}

/// A reasoning model's thinking (`delta.reasoning_content`) goes out in its own field,
/// streamed and batch, with its logprobs, and counts as token frames.
fn reasoning_is_forwarded_in_its_own_field(rig: &Rig) -> Result<()> {
    let script = "[[script:normal tokens=6 reasoning=3 words=\"Let, me, think, The, answer, .\"]]";
    let mut body = chat(script, true);
    body["logprobs"] = json!(true);
    let o = rig.stream(
        "/v1/chat/completions",
        &body,
        Some(&sse::fresh_key()),
        |_, _| {},
    )?;
    ensure!(
        o.finish_reason.as_deref() == Some("stop") && o.error.is_none(),
        "{o:?}"
    );
    ensure!(
        (o.reasoning.as_str(), o.reasoning_tokens) == ("Let me think", 3),
        "reasoning {:?} in {} frames",
        o.reasoning,
        o.reasoning_tokens
    );
    ensure!((o.text.as_str(), o.tokens) == (" The answer .", 3), "{o:?}");
    // The first frame is a reasoning one: it carries the role, and its token's logprobs.
    let first = o
        .events
        .iter()
        .find(|e| matches!(e.kind, EventKind::Reasoning(_)))
        .context("no reasoning frame")?;
    let v: Value = serde_json::from_str(&first.data)?;
    let choice = &v["choices"][0];
    ensure!(
        choice["delta"]["role"] == "assistant"
            && choice["delta"].get("content").is_none()
            && choice["logprobs"]["content"][0]["token"] == "Let",
        "{v}"
    );
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(rec["tokens_emitted"] == 6, "six token frames: {rec}");

    let (status, _, v) = rig.post(
        "/v1/chat/completions",
        &chat(script, false),
        Some(&sse::fresh_key()),
    )?;
    let message = &v["choices"][0]["message"];
    ensure!(
        status == 200
            && message["content"] == " The answer ."
            && message["reasoning_content"] == "Let me think",
        "{status} {v}"
    );
    Ok(())
}

/// Reasoning is governed like text: a trip on a reasoning token halts within B (the failing
/// token never goes out), and a secret in the reasoning never reaches the client.
#[test]
fn reasoning_is_forwarded_and_governed_like_text() -> Result<()> {
    let rig = Rig::start(UPSTREAM_BIN, &["--hard-limit", "0.05"])?;
    reasoning_is_forwarded_in_its_own_field(&rig)?;

    let o = rig.stream(
        "/v1/chat/completions",
        &chat(
            "[[script:normal tokens=40 pace_ms=10 reasoning=20 neginf_at=5]]",
            true,
        ),
        Some(&sse::fresh_key()),
        |_, _| {},
    )?;
    o.halted_cleanly("COHERENCE_BELOW_THRESHOLD")
        .with_context(|| format!("events: {:?}", o.events))?;
    ensure!(
        (o.reasoning_tokens, o.tokens) == (5, 0),
        "the failing 6th reasoning token is never emitted: {} reasoning, {} content",
        o.reasoning_tokens,
        o.tokens
    );
    let err = o.error.clone().unwrap_or_default();
    ensure!(
        err["post_trip_tokens"].as_u64().unwrap_or(99) <= 5,
        "more than B tokens after the trip: {err}"
    );
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(
        rec["trip_token_index"] == 5 && rec["turn_status"] == "failed",
        "{rec}"
    );
    // The third turn upstream (after the stream and the batch above).
    let turns = upstream_requests(&rig, "/v1/chat/completions", 3)?;
    let up = turns
        .get(2)
        .context("the halted turn did not end upstream")?;
    ensure!(
        up["outcome"] == "cancelled",
        "generation not cancelled: {up}"
    );

    // The exfiltration scanner reads the reasoning as it reads the answer.
    let o = rig.stream(
        "/v1/chat/completions",
        &chat(
            "[[script:normal tokens=12 reasoning=12 words=\"The, access, key, is, AKIA,IOSF,ODNN,7EXA,MPLE, and, more, text\"]]",
            true,
        ),
        Some(&sse::fresh_key()),
        |_, _| {},
    )?;
    o.halted_cleanly("EXFIL_ALERT")
        .with_context(|| format!("events: {:?}", o.events))?;
    ensure!(
        !o.reasoning.contains("AKIA") && o.tokens == 0,
        "part of the secret was emitted: {:?}",
        o.reasoning
    );
    Ok(())
}
