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
mod tests;
