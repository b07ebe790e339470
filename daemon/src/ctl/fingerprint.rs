//! `haltctl key fingerprint`: the fingerprint haltd gives a credential (records, `haltctl
//! mode`, `--scope key:<fingerprint>`), computed from the credential read on standard input
//! and the node secret in the state directory, so an operator can find a client's records
//! without haltd ever logging a key.

use std::path::Path;

use crate::{
    credential::{self, Credential},
    identity::NodeSecret,
    modes::KeyId,
};

/// What the line on standard input is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Input {
    /// An API key: the token, or a whole `Bearer TOKEN` value.
    Bearer,
    /// The value of `--identity-header`.
    Header,
}

/// The fingerprint of `line` (its surrounding whitespace and newline are not part of it)
/// under the node secret of `state_dir`.
pub fn fingerprint(state_dir: &Path, input: Input, line: &str) -> Result<String, String> {
    let value = line.trim_matches([' ', '\t', '\r', '\n']);
    if value.is_empty() {
        return Err("standard input holds no key".to_owned());
    }
    let secret = NodeSecret::read(state_dir).map_err(|e| {
        format!(
            "the node secret: {e} (run as the user haltd runs as, or give --state-dir or --config)"
        )
    })?;
    let credential = match input {
        Input::Header => Credential::Header(value),
        Input::Bearer => {
            let looks_like_authorization = value
                .split_once([' ', '\t'])
                .is_some_and(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"));
            let token = if looks_like_authorization {
                credential::bearer_of_authorization(value)
            } else {
                credential::api_key(value)
            }
            .map_err(|e| e.to_string())?;
            Credential::Bearer(token)
        }
    };
    Ok(KeyId::of(&secret, credential).fingerprint())
}
