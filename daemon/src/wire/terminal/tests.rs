use haltd_common::{NONCE_LEN, NONCE_OFFSET};

use super::*;

fn id() -> StreamId {
    StreamId {
        slot: 3,
        generation: 9,
    }
}

fn halt() -> Halt {
    Halt {
        stream_id: id(),
        endpoint: Endpoint::Chat,
        created: 1,
        model: "builtin".into(),
        code: FailureCode::OperatorTrip,
        trip_token_index: 12,
        post_trip_tokens: 2,
        nonce: 0xfeed_f00d_0000_0001,
        degraded: false,
        detail: Vec::new(),
        request_id: None,
        sequence: 0,
    }
}

#[test]
fn terminal_frames_carry_the_nonce_where_the_gate_looks() {
    for endpoint in [
        Endpoint::Chat,
        Endpoint::Completion,
        Endpoint::Messages,
        Endpoint::Responses,
    ] {
        for code in [FailureCode::OperatorTrip, FailureCode::UpstreamFailure] {
            let h = Halt {
                endpoint,
                code,
                ..halt()
            };
            nonce_at_the_offset(&h);
        }
    }
}

fn nonce_at_the_offset(h: &Halt) {
    for frame in [
        {
            let mut o = Vec::new();
            h.sse_terminal(&mut o);
            o
        },
        {
            let mut o = Vec::new();
            h.sse_terminal_chunked(&mut o);
            o
        },
        {
            let mut o = Vec::new();
            h.http_terminal(&mut o, true);
            o
        },
        {
            let mut o = Vec::new();
            h.http_terminal(&mut o, false);
            o
        },
    ] {
        assert_eq!(
            &frame[NONCE_OFFSET..NONCE_OFFSET + NONCE_LEN],
            b"feedf00d00000001"
        );
    }
}

#[test]
fn sse_terminal_is_content_filter_then_error_then_done() {
    let mut o = Vec::new();
    halt().sse_terminal(&mut o);
    let text = String::from_utf8(o).expect("utf8");
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 3, "{text}");
    let first = events[0]
        .lines()
        .find(|l| l.starts_with("data: "))
        .expect("data line");
    let chunk: Value = serde_json::from_str(&first[6..]).expect("json");
    assert_eq!(chunk["choices"][0]["finish_reason"], "content_filter");
    let err: Value = serde_json::from_str(&events[1][6..]).expect("json");
    assert_eq!(err["error"]["type"], "halted");
    assert_eq!(err["error"]["code"], "OPERATOR_TRIP");
    assert_eq!(err["error"]["trip_token_index"], 12);
    assert_eq!(err["error"]["post_trip_tokens"], 2);
    assert_eq!(events[2], "data: [DONE]");
}

#[test]
fn the_chunked_terminal_is_one_chunk_then_the_last_chunk() {
    let (mut plain, mut chunked) = (Vec::new(), Vec::new());
    halt().sse_terminal(&mut plain);
    halt().sse_terminal_chunked(&mut chunked);
    let size_end = chunked
        .windows(2)
        .position(|w| w == b"\r\n")
        .expect("size line");
    assert_eq!(size_end, 8);
    let size = usize::from_str_radix(std::str::from_utf8(&chunked[..8]).expect("hex"), 16)
        .expect("hex size");
    let payload = &chunked[10..10 + size];
    assert_eq!(&chunked[10 + size..], b"\r\n0\r\n\r\n");
    // The payload is the plain terminal with ten fewer spaces before the nonce.
    assert!(payload.starts_with(b": haltd-halt "));
    assert_eq!(payload.len() + 10, plain.len());
    assert_eq!(&payload[21..], &plain[31..]);
}

/// The SSE events of a frame (after the nonce comment): (event name, data JSON).
fn messages_events(frame: &[u8]) -> Vec<(String, Value)> {
    let text = std::str::from_utf8(frame).expect("utf8");
    let sse = text.split_once("\r\n\r\n").map_or(text, |(_, body)| body);
    sse.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let mut lines = e.lines().filter(|l| !l.starts_with(':'));
            let name = lines.next().and_then(|l| l.strip_prefix("event: "));
            let data = lines.next().and_then(|l| l.strip_prefix("data: "));
            let data: Value = serde_json::from_str(data.expect("data")).expect("json");
            (name.expect("event").to_owned(), data)
        })
        .collect()
}

#[test]
fn a_halted_messages_stream_ends_with_a_refusal_and_message_stop() {
    let h = Halt {
        endpoint: Endpoint::Messages,
        ..halt()
    };
    let mut sse = Vec::new();
    h.sse_terminal(&mut sse);
    let ev = messages_events(&sse);
    let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["message_delta", "message_stop"]);
    assert_eq!(ev[0].1["delta"]["stop_reason"], "refusal");
    assert_eq!(ev[0].1["haltd"]["code"], "OPERATOR_TRIP");
    assert_eq!(ev[0].1["haltd"]["post_trip_tokens"], 2);
    assert_eq!(ev[0].1["usage"]["output_tokens"], 14);
    // A whole response: no head went out before, so message_start comes first.
    let mut whole = Vec::new();
    h.http_terminal(&mut whole, true);
    let ev = messages_events(&whole);
    let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["message_start", "message_delta", "message_stop"]);
    let failed = Halt {
        code: FailureCode::UpstreamFailure,
        ..h.clone()
    };
    let mut sse = Vec::new();
    failed.sse_terminal(&mut sse);
    let ev = messages_events(&sse);
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].0, "error");
    assert_eq!(ev[0].1["error"]["type"], "api_error");
    assert_eq!(ev[0].1["error"]["haltd"]["code"], "UPSTREAM_FAILURE");
    let v: Value = serde_json::from_slice(&h.degraded_body()).expect("json");
    assert_eq!(v["type"], "message");
    assert_eq!(v["content"], serde_json::json!([]));
    assert_eq!(v["stop_reason"], "refusal");
    assert_eq!(v["haltd"]["code"], "OPERATOR_TRIP");
}

#[test]
fn a_halted_responses_stream_ends_with_response_incomplete() {
    let h = Halt {
        endpoint: Endpoint::Responses,
        sequence: 9,
        ..halt()
    };
    let mut sse = Vec::new();
    h.sse_terminal(&mut sse);
    let ev = messages_events(&sse);
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].0, "response.incomplete");
    assert_eq!(ev[0].1["type"], "response.incomplete");
    // The next number at the trip and three per post-trip token.
    assert_eq!(ev[0].1["sequence_number"], 9 + 3 * 2);
    let r = &ev[0].1["response"];
    crate::wire::responses::encode::tests::check_response(r);
    assert_eq!(r["id"], "resp_hs_0000000900000003");
    assert_eq!(r["status"], "incomplete");
    assert_eq!(r["incomplete_details"]["reason"], "content_filter");
    assert_eq!(r["haltd"]["code"], "OPERATOR_TRIP");
    assert_eq!(r["haltd"]["trip_token_index"], 12);
    assert_eq!(r["haltd"]["post_trip_tokens"], 2);
    assert_eq!(r["usage"]["output_tokens"], 14);
    // A whole response: the start events first, numbered 0 and 1, the terminal 2.
    let mut whole = Vec::new();
    h.http_terminal(&mut whole, true);
    let ev = messages_events(&whole);
    let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.incomplete"
        ]
    );
    for (i, (_, d)) in ev.iter().enumerate() {
        assert_eq!(d["sequence_number"], i);
    }
    // An upstream failure: an error event with an `error` member (the SDK's APIError).
    let failed = Halt {
        code: FailureCode::UpstreamFailure,
        ..h.clone()
    };
    let mut sse = Vec::new();
    failed.sse_terminal(&mut sse);
    let ev = messages_events(&sse);
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].0, "error");
    assert_eq!(ev[0].1["error"]["code"], "UPSTREAM_FAILURE");
    assert_eq!(
        ev[0].1["message"],
        "stream halted by haltd: UPSTREAM_FAILURE"
    );
    // A halted batch: the Response, incomplete for a halt, failed for the upstream.
    let v: Value = serde_json::from_slice(&h.degraded_body()).expect("json");
    crate::wire::responses::encode::tests::check_response(&v);
    assert_eq!(v["status"], "incomplete");
    assert_eq!(v["incomplete_details"]["reason"], "content_filter");
    assert_eq!(v["output"], json!([]));
    assert_eq!(v["haltd"]["code"], "OPERATOR_TRIP");
    let v: Value = serde_json::from_slice(&failed.degraded_body()).expect("json");
    assert_eq!(v["status"], "failed");
    assert_eq!(v["error"]["code"], "server_error");
}

#[test]
fn degraded_batch_body_has_no_content_and_the_error() {
    let v: Value = serde_json::from_slice(&halt().degraded_body()).expect("json");
    assert_eq!(v["choices"][0]["message"]["content"], "");
    assert_eq!(v["choices"][0]["finish_reason"], "content_filter");
    assert_eq!(v["error"]["code"], "OPERATOR_TRIP");
}
