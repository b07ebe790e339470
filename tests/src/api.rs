//! How a test's client reaches haltd's API: plain HTTP, or TLS to a haltd started with
//! `--tls-cert`/`--tls-key` ([`Transport::Tls`], a certificate made for the test). The halt
//! tests take a [`Transport`] and stream through [`ApiClient`], so each halt scenario runs
//! over both with the same bounds: under TLS the client opens the records (`tls_client`) and
//! sees the same SSE events, so what it counts is what it could read.

use std::{
    net::{IpAddr, SocketAddr},
    path::Path,
    sync::Arc,
    time::Duration,
};

use anyhow::Result;
use rustls::ClientConfig;
use serde_json::Value;

use crate::{
    raw_http::KeptConn,
    sse::{self, fresh_key, Progress, SseEvent, StreamOutcome},
    tls::TestPki,
    tls_client::{client_config, tls_stream},
};

/// What carries the client's requests to haltd's API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Plain HTTP/1.1.
    Plain,
    /// HTTPS: haltd serves a test certificate, the client trusts its CA.
    Tls,
}

impl Transport {
    /// For test output: `plain` or `tls`.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Plain => "plain",
            Transport::Tls => "tls",
        }
    }
}

/// haltd's side of [`Transport::Tls`]: the certificate it serves (files removed on drop) and
/// the client configuration that trusts it.
#[derive(Debug)]
pub struct ServedTls {
    pki: TestPki,
    cfg: Arc<ClientConfig>,
}

impl ServedTls {
    /// A new test CA and a certificate for `localhost` (the Rust clients' SNI) and `ip` (for
    /// clients given an `https://IP` URL, as the SDK is).
    pub fn new(ip: IpAddr) -> Result<Self> {
        let ip = ip.to_string();
        let pki = TestPki::new("api", &["localhost", &ip])?;
        let cfg = client_config(&pki.ca)?;
        Ok(ServedTls { pki, cfg })
    }

    /// haltd's flags that serve it: `--tls-cert FILE --tls-key FILE`.
    pub fn haltd_args(&self) -> Vec<String> {
        vec![
            "--tls-cert".into(),
            self.pki.cert.display().to_string(),
            "--tls-key".into(),
            self.pki.key.display().to_string(),
        ]
    }

    /// The test CA's certificate file (PEM), for clients that read one (the SDK).
    pub fn ca_file(&self) -> &Path {
        &self.pki.ca
    }

    /// The client configuration trusting it.
    pub fn client_config(&self) -> Arc<ClientConfig> {
        Arc::clone(&self.cfg)
    }
}

/// A client of haltd's API, cheap to clone into client threads; call it from the client
/// namespace.
#[derive(Debug, Clone)]
pub enum ApiClient {
    /// `http://ADDR`.
    Plain { base: String },
    /// TLS to `addr` (SNI `localhost`).
    Tls {
        addr: SocketAddr,
        cfg: Arc<ClientConfig>,
    },
}

impl ApiClient {
    /// A connection kept from request to request (HTTP keep-alive), over this transport.
    pub fn kept(&self, timeout: Duration) -> Result<KeptConn> {
        match self {
            ApiClient::Plain { base } => {
                let addr = base.trim_start_matches("http://").parse()?;
                KeptConn::connect(addr, timeout)
            }
            ApiClient::Tls { addr, cfg } => KeptConn::connect_tls(*addr, cfg, timeout),
        }
    }

    pub fn transport(&self) -> Transport {
        match self {
            ApiClient::Plain { .. } => Transport::Plain,
            ApiClient::Tls { .. } => Transport::Tls,
        }
    }

    /// POSTs `body` to `path` with a fresh API key ([`fresh_key`]) and reads the SSE response
    /// to its end, calling `on_event` per event (as [`sse::stream`]).
    pub fn stream(
        &self,
        path: &str,
        body: &Value,
        timeout: Duration,
        on_event: impl FnMut(&Progress<'_>, &SseEvent),
    ) -> Result<StreamOutcome> {
        let key = fresh_key();
        self.stream_with(path, body, &[("authorization", &key)], timeout, on_event)
    }

    /// [`ApiClient::stream`] with the caller's headers (no key added).
    pub fn stream_with(
        &self,
        path: &str,
        body: &Value,
        headers: &[(&str, &str)],
        timeout: Duration,
        on_event: impl FnMut(&Progress<'_>, &SseEvent),
    ) -> Result<StreamOutcome> {
        match self {
            ApiClient::Plain { base } => {
                sse::stream_with(&format!("{base}{path}"), body, headers, timeout, on_event)
            }
            ApiClient::Tls { addr, cfg } => {
                tls_stream(cfg, *addr, path, body, headers, timeout, on_event).map(|t| t.outcome)
            }
        }
    }
}
