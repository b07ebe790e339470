//! What degraded mode and the per-key limits are kept per (issue 36): a **scope** that a
//! client cannot respell.
//!
//! - With the key store on (`--client-keys store`): the haltd key the request authenticated
//!   with, by its id (`apikey:<id>`). The same id names the TokenCircuit conversation.
//! - Without it: the value of `--identity-header` when one is configured and the request
//!   carries it (the deployment behind a trusted gateway that sets it, `header:<fp>`), else the
//!   client's address group (`--addr-prefix-v4`/`-v6`, as the per-address connection cap
//!   groups them, `addr:<fp>`). A client that sends a new bearer token is the same scope.
//!
//! Never the raw credential: before issue 36 a scope was the bearer token's fingerprint
//! (`key:<fp>`), so any new string escaped degraded mode. Such scopes, restored from the state
//! store or the ledger, are kept as **legacy** scopes: a request whose credential has that
//! fingerprint still runs degraded, and its new scope is degraded with it (recorded, `by:
//! migration`): an upgrade never loosens governance.
//!
//! The fingerprints are HMAC-SHA-256 under the node secret (`identity.rs`), domain-separated
//! from the credential fingerprints and by kind, so that no two kinds share an id.

use std::net::IpAddr;

use crate::{
    credential::Credential,
    identity::{KeyId, NodeSecret},
};

/// What every scope fingerprint's HMAC starts with.
pub const SCOPE_DOMAIN: &[u8] = b"haltd scope v3\0";

/// Which rule named a scope: the prefix of its name in records, the store and `haltctl`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ScopeKind {
    /// A bearer token's fingerprint: the rule before issue 36, kept for restored scopes only.
    Key,
    /// A client address group.
    Addr,
    /// The `--identity-header` value.
    Header,
    /// A key of the key store, by its id.
    Apikey,
}

impl ScopeKind {
    pub const fn prefix(self) -> &'static str {
        match self {
            ScopeKind::Key => "key",
            ScopeKind::Addr => "addr",
            ScopeKind::Header => "header",
            ScopeKind::Apikey => "apikey",
        }
    }

    /// The kind a stream slot keeps (`stream.rs`).
    pub const fn as_u8(self) -> u8 {
        match self {
            ScopeKind::Key => 0,
            ScopeKind::Addr => 1,
            ScopeKind::Header => 2,
            ScopeKind::Apikey => 3,
        }
    }

    pub const fn from_u8(v: u8) -> ScopeKind {
        match v {
            1 => ScopeKind::Addr,
            2 => ScopeKind::Header,
            3 => ScopeKind::Apikey,
            _ => ScopeKind::Key,
        }
    }

    const ALL: [ScopeKind; 4] = [
        ScopeKind::Key,
        ScopeKind::Addr,
        ScopeKind::Header,
        ScopeKind::Apikey,
    ];
}

/// A degraded scope (and a limits scope): its kind and fingerprint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scope {
    pub kind: ScopeKind,
    pub id: KeyId,
}

impl Scope {
    /// `addr:<fp>`, `header:<fp>`, `apikey:<id>` or (legacy) `key:<fp>`.
    pub fn name(self) -> String {
        format!("{}:{}", self.kind.prefix(), self.id)
    }

    /// The scope a name gives (`None`: not `<kind>:<16 hex digits>`).
    pub fn parse(s: &str) -> Option<Scope> {
        let (prefix, fp) = s.split_once(':')?;
        let kind = ScopeKind::ALL.into_iter().find(|k| k.prefix() == prefix)?;
        KeyId::parse_fingerprint(fp).map(|id| Scope { kind, id })
    }

    /// The scope of a client address group (already grouped: `AddrGroups::group`).
    pub fn of_addr(secret: &NodeSecret, group: IpAddr) -> Scope {
        let bytes = match group {
            IpAddr::V4(a) => a.octets().to_vec(),
            IpAddr::V6(a) => a.octets().to_vec(),
        };
        Scope {
            kind: ScopeKind::Addr,
            id: KeyId(secret.mac64(&[SCOPE_DOMAIN, b"addr\0", &bytes])),
        }
    }

    /// The scope of an `--identity-header` value, compared exactly.
    pub fn of_header(secret: &NodeSecret, value: &str) -> Scope {
        Scope {
            kind: ScopeKind::Header,
            id: KeyId(secret.mac64(&[SCOPE_DOMAIN, b"header\0", value.as_bytes()])),
        }
    }

    /// The scope of a key of the key store.
    pub const fn of_api_key(id: KeyId) -> Scope {
        Scope {
            kind: ScopeKind::Apikey,
            id,
        }
    }

    /// The legacy scope of a credential (its fingerprint before issue 36).
    pub const fn legacy(credential: KeyId) -> Scope {
        Scope {
            kind: ScopeKind::Key,
            id: credential,
        }
    }
}

/// Which rule names the scopes of this haltd (said at start).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScopeRule {
    /// The key store's key ids.
    Store,
    /// The `--identity-header` value, else the address group.
    HeaderThenAddr,
    /// The address group.
    Addr,
}

impl ScopeRule {
    /// What haltd says at start.
    pub const fn describe(self) -> &'static str {
        match self {
            ScopeRule::Store => "the key store's key id (--client-keys store)",
            ScopeRule::HeaderThenAddr => {
                "the --identity-header value, else the client address group"
            }
            ScopeRule::Addr => "the client address group (--addr-prefix-v4/-v6)",
        }
    }
}

/// Who a request is: the scope degraded mode and the limits key on, TokenCircuit's
/// conversation key, and the legacy scope its credential had.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    pub scope: Scope,
    /// TokenCircuit's and the conversation state's key: the credential's fingerprint
    /// (`credential.rs`) without a store, the key id with one.
    pub conversation: KeyId,
    /// The credential's fingerprint, which named the scope before issue 36.
    pub legacy: Scope,
}

impl Identity {
    /// A request's identity without a key store: its `--identity-header` value when it
    /// carried one, else its address `group` (`None`: no address, a Unix socket: one group).
    pub fn without_store(
        secret: &NodeSecret,
        credential: Credential<'_>,
        group: Option<IpAddr>,
    ) -> Identity {
        let fp = KeyId::of(secret, credential);
        let scope = match credential {
            Credential::Header(v) => Scope::of_header(secret, v),
            Credential::Bearer(_) | Credential::None => Scope::of_addr(
                secret,
                group.unwrap_or(IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED)),
            ),
        };
        Identity {
            scope,
            conversation: fp,
            legacy: Scope::legacy(fp),
        }
    }

    /// A request authenticated with the key store's key `id`.
    pub fn of_key(secret: &NodeSecret, credential: Credential<'_>, id: KeyId) -> Identity {
        Identity {
            scope: Scope::of_api_key(id),
            conversation: id,
            legacy: Scope::legacy(KeyId::of(secret, credential)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> NodeSecret {
        NodeSecret::from_bytes([5; 32])
    }

    #[test]
    fn a_new_token_from_one_address_is_the_same_scope_and_a_header_its_own() {
        let s = secret();
        let addr = Some("192.0.2.0".parse().expect("addr"));
        let a = Identity::without_store(&s, Credential::Bearer("sk-a"), addr);
        let b = Identity::without_store(&s, Credential::Bearer("sk-b"), addr);
        let none = Identity::without_store(&s, Credential::None, addr);
        assert_eq!(a.scope, b.scope);
        assert_eq!(a.scope, none.scope);
        assert_eq!(a.scope.kind, ScopeKind::Addr);
        assert_ne!(
            a.conversation, b.conversation,
            "the circuit keeps the credential rule"
        );
        let h = Identity::without_store(&s, Credential::Header("tenant-1"), addr);
        assert_eq!(h.scope.kind, ScopeKind::Header);
        assert_ne!(h.scope.id, a.scope.id);
        let other = Identity::without_store(
            &s,
            Credential::Bearer("sk-a"),
            Some("192.0.2.1".parse().expect("addr")),
        );
        assert_ne!(other.scope, a.scope);
    }

    #[test]
    fn names_round_trip_and_kinds_do_not_collide() {
        let s = secret();
        for scope in [
            Scope::of_addr(&s, "::".parse().expect("addr")),
            Scope::of_header(&s, "x"),
            Scope::of_api_key(KeyId(0x0123_4567_89ab_cdef)),
            Scope::legacy(KeyId(7)),
        ] {
            assert_eq!(Scope::parse(&scope.name()), Some(scope), "{}", scope.name());
            assert_eq!(ScopeKind::from_u8(scope.kind.as_u8()), scope.kind);
        }
        assert_eq!(
            Scope::of_api_key(KeyId(0x0123_4567_89ab_cdef)).name(),
            "apikey:0123456789abcdef"
        );
        assert_ne!(
            Scope::of_header(&s, "x").id,
            KeyId::of(&s, Credential::Header("x"))
        );
        assert_eq!(Scope::parse("node"), None);
        assert_eq!(Scope::parse("addr:xyz"), None);
        assert_eq!(Scope::parse("user:0123456789abcdef"), None);
    }
}
