//! A tripped stream's terminal frame: the error event (SSE) or error response (HTTP) that
//! ends it, encoded at the trip so that its length is known to the kernel gate before it is
//! sent, and patched with the number of post-trip tokens when it is.

use std::io::Write as _;

use crate::{
    codes::FailureCode,
    source::builtin::MODEL_NAME,
    stream::{Mode, SlotSnapshot},
    wire::{responses::terminal::EVENTS_PER_TOKEN, Endpoint, Halt},
};

use super::HaltCore;

/// A terminal frame encoded at the trip: its bytes, and where the numbers that grow with the
/// post-trip tokens sit, each right-aligned in a field of fixed width, so the frame sent at
/// the halt has exactly the length the gate was told.
#[derive(Debug, Clone)]
pub struct PreparedTerminal {
    pub bytes: Vec<u8>,
    /// The numbers to patch, in the order they occur (none: nothing to patch).
    pub count_fields: Vec<CountField>,
}

/// A number of the terminal frame that is `base` plus `per` times the post-trip tokens:
/// haltd's `post_trip_tokens` (base 0), a halted Messages or Responses stream's
/// `output_tokens` (base τ; and a Responses `total_tokens`), and a Responses terminal's
/// `sequence_number` (the stream's next one at the trip, [`EVENTS_PER_TOKEN`] per token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CountField {
    /// Offset of the field in the frame.
    pub at: usize,
    pub width: usize,
    pub base: u64,
    pub per: u64,
}

impl PreparedTerminal {
    /// A frame without fields to patch.
    pub fn new(bytes: Vec<u8>) -> Self {
        PreparedTerminal {
            bytes,
            count_fields: Vec::new(),
        }
    }

    /// The frame with `post_trip_tokens` set, and every field with it; a number wider than
    /// its field (more post-trip tokens than the budget, which the gate never lets through)
    /// makes a longer frame, which the gate drops.
    pub fn write(&self, post_trip_tokens: u64, out: &mut Vec<u8>) {
        out.clear();
        let mut from = 0;
        for f in &self.count_fields {
            out.extend_from_slice(&self.bytes[from..f.at]);
            let _ = write!(
                out,
                "{:>width$}",
                f.base + f.per * post_trip_tokens,
                width = f.width
            );
            from = f.at + f.width;
        }
        out.extend_from_slice(&self.bytes[from..]);
    }

    /// Makes the number after `key` (its last occurrence with `last`, else its first) a field
    /// of `base` plus the post-trip tokens. The frame was encoded with the most post-trip
    /// tokens there can be, so the number there reads `most` and the field is as wide as
    /// it: a smaller number is written right-aligned after spaces (JSON allows whitespace
    /// before a value), and the frame keeps its length, the size line of a chunked frame
    /// staying true. Nothing changes unless the number there is `most`. (A key cannot occur
    /// inside a JSON string, whose quotes are escaped.)
    pub fn with_field(self, key: &[u8], last: bool, base: u64, most: u64) -> Self {
        self.with_step_field(key, last, (base, 1), most)
    }

    /// [`PreparedTerminal::with_field`] for a number that grows by `per` with each post-trip
    /// token (`base_per`: the base and the step), read `most` when encoded.
    pub fn with_step_field(
        mut self,
        key: &[u8],
        last: bool,
        (base, per): (u64, u64),
        most: u64,
    ) -> Self {
        let mut found = self
            .bytes
            .windows(key.len())
            .enumerate()
            .filter(|(_, w)| *w == key);
        let found = if last {
            found.next_back()
        } else {
            found.next()
        };
        let Some(at) = found.map(|(i, _)| i + key.len()) else {
            return self;
        };
        let digits = most.to_string();
        let end = at + digits.len();
        let is_most = self.bytes.get(at..end) == Some(digits.as_bytes())
            && !self.bytes.get(end).is_some_and(u8::is_ascii_digit);
        if !is_most || base > most {
            return self;
        }
        self.count_fields.push(CountField {
            at,
            width: digits.len(),
            base,
            per,
        });
        self.count_fields.sort_by_key(|f| f.at);
        self
    }
}

/// The key of haltd's `post_trip_tokens` in the terminal's halt object.
const POST_TRIP_KEY: &[u8] = b"\"post_trip_tokens\":";

/// The key of a Messages or Responses `usage.output_tokens`.
const OUTPUT_TOKENS_KEY: &[u8] = b"\"output_tokens\":";

/// The key of a Responses `usage.total_tokens` (no input tokens in a halted response: the
/// output tokens).
const TOTAL_TOKENS_KEY: &[u8] = b"\"total_tokens\":";

/// The key of a Responses event's `sequence_number`.
const SEQUENCE_KEY: &[u8] = b"\"sequence_number\":";

impl HaltCore {
    /// The terminal frame for a tripped stream, in the form its response needs: the one
    /// prepared at the trip when there is one (its length is the one the kernel expects).
    pub fn terminal_frame(&self, snap: &SlotSnapshot, out: &mut Vec<u8>) {
        let prepared = self.meta(snap.id.slot).terminal.clone();
        match prepared {
            Some(t) => t.write(snap.post_trip_delivered, out),
            None => self.encode_terminal(snap, snap.post_trip_delivered, out),
        }
    }

    /// Encodes the terminal frame with `post_trip_tokens` in a field as wide as the stream's
    /// budget needs; on a Messages stream also `usage.output_tokens` (τ plus the post-trip
    /// tokens), as wide as τ plus the budget needs. It is encoded with B post-trip tokens,
    /// its widest, and written with the count at the halt ([`PreparedTerminal::write`]).
    pub fn prepare_terminal(&self, snap: &SlotSnapshot) -> PreparedTerminal {
        let mut bytes = Vec::with_capacity(1024);
        let budget = u64::from(snap.budget);
        self.encode_terminal(snap, budget, &mut bytes);
        let prepared = PreparedTerminal::new(bytes).with_field(POST_TRIP_KEY, false, 0, budget);
        let tau = snap.trip_token_index;
        match snap.endpoint {
            // The halted end's `message_delta`: the last one (a whole response's
            // `message_start`, before it, says 0).
            Endpoint::Messages => prepared.with_field(OUTPUT_TOKENS_KEY, true, tau, tau + budget),
            Endpoint::Responses => responses_fields(prepared, tau, budget),
            Endpoint::Chat | Endpoint::Completion => prepared,
        }
    }

    fn encode_terminal(&self, snap: &SlotSnapshot, post_trip_tokens: u64, out: &mut Vec<u8>) {
        let sequence = snap.sse_events;
        let (model, detail, request_id) = {
            let meta = self.meta(snap.id.slot);
            let model = meta.model.clone().unwrap_or_else(|| MODEL_NAME.into());
            let mut detail = Vec::new();
            if let Some(f) = &meta.upstream_failure {
                detail.push((
                    "upstream",
                    serde_json::json!({"kind": f.kind.as_str(), "message": f.message}),
                ));
            }
            if let Some(artifact) = &meta.tool_circuit {
                detail.push(("tool_circuit", artifact.clone()));
            }
            if let Some((name, what)) = &meta.detector_trip {
                detail.push((
                    "detector",
                    serde_json::json!({"name": name.as_str(), "detail": what}),
                ));
            }
            (model, detail, meta.request_id.clone())
        };
        let halt = Halt {
            request_id,
            stream_id: snap.id,
            endpoint: snap.endpoint,
            created: snap.created,
            model,
            code: snap.trip_cause.unwrap_or(FailureCode::WatchdogTrip),
            trip_token_index: snap.trip_token_index,
            post_trip_tokens,
            nonce: snap.nonce,
            degraded: snap.degraded,
            detail,
            sequence,
        };
        out.clear();
        if snap.mode == Mode::Stream && snap.headers_sent && snap.chunked {
            halt.sse_terminal_chunked(out);
        } else if snap.mode == Mode::Stream && snap.headers_sent {
            halt.sse_terminal(out);
        } else {
            halt.http_terminal(out, snap.client_sse);
        }
    }
}

/// A Responses terminal's count fields: the usage's output and total tokens (τ plus the
/// post-trip tokens), and the terminal event's `sequence_number`, the last one of the frame
/// (a whole response's start events, before it, are numbered 0 and 1). Encoded with B
/// post-trip tokens it reads its base plus [`EVENTS_PER_TOKEN`] × B.
fn responses_fields(prepared: PreparedTerminal, tau: u64, budget: u64) -> PreparedTerminal {
    let step = EVENTS_PER_TOKEN * budget;
    let seq = last_number(&prepared.bytes, SEQUENCE_KEY).filter(|&n| n >= step);
    let prepared = prepared
        .with_field(OUTPUT_TOKENS_KEY, true, tau, tau + budget)
        .with_field(TOTAL_TOKENS_KEY, true, tau, tau + budget);
    match seq {
        Some(most) => {
            prepared.with_step_field(SEQUENCE_KEY, true, (most - step, EVENTS_PER_TOKEN), most)
        }
        None => prepared,
    }
}

/// The number after the last `key` of `bytes`.
fn last_number(bytes: &[u8], key: &[u8]) -> Option<u64> {
    let at = bytes.windows(key.len()).rposition(|w| w == key)? + key.len();
    let digits = bytes[at..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count();
    std::str::from_utf8(&bytes[at..at + digits])
        .ok()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::wire::StreamId;

    fn written(t: &PreparedTerminal, post: u64) -> String {
        let mut out = Vec::new();
        t.write(post, &mut out);
        String::from_utf8(out).expect("utf8")
    }

    /// The terminal of a Messages or chat stream tripped at `tau`, encoded as at the trip
    /// (with `budget` post-trip tokens), chunked when `chunked`.
    fn prepared(endpoint: Endpoint, tau: u64, budget: u64, chunked: bool) -> PreparedTerminal {
        let halt = Halt {
            stream_id: StreamId {
                slot: 1,
                generation: 2,
            },
            endpoint,
            created: 1,
            model: Arc::from("m"),
            code: FailureCode::OperatorTrip,
            trip_token_index: tau,
            post_trip_tokens: budget,
            nonce: 7,
            degraded: false,
            detail: Vec::new(),
            request_id: None,
            sequence: 0,
        };
        let mut bytes = Vec::new();
        if chunked {
            halt.sse_terminal_chunked(&mut bytes);
        } else {
            halt.sse_terminal(&mut bytes);
        }
        let t = PreparedTerminal::new(bytes).with_field(POST_TRIP_KEY, false, 0, budget);
        match endpoint {
            Endpoint::Messages => t.with_field(OUTPUT_TOKENS_KEY, true, tau, tau + budget),
            _ => t,
        }
    }

    /// The JSON of each `data:` line of an SSE text.
    fn data(text: &str) -> Vec<serde_json::Value> {
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str(d).ok())
            .collect()
    }

    #[test]
    fn every_count_field_grows_with_the_post_trip_tokens_at_a_fixed_length() {
        // τ crossing a power of ten with B (5 + 5, 98 + 5), B of two digits, B = 0.
        for (tau, budget) in [(5, 5), (98, 5), (3, 12), (0, 0)] {
            let t = prepared(Endpoint::Messages, tau, budget, false);
            assert_eq!(t.count_fields.len(), 2, "τ {tau} B {budget}");
            let len = t.bytes.len();
            for post in 0..=budget {
                let out = written(&t, post);
                assert_eq!(out.len(), len, "τ {tau} B {budget} post {post}");
                let end = data(&out)
                    .into_iter()
                    .find(|v| v["type"] == "message_delta")
                    .expect("message_delta");
                assert_eq!(end["usage"]["output_tokens"], tau + post, "{out}");
                assert_eq!(end["haltd"]["post_trip_tokens"], post, "{out}");
            }
            // More than the field holds: a longer frame (the gate drops it).
            assert!(written(&t, budget + 1000).len() > len);
        }
    }

    #[test]
    fn a_chunked_terminal_s_size_line_stays_true() {
        for endpoint in [Endpoint::Chat, Endpoint::Messages] {
            for (tau, budget) in [(5, 5), (3, 12), (0, 100)] {
                let t = prepared(endpoint, tau, budget, true);
                let out = written(&t, budget / 2);
                let size = usize::from_str_radix(&out[..8], 16).expect("a size line");
                assert_eq!(&out[8..10], "\r\n");
                assert_eq!(
                    &out[10 + size..],
                    "\r\n0\r\n\r\n",
                    "{endpoint:?} τ {tau} B {budget}: the chunk is not {size} bytes: {out:?}"
                );
            }
        }
    }

    #[test]
    fn a_responses_terminal_counts_its_sequence_number_and_usage() {
        for (tau, budget, next) in [(5, 5, 12), (98, 5, 300), (3, 12, 7), (0, 0, 2)] {
            for chunked in [false, true] {
                let halt = Halt {
                    stream_id: StreamId {
                        slot: 1,
                        generation: 2,
                    },
                    endpoint: Endpoint::Responses,
                    created: 1,
                    model: Arc::from("m"),
                    code: FailureCode::OperatorTrip,
                    trip_token_index: tau,
                    post_trip_tokens: budget,
                    nonce: 7,
                    degraded: false,
                    detail: Vec::new(),
                    request_id: None,
                    sequence: next,
                };
                let mut bytes = Vec::new();
                if chunked {
                    halt.sse_terminal_chunked(&mut bytes);
                } else {
                    halt.sse_terminal(&mut bytes);
                }
                let t = PreparedTerminal::new(bytes).with_field(POST_TRIP_KEY, false, 0, budget);
                let t = responses_fields(t, tau, budget);
                assert_eq!(t.count_fields.len(), 4, "τ {tau} B {budget}");
                let len = t.bytes.len();
                for post in 0..=budget {
                    let out = written(&t, post);
                    assert_eq!(out.len(), len, "τ {tau} B {budget} post {post}");
                    let end = data(&out)
                        .into_iter()
                        .find(|v| v["type"] == "response.incomplete")
                        .expect("response.incomplete");
                    let seq = next + EVENTS_PER_TOKEN * post;
                    assert_eq!(end["sequence_number"], seq, "{out}");
                    assert_eq!(end["response"]["usage"]["output_tokens"], tau + post);
                    assert_eq!(end["response"]["usage"]["total_tokens"], tau + post);
                    assert_eq!(end["response"]["haltd"]["post_trip_tokens"], post);
                }
            }
        }
    }

    #[test]
    fn a_number_other_than_the_most_is_no_field() {
        let t = PreparedTerminal::new(br#"{"output_tokens":12}"#.to_vec())
            .with_field(OUTPUT_TOKENS_KEY, true, 1, 6)
            .with_field(POST_TRIP_KEY, false, 0, 5);
        assert!(t.count_fields.is_empty());
        assert_eq!(written(&t, 3), r#"{"output_tokens":12}"#);
    }
}
