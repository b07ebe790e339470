use proptest::prelude::*;

use super::*;

fn parse_all(input: &[u8]) -> Result<Vec<SseEvent>, SseError> {
    let mut p = SseParser::new(64 * 1024);
    p.push(input);
    let mut out = Vec::new();
    while let Some(ev) = p.next_event()? {
        out.push(ev);
    }
    Ok(out)
}

fn data(s: &str) -> SseEvent {
    SseEvent {
        data: s.into(),
        ..SseEvent::default()
    }
}

#[test]
fn vllm_stream() {
    let input = b"data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]}\n\ndata: [DONE]\n\n";
    let evs = parse_all(input).expect("parse");
    assert_eq!(evs.len(), 2);
    assert!(evs[0].data.starts_with("{\"id\":\"chatcmpl-1\""));
    assert_eq!(evs[1], data("[DONE]"));
}

#[test]
fn line_endings_crlf_lf_cr() {
    let expected = vec![data("a"), data("b"), data("c"), data("d")];
    let input = b"data: a\r\n\r\ndata: b\n\ndata: c\r\rdata: d\r\n\n";
    assert_eq!(parse_all(input).expect("parse"), expected);
}

#[test]
fn cr_at_end_of_push_then_lf() {
    let mut p = SseParser::new(1024);
    p.push(b"data: x\r");
    assert_eq!(p.next_event(), Ok(None));
    p.push(b"\n");
    // The LF completes the CRLF: no blank line yet.
    assert_eq!(p.next_event(), Ok(None));
    p.push(b"\r");
    assert_eq!(p.next_event(), Ok(Some(data("x"))));
    p.push(b"\ndata: y\r");
    assert_eq!(p.next_event(), Ok(None));
    p.push(b"\r");
    assert_eq!(p.next_event(), Ok(Some(data("y"))));
    assert!(!p.has_partial());
}

#[test]
fn field_parsing() {
    let input = b"event: completion\ndata:no-space\ndata:  two spaces\ndata\ndata: a:b: c\nid: 7\nretry: 100\nunknown: x\n: comment\n\n";
    let evs = parse_all(input).expect("parse");
    assert_eq!(
        evs,
        vec![SseEvent {
            event: Some("completion".into()),
            data: "no-space\n two spaces\n\na:b: c".into(),
            error_field: None,
        }]
    );
}

#[test]
fn events_without_data_are_not_dispatched() {
    let input = b": keep-alive\n\nevent: ping\n\nid: 3\n\n\n\ndata:\n\n";
    assert_eq!(parse_all(input).expect("parse"), vec![data("")]);
    // The event name of an undispatched block does not leak into the next event.
    let input = b"event: ping\n\ndata: x\n\n";
    assert_eq!(parse_all(input).expect("parse"), vec![data("x")]);
    let input = b"event: x\nevent:\ndata: y\n\n";
    assert_eq!(parse_all(input).expect("parse"), vec![data("y")]);
}

#[test]
fn borrowed_events_reuse_the_buffers() {
    let input = b"event: a\nerror: e1\nerror: e2\ndata: x\n\ndata: y\n\n: c\n\nevent: b\n\ndata: z\ndata:\n\n";
    let owned = parse_all(input).expect("parse");
    let mut p = SseParser::new(1024);
    p.push(input);
    let (mut borrowed, mut partial) = (Vec::new(), true);
    while let Some(ev) = p.next_event_ref().expect("valid") {
        borrowed.push(ev.to_event());
        partial = p.has_partial();
    }
    // The last event, handed out, is not input still pending.
    assert!(!partial);
    assert_eq!(borrowed, owned);
    assert_eq!(
        owned,
        vec![
            SseEvent {
                event: Some("a".into()),
                data: "x".into(),
                error_field: Some("e1\ne2".into()),
            },
            data("y"),
            data("z\n"),
        ]
    );
    assert_eq!(owned[0].view().to_event(), owned[0]);
}

#[test]
fn llama_cpp_error_field() {
    let input = b"error: {\"code\":500,\"message\":\"context shift is disabled\",\"type\":\"server_error\"}\n\n";
    let evs = parse_all(input).expect("parse");
    assert_eq!(
        evs,
        vec![SseEvent {
            event: None,
            data: String::new(),
            error_field: Some(
                "{\"code\":500,\"message\":\"context shift is disabled\",\"type\":\"server_error\"}"
                    .into()
            ),
        }]
    );
}

#[test]
fn bom_is_skipped_once() {
    let evs = parse_all(b"\xEF\xBB\xBFdata: a\n\n").expect("parse");
    assert_eq!(evs, vec![data("a")]);
    // A BOM split across pushes.
    let mut p = SseParser::new(1024);
    p.push(b"\xEF");
    assert_eq!(p.next_event(), Ok(None));
    p.push(b"\xBB");
    assert_eq!(p.next_event(), Ok(None));
    p.push(b"\xBFdata: b\n\n");
    assert_eq!(p.next_event(), Ok(Some(data("b"))));
    // A second BOM makes the line's field name "\u{feff}data", an unknown field.
    let evs = parse_all(b"\xEF\xBB\xBF\xEF\xBB\xBFdata: a\n\ndata: c\n\n").expect("parse");
    assert_eq!(evs, vec![data("c")]);
    // A partial BOM followed by something else is data, and here invalid UTF-8.
    assert!(matches!(
        parse_all(b"\xEF\xBBdata: a\n\n"),
        Err(SseError::InvalidUtf8 { offset: 0 })
    ));
}

#[test]
fn invalid_utf8_is_refused_and_sticky() {
    let mut p = SseParser::new(1024);
    p.push(b"data: ok\n\ndata: \xFF\xFE\n\n");
    assert_eq!(p.next_event(), Ok(Some(data("ok"))));
    let e = p.next_event().expect_err("invalid");
    assert_eq!(e, SseError::InvalidUtf8 { offset: 10 });
    assert_eq!(
        e.to_string(),
        "upstream SSE stream is not valid UTF-8 (line at byte 10)"
    );
    p.push(b"data: fine\n\n");
    assert_eq!(p.next_event(), Err(e));
}

#[test]
fn utf8_split_across_pushes() {
    let text = "data: héllo ✓ 😀\n\n".as_bytes();
    let mut p = SseParser::new(1024);
    let mut got = Vec::new();
    for b in text {
        p.push(std::slice::from_ref(b));
        while let Some(ev) = p.next_event().expect("valid") {
            got.push(ev);
        }
    }
    assert_eq!(got, vec![data("héllo ✓ 😀")]);
}

#[test]
fn event_size_limit() {
    let mut p = SseParser::new(32);
    p.push(b"data: 0123456789\n\n");
    assert_eq!(p.next_event(), Ok(Some(data("0123456789"))));
    // Lines of one event add up.
    p.push(b"data: 0123456789\ndata: 0123456789\n");
    assert_eq!(p.next_event(), Err(SseError::EventTooLarge { limit: 32 }));
    // An incomplete line is caught before its end arrives.
    let mut p = SseParser::new(32);
    p.push(&[b'a'; 20]);
    assert_eq!(p.next_event(), Ok(None));
    p.push(&[b'a'; 20]);
    assert_eq!(p.next_event(), Err(SseError::EventTooLarge { limit: 32 }));
    assert_eq!(
        SseError::EventTooLarge { limit: 32 }.to_string(),
        "upstream SSE event larger than 32 bytes"
    );
    // Exactly the limit is fine (`data: x` + LF + LF = 9 bytes).
    let mut p = SseParser::new(9);
    p.push(b"data: x\n\ndata: y\n\n");
    assert_eq!(p.next_event(), Ok(Some(data("x"))));
    assert_eq!(p.next_event(), Ok(Some(data("y"))));
}

#[test]
fn partial_input_is_reported() {
    let mut p = SseParser::new(1024);
    assert!(!p.has_partial());
    p.push(b"data: [DO");
    assert_eq!(p.next_event(), Ok(None));
    assert!(p.has_partial());
    p.push(b"NE]\n");
    assert_eq!(p.next_event(), Ok(None));
    assert!(p.has_partial(), "data line waiting for its blank line");
    p.push(b"\n");
    assert_eq!(p.next_event(), Ok(Some(data("[DONE]"))));
    assert!(!p.has_partial());
}

/// One event as the generator describes it.
#[derive(Debug, Clone)]
struct Spec {
    event: Option<String>,
    data: Vec<String>,
    error: Option<String>,
    comment: bool,
    id: bool,
}

/// A field value: any text without CR or LF.
fn value() -> impl Strategy<Value = String> {
    "[^\r\n]{0,12}"
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        proptest::option::of("[a-z_]{1,8}"),
        proptest::collection::vec(value(), 0..4),
        proptest::option::weighted(0.2, value()),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(event, data, error, comment, id)| Spec {
            event,
            data,
            error,
            comment,
            id,
        })
}

/// `name: value` or `name:value`, whichever keeps the value intact.
fn field_line(name: &str, value: &str, space: bool) -> String {
    if space || value.starts_with(' ') {
        format!("{name}: {value}")
    } else {
        format!("{name}:{value}")
    }
}

/// Serialises the specs with the given line endings (0 = LF, 1 = CR, 2 = CRLF).
fn serialise(specs: &[Spec], endings: &[u8], bom: bool) -> Vec<u8> {
    let mut lines: Vec<String> = Vec::new();
    for (k, s) in specs.iter().enumerate() {
        let space = k % 2 == 0;
        if s.comment {
            lines.push(": keep-alive".into());
        }
        if let Some(e) = &s.event {
            lines.push(field_line("event", e, space));
        }
        if s.id {
            lines.push(format!("id: {k}"));
        }
        for d in &s.data {
            lines.push(field_line("data", d, !space));
        }
        if let Some(e) = &s.error {
            lines.push(field_line("error", e, space));
        }
        lines.push(String::new());
    }
    let mut out = Vec::new();
    if bom {
        out.extend_from_slice(BOM);
    }
    let mut prev_cr = false;
    for (i, line) in lines.iter().enumerate() {
        let mut ending = endings.get(i).copied().unwrap_or(0) % 3;
        // After a lone CR, an empty line ended by LF would read as one CRLF.
        if prev_cr && line.is_empty() && ending == 0 {
            ending = 2;
        }
        out.extend_from_slice(line.as_bytes());
        out.extend_from_slice(match ending {
            0 => b"\n".as_slice(),
            1 => b"\r",
            _ => b"\r\n",
        });
        prev_cr = ending == 1;
    }
    out
}

fn expected(specs: &[Spec]) -> Vec<SseEvent> {
    specs
        .iter()
        .filter(|s| !s.data.is_empty() || s.error.is_some())
        .map(|s| SseEvent {
            event: s.event.clone(),
            data: s.data.join("\n"),
            error_field: s.error.clone(),
        })
        .collect()
}

proptest! {
    #[test]
    fn any_split_and_line_endings_parse_the_same(
        specs in proptest::collection::vec(spec(), 0..8),
        endings in proptest::collection::vec(0u8..3, 0..64),
        cuts in proptest::collection::vec(any::<usize>(), 0..16),
        bom in any::<bool>(),
    ) {
        let input = serialise(&specs, &endings, bom);
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
        points.push(0);
        points.push(input.len());
        points.sort_unstable();
        let mut p = SseParser::new(64 * 1024);
        let mut got = Vec::new();
        for w in points.windows(2) {
            p.push(&input[w[0]..w[1]]);
            while let Some(ev) = p.next_event().map_err(|e| TestCaseError::fail(e.to_string()))? {
                got.push(ev);
            }
        }
        prop_assert_eq!(got, expected(&specs));
        prop_assert!(!p.has_partial());
    }

    #[test]
    fn random_bytes_never_panic(
        input in proptest::collection::vec(any::<u8>(), 0..512),
        cuts in proptest::collection::vec(any::<usize>(), 0..8),
        limit in 1usize..128,
    ) {
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
        points.push(0);
        points.push(input.len());
        points.sort_unstable();
        let mut p = SseParser::new(limit);
        'feed: for w in points.windows(2) {
            p.push(&input[w[0]..w[1]]);
            loop {
                match p.next_event() {
                    Ok(Some(ev)) => prop_assert!(ev.data.len() <= limit),
                    Ok(None) => break,
                    Err(_) => break 'feed,
                }
            }
        }
    }
}
