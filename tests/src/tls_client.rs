//! A TLS client for haltd's own listener (`--tls-cert`): one streamed turn over rustls,
//! read as the client sees it (SSE events, [`StreamOutcome`]) and as the wire carries it
//! (the TLS records that arrived, counted by type). The halt tests run their TLS variants
//! with it; the halt SLO bench too (`bench-halt-slo --tls`).

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use rustls::{pki_types::pem::PemObject as _, ClientConfig, ClientConnection, RootCertStore};
use serde_json::Value;

use crate::sse::{classify, Progress, SseEvent, SseParser, StreamOutcome};

/// A client configuration trusting the test CA of `ca_pem` (a PEM file), offering ALPN
/// `http/1.1` as the SDKs' HTTP clients do.
pub fn client_config(ca_pem: &std::path::Path) -> Result<Arc<ClientConfig>> {
    let mut roots = RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca_pem)? {
        roots.add(cert?)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// TLS records as they arrived, by what the client could tell of them.
#[derive(Debug, Default, Clone, Copy)]
pub struct RecordCount {
    /// Application-data records (type 23) that arrived after the client's handshake was done:
    /// each is one frame of haltd's (a head, a token, the terminal, a final frame), or under
    /// TLS 1.3 an alert (`close_notify`), which travels as application data too.
    pub app_after_handshake: u64,
    /// Alert records (type 21), `close_notify` included.
    pub alerts: u64,
    /// Bytes that arrived, all of them.
    pub bytes: u64,
}

/// Splits what arrived into records and counts them (a record may span reads).
#[derive(Debug, Default)]
struct RecordScanner {
    /// Bytes of the record being read still to come (its header included while incomplete).
    header: Vec<u8>,
    body_left: usize,
}

impl RecordScanner {
    fn feed(&mut self, mut bytes: &[u8], handshake_done: bool, count: &mut RecordCount) {
        count.bytes += bytes.len() as u64;
        while !bytes.is_empty() {
            if self.body_left > 0 {
                let n = self.body_left.min(bytes.len());
                self.body_left -= n;
                bytes = &bytes[n..];
                continue;
            }
            let need = 5 - self.header.len();
            let n = need.min(bytes.len());
            self.header.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if self.header.len() == 5 {
                match self.header[0] {
                    23 if handshake_done => count.app_after_handshake += 1,
                    21 => count.alerts += 1,
                    _ => {}
                }
                self.body_left = usize::from(u16::from_be_bytes([self.header[3], self.header[4]]));
                self.header.clear();
            }
        }
    }
}

/// One streamed turn over TLS: the outcome as the client saw it, and the records.
#[derive(Debug)]
pub struct TlsTurn {
    pub outcome: StreamOutcome,
    pub records: RecordCount,
    /// The TLS error that ended the session, if any (a bare TCP close is none).
    pub tls_error: Option<String>,
    /// The client got `close_notify`.
    pub close_notify: bool,
}

/// The request of [`tls_stream`].
fn request(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> Result<Vec<u8>> {
    let payload = serde_json::to_vec(body)?;
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        payload.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(tenant) = crate::daemon::tenant_of(headers) {
        req.push_str(&format!(
            "{}: {tenant}\r\n",
            crate::daemon::TEST_TENANT_HEADER
        ));
    }
    // One request per connection, read to the close (`close_notify`, then EOF): say so, or
    // haltd keeps the connection for the next request, as HTTP/1.1 does by default.
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("connection"))
    {
        req.push_str("connection: close\r\n");
    }
    req.push_str("\r\n");
    let mut out = req.into_bytes();
    out.extend_from_slice(&payload);
    Ok(out)
}

/// The HTTP side of [`tls_stream`]: the plaintext as it opens, into a response head and SSE
/// events.
struct Response {
    started: Instant,
    plain: Vec<u8>,
    parser: SseParser,
    out: Option<StreamOutcome>,
}

impl Response {
    /// Takes the plaintext in `self.plain`: the head once it is whole, then events.
    fn take(&mut self, on_event: &mut impl FnMut(&Progress<'_>, &SseEvent)) {
        if self.out.is_none() {
            let Some(end) = self.plain.windows(4).position(|w| w == b"\r\n\r\n") else {
                return;
            };
            let text = String::from_utf8_lossy(&self.plain[..end]).to_string();
            let (status, id, ct) = parse_head(&text);
            self.plain.drain(..end + 4);
            self.out = Some(StreamOutcome::new(status, id, ct, None, self.started));
        }
        let Some(o) = self.out.as_mut() else {
            return;
        };
        for (event, data) in self.parser.feed(&self.plain) {
            let ev = SseEvent {
                kind: classify(&data),
                event,
                data,
                at: Instant::now(),
            };
            o.count(&ev);
            on_event(
                &Progress {
                    stream_id: &o.stream_id,
                    tokens: o.tokens,
                },
                &ev,
            );
            o.events.push(ev);
        }
        self.plain.clear();
    }
}

/// POSTs `body` to `path` on `addr` over TLS (SNI `localhost`) from the current thread's
/// namespace and reads the SSE response to its end, calling `on_event` for each event. After
/// a TLS error, what still arrives is only counted (the records the gate let through), until
/// haltd closes.
pub fn tls_stream(
    cfg: &Arc<ClientConfig>,
    addr: SocketAddr,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
    timeout: Duration,
    mut on_event: impl FnMut(&Progress<'_>, &SseEvent),
) -> Result<TlsTurn> {
    let mut tcp = TcpStream::connect_timeout(&addr, timeout).context("connecting")?;
    tcp.set_read_timeout(Some(timeout))?;
    tcp.set_nodelay(true)?;
    let mut tls = ClientConnection::new(Arc::clone(cfg), "localhost".try_into()?)?;
    tls.writer()
        .write_all(&request(addr, path, body, headers)?)?;
    let mut resp = Response {
        started: Instant::now(),
        plain: Vec::new(),
        parser: SseParser::default(),
        out: None,
    };
    let (mut count, mut scanner) = (RecordCount::default(), RecordScanner::default());
    let (mut tls_error, mut close_notify) = (None, false);
    let mut buf = vec![0u8; 16 * 1024];
    'read: while !close_notify {
        while tls_error.is_none() && tls.wants_write() {
            if tls.write_tls(&mut tcp).is_err() {
                break 'read;
            }
        }
        let n = match tcp.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) => {
                tls_error.get_or_insert_with(|| format!("read: {e}"));
                break;
            }
        };
        scanner.feed(&buf[..n], !tls.is_handshaking(), &mut count);
        if tls_error.is_some() {
            continue;
        }
        // Every byte goes into the session, and what it opens comes out at once: rustls
        // refuses more ciphertext while its opened plaintext is not read (a flood of small
        // records fills it), and a byte left out would misalign every record after it.
        let mut rd = &buf[..n];
        while !rd.is_empty() && tls_error.is_none() && !close_notify {
            if let Err(e) = tls.read_tls(&mut rd) {
                tls_error = Some(format!("read_tls: {e}"));
            } else if let Err(e) = tls.process_new_packets() {
                tls_error = Some(e.to_string());
            } else {
                close_notify = tls.reader().read_to_end(&mut resp.plain).is_ok();
            }
        }
        resp.take(&mut on_event);
    }
    let mut outcome = resp.out.with_context(|| {
        format!(
            "no response head arrived ({} bytes, TLS error {tls_error:?}, close_notify {close_notify})",
            count.bytes
        )
    })?;
    outcome.comments = resp.parser.comments;
    outcome.ended = Instant::now();
    outcome.read_error = tls_error.clone();
    Ok(TlsTurn {
        outcome,
        records: count,
        tls_error,
        close_notify,
    })
}

/// Status, `x-haltd-stream-id` and `content-type` of a response head.
fn parse_head(text: &str) -> (u16, String, Option<String>) {
    let mut lines = text.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let (mut id, mut ct) = (String::new(), None);
    for l in lines {
        if let Some((k, v)) = l.split_once(':') {
            match k.trim().to_ascii_lowercase().as_str() {
                "x-haltd-stream-id" => id = v.trim().to_owned(),
                "content-type" => ct = Some(v.trim().to_owned()),
                _ => {}
            }
        }
    }
    (status, id, ct)
}

/// Connects and sends `garbage` where a ClientHello belongs; returns once haltd closed.
pub fn bad_handshake(addr: SocketAddr, garbage: &[u8], timeout: Duration) -> Result<()> {
    let mut tcp = TcpStream::connect_timeout(&addr, timeout)?;
    tcp.set_read_timeout(Some(timeout))?;
    tcp.write_all(garbage)?;
    let mut sink = Vec::new();
    let _ = tcp.read_to_end(&mut sink);
    Ok(())
}
