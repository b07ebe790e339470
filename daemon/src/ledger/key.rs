//! The ledger key: what makes the chain tamper-evident.
//!
//! Every record's `hash` is HMAC-SHA-256 under this key, not a plain digest, so someone who
//! can rewrite the ledger file but cannot read the key cannot make a record, or a re-linked
//! chain, that verifies. The key is 32 random bytes in `<--state-dir>/ledger.key` (mode 0600,
//! created at first start like the node secret, [`crate::identity`]); `haltctl ledger verify
//! --state-dir` reads it. Losing it makes the existing ledger unverifiable, so it is backed up
//! with the ledger; leaking it voids tamper evidence (not the crash guarantees).

use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::identity::{load_or_create_secret, read_secret, IdentityError};

/// The key file's name in the state directory.
pub const KEY_FILE: &str = "ledger.key";

/// The chain key.
#[derive(Clone)]
pub struct LedgerKey([u8; 32]);

impl std::fmt::Debug for LedgerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LedgerKey(..)")
    }
}

impl LedgerKey {
    /// The key of `state_dir`, created if there is none yet (the daemon).
    pub fn load_or_create(state_dir: &Path) -> Result<Self, IdentityError> {
        load_or_create_secret(state_dir, KEY_FILE).map(LedgerKey)
    }

    /// The key of `state_dir`, which must exist (`haltctl ledger verify`).
    pub fn read(state_dir: &Path) -> Result<Self, IdentityError> {
        read_secret(state_dir, KEY_FILE).map(LedgerKey)
    }

    /// A key for tests and tools that need no persistence.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        LedgerKey(bytes)
    }

    /// The key's id: 16 hex digits of HMAC-SHA-256 of a fixed label under the key. Written
    /// into the first record of every ledger segment (`ledger_key_id`), so that `haltctl
    /// ledger verify` tells a wrong key from a broken chain; it reveals nothing of the key.
    pub fn id(&self) -> String {
        hex::encode(&self.mac(&[b"haltd-ledger-key-id\0"])[..8])
    }

    /// Hex HMAC-SHA-256 of `parts`, fed in order.
    pub fn mac_hex(&self, parts: &[&[u8]]) -> String {
        hex::encode(self.mac(parts))
    }

    fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        for p in parts {
            mac.update(p);
        }
        mac.finalize().into_bytes().into()
    }

    /// Whether `hex_tag` is the MAC of `parts`, compared in constant time.
    pub fn verify_hex(&self, parts: &[&[u8]], hex_tag: &str) -> bool {
        let Ok(tag) = hex::decode(hex_tag) else {
            return false;
        };
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        for p in parts {
            mac.update(p);
        }
        mac.verify_slice(&tag).is_ok()
    }
}
