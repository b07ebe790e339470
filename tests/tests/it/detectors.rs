//! Root-only tests of the detectors (issue 4): each hard-trip detector halts a real stream
//! within B tokens, with its code in the terminal event and the record. haltd proxies the
//! scripted upstream (whose `words=` and logprob keys script what the model "says"), in
//! network namespaces, with a config file per test; the exfiltration look-ahead runs on the
//! built-in model.

use std::{fs, sync::Arc, thread, time::Duration};

use anyhow::{ensure, Context, Result};
use haltd::detect::exfil::{Ahead, ExfilConfig, ExfilRules, ExfilScanner};
use haltd_tests::{
    in_netns,
    rig::{chat, Rig},
    sse, temp_dir, EventKind, Haltd, NetPair, StreamOutcome,
};
use serde_json::{json, Value};

use crate::UPSTREAM_BIN;

const SCORER_BIN: &str = env!("CARGO_BIN_EXE_test-scorer");

/// haltd in front of the scripted upstream, with `config` as its config file.
fn rig(config: &str, extra: &[&str]) -> Result<Rig> {
    Rig::with_config(UPSTREAM_BIN, config, extra)
}

/// Streams a chat request with a key of its own (a halt puts only that key into degraded
/// safe mode, not the streams that follow).
fn stream(rig: &Rig, body: &Value) -> Result<StreamOutcome> {
    let key = sse::fresh_key();
    rig.stream("/v1/chat/completions", body, Some(&key), |_, _| {})
}

/// Checks a detector halt end to end: terminal event, budget, incident and turn records.
fn halted_by(rig: &Rig, o: &StreamOutcome, code: &str, detector: &str) -> Result<Value> {
    o.halted_cleanly(code)
        .with_context(|| format!("events: {:?}", o.events))?;
    let err = o.error.clone().unwrap_or_default();
    ensure!(
        err["detector"]["name"] == detector,
        "terminal event names the detector: {err}"
    );
    ensure!(
        err["post_trip_tokens"].as_u64().unwrap_or(99) <= 5,
        "more than B tokens after the trip: {err}"
    );
    let inc = rig.record("incident", &o.stream_id)?;
    ensure!(inc["trip_cause"] == code, "{inc}");
    let turn = rig.record("turn", &o.stream_id)?;
    ensure!(turn["turn_status"] == "failed", "{turn}");
    ensure!(
        turn["detector_refs"].as_array().is_some_and(|r| r
            .iter()
            .any(|x| x.as_str().is_some_and(|s| s.starts_with(detector)))),
        "{turn}"
    );
    Ok(turn)
}

#[test]
fn a_secret_split_across_tokens_never_reaches_the_client() -> Result<()> {
    let rig = rig("", &[])?;
    let o = stream(
        &rig,
        &chat(
            "[[script:normal tokens=12 words=\"The, access, key, is, AKIA,IOSF,ODNN,7EXA,MPLE, and, more, text\"]]",
            true,
        ),
    )?;
    let turn = halted_by(&rig, &o, "EXFIL_ALERT", "exfil")?;
    ensure!(
        !o.text.contains("AKIA"),
        "part of the secret was emitted: {:?}",
        o.text
    );
    ensure!(
        "The access key is".starts_with(o.text.trim_end()) || o.text.is_empty(),
        "unexpected text {:?}",
        o.text
    );
    ensure!(turn["detectors"]["exfil"]["hits"] == 1, "{turn}");
    // A private key block, streamed a few bytes at a time, too.
    let o = stream(
        &rig,
        &chat(
            "[[script:normal tokens=9 words=\"Here:, -----BEGIN ,RSA PRIV,ATE KEY-----\nMIIEow,IBAAKCAQEAxyzq,rstuv0123456789abcdef\n,-----END RSA ,PRIVATE KEY-----, end\"]]",
            true,
        ),
    )?;
    halted_by(&rig, &o, "EXFIL_ALERT", "exfil")?;
    ensure!(!o.text.contains("BEGIN"), "{:?}", o.text);
    // Clean text goes through whole, with nothing held at the end.
    let o = stream(&rig, &chat("[[script:normal tokens=20]]", true))?;
    ensure!(
        o.finish_reason.as_deref() == Some("stop") && o.tokens == 20,
        "{:?}",
        o.events
    );
    let turn = rig.record("turn", &o.stream_id)?;
    ensure!(turn["detectors"]["exfil"]["hits"] == 0, "{turn}");
    ensure!(turn["turn_status"] == "committed", "{turn}");
    ensure!(
        turn["safety_verdict"]["pack_id"].is_string(),
        "verdict in every record: {turn}"
    );
    Ok(())
}

#[test]
fn compute_budget_and_surprise_trip_hard() -> Result<()> {
    let rig = rig(
        "[detectors.compute_budget]\nmax_tokens = 5\n\n[detectors.surprise]\nmode = \"hard\"\nwindow = 4\nthreshold_bits = 6.0\nmin_tokens = 2\n",
        &[],
    )?;
    let o = stream(&rig, &chat("[[script:normal tokens=20]]", true))?;
    halted_by(&rig, &o, "COMPUTE_BUDGET_EXCEEDED", "compute_budget")?;
    // The 6th token is over budget and never sent (the scanner may still hold the 5th).
    ensure!(o.tokens <= 5, "tokens {}", o.tokens);
    let inc = rig.record("incident", &o.stream_id)?;
    ensure!(inc["trip_token_index"].as_u64() <= Some(5), "{inc}");
    // ln 0.001 is ~10 bits of surprise: three of them lift the mean of 4 above 6 bits.
    let o = stream(&rig, &chat("[[script:normal tokens=5 low_at=1,2,3]]", true))?;
    halted_by(&rig, &o, "SURPRISE_THRESHOLD", "surprise")?;
    ensure!(o.tokens < 4, "tokens {}", o.tokens);
    Ok(())
}

#[test]
fn an_external_scorer_feeds_the_halt_monitor_and_fails_closed() -> Result<()> {
    let dir = temp_dir("scorer")?;
    let sock = dir.join("scorer.sock");
    let mut scorer = std::process::Command::new(SCORER_BIN)
        .arg("--socket")
        .arg(&sock)
        .args(["--fail-on-text", "forbidden"])
        .stdout(std::process::Stdio::null())
        .spawn()?;
    let slow_sock = dir.join("slow.sock");
    let mut slow = std::process::Command::new(SCORER_BIN)
        .arg("--socket")
        .arg(&slow_sock)
        .args(["--delay-ms", "100"])
        .stdout(std::process::Stdio::null())
        .spawn()?;
    for s in [&sock, &slow_sock] {
        for _ in 0..200 {
            if s.exists() {
                break;
            }
            thread::sleep(Duration::from_millis(10));
        }
    }
    let result = (|| -> Result<()> {
        let r = rig(
            &format!(
                "[detectors.halt_monitor]\nhard_limit = 0.5\nscorer = {{ unix = \"{}\", deadline_us = 50000 }}\n",
                sock.display()
            ),
            &[],
        )?;
        let o = stream(
            &r,
            &chat(
                "[[script:normal tokens=6 words=\"The, plan, is, forbidden, now, ok\"]]",
                true,
            ),
        )?;
        halted_by(&r, &o, "COHERENCE_BELOW_THRESHOLD", "halt_monitor")?;
        ensure!(
            o.tokens <= 3 && !o.text.contains("forbidden"),
            "the failing token is never emitted: {:?}",
            o.text
        );
        drop(r);
        // A scorer slower than its deadline: the first token fails closed.
        let r = rig(
            &format!(
                "[detectors.halt_monitor]\nhard_limit = 0.5\nscorer = {{ unix = \"{}\", deadline_us = 5000 }}\n",
                slow_sock.display()
            ),
            &[],
        )?;
        let o = stream(&r, &chat("[[script:normal tokens=6]]", true))?;
        halted_by(&r, &o, "DETECTOR_FAILURE", "halt_monitor")?;
        ensure!(o.tokens == 0, "{}", o.tokens);
        Ok(())
    })();
    let _ = scorer.kill();
    let _ = slow.kill();
    let _ = scorer.wait();
    let _ = slow.wait();
    let _ = fs::remove_dir_all(&dir);
    result
}

/// Issue 11: an external scorer that stalls on one stream holds up that stream only. With one
/// worker, the stalled stream's every token waits 250 ms for its score (within the 1 s
/// deadline), while another stream on the same worker gets all its tokens meanwhile: its
/// tokens are never queued behind the stalled stream's wait.
#[test]
fn a_scorer_stalled_on_one_stream_does_not_hold_up_another() -> Result<()> {
    const VICTIM_TOKENS: usize = 8;
    const OTHER_TOKENS: usize = 20;
    let dir = temp_dir("scorer-stall")?;
    let sock = dir.join("scorer.sock");
    let mut scorer = std::process::Command::new(SCORER_BIN)
        .arg("--socket")
        .arg(&sock)
        .args(["--stall-on-text", "Stallword", "--stall-ms", "250"])
        .stdout(std::process::Stdio::null())
        .spawn()?;
    for _ in 0..200 {
        if sock.exists() {
            break;
        }
        thread::sleep(Duration::from_millis(10));
    }
    let result = (|| -> Result<()> {
        let r = rig(
            &format!(
                "[detectors.halt_monitor]\nhard_limit = 0.5\nscorer = {{ unix = \"{}\", deadline_us = 1000000 }}\n",
                sock.display()
            ),
            &["--workers", "1"],
        )?;
        let victim_tokens = std::sync::atomic::AtomicUsize::new(0);
        let (victim, other, victim_seen) = thread::scope(|s| {
            let victim = s.spawn(|| {
                let key = sse::fresh_key();
                r.stream(
                    "/v1/chat/completions",
                    &chat(
                        "[[script:normal tokens=8 words=\"Stallword, a, b, c, d, e, f, g\"]]",
                        true,
                    ),
                    Some(&key),
                    |p, _| {
                        victim_tokens.store(p.tokens, std::sync::atomic::Ordering::SeqCst);
                    },
                )
            });
            // The victim's first token is with the scorer by now (it takes at least 2 s
            // in all: 8 tokens of 250 ms each).
            thread::sleep(Duration::from_millis(200));
            let other = stream(&r, &chat("[[script:normal tokens=20]]", true));
            let seen = victim_tokens.load(std::sync::atomic::Ordering::SeqCst);
            (victim.join(), other, seen)
        });
        let other = other?;
        ensure!(
            other.finish_reason.as_deref() == Some("stop") && other.tokens == OTHER_TOKENS,
            "the other stream: {:?}",
            other.events
        );
        ensure!(
            victim_seen < VICTIM_TOKENS,
            "the other stream waited for the stalled one: it ended after the stalled stream \
             had all {victim_seen} of its tokens"
        );
        let victim = victim.map_err(|_| anyhow::anyhow!("victim thread panicked"))??;
        ensure!(
            victim.finish_reason.as_deref() == Some("stop") && victim.tokens == VICTIM_TOKENS,
            "the stalled stream still gets every token, each judged: {:?}",
            victim.events
        );
        Ok(())
    })();
    let _ = scorer.kill();
    let _ = scorer.wait();
    let _ = fs::remove_dir_all(&dir);
    result
}

#[test]
fn safety_check_enforce_trips_on_a_fabricated_source_and_records_every_verdict() -> Result<()> {
    let rig = rig("[safety]\nmode = \"enforce\"\n", &[])?;
    // The URL is assembled from two tokens, so the request (holding the script) never
    // names it whole.
    let o = stream(
        &rig,
        &chat(
            "[[script:normal tokens=4 words=\"See, https://evil,.example/x, .\"]]",
            true,
        ),
    )?;
    let turn = halted_by(&rig, &o, "SAFETY_BOUNDARY_VIOLATED", "safety")?;
    ensure!(
        turn["safety_verdict"]["violated_boundaries"][0] == "no_fabricated_source",
        "{turn}"
    );
    // The same citation is fine when the request gave that source.
    let o = stream(
        &rig,
        &chat(
            "Use https://evil.example/x as your source. [[script:normal tokens=4 words=\"See, https://evil,.example/x, .\"]]",
            true,
        ),
    )?;
    ensure!(o.finish_reason.as_deref() == Some("stop"), "{:?}", o.events);
    let turn = rig.record("turn", &o.stream_id)?;
    ensure!(turn["safety_verdict"]["upheld"] == true, "{turn}");
    Ok(())
}

#[test]
fn latency_anomaly_trips_on_a_slowed_stream_after_a_learned_baseline() -> Result<()> {
    let rig = rig(
        "[detectors.latency_anomaly]\nmode = \"hard\"\nwarmup_samples = 40\nwarmup_turns = 3\nbaseline_alpha = 0.05\n",
        &[],
    )?;
    // Teach the baseline: clean turns at a steady pace.
    for _ in 0..3 {
        let o = stream(&rig, &chat("[[script:normal tokens=25 pace_ms=4]]", true))?;
        ensure!(o.finish_reason.as_deref() == Some("stop"), "{:?}", o.events);
    }
    let o = stream(&rig, &chat("[[script:normal tokens=60 pace_ms=60]]", true))?;
    let turn = halted_by(&rig, &o, "TIMING_DISTRIBUTION_ANOMALY", "latency_anomaly")?;
    ensure!(turn["tig_breach"] == true, "{turn}");
    ensure!(o.tokens < 60, "{}", o.tokens);
    Ok(())
}

#[test]
fn bad_detector_config_is_refused_at_start() -> Result<()> {
    let pair = NetPair::new()?;
    let dir = temp_dir("badcfg")?;
    for (text, needle) in [
        ("[detectors.surprise]\nwindw = 3\n", "detectors.surprise"),
        ("[detectors.nope]\n", "detectors.nope"),
        ("[detectors.exfil]\nextra_patterns = [\"(\"]\n", "exfil"),
        ("[safety]\nmode = \"loud\"\n", "safety"),
        (
            "[safety]\nboundaries = [\"no_fabricated_source\"]\n",
            "safety.boundaries",
        ),
        (
            "[[safety.predicates]]\nname = \"p\"\nfield = \"nope\"\nop = \"max\"\nvalue = 1\n",
            "safety.predicates[0].field",
        ),
        (
            "[[safety.predicates]]\nname = \"p\"\nfield = \"model_answered\"\nop = \"matches\"\nvalue = \"(\"\n",
            "safety.predicates[0].value",
        ),
        (
            "[flight_recorder]\nturn_sample_rate = 0.0\n",
            "flight_recorder.turn_sample_rate",
        ),
    ] {
        let path = dir.join("bad.toml");
        fs::write(&path, text)?;
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", &pair.srv])
            .arg(haltd_tests::haltd_bin()?)
            .args(["serve", "--ledger"])
            .arg(dir.join("l.jsonl"))
            .arg("--config")
            .arg(&path)
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(!out.status.success(), "{text}: started");
        ensure!(
            err.contains(needle),
            "{text}: error does not name {needle}: {err}"
        );
    }
    Ok(())
}

/// Of `tokens`, in order: how many the exfiltration scanner (default rules) holds text after
/// by their push alone, and how many still after a look-ahead at the next token.
fn held_tokens(tokens: &[&str]) -> Result<(usize, usize)> {
    let rules = Arc::new(ExfilRules::new(&ExfilConfig::default())?);
    let mut sc = ExfilScanner::new(rules);
    let (mut by_push, mut after_look_ahead) = (0, 0);
    for (i, tok) in tokens.iter().enumerate() {
        sc.push(tok);
        by_push += usize::from(sc.held_bytes() > 0);
        sc.look_ahead(tokens.get(i + 1).map_or(Ahead::End, |t| Ahead::Text(t)));
        after_look_ahead += usize::from(sc.held_bytes() > 0);
    }
    Ok((by_push, after_look_ahead))
}

#[test]
fn builtin_tokens_the_next_token_clears_are_not_held_back() -> Result<()> {
    // Issue 11: a built-in token that leaves text held after its push (" a" could begin
    // `api_key`) but that the next token rules out goes out on its own tick. Without the
    // look-ahead it would wait one interval (200 ms, over the largest finite bucket of
    // `haltd_token_overhead_seconds`) for the next token, and that token one more behind it.
    const N: usize = 30;
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &["--builtin-token-interval-us", "200000"])?;
    let url = format!("{}/v1/completions", haltd.api_url());
    // Seed 11 gives 4 such tokens in 30 (and none the look-ahead cannot clear).
    let body = json!({"model": "builtin", "prompt": "Tell me about rivers", "seed": 11,
        "max_tokens": N, "ignore_eos": true, "stream": true});
    let o = in_netns(&haltd.client_ns, move || {
        sse::stream(&url, &body, Duration::from_secs(60), |_, _| {})
    })?;
    ensure!(o.tokens == N, "{:?}", o.events);
    let tokens: Vec<&str> = o
        .events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Token(t) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    let (by_push, after_look_ahead) = held_tokens(&tokens)?;
    ensure!(
        by_push > after_look_ahead,
        "no token the look-ahead clears in {:?} ({by_push}, {after_look_ahead})",
        o.text
    );
    let m = haltd.metrics()?;
    let family = "haltd_token_overhead_seconds";
    let count = m.histogram_count(family)?;
    let within = m
        .buckets(family)
        .iter()
        .filter(|(le, _)| le.is_finite())
        .map(|(_, c)| *c)
        .fold(0.0, f64::max);
    ensure!(count == N as f64, "{family} count {count}");
    ensure!(
        count - within <= after_look_ahead as f64,
        "{} tokens waited over 164 ms (held by their push: {by_push}, after the look-ahead: \
         {after_look_ahead}) in {:?}",
        count - within,
        o.text
    );
    Ok(())
}
