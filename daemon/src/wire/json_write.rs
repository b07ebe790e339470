//! JSON pieces written straight into a frame buffer, without `fmt` where it showed in the
//! per-token profile: strings (escaped), decimal and hex numbers, logprobs.

use std::io::Write as _;

/// Bytes a JSON-escaped string takes per byte of text, at most (`\u001f`).
pub const ESCAPED_PER_BYTE: usize = 6;

/// The f32 whose `Display` is the longest (`-0.000…001`, 48 bytes,
/// [`crate::wire::encode::bound::MAX_LOGPROB_BYTES`]): −1e-45.
pub const LONGEST_LOGPROB: f32 = f32::from_bits(0x8000_0001);

/// Writes a logprob; non-finite values use vLLM's -9999.0 sentinel, since JSON has no -inf.
pub fn write_logprob(out: &mut Vec<u8>, lp: f32) {
    if lp.is_finite() {
        let _ = write!(out, "{lp}");
    } else {
        out.extend_from_slice(b"-9999.0");
    }
}

pub fn write_str(out: &mut Vec<u8>, s: &str) {
    // Serialising a &str into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// A decimal number, without `fmt` (once per frame and per byte of a `bytes` field).
pub fn write_u64(out: &mut Vec<u8>, mut n: u64) {
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&buf[i..]);
}

/// `{:08x}`, without `fmt`.
pub fn write_hex8(out: &mut Vec<u8>, v: u32) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for shift in (0..8).rev() {
        out.push(HEX[(v >> (shift * 4)) as usize & 0xf]);
    }
}
