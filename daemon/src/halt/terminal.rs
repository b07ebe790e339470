//! A tripped stream's terminal frame: the error event (SSE) or error response (HTTP) that
//! ends it, encoded at the trip so that its length is known to the kernel gate before it is
//! sent, and patched with the number of post-trip tokens when it is.

use std::io::Write as _;

use crate::{
    codes::FailureCode,
    source::builtin::MODEL_NAME,
    stream::{Mode, SlotSnapshot},
    wire::{Endpoint, Halt},
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

/// A number of the terminal frame that is `base` plus the post-trip tokens: haltd's
/// `post_trip_tokens` (base 0), and a halted Messages stream's `usage.output_tokens` (base
/// τ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CountField {
    /// Offset of the field in the frame.
    pub at: usize,
    pub width: usize,
    pub base: u64,
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
                f.base + post_trip_tokens,
                width = f.width
            );
            from = f.at + f.width;
        }
        out.extend_from_slice(&self.bytes[from..]);
    }

    /// Makes the number after `key` (its last occurrence with `last`, else its first) a field
    /// of `base` plus the post-trip tokens, wide enough for `most`: JSON allows whitespace
    /// before a value, so it is padded with spaces. Nothing changes unless the number there
    /// is `base`. (A key cannot occur inside a JSON string, whose quotes are escaped.)
    pub fn with_field(mut self, key: &[u8], last: bool, base: u64, most: u64) -> Self {
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
        let digits = base.to_string();
        let end = at + digits.len();
        let is_base = self.bytes.get(at..end) == Some(digits.as_bytes())
            && !self.bytes.get(end).is_some_and(u8::is_ascii_digit);
        if !is_base {
            return self;
        }
        let width = most.max(base).to_string().len();
        let pad = width - digits.len();
        self.bytes.splice(at..at, std::iter::repeat_n(b' ', pad));
        for f in &mut self.count_fields {
            if f.at > at {
                f.at += pad;
            }
        }
        self.count_fields.push(CountField { at, width, base });
        self.count_fields.sort_by_key(|f| f.at);
        self
    }
}

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
    /// tokens), as wide as τ plus the budget needs.
    pub fn prepare_terminal(&self, snap: &SlotSnapshot) -> PreparedTerminal {
        let mut bytes = Vec::with_capacity(1024);
        self.encode_terminal(snap, 0, &mut bytes);
        let budget = u64::from(snap.budget);
        let prepared =
            PreparedTerminal::new(bytes).with_field(b"\"post_trip_tokens\":", false, 0, budget);
        if snap.endpoint != Endpoint::Messages {
            return prepared;
        }
        // The halted end's `message_delta`: the last one (a whole response's
        // `message_start`, before it, says 0).
        let tau = snap.trip_token_index;
        prepared.with_field(b"\"output_tokens\":", true, tau, tau + budget)
    }

    fn encode_terminal(&self, snap: &SlotSnapshot, post_trip_tokens: u64, out: &mut Vec<u8>) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn written(t: &PreparedTerminal, post: u64) -> String {
        let mut out = Vec::new();
        t.write(post, &mut out);
        String::from_utf8(out).expect("utf8")
    }

    #[test]
    fn every_count_field_grows_with_the_post_trip_tokens_at_a_fixed_length() {
        // A halted Messages end at τ = 98, B = 5: both numbers, at their widths.
        let frame = br#"{"usage":{"output_tokens":0}}{"haltd":{"post_trip_tokens":0},"usage":{"output_tokens":98}}"#;
        let t = PreparedTerminal::new(frame.to_vec())
            .with_field(br#""post_trip_tokens":"#, false, 0, 5)
            .with_field(br#""output_tokens":"#, true, 98, 103);
        assert_eq!(t.count_fields.len(), 2);
        let at_trip = written(&t, 0);
        assert_eq!(
            at_trip,
            r#"{"usage":{"output_tokens":0}}{"haltd":{"post_trip_tokens":0},"usage":{"output_tokens": 98}}"#
        );
        let five = written(&t, 5);
        assert_eq!(five.len(), at_trip.len());
        assert!(five.ends_with(r#"{"post_trip_tokens":5},"usage":{"output_tokens":103}}"#));
        let v: Vec<serde_json::Value> = serde_json::Deserializer::from_str(&five)
            .into_iter()
            .collect::<Result<_, _>>()
            .expect("still JSON");
        assert_eq!(v[0]["usage"]["output_tokens"], 0, "message_start's stays");
        assert_eq!(v[1]["usage"]["output_tokens"], 103);
        // More than the field holds: a longer frame (the gate drops it).
        assert!(written(&t, 1000).len() > at_trip.len());
    }

    #[test]
    fn a_number_other_than_its_base_is_no_field() {
        let t = PreparedTerminal::new(br#"{"output_tokens":12}"#.to_vec())
            .with_field(br#""output_tokens":"#, true, 1, 6)
            .with_field(br#""post_trip_tokens":"#, false, 0, 5);
        assert!(t.count_fields.is_empty());
        assert_eq!(written(&t, 3), r#"{"output_tokens":12}"#);
    }
}
