//! Every path haltd answers on its data plane, and what it does with each: the routing table
//! (README's endpoint table and docs/wire-format.md, "Surfaces").
//!
//! A generating path is either governed (its tokens go through the detectors, the budget B
//! and the kernel gate, whatever the surface) or refused: nothing that produces tokens is
//! passed through. The paths passed through carry no tokens (the model list, embeddings).
//! Any other path under `/v1/` is refused with 404 `unsupported_endpoint`, so a client of a
//! surface haltd does not govern learns it at once instead of meeting a silent gap.

use crate::wire::endpoint::Endpoint;

/// What haltd does with a path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handling {
    /// A turn: every token governed, answered in the endpoint's schema.
    Governed(Endpoint),
    /// `GET /v1/models` and `/v1/models/{id}`: the backend's list (the built-in source: its
    /// one model). No tokens.
    Models,
    /// `POST /v1/embeddings`: relayed to the backend as it is. No tokens.
    Embeddings,
    /// `GET /healthz`, `/readyz`: answered by haltd.
    Health,
    /// Refused with 404 `unsupported_endpoint`, in the schema of `Endpoint`'s surface, with
    /// the reason.
    Refused(Endpoint, &'static str),
}

/// One row of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    /// The path; `/v1/models/{id}` stands for every path below `/v1/models/`.
    pub path: &'static str,
    /// The one method the path takes (405 with `allow` for another).
    pub method: &'static str,
    pub handling: Handling,
}

/// The routing table, in the order README lists it.
pub const ROUTES: &[Route] = &[
    Route {
        path: "/v1/chat/completions",
        method: "POST",
        handling: Handling::Governed(Endpoint::Chat),
    },
    Route {
        path: "/v1/completions",
        method: "POST",
        handling: Handling::Governed(Endpoint::Completion),
    },
    Route {
        path: "/v1/messages",
        method: "POST",
        handling: Handling::Governed(Endpoint::Messages),
    },
    Route {
        path: "/v1/messages/count_tokens",
        method: "POST",
        handling: Handling::Refused(
            Endpoint::Messages,
            "haltd does not count tokens for a backend; send the request to /v1/messages, whose usage reports input_tokens",
        ),
    },
    Route {
        path: "/v1/responses",
        method: "POST",
        handling: Handling::Governed(Endpoint::Responses),
    },
    Route {
        path: "/v1/models",
        method: "GET",
        handling: Handling::Models,
    },
    Route {
        path: "/v1/models/{id}",
        method: "GET",
        handling: Handling::Models,
    },
    Route {
        path: "/v1/embeddings",
        method: "POST",
        handling: Handling::Embeddings,
    },
    Route {
        path: "/healthz",
        method: "GET",
        handling: Handling::Health,
    },
    Route {
        path: "/readyz",
        method: "GET",
        handling: Handling::Health,
    },
];

/// Code of the 404 for a path under `/v1/` that haltd does not serve.
pub const UNSUPPORTED_ENDPOINT: &str = "unsupported_endpoint";

/// The row for `path` (without its query), if haltd serves it.
pub fn route(path: &str) -> Option<&'static Route> {
    // Every path below `/v1/models/` is that row (an empty or malformed id is its handler's
    // 400).
    let models_entry = path.starts_with("/v1/models/");
    ROUTES
        .iter()
        .find(|r| r.path == path || (models_entry && r.path == "/v1/models/{id}"))
}

/// Whether a path nobody serves is under `/v1/` (404 `unsupported_endpoint`, not `not_found`).
pub fn is_api_path(path: &str) -> bool {
    path.starts_with("/v1/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_path_has_one_row_and_generating_ones_are_governed_or_refused() {
        for (i, r) in ROUTES.iter().enumerate() {
            assert!(
                ROUTES[..i].iter().all(|o| o.path != r.path),
                "{} twice",
                r.path
            );
            assert_eq!(route(r.path.replace("{id}", "m").as_str()), Some(r));
        }
        assert_eq!(
            route("/v1/messages").map(|r| r.handling),
            Some(Handling::Governed(Endpoint::Messages))
        );
        assert_eq!(
            route("/v1/models/").map(|r| r.path),
            Some("/v1/models/{id}")
        );
        assert_eq!(
            route("/v1/responses").map(|r| r.handling),
            Some(Handling::Governed(Endpoint::Responses))
        );
        assert_eq!(route("/v1/responses/resp_1"), None);
        assert!(is_api_path("/v1/responses/resp_1") && !is_api_path("/admin"));
    }

    #[test]
    fn readme_and_the_wire_format_list_every_route() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
        let readme = std::fs::read_to_string(format!("{root}/README.md")).expect("README");
        let wire =
            std::fs::read_to_string(format!("{root}/docs/wire-format.md")).expect("wire format");
        for r in ROUTES {
            let cell = format!("`{} {}`", r.method, r.path);
            assert!(
                readme.contains(&cell),
                "README's endpoint table lacks {cell}"
            );
            assert!(wire.contains(&cell), "docs/wire-format.md lacks {cell}");
        }
        assert!(wire.contains(UNSUPPORTED_ENDPOINT));
    }
}
