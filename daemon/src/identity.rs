//! Who a request is, for degraded safe mode and the conversation state: one identity per key.
//!
//! A conversation is named by a [`KeyId`](crate::modes::KeyId) computed from the request's
//! [`Credential`], which one rule decides (`credential.rs`): the value of a header the
//! operator names (`--identity-header`, e.g. a gateway's user header), exactly; else the bearer
//! token of `Authorization: Bearer` or `x-api-key`; else none.
//!
//! The id is the first 8 bytes of **HMAC-SHA-256**, under a per-node secret ([`NodeSecret`]),
//! of a domain tag, the credential's namespace (`none`, `bearer` or `header`) and its bytes,
//! so that a header value and a bearer token with the same bytes are two identities. The
//! secret is 32 random bytes created at first start in
//! `<--state-dir>/node.key` (mode 0600, the directory 0700) and read at every later start, so
//! fingerprints are stable on a node across restarts, differ between nodes, and cannot be
//! reversed or tested against a guessed key without the secret. The credential itself is
//! never stored or logged.

use std::{
    fs,
    io::{self, Write},
    os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
};

use hmac::{Hmac, Mac};

pub use crate::credential::Credential;
use sha2::Sha256;

/// What every identity's HMAC starts with: a version, so that a later rule cannot collide
/// with this one (the rule of issue 29 changed every fingerprint).
pub const IDENTITY_DOMAIN: &[u8] = b"haltd identity v2\0";

/// A conversation's key: the first 8 bytes of HMAC-SHA-256, under the node secret, of the
/// request's credential (`credential.rs`, `identity.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyId(pub u64);

impl KeyId {
    /// The key of a request with this credential (`None`: it had none).
    pub fn of(secret: &NodeSecret, credential: Credential<'_>) -> KeyId {
        KeyId(secret.key_id(credential))
    }

    /// The 16-hex-digit fingerprint used in records, metrics-free views and `haltctl`.
    pub fn fingerprint(self) -> String {
        format!("{:016x}", self.0)
    }

    pub fn parse_fingerprint(s: &str) -> Option<KeyId> {
        (s.len() == 16)
            .then(|| u64::from_str_radix(s, 16).ok())
            .flatten()
            .map(KeyId)
    }
}

impl std::fmt::Display for KeyId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// Length of the node secret in bytes.
const SECRET_LEN: usize = 32;

/// The per-node secret fingerprints are keyed with.
#[derive(Clone)]
pub struct NodeSecret([u8; SECRET_LEN]);

impl std::fmt::Debug for NodeSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NodeSecret(..)")
    }
}

/// Why the node secret could not be read or created.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("{path} is readable or writable by group or others (mode {mode:o}); it must be 0600")]
    Exposed { path: PathBuf, mode: u32 },
    #[error("{path} does not hold {SECRET_LEN} bytes as 64 hex digits")]
    Malformed { path: PathBuf },
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> IdentityError + 'a {
    move |source| IdentityError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

impl NodeSecret {
    /// The secret in `dir/node.key`, created (with `dir`) if there is none yet.
    pub fn load_or_create(dir: &Path) -> Result<Self, IdentityError> {
        load_or_create_secret(dir, "node.key").map(NodeSecret)
    }

    /// The secret in `dir/node.key`, which must exist (`haltctl key fingerprint`: a tool
    /// that reads, never creates).
    pub fn read(dir: &Path) -> Result<Self, IdentityError> {
        read_secret(dir, "node.key").map(NodeSecret)
    }

    /// A secret for tests and tools that need no persistence.
    pub fn from_bytes(bytes: [u8; SECRET_LEN]) -> Self {
        NodeSecret(bytes)
    }

    /// The first 8 bytes of HMAC-SHA-256 of `parts`, concatenated (`scope.rs`).
    pub fn mac64(&self, parts: &[&[u8]]) -> u64 {
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        for p in parts {
            mac.update(p);
        }
        let tag = mac.finalize().into_bytes();
        let mut first = [0u8; 8];
        first.copy_from_slice(&tag[..8]);
        u64::from_be_bytes(first)
    }

    /// The first 8 bytes of HMAC-SHA-256 of [`IDENTITY_DOMAIN`], the credential's namespace,
    /// a NUL and its bytes (all requests without a credential share one identity).
    pub fn key_id(&self, credential: Credential<'_>) -> u64 {
        let (namespace, bytes) = credential.domain_and_bytes();
        self.mac64(&[IDENTITY_DOMAIN, namespace, b"\0", bytes])
    }
}

/// The 32-byte secret in `dir/name` (64 hex digits, mode 0600), created with `dir` (0700)
/// if there is none yet. Shared by the node secret and the ledger key
/// ([`crate::ledger::LedgerKey`]).
pub(crate) fn load_or_create_secret(
    dir: &Path,
    name: &str,
) -> Result<[u8; SECRET_LEN], IdentityError> {
    let path = dir.join(name);
    match fs::read_to_string(&path) {
        Ok(text) => check_secret(&path, &text),
        Err(e) if e.kind() == io::ErrorKind::NotFound => create_secret(dir, &path),
        Err(e) => Err(io_err("reading", &path)(e)),
    }
}

/// The secret in `dir/name`, which must exist (tools that check, never create).
pub(crate) fn read_secret(dir: &Path, name: &str) -> Result<[u8; SECRET_LEN], IdentityError> {
    let path = dir.join(name);
    let text = fs::read_to_string(&path).map_err(io_err("reading", &path))?;
    check_secret(&path, &text)
}

fn check_secret(path: &Path, text: &str) -> Result<[u8; SECRET_LEN], IdentityError> {
    let mode = fs::metadata(path)
        .map_err(io_err("reading the mode of", path))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        return Err(IdentityError::Exposed {
            path: path.to_path_buf(),
            mode: mode & 0o7777,
        });
    }
    let bytes = hex::decode(text.trim()).ok();
    bytes
        .and_then(|b| <[u8; SECRET_LEN]>::try_from(b).ok())
        .ok_or_else(|| IdentityError::Malformed {
            path: path.to_path_buf(),
        })
}

fn create_secret(dir: &Path, path: &Path) -> Result<[u8; SECRET_LEN], IdentityError> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io_err("creating", dir))?;
    let mut secret = [0u8; SECRET_LEN];
    rand::fill(&mut secret);
    // O_EXCL: two daemons starting at once must not overwrite each other's secret.
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(io_err("creating", path))?;
    f.write_all(format!("{}\n", hex::encode(secret)).as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(io_err("writing", path))?;
    // The new entry itself must survive a crash, or the next start makes another secret.
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("syncing", dir))?;
    tracing::info!(path = %path.display(), "created a secret in the state directory");
    Ok(secret)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_and_bytes_make_the_identity() {
        let s = NodeSecret::from_bytes([7; SECRET_LEN]);
        let id = s.key_id(Credential::Bearer("sk-victim"));
        assert_eq!(s.key_id(Credential::Bearer("sk-victim")), id);
        assert_ne!(
            s.key_id(Credential::Bearer("sk-Victim")),
            id,
            "the token stays case-sensitive"
        );
        assert_ne!(s.key_id(Credential::Header("sk-victim")), id);
        assert_ne!(
            s.key_id(Credential::Header("TenantAb9")),
            s.key_id(Credential::Header("tenantab9"))
        );
        assert_ne!(s.key_id(Credential::None), s.key_id(Credential::Header("")));
        assert_ne!(s.key_id(Credential::None), s.key_id(Credential::Bearer("")));
    }

    #[test]
    fn the_secret_keys_the_id() {
        let a = NodeSecret::from_bytes([1; SECRET_LEN]);
        let b = NodeSecret::from_bytes([2; SECRET_LEN]);
        assert_ne!(
            a.key_id(Credential::Bearer("k")),
            b.key_id(Credential::Bearer("k"))
        );
    }

    #[test]
    fn the_secret_is_created_once_private_and_kept() {
        let dir = std::env::temp_dir().join(format!("haltd-identity-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let first = NodeSecret::load_or_create(&dir).expect("created");
        let mode = fs::metadata(dir.join("node.key"))
            .expect("file")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let again = NodeSecret::load_or_create(&dir).expect("read back");
        assert_eq!(
            first.key_id(Credential::Bearer("x")),
            again.key_id(Credential::Bearer("x"))
        );
        fs::set_permissions(dir.join("node.key"), fs::Permissions::from_mode(0o644))
            .expect("chmod");
        assert!(matches!(
            NodeSecret::load_or_create(&dir),
            Err(IdentityError::Exposed { .. })
        ));
        fs::write(dir.join("node.key"), "abcd\n").expect("write");
        fs::set_permissions(dir.join("node.key"), fs::Permissions::from_mode(0o600))
            .expect("chmod");
        assert!(matches!(
            NodeSecret::load_or_create(&dir),
            Err(IdentityError::Malformed { .. })
        ));
        let _ = fs::remove_dir_all(&dir);
    }
}
