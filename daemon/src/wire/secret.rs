//! A credential on the wire (the client's `Authorization` value, passed through to the
//! upstream), kept out of every log and record.

use std::fmt;

use sha2::{Digest as _, Sha256};

/// A credential (an upstream API key, a client's bearer token) that must never reach a log
/// or a record. `Debug` and `Display` print `Secret(<redacted>)`; records name the key by
/// [`Secret::fingerprint`].
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
    /// First 16 hex digits of the SHA-256 of the secret: names a key in records and logs
    /// without revealing it.
    pub fn fingerprint(&self) -> String {
        let digest = Sha256::digest(self.0.as_bytes());
        let mut hex = hex::encode(digest);
        hex.truncate(16);
        hex
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
        let fp = s.fingerprint();
        assert_eq!(fp.len(), 16);
        assert!(fp.bytes().all(|b| b.is_ascii_hexdigit()));
        // SHA-256("abc") = ba7816bf8f01cfea...
        assert_eq!(
            Secret::from("abc".to_owned()).fingerprint(),
            "ba7816bf8f01cfea"
        );
        assert_ne!(Secret::new("abd").fingerprint(), "ba7816bf8f01cfea");
    }
}
