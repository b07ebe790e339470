//! Cutting text to a size: token texts at a byte cap (at a character boundary), and
//! client-facing messages at a number of characters.

/// `s` cut to at most `max` bytes at a UTF-8 character boundary.
pub fn truncate_text(s: &str, max: usize) -> &str {
    &s[..s.floor_char_boundary(max)]
}

/// Keeps at most `max` characters of `s` (client-facing messages must stay short).
pub fn truncate_chars(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => s[..i].to_owned(),
        None => s.to_owned(),
    }
}
