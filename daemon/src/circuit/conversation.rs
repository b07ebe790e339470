//! What names a conversation: the client's `x-haltd-conversation-id`, else a digest of the
//! transcript's stable prefix, both under the caller's key fingerprint.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// Where a conversation's name came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IdSource {
    /// The client's `x-haltd-conversation-id`.
    Header,
    /// The digest of the transcript's stable prefix.
    Digest,
}

/// A conversation: its name, scoped by the caller's key fingerprint (two tenants choosing
/// the same header value are two conversations).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ConversationId {
    /// The key fingerprint (`KeyId::fingerprint`).
    pub key: String,
    /// The header's value, or 32 hex digits of the prefix digest.
    pub id: String,
    pub source: IdSource,
}

impl ConversationId {
    /// The conversation of a chat request: the header's value if the client sent one, else
    /// the digest of its `messages` before the first assistant message, with `key`.
    pub fn of(header: Option<&str>, key: &str, messages: &[Value]) -> Self {
        if let Some(h) = header {
            return ConversationId {
                key: key.to_owned(),
                id: h.to_owned(),
                source: IdSource::Header,
            };
        }
        let mut d = Sha256::new();
        d.update(key.as_bytes());
        let prefix = messages
            .iter()
            .take_while(|m| m.get("role").and_then(Value::as_str) != Some("assistant"));
        for m in prefix {
            d.update([0]);
            d.update(m.to_string().as_bytes());
        }
        let id = d.finalize()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        ConversationId {
            key: key.to_owned(),
            id,
            source: IdSource::Digest,
        }
    }
}
