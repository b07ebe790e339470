//! `--listen` and `--metrics`: an `IP:PORT`, or a `HOST:PORT` whose name is resolved once,
//! when the flags are parsed at start (so `localhost:8080` works, as operators expect).
//! haltd binds one socket per listener: of the addresses a name resolves to, the first IPv4
//! one, else the first IPv6 one (`localhost` is `127.0.0.1` whatever order the resolver
//! prefers, so loopback-only listeners stay loopback and the `127.0.0.1` of the docs).

use std::net::{SocketAddr, ToSocketAddrs};

/// Parses `IP:PORT`, `[IPv6]:PORT` or `HOST:PORT` (resolved now) into the address to bind.
/// A clap value parser: the error is the text clap shows after the flag.
pub fn socket_addr(s: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    let (host, port) = s
        .rsplit_once(':')
        .filter(|(h, _)| !h.is_empty() && !h.contains(':'))
        .ok_or_else(|| "not HOST:PORT (e.g. 127.0.0.1:8080, localhost:8080)".to_owned())?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("port {port:?} is not a number in 0..=65535"))?;
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("host {host:?} does not resolve: {e}"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| addrs.first())
        .copied()
        .ok_or_else(|| format!("host {host:?} resolves to no address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_names() {
        assert_eq!(
            socket_addr("127.0.0.1:8080"),
            Ok("127.0.0.1:8080".parse().expect("addr"))
        );
        assert_eq!(socket_addr("[::1]:9"), Ok("[::1]:9".parse().expect("addr")));
        // `localhost` is in /etc/hosts on every machine the tests run on.
        assert_eq!(
            socket_addr("localhost:8080"),
            Ok("127.0.0.1:8080".parse().expect("addr"))
        );
        for (bad, want) in [
            ("8080", "not HOST:PORT"),
            (":8080", "not HOST:PORT"),
            ("localhost", "not HOST:PORT"),
            ("localhost:http", "is not a number"),
            ("localhost:70000", "is not a number"),
            ("no-such-host.invalid:80", "does not resolve"),
        ] {
            let e = socket_addr(bad).expect_err(bad);
            assert!(e.contains(want), "{bad}: {e}");
        }
    }
}
