//! Who is calling the admin API, and whether they may.
//!
//! - On the Unix socket the file's mode and group decide who can connect; the kernel's peer
//!   credentials (SO_PEERCRED) name the caller, and every action's ledger record carries them.
//! - On TCP every request needs `Authorization: Bearer <token>`, the token of
//!   `--admin-token-file`, compared in constant time.
//! - A request with a body (anything but GET and HEAD) must say `content-type:
//!   application/json`: a browser's cross-site form post cannot, so a web page cannot drive
//!   the API even where it can reach it.

use std::{net::SocketAddr, sync::Arc};

use axum::{
    extract::{connect_info::Connected, ConnectInfo, Request, State},
    http::{header, Method, StatusCode},
    middleware::Next,
    response::{IntoResponse, Response},
    serve::IncomingStream,
};
use serde::Serialize;

use crate::config::AdminToken;

/// The caller of one admin request, as its ledger record names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "transport", rename_all = "snake_case")]
pub enum AdminActor {
    /// A process on the admin socket, by its kernel credentials.
    Unix {
        uid: u32,
        gid: u32,
        pid: Option<i32>,
    },
    /// A TCP client that presented the admin token.
    Tcp { peer: SocketAddr },
}

impl Connected<IncomingStream<'_, tokio::net::UnixListener>> for AdminActor {
    fn connect_info(stream: IncomingStream<'_, tokio::net::UnixListener>) -> Self {
        match stream.io().peer_cred() {
            Ok(c) => AdminActor::Unix {
                uid: c.uid(),
                gid: c.gid(),
                pid: c.pid(),
            },
            // Cannot happen on Linux for a connected socket; name nobody rather than fail.
            Err(_) => AdminActor::Unix {
                uid: u32::MAX,
                gid: u32::MAX,
                pid: None,
            },
        }
    }
}

impl Connected<IncomingStream<'_, tokio::net::TcpListener>> for AdminActor {
    fn connect_info(stream: IncomingStream<'_, tokio::net::TcpListener>) -> Self {
        AdminActor::Tcp {
            peer: *stream.remote_addr(),
        }
    }
}

/// What the middleware needs: the token, if the listener is TCP.
#[derive(Clone)]
pub struct Guard {
    pub token: Option<Arc<AdminToken>>,
}

fn refuse(status: StatusCode, kind: &str, message: &str) -> Response {
    let body = axum::Json(serde_json::json!({"error": {"type": kind, "message": message}}));
    let mut resp = (status, body).into_response();
    if status == StatusCode::UNAUTHORIZED {
        resp.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
    }
    resp
}

/// Checks the caller, then the content type; puts the [`AdminActor`] into the request.
pub async fn guard(
    State(guard): State<Guard>,
    ConnectInfo(actor): ConnectInfo<AdminActor>,
    mut req: Request,
    next: Next,
) -> Response {
    if let AdminActor::Tcp { .. } = actor {
        let Some(token) = guard.token.as_deref() else {
            // The config refuses a TCP admin listener without a token; fail closed anyway.
            return refuse(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "no admin token is configured",
            );
        };
        let presented = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer);
        if !presented.is_some_and(|p| token.matches(p.as_bytes())) {
            return refuse(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "the admin API on TCP needs Authorization: Bearer <the token of --admin-token-file>",
            );
        }
    }
    if !matches!(*req.method(), Method::GET | Method::HEAD) && !is_json(&req) {
        return refuse(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "admin requests that change state must have content-type: application/json",
        );
    }
    req.extensions_mut().insert(actor);
    next.run(req).await
}

/// The credentials of a `Bearer` authorization (scheme case-insensitive).
fn bearer(value: &str) -> Option<&str> {
    let (scheme, rest) = value.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
}

fn is_json(req: &Request) -> bool {
    req.headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer  abc "), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearer"), None);
    }
}
