//! Root-only tests of the surprise detector's intervene mode (issue 16, spec 003): a
//! high-surprise span is held back, grounded, rewound unseen and resumed, through the real
//! proxy: the built-in source (its continuation reads the evidence, then samples re-seeded by
//! it) and the scripted upstream in vLLM's and llama.cpp's continuation shapes. The grounder
//! is haltd's own, with a memory store of documents each test writes.
//!
//! The built-in tests compute the expected reply in-process with the same model
//! (`haltd::source`): the unmodified reply, and the resumed one from the round's kept bytes,
//! rewound tokens and evidence as the record states them. The client's text must equal it
//! byte for byte.

use std::{fs, net::TcpListener, thread, time::Duration};

use anyhow::{ensure, Context, Result};
use haltd::{
    grounding::Snippet,
    source::{
        builtin::BuiltinModel,
        resume::{BuiltinSource, History, Reading},
        Polled, TokenSource,
    },
};
use haltd_tests::{
    in_netns, rig::Rig, spawn_in_netns, sse, temp_dir, Haltd, NetPair, StreamOutcome,
};
use serde_json::{json, Value};

use crate::UPSTREAM_BIN;

const PROMPT: &str = "tell me about the river and the town";
const SEED: u64 = 11;
const MAX_TOKENS: u32 = 24;

/// The built-in source a turn of [`PROMPT`] gets.
fn builtin() -> BuiltinSource {
    BuiltinSource {
        stream: BuiltinModel::get()
            .stream(PROMPT, Some(SEED), MAX_TOKENS)
            .with_ignore_eos(true),
        top_n: 0,
        history: History::with_capacity(64),
        reading: Reading::default(),
    }
}

/// The next token's text; `None` at the end.
fn next(src: &mut BuiltinSource) -> Option<String> {
    match src.poll() {
        Polled::Text(t) => Some(t.text.into_owned()),
        _ => None,
    }
}

/// The unmodified reply, token by token.
fn baseline() -> Vec<String> {
    let mut src = builtin();
    std::iter::from_fn(|| next(&mut src)).collect()
}

/// The reply of one rewind: the tokens up to `kept` bytes and `rewound` more, then the
/// continuation: `evidence`'s first snippet read, then the model salted by it.
fn resumed(kept: usize, rewound: usize, evidence: &[Snippet]) -> Result<String> {
    resumed_from(builtin(), kept, rewound, evidence)
}

/// [`resumed`] for any built-in source `src` (with a history that reaches `rewound` back).
pub(crate) fn resumed_from(
    mut src: BuiltinSource,
    kept: usize,
    rewound: usize,
    evidence: &[Snippet],
) -> Result<String> {
    let mut text = String::new();
    while text.len() < kept {
        text.push_str(&next(&mut src).context("the reply ended before the kept prefix")?);
    }
    ensure!(text.len() == kept, "kept bytes {kept} split a token");
    for _ in 0..rewound {
        next(&mut src).context("the reply ended inside the rewound span")?;
    }
    ensure!(src.resume(rewound, evidence), "history too short");
    while let Some(t) = next(&mut src) {
        text.push_str(&t);
    }
    Ok(text)
}

/// The snippets of a round record's `evidence`.
pub(crate) fn evidence(round: &Value) -> Vec<Snippet> {
    round["evidence"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| Snippet {
            claim: s["claim"].as_str().unwrap_or_default().to_owned(),
            evidence: s["evidence"].as_str().unwrap_or_default().to_owned(),
            confidence: s["confidence"].as_f64().unwrap_or_default() as f32,
            source: s["source"].as_str().unwrap_or_default().to_owned(),
        })
        .collect()
}

/// A memory store with one document of `text`.
fn store(text: &str) -> Result<String> {
    let dir = temp_dir("memory")?;
    fs::write(dir.join("notes.md"), text)?;
    Ok(dir.display().to_string())
}

/// The surprise detector in intervene mode over a window of 4 with a threshold every token
/// breaches (`min_tokens` 4: the first breach is the 4th token), holding back `hold_back`.
fn surprise(hold_back: usize) -> String {
    format!(
        "[detectors.surprise]\nmode = \"intervene\"\nwindow = 4\nmin_tokens = 4\n\
         threshold_bits = 0.0\nhold_back = {hold_back}\n"
    )
}

/// haltd with the built-in source and `config`.
fn builtin_haltd(pair: &NetPair, config: &str) -> Result<Haltd> {
    let dir = temp_dir("intervene")?;
    let path = dir.join("haltd.toml");
    fs::write(&path, config)?;
    let path = path.display().to_string();
    Haltd::start(
        pair,
        &["--config", &path, "--builtin-token-interval-us", "2000"],
    )
}

fn request() -> Value {
    json!({"model": "builtin", "stream": true, "max_tokens": MAX_TOKENS, "seed": SEED,
        "ignore_eos": true, "messages": [{"role": "user", "content": PROMPT}]})
}

fn stream_builtin(haltd: &Haltd) -> Result<StreamOutcome> {
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    let body = request();
    in_netns(&haltd.client_ns, move || {
        sse::stream(&url, &body, Duration::from_secs(30), |_, _| {})
    })
}

/// The turn record's grounding receipt.
fn receipt(haltd: &Haltd, o: &StreamOutcome) -> Result<Value> {
    let id = o.stream_id.clone();
    let turn = haltd.wait_record("the turn record", |r| {
        r["kind"] == "turn" && r["stream_id"] == id.as_str()
    })?;
    Ok(turn["grounding"].clone())
}

#[test]
fn a_grounded_span_is_rewound_unseen_and_resumed_byte_for_byte() -> Result<()> {
    let base = baseline();
    ensure!(base.len() >= 8, "baseline too short: {base:?}");
    // The document holds the unmodified reply: whichever span is held, it matches.
    let doc = format!("Notes.\n\n{}\n", base.concat());
    let config = format!(
        "{}\n[grounding]\nmax_rounds = 1\n\n[grounding.memory]\ndir = \"{}\"\nfloor = 0.01\n",
        surprise(2),
        store(&doc)?
    );
    let pair = NetPair::new()?;
    let haltd = builtin_haltd(&pair, &config)?;
    let o = stream_builtin(&haltd)?;
    ensure!(
        o.error.is_none() && o.finish_reason.is_some(),
        "{:?}",
        o.events
    );
    let g = receipt(&haltd, &o)?;
    let rounds = g["rounds"].as_array().context("rounds")?;
    ensure!(rounds.len() == 1, "max_rounds = 1: {g}");
    let r = &rounds[0];
    ensure!(r["outcome"] == "rewound", "{g}");
    ensure!(r["arm"] == "memory" && r["rewound_tokens"] == 2, "{g}");
    let kept = r["kept_bytes"].as_u64().context("kept_bytes")? as usize;
    // `resumed` checks that the kept bytes end on a token of the unmodified reply.
    let expected = resumed(kept, 2, &evidence(r))?;
    let prefix = &expected[..kept];
    ensure!(
        kept >= base[..2].concat().len(),
        "at least 2 tokens kept (min_tokens 4)"
    );
    ensure!(
        o.text == expected,
        "client text {:?}\n expected {expected:?}",
        o.text
    );
    ensure!(
        o.text.starts_with(prefix) && base.concat().starts_with(prefix),
        "the kept prefix"
    );
    ensure!(
        o.text != base.concat(),
        "the resumed text is the unmodified one"
    );
    ensure!(
        g["threshold_bits"] == 0.0 && g["window"] == 4 && g["hold_back"] == 2,
        "{g}"
    );
    ensure!(g["arm_order"]["computable"][0] == "memory", "{g}");
    no_silent_correction_after_the_rewind(&haltd, &o)
}

/// The rewound tokens were never sent, and the continuation replaced them: the turn record's
/// `no_silent_correction` holds, checked, over exactly the text the client got.
fn no_silent_correction_after_the_rewind(haltd: &Haltd, o: &StreamOutcome) -> Result<()> {
    let id = o.stream_id.clone();
    let turn = haltd.wait_record("the turn record", |r| {
        r["kind"] == "turn" && r["stream_id"] == id.as_str()
    })?;
    let silent = turn["safety_verdict"]["results"]
        .as_array()
        .and_then(|r| {
            r.iter()
                .find(|x| x["boundary_id"] == "no_silent_correction")
        })
        .context("no_silent_correction")?;
    let sent = o.text.len().to_string();
    let expected = json!([
        ["produced_bytes", sent],
        ["sent_bytes", sent],
        ["completed", "true"]
    ]);
    ensure!(
        silent["status"] == "upheld" && silent["evidence"] == expected,
        "{silent}"
    );
    Ok(())
}

#[test]
fn rounds_stop_at_max_rounds_and_nothing_found_resumes_unmodified() -> Result<()> {
    let base = baseline();
    let doc = format!("{}\n", base.concat());
    let config = format!(
        "{}\n[grounding]\nmax_rounds = 2\n\n[grounding.memory]\ndir = \"{}\"\nfloor = 0.01\n",
        surprise(2),
        store(&doc)?
    );
    let pair = NetPair::new()?;
    let haltd = builtin_haltd(&pair, &config)?;
    let o = stream_builtin(&haltd)?;
    ensure!(o.error.is_none(), "{:?}", o.events);
    let g = receipt(&haltd, &o)?;
    let rounds = g["rounds"].as_array().context("rounds")?;
    ensure!(
        rounds.len() == 2,
        "every token breaches, 2 rounds at most: {g}"
    );
    ensure!(rounds.iter().all(|r| r["took_ms"].is_u64()), "{g}");
    // Nothing in the store matches: both rounds find nothing, the reply is unmodified.
    let config = format!(
        "{}\n[grounding]\nmax_rounds = 2\n\n[grounding.memory]\ndir = \"{}\"\nfloor = 0.01\n",
        surprise(2),
        store("zyzzyva quixotic xylophone\n")?
    );
    let pair = NetPair::new()?;
    let haltd = builtin_haltd(&pair, &config)?;
    let o = stream_builtin(&haltd)?;
    ensure!(
        o.text == base.concat(),
        "{:?} vs {:?}",
        o.text,
        base.concat()
    );
    let g = receipt(&haltd, &o)?;
    let rounds = g["rounds"].as_array().context("rounds")?;
    ensure!(
        rounds.len() == 2 && rounds.iter().all(|r| r["outcome"] == "empty"),
        "{g}"
    );
    Ok(())
}

/// A listener in `ns` that accepts and never answers: a web arm that hangs.
fn hanging_endpoint(ns: &str, port: u16) -> Result<()> {
    let ns = ns.to_owned();
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        in_netns(&ns, move || {
            let l = TcpListener::bind(("127.0.0.1", port));
            let ok = l.is_ok();
            let _ = tx.send(ok);
            if let Ok(l) = l {
                let mut held = Vec::new();
                for s in l.incoming().flatten() {
                    held.push(s);
                }
            }
        });
    });
    ensure!(
        rx.recv_timeout(Duration::from_secs(5))?,
        "binding the hanging endpoint"
    );
    Ok(())
}

#[test]
fn a_trip_during_a_round_halts_within_b_and_cancels_the_round() -> Result<()> {
    let pair = NetPair::new()?;
    hanging_endpoint(&pair.srv, 9011)?;
    let config = format!(
        "{}\n[grounding]\nround_deadline_ms = 8000\narm_deadline_ms = 7000\n\n\
         [grounding.web]\nendpoint = \"http://127.0.0.1:9011\"\n",
        surprise(2)
    );
    let haltd = builtin_haltd(&pair, &config)?;
    let (tx, rx) = std::sync::mpsc::channel();
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    let body = request();
    let streamer = spawn_in_netns(&pair.cli, move || {
        sse::stream(
            &url,
            &body,
            Duration::from_secs(30),
            sse::report_stream_id(tx),
        )
    });
    let id = rx.recv_timeout(Duration::from_secs(10))?;
    // The breach comes at the 4th token (8 ms in); the round then waits on the web arm.
    thread::sleep(Duration::from_millis(800));
    let (status, _) = haltd.trip(&id, None)?;
    ensure!(status == 200, "trip: {status}");
    let o = streamer.join().expect("streamer thread")?;
    o.halted_cleanly("OPERATOR_TRIP")
        .with_context(|| format!("{:?}", o.events))?;
    let err = o.error.clone().unwrap_or_default();
    ensure!(
        err["post_trip_tokens"].as_u64().unwrap_or(99) <= 5,
        "more than B after the trip: {err}"
    );
    // Parked since the breach: only the unmodified reply's beginning went out, never the
    // held span.
    let base = baseline().concat();
    ensure!(
        base.starts_with(&o.text) && o.text.len() < base.len(),
        "{:?} went out while the round ran",
        o.text
    );
    let g = receipt(&haltd, &o)?;
    let rounds = g["rounds"].as_array().context("rounds")?;
    ensure!(
        rounds.len() == 1 && rounds[0]["outcome"] == "cancelled",
        "{g}"
    );
    ensure!(
        rounds[0]["took_ms"].as_u64().unwrap_or(u64::MAX) < 7000,
        "cancelled at the trip, not at the deadline: {g}"
    );
    Ok(())
}

/// The scripted upstream's first `k` tokens of `words`, as the client reads them.
fn scripted_prefix(words: &[&str], k: usize) -> String {
    words.iter().cycle().take(k).copied().collect()
}

/// A proxied turn grounded and resumed in `shape`: the upstream gets the continuation in
/// that shape, and the client's text is the kept prefix plus the continuation, byte for byte.
fn proxied_resume(shape: &str) -> Result<()> {
    let words = [
        " The", " river", " Nile", " is", " long", " and", " wide", " today",
    ];
    let doc = "The river Nile is the longest river in Africa.\n";
    let config = format!(
        "[detectors.surprise]\nmode = \"intervene\"\nwindow = 4\nmin_tokens = 2\n\
         threshold_bits = 5.0\nhold_back = 3\n\n[grounding]\nmax_rounds = 1\n\
         continuation = \"{shape}\"\n\n[grounding.memory]\ndir = \"{}\"\nfloor = 0.01\n",
        store(doc)?
    );
    let rig = Rig::with_config(UPSTREAM_BIN, &config, &[])?;
    // Tokens 5 and 6 (0-based) are unlikely (~10 bits): the mean of 4 passes 5 bits at 6.
    let directive = format!(
        "[[script:normal tokens=12 low_at=5,6 resume=4 words=\"{}\"]]",
        words.join(",")
    );
    let body = json!({"model": "m", "stream": true, "max_tokens": 12,
        "messages": [{"role": "user", "content": directive}]});
    let key = sse::fresh_key();
    let o = rig.stream("/v1/chat/completions", &body, Some(&key), |_, _| {})?;
    ensure!(o.error.is_none(), "{:?}", o.events);
    let turn = rig.record("turn", &o.stream_id)?;
    let g = &turn["grounding"];
    let r = &g["rounds"][0];
    ensure!(r["outcome"] == "rewound" && r["arm"] == "memory", "{g}");
    let rewound = r["rewound_tokens"].as_u64().context("rewound")? as usize;
    let kept = r["kept_bytes"].as_u64().context("kept")? as usize;
    // The breach is at token 6: the 3 held tokens 4..=6 are rewound, 0..=3 kept.
    ensure!(rewound == 3, "{g}");
    let prefix = scripted_prefix(&words, 4);
    ensure!(kept == prefix.len(), "kept {kept}: {g}");
    // The upstream got the continuation in the configured shape.
    let reqs = rig.up.requests()?;
    let cont = reqs
        .iter()
        .rev()
        .find(|q| {
            q["event"] != "started"
                && q["body"]["messages"]
                    .as_array()
                    .is_some_and(|m| m.len() == 3)
        })
        .context("no continuation request")?;
    let b = &cont["body"];
    let m = b["messages"].as_array().context("messages")?;
    ensure!(m[0]["role"] == "system", "{b}");
    ensure!(
        m[0]["content"]
            .as_str()
            .is_some_and(|s| s.starts_with("[grounding]\n") && s.contains("Nile")),
        "{b}"
    );
    ensure!(
        m[2] == json!({"role": "assistant", "content": prefix}),
        "{b}"
    );
    match shape {
        "vllm" => ensure!(
            b["continue_final_message"] == true && b["add_generation_prompt"] == false,
            "{b}"
        ),
        _ => ensure!(
            b.get("continue_final_message").is_none() && b.get("add_generation_prompt").is_none(),
            "{b}"
        ),
    }
    ensure!(b["max_tokens"] == 8, "12 less the 4 kept: {b}");
    // The continuation says the evidence's words (scripted upstream): 4 tokens.
    let ev = r["evidence"][0]["evidence"].as_str().context("evidence")?;
    let ev_words: Vec<String> = ev.split_whitespace().map(|w| format!(" {w}")).collect();
    let resumed: String = ev_words.iter().cycle().take(4).cloned().collect();
    ensure!(
        o.text == format!("{prefix}{resumed}"),
        "client text {:?}\n expected {:?}",
        o.text,
        format!("{prefix}{resumed}")
    );
    Ok(())
}

#[test]
fn a_proxied_turn_resumes_in_vllm_shape() -> Result<()> {
    proxied_resume("vllm")
}

#[test]
fn a_proxied_turn_resumes_in_llama_cpp_shape() -> Result<()> {
    proxied_resume("llama_cpp")
}

#[test]
fn without_continuation_the_evidence_follows_the_reply_unchanged() -> Result<()> {
    let words = [
        " The", " river", " Nile", " is", " long", " and", " wide", " today",
    ];
    let config = format!(
        "[detectors.surprise]\nmode = \"intervene\"\nwindow = 4\nmin_tokens = 2\n\
         threshold_bits = 5.0\nhold_back = 3\n\n[grounding]\ncontinuation = \"none\"\n\n\
         [grounding.memory]\ndir = \"{}\"\nfloor = 0.01\n",
        store("The river Nile is the longest river in Africa.\n")?
    );
    let rig = Rig::with_config(UPSTREAM_BIN, &config, &[])?;
    let directive = format!(
        "[[script:normal tokens=12 low_at=5,6 words=\"{}\"]]",
        words.join(",")
    );
    let body = json!({"model": "m", "stream": true,
        "messages": [{"role": "user", "content": directive}]});
    let o = rig.stream(
        "/v1/chat/completions",
        &body,
        Some(&sse::fresh_key()),
        |_, _| {},
    )?;
    ensure!(o.error.is_none(), "{:?}", o.events);
    // The reply is the upstream's, whole and unchanged; one request, never re-issued.
    ensure!(o.text == scripted_prefix(&words, 12), "{:?}", o.text);
    ensure!(
        rig.up
            .requests()?
            .iter()
            .filter(|q| q["event"] != "started")
            .count()
            == 1,
        "re-issued without continuation"
    );
    // The evidence comes after the reply: a chunk without choices, before the final one.
    let n = o.events.len();
    let note = o
        .events
        .iter()
        .position(|e| e.data.contains("\"haltd_grounding\""))
        .context("no haltd_grounding chunk")?;
    let v: Value = serde_json::from_str(&o.events[note].data)?;
    ensure!(v["choices"] == json!([]), "{v}");
    ensure!(v["haltd_grounding"]["revision"] == "post_hoc", "{v}");
    ensure!(v["haltd_grounding"]["arm"] == "memory", "{v}");
    ensure!(
        v["haltd_grounding"]["evidence"][0]["evidence"]
            .as_str()
            .is_some_and(|e| e.contains("Nile")),
        "{v}"
    );
    let last_token = o
        .events
        .iter()
        .rposition(|e| matches!(e.kind, haltd_tests::EventKind::Token(_)))
        .unwrap_or(0);
    ensure!(
        last_token < note && note + 1 < n,
        "after every token, before [DONE]"
    );
    let turn = rig.record("turn", &o.stream_id)?;
    let g = &turn["grounding"];
    ensure!(
        g["continuation"] == "none" && g["rounds"][0]["outcome"] == "annotated",
        "{g}"
    );
    Ok(())
}

#[test]
fn a_backend_without_logprobs_sees_no_change() -> Result<()> {
    let config = format!(
        "{}\n[grounding]\ncontinuation = \"vllm\"\n\n[grounding.memory]\ndir = \"{}\"\nfloor = 0.01\n",
        surprise(2),
        store("The quick brown fox.\n")?
    );
    let rig = Rig::with_config(UPSTREAM_BIN, &config, &[])?;
    let body = json!({"model": "m", "stream": true,
        "messages": [{"role": "user", "content": "[[script:normal tokens=12 no_logprobs=1]]"}]});
    let key = sse::fresh_key();
    let o = rig.stream("/v1/chat/completions", &body, Some(&key), |_, _| {})?;
    ensure!(o.error.is_none() && o.tokens > 0, "{:?}", o.events);
    let turn = rig.record("turn", &o.stream_id)?;
    let g = &turn["grounding"];
    ensure!(g["no_logprobs"] == true, "{turn}");
    ensure!(g["rounds"].as_array().is_some_and(Vec::is_empty), "{g}");
    ensure!(
        rig.up
            .requests()?
            .iter()
            .filter(|q| q["event"] != "started")
            .count()
            == 1,
        "one upstream request, never re-issued"
    );
    // The same stream as without intervene mode.
    let plain = Rig::with_config(UPSTREAM_BIN, "", &[])?;
    let p = plain.stream(
        "/v1/chat/completions",
        &body,
        Some(&sse::fresh_key()),
        |_, _| {},
    )?;
    ensure!(o.text == p.text, "{:?} vs {:?}", o.text, p.text);
    Ok(())
}
