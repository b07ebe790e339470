//! haltd's logs with `--log-format json`: every line a run writes, on stdout and stderr, is one
//! flat JSON object (no nested `fields` or span objects), with no duplicate key and no Rust
//! debug text in a value, and no ANSI colour in a file.

use std::{collections::BTreeMap, fmt, time::Duration};

use anyhow::{bail, ensure, Context, Result};
use haltd_tests::{in_netns, raw_exchange, require_root, sse, trip_here, Haltd, NetPair};
use serde::{
    de::{self, MapAccess, SeqAccess, Visitor},
    Deserialize, Deserializer,
};
use serde_json::Value;

/// A JSON value parsed with duplicate object keys refused (serde_json keeps the last one).
struct Strict(Value);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Strict;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }
    fn visit_str<E>(self, v: &str) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }
    fn visit_unit<E>(self) -> Result<Strict, E> {
        Ok(Strict(Value::Null))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Strict, A::Error> {
        let mut out = Vec::new();
        while let Some(Strict(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Strict(Value::Array(out)))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Strict, A::Error> {
        let mut out = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let Strict(v) = map.next_value()?;
            if out.insert(key.clone(), v).is_some() {
                return Err(de::Error::custom(format!("duplicate key {key:?}")));
            }
        }
        Ok(Strict(Value::Object(out)))
    }
}

/// Checks one log line: a flat JSON object with the keys every line has, no duplicate key, no
/// nested object, no debug-formatted value and no ANSI escape.
fn check_line(line: &str) -> Result<BTreeMap<String, Value>> {
    ensure!(!line.contains('\u{1b}'), "an ANSI escape in {line:?}");
    let Strict(v) =
        serde_json::from_str(line).with_context(|| format!("not strict JSON: {line}"))?;
    let Value::Object(obj) = v else {
        bail!("not a JSON object: {line}")
    };
    for key in ["timestamp", "level", "message"] {
        ensure!(
            obj.get(key).is_some_and(Value::is_string),
            "no {key} in {line}"
        );
    }
    for (k, v) in &obj {
        ensure!(!v.is_object() && !v.is_array(), "{k} is not flat in {line}");
        if let Some(s) = v.as_str() {
            let debug = ["Some(", "None", "\\\"", "Ok(", "Err("];
            ensure!(
                !debug.iter().any(|d| s.starts_with(d)),
                "{k} holds debug text in {line}"
            );
        }
    }
    Ok(obj.into_iter().collect())
}

/// Every line haltd wrote on stdout and stderr, each checked; returns them parsed.
fn check_all(haltd: &Haltd) -> Result<Vec<BTreeMap<String, Value>>> {
    let mut out = Vec::new();
    for name in ["stdout.log", "stderr.log"] {
        for line in haltd.log_file(name)?.lines() {
            out.push(check_line(line).with_context(|| format!("in {name}"))?);
        }
    }
    Ok(out)
}

/// Streams a turn of 30 tokens and trips it through the admin API after 5.
fn tripped_turn(haltd: &Haltd) -> Result<()> {
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    let admin = haltd.admin_url();
    let out = in_netns(&haltd.client_ns, move || {
        let mut tripped = false;
        sse::stream(
            &url,
            &sse::chat_body("logs", 30, true),
            Duration::from_secs(30),
            |p, _| {
                if !tripped && p.tokens >= 5 {
                    tripped = true;
                    let trip = format!("{admin}/admin/streams/{}/trip", p.stream_id);
                    if let Err(e) = trip_here(&trip, Some("OPERATOR_TRIP")) {
                        eprintln!("trip failed: {e:#}");
                    }
                }
            },
        )
    })?;
    out.halted_cleanly("OPERATOR_TRIP")
}

/// Posts a chat turn of 5 tokens; returns the status.
fn chat(haltd: &Haltd) -> Result<u16> {
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    in_netns(&haltd.client_ns, move || {
        Ok(sse::post(
            &url,
            &sse::chat_body("logs", 5, true),
            Duration::from_secs(10),
        )?
        .0)
    })
}

/// Posts a body that is not JSON; returns the status.
fn malformed(haltd: &Haltd) -> Result<u16> {
    let addr = haltd.api;
    let request = b"POST /v1/chat/completions HTTP/1.1\r\nhost: haltd\r\ncontent-type: application/json\r\ncontent-length: 9\r\n\r\n{not json";
    in_netns(&haltd.client_ns, move || {
        Ok(raw_exchange(addr, request, Duration::from_secs(10))?.status)
    })
}

#[test]
fn json_logs_are_one_flat_object_per_line() -> Result<()> {
    require_root()?;
    let pair = NetPair::new()?;
    let json = ["--log-format", "json"];
    let debug = ["env", "HALTD_LOG=debug"];
    // The built-in source: a normal turn, a tripped one, a refused request, then SIGTERM.
    let mut haltd = Haltd::start_wrapped(&pair, None, &debug, &json)?;
    ensure!(chat(&haltd)? == 200);
    tripped_turn(&haltd)?;
    ensure!(malformed(&haltd)? == 400);
    haltd.stop()?;
    let lines = check_all(&haltd)?;
    let messages: Vec<&str> = lines.iter().filter_map(|l| l["message"].as_str()).collect();
    for want in [
        "haltd ready",
        "stream tripped",
        "request refused",
        "ledger opened",
    ] {
        ensure!(messages.contains(&want), "no {want:?} line in {messages:?}");
    }
    let ready = lines
        .iter()
        .find(|l| l["message"] == "haltd ready")
        .context("ready")?;
    ensure!(
        ready.contains_key("listen") && ready.contains_key("commit"),
        "{ready:?}"
    );
    let refused = lines
        .iter()
        .find(|l| l["message"] == "request refused")
        .context("refused")?;
    ensure!(
        refused.contains_key("detail") && refused.contains_key("stream_id"),
        "{refused:?}"
    );
    drop(haltd);

    // An upstream nobody listens at: an `upstream failure` line.
    let pair = NetPair::new()?;
    let upstream = [
        "--log-format",
        "json",
        "--source",
        "openai",
        "--upstream",
        "http://127.0.0.1:9",
    ];
    let haltd = Haltd::start(&pair, &upstream)?;
    ensure!(chat(&haltd)? == 502);
    let lines = check_all(&haltd)?;
    let failure = lines
        .iter()
        .find(|l| l["message"] == "upstream failure")
        .with_context(|| format!("no upstream failure line in {lines:?}"))?;
    ensure!(
        failure["kind"] == "connect_refused" && failure["source"] == "upstream",
        "{failure:?}"
    );
    Ok(())
}
