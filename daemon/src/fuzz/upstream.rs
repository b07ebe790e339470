//! An upstream's answer: the HTTP response reader (head, content-length and chunked
//! framing), then the event stream, its chunks and the upstream source the pipeline polls.

use crate::{
    source::{upstream::UpstreamSource, Polled, TokenSource},
    upstream::{
        chunk::{LOGPROB_EPSILON, MAX_ERROR_MESSAGE_CHARS},
        framing::Split,
        parse_event, ChunkReader, Framing, Parsed, ResponseError, ResponseHead, ResponseReader,
        SseError, SseEvent, SseParser, UpstreamEvent, UpstreamSurface,
    },
    wire::{Endpoint, MAX_TOKEN_TEXT_BYTES, MAX_TOP_LOGPROBS},
};

/// The data plane's limit on an upstream's head (`dataplane/upstream_io.rs`), and a small one
/// that inputs of a few KiB can reach.
const HEAD_LIMITS: [usize; 2] = [64 * 1024, 512];
/// The data plane's limit on one upstream event, and a small one.
const EVENT_LIMITS: [usize; 2] = [1 << 20, 256];

/// What reading a whole response gave: the head, the body, how it ended.
#[derive(Debug, PartialEq)]
struct Read {
    head: Option<ResponseHead>,
    body: Vec<u8>,
    done: bool,
    end: Result<(), ResponseError>,
}

fn read_response(max_head: usize, pieces: &[&[u8]]) -> Read {
    let mut r = ResponseReader::new(max_head);
    let mut body = Vec::new();
    let mut end = Ok(());
    for piece in pieces {
        if let Err(e) = r.feed(piece, &mut body) {
            end = Err(comparable(e));
            break;
        }
    }
    let done = r.is_done();
    if end.is_ok() {
        end = r.eof().map_err(comparable);
    }
    Read {
        head: r.head().cloned(),
        body,
        done,
        end,
    }
}

/// An error as far as it must not depend on how the bytes were cut. The count of bytes after
/// the body is per read. A malformed head longer than the limit is refused as too large when
/// it arrives in pieces (its end has not arrived when the limit is passed) and as malformed
/// when it arrives whole: either way the upstream is refused, as malformed.
fn comparable(e: ResponseError) -> ResponseError {
    match e {
        ResponseError::TrailingBytes { .. } => ResponseError::TrailingBytes { count: 0 },
        ResponseError::HeadTooLarge { .. }
        | ResponseError::MalformedHead { .. }
        | ResponseError::TooManyHeaders { .. } => ResponseError::MalformedHead {
            reason: "a head haltd refuses".to_owned(),
        },
        e => e,
    }
}

/// An upstream's response bytes, then EOF, through [`ResponseReader`] with the data plane's
/// head limit and a small one.
///
/// Checks: the same head, body and outcome (up to [`comparable`]) whether the bytes come
/// whole, a byte at a time or in pieces; a body never holds more bytes than arrived; a complete content-length body has
/// exactly that length.
pub fn upstream_response(data: &[u8]) {
    for max_head in HEAD_LIMITS {
        let [whole, bytes, pieces] = super::feedings(data);
        let first = read_response(max_head, &whole);
        assert_eq!(
            first,
            read_response(max_head, &bytes),
            "fed a byte at a time"
        );
        assert_eq!(first, read_response(max_head, &pieces), "fed in pieces");
        assert!(first.body.len() <= data.len());
        if let (Some(h), true) = (&first.head, first.done) {
            if let Framing::ContentLength(n) = h.framing {
                assert_eq!(first.body.len() as u64, n, "{h:?}");
            }
        }
    }
}

/// Every event of a stream and how it ended, as the data plane drains the parser.
fn read_events(max_event: usize, pieces: &[&[u8]]) -> (Vec<SseEvent>, Option<SseError>) {
    let mut p = SseParser::new(max_event);
    let mut events = Vec::new();
    for piece in pieces {
        p.push(piece);
        loop {
            match p.next_event() {
                Ok(Some(e)) => events.push(e),
                Ok(None) => break,
                Err(e) => return (events, Some(e)),
            }
        }
    }
    (events, None)
}

/// An upstream's `text/event-stream` body: the first byte picks the endpoint (bit 0),
/// degraded mode (bit 1) and a natively served surface (its high half: `0xA` Responses,
/// `0xB` Messages, read by `upstream/chunk/native.rs`; any other, none); the rest is the
/// stream.
///
/// Checks: the same events (and error) however the bytes are cut; a smaller event limit
/// gives a prefix of the same events; a [`ChunkReader`] reused across the stream reads each
/// event as a fresh one does; chunks keep their bounds (alternatives, logprobs, error
/// length); the [`UpstreamSource`] the pipeline polls frames text by its own rule and keeps
/// no tool call in degraded mode (the pipeline suppresses the deltas it polls).
pub fn upstream_sse(data: &[u8]) {
    let Some((&sel, stream)) = data.split_first() else {
        return;
    };
    let endpoint = if sel & 1 == 0 {
        Endpoint::Chat
    } else {
        Endpoint::Completion
    };
    let [whole, bytes, pieces] = super::feedings(stream);
    let first = read_events(EVENT_LIMITS[0], &whole);
    assert_eq!(
        first,
        read_events(EVENT_LIMITS[0], &bytes),
        "fed a byte at a time"
    );
    assert_eq!(
        first,
        read_events(EVENT_LIMITS[0], &pieces),
        "fed in pieces"
    );
    let events = first.0;
    let (small, _) = read_events(EVENT_LIMITS[1], &pieces);
    assert!(
        events.starts_with(&small),
        "a smaller limit changed the events"
    );
    let native = match sel >> 4 {
        0xA => Some(UpstreamSurface::Responses),
        0xB => Some(UpstreamSurface::Messages),
        _ => None,
    };
    if let Some(surface) = native {
        // A native reader keeps the stream's state (its calls): no fresh read to compare.
        let mut reader = ChunkReader::native(surface);
        for ev in &events {
            if let Ok(Parsed::Chunk) = reader.read(endpoint, ev.view()) {
                check_chunk(reader.chunk());
            }
        }
        let source = UpstreamSource::native(sel & 2 != 0, Some(surface));
        return poll_source(source, endpoint, sel & 2 != 0, &events);
    }
    let mut reader = ChunkReader::default();
    for ev in &events {
        let reused = reader.read(endpoint, ev.view());
        let fresh = parse_event(endpoint, ev);
        match (&reused, &fresh) {
            (Ok(Parsed::Chunk), Ok(UpstreamEvent::Chunk(c))) => {
                assert_eq!(reader.chunk(), c, "a reused reader read {ev:?} differently");
                check_chunk(c);
            }
            (Ok(Parsed::Done), Ok(UpstreamEvent::Done)) => {}
            (Ok(Parsed::Error(a)), Ok(UpstreamEvent::Error(b))) => {
                assert_eq!(a, b);
                assert!(a.message.chars().count() <= MAX_ERROR_MESSAGE_CHARS);
            }
            (Err(a), Err(b)) => assert_eq!(a, b),
            _ => panic!("{ev:?}: reused {reused:?}, fresh {fresh:?}"),
        }
    }
    poll_source(
        UpstreamSource::new(sel & 2 != 0),
        endpoint,
        sel & 2 != 0,
        &events,
    );
}

fn check_chunk(c: &crate::upstream::UpstreamChunk) {
    for t in &c.tokens {
        assert!(t.top.len() <= MAX_TOP_LOGPROBS as usize, "{t:?}");
        for lp in t.logprob.iter().chain(t.top.iter().map(|(_, lp)| lp)) {
            assert!(!lp.is_nan() && f64::from(*lp) <= LOGPROB_EPSILON, "{t:?}");
        }
    }
}

/// The events through the source the pipeline polls, as `dataplane/upstream_io/recv.rs` feeds it.
fn poll_source(
    mut source: UpstreamSource,
    endpoint: Endpoint,
    degraded: bool,
    events: &[SseEvent],
) {
    for ev in events {
        if !source.push_event(endpoint, ev.view(), 0) {
            assert!(source.saw_done(), "a stream that broke reads on");
            break;
        }
    }
    loop {
        match source.poll() {
            Polled::Text(p) => {
                let pieces: Vec<&str> = p.split.pieces(&p.text).collect();
                assert_eq!(pieces.concat(), p.text);
                assert_eq!(pieces.len() as u64, p.split.frames(&p.text));
                if p.split == Split::Token {
                    assert!(pieces.iter().all(|s| s.len() <= MAX_TOKEN_TEXT_BYTES));
                }
                source.recycle(p);
            }
            Polled::ToolCalls { .. } => {}
            Polled::Pending | Polled::End | Polled::Failed(_) => break,
        }
    }
    let ending = source.ending();
    assert!(
        !degraded || ending.tools.is_empty(),
        "degraded mode kept {:?}",
        ending.tools
    );
}
