//! One probe of the upstream: `GET` of `--upstream-probe-path` (default `/v1/models`) over a
//! blocking std socket with a short timeout, in TLS for an `https://` upstream (the data
//! plane's trust roots, server name and ALPN: `tls.rs`). It runs on the watch thread
//! (`watch.rs`), never on the data plane. A 2xx answer is a success; from `/v1/models` it also
//! yields the model ids (`data[].id`).

use std::{
    io::{self, Read, Write},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use serde::Deserialize;

use crate::upstream::{
    request::write_http_request_with, response::ResponseReader, ResponseError, UpstreamTls,
    UpstreamUrl, MODELS_PATH,
};

/// Largest response head a probe reads.
const MAX_HEAD: usize = 16 * 1024;
/// Largest response body a probe reads (a long model list is a few tens of KiB).
const MAX_BODY: usize = 1024 * 1024;

/// Why a probe failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("connecting to {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("reading or writing: {0}")]
    Io(#[source] io::Error),
    #[error("TLS: {0}")]
    Tls(#[source] rustls::Error),
    #[error("bad HTTP response: {0}")]
    Response(#[source] ResponseError),
    #[error("the connection closed before a response head")]
    NoHead,
    #[error("response body over {MAX_BODY} bytes")]
    TooLarge,
    #[error("answered {status} {reason}")]
    Status { status: u16, reason: String },
}

impl ProbeError {
    /// The upstream accepted the connection and did not answer in time: busy, or hung (not
    /// refused, not broken).
    pub fn is_timeout(&self) -> bool {
        match self {
            ProbeError::Timeout(_) => true,
            ProbeError::Io(e) => matches!(
                e.kind(),
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
            ),
            _ => false,
        }
    }
}

/// What a successful probe learnt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    /// The model ids of a `/v1/models` answer whose body parsed; `None` otherwise.
    pub models: Option<Vec<String>>,
}

/// Where and how to probe.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    pub url: &'a UpstreamUrl,
    pub tls: Option<&'a UpstreamTls>,
    /// The API path, below the URL's base path (`/v1/models`).
    pub path: &'a str,
    /// `authorization` value (`--upstream-api-key-file`), if any.
    pub authorization: Option<&'a str>,
    /// For the whole probe: connect, request and response.
    pub timeout: Duration,
}

/// Probes the upstream at `addr` once.
pub fn probe(target: &Target<'_>, addr: SocketAddr) -> Result<Answer, ProbeError> {
    let (status, body) = send(target, addr, ("GET", None))?;
    let models = (target.path == MODELS_PATH)
        .then(|| model_ids(&body))
        .flatten();
    Ok(Answer { status, models })
}

/// `POST`s `body` (JSON) to the target at `addr` once, the same way: its 2xx status, or why
/// not (the escalation of a degraded scope, `escalation.rs`).
pub fn post_json(target: &Target<'_>, addr: SocketAddr, body: &[u8]) -> Result<u16, ProbeError> {
    send(target, addr, ("POST", Some(body))).map(|(status, _)| status)
}

/// One request and its answer: a 2xx status and the body, or why not.
fn send(
    target: &Target<'_>,
    addr: SocketAddr,
    (method, body): (&str, Option<&[u8]>),
) -> Result<(u16, Vec<u8>), ProbeError> {
    let deadline = Instant::now() + target.timeout;
    let tcp = TcpStream::connect_timeout(&addr, target.timeout)
        .map_err(|source| ProbeError::Connect { addr, source })?;
    let _ = tcp.set_nodelay(true);
    tcp.set_write_timeout(Some(target.timeout))
        .map_err(ProbeError::Io)?;
    let mut request = Vec::new();
    // A JSON POST (the escalation) reads a JSON answer, not a turn's stream.
    let accept: &[(&str, &str)] = match body {
        Some(_) => &[("accept", "application/json")],
        None => &[],
    };
    write_http_request_with(
        &mut request,
        target.url,
        (method, target.path),
        target.authorization,
        accept,
        body,
    );
    let (status, reason, body) = match target.tls {
        None => exchange(Timed(tcp, deadline), &request, target.timeout)?,
        Some(tls) => {
            let conn = tls.client_connection().map_err(ProbeError::Tls)?;
            let stream = rustls::StreamOwned::new(conn, Timed(tcp, deadline));
            exchange(stream, &request, target.timeout)?
        }
    };
    if !(200..300).contains(&status) {
        return Err(ProbeError::Status { status, reason });
    }
    Ok((status, body))
}

/// The model ids of a `/v1/models` body (`{"data": [{"id": ...}, ...]}`).
pub fn model_ids(body: &[u8]) -> Option<Vec<String>> {
    #[derive(Deserialize)]
    struct List {
        data: Vec<Model>,
    }
    #[derive(Deserialize)]
    struct Model {
        id: String,
    }
    let list: List = serde_json::from_slice(body).ok()?;
    Some(list.data.into_iter().map(|m| m.id).collect())
}

/// A socket whose every read waits at most until the probe's deadline.
struct Timed(TcpStream, Instant);

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.1.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.0.set_read_timeout(Some(left))?;
        self.0.read(buf)
    }
}

impl Write for Timed {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

/// Sends the request and reads the response: its status, reason and body.
fn exchange(
    mut s: impl Read + Write,
    request: &[u8],
    timeout: Duration,
) -> Result<(u16, String, Vec<u8>), ProbeError> {
    let io_err = |e: io::Error| match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => ProbeError::Timeout(timeout),
        _ => ProbeError::Io(e),
    };
    s.write_all(request)
        .and_then(|()| s.flush())
        .map_err(io_err)?;
    let mut reader = ResponseReader::new(MAX_HEAD);
    let mut body = Vec::new();
    let mut buf = [0u8; 8192];
    while !reader.is_done() {
        let n = match s.read(&mut buf) {
            Ok(n) => n,
            // A TLS peer that closes without close_notify: the framing judges the end.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => 0,
            Err(e) => return Err(io_err(e)),
        };
        if n == 0 {
            reader.eof().map_err(ProbeError::Response)?;
            break;
        }
        reader
            .feed(&buf[..n], &mut body)
            .map_err(ProbeError::Response)?;
        if body.len() > MAX_BODY {
            return Err(ProbeError::TooLarge);
        }
    }
    let head = reader.head().ok_or(ProbeError::NoHead)?;
    Ok((head.status, head.reason.clone(), body))
}

#[cfg(test)]
mod tests {
    use std::{io::BufRead as _, net::TcpListener, thread};

    use super::*;

    /// A one-shot HTTP server on loopback answering `response` to the first request; the
    /// request head it read comes out of the receiver.
    fn serve_once(response: &'static [u8]) -> (SocketAddr, std::sync::mpsc::Receiver<String>) {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        let (tx, rx) = std::sync::mpsc::channel();
        thread::spawn(move || {
            let (s, _) = l.accept().expect("accept");
            let mut r = io::BufReader::new(s.try_clone().expect("clone"));
            let (mut line, mut head) = (String::new(), String::new());
            while r.read_line(&mut line).is_ok_and(|n| n > 2) {
                head.push_str(&line);
                line.clear();
            }
            let _ = (&s).write_all(response);
            let _ = tx.send(head);
        });
        (addr, rx)
    }

    fn target(url: &UpstreamUrl) -> Target<'_> {
        Target {
            url,
            tls: None,
            path: MODELS_PATH,
            authorization: None,
            timeout: Duration::from_secs(2),
        }
    }

    #[test]
    fn a_models_answer_is_up_with_its_model_ids() {
        let body = concat!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 74\r\n\r\n",
            r#"{"object":"list","data":[{"id":"llama-3","object":"model"},{"id":"qwen"}]}"#
        )
        .as_bytes();
        let (addr, head) = serve_once(body);
        let url = UpstreamUrl::parse(&format!("http://{addr}/v1")).expect("url");
        let mut t = target(&url);
        t.authorization = Some("Bearer sk-haltd-own");
        let got = probe(&t, addr).expect("probe");
        let head = head.recv().expect("the request head");
        assert!(head.starts_with("GET /v1/models HTTP/1.1\r\n"), "{head}");
        assert!(
            head.contains("authorization: Bearer sk-haltd-own\r\n"),
            "{head}"
        );
        assert_eq!(got.status, 200);
        assert_eq!(
            got.models,
            Some(vec!["llama-3".to_owned(), "qwen".to_owned()])
        );
    }

    #[test]
    fn an_error_status_a_refused_connect_and_silence_fail() {
        let (addr, _) =
            serve_once(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n");
        let url = UpstreamUrl::parse(&format!("http://{addr}")).expect("url");
        let e = probe(&target(&url), addr).expect_err("503");
        assert!(matches!(e, ProbeError::Status { status: 503, .. }), "{e}");

        // Nothing listens on a port just released.
        let closed = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("port");
        let e = probe(&target(&url), closed).expect_err("refused");
        assert!(matches!(e, ProbeError::Connect { .. }), "{e}");

        // Accepts and never answers: the probe's timeout ends it.
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let silent = l.local_addr().expect("addr");
        let mut t = target(&url);
        t.timeout = Duration::from_millis(200);
        let started = Instant::now();
        let e = probe(&t, silent).expect_err("silent");
        assert!(matches!(e, ProbeError::Timeout(_)), "{e}");
        assert!(started.elapsed() < Duration::from_secs(2));
        drop(l);
    }

    #[test]
    fn model_ids_need_the_list_shape() {
        assert_eq!(model_ids(br#"{"data":[]}"#), Some(vec![]));
        assert_eq!(model_ids(br#"{"data":[{"object":"model"}]}"#), None);
        assert_eq!(model_ids(b"not json"), None);
    }
}
