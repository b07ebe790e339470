//! A credential on the wire (the client's `Authorization` value, passed through to the
//! upstream), kept out of every log and record.

use std::fmt;

/// A credential (an upstream API key, a client's bearer token) that must never reach a log
/// or a record. `Debug` and `Display` print `Secret(<redacted>)`; records name a client's
/// key by its keyed fingerprint ([`crate::modes::KeyId`], `identity.rs`), never by a plain
/// hash that a guessed key could be checked against.
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }
    /// The secret itself, for the one place it is written (a request head).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Self {
        Secret(s)
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_is_redacted() {
        let s = Secret::new("sk-live-123456");
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
        assert_eq!(format!("{s}"), "Secret(<redacted>)");
        assert_eq!(format!("{:?}", Some(s.clone())), "Some(Secret(<redacted>))");
        assert_eq!(s.as_str(), "sk-live-123456");
    }
}
