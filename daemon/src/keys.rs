//! The key store (issue 36): keys haltd issues to its clients, with `--client-keys store`.
//!
//! - **A key** is `hk-<id>-<secret>`: `id` 16 hex digits (64 random bits, public: records,
//!   the access log, `haltctl key list` and degraded scopes name a key by it), `secret` 64 hex
//!   digits (256 random bits). Only the secret's **SHA-256** is stored: a 256-bit random
//!   secret needs no slow hash (no dictionary reaches it), and the hash is compared in
//!   constant time (`subtle`). No command prints a stored secret: `haltctl key add` and
//!   `rotate` print the new one once, from the answer that created it.
//! - **Changes** come only from the admin API (`haltctl key add|revoke|rotate`): each is an
//!   `admin` ledger record with the operator's identity, written before the change is
//!   applied; the change is then written to the state store (`state.rs`, table
//!   `client_keys`) and waited for, and only then applied here and answered. A crash between
//!   the record and the store loses an unanswered change: an added key nobody received, a
//!   revocation the operator saw fail and repeats.
//! - **Rotation** gives a key a new secret; the old one keeps working for the overlap
//!   window the operator chose (`--overlap-s`, 0 ends it at once), then is refused.
//! - **Revocation** refuses the key's next request with 401; the turns it has open are
//!   tripped (`OPERATOR_TRIP`, recorded with the revocation).
//!
//! The registry is read once per request (a read lock and one hash map lookup), never per
//! token.

use std::{
    collections::HashMap,
    sync::{PoisonError, RwLock},
};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::{identity::KeyId, limits::Limits};

/// `--client-keys`: whether clients must hold a key of the key store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ClientKeys {
    /// No key store: clients' credentials pass upstream; scopes are the identity header's
    /// value or the address group.
    Off,
    /// Every `/v1/` request needs a key haltd issued (`haltctl key add`): an unknown or revoked
    /// one gets 401 before any upstream work, and the key's id is the request's identity.
    Store,
}

/// What every key starts with.
pub const KEY_PREFIX: &str = "hk-";

/// One secret of a key: its SHA-256, and when it stops working (a rotated-out secret).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretHash {
    #[serde(with = "hex32")]
    pub sha256: [u8; 32],
    pub not_after_unix_ms: Option<u64>,
}

/// A key's own limits (`None` in a field: the node's `--limit-*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyLimits {
    pub concurrency: Option<u32>,
    pub requests_per_minute: Option<u32>,
    pub tokens_per_minute: Option<u64>,
}

impl KeyLimits {
    /// The limits in force for this key under the node's `node` limits.
    pub fn over(&self, node: Limits) -> Limits {
        Limits {
            concurrency: self.concurrency.unwrap_or(node.concurrency),
            requests_per_minute: self.requests_per_minute.unwrap_or(node.requests_per_minute),
            tokens_per_minute: self.tokens_per_minute.unwrap_or(node.tokens_per_minute),
        }
    }
}

/// A key as the store keeps it (the state store's `client_keys` body).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientKey {
    #[serde(with = "fingerprint")]
    pub id: KeyId,
    pub name: String,
    pub created_unix_ms: u64,
    pub revoked_unix_ms: Option<u64>,
    pub secrets: Vec<SecretHash>,
    #[serde(default)]
    pub limits: KeyLimits,
}

mod hex32 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8; 32], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 32], D::Error> {
        let text = String::deserialize(d)?;
        hex::decode(&text)
            .ok()
            .and_then(|b| <[u8; 32]>::try_from(b).ok())
            .ok_or_else(|| serde::de::Error::custom("a secret's hash is not 64 hex digits"))
    }
}

mod fingerprint {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::identity::KeyId;

    pub fn serialize<S: Serializer>(id: &KeyId, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&id.fingerprint())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<KeyId, D::Error> {
        let text = String::deserialize(d)?;
        KeyId::parse_fingerprint(&text)
            .ok_or_else(|| serde::de::Error::custom(format!("{text:?} is no key id")))
    }
}

/// What `haltctl key list` shows of a key: never a secret or its hash.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KeyView {
    pub id: String,
    pub name: String,
    pub state: &'static str,
    pub created_unix_ms: u64,
    pub revoked_unix_ms: Option<u64>,
    /// Secrets that work now (2 during a rotation's overlap).
    pub secrets_active: usize,
    /// When the oldest working secret stops working, during an overlap.
    pub overlap_ends_unix_ms: Option<u64>,
    pub limits: KeyLimits,
}

impl ClientKey {
    pub fn is_revoked(&self) -> bool {
        self.revoked_unix_ms.is_some()
    }

    fn active(&self, now_ms: u64) -> impl Iterator<Item = &SecretHash> {
        self.secrets
            .iter()
            .filter(move |s| s.not_after_unix_ms.is_none_or(|t| now_ms < t))
    }

    pub fn view(&self, now_ms: u64) -> KeyView {
        let active: Vec<&SecretHash> = self.active(now_ms).collect();
        KeyView {
            id: self.id.fingerprint(),
            name: self.name.clone(),
            state: if self.is_revoked() {
                "revoked"
            } else if active.len() > 1 {
                "rotating"
            } else {
                "active"
            },
            created_unix_ms: self.created_unix_ms,
            revoked_unix_ms: self.revoked_unix_ms,
            secrets_active: if self.is_revoked() { 0 } else { active.len() },
            overlap_ends_unix_ms: active.iter().filter_map(|s| s.not_after_unix_ms).min(),
            limits: self.limits,
        }
    }
}

/// Why a request's key is refused (answered 401).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyRefusal {
    #[error("this haltd requires a key it issued: `Authorization: Bearer hk-...` or `x-api-key: hk-...`")]
    Missing,
    #[error(
        "the key is not a key of this haltd (keys look like hk-<16 hex digits>-<64 hex digits>)"
    )]
    Malformed,
    #[error("unknown key")]
    Unknown,
    #[error("the key was revoked")]
    Revoked,
}

/// A key that authenticated a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyMatch {
    pub id: KeyId,
    pub name: String,
    pub limits: KeyLimits,
}

/// A new secret: the key to hand out once, and what the store keeps of it.
pub struct NewSecret {
    pub token: String,
    pub hash: SecretHash,
}

impl std::fmt::Debug for NewSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NewSecret(..)")
    }
}

/// Makes a new random secret for key `id`.
pub fn new_secret(id: KeyId) -> NewSecret {
    let mut secret = [0u8; 32];
    rand::fill(&mut secret);
    let secret = hex::encode(secret);
    NewSecret {
        token: format!("{KEY_PREFIX}{}-{secret}", id.fingerprint()),
        hash: SecretHash {
            sha256: Sha256::digest(secret.as_bytes()).into(),
            not_after_unix_ms: None,
        },
    }
}

/// A new key id, random, and not `taken`.
pub fn new_id(taken: impl Fn(KeyId) -> bool) -> KeyId {
    loop {
        let id = KeyId(rand::random::<u64>());
        if !taken(id) {
            return id;
        }
    }
}

/// A token's id and secret (`None`: not `hk-<16 hex>-<64 hex>`).
fn split(token: &str) -> Option<(KeyId, &str)> {
    let rest = token.strip_prefix(KEY_PREFIX)?;
    let (id, secret) = rest.split_once('-')?;
    let hex64 = secret.len() == 64 && secret.bytes().all(|b| b.is_ascii_hexdigit());
    hex64.then_some(())?;
    KeyId::parse_fingerprint(id).map(|id| (id, secret))
}

/// The keys of this node, as the state store holds them.
#[derive(Debug, Default)]
pub struct KeyStore {
    keys: RwLock<HashMap<KeyId, ClientKey>>,
}

impl KeyStore {
    pub fn new(keys: Vec<ClientKey>) -> KeyStore {
        KeyStore {
            keys: RwLock::new(keys.into_iter().map(|k| (k.id, k)).collect()),
        }
    }

    /// Checks a request's bearer token at `now_ms`: the key it authenticates as.
    pub fn verify(&self, token: Option<&str>, now_ms: u64) -> Result<KeyMatch, KeyRefusal> {
        let token = token.ok_or(KeyRefusal::Missing)?;
        let (id, secret) = split(token).ok_or(KeyRefusal::Malformed)?;
        let presented: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
        let keys = self.keys.read().unwrap_or_else(PoisonError::into_inner);
        let key = keys.get(&id).ok_or(KeyRefusal::Unknown)?;
        // Every working secret is compared, in constant time, whichever matches.
        let matched = key.active(now_ms).fold(subtle::Choice::from(0), |m, s| {
            m | s.sha256.ct_eq(&presented)
        });
        if !bool::from(matched) {
            return Err(KeyRefusal::Unknown);
        }
        if key.is_revoked() {
            return Err(KeyRefusal::Revoked);
        }
        Ok(KeyMatch {
            id,
            name: key.name.clone(),
            limits: key.limits,
        })
    }

    pub fn get(&self, id: KeyId) -> Option<ClientKey> {
        let keys = self.keys.read().unwrap_or_else(PoisonError::into_inner);
        keys.get(&id).cloned()
    }

    pub fn contains(&self, id: KeyId) -> bool {
        let keys = self.keys.read().unwrap_or_else(PoisonError::into_inner);
        keys.contains_key(&id)
    }

    /// Puts a key as the store now holds it (added, rotated or revoked).
    pub fn put(&self, key: ClientKey) {
        let mut keys = self.keys.write().unwrap_or_else(PoisonError::into_inner);
        keys.insert(key.id, key);
    }

    /// Every key, by id, as `haltctl key list` shows them.
    pub fn list(&self, now_ms: u64) -> Vec<KeyView> {
        let keys = self.keys.read().unwrap_or_else(PoisonError::into_inner);
        let mut all: Vec<KeyView> = keys.values().map(|k| k.view(now_ms)).collect();
        all.sort_by(|a, b| a.id.cmp(&b.id));
        all
    }
}

/// A key with a new secret: the old ones stop working `overlap_ms` after `now_ms`.
pub fn rotated(key: &ClientKey, overlap_ms: u64, now_ms: u64) -> (ClientKey, String) {
    let fresh = new_secret(key.id);
    let mut next = key.clone();
    let end = now_ms.saturating_add(overlap_ms);
    next.secrets
        .retain(|s| s.not_after_unix_ms.is_none_or(|t| now_ms < t));
    for s in &mut next.secrets {
        s.not_after_unix_ms = Some(s.not_after_unix_ms.map_or(end, |t| t.min(end)));
    }
    next.secrets.push(fresh.hash);
    (next, fresh.token)
}

#[cfg(test)]
mod tests;
