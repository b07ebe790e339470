//! An incremental Server-Sent Events parser for the upstream's `text/event-stream` body.
//!
//! It follows the WHATWG HTML "event stream interpretation" rules exactly, because the
//! backends differ in the corners: lines may end in CRLF, LF or CR (and a CR at the end of one
//! read may be followed by the LF of the same line ending in the next), a leading BOM is
//! skipped, one space after the colon is removed, `data` lines join with `\n`, comments (`:`)
//! carry keep-alives, and a blank line dispatches. An event with no `data` line is not
//! dispatched. `id` and `retry` are ignored (haltd never reconnects: a retried generation
//! would be a different one).
//!
//! One deviation from the standard: the non-standard `error` field, which older llama.cpp
//! servers send (`error: {json}`) instead of a `data` line, is kept and makes the event
//! dispatch, so an upstream failure is reported rather than silently dropped.
//!
//! Two limits keep an upstream from growing memory or hiding garbage: an event (all its lines,
//! terminators included) may not exceed `max_event_bytes`, checked while a line is still
//! incomplete, and the stream must be UTF-8 (the standard would substitute U+FFFD; haltd's
//! detectors must see the bytes the model produced, so it refuses instead). Errors are sticky.

const BOM: &[u8] = b"\xEF\xBB\xBF";

/// One dispatched event, owned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event` field; `None` when absent or empty (the standard's `message`).
    pub event: Option<String>,
    /// The `data` lines joined with `\n`.
    pub data: String,
    /// The non-standard `error` field's lines joined with `\n`.
    pub error_field: Option<String>,
}

impl SseEvent {
    /// The event as a borrowed view.
    pub fn view(&self) -> SseEventRef<'_> {
        SseEventRef {
            event: self.event.as_deref(),
            data: &self.data,
            error_field: self.error_field.as_deref(),
        }
    }
}

/// One dispatched event, borrowed from the parser ([`SseParser::next_event_ref`]) or from an
/// [`SseEvent`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SseEventRef<'a> {
    /// The `event` field; `None` when absent or empty (the standard's `message`).
    pub event: Option<&'a str>,
    /// The `data` lines joined with `\n`.
    pub data: &'a str,
    /// The non-standard `error` field's lines joined with `\n`.
    pub error_field: Option<&'a str>,
}

impl SseEventRef<'_> {
    /// An owned copy.
    pub fn to_event(self) -> SseEvent {
        SseEvent {
            event: self.event.map(str::to_owned),
            data: self.data.to_owned(),
            error_field: self.error_field.map(str::to_owned),
        }
    }
}

/// Why the upstream's event stream cannot be parsed. Sticky: the stream is unusable after it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    #[error("upstream SSE event larger than {limit} bytes")]
    EventTooLarge { limit: usize },
    #[error("upstream SSE stream is not valid UTF-8 (line at byte {offset})")]
    InvalidUtf8 { offset: u64 },
}

/// Incremental SSE parser: [`SseParser::push`] bytes, then drain [`SseParser::next_event_ref`]
/// (or [`SseParser::next_event`]) until it returns `Ok(None)`.
///
/// The event being built lives in buffers the parser keeps and reuses: once they have grown
/// to the stream's event size, reading an event allocates nothing.
#[derive(Debug)]
pub struct SseParser {
    max_event_bytes: usize,
    buf: Vec<u8>,
    /// Start of the unconsumed bytes in `buf`.
    pos: usize,
    /// Bytes after `pos` already known to hold no CR or LF.
    scanned: usize,
    /// Stream offset of `buf[0]` (for error messages).
    base: u64,
    bom_done: bool,
    /// The last line ended in CR: an LF right after it belongs to that line ending.
    skip_lf: bool,
    /// Bytes of the complete lines of the event being built.
    event_bytes: usize,
    data: String,
    /// The `event` field; empty is none (an empty value is the standard's `message`).
    event: String,
    /// The `error` field's lines, when `has_error`.
    error: String,
    has_error: bool,
    /// The buffers hold the event last handed out: they are cleared on the next call.
    handed_out: bool,
    failed: Option<SseError>,
}

impl SseParser {
    /// A parser that refuses an event larger than `max_event_bytes` on the wire.
    pub fn new(max_event_bytes: usize) -> Self {
        SseParser {
            max_event_bytes,
            buf: Vec::new(),
            pos: 0,
            scanned: 0,
            base: 0,
            bom_done: false,
            skip_lf: false,
            event_bytes: 0,
            data: String::new(),
            event: String::new(),
            error: String::new(),
            has_error: false,
            handed_out: false,
            failed: None,
        }
    }

    /// Appends bytes of the stream (any split).
    pub fn push(&mut self, bytes: &[u8]) {
        if self.pos > 0 {
            self.buf.drain(..self.pos);
            self.base += self.pos as u64;
            self.pos = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Whether input is pending that a blank line would still have to complete: a partial
    /// line, or buffered `data` / `error` lines. At EOF the standard discards it; a caller
    /// that expects `[DONE]` treats it as a truncated stream.
    pub fn has_partial(&self) -> bool {
        self.pos < self.buf.len() || (!self.handed_out && (!self.data.is_empty() || self.has_error))
    }

    fn fail(&mut self, e: SseError) -> SseError {
        self.failed = Some(e.clone());
        e
    }

    /// The next complete event, owned; `Ok(None)` when more bytes are needed. Allocates the
    /// event's strings: [`SseParser::next_event_ref`] does not.
    pub fn next_event(&mut self) -> Result<Option<SseEvent>, SseError> {
        Ok(self.next_event_ref()?.map(SseEventRef::to_event))
    }

    /// The next complete event, borrowed from the parser until the next call; `Ok(None)`
    /// when more bytes are needed.
    pub fn next_event_ref(&mut self) -> Result<Option<SseEventRef<'_>>, SseError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if std::mem::take(&mut self.handed_out) {
            self.data.clear();
            self.event.clear();
            self.error.clear();
            self.has_error = false;
        }
        loop {
            let avail = &self.buf[self.pos..];
            if !self.bom_done {
                if avail.len() < BOM.len() && BOM.starts_with(avail) {
                    return Ok(None);
                }
                if avail.starts_with(BOM) {
                    self.pos += BOM.len();
                }
                self.bom_done = true;
                continue;
            }
            if self.skip_lf {
                match avail.first() {
                    None => return Ok(None),
                    Some(b'\n') => self.pos += 1,
                    Some(_) => {}
                }
                self.skip_lf = false;
                continue;
            }
            let Some((start, end)) = self.next_line()? else {
                return Ok(None);
            };
            if end == start {
                self.event_bytes = 0;
                if self.dispatch() {
                    return Ok(Some(self.current()));
                }
                continue;
            }
            let Ok(line) = std::str::from_utf8(&self.buf[start..end]) else {
                let offset = self.base + start as u64;
                return Err(self.fail(SseError::InvalidUtf8 { offset }));
            };
            if !line.starts_with(':') {
                let Self {
                    data,
                    event,
                    error,
                    has_error,
                    ..
                } = self;
                apply_field(line, data, event, error, has_error);
            }
        }
    }

    /// The next complete line, consumed with its line ending: `(start, end)` in `buf`, `end`
    /// at the ending; `Ok(None)` when no complete line is buffered yet.
    fn next_line(&mut self) -> Result<Option<(usize, usize)>, SseError> {
        let from = self.pos + self.scanned;
        let Some(rel) = self.buf[from..]
            .iter()
            .position(|&b| b == b'\n' || b == b'\r')
        else {
            self.scanned = self.buf.len() - self.pos;
            if self.event_bytes + self.scanned > self.max_event_bytes {
                return Err(self.fail(SseError::EventTooLarge {
                    limit: self.max_event_bytes,
                }));
            }
            return Ok(None);
        };
        let end = from + rel;
        let mut next = end + 1;
        if self.buf[end] == b'\r' {
            match self.buf.get(next) {
                Some(b'\n') => next += 1,
                Some(_) => {}
                None => self.skip_lf = true,
            }
        }
        let start = self.pos;
        self.event_bytes += next - start;
        self.pos = next;
        self.scanned = 0;
        if self.event_bytes > self.max_event_bytes {
            return Err(self.fail(SseError::EventTooLarge {
                limit: self.max_event_bytes,
            }));
        }
        Ok(Some((start, end)))
    }

    /// The blank-line step: whether the buffers hold an event to hand out (it has data or an
    /// error field); else they are reset.
    fn dispatch(&mut self) -> bool {
        if self.data.is_empty() && !self.has_error {
            self.event.clear();
            return false;
        }
        self.handed_out = true;
        true
    }

    /// The event the buffers hold, after [`SseParser::dispatch`].
    fn current(&self) -> SseEventRef<'_> {
        SseEventRef {
            event: Some(self.event.as_str()).filter(|e| !e.is_empty()),
            data: self.data.strip_suffix('\n').unwrap_or(&self.data),
            error_field: self.has_error.then_some(self.error.as_str()),
        }
    }
}

/// One `field: value` line (not a comment) into the event being built.
fn apply_field(
    line: &str,
    data: &mut String,
    event: &mut String,
    error: &mut String,
    has_error: &mut bool,
) {
    let (field, value) = match line.split_once(':') {
        Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
        None => (line, ""),
    };
    match field {
        "data" => {
            data.push_str(value);
            data.push('\n');
        }
        "event" => {
            event.clear();
            event.push_str(value);
        }
        "error" => {
            if *has_error {
                error.push('\n');
            }
            error.push_str(value);
            *has_error = true;
        }
        // `id`, `retry` and unknown fields.
        _ => {}
    }
}

#[cfg(test)]
mod tests {
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
}
