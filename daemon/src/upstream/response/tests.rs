use proptest::prelude::*;

use super::*;

const MAX: usize = 16 * 1024;

/// Feeds `input` in one piece, then EOF.
fn read_all(input: &[u8]) -> (Result<(), ResponseError>, Option<ResponseHead>, Vec<u8>) {
    let mut r = ResponseReader::new(MAX);
    let mut body = Vec::new();
    let res = r.feed(input, &mut body).map(|_| ()).and_then(|()| r.eof());
    (res, r.head().cloned(), body)
}

fn read_ok(input: &[u8]) -> (ResponseHead, Vec<u8>) {
    let (res, head, body) = read_all(input);
    res.unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(input)));
    (head.expect("head"), body)
}

#[test]
fn vllm_sse_response_chunked() {
    // uvicorn (vLLM) streams SSE with chunked framing, one chunk per event.
    let ev1 = "data: {\"id\":\"chatcmpl-1\",\"choices\":[]}\n\n";
    let ev2 = "data: [DONE]\n\n";
    let input = format!(
        "HTTP/1.1 200 OK\r\ndate: Mon, 01 Jan 2024 00:00:00 GMT\r\nserver: uvicorn\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{ev1}\r\n{:x}\r\n{ev2}\r\n0\r\n\r\n",
        ev1.len(),
        ev2.len()
    );
    let (head, body) = read_ok(input.as_bytes());
    assert_eq!(head.status, 200);
    assert_eq!(head.reason, "OK");
    assert!(head.is_event_stream());
    assert!(!head.is_json());
    assert_eq!(head.framing, Framing::Chunked);
    assert_eq!(body, format!("{ev1}{ev2}").as_bytes());
}

#[test]
fn progress_reports_head_then_done() {
    let mut r = ResponseReader::new(MAX);
    let mut body = Vec::new();
    let p = r.feed(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n",
        &mut body,
    );
    assert_eq!(p, Ok(Progress::default()));
    assert!(r.head().is_none());
    let p = r.feed(b"content-length: 4\r\n\r\n{}", &mut body);
    assert_eq!(
        p,
        Ok(Progress {
            head_ready: true,
            body_done: false
        })
    );
    assert!(r.head().expect("head").is_json());
    let p = r.feed(b"\n}", &mut body);
    assert_eq!(
        p,
        Ok(Progress {
            head_ready: false,
            body_done: true
        })
    );
    assert!(r.is_done());
    assert_eq!(body, b"{}\n}");
    assert_eq!(r.eof(), Ok(()));
    // Nothing may follow a complete body.
    assert_eq!(
        r.feed(b"x", &mut body),
        Err(ResponseError::TrailingBytes { count: 1 })
    );
    assert_eq!(
        r.feed(b"", &mut body),
        Err(ResponseError::TrailingBytes { count: 1 }),
        "errors are sticky"
    );
}

#[test]
fn error_response_with_retry_after() {
    let input = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nRetry-After: 7\r\ncontent-length: 58\r\n\r\n{\"error\":{\"message\":\"overloaded\",\"type\":\"server_error\"}}\n\n";
    let (head, body) = read_ok(input);
    assert_eq!(head.status, 503);
    assert_eq!(head.retry_after.as_deref(), Some("7"));
    assert_eq!(head.framing, Framing::ContentLength(58));
    assert_eq!(body.len(), 58);
}

#[test]
fn close_delimited_body() {
    // llama.cpp's and older servers' SSE without content-length or chunking.
    let mut r = ResponseReader::new(MAX);
    let mut body = Vec::new();
    let p = r
        .feed(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: {}\n\n",
            &mut body,
        )
        .expect("head");
    assert!(p.head_ready && !p.body_done);
    assert_eq!(r.head().map(|h| h.framing), Some(Framing::Close));
    r.feed(b"data: [DONE]\n\n", &mut body).expect("more");
    assert!(!r.is_done());
    assert_eq!(r.eof(), Ok(()));
    assert!(r.is_done());
    assert_eq!(body, b"data: {}\n\ndata: [DONE]\n\n");
    // HTTP/1.0 too.
    let (head, body) = read_ok(b"HTTP/1.0 200 OK\r\n\r\nabc");
    assert_eq!(head.framing, Framing::Close);
    assert_eq!(body, b"abc");
}

#[test]
fn no_body_statuses() {
    let (head, body) = read_ok(b"HTTP/1.1 204 No Content\r\ncontent-length: 10\r\n\r\n");
    assert_eq!(head.framing, Framing::NoBody);
    assert!(body.is_empty());
    let (head, _) = read_ok(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
    assert_eq!(head.framing, Framing::ContentLength(0));
}

#[test]
fn interim_heads_are_skipped() {
    let (head, body) = read_ok(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
    );
    assert_eq!(head.status, 200);
    assert_eq!(body, b"ok");
    let (res, _, _) = read_all(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\n");
    assert_eq!(res, Err(ResponseError::UnexpectedStatus { status: 101 }));
}

#[test]
fn chunk_extensions_and_trailers() {
    let (_, body) = read_ok(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;name=value\r\nhello\r\n6 ; x\r\n world\r\nA\r\n0123456789\r\n0;last\r\nx-trailer: 1\r\nx-other: 2\r\n\r\n",
    );
    assert_eq!(body, b"hello world0123456789");
}

#[test]
fn transfer_encoding_lists() {
    let (head, _) =
        read_ok(b"HTTP/1.1 200 OK\r\ntransfer-encoding: identity, Chunked\r\n\r\n0\r\n\r\n");
    assert_eq!(head.framing, Framing::Chunked);
    let (res, _, _) = read_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n");
    assert_eq!(
        res,
        Err(ResponseError::UnsupportedTransferEncoding {
            value: "gzip, chunked".into()
        })
    );
    let (res, _, _) = read_all(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n",
    );
    assert!(matches!(
        res,
        Err(ResponseError::UnsupportedTransferEncoding { .. })
    ));
    let (res, _, _) =
        read_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n");
    assert_eq!(res, Err(ResponseError::ConflictingFraming));
}

#[test]
fn content_length_checks() {
    let (head, body) =
        read_ok(b"HTTP/1.1 200 OK\r\ncontent-length: 3, 3\r\ncontent-length: 3\r\n\r\nabc");
    assert_eq!(head.framing, Framing::ContentLength(3));
    assert_eq!(body, b"abc");
    for bad in ["-1", "1x", "", " ", "0x10", "99999999999999999999999"] {
        let input = format!("HTTP/1.1 200 OK\r\ncontent-length: {bad}\r\n\r\n");
        let (res, _, _) = read_all(input.as_bytes());
        assert!(
            matches!(res, Err(ResponseError::BadContentLength { .. })),
            "{bad:?}: {res:?}"
        );
    }
    let (res, _, _) =
        read_all(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n");
    assert_eq!(res, Err(ResponseError::ConflictingContentLength));
    let (res, _, _) = read_all(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nabcd");
    assert_eq!(res, Err(ResponseError::TrailingBytes { count: 1 }));
}

#[test]
fn compressed_body_is_flagged() {
    let (head, _) =
        read_ok(b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: 0\r\n\r\n");
    assert_eq!(head.content_encoding.as_deref(), Some("gzip"));
    let (head, _) =
        read_ok(b"HTTP/1.1 200 OK\r\ncontent-encoding: identity\r\ncontent-length: 0\r\n\r\n");
    assert_eq!(head.content_encoding, None);
}

#[test]
fn early_eof() {
    let cases: &[(&[u8], &str)] = &[
        (
            b"",
            "upstream closed the connection early: no response head",
        ),
        (
            b"HTTP/1.1 200 OK\r\n",
            "upstream closed the connection early: response head incomplete after 17 bytes",
        ),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc",
            "upstream closed the connection early: body has 3 of its 10 content-length bytes",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n",
            "upstream closed the connection early: chunked body ended before its last chunk",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nab",
            "upstream closed the connection early: chunked body ended before its last chunk",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r",
            "upstream closed the connection early: chunked body ended before its last chunk",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n",
            "upstream closed the connection early: chunked body ended inside its trailers",
        ),
    ];
    for (input, msg) in cases {
        let (res, _, _) = read_all(input);
        match res {
            Err(e @ ResponseError::EarlyEof { .. }) => assert_eq!(e.to_string(), *msg),
            other => panic!("{}: {other:?}", String::from_utf8_lossy(input)),
        }
    }
}

#[test]
fn malformed_input() {
    let chunked = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
    let cases: Vec<(String, ResponseError)> = vec![
        (
            "HTTP/1.1 2OO OK\r\n\r\n".into(),
            ResponseError::MalformedHead {
                reason: "invalid response status".into(),
            },
        ),
        (
            "SSH-2.0-OpenSSH\r\n\r\n".into(),
            ResponseError::MalformedHead {
                reason: "invalid HTTP version".into(),
            },
        ),
        (
            format!("{chunked}\r\n"),
            ResponseError::BadChunkSize { line: "".into() },
        ),
        (
            format!("{chunked};x\r\n"),
            ResponseError::BadChunkSize { line: ";x".into() },
        ),
        (
            format!("{chunked}zz\r\n"),
            ResponseError::BadChunkSize { line: "zz".into() },
        ),
        (
            format!("{chunked}5\n"),
            ResponseError::BadChunkSize { line: "5".into() },
        ),
        (
            format!("{chunked}1 2\r\n"),
            ResponseError::BadChunkSize { line: "1 2".into() },
        ),
        (
            format!("{chunked}10000000000000000\r\n"),
            ResponseError::BadChunkSize {
                line: "10000000000000000".into(),
            },
        ),
        (
            format!("{chunked}3\r\nabcX"),
            ResponseError::MissingChunkCrlf,
        ),
        (
            format!("{chunked}3\r\nabc\rX"),
            ResponseError::MissingChunkCrlf,
        ),
        (
            format!("{chunked}3\r\nabc\n"),
            ResponseError::MissingChunkCrlf,
        ),
        (
            format!("{chunked}0\r\nx: 1\n"),
            ResponseError::MalformedTrailer,
        ),
        (
            format!("{chunked}0\r\n\r\nextra"),
            ResponseError::TrailingBytes { count: 5 },
        ),
        (
            format!("{chunked}1;{}\r\n", "e".repeat(MAX_CHUNK_LINE)),
            ResponseError::ChunkLineTooLong {
                limit: MAX_CHUNK_LINE,
            },
        ),
    ];
    for (input, expected) in cases {
        let (res, _, _) = read_all(input.as_bytes());
        assert_eq!(res, Err(expected), "{input:?}");
    }
}

#[test]
fn head_limits() {
    let mut r = ResponseReader::new(64);
    let mut body = Vec::new();
    assert_eq!(
        r.feed(b"HTTP/1.1 200 OK\r\n", &mut body),
        Ok(Progress::default())
    );
    let long = format!("x-pad: {}\r\n", "a".repeat(64));
    assert_eq!(
        r.feed(long.as_bytes(), &mut body),
        Err(ResponseError::HeadTooLarge { limit: 64 })
    );
    // A complete head over the limit, delivered in one read.
    let mut r = ResponseReader::new(64);
    let input = format!("HTTP/1.1 200 OK\r\n{long}\r\n");
    assert_eq!(
        r.feed(input.as_bytes(), &mut body),
        Err(ResponseError::HeadTooLarge { limit: 64 })
    );
    // Interim heads count against the limit.
    let mut r = ResponseReader::new(64);
    let input = "HTTP/1.1 103 Early Hints\r\n\r\n".repeat(3);
    assert_eq!(
        r.feed(input.as_bytes(), &mut body),
        Err(ResponseError::HeadTooLarge { limit: 64 })
    );
    let many: String = (0..=MAX_RESPONSE_HEADERS)
        .map(|i| format!("x-{i}: 1\r\n"))
        .collect();
    let (res, _, _) = read_all(format!("HTTP/1.1 200 OK\r\n{many}\r\n").as_bytes());
    assert_eq!(
        res,
        Err(ResponseError::TooManyHeaders {
            limit: MAX_RESPONSE_HEADERS
        })
    );
}

#[test]
fn trailer_limit() {
    let mut r = ResponseReader::new(128);
    let mut body = Vec::new();
    r.feed(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n",
        &mut body,
    )
    .expect("head");
    let mut res = Ok(Progress::default());
    for _ in 0..20 {
        res = r.feed(b"x-trailer: 0123456789\r\n", &mut body);
        if res.is_err() {
            break;
        }
    }
    assert_eq!(res, Err(ResponseError::TrailersTooLarge { limit: 128 }));
}

/// Feeds `input` split at `cuts` (offsets taken modulo the length), then EOF.
fn read_split(input: &[u8], cuts: &[usize]) -> Result<(Vec<u8>, bool), ResponseError> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
    points.push(0);
    points.push(input.len());
    points.sort_unstable();
    let mut r = ResponseReader::new(MAX);
    let mut body = Vec::new();
    let mut head_ready = 0;
    for w in points.windows(2) {
        let p = r.feed(&input[w[0]..w[1]], &mut body)?;
        head_ready += usize::from(p.head_ready);
    }
    assert!(head_ready <= 1, "head_ready reported {head_ready} times");
    let done_before_eof = r.is_done();
    r.eof()?;
    Ok((body, done_before_eof))
}

fn chunked_response(body: &[u8], sizes: &[usize], ext: bool, trailers: bool) -> Vec<u8> {
    let mut out =
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            .to_vec();
    let mut rest = body;
    let mut k = 0;
    while !rest.is_empty() {
        let n = sizes.get(k).copied().unwrap_or(7).clamp(1, rest.len());
        k += 1;
        let (chunk, tail) = rest.split_at(n);
        if ext && k % 2 == 0 {
            out.extend_from_slice(format!("{n:X};ext=\"v\"\r\n").as_bytes());
        } else {
            out.extend_from_slice(format!("{n:x}\r\n").as_bytes());
        }
        out.extend_from_slice(chunk);
        out.extend_from_slice(b"\r\n");
        rest = tail;
    }
    out.extend_from_slice(b"0\r\n");
    if trailers {
        out.extend_from_slice(b"x-usage: 12\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

proptest! {
    #[test]
    fn random_bytes_never_panic(
        input in proptest::collection::vec(any::<u8>(), 0..512),
        cuts in proptest::collection::vec(any::<usize>(), 0..8),
    ) {
        let _ = read_split(&input, &cuts);
        let mut with_head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
        with_head.extend_from_slice(&input);
        let _ = read_split(&with_head, &cuts);
    }

    #[test]
    fn chunked_decodes_the_same_under_any_split(
        body in proptest::collection::vec(any::<u8>(), 0..600),
        sizes in proptest::collection::vec(1usize..80, 0..20),
        cuts in proptest::collection::vec(any::<usize>(), 0..24),
        ext in any::<bool>(),
        trailers in any::<bool>(),
    ) {
        let input = chunked_response(&body, &sizes, ext, trailers);
        let (decoded, done) = read_split(&input, &cuts).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(decoded, body);
        prop_assert!(done);
    }

    #[test]
    fn truncated_chunked_is_an_early_eof(
        body in proptest::collection::vec(any::<u8>(), 1..200),
        sizes in proptest::collection::vec(1usize..40, 0..10),
        cut in any::<usize>(),
    ) {
        let input = chunked_response(&body, &sizes, false, false);
        let head_len = input.windows(4).position(|w| w == b"\r\n\r\n").map_or(0, |p| p + 4);
        let end = head_len + cut % (input.len() - head_len);
        let res = read_split(&input[..end], &[]);
        let early = matches!(res, Err(ResponseError::EarlyEof { .. }));
        prop_assert!(early, "{:?}", res);
    }

    #[test]
    fn content_length_decodes_the_same_under_any_split(
        body in proptest::collection::vec(any::<u8>(), 0..600),
        cuts in proptest::collection::vec(any::<usize>(), 0..24),
    ) {
        let mut input = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len()).into_bytes();
        input.extend_from_slice(&body);
        let (decoded, done) = read_split(&input, &cuts).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(decoded, body);
        prop_assert!(done);
    }
}

#[test]
fn keep_alive_follows_version_connection_and_framing() {
    let cases: [(&[u8], bool); 6] = [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", true),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
            true,
        ),
        (
            b"HTTP/1.1 200 OK\r\nconnection: keep-alive, Close\r\ncontent-length: 0\r\n\r\n",
            false,
        ),
        (b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n", false),
        (
            b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 0\r\n\r\n",
            true,
        ),
        // Close-delimited: the body's end is the connection's.
        (b"HTTP/1.1 200 OK\r\n\r\n", false),
    ];
    for (input, want) in cases {
        let (head, _) = read_ok(input);
        assert_eq!(head.keep_alive, want, "{}", String::from_utf8_lossy(input));
    }
}
