use super::*;

#[test]
fn http_1_1_keeps_the_connection_unless_the_client_says_close() {
    let head = |conn: &str| {
        let req = format!("GET / HTTP/1.1\r\nhost: x\r\n{conn}\r\n");
        parse_head(req.as_bytes(), 10)
            .expect("valid")
            .expect("complete")
    };
    assert!(head("").keep_alive);
    assert!(head("connection: upgrade\r\n").keep_alive);
    assert!(head("connection: keep-alive\r\n").keep_alive);
    assert!(head("Connection: Upgrade, Keep-Alive\r\n").keep_alive);
    assert!(!head("connection: close\r\n").keep_alive);
    assert!(!head("connection: keep-alive\r\nconnection: close\r\n").keep_alive);
}

#[test]
fn the_conversation_header_is_kept_or_refused() {
    let head = |h: &str| {
        let req = format!("GET / HTTP/1.1\r\nhost: x\r\n{h}\r\n");
        parse_head(req.as_bytes(), 10).map(|h| h.expect("complete").conversation_id)
    };
    assert_eq!(head(""), Ok(None));
    assert_eq!(
        head("X-Haltd-Conversation-Id:  c-42 \r\n"),
        Ok(Some("c-42".to_owned()))
    );
    let refused = |h: &str| head(h).expect_err(h).status;
    assert_eq!(refused("x-haltd-conversation-id: \r\n"), 400);
    assert_eq!(refused("x-haltd-conversation-id: a b\r\n"), 400);
    let long = "x".repeat(129);
    assert_eq!(
        refused(&format!("x-haltd-conversation-id: {long}\r\n")),
        400
    );
    assert_eq!(
        refused("x-haltd-conversation-id: a\r\nx-haltd-conversation-id: a\r\n"),
        400
    );
}

#[test]
fn a_chunk_is_its_hex_size_the_payload_and_crlfs() {
    let mut out = b"head|".to_vec();
    out.extend_from_slice(&[b'x'; 300]);
    chunk_in_place(&mut out, 5);
    assert!(out.starts_with(b"head|12c\r\nxxx"));
    assert!(out.ends_with(b"xxx\r\n"));
    assert_eq!(out.len(), 5 + 300 + chunk_overhead(300) as usize);
    let mut one = b"a".to_vec();
    chunk_in_place(&mut one, 0);
    assert_eq!(one, b"1\r\na\r\n");
    // The bound covers every payload up to it.
    for max in [1_u32, 15, 16, 255, 256, 4095, 4096, 70_000] {
        for len in [1, max / 2 + 1, max] {
            let mut f = vec![b'y'; len as usize];
            chunk_in_place(&mut f, 0);
            assert!(
                f.len() <= (max + chunk_overhead(max)) as usize,
                "{len} of {max}"
            );
        }
    }
}

#[test]
fn a_kept_head_says_so_and_is_chunked_without_a_length() {
    let mut out = Vec::new();
    write_head_persist(
        &mut out,
        200,
        "text/event-stream",
        None,
        None,
        &[],
        Persist::KeepAlive,
    );
    let text = String::from_utf8(out).expect("ascii");
    assert!(text.ends_with("transfer-encoding: chunked\r\nconnection: keep-alive\r\n\r\n"));
    let mut out = Vec::new();
    write_head_persist(
        &mut out,
        200,
        "application/json",
        Some(2),
        None,
        &[],
        Persist::KeepAlive,
    );
    let text = String::from_utf8(out).expect("ascii");
    assert!(text.ends_with("content-length: 2\r\nconnection: keep-alive\r\n\r\n"));
    assert!(!text.contains("chunked"));
}

#[test]
fn parses_a_complete_post() {
    let req = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello";
    let head = parse_head(req, 100).expect("valid").expect("complete");
    assert_eq!(head.method, "POST");
    assert_eq!(head.path, "/v1/completions");
    assert_eq!(head.content_length, 5);
    assert_eq!(&req[head.head_len..], b"hello");
}

#[test]
fn partial_heads_wait_for_more() {
    assert!(matches!(
        parse_head(b"POST /v1/completions HTTP/1.1\r\nHost", 100),
        Ok(None)
    ));
}

#[test]
fn refuses_bad_input_with_precise_statuses() {
    let status = |req: &[u8]| parse_head(req, 10).expect_err("refused").status;
    assert_eq!(status(b"GARBAGE\x01 / HTTP/1.1\r\n\r\n"), 400);
    assert_eq!(
        status(b"POST / HTTP/1.1\r\nContent-Length: 11\r\n\r\n"),
        413
    );
    assert_eq!(
        status(b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n"),
        400
    );
    assert_eq!(
        status(b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"),
        400
    );
    assert_eq!(
        status(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"),
        411
    );
    assert_eq!(status(b"POST / HTTP/1.0\r\n\r\n"), 505);
    let many: Vec<u8> = [
        &b"GET / HTTP/1.1\r\n"[..],
        &b"a: b\r\n".repeat(100),
        b"\r\n",
    ]
    .concat();
    assert_eq!(status(&many), 431);
    let huge = [
        &b"GET / HTTP/1.1\r\nx: "[..],
        &vec![b'a'; MAX_HEAD_BYTES + 10],
    ]
    .concat();
    assert_eq!(status(&huge), 431);
}

#[test]
fn a_refused_head_still_names_its_path() {
    let two_keys =
        b"POST /v1/messages?beta=true HTTP/1.1\r\nx-api-key: a\r\nauthorization: Bearer b\r\n\r\n";
    assert_eq!(parse_head(two_keys, 100).expect_err("refused").status, 400);
    assert_eq!(request_path(two_keys), Some("/v1/messages"));
    assert_eq!(request_path(b"GET /healthz HTTP/1.1\n"), Some("/healthz"));
    for no_path in [
        &b"POST /v1/messages HTTP/1.1"[..],
        b"POST /v1/messages\r\n",
        b"POST v1/messages HTTP/1.1\r\n",
        b"POST /v1/messages HTTP/1.1 x\r\n",
        b"POST /\xff HTTP/1.1\r\n",
    ] {
        assert_eq!(
            request_path(no_path),
            None,
            "{:?}",
            String::from_utf8_lossy(no_path)
        );
    }
}

#[test]
fn error_responses_are_openai_shaped_json() {
    let mut out = Vec::new();
    write_error_response(
        &mut out,
        &HttpError::bad_request("bad \"json\""),
        None,
        None,
        crate::wire::Endpoint::Chat,
    );
    let text = String::from_utf8(out).expect("utf8");
    let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
    assert!(head.starts_with("HTTP/1.1 400 Bad Request\r\n"));
    assert!(head.contains(&format!("content-length: {}", body.len())));
    let v: serde_json::Value = serde_json::from_str(body).expect("json");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["message"], "bad \"json\"");
}

#[test]
fn an_error_not_to_be_retried_says_so_in_every_schema() {
    let err = HttpError::new(409, "tool_circuit_open", "stopped")
        .with_code("TOOL_CIRCUIT_OPEN")
        .without_retry();
    for schema in [
        crate::wire::Endpoint::Chat,
        crate::wire::Endpoint::Responses,
        crate::wire::Endpoint::Messages,
    ] {
        let mut out = Vec::new();
        write_error_response(&mut out, &err, None, Some("r1"), schema);
        let text = String::from_utf8(out).expect("utf8");
        let (head, _) = text.split_once("\r\n\r\n").expect("head and body");
        assert!(head.starts_with("HTTP/1.1 409 Conflict\r\n"), "{head}");
        assert!(head.contains("\r\nx-should-retry: false\r\n"), "{head}");
        assert!(head.contains("\r\nx-request-id: r1\r\n"), "{head}");
    }
    let mut out = Vec::new();
    write_error_response(
        &mut out,
        &HttpError::bad_request("no"),
        None,
        None,
        crate::wire::Endpoint::Chat,
    );
    assert!(!String::from_utf8_lossy(&out).contains("x-should-retry"));
}

proptest::proptest! {
    /// Hostile bytes never panic the parser, and every refusal is a 4xx/5xx it can send.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..2048), max_body in 0usize..4096) {
        match parse_head(&bytes, max_body) {
            Ok(Some(h)) => {
                proptest::prop_assert!(h.head_len <= bytes.len());
                proptest::prop_assert!(h.content_length <= max_body);
            }
            Ok(None) => proptest::prop_assert!(bytes.len() <= MAX_HEAD_BYTES),
            Err(e) => proptest::prop_assert!((400..=505).contains(&e.status) && reason(e.status) != "Unknown"),
        }
    }

    /// Heads built from arbitrary header names and values parse or are refused cleanly.
    #[test]
    fn arbitrary_headers_never_panic(headers in proptest::collection::vec(("[ -~]{0,20}", "[ -~]{0,40}"), 0..80)) {
        let mut req = b"POST /v1/chat/completions HTTP/1.1\r\n".to_vec();
        for (k, v) in &headers {
            req.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
        }
        req.extend_from_slice(b"\r\n");
        if let Err(e) = parse_head(&req, 1 << 20) {
            proptest::prop_assert!((400..=505).contains(&e.status));
        }
    }
}

#[test]
fn authorization_is_kept_redacted_and_checked() {
    let req =
        b"POST /v1/completions HTTP/1.1\r\nAuthorization: Bearer sk-1\r\ncontent-length: 0\r\n\r\n";
    let head = parse_head(req, 100).expect("valid").expect("complete");
    let auth = head.authorization.as_ref().expect("kept");
    assert_eq!(auth.as_str(), "Bearer sk-1");
    assert!(
        !format!("{head:?}").contains("sk-1"),
        "Debug must not show the key"
    );
    let twice = b"GET / HTTP/1.1\r\nauthorization: a\r\nauthorization: b\r\n\r\n";
    assert_eq!(parse_head(twice, 100).expect_err("refused").status, 400);
    let binary = b"GET / HTTP/1.1\r\nauthorization: \xff\xfe\r\n\r\n";
    assert_eq!(parse_head(binary, 100).expect_err("refused").status, 400);
}

#[test]
fn messages_errors_are_anthropic_shaped_with_haltd_s_code() {
    let cases = [
        (
            HttpError::bad_request("max_tokens: required"),
            "invalid_request_error",
        ),
        (
            HttpError::new(404, "invalid_request_error", "no").with_code("unsupported_endpoint"),
            "not_found_error",
        ),
        (
            HttpError::new(429, "rate_limit", "slow down"),
            "rate_limit_error",
        ),
        (
            HttpError::new(503, "server_error", "down").with_code("recorder_failed"),
            "overloaded_error",
        ),
        (HttpError::new(502, "server_error", "bad"), "api_error"),
    ];
    for (err, kind) in cases {
        let mut out = Vec::new();
        write_error_response(&mut out, &err, None, None, crate::wire::Endpoint::Messages);
        let text = String::from_utf8(out).expect("utf8");
        let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
        assert!(
            head.starts_with(&format!("HTTP/1.1 {} ", err.status)),
            "{head}"
        );
        let v: serde_json::Value = serde_json::from_str(body).expect("json");
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], kind);
        assert_eq!(v["error"]["message"], err.message.as_str());
        assert_eq!(v["error"]["code"].as_str(), err.code);
    }
}
