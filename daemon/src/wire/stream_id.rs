//! The stream id every response carries (`x-haltd-stream-id`, chunk ids, the terminal event),
//! and the trip nonce as the terminal frame writes it.

use std::{fmt, str::FromStr};

/// Identity of a stream: slot index plus the slot's generation, so an id of a finished stream
/// never names the stream that reuses its slot. Written `hs_<generation:08x><slot:08x>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StreamId {
    pub slot: u32,
    pub generation: u32,
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "hs_{:08x}{:08x}", self.generation, self.slot)
    }
}

/// Error for a malformed stream id.
#[derive(Debug, thiserror::Error)]
#[error("malformed stream id {0:?}: expected hs_ followed by 16 hex digits")]
pub struct BadStreamId(pub String);

impl FromStr for StreamId {
    type Err = BadStreamId;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadStreamId(s.chars().take(64).collect());
        let hex = s.strip_prefix("hs_").ok_or_else(bad)?;
        if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        let generation = u32::from_str_radix(&hex[..8], 16).map_err(|_| bad())?;
        let slot = u32::from_str_radix(&hex[8..], 16).map_err(|_| bad())?;
        Ok(StreamId { slot, generation })
    }
}

/// The nonce as the 16 ASCII hex digits the gate compares.
pub fn nonce_hex(nonce: u64) -> [u8; 16] {
    let mut out = [0u8; 16];
    let digits = b"0123456789abcdef";
    for (i, b) in out.iter_mut().enumerate() {
        *b = digits[((nonce >> (60 - 4 * i)) & 0xf) as usize];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_ids_round_trip_and_reject_garbage() {
        let id = StreamId {
            slot: 7,
            generation: 0xdead_beef,
        };
        assert_eq!(id.to_string(), "hs_deadbeef00000007");
        assert_eq!(id.to_string().parse::<StreamId>().ok(), Some(id));
        for bad in [
            "",
            "hs_",
            "hs_123",
            "xx_deadbeef00000007",
            "hs_deadbeef0000000g",
            "hs_deadbeef000000071",
        ] {
            assert!(bad.parse::<StreamId>().is_err(), "{bad}");
        }
    }

    #[test]
    fn nonce_hex_is_big_endian_lowercase() {
        assert_eq!(&nonce_hex(0x0123_4567_89ab_cdef), b"0123456789abcdef");
    }
}
