//! A tripped stream's terminal frame: the error event (SSE) or error response (HTTP) that
//! ends it, encoded at the trip so that its length is known to the kernel gate before it is
//! sent, and patched with the number of post-trip tokens when it is.

use std::io::Write as _;

use crate::{
    codes::FailureCode,
    source::builtin::MODEL_NAME,
    stream::{Mode, SlotSnapshot},
    wire::Halt,
};

use super::HaltCore;

/// A terminal frame encoded at the trip: its bytes, and where the `post_trip_tokens` number
/// sits, right-aligned in a field of fixed width, so the frame sent at the halt has exactly
/// the length the gate was told.
#[derive(Debug, Clone)]
pub struct PreparedTerminal {
    pub bytes: Vec<u8>,
    /// Offset and width of the number's field (`None`: no such field, nothing to patch).
    pub count_field: Option<(usize, usize)>,
}

impl PreparedTerminal {
    /// The frame with `post_trip_tokens` set; a number wider than the field (more post-trip
    /// tokens than the budget, which the gate never lets through) makes a longer frame, which
    /// the gate drops.
    pub fn write(&self, post_trip_tokens: u64, out: &mut Vec<u8>) {
        out.clear();
        let Some((at, width)) = self.count_field else {
            out.extend_from_slice(&self.bytes);
            return;
        };
        out.extend_from_slice(&self.bytes[..at]);
        let _ = write!(out, "{post_trip_tokens:>width$}");
        out.extend_from_slice(&self.bytes[at + width..]);
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
    /// budget needs.
    pub fn prepare_terminal(&self, snap: &SlotSnapshot) -> PreparedTerminal {
        let mut bytes = Vec::with_capacity(1024);
        self.encode_terminal(snap, 0, &mut bytes);
        let width = u64::from(snap.budget).max(1).ilog10() as usize + 1;
        // The key occurs once, outside any string (a quote inside a JSON string is escaped).
        let key = b"\"post_trip_tokens\":";
        let count_field = bytes
            .windows(key.len())
            .position(|w| w == key)
            .map(|i| i + key.len());
        match count_field {
            Some(at) if bytes.get(at) == Some(&b'0') => {
                // JSON allows whitespace before a value: pad "0" to the field's width.
                let pad = width - 1;
                bytes.splice(at..at, std::iter::repeat_n(b' ', pad));
                PreparedTerminal {
                    bytes,
                    count_field: Some((at, width)),
                }
            }
            _ => PreparedTerminal {
                bytes,
                count_field: None,
            },
        }
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
