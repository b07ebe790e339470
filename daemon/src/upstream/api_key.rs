//! `--upstream-api-key-file`: haltd's own credential for the upstream.
//!
//! Without it a client's `Authorization` value goes upstream as it came, so every client needs
//! a key the backend accepts. With it, haltd sends `Authorization: Bearer <key>` from the file
//! on every upstream request (turns, `/v1/models`, embeddings) and never forwards the client's
//! value: clients keep their own keys, which still name their conversation and degraded
//! mode (`identity.rs`), and the backend's key stays on the node.
//!
//! The file is read once at start, before privileges are dropped: one line, visible ASCII,
//! and readable by its owner only, like the admin token file.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use crate::wire::Secret;

/// Longest key accepted: a bound on what goes into every request head.
const MAX_KEY_LEN: usize = 4096;

/// The upstream credential, as the header value haltd sends.
#[derive(Clone, Debug)]
pub struct UpstreamApiKey {
    /// `Bearer <key>`.
    header: Secret,
}

impl UpstreamApiKey {
    /// Reads the key from `path`: the first line, trimmed; refused when the file can be read
    /// or written by group or others, is empty, holds more than one line, or bytes other
    /// than visible ASCII.
    pub fn read(path: &Path) -> Result<UpstreamApiKey, String> {
        let shown = path.display();
        let meta = std::fs::metadata(path).map_err(|e| format!("{shown}: {e}"))?;
        let mode = meta.permissions().mode();
        if mode & 0o077 != 0 {
            return Err(format!(
                "{shown}: readable or writable by group or others (mode {:o}); chmod 600 it",
                mode & 0o777
            ));
        }
        let text = std::fs::read_to_string(path).map_err(|e| format!("{shown}: {e}"))?;
        Self::from_file_contents(&text).map_err(|e| format!("{shown}: {e}"))
    }

    /// The key from a file's contents (see [`UpstreamApiKey::read`]). A `Bearer ` prefix in
    /// the file is accepted and not doubled.
    pub fn from_file_contents(text: &str) -> Result<UpstreamApiKey, &'static str> {
        let mut lines = text.lines().filter(|l| !l.trim().is_empty());
        let key = lines.next().map(str::trim).ok_or("the file is empty")?;
        if lines.next().is_some() {
            return Err("the file holds more than one line: it must hold the key alone");
        }
        let key = key
            .strip_prefix("Bearer ")
            .or_else(|| key.strip_prefix("bearer "))
            .unwrap_or(key)
            .trim();
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return Err("the key must be 1 to 4096 characters");
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("the key holds bytes other than visible ASCII (no spaces)");
        }
        Ok(UpstreamApiKey {
            header: Secret::new(format!("Bearer {key}")),
        })
    }

    /// The `Authorization` value for upstream requests.
    pub fn header_value(&self) -> &str {
        self.header.as_str()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_line_becomes_a_bearer_header() {
        let k = UpstreamApiKey::from_file_contents("sk-upstream-123\n").expect("valid");
        assert_eq!(k.header_value(), "Bearer sk-upstream-123");
        let k = UpstreamApiKey::from_file_contents("\n  Bearer sk-x  \n\n").expect("valid");
        assert_eq!(k.header_value(), "Bearer sk-x");
    }

    #[test]
    fn empty_multi_line_and_non_ascii_files_are_refused() {
        for bad in ["", "\n \n", "a\nb\n", "sk key", "sk-\u{e9}", "sk\u{7f}"] {
            assert!(
                UpstreamApiKey::from_file_contents(bad).is_err(),
                "{bad:?} was accepted"
            );
        }
        assert!(UpstreamApiKey::from_file_contents(&"k".repeat(MAX_KEY_LEN + 1)).is_err());
    }

    #[test]
    fn the_key_never_shows_in_debug_output() {
        let k = UpstreamApiKey::from_file_contents("sk-live-secret").expect("valid");
        assert!(!format!("{k:?}").contains("sk-live-secret"));
    }

    #[test]
    fn a_file_others_can_read_is_refused() {
        let dir = std::env::temp_dir().join(format!("haltd-upkey-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("key");
        std::fs::write(&path, "sk-upstream\n").expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let e = UpstreamApiKey::read(&path).expect_err("0644 accepted");
        assert!(e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert_eq!(
            UpstreamApiKey::read(&path).expect("0600").header_value(),
            "Bearer sk-upstream"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
