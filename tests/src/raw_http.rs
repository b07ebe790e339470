//! A raw HTTP/1.1 exchange over a plain TCP connection, for requests a real client would
//! refuse to send (bad input) and for requests sent at the same instant; and a connection kept
//! from request to request ([`KeptConn`]), in plain TCP or TLS ([`Wire`]).

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpStream},
    sync::Arc,
    time::Duration,
};

use anyhow::{anyhow, ensure, Context, Result};
use serde_json::Value;

/// A raw HTTP/1.1 exchange for inputs a real client would refuse to send: writes `request`,
/// half-closes nothing, and reads the response head and body (Content-Length, chunked or
/// until close). Runs in the current thread's namespace.
pub fn raw_exchange(addr: SocketAddr, request: &[u8], timeout: Duration) -> Result<RawResponse> {
    let s = TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("connecting to {addr}"))?;
    raw_exchange_on(s, request, timeout)
}

/// [`raw_exchange`] on a connection the caller opened (e.g. to send several requests at the
/// same instant on connections set up beforehand).
pub fn raw_exchange_on(mut s: TcpStream, request: &[u8], timeout: Duration) -> Result<RawResponse> {
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(request).context("writing the request")?;
    let mut r = BufReader::new(s);
    read_response(&mut r, true)
}

/// Reads one response from `r`: its head, then its body by `content-length`, chunked framing
/// or (with `to_close`, else an error) until the connection closes.
pub fn read_response(r: &mut impl BufRead, to_close: bool) -> Result<RawResponse> {
    let (status, headers) = read_head(r)?;
    let body = read_body(r, &headers, to_close)?;
    Ok(RawResponse {
        status,
        headers,
        body,
    })
}

/// A response's status and headers (names in lower case).
pub fn read_head(r: &mut impl BufRead) -> Result<(u16, Vec<(String, String)>)> {
    let mut status_line = String::new();
    r.read_line(&mut status_line)
        .context("reading the status line")?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("bad status line {status_line:?}"))?;
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        ensure!(
            r.read_line(&mut line)? > 0,
            "connection closed inside the response head"
        );
        let line = line.trim_end_matches(['\r', '\n']);
        if line.is_empty() {
            break;
        }
        let (k, v) = line
            .split_once(':')
            .with_context(|| format!("bad header line {line:?}"))?;
        headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
    }
    Ok((status, headers))
}

/// The body of a response whose head was read.
fn read_body(
    r: &mut impl BufRead,
    headers: &[(String, String)],
    to_close: bool,
) -> Result<Vec<u8>> {
    let get = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let mut body = Vec::new();
    if let Some(len) = get("content-length") {
        let len: usize = len.parse().context("bad content-length")?;
        body.resize(len, 0);
        r.read_exact(&mut body).context("reading the body")?;
    } else if get("transfer-encoding").is_some_and(|t| t.eq_ignore_ascii_case("chunked")) {
        loop {
            let mut size = String::new();
            r.read_line(&mut size)?;
            let size = usize::from_str_radix(size.trim().split(';').next().unwrap_or("0"), 16)
                .context("bad chunk size")?;
            let mut chunk = vec![0; size + 2];
            r.read_exact(&mut chunk)?;
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    } else {
        ensure!(
            to_close,
            "a response without length or chunked framing on a kept connection"
        );
        r.read_to_end(&mut body)?;
    }
    Ok(body)
}

/// The payloads of a chunked body as far as it is whole: a body cut off (a connection reset
/// inside it) keeps its whole chunks.
pub fn dechunk_lenient(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = raw.windows(2).position(|w| w == b"\r\n") {
        let Some(size) = std::str::from_utf8(&raw[..eol])
            .ok()
            .and_then(|s| usize::from_str_radix(s.trim(), 16).ok())
        else {
            break;
        };
        let start = eol + 2;
        if size == 0 || raw.len() < start + size + 2 {
            break;
        }
        out.extend_from_slice(&raw[start..start + size]);
        raw = &raw[start + size + 2..];
    }
    out
}

/// What a [`KeptConn`] runs over: TCP, or TLS over it (rustls, SNI `localhost`).
#[derive(Debug)]
pub enum Wire {
    Tcp(TcpStream),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
}

impl Wire {
    /// The TCP connection under it.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Wire::Tcp(s) => s,
            Wire::Tls(t) => &t.sock,
        }
    }

    /// TLS over `s`, the handshake done before it returns (so that a caller can time it).
    pub fn tls(s: TcpStream, cfg: &Arc<rustls::ClientConfig>) -> Result<Self> {
        let conn = rustls::ClientConnection::new(Arc::clone(cfg), "localhost".try_into()?)?;
        let mut t = rustls::StreamOwned::new(conn, s);
        while t.conn.is_handshaking() {
            t.conn
                .complete_io(&mut t.sock)
                .context("the TLS handshake")?;
        }
        Ok(Wire::Tls(Box::new(t)))
    }
}

impl Read for Wire {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Wire::Tcp(s) => s.read(buf),
            Wire::Tls(t) => t.read(buf),
        }
    }
}

impl Write for Wire {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Wire::Tcp(s) => s.write(buf),
            Wire::Tls(t) => t.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Wire::Tcp(s) => s.flush(),
            Wire::Tls(t) => t.flush(),
        }
    }
}

impl Read for KeptConn {
    /// Raw bytes of the connection, after what the response readers took.
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.r.read(buf)
    }
}

/// A client connection kept from request to request (HTTP keep-alive), for tests and probes
/// of haltd's persistent connections.
#[derive(Debug)]
pub struct KeptConn {
    r: BufReader<Wire>,
}

impl KeptConn {
    /// Connects to `addr` (in the current thread's namespace) with `timeout` on every read
    /// and write.
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<Self> {
        let s = TcpStream::connect_timeout(&addr, timeout)
            .with_context(|| format!("connecting to {addr}"))?;
        Self::on(s, timeout)
    }

    /// A kept connection on a stream the caller opened.
    pub fn on(s: TcpStream, timeout: Duration) -> Result<Self> {
        Self::over(s, None, timeout)
    }

    /// Like [`KeptConn::connect`], in TLS trusting `cfg`'s roots (haltd with `--tls-cert`).
    pub fn connect_tls(
        addr: SocketAddr,
        cfg: &Arc<rustls::ClientConfig>,
        timeout: Duration,
    ) -> Result<Self> {
        let s = TcpStream::connect_timeout(&addr, timeout)
            .with_context(|| format!("connecting to {addr}"))?;
        Self::over(s, Some(cfg), timeout)
    }

    /// A kept connection on `s`, in TLS when `tls` is given (the handshake done when it
    /// returns).
    pub fn over(
        s: TcpStream,
        tls: Option<&Arc<rustls::ClientConfig>>,
        timeout: Duration,
    ) -> Result<Self> {
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(timeout))?;
        s.set_write_timeout(Some(timeout))?;
        let wire = match tls {
            Some(cfg) => Wire::tls(s, cfg)?,
            None => Wire::Tcp(s),
        };
        Ok(KeptConn {
            r: BufReader::new(wire),
        })
    }

    /// The client's port of the connection.
    pub fn local_port(&self) -> Result<u16> {
        Ok(self.tcp().local_addr()?.port())
    }

    fn tcp(&self) -> &TcpStream {
        self.r.get_ref().tcp()
    }

    /// Whether the connection is TLS.
    pub fn is_tls(&self) -> bool {
        matches!(self.r.get_ref(), Wire::Tls(_))
    }

    /// Writes `bytes` (one request, several pipelined, or part of one).
    pub fn send(&mut self, bytes: &[u8]) -> Result<()> {
        self.r
            .get_mut()
            .write_all(bytes)
            .context("writing the request")
    }

    /// Reads the next response (one that says `connection: close` may run until close).
    pub fn response(&mut self) -> Result<RawResponse> {
        read_response(&mut self.r, true)
    }

    /// Reads the next response's head only (the body follows with [`KeptConn::body`] or
    /// [`KeptConn::rest`]).
    pub fn head(&mut self) -> Result<(u16, Vec<(String, String)>)> {
        read_head(&mut self.r)
    }

    /// Reads the body of the response whose head [`KeptConn::head`] read.
    pub fn body(&mut self, headers: &[(String, String)]) -> Result<Vec<u8>> {
        read_body(&mut self.r, headers, false)
    }

    /// Every byte until the connection closes (EOF, a reset, under TLS a close without
    /// `close_notify`, or `wait` without a byte).
    pub fn rest(&mut self, wait: Duration) -> Result<Vec<u8>> {
        self.tcp().set_read_timeout(Some(wait))?;
        let mut out = Vec::new();
        let mut buf = [0u8; 16 * 1024];
        loop {
            match self.r.read(&mut buf) {
                Ok(0) => return Ok(out),
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionReset
                            | std::io::ErrorKind::UnexpectedEof
                            | std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Ok(out)
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Sends `request` and reads its response; also returns the time from the write to the
    /// first response byte.
    pub fn exchange_timed(&mut self, request: &[u8]) -> Result<(Duration, RawResponse)> {
        let t0 = std::time::Instant::now();
        self.send(request)?;
        let first = self.r.fill_buf().context("waiting for the response")?;
        ensure!(!first.is_empty(), "the connection closed before a response");
        let ttfb = t0.elapsed();
        Ok((ttfb, self.response()?))
    }

    /// How the connection ends within `wait`, with nothing more to read before: under TLS,
    /// `close_notify` (and then the TCP close) or a bare TCP close.
    pub fn ending(&mut self, wait: Duration) -> Result<Ending> {
        self.tcp().set_read_timeout(Some(wait))?;
        let tls = self.is_tls();
        let mut byte = [0u8; 1];
        match self.r.read(&mut byte) {
            Ok(0) if tls => {
                // close_notify came: the TCP close follows.
                let mut rest = [0u8; 64];
                match self.r.get_mut().tcp().read(&mut rest) {
                    Ok(0) => Ok(Ending::CloseNotify),
                    Ok(_) => Err(anyhow!("bytes after close_notify")),
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(Ending::Reset),
                    Err(e) => Err(anyhow!("no TCP close after close_notify: {e}")),
                }
            }
            Ok(0) => Ok(Ending::Eof),
            Ok(_) => Err(anyhow!("unexpected bytes on an idle kept connection")),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(Ending::Eof),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(Ending::Reset),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                Ok(Ending::Open)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Whether haltd closed the connection: a read sees EOF (or a reset) within `wait`; under
    /// TLS, `close_notify` or a TCP close without it.
    pub fn closed_within(&mut self, wait: Duration) -> Result<bool> {
        self.tcp().set_read_timeout(Some(wait))?;
        let mut byte = [0u8; 1];
        match self.r.read(&mut byte) {
            Ok(0) => Ok(true),
            Ok(_) => Err(anyhow!("unexpected bytes on an idle kept connection")),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof
                ) =>
            {
                Ok(true)
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// How a kept connection ended ([`KeptConn::ending`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// TLS: `close_notify`, then the TCP close.
    CloseNotify,
    /// A TCP close with nothing before it: plain HTTP's clean end, TLS's truncation.
    Eof,
    /// A TCP reset.
    Reset,
    /// Still open after the wait.
    Open,
}

/// What [`raw_exchange`] read.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    /// Header names in lower case.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Result<Value> {
        serde_json::from_slice(&self.body).map_err(|e| {
            anyhow!(
                "body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }
}
