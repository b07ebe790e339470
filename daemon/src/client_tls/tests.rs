//! [`ClientTls`] against a rustls client in memory: the handshake, frames sealed at the length
//! counted for them, the terminal record and its ciphertext prefix, and reloads.

use std::{io::Read as _, path::PathBuf, sync::Arc};

use rustls::{pki_types::CertificateDer, ClientConfig, ClientConnection, RootCertStore};

use super::*;

/// A self-signed certificate for `localhost` written as PEM files in a fresh folder.
struct Files {
    dir: PathBuf,
    cert: PathBuf,
    key: PathBuf,
    der: CertificateDer<'static>,
}

impl Drop for Files {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn files() -> Files {
    let dir = std::env::temp_dir().join(format!("haltd-client-tls-{}", rand::random::<u64>()));
    std::fs::create_dir_all(&dir).expect("dir");
    let c = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).expect("cert");
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, c.cert.pem()).expect("write cert");
    std::fs::write(&key, c.signing_key.serialize_pem()).expect("write key");
    Files {
        dir,
        cert,
        key,
        der: c.cert.der().clone(),
    }
}

fn client(f: &Files, suites: Option<&[rustls::SupportedCipherSuite]>) -> ClientConnection {
    let mut provider = rustls::crypto::ring::default_provider();
    if let Some(s) = suites {
        provider.cipher_suites = s.to_vec();
    }
    let mut roots = RootCertStore::empty();
    roots.add(f.der.clone()).expect("root");
    let mut cfg = ClientConfig::builder_with_provider(Arc::new(provider))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    ClientConnection::new(Arc::new(cfg), "localhost".try_into().expect("name")).expect("client")
}

/// Runs the handshake to its end.
fn handshake(c: &mut ClientConnection, s: &mut ClientTls) {
    for _ in 0..6 {
        let mut wire = Vec::new();
        while c.wants_write() {
            c.write_tls(&mut wire).expect("client write");
        }
        s.open(&wire, false).expect("server open");
        let mut back = Vec::new();
        s.pending(&mut back);
        let mut rd = &back[..];
        while !rd.is_empty() {
            c.read_tls(&mut rd).expect("client read");
            c.process_new_packets().expect("client process");
        }
    }
    assert!(!s.is_handshaking() && !c.is_handshaking());
}

/// The client's plaintext of `wire`, or its error.
fn open_at_client(c: &mut ClientConnection, wire: &[u8]) -> Result<Vec<u8>, rustls::Error> {
    let mut rd = wire;
    let mut got = Vec::new();
    while !rd.is_empty() {
        c.read_tls(&mut rd).expect("client read");
        c.process_new_packets()?;
        // Drained as it comes: the client buffers at most a record or so of plaintext.
        let _ = c.reader().read_to_end(&mut got);
    }
    Ok(got)
}

#[test]
fn frames_are_sealed_at_the_length_counted_for_them_under_every_suite() {
    let f = files();
    let cfg = ClientTlsConfig::load(&f.cert, &f.key).expect("load");
    // Every suite an ECDSA certificate (rcgen's) can serve: TLS 1.3's, TLS 1.2's ECDSA ones.
    let all = rustls::crypto::ring::default_provider().cipher_suites;
    let usable = all
        .into_iter()
        .filter(|s| !format!("{:?}", s.suite()).contains("_RSA_"));
    for suite in usable {
        let mut c = client(&f, Some(&[suite]));
        let mut s = cfg.session().expect("session");
        handshake(&mut c, &mut s);
        assert_eq!(c.alpn_protocol(), Some(ALPN_HTTP11));
        for len in [1, 200, 16_384, 16_385, 40_000] {
            let frame: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let mut out = Vec::new();
            s.seal(&frame, &mut out);
            assert_eq!(out.len(), s.sealed_len(len), "{suite:?} {len}");
            assert_eq!(open_at_client(&mut c, &out).expect("open"), frame);
        }
    }
}

#[test]
fn the_terminal_is_one_record_its_prefix_is_its_ciphertext_and_close_notify_follows() {
    let f = files();
    let cfg = ClientTlsConfig::load(&f.cert, &f.key).expect("load");
    let mut c = client(&f, None);
    let mut s = cfg.session().expect("session");
    handshake(&mut c, &mut s);
    let plain = b": haltd-halt 0123456789abcdef\n data: [DONE]\n\n";
    // A token record of the very same bytes first: it never carries the terminal's prefix.
    let mut token = Vec::new();
    s.seal(plain, &mut token);
    assert_eq!(open_at_client(&mut c, &token).expect("open"), plain);
    let mut out = Vec::new();
    let nonce = s.seal_terminal(plain, &mut out).expect("sealed");
    let record = s.sealed_len(plain.len());
    assert_eq!(token.len(), record, "same length as the token record");
    assert_ne!(token[RECORD_HEADER_LEN..RECORD_HEADER_LEN + 16], nonce);
    assert_eq!(&out[..1], &[0x17], "application data record");
    assert_eq!(out[RECORD_HEADER_LEN..RECORD_HEADER_LEN + 16], nonce);
    assert!(out.len() > record, "close_notify follows the record");
    assert_eq!(open_at_client(&mut c, &out).expect("open"), plain);
    let mut rest = Vec::new();
    assert_eq!(
        c.reader().read_to_end(&mut rest).map_err(|e| e.kind()).ok(),
        Some(0),
        "close_notify received"
    );
}

#[test]
fn nothing_is_sealed_for_a_terminal_while_the_handshake_is_under_way() {
    let f = files();
    let cfg = ClientTlsConfig::load(&f.cert, &f.key).expect("load");
    let mut s = cfg.session().expect("session");
    let mut out = Vec::new();
    assert!(s.seal_terminal(b"HTTP/1.1 200 OK\r\n", &mut out).is_none());
    assert!(out.is_empty());
}

#[test]
fn a_broken_pair_is_refused_and_a_reload_of_one_keeps_the_running_configuration() {
    let f = files();
    let other = files();
    // A key that is not the certificate's.
    assert!(matches!(
        ClientTlsConfig::load(&f.cert, &other.key),
        Err(ClientTlsError::Rustls { .. })
    ));
    assert!(matches!(
        ClientTlsConfig::load(&f.key, &f.key),
        Err(ClientTlsError::Pem(crate::pem::PemError::NoCert { .. }))
    ));
    let cfg = ClientTlsConfig::load(&f.cert, &f.key).expect("load");
    std::fs::write(&f.key, "not a key").expect("break");
    assert!(cfg.reload().is_err());
    // The running configuration still serves.
    let mut c = client(&f, None);
    let mut s = cfg.session().expect("session");
    handshake(&mut c, &mut s);
    // A new pair is taken by the next connection.
    std::fs::copy(&other.cert, &f.cert).expect("copy cert");
    std::fs::copy(&other.key, &f.key).expect("copy key");
    cfg.reload().expect("reload");
    let mut c = client(&other, None);
    let mut s = cfg.session().expect("session");
    handshake(&mut c, &mut s);
}
