//! [`TlsLink`] against a rustls server in memory: the handshake and records cut at every
//! size, verification failures, `close_notify`, and the configuration's refusals.

use std::{io::Write as _, sync::Arc};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::{
    pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer},
    ServerConfig, ServerConnection,
};

use super::*;

/// A CA and a server certificate it signed for `names` (valid from `from` to `until`).
struct Pki {
    ca: CertificateDer<'static>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    ca_pem: String,
}

fn pki_with(names: &[&str], from: i32, until: i32) -> Pki {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    // Each CA its own name: a client trusting another CA of the same name would find it and
    // fail on the signature instead of on the issuer.
    let cn = format!("test CA {}", rand::random::<u64>());
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, cn);
    let ca =
        CertifiedIssuer::self_signed(ca_params, KeyPair::generate().expect("ca key")).expect("ca");
    let key = KeyPair::generate().expect("leaf key");
    let names: Vec<String> = names.iter().map(|s| (*s).to_owned()).collect();
    let mut params = CertificateParams::new(names).expect("leaf params");
    params.not_before = rcgen::date_time_ymd(from, 1, 1);
    params.not_after = rcgen::date_time_ymd(until, 1, 1);
    let leaf = params.signed_by(&key, &ca).expect("leaf");
    Pki {
        ca: ca.der().clone(),
        chain: vec![leaf.der().clone()],
        key: PrivatePkcs8KeyDer::from(key.serialize_der()).into(),
        ca_pem: ca.pem(),
    }
}

fn pki(names: &[&str]) -> Pki {
    pki_with(names, 2020, 4000)
}

fn server(p: &Pki) -> ServerConnection {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(p.chain.clone(), p.key.clone_key())
        .expect("server config");
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let mut s = ServerConnection::new(Arc::new(cfg)).expect("server");
    s.set_buffer_limit(None);
    s
}

fn client(url: &str, trusted: &Pki) -> TlsLink {
    let url = UpstreamUrl::parse(url).expect("url");
    let mut roots = RootCertStore::empty();
    roots.add(trusted.ca.clone()).expect("root");
    UpstreamTls::with_roots(&url, roots, "test".into())
        .expect("config")
        .link()
        .expect("link")
}

/// Moves everything the server has to send to the client in pieces of `piece` bytes; returns
/// the plaintext the client got, or its first error.
fn to_client(
    s: &mut ServerConnection,
    c: &mut TlsLink,
    piece: usize,
) -> Result<Vec<u8>, rustls::Error> {
    let mut wire = Vec::new();
    while s.wants_write() {
        s.write_tls(&mut wire).expect("server write_tls");
    }
    let mut got = Vec::new();
    for part in wire.chunks(piece) {
        if let Opened::Data(n) = c.open(part, false)? {
            got.extend_from_slice(&c.plain_mut()[..n]);
        }
    }
    Ok(got)
}

/// Moves the client's pending ciphertext to the server; returns the server's plaintext.
fn to_server(c: &mut TlsLink, s: &mut ServerConnection) -> Vec<u8> {
    let mut got = Vec::new();
    while let Some(buf) = c.pending() {
        let mut rd = &buf[..];
        while !rd.is_empty() {
            s.read_tls(&mut rd).expect("server read_tls");
            s.process_new_packets().expect("server process");
        }
        let _ = std::io::Read::read_to_end(&mut s.reader(), &mut got);
        c.recycle(buf);
    }
    got
}

/// Runs the handshake with the request queued before it, as the data plane does.
fn exchange(c: &mut TlsLink, s: &mut ServerConnection, piece: usize) -> Vec<u8> {
    c.seal(b"POST /v1/chat/completions HTTP/1.1\r\n\r\n");
    let mut at_server = Vec::new();
    for _ in 0..4 {
        at_server.extend(to_server(c, s));
        to_client(s, c, piece).expect("client open");
    }
    at_server
}

#[test]
fn handshake_and_records_cut_anywhere() {
    let p = pki(&["upstream.test"]);
    for piece in [1, 7, 100, 1 << 20] {
        let mut c = client("https://upstream.test:8443/v1", &p);
        let mut s = server(&p);
        assert!(c.is_handshaking());
        let req = exchange(&mut c, &mut s, piece);
        assert!(!c.is_handshaking(), "piece {piece}");
        assert_eq!(req, b"POST /v1/chat/completions HTTP/1.1\r\n\r\n");
        assert_eq!(s.server_name(), Some("upstream.test"), "SNI");
        assert_eq!(c.alpn(), Some(ALPN_HTTP11));
        // A response larger than a record and a receive buffer.
        let body: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        s.writer().write_all(&body).expect("server write");
        assert_eq!(to_client(&mut s, &mut c, piece).expect("open"), body);
    }
}

#[test]
fn an_ip_host_is_verified_against_an_ip_san_and_sends_no_sni() {
    let p = pki(&["127.0.0.1"]);
    let mut c = client("https://127.0.0.1:9000", &p);
    let mut s = server(&p);
    exchange(&mut c, &mut s, 512);
    assert!(!c.is_handshaking());
    assert_eq!(s.server_name(), None);
}

/// The client's error after the server's first flight.
fn handshake_error(c: &mut TlsLink, s: &mut ServerConnection) -> rustls::Error {
    to_server(c, s);
    to_client(s, c, 4096).expect_err("verification must fail")
}

#[test]
fn verification_failures_are_errors() {
    let good = pki(&["upstream.test"]);
    let other_ca = pki(&["upstream.test"]);
    // Signed by a CA the client does not trust.
    let mut c = client("https://upstream.test", &good);
    let e = handshake_error(&mut c, &mut server(&other_ca));
    assert!(format!("{e:?}").contains("UnknownIssuer"), "{e:?}");
    // Trusted CA, another name.
    let mut c = client("https://other.test", &good);
    let e = handshake_error(&mut c, &mut server(&good));
    assert!(format!("{e:?}").contains("NotValidForName"), "{e:?}");
    // Expired.
    let old = pki_with(&["upstream.test"], 2000, 2001);
    let mut c = client("https://upstream.test", &old);
    let e = handshake_error(&mut c, &mut server(&old));
    assert!(format!("{e:?}").contains("Expired"), "{e:?}");
}

#[test]
fn an_alert_from_the_upstream_is_an_error() {
    let p = pki(&["upstream.test"]);
    let mut c = client("https://upstream.test", &p);
    let mut s = server(&p);
    // Garbage where the ServerHello belongs: rustls rejects it.
    to_server(&mut c, &mut s);
    let e = c
        .open(b"\x15\x03\x03\x00\x02\x02\x28", false)
        .expect_err("alert");
    assert!(format!("{e:?}").contains("HandshakeFailure"), "{e:?}");
}

#[test]
fn close_notify_and_a_bare_close_end_the_stream() {
    let p = pki(&["upstream.test"]);
    let mut c = client("https://upstream.test", &p);
    let mut s = server(&p);
    exchange(&mut c, &mut s, 4096);
    // Data and close_notify in one receive: the data first, then the end.
    s.writer().write_all(b"last").expect("write");
    s.send_close_notify();
    let mut wire = Vec::new();
    while s.wants_write() {
        s.write_tls(&mut wire).expect("write_tls");
    }
    assert_eq!(c.open(&wire, false).expect("open"), Opened::Data(4));
    assert!(c.peer_closed());
    assert_eq!(c.open(&[], true).expect("eof"), Opened::Eof { clean: true });
    // A TCP close with no close_notify.
    let mut c = client("https://upstream.test", &p);
    let mut s = server(&p);
    exchange(&mut c, &mut s, 4096);
    assert_eq!(
        c.open(&[], true).expect("eof"),
        Opened::Eof { clean: false }
    );
    assert!(c.peer_closed());
    // Our own close_notify for a clean close.
    let mut c = client("https://upstream.test", &p);
    let mut s = server(&p);
    exchange(&mut c, &mut s, 4096);
    let alert = c.close_notify().expect("close_notify bytes");
    let mut rd = &alert[..];
    s.read_tls(&mut rd).expect("read");
    let st = s.process_new_packets().expect("process");
    assert!(st.peer_has_closed());
}

#[test]
fn configuration_refusals() {
    let url = UpstreamUrl::parse("https://upstream.test").expect("url");
    let dir = std::env::temp_dir().join(format!("haltd-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let missing = dir.join("missing.pem");
    let e = UpstreamTls::load(&url, Some(&missing)).expect_err("missing");
    assert!(
        matches!(e, TlsConfigError::Pem(crate::pem::PemError::Read { .. })),
        "{e}"
    );
    let empty = dir.join("empty.pem");
    std::fs::write(&empty, "not a certificate\n").expect("write");
    let e = UpstreamTls::load(&url, Some(&empty)).expect_err("empty");
    assert!(
        matches!(e, TlsConfigError::Pem(crate::pem::PemError::NoCert { .. })),
        "{e}"
    );
    let good = dir.join("ca.pem");
    std::fs::write(&good, pki(&["upstream.test"]).ca_pem).expect("write");
    let tls = UpstreamTls::load(&url, Some(&good)).expect("ca file");
    assert!(
        tls.roots().starts_with("1 certificates from"),
        "{}",
        tls.roots()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
