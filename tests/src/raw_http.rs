//! A raw HTTP/1.1 exchange over a plain TCP connection, for requests a real client would
//! refuse to send (bad input) and for requests sent at the same instant.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpStream},
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
        r.read_to_end(&mut body)?;
    }
    Ok(RawResponse {
        status,
        headers,
        body,
    })
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
