//! The admin API's settings that the configuration validates: where it listens (`--admin`)
//! and the TCP bearer token (`--admin-token-file`). The listener and the request guard that
//! use them are in `admin/`.

use std::{fmt, net::SocketAddr, path::PathBuf, str::FromStr};

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The default admin socket.
pub const DEFAULT_ADMIN_SOCKET: &str = "/run/haltd/admin.sock";

/// `--admin`: `unix:PATH` or `HOST:PORT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AdminAddr {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl FromStr for AdminAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("unix:") {
            if !path.starts_with('/') {
                return Err(format!("{s:?}: a unix socket path must be absolute"));
            }
            return Ok(AdminAddr::Unix(PathBuf::from(path)));
        }
        s.parse().map(AdminAddr::Tcp).map_err(|_| {
            format!("{s:?}: expected unix:/ABSOLUTE/PATH or an IP address with a port")
        })
    }
}

impl fmt::Display for AdminAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AdminAddr::Unix(p) => write!(f, "unix:{}", p.display()),
            AdminAddr::Tcp(a) => write!(f, "{a}"),
        }
    }
}

/// The TCP admin token, kept as its SHA-256 so the comparison takes the same time whatever the
/// presented token's length.
#[derive(Clone)]
pub struct AdminToken {
    digest: [u8; 32],
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(..)")
    }
}

/// Shortest token accepted: a guessable token is no authentication.
pub const MIN_TOKEN_LEN: usize = 16;

impl AdminToken {
    /// The token from the file's first line (surrounding whitespace ignored).
    pub fn from_file_contents(text: &str) -> Result<Self, String> {
        let token = text.trim();
        if token.len() < MIN_TOKEN_LEN {
            return Err(format!(
                "the token is {} bytes; at least {MIN_TOKEN_LEN} are required",
                token.len()
            ));
        }
        if token.bytes().any(|b| !b.is_ascii_graphic()) {
            return Err("the token must be one line of printable ASCII without spaces".into());
        }
        Ok(Self::new(token.as_bytes()))
    }

    fn new(token: &[u8]) -> Self {
        AdminToken {
            digest: Sha256::digest(token).into(),
        }
    }

    pub(crate) fn matches(&self, presented: &[u8]) -> bool {
        let digest: [u8; 32] = Sha256::digest(presented).into();
        digest.ct_eq(&self.digest).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_addresses_parse() {
        assert_eq!(
            "unix:/run/haltd/admin.sock".parse::<AdminAddr>(),
            Ok(AdminAddr::Unix(PathBuf::from("/run/haltd/admin.sock")))
        );
        assert_eq!(
            "127.0.0.1:8081".parse::<AdminAddr>(),
            Ok(AdminAddr::Tcp(
                "127.0.0.1:8081".parse().expect("test setup")
            ))
        );
        assert!("unix:relative.sock".parse::<AdminAddr>().is_err());
        assert!("localhost:8081".parse::<AdminAddr>().is_err());
        assert_eq!(
            AdminAddr::Unix(PathBuf::from("/x/a.sock")).to_string(),
            "unix:/x/a.sock"
        );
    }

    #[test]
    fn tokens_compare_whole() {
        let t = AdminToken::from_file_contents("  0123456789abcdef-secret\n").expect("test setup");
        assert!(t.matches(b"0123456789abcdef-secret"));
        assert!(!t.matches(b"0123456789abcdef-secre"));
        assert!(!t.matches(b"0123456789abcdef-secret "));
        assert!(!t.matches(b""));
        assert!(AdminToken::from_file_contents("short").is_err());
        assert!(AdminToken::from_file_contents("0123456789abcdef 0123").is_err());
    }
}
