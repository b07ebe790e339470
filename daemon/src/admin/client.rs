//! A blocking client for the admin API, over its Unix socket or TCP: what `haltctl` uses.
//!
//! One request per connection, on a current-thread tokio runtime with hyper's HTTP/1 client:
//! an operator's command, not a hot path.

use std::path::PathBuf;

use http_body_util::{BodyExt, Full};
use hyper::{body::Bytes, header, Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::config::AdminAddr;

/// An admin request that did not get an answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connecting to haltd's admin API at {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{method} {path} at {addr}: {source}")]
    Http {
        method: Method,
        path: String,
        addr: String,
        #[source]
        source: hyper::Error,
    },
    #[error("building the request {method} {path}: {source}")]
    Request {
        method: Method,
        path: String,
        #[source]
        source: hyper::http::Error,
    },
    #[error("starting the client runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("reading the admin token file {path}: {reason}")]
    Token { path: PathBuf, reason: String },
}

/// Where the admin API is and how to authenticate to it.
#[derive(Clone, Debug)]
pub struct AdminClient {
    addr: AdminAddr,
    token: Option<String>,
}

impl AdminClient {
    /// `addr`: `unix:PATH`, `IP:PORT` or `http://IP:PORT`; `token_file`: the bearer token a TCP
    /// admin listener needs.
    pub fn new(addr: &str, token_file: Option<&std::path::Path>) -> Result<Self, String> {
        let trimmed = addr
            .strip_prefix("http://")
            .unwrap_or(addr)
            .trim_end_matches('/');
        let addr: AdminAddr = trimmed.parse()?;
        let token = match token_file {
            None => None,
            Some(p) => Some(read_token(p).map_err(|e| e.to_string())?),
        };
        Ok(AdminClient { addr, token })
    }

    /// Sends one request; returns the status and the body as text.
    pub fn request(
        &self,
        method: Method,
        path: &str,
        json: Option<&serde_json::Value>,
    ) -> Result<(StatusCode, String), ClientError> {
        let req = self.build(method.clone(), path, json)?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(ClientError::Runtime)?;
        rt.block_on(async {
            let connect = |source| ClientError::Connect {
                addr: self.addr.to_string(),
                source,
            };
            let http = |source| ClientError::Http {
                method: method.clone(),
                path: path.to_owned(),
                addr: self.addr.to_string(),
                source,
            };
            match &self.addr {
                AdminAddr::Unix(p) => {
                    let io = tokio::net::UnixStream::connect(p).await.map_err(connect)?;
                    send(io, req).await.map_err(http)
                }
                AdminAddr::Tcp(a) => {
                    let io = tokio::net::TcpStream::connect(a).await.map_err(connect)?;
                    send(io, req).await.map_err(http)
                }
            }
        })
    }

    fn build(
        &self,
        method: Method,
        path: &str,
        json: Option<&serde_json::Value>,
    ) -> Result<Request<Full<Bytes>>, ClientError> {
        let host = match &self.addr {
            AdminAddr::Unix(_) => "localhost".to_owned(),
            AdminAddr::Tcp(a) => a.to_string(),
        };
        let body = json.map(|v| v.to_string()).unwrap_or_default();
        let mut b = Request::builder()
            .method(method.clone())
            .uri(path)
            .header(header::HOST, host)
            // Every admin request says JSON: the API refuses state changes that do not.
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(t) = &self.token {
            b = b.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        b.body(Full::new(Bytes::from(body)))
            .map_err(|source| ClientError::Request {
                method,
                path: path.to_owned(),
                source,
            })
    }
}

async fn send<S>(io: S, req: Request<Full<Bytes>>) -> Result<(StatusCode, String), hyper::Error>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    let driver = tokio::spawn(conn);
    let resp = sender.send_request(req).await?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    drop(sender);
    // The connection ends with the request; its result adds nothing to the answer.
    let _ = driver.await;
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

fn read_token(path: &std::path::Path) -> Result<String, ClientError> {
    let text = std::fs::read_to_string(path).map_err(|e| ClientError::Token {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    let token = text.trim();
    if token.is_empty() {
        return Err(ClientError::Token {
            path: path.to_owned(),
            reason: "the file is empty".into(),
        });
    }
    Ok(token.to_owned())
}
