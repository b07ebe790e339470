//! TLS to an `https://` upstream, with no I/O: the rustls client configuration haltd builds
//! once at start ([`UpstreamTls`]), and one connection's TLS session as bytes in and bytes out
//! ([`TlsLink`]), which the data plane drives over its io_uring receive and send buffers
//! (`dataplane/upstream_io/tls.rs`). Nothing here blocks or touches a socket.
//!
//! What is verified, always (there is no switch to turn it off, and an `https://` URL is never
//! spoken to in plain HTTP): the upstream's certificate chain against the trust roots, its
//! validity period, and that it names the URL's host (a DNS name, or an IP address in an IP
//! SAN). The roots are the system's (the certificates of the platform store, read with
//! `rustls-native-certs`: on Linux `SSL_CERT_FILE`/`SSL_CERT_DIR`, else the distribution's
//! bundle, e.g. `/etc/ssl/certs`), or, with `--upstream-ca-file`, only the certificates of that
//! PEM file, which replace the system's (a private CA then vouches for this one upstream, and
//! nothing else does). SNI carries the URL's host name (not an IP address, as RFC 6066 says);
//! ALPN offers `http/1.1` only. Protocol versions and cipher suites are rustls's safe
//! defaults (TLS 1.3 and 1.2, AEAD suites only) with the `ring` provider.
//!
//! A TLS failure (an unknown CA, a name mismatch, an expired certificate, an alert from the
//! upstream) ends the exchange as `UPSTREAM_FAILURE` kind `tls` with rustls's error in the
//! message.

use std::{
    fmt,
    io::{self, Read as _, Write as _},
    path::{Path, PathBuf},
    sync::Arc,
};

use rustls::{pki_types::ServerName, ClientConfig, ClientConnection, RootCertStore};

use super::url::UpstreamUrl;

/// The one protocol haltd speaks to an upstream, offered by ALPN.
pub const ALPN_HTTP11: &[u8] = b"http/1.1";

/// Why the upstream's TLS configuration cannot be built (haltd refuses to start).
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    #[error(transparent)]
    Pem(#[from] crate::pem::PemError),
    #[error("{path}: certificate {index} is not a usable trust anchor: {source}")]
    BadCa {
        path: PathBuf,
        index: usize,
        #[source]
        source: rustls::Error,
    },
    #[error("no trust roots in the system store ({detail}); install the CA certificates (ca-certificates) or give --upstream-ca-file")]
    NoSystemRoots { detail: String },
    #[error("{host:?} is not a name a TLS certificate can carry")]
    ServerName { host: String },
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

/// The upstream's TLS client configuration: trust roots, SNI name, ALPN. Shared by every
/// data-plane worker; making a connection's session from it takes no lock except rustls's
/// session-resumption cache (a mutex held for a lookup at each new connection, never per
/// token).
pub struct UpstreamTls {
    config: Arc<ClientConfig>,
    server_name: ServerName<'static>,
    /// Where the roots came from, for the start-up log.
    roots: String,
}

impl fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("server_name", &self.server_name)
            .field("roots", &self.roots)
            .finish_non_exhaustive()
    }
}

/// The certificates of a PEM file, as trust roots.
fn roots_from_file(path: &Path) -> Result<RootCertStore, TlsConfigError> {
    let certs = crate::pem::certificates(path)?;
    let mut roots = RootCertStore::empty();
    for (index, cert) in certs.into_iter().enumerate() {
        roots.add(cert).map_err(|source| TlsConfigError::BadCa {
            path: path.to_owned(),
            index,
            source,
        })?;
    }
    Ok(roots)
}

/// The system's trust roots; certificates it cannot parse are skipped, as a browser does.
fn system_roots() -> Result<RootCertStore, TlsConfigError> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let detail = match found.errors.first() {
            Some(e) => e.to_string(),
            None => "no certificates found".to_owned(),
        };
        return Err(TlsConfigError::NoSystemRoots { detail });
    }
    Ok(roots)
}

impl UpstreamTls {
    /// The configuration for `url` (an `https://` one), trusting `ca_file`'s certificates
    /// or, without one, the system's. Reads files: call it at start, never on the data plane.
    pub fn load(url: &UpstreamUrl, ca_file: Option<&Path>) -> Result<Self, TlsConfigError> {
        let (roots, from) = match ca_file {
            Some(p) => (roots_from_file(p)?, p.display().to_string()),
            None => (system_roots()?, "the system store".to_owned()),
        };
        let described = format!("{} certificates from {from}", roots.len());
        Self::with_roots(url, roots, described)
    }

    /// The configuration for `url` trusting exactly `roots`.
    pub fn with_roots(
        url: &UpstreamUrl,
        roots: RootCertStore,
        described: String,
    ) -> Result<Self, TlsConfigError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
        let server_name =
            ServerName::try_from(url.host.clone()).map_err(|_| TlsConfigError::ServerName {
                host: url.host.clone(),
            })?;
        Ok(UpstreamTls {
            config: Arc::new(config),
            server_name,
            roots: described,
        })
    }

    /// Where the trust roots came from and how many there are, for the start-up log.
    pub fn roots(&self) -> &str {
        &self.roots
    }

    /// A new blocking client session with the same trust roots, name and ALPN as the data
    /// plane's (the upstream probe's, over a std socket).
    pub fn client_connection(&self) -> Result<ClientConnection, rustls::Error> {
        ClientConnection::new(Arc::clone(&self.config), self.server_name.clone())
    }

    /// A new connection's TLS session, its handshake not begun.
    pub fn link(&self) -> Result<TlsLink, rustls::Error> {
        let mut conn = ClientConnection::new(Arc::clone(&self.config), self.server_name.clone())?;
        // The request is written before the handshake completes (rustls sends it right
        // after): it may be as large as a request body, so no limit on what waits.
        conn.set_buffer_limit(None);
        Ok(TlsLink {
            conn,
            plain: Vec::new(),
            out: Vec::new(),
            closed: None,
        })
    }
}

/// What a receive's ciphertext amounted to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opened {
    /// This many plaintext bytes, now in [`TlsLink::plain_mut`].
    Data(usize),
    /// No application data (handshake messages, a session ticket, half a record): read on.
    Nothing,
    /// The upstream ended the stream: `close_notify`, or (`clean: false`) a TCP close
    /// without one, which the HTTP framing then judges as it judges any early close.
    Eof { clean: bool },
}

/// One upstream connection's TLS session, sans I/O: ciphertext from receives goes in
/// ([`TlsLink::open`]), plaintext to send goes in ([`TlsLink::seal`]), and the ciphertext to
/// send comes out ([`TlsLink::pending`]). Its buffers are reused across the connection's
/// receives and sends, and the link stays with the connection when it is pooled, so that a
/// reused connection does not redo the handshake.
///
/// Allocation: rustls's buffered `ClientConnection` copies each received record's plaintext
/// into a `Vec` of its own before [`TlsLink::open`] drains it, so a TLS upstream costs one
/// allocation per record (per token of a paced stream) that a plain one does not; rustls's
/// unbuffered API would decrypt in place instead. The CPU it costs is measured in
/// docs/bench.md ("TLS to the upstream").
pub struct TlsLink {
    conn: ClientConnection,
    /// Plaintext of the last receive.
    plain: Vec<u8>,
    /// A spent send buffer, for the next ciphertext.
    out: Vec<u8>,
    /// The TLS stream ended: `Some(true)` by `close_notify`, `Some(false)` by a bare TCP close.
    closed: Option<bool>,
}

impl fmt::Debug for TlsLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsLink")
            .field("handshaking", &self.conn.is_handshaking())
            .field("plain", &self.plain.len())
            .finish_non_exhaustive()
    }
}

impl TlsLink {
    /// Whether the handshake is still under way.
    pub fn is_handshaking(&self) -> bool {
        self.conn.is_handshaking()
    }

    /// The upstream ended the TLS stream (`close_notify`, or a TCP close seen by
    /// [`TlsLink::open`]): nothing more will come, though plaintext before it may have.
    pub fn peer_closed(&self) -> bool {
        self.closed.is_some()
    }

    /// The negotiated ALPN protocol, if the upstream chose one.
    pub fn alpn(&self) -> Option<&[u8]> {
        self.conn.alpn_protocol()
    }

    /// Takes a receive's ciphertext (`eof`: the TCP connection closed, `cipher` is empty),
    /// decrypting what completes a record into [`TlsLink::plain_mut`] (cleared first).
    pub fn open(&mut self, mut cipher: &[u8], eof: bool) -> Result<Opened, rustls::Error> {
        self.plain.clear();
        if let Some(clean) = self.closed {
            return Ok(Opened::Eof { clean });
        }
        if cipher.is_empty() && !eof {
            return Ok(Opened::Nothing);
        }
        loop {
            // An empty read (with `eof`) tells rustls the TCP stream ended.
            let n = self
                .conn
                .read_tls(&mut cipher)
                .map_err(|e| rustls::Error::General(format!("reading TLS: {e}")))?;
            self.conn.process_new_packets()?;
            if let Some(clean) = self.drain()? {
                self.closed = Some(clean);
                break;
            }
            // All of it taken, or nothing more is taken (the session is over).
            if cipher.is_empty() || n == 0 {
                break;
            }
        }
        Ok(match (self.plain.len(), self.closed) {
            (0, Some(clean)) => Opened::Eof { clean },
            (0, None) => Opened::Nothing,
            (n, _) => Opened::Data(n),
        })
    }

    /// Moves the decrypted plaintext into `plain`; `Some(clean)` once the stream ended.
    fn drain(&mut self) -> Result<Option<bool>, rustls::Error> {
        match self.conn.reader().read_to_end(&mut self.plain) {
            Ok(_) => Ok(Some(true)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(Some(false)),
            Err(e) => Err(rustls::Error::General(format!("reading TLS: {e}"))),
        }
    }

    /// The plaintext [`TlsLink::open`] produced; the data plane swaps it with its receive
    /// buffer (both keep their capacity).
    pub fn plain_mut(&mut self) -> &mut Vec<u8> {
        &mut self.plain
    }

    /// Queues `plain` to go out encrypted (after the handshake if it is under way).
    pub fn seal(&mut self, plain: &[u8]) {
        // No buffer limit (`link`): writing into the session cannot fail or stop short.
        let _ = self.conn.writer().write_all(plain);
    }

    /// The ciphertext waiting to be sent (handshake messages, records, alerts), in a reused
    /// buffer; `None` when there is none.
    pub fn pending(&mut self) -> Option<Vec<u8>> {
        if !self.conn.wants_write() {
            return None;
        }
        let mut buf = std::mem::take(&mut self.out);
        buf.clear();
        while self.conn.wants_write() {
            // Writing into a Vec cannot fail.
            if self.conn.write_tls(&mut buf).is_err() {
                break;
            }
        }
        Some(buf)
    }

    /// A send buffer back from the kernel, for the next [`TlsLink::pending`].
    pub fn recycle(&mut self, buf: Vec<u8>) {
        if buf.capacity() > self.out.capacity() {
            self.out = buf;
        }
    }

    /// The `close_notify` alert, to send before closing the connection cleanly.
    pub fn close_notify(&mut self) -> Option<Vec<u8>> {
        self.conn.send_close_notify();
        self.pending()
    }
}

#[cfg(test)]
mod tests;
