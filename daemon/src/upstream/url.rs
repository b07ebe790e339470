//! The upstream's base URL, as an operator writes it in the config.
//!
//! `http://host[:port][/prefix]` and `https://host[:port][/prefix]` are accepted. An
//! `https://` upstream is spoken to in TLS only, verified (`tls.rs`): never downgraded to
//! plain HTTP.
//!
//! Operators paste OpenAI base URLs (`http://vllm:8000/v1`), so a trailing `/v1` is dropped:
//! the API paths haltd appends already start with `/v1/`. Anything that would be silently lost
//! or misread (credentials in userinfo, a query, a fragment, a full endpoint path) is an error.
//!
//! Parsing is by hand: the accepted grammar is this small, and checking every byte here is what
//! lets [`UpstreamUrl::host_header`] and [`UpstreamUrl::path_for`] go into a request head
//! unescaped.

use std::{
    fmt,
    net::{Ipv6Addr, SocketAddr, ToSocketAddrs as _},
};

use crate::wire::truncate_chars;

/// Port used when an `http://` URL names none.
pub const DEFAULT_PORT: u16 = 80;
/// Port used when an `https://` URL names none.
pub const DEFAULT_TLS_PORT: u16 = 443;

/// A URL haltd refuses as its upstream.
#[derive(Debug, thiserror::Error)]
pub enum UrlError {
    #[error("upstream URL is empty")]
    Empty,
    #[error("upstream URL must start with http:// or https:// (got {got:?})")]
    UnsupportedScheme { got: String },
    #[error(
        "upstream URL must not carry credentials (user:password@); configure the API key instead"
    )]
    Userinfo,
    #[error("upstream URL must not have a query (?...)")]
    Query,
    #[error("upstream URL must not have a fragment (#...)")]
    Fragment,
    #[error("upstream URL has no host")]
    MissingHost,
    #[error("upstream host {host:?} is not a valid host name or IP address")]
    InvalidHost { host: String },
    #[error("upstream port {port:?} is not a number from 1 to 65535")]
    InvalidPort { port: String },
    #[error("upstream URL path {path:?} has characters that must be percent-encoded")]
    InvalidPath { path: String },
    #[error(
        "upstream URL path {path:?} names an API endpoint; give the base URL (e.g. http://host:8000/v1)"
    )]
    EndpointPath { path: String },
    #[error("cannot resolve upstream host {host:?}: {source}")]
    Resolve {
        host: String,
        #[source]
        source: std::io::Error,
    },
    #[error("upstream host {host:?} resolved to no addresses")]
    NoAddresses { host: String },
}

/// A parsed upstream base URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamUrl {
    /// `https://`: the upstream is spoken to in TLS, verified (`tls.rs`).
    pub tls: bool,
    /// Host name (lowercased) or IP address; an IPv6 address without its brackets.
    pub host: String,
    pub port: u16,
    /// Path prefix without the trailing `/v1` and without a trailing slash: `""` or `/prefix`.
    pub base_path: String,
}

/// Short, printable excerpt of operator input for an error message.
fn excerpt(s: &str) -> String {
    truncate_chars(s, 64)
}

fn valid_reg_name(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 253
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
}

/// Path bytes allowed as they are in a request target: RFC 3986 `pchar` and `/`.
fn valid_path_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric()
        || matches!(
            b,
            b'/' | b'-'
                | b'.'
                | b'_'
                | b'~'
                | b'%'
                | b'!'
                | b'$'
                | b'&'
                | b'\''
                | b'('
                | b')'
                | b'*'
                | b'+'
                | b','
                | b';'
                | b'='
                | b':'
                | b'@'
        )
}

fn parse_port(s: &str) -> Result<u16, UrlError> {
    let bad = || UrlError::InvalidPort { port: excerpt(s) };
    if s.is_empty() || s.len() > 5 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    match s.parse::<u16>() {
        Ok(0) | Err(_) => Err(bad()),
        Ok(p) => Ok(p),
    }
}

/// The host (lower-cased, or an IPv6 address without brackets) and port of an authority
/// that has no userinfo and is not empty; `default_port` when it names none.
fn parse_authority(authority: &str, default_port: u16) -> Result<(String, u16), UrlError> {
    if let Some(v6) = authority.strip_prefix('[') {
        let Some((addr, after)) = v6.split_once(']') else {
            return Err(UrlError::InvalidHost {
                host: excerpt(authority),
            });
        };
        let ip: Ipv6Addr = addr.parse().map_err(|_| UrlError::InvalidHost {
            host: excerpt(authority),
        })?;
        let port = match after {
            "" => default_port,
            _ => match after.strip_prefix(':') {
                Some(p) => parse_port(p)?,
                None => {
                    return Err(UrlError::InvalidHost {
                        host: excerpt(authority),
                    })
                }
            },
        };
        Ok((ip.to_string(), port))
    } else {
        let (host, port) = match authority.split_once(':') {
            Some((h, p)) => (h, parse_port(p)?),
            None => (authority, default_port),
        };
        if host.is_empty() {
            return Err(UrlError::MissingHost);
        }
        if !valid_reg_name(host) {
            return Err(UrlError::InvalidHost {
                host: excerpt(host),
            });
        }
        Ok((host.to_ascii_lowercase(), port))
    }
}

/// The base path requests go under: `path` without trailing slashes and without a final
/// `/v1`; an endpoint path is refused.
fn base_path(path: &str) -> Result<String, UrlError> {
    if !path.bytes().all(valid_path_byte) {
        return Err(UrlError::InvalidPath {
            path: excerpt(path),
        });
    }
    let mut base = path.trim_end_matches('/');
    if let Some(b) = base.strip_suffix("/v1") {
        base = b.trim_end_matches('/');
    }
    if base.ends_with("/completions") || base.ends_with("/models") {
        return Err(UrlError::EndpointPath {
            path: excerpt(path),
        });
    }
    Ok(base.to_owned())
}

impl UpstreamUrl {
    /// Parses `http[s]://host[:port][/prefix]`; see the module doc for what is refused.
    pub fn parse(input: &str) -> Result<Self, UrlError> {
        let s = input.trim();
        if s.is_empty() {
            return Err(UrlError::Empty);
        }
        let (tls, rest) = match s.split_once("://") {
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("http") => (false, rest),
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("https") => (true, rest),
            Some((scheme, _)) => {
                return Err(UrlError::UnsupportedScheme {
                    got: excerpt(scheme),
                })
            }
            None => return Err(UrlError::UnsupportedScheme { got: excerpt(s) }),
        };
        if rest.contains('#') {
            return Err(UrlError::Fragment);
        }
        if rest.contains('?') {
            return Err(UrlError::Query);
        }
        let (authority, path) = match rest.find('/') {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        if authority.contains('@') {
            return Err(UrlError::Userinfo);
        }
        if authority.is_empty() {
            return Err(UrlError::MissingHost);
        }
        let default_port = if tls { DEFAULT_TLS_PORT } else { DEFAULT_PORT };
        let (host, port) = parse_authority(authority, default_port)?;
        let base_path = base_path(path)?;
        Ok(UpstreamUrl {
            tls,
            host,
            port,
            base_path,
        })
    }

    /// Resolves the host with the system resolver.
    ///
    /// Blocking (it may query DNS): the upstream's watch thread calls it (`watch.rs`), never
    /// the data plane.
    pub fn resolve(&self) -> Result<Vec<SocketAddr>, UrlError> {
        let addrs: Vec<SocketAddr> = (self.host.as_str(), self.port)
            .to_socket_addrs()
            .map_err(|source| UrlError::Resolve {
                host: self.host.clone(),
                source,
            })?
            .collect();
        if addrs.is_empty() {
            return Err(UrlError::NoAddresses {
                host: self.host.clone(),
            });
        }
        Ok(addrs)
    }

    /// `host:port`, as messages name the upstream (`[v6]:port` for an IPv6 address).
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The request target for an API path such as `/v1/chat/completions`.
    pub fn path_for(&self, api_path: &str) -> String {
        if api_path.starts_with('/') {
            format!("{}{api_path}", self.base_path)
        } else {
            format!("{}/{api_path}", self.base_path)
        }
    }

    /// The `Host` header value: `host`, `host:port`, `[v6]` or `[v6]:port` (port omitted
    /// when it is the scheme's default: 80, or 443 for `https://`).
    pub fn host_header(&self) -> String {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        let default_port = if self.tls {
            DEFAULT_TLS_PORT
        } else {
            DEFAULT_PORT
        };
        if self.port == default_port {
            host
        } else {
            format!("{host}:{}", self.port)
        }
    }
}

impl fmt::Display for UpstreamUrl {
    /// The normalised URL, for logs and records (carries no credentials by construction).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        let scheme = if self.tls { "https" } else { "http" };
        write!(f, "{scheme}://{host}:{}{}", self.port, self.base_path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str) -> UpstreamUrl {
        UpstreamUrl::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn plain_host_port() {
        let u = ok("http://127.0.0.1:8000");
        assert_eq!(u.host, "127.0.0.1");
        assert_eq!(u.port, 8000);
        assert_eq!(u.base_path, "");
        assert_eq!(u.path_for("/v1/chat/completions"), "/v1/chat/completions");
        assert_eq!(u.host_header(), "127.0.0.1:8000");
        assert_eq!(u.to_string(), "http://127.0.0.1:8000");
    }

    #[test]
    fn default_port_and_host_header() {
        let u = ok("http://Backend.Local");
        assert_eq!(u.host, "backend.local");
        assert_eq!(u.port, 80);
        assert_eq!(u.host_header(), "backend.local");
        let u = ok("HTTP://backend:80/");
        assert_eq!(u.port, 80);
        assert_eq!(u.base_path, "");
    }

    #[test]
    fn openai_base_urls_drop_v1() {
        for s in [
            "http://vllm:8000/v1",
            "http://vllm:8000/v1/",
            "http://vllm:8000/v1//",
            "http://vllm:8000/",
            "  http://vllm:8000/v1\n",
        ] {
            let u = ok(s);
            assert_eq!(u.base_path, "", "{s}");
            assert_eq!(u.path_for("/v1/completions"), "/v1/completions");
        }
        let u = ok("http://gw:8080/ollama/v1/");
        assert_eq!(u.base_path, "/ollama");
        assert_eq!(
            u.path_for("/v1/chat/completions"),
            "/ollama/v1/chat/completions"
        );
        assert_eq!(u.path_for("v1/models"), "/ollama/v1/models");
        // Only a trailing /v1 is dropped.
        assert_eq!(ok("http://gw/v1/x").base_path, "/v1/x");
        assert_eq!(ok("http://gw/api/v10").base_path, "/api/v10");
    }

    #[test]
    fn ipv6() {
        let u = ok("http://[::1]:8000/v1");
        assert_eq!(u.host, "::1");
        assert_eq!(u.port, 8000);
        assert_eq!(u.host_header(), "[::1]:8000");
        assert_eq!(u.to_string(), "http://[::1]:8000");
        let u = ok("http://[fe80::1]");
        assert_eq!(u.port, 80);
        assert_eq!(u.host_header(), "[fe80::1]");
        assert!(matches!(
            UpstreamUrl::parse("http://[::1"),
            Err(UrlError::InvalidHost { .. })
        ));
        assert!(matches!(
            UpstreamUrl::parse("http://[zz]:80"),
            Err(UrlError::InvalidHost { .. })
        ));
        assert!(matches!(
            UpstreamUrl::parse("http://[::1]8000"),
            Err(UrlError::InvalidHost { .. })
        ));
        // Unbracketed IPv6 splits at the first colon and fails on the port.
        assert!(matches!(
            UpstreamUrl::parse("http://::1:8000"),
            Err(UrlError::MissingHost | UrlError::InvalidPort { .. })
        ));
    }

    #[test]
    fn https_is_tls_with_its_own_default_port() {
        let u = ok("https://API.example.com/v1");
        assert!(u.tls);
        assert_eq!(u.host, "api.example.com");
        assert_eq!(u.port, 443);
        assert_eq!(u.host_header(), "api.example.com");
        assert_eq!(u.to_string(), "https://api.example.com:443");
        let u = ok("HTTPS://10.0.0.1:8443/gw/v1");
        assert!(u.tls);
        assert_eq!(u.host_header(), "10.0.0.1:8443");
        assert_eq!(u.base_path, "/gw");
        // Port 80 is not https's default: it is named.
        assert_eq!(ok("https://h:80").host_header(), "h:80");
        assert_eq!(ok("http://h:443").host_header(), "h:443");
        assert!(!ok("http://h").tls);
        assert_eq!(ok("https://[::1]").port, 443);
    }

    type Check = fn(&UrlError) -> bool;

    #[test]
    fn refusals() {
        let cases: &[(&str, Check)] = &[
            ("", |e| matches!(e, UrlError::Empty)),
            ("   ", |e| matches!(e, UrlError::Empty)),
            ("localhost:8000", |e| {
                matches!(e, UrlError::UnsupportedScheme { .. })
            }),
            ("ftp://x", |e| {
                matches!(e, UrlError::UnsupportedScheme { .. })
            }),
            ("http://user:pw@host:8000", |e| {
                matches!(e, UrlError::Userinfo)
            }),
            ("http://host:8000/v1?key=1", |e| {
                matches!(e, UrlError::Query)
            }),
            ("http://host:8000/v1#x", |e| matches!(e, UrlError::Fragment)),
            ("http://", |e| matches!(e, UrlError::MissingHost)),
            ("http:///v1", |e| matches!(e, UrlError::MissingHost)),
            ("http://:8000", |e| matches!(e, UrlError::MissingHost)),
            ("http://host:0", |e| {
                matches!(e, UrlError::InvalidPort { .. })
            }),
            ("http://host:65536", |e| {
                matches!(e, UrlError::InvalidPort { .. })
            }),
            ("http://host:", |e| {
                matches!(e, UrlError::InvalidPort { .. })
            }),
            ("http://host:+80", |e| {
                matches!(e, UrlError::InvalidPort { .. })
            }),
            ("http://host:80:81", |e| {
                matches!(e, UrlError::InvalidPort { .. })
            }),
            ("http://ho st", |e| {
                matches!(e, UrlError::InvalidHost { .. })
            }),
            ("http://host\r\nx:1", |e| {
                matches!(e, UrlError::InvalidHost { .. })
            }),
            ("http://hóst", |e| {
                matches!(e, UrlError::InvalidHost { .. })
            }),
            ("http://host/a b", |e| {
                matches!(e, UrlError::InvalidPath { .. })
            }),
            ("http://host/a\r\nx", |e| {
                matches!(e, UrlError::InvalidPath { .. })
            }),
            ("http://host/v1/chat/completions", |e| {
                matches!(e, UrlError::EndpointPath { .. })
            }),
            ("http://host/v1/completions/", |e| {
                matches!(e, UrlError::EndpointPath { .. })
            }),
        ];
        for (s, check) in cases {
            match UpstreamUrl::parse(s) {
                Ok(u) => panic!("{s:?} parsed as {u:?}"),
                Err(e) => assert!(check(&e), "{s:?}: {e:?}"),
            }
        }
    }

    #[test]
    fn error_messages_name_the_input() {
        let e = UpstreamUrl::parse("http://host:99999").expect_err("port");
        assert_eq!(
            e.to_string(),
            "upstream port \"99999\" is not a number from 1 to 65535"
        );
        let e = UpstreamUrl::parse("gopher://x").expect_err("scheme");
        assert_eq!(
            e.to_string(),
            "upstream URL must start with http:// or https:// (got \"gopher\")"
        );
    }

    #[test]
    fn resolve_literal_addresses() {
        let u = ok("http://127.0.0.1:8000/v1");
        assert_eq!(
            u.resolve().expect("literal v4"),
            vec!["127.0.0.1:8000".parse().expect("addr")]
        );
        assert_eq!(u.authority(), "127.0.0.1:8000");
        let u = ok("http://[::1]:9000");
        assert_eq!(
            u.resolve().expect("literal v6"),
            vec!["[::1]:9000".parse().expect("addr")]
        );
        assert_eq!(u.authority(), "[::1]:9000");
    }

    #[test]
    fn resolve_failure_names_the_host() {
        let u = ok("http://no-such-host.invalid:8000");
        let e = u.resolve().expect_err(".invalid never resolves");
        assert!(e.to_string().contains("no-such-host.invalid"), "{e}");
    }

    proptest::proptest! {
        #[test]
        fn parse_never_panics(s in "\\PC{0,64}") {
            let _ = UpstreamUrl::parse(&s);
            let _ = UpstreamUrl::parse(&format!("http://{s}"));
        }

        #[test]
        fn accepted_urls_are_safe_in_a_request_head(s in "[a-z0-9:/\\[\\]%.@?#\\-]{0,40}") {
            if let Ok(u) = UpstreamUrl::parse(&format!("http://{s}")) {
                let target = u.path_for("/v1/chat/completions");
                let host = u.host_header();
                proptest::prop_assert!(target.bytes().all(|b| b.is_ascii_graphic()));
                proptest::prop_assert!(host.bytes().all(|b| b.is_ascii_graphic()));
                proptest::prop_assert!(target.starts_with('/'));
            }
        }
    }
}
