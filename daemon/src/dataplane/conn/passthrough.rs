//! Requests haltd answers without a turn: `GET /v1/models` and `GET /v1/models/{id}` of a
//! proxied source, and `POST /v1/embeddings`.
//!
//! Neither produces tokens, so nothing here is governed: no detector, no halt budget, no
//! record. `/v1/models/{id}` is answered from the model list (the built-in model's, or the
//! upstream's `GET /v1/models`, which every OpenAI-compatible backend serves, unlike
//! `/v1/models/{id}` itself). `/v1/embeddings` is relayed to the upstream and its answer back,
//! status and body as they came, up to `MAX_PASSTHROUGH_BODY` (`upstream_io/exchange.rs`). The client's credential (or
//! `--upstream-api-key-file`) goes upstream as for a turn.

use std::io;

use serde_json::Value;

use crate::dataplane::upstream_io::{Purpose, UpstreamRequest};
use crate::dataplane::Step;
use crate::{
    config::SourceKind,
    source::builtin::MODEL_NAME,
    upstream,
    wire::{HttpError, RequestHead},
};

/// The upstream path of embeddings.
const EMBEDDINGS_PATH: &str = "/v1/embeddings";

/// The model id of a `/v1/models/{id}` path: 1 to 256 visible ASCII characters (slashes
/// included: Hugging Face ids such as `org/name` come unescaped).
pub(in crate::dataplane) fn model_id(path: &str) -> Option<Result<&str, HttpError>> {
    let id = path.strip_prefix("/v1/models/")?;
    if id.is_empty() || id.len() > 256 || !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Some(Err(HttpError::bad_request(
            "a model id is 1 to 256 visible ASCII characters",
        )));
    }
    Some(Ok(id))
}

/// The `404` OpenAI answers for a model it does not serve.
fn no_such_model(id: &str) -> HttpError {
    HttpError::new(
        404,
        "invalid_request_error",
        format!(
            "The model '{}' does not exist",
            id.chars().take(256).collect::<String>()
        ),
    )
    .with_code("model_not_found")
}

/// The model object for `id` in a `/v1/models` list, if the list has it.
fn find_model(list: &Value, id: &str) -> Option<Value> {
    list["data"]
        .as_array()?
        .iter()
        .find(|m| m["id"].as_str() == Some(id))
        .cloned()
}

impl Step<'_> {
    /// `GET /v1/models` with `--source openai`: relayed from the upstream.
    pub(in crate::dataplane) fn start_proxy_models(&mut self, head: RequestHead) -> io::Result<()> {
        let auth = head.authorization.as_ref().map(|a| a.as_str().to_owned());
        let req = UpstreamRequest {
            purpose: Purpose::Models,
            api_path: upstream::MODELS_PATH,
            method: "GET",
            authorization: auth.as_deref(),
            body: None,
        };
        self.open_upstream(&req, String::new())
    }

    /// `GET /v1/models/{id}`.
    pub(in crate::dataplane) fn start_model(
        &mut self,
        head: RequestHead,
        id: &str,
    ) -> io::Result<()> {
        if self.io.shared.cfg.args.source != SourceKind::Openai {
            if id != MODEL_NAME {
                return self.reply_error(&no_such_model(id));
            }
            let body = serde_json::json!({"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "haltd"});
            return self.reply(200, "application/json", body.to_string().as_bytes());
        }
        let auth = head.authorization.as_ref().map(|a| a.as_str().to_owned());
        let req = UpstreamRequest {
            purpose: Purpose::Model,
            api_path: upstream::MODELS_PATH,
            method: "GET",
            authorization: auth.as_deref(),
            body: None,
        };
        self.open_upstream(&req, String::new())?;
        if let Some(up) = self.conn.up.as_mut() {
            up.only_model = Some(id.into());
        }
        Ok(())
    }

    /// The upstream's `/v1/models` list arrived for a `GET /v1/models/{id}`.
    pub(in crate::dataplane) fn reply_model_from_list(&mut self, list: &[u8]) -> io::Result<()> {
        let id = self
            .conn
            .up
            .as_mut()
            .and_then(|up| up.only_model.take())
            .unwrap_or_default();
        let Ok(list) = serde_json::from_slice::<Value>(list) else {
            let e = HttpError::new(
                502,
                "upstream_error",
                "the upstream's /v1/models answer is not JSON",
            );
            return self.reply_error(&e);
        };
        match find_model(&list, &id) {
            Some(model) => self.reply(200, "application/json", model.to_string().as_bytes()),
            None => self.reply_error(&no_such_model(&id)),
        }
    }

    /// `POST /v1/embeddings`: relayed to the upstream as it came.
    pub(in crate::dataplane) fn start_embeddings(
        &mut self,
        head: RequestHead,
        body: &[u8],
    ) -> io::Result<()> {
        if self.io.shared.cfg.args.source != SourceKind::Openai {
            let e = HttpError::new(
                404,
                "invalid_request_error",
                "the built-in source serves no embeddings model: run with --source openai to \
                 pass /v1/embeddings to the upstream",
            )
            .with_code("model_not_found");
            return self.reply_error(&e);
        }
        let auth = head.authorization.as_ref().map(|a| a.as_str().to_owned());
        let req = UpstreamRequest {
            purpose: Purpose::Passthrough,
            api_path: EMBEDDINGS_PATH,
            method: "POST",
            authorization: auth.as_deref(),
            body: Some(body),
        };
        self.open_upstream(&req, String::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_ids_come_from_the_path_whole() {
        assert!(model_id("/v1/models").is_none());
        assert_eq!(
            model_id("/v1/models/meta-llama/Llama-3.1-8B").map(|r| r.ok()),
            Some(Some("meta-llama/Llama-3.1-8B"))
        );
        assert!(matches!(model_id("/v1/models/"), Some(Err(_))));
        assert!(matches!(model_id("/v1/models/a b"), Some(Err(_))));
        assert!(matches!(
            model_id(&format!("/v1/models/{}", "m".repeat(257))),
            Some(Err(_))
        ));
    }

    #[test]
    fn a_model_is_found_in_the_list_by_its_id() {
        let list = serde_json::json!({"object": "list", "data": [
            {"id": "a", "object": "model"}, {"id": "org/b", "object": "model", "owned_by": "x"}]});
        assert_eq!(find_model(&list, "org/b").expect("found")["owned_by"], "x");
        assert!(find_model(&list, "c").is_none());
        assert!(find_model(&serde_json::json!({"data": 3}), "a").is_none());
    }

    #[test]
    fn an_unknown_model_is_openai_s_404() {
        let e = no_such_model("gpt-9");
        assert_eq!(e.status, 404);
        assert!(
            e.message.contains("'gpt-9' does not exist"),
            "{}",
            e.message
        );
    }
}
