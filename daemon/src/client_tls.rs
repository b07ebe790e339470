//! TLS for clients (`--tls-cert`/`--tls-key`), with no I/O: the rustls server configuration
//! ([`ClientTlsConfig`], replaced whole on SIGHUP) and one client connection's session as bytes
//! in and records out ([`ClientTls`]), which the data plane drives over its io_uring buffers
//! (`dataplane/conn/client_tls.rs`), as it drives the upstream's (`upstream/tls.rs`).
//!
//! Modern defaults: TLS 1.3 and 1.2 with the `ring` provider's default cipher suites (AEAD
//! only: AES-GCM and ChaCha20-Poly1305, ECDHE key exchange), ALPN `http/1.1` (a client that
//! offers ALPN without it is refused), no client certificates.
//!
//! What the kernel gate needs from TLS (architecture.md §6, "The gate on ciphertext"):
//!
//! * **One record per frame.** [`ClientTls::seal`] turns a frame into records at once, and the
//!   data plane sends them in one send: a token frame (far below 16 KiB) is one record. Its
//!   length is known before it is sealed ([`ClientTls::sealed_len`]), so the frame is counted
//!   at its length on the wire, record overhead included.
//! * **No records haltd did not ask for.** rustls sends nothing after the handshake on its
//!   own except what the peer provokes: TLS 1.3 session tickets are off
//!   (`send_tls13_tickets = 0`, and TLS 1.2 tickets are never made: the default ticketer
//!   makes none), so resumption is by session id only (TLS 1.2, a stateful cache, nothing sent
//!   after the handshake). A client's key update request would make rustls answer with its own
//!   record: haltd reads nothing from a client during a turn, so such an answer can only come
//!   between turns, before any trip. rustls refreshes keys by itself only near a suite's
//!   confidentiality limit (millions of records); that record then goes out with the next
//!   frame, counted in it, and a frame grown by it after a trip is one the gate drops (fail
//!   closed).
//! * **The terminal record is sealed before the trip is written** ([`ClientTls::seal_terminal`]),
//!   its first 16 ciphertext bytes go into the trip (`SockPolicy::nonce`), and `close_notify`
//!   is sealed with it, as part of the terminal frame.

use std::{
    fmt,
    io::{self, Read as _, Write as _},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard},
};

use arc_swap::ArcSwap;
use rustls::{ServerConfig, ServerConnection};

pub use crate::upstream::tls::Opened;

/// The one protocol haltd speaks to clients, chosen by ALPN.
pub const ALPN_HTTP11: &[u8] = b"http/1.1";
/// Most plaintext bytes in one TLS record (RFC 8446 §5.1); rustls fills records up to it.
pub const MAX_RECORD_PLAINTEXT: usize = 16_384;
/// Bytes of a record's header: type, version, length.
pub const RECORD_HEADER_LEN: usize = 5;
/// The largest overhead of one record of any suite haltd negotiates: TLS 1.2 AES-GCM, header
/// (5) + explicit nonce (8) + tag (16).
pub const MAX_RECORD_OVERHEAD: usize = 29;

/// Why the client TLS configuration cannot be built (haltd refuses to start; a reload keeps
/// the running one).
#[derive(Debug, thiserror::Error)]
pub enum ClientTlsError {
    #[error(transparent)]
    Pem(#[from] crate::pem::PemError),
    #[error("certificate {cert} and key {key} do not make a server configuration: {source}")]
    Rustls {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: rustls::Error,
    },
}

/// The certificate chain and key of `cert` and `key` as a server configuration.
fn server_config(cert: &Path, key: &Path) -> Result<ServerConfig, ClientTlsError> {
    let chain = crate::pem::certificates(cert)?;
    let private = crate::pem::private_key(key)?;
    let rustls_err = |source| ClientTlsError::Rustls {
        cert: cert.to_owned(),
        key: key.to_owned(),
        source,
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(rustls_err)?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(rustls_err)?;
    config.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
    // No post-handshake records haltd did not ask for (module doc).
    config.send_tls13_tickets = 0;
    Ok(config)
}

/// The client TLS configuration: the files it came from and the configuration now in force.
/// A connection takes the current one at accept (one atomic load); SIGHUP replaces it whole.
pub struct ClientTlsConfig {
    cert: PathBuf,
    key: PathBuf,
    current: ArcSwap<ServerConfig>,
}

impl fmt::Debug for ClientTlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTlsConfig")
            .field("cert", &self.cert)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl ClientTlsConfig {
    /// Reads `cert` (PEM chain, leaf first) and `key` (PEM private key). Reads files: call it
    /// at start or on SIGHUP, never on the data plane.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, ClientTlsError> {
        Ok(ClientTlsConfig {
            current: ArcSwap::from_pointee(server_config(cert, key)?),
            cert: cert.to_owned(),
            key: key.to_owned(),
        })
    }

    /// Reads the files again, changing nothing yet: [`ClientTlsConfig::install`] puts what it
    /// read in force. A pair that does not load is an error and changes nothing.
    pub fn reread(&self) -> Result<NextServerConfig, ClientTlsError> {
        server_config(&self.cert, &self.key).map(|c| NextServerConfig(Arc::new(c)))
    }

    /// Puts a configuration read by [`ClientTlsConfig::reread`] in force for connections
    /// accepted from now on (open ones keep their session); says what it installed.
    pub fn install(&self, next: NextServerConfig) -> String {
        self.current.store(next.0);
        self.describe()
    }

    /// Reads the files again and puts them in force; a pair that does not load changes
    /// nothing.
    pub fn reload(&self) -> Result<String, ClientTlsError> {
        Ok(self.install(self.reread()?))
    }

    /// The files, for logs and records.
    pub fn describe(&self) -> String {
        format!(
            "TLS certificate {} and key {}",
            self.cert.display(),
            self.key.display()
        )
    }

    /// A new client connection's session, its handshake not begun.
    pub fn session(&self) -> Result<ClientTls, rustls::Error> {
        let mut conn = ServerConnection::new(self.current.load_full())?;
        // A reply written while the handshake is under way waits in the session.
        conn.set_buffer_limit(None);
        Ok(ClientTls {
            conn,
            plain: Vec::new(),
            overhead: MAX_RECORD_OVERHEAD,
            closed: None,
        })
    }
}

/// A configuration read from the files, not yet in force.
pub struct NextServerConfig(Arc<ServerConfig>);

impl fmt::Debug for NextServerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NextServerConfig").finish_non_exhaustive()
    }
}

/// One client connection's TLS session, shared by its worker and whoever trips its stream
/// (the terminal record is sealed by the tripper): see [`lock`].
pub type SharedTls = Arc<Mutex<ClientTls>>;

/// The session, locked. A lock per frame: the worker takes it to count and seal a frame, a
/// tripper to seal the terminal; it is never held across anything that waits. A panic while
/// it was held leaves a session that may be mid-record: it is still taken (the client then
/// fails to open a record, which ends its stream), as a poisoned lock must not stop a halt.
pub fn lock(tls: &SharedTls) -> MutexGuard<'_, ClientTls> {
    tls.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One client connection's TLS session, sans I/O: ciphertext from receives goes in
/// ([`ClientTls::open`]), frames go out as records ([`ClientTls::seal`]).
pub struct ClientTls {
    conn: ServerConnection,
    /// Plaintext of the last receive.
    plain: Vec<u8>,
    /// Bytes one record adds to its plaintext under the negotiated suite (the largest of any
    /// suite until the handshake is done).
    overhead: usize,
    /// The client ended the TLS stream: `Some(true)` by `close_notify`, else a bare TCP close.
    closed: Option<bool>,
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls")
            .field("handshaking", &self.conn.is_handshaking())
            .field("overhead", &self.overhead)
            .finish_non_exhaustive()
    }
}

/// Bytes one record adds under a suite: TLS 1.3 header (5) + content type (1) + tag (16);
/// TLS 1.2 ChaCha20-Poly1305 header + tag; TLS 1.2 AES-GCM header + explicit nonce (8) + tag.
fn record_overhead(suite: rustls::SupportedCipherSuite) -> usize {
    match suite {
        rustls::SupportedCipherSuite::Tls13(_) => 22,
        rustls::SupportedCipherSuite::Tls12(s) => {
            if format!("{:?}", s.common.suite).contains("CHACHA20") {
                21
            } else {
                MAX_RECORD_OVERHEAD
            }
        }
    }
}

impl ClientTls {
    /// Whether the handshake is still under way.
    pub fn is_handshaking(&self) -> bool {
        self.conn.is_handshaking()
    }

    /// Takes a receive's ciphertext (`eof`: the TCP connection closed), decrypting what
    /// completes a record into [`ClientTls::plain_mut`] (cleared first).
    pub fn open(&mut self, mut cipher: &[u8], eof: bool) -> Result<Opened, rustls::Error> {
        self.plain.clear();
        if let Some(clean) = self.closed {
            return Ok(Opened::Eof { clean });
        }
        if cipher.is_empty() && !eof {
            return Ok(Opened::Nothing);
        }
        loop {
            let n = self
                .conn
                .read_tls(&mut cipher)
                .map_err(|e| rustls::Error::General(format!("reading TLS: {e}")))?;
            self.conn.process_new_packets()?;
            match self.conn.reader().read_to_end(&mut self.plain) {
                Ok(_) => self.closed = Some(true),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => self.closed = Some(false),
                Err(e) => return Err(rustls::Error::General(format!("reading TLS: {e}"))),
            }
            if self.closed.is_some() || cipher.is_empty() || n == 0 {
                break;
            }
        }
        if !self.conn.is_handshaking() {
            if let Some(suite) = self.conn.negotiated_cipher_suite() {
                self.overhead = record_overhead(suite);
            }
        }
        Ok(match (self.plain.len(), self.closed) {
            (0, Some(clean)) => Opened::Eof { clean },
            (0, None) => Opened::Nothing,
            (n, _) => Opened::Data(n),
        })
    }

    /// The plaintext [`ClientTls::open`] produced.
    pub fn plain_mut(&mut self) -> &mut Vec<u8> {
        &mut self.plain
    }

    /// Appends what the session has to send (handshake flights, an alert) to `out`; whether
    /// there was anything.
    pub fn pending(&mut self, out: &mut Vec<u8>) -> bool {
        let before = out.len();
        while self.conn.wants_write() {
            // Writing into a Vec cannot fail.
            if self.conn.write_tls(out).is_err() {
                break;
            }
        }
        out.len() > before
    }

    /// Bytes `plain` becomes on the wire once sealed: its records' plaintext plus their
    /// overhead (exact once the handshake is done).
    pub fn sealed_len(&self, plain: usize) -> usize {
        plain + plain.div_ceil(MAX_RECORD_PLAINTEXT) * self.overhead
    }

    /// Seals `plain` into `out` (cleared first): the records of the frame, with whatever the
    /// session had waiting before them. Empty while the handshake is under way (the frame
    /// then waits in the session).
    ///
    /// Allocates once per record (the hot path's one allocation on a TLS connection): rustls
    /// 0.23's buffered API has its `ring` encrypter seal each record into a `Vec` of its own
    /// (`PrefixedPayload::with_capacity`), queues it, and `write_tls` copies it into `out`
    /// (reused, no allocation once grown) and frees it. Sealing into our buffer without that
    /// `Vec` needs rustls's unbuffered API (`UnbufferedServerConnection`), a different state
    /// machine for the handshake too; measured cost: docs/bench.md "TLS for clients".
    pub fn seal(&mut self, plain: &[u8], out: &mut Vec<u8>) {
        out.clear();
        // No buffer limit (`session`): writing into the session cannot fail or stop short.
        let _ = self.conn.writer().write_all(plain);
        self.pending(out);
    }

    /// The terminal frame `plain` sealed as one record, followed by `close_notify` (a halted
    /// stream's connection closes after it): `out` is the whole terminal frame on the wire.
    /// Returns the first 16 ciphertext bytes of the record (after its header), which the
    /// kernel gate's terminal allowance matches; `None` when nothing could be sealed (the
    /// handshake is under way, or the frame does not fit one record).
    pub fn seal_terminal(&mut self, plain: &[u8], out: &mut Vec<u8>) -> Option<[u8; 16]> {
        out.clear();
        if self.conn.is_handshaking() || plain.len() > MAX_RECORD_PLAINTEXT {
            return None;
        }
        // Anything the session had waiting goes out before the terminal, in its own frame:
        // not here. Nothing waits after the handshake (module doc); if something does, fail
        // closed (no terminal) rather than merge it into the terminal frame.
        if self.conn.wants_write() {
            return None;
        }
        let _ = self.conn.writer().write_all(plain);
        self.pending(out);
        let nonce = out
            .get(RECORD_HEADER_LEN..RECORD_HEADER_LEN + 16)?
            .try_into()
            .ok()?;
        if out.len() != self.sealed_len(plain.len()) {
            return None;
        }
        self.conn.send_close_notify();
        self.pending(out);
        Some(nonce)
    }

    /// The `close_notify` alert, to send before closing a connection that ended cleanly.
    pub fn close_notify(&mut self, out: &mut Vec<u8>) {
        out.clear();
        self.conn.send_close_notify();
        self.pending(out);
    }

    /// The negotiated protocol version and suite, for records (`None` while handshaking).
    pub fn negotiated(&self) -> Option<String> {
        let v = self.conn.protocol_version()?;
        let s = self.conn.negotiated_cipher_suite()?;
        Some(format!("{v:?} {:?}", s.suite()))
    }
}

#[cfg(test)]
mod tests;
