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
mod tests;
