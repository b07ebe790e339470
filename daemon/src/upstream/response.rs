//! An incremental reader of one HTTP/1.1 response from the upstream.
//!
//! The data plane reads the upstream socket with io_uring into whatever buffer it has, so bytes
//! arrive split at arbitrary points: inside the head, inside a chunk-size line, between the CR
//! and LF after a chunk. [`ResponseReader`] keeps the little state that needs (a partial head
//! or line) and turns each read into de-framed body bytes, so the SSE parser above it never
//! sees transfer framing.
//!
//! Framing follows RFC 9112 §6.3 for a response to GET/POST: 1xx interim heads are skipped,
//! 204 and 304 have no body, `transfer-encoding: chunked` wins, then `content-length`, else the
//! body runs until the connection closes. A close-delimited body that ends early is only
//! detectable at EOF, which is what [`ResponseReader::eof`] decides: a truncated upstream
//! stream must end as an upstream failure, never pass as a clean end. Whether the connection
//! may carry another request afterwards ([`ResponseHead::keep_alive`], RFC 9112 §9.3) is for
//! the data plane's upstream pool to use once the body ended cleanly.
//!
//! Anything ambiguous (conflicting lengths, both framings, a content coding haltd cannot undo)
//! is an error rather than a guess: an upstream is a separate process, possibly behind a
//! proxy, and a misread body would feed detectors the wrong tokens.

use crate::wire::truncate_chars;

/// Most headers an upstream response may carry.
pub const MAX_RESPONSE_HEADERS: usize = 64;
/// Longest chunk-size line (size plus extensions), or trailer line.
pub const MAX_CHUNK_LINE: usize = 4096;

/// How the response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// `transfer-encoding: chunked`.
    Chunked,
    /// `content-length: n`.
    ContentLength(u64),
    /// Until the upstream closes the connection.
    Close,
    /// No body (204, 304).
    NoBody,
}

/// The parsed head of the final (non-1xx) response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHead {
    pub status: u16,
    pub reason: String,
    pub content_type: Option<String>,
    /// Raw `retry-after` (seconds or an HTTP date); the caller caps it.
    pub retry_after: Option<String>,
    /// `content-encoding` other than `identity`: the body is compressed, which haltd asks
    /// not to get (`accept-encoding: identity`) and cannot decode.
    pub content_encoding: Option<String>,
    pub framing: Framing,
    /// The connection may carry another request once this body ended: HTTP/1.1 without
    /// `connection: close`, HTTP/1.0 only with `connection: keep-alive`, and a body with an
    /// end of its own (not close-delimited).
    pub keep_alive: bool,
}

impl ResponseHead {
    fn media_type(&self) -> Option<&str> {
        self.content_type
            .as_deref()
            .map(|ct| ct.split(';').next().unwrap_or_default().trim())
    }
    /// Whether the body is an SSE stream (`text/event-stream`, any parameters).
    pub fn is_event_stream(&self) -> bool {
        self.media_type()
            .is_some_and(|m| m.eq_ignore_ascii_case("text/event-stream"))
    }
    /// Whether the body is JSON (`application/json`, any parameters).
    pub fn is_json(&self) -> bool {
        self.media_type()
            .is_some_and(|m| m.eq_ignore_ascii_case("application/json"))
    }
}

/// What one [`ResponseReader::feed`] achieved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    /// The head became available during this call ([`ResponseReader::head`]).
    pub head_ready: bool,
    /// The body is complete (by its framing; a close-delimited body completes at
    /// [`ResponseReader::eof`]).
    pub body_done: bool,
}

/// Why an upstream response cannot be read. Every case is the upstream's fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResponseError {
    #[error("upstream response head larger than {limit} bytes")]
    HeadTooLarge { limit: usize },
    #[error("upstream response has more than {limit} headers")]
    TooManyHeaders { limit: usize },
    #[error("malformed upstream response head: {reason}")]
    MalformedHead { reason: String },
    #[error("upstream answered {status}, which haltd does not handle")]
    UnexpectedStatus { status: u16 },
    #[error("upstream content-length {value:?} is not a decimal number")]
    BadContentLength { value: String },
    #[error("upstream response has conflicting content-length values")]
    ConflictingContentLength,
    #[error("upstream response has both transfer-encoding and content-length")]
    ConflictingFraming,
    #[error("upstream transfer-encoding {value:?} is not supported (only chunked)")]
    UnsupportedTransferEncoding { value: String },
    #[error("bad chunk size line {line:?} in upstream response")]
    BadChunkSize { line: String },
    #[error("upstream chunk-size or trailer line longer than {limit} bytes")]
    ChunkLineTooLong { limit: usize },
    #[error("upstream chunk data not followed by CRLF")]
    MissingChunkCrlf,
    #[error("malformed trailer line in upstream response")]
    MalformedTrailer,
    #[error("upstream trailers larger than {limit} bytes")]
    TrailersTooLarge { limit: usize },
    #[error("upstream sent {count} bytes after the end of the response body")]
    TrailingBytes { count: usize },
    #[error("upstream closed the connection early: {detail}")]
    EarlyEof { detail: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Head,
    Length {
        remaining: u64,
    },
    Close,
    ChunkSize,
    ChunkData {
        remaining: u64,
    },
    /// After a chunk's data: expecting CR (`cr_seen: false`) or LF.
    ChunkDataEnd {
        cr_seen: bool,
    },
    /// After the last chunk: trailer lines until an empty line; `bytes` read so far.
    Trailer {
        bytes: usize,
    },
    Done,
}

/// Reads one HTTP/1.1 response incrementally; see the module doc.
#[derive(Debug)]
pub struct ResponseReader {
    max_head: usize,
    state: State,
    /// Head bytes until the head is complete.
    head_buf: Vec<u8>,
    /// Bytes of interim (1xx) heads skipped so far; they count against `max_head`.
    interim_bytes: usize,
    head: Option<ResponseHead>,
    /// A partial chunk-size or trailer line.
    line: Vec<u8>,
    /// Sticky: once an error is returned, every later call returns it.
    failed: Option<ResponseError>,
}

fn header_text(v: &[u8]) -> String {
    truncate_chars(String::from_utf8_lossy(v).trim(), 256)
}

fn printable(line: &[u8]) -> String {
    truncate_chars(&String::from_utf8_lossy(line), 40)
}

/// The headers of a response head that haltd acts on.
#[derive(Default)]
struct HeadFields {
    content_type: Option<String>,
    retry_after: Option<String>,
    content_encoding: Option<String>,
    content_length: Option<u64>,
    /// Transfer codings other than `identity`, lower-cased, in order.
    codings: Vec<String>,
    has_te: bool,
    /// `connection: close` / `connection: keep-alive` tokens seen.
    conn_close: bool,
    conn_keep_alive: bool,
}

impl HeadFields {
    fn read(headers: &[httparse::Header<'_>]) -> Result<Self, ResponseError> {
        let mut f = HeadFields::default();
        for h in headers {
            let name = h.name;
            if name.eq_ignore_ascii_case("content-type") {
                f.content_type.get_or_insert_with(|| header_text(h.value));
            } else if name.eq_ignore_ascii_case("retry-after") {
                f.retry_after.get_or_insert_with(|| header_text(h.value));
            } else if name.eq_ignore_ascii_case("content-encoding") {
                let v = header_text(h.value);
                if !v.is_empty() && !v.eq_ignore_ascii_case("identity") {
                    f.content_encoding.get_or_insert(v);
                }
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                f.has_te = true;
                let v = String::from_utf8_lossy(h.value);
                f.codings.extend(
                    v.split(',')
                        .map(|c| c.trim().to_ascii_lowercase())
                        .filter(|c| !c.is_empty() && c != "identity"),
                );
            } else if name.eq_ignore_ascii_case("content-length") {
                f.add_content_length(h.value)?;
            } else if name.eq_ignore_ascii_case("connection") {
                for t in h.value.split(|&b| b == b',').map(<[u8]>::trim_ascii) {
                    f.conn_close |= t.eq_ignore_ascii_case(b"close");
                    f.conn_keep_alive |= t.eq_ignore_ascii_case(b"keep-alive");
                }
            }
        }
        Ok(f)
    }

    /// One `content-length` header. A list of identical values ("10, 10") is allowed (RFC 9110
    /// §8.6); different values, here or across headers, are an error.
    fn add_content_length(&mut self, value: &[u8]) -> Result<(), ResponseError> {
        for part in value.split(|&b| b == b',') {
            let part = part.trim_ascii();
            let n = std::str::from_utf8(part)
                .ok()
                .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or_else(|| ResponseError::BadContentLength {
                    value: printable(value),
                })?;
            if self.content_length.is_some_and(|prev| prev != n) {
                return Err(ResponseError::ConflictingContentLength);
            }
            self.content_length = Some(n);
        }
        Ok(())
    }

    /// How the body of a response with `status` and these headers is delimited.
    fn framing(&self, status: u16) -> Result<Framing, ResponseError> {
        if matches!(status, 204 | 304) {
            return Ok(Framing::NoBody);
        }
        if self.has_te {
            if self.content_length.is_some() {
                return Err(ResponseError::ConflictingFraming);
            }
            return match self.codings.as_slice() {
                [] => Ok(Framing::Close),
                [c] if c == "chunked" => Ok(Framing::Chunked),
                _ => Err(ResponseError::UnsupportedTransferEncoding {
                    value: truncate_chars(&self.codings.join(", "), 64),
                }),
            };
        }
        Ok(self
            .content_length
            .map_or(Framing::Close, Framing::ContentLength))
    }
}

/// Parses a head; `Ok(None)` = incomplete. Returns the head and its length in bytes.
fn parse_head(buf: &[u8], max_head: usize) -> Result<Option<(ResponseHead, usize)>, ResponseError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_RESPONSE_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            if buf.len() > max_head {
                return Err(ResponseError::HeadTooLarge { limit: max_head });
            }
            return Ok(None);
        }
        Err(httparse::Error::TooManyHeaders) => {
            return Err(ResponseError::TooManyHeaders {
                limit: MAX_RESPONSE_HEADERS,
            })
        }
        Err(e) => {
            return Err(ResponseError::MalformedHead {
                reason: e.to_string(),
            })
        }
    };
    if len > max_head {
        return Err(ResponseError::HeadTooLarge { limit: max_head });
    }
    let status = resp.code.unwrap_or_default();
    let fields = HeadFields::read(resp.headers)?;
    let framing = fields.framing(status)?;
    let persistent = match resp.version {
        Some(1) => !fields.conn_close,
        _ => fields.conn_keep_alive && !fields.conn_close,
    };
    let keep_alive = persistent && framing != Framing::Close;
    let HeadFields {
        content_type,
        retry_after,
        content_encoding,
        ..
    } = fields;
    Ok(Some((
        ResponseHead {
            status,
            reason: truncate_chars(resp.reason.unwrap_or_default(), 128),
            content_type,
            retry_after,
            content_encoding,
            framing,
            keep_alive,
        },
        len,
    )))
}

impl ResponseReader {
    /// A reader that refuses a head (interim heads included) larger than `max_head` bytes.
    pub fn new(max_head: usize) -> Self {
        ResponseReader {
            max_head,
            state: State::Head,
            head_buf: Vec::new(),
            interim_bytes: 0,
            head: None,
            line: Vec::new(),
            failed: None,
        }
    }

    /// The final response head, once parsed (it stays available after a body error).
    pub fn head(&self) -> Option<&ResponseHead> {
        self.head.as_ref()
    }

    /// Whether the body is complete.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Consumes bytes read from the upstream; body bytes are appended to `body_out`.
    ///
    /// After an error the reader is spent: every later call returns the same error.
    pub fn feed(
        &mut self,
        bytes: &[u8],
        body_out: &mut Vec<u8>,
    ) -> Result<Progress, ResponseError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let r = self.feed_inner(bytes, body_out);
        if let Err(e) = &r {
            self.failed = Some(e.clone());
        }
        r
    }

    fn feed_inner(
        &mut self,
        bytes: &[u8],
        body_out: &mut Vec<u8>,
    ) -> Result<Progress, ResponseError> {
        let mut progress = Progress::default();
        if self.state == State::Head {
            self.head_buf.extend_from_slice(bytes);
            loop {
                let budget = self.max_head.saturating_sub(self.interim_bytes);
                let Some((head, len)) =
                    parse_head(&self.head_buf, budget).map_err(|e| match e {
                        ResponseError::HeadTooLarge { .. } => ResponseError::HeadTooLarge {
                            limit: self.max_head,
                        },
                        e => e,
                    })?
                else {
                    return Ok(progress);
                };
                match head.status {
                    101 => return Err(ResponseError::UnexpectedStatus { status: 101 }),
                    100..=199 => {
                        // Interim response (100 Continue, 103 Early Hints): skip it.
                        self.interim_bytes += len;
                        self.head_buf.drain(..len);
                    }
                    _ => {
                        let rest = self.head_buf.split_off(len);
                        self.head_buf = Vec::new();
                        self.state = match head.framing {
                            Framing::Chunked => State::ChunkSize,
                            Framing::ContentLength(0) | Framing::NoBody => State::Done,
                            Framing::ContentLength(n) => State::Length { remaining: n },
                            Framing::Close => State::Close,
                        };
                        self.head = Some(head);
                        progress.head_ready = true;
                        self.body(&rest, body_out)?;
                        break;
                    }
                }
            }
        } else {
            self.body(bytes, body_out)?;
        }
        progress.body_done = self.state == State::Done;
        Ok(progress)
    }

    /// Appends `data` to the partial line up to and including the first LF. Returns the
    /// bytes consumed and whether the line is complete.
    fn take_line(&mut self, data: &[u8]) -> Result<(usize, bool), ResponseError> {
        let (used, complete) = match data.iter().position(|&b| b == b'\n') {
            Some(p) => (p + 1, true),
            None => (data.len(), false),
        };
        if self.line.len() + used > MAX_CHUNK_LINE {
            return Err(ResponseError::ChunkLineTooLong {
                limit: MAX_CHUNK_LINE,
            });
        }
        self.line.extend_from_slice(&data[..used]);
        Ok((used, complete))
    }

    fn body(&mut self, data: &[u8], out: &mut Vec<u8>) -> Result<(), ResponseError> {
        let mut i = 0;
        while i < data.len() {
            let rest = &data[i..];
            match self.state {
                // `feed` calls this only once the head is parsed.
                State::Head => return Ok(()),
                State::Close => {
                    out.extend_from_slice(rest);
                    i = data.len();
                }
                State::Length { remaining } | State::ChunkData { remaining } => {
                    let take = usize::try_from(remaining).map_or(rest.len(), |r| r.min(rest.len()));
                    out.extend_from_slice(&rest[..take]);
                    i += take;
                    let left = remaining - take as u64;
                    self.state = match (self.state, left) {
                        (State::Length { .. }, 0) => State::Done,
                        (State::Length { .. }, _) => State::Length { remaining: left },
                        (_, 0) => State::ChunkDataEnd { cr_seen: false },
                        (_, _) => State::ChunkData { remaining: left },
                    };
                }
                State::ChunkDataEnd { cr_seen } => {
                    i += 1;
                    self.state = match (cr_seen, rest[0]) {
                        (false, b'\r') => State::ChunkDataEnd { cr_seen: true },
                        (true, b'\n') => State::ChunkSize,
                        _ => return Err(ResponseError::MissingChunkCrlf),
                    };
                }
                State::ChunkSize => {
                    let (used, complete) = self.take_line(rest)?;
                    i += used;
                    if complete {
                        let size = self.chunk_size()?;
                        self.line.clear();
                        self.state = if size == 0 {
                            State::Trailer { bytes: 0 }
                        } else {
                            State::ChunkData { remaining: size }
                        };
                    }
                }
                State::Trailer { bytes } => {
                    let (used, complete) = self.take_line(rest)?;
                    i += used;
                    let total = bytes + used;
                    if total > self.max_head {
                        return Err(ResponseError::TrailersTooLarge {
                            limit: self.max_head,
                        });
                    }
                    self.state = State::Trailer { bytes: total };
                    if complete {
                        if !self.line.ends_with(b"\r\n") {
                            return Err(ResponseError::MalformedTrailer);
                        }
                        if self.line.len() == 2 {
                            self.state = State::Done;
                        }
                        self.line.clear();
                    }
                }
                State::Done => {
                    return Err(ResponseError::TrailingBytes { count: rest.len() });
                }
            }
        }
        Ok(())
    }

    /// The size on the complete chunk-size line in `self.line` (ends in LF).
    fn chunk_size(&self) -> Result<u64, ResponseError> {
        let bad = || ResponseError::BadChunkSize {
            line: printable(self.line.trim_ascii_end()),
        };
        // httparse reads a line with no digits as size 0; that is not a chunk size.
        if !self.line.first().is_some_and(u8::is_ascii_hexdigit) {
            return Err(bad());
        }
        match httparse::parse_chunk_size(&self.line) {
            Ok(httparse::Status::Complete((used, size))) if used == self.line.len() => Ok(size),
            _ => Err(bad()),
        }
    }

    /// The upstream closed the connection: `Ok` if the body ended cleanly.
    pub fn eof(&mut self) -> Result<(), ResponseError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let detail = match self.state {
            State::Done => return Ok(()),
            State::Close => {
                self.state = State::Done;
                return Ok(());
            }
            State::Head if self.head_buf.is_empty() && self.interim_bytes == 0 => {
                "no response head".to_owned()
            }
            State::Head => format!(
                "response head incomplete after {} bytes",
                self.head_buf.len()
            ),
            State::Length { remaining } => match self.head.as_ref().map(|h| h.framing) {
                Some(Framing::ContentLength(total)) => format!(
                    "body has {} of its {total} content-length bytes",
                    total.saturating_sub(remaining)
                ),
                _ => format!("body is {remaining} bytes short"),
            },
            State::ChunkSize | State::ChunkData { .. } | State::ChunkDataEnd { .. } => {
                "chunked body ended before its last chunk".to_owned()
            }
            State::Trailer { .. } => "chunked body ended inside its trailers".to_owned(),
        };
        let e = ResponseError::EarlyEof { detail };
        self.failed = Some(e.clone());
        Err(e)
    }
}

#[cfg(test)]
mod tests;
