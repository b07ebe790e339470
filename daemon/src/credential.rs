//! The one rule that decides what names a request's identity (docs/operations.md "Who a
//! request is"). Degraded mode and TokenCircuit's store are kept per identity, so two spellings
//! of one credential must be one identity, and two tenants must never be one.
//!
//! 1. `--identity-header NAME`, when configured and present: its value, compared exactly
//!    (case and inner whitespace count; HTTP's optional whitespace around a field value is not
//!    part of it, RFC 9110 §5.5), in its own namespace: no bearer token is ever the same
//!    identity as a header value, whatever their bytes.
//! 2. Else a bearer token: `Authorization: Bearer TOKEN` (the scheme's case folds, the token
//!    never does) or `x-api-key: TOKEN` (the Anthropic SDK's header), which are one identity.
//!    Both in one request must carry the same token.
//! 3. Else no credential: all such requests share one identity.
//!
//! Anything else that looks like a credential is refused with 400, never read as another
//! identity: an `Authorization` value without a scheme (`K`), another scheme (`Basic K`), a
//! token that is not one RFC 6750 `b64token` (a quoted `"K"`, two words), a second
//! `Authorization` or `x-api-key`. A query parameter (`?api_key=K`) is no credential at all:
//! haltd neither reads a query string for identity nor forwards it upstream.

/// What names a request's identity, by the rule above.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Credential<'a> {
    /// No credential.
    None,
    /// A bearer token, from `Authorization: Bearer` or `x-api-key`.
    Bearer(&'a str),
    /// The value of the header `--identity-header` names, exactly.
    Header(&'a str),
}

impl<'a> Credential<'a> {
    /// The credential of a request that carried `header` (the `--identity-header` value) and
    /// `bearer` (the token of `Authorization` or `x-api-key`).
    pub fn of(header: Option<&'a str>, bearer: Option<&'a str>) -> Self {
        match (header, bearer) {
            (Some(h), _) => Credential::Header(h),
            (None, Some(t)) => Credential::Bearer(t),
            (None, None) => Credential::None,
        }
    }

    /// The namespace the HMAC of the identity is domain-separated by, and the bytes after it.
    pub fn domain_and_bytes(&self) -> (&'static [u8], &'a [u8]) {
        match self {
            Credential::None => (b"none", b""),
            Credential::Bearer(t) => (b"bearer", t.as_bytes()),
            Credential::Header(v) => (b"header", v.as_bytes()),
        }
    }
}

/// Why a request's credential headers are refused (answered 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CredentialError {
    #[error("the authorization header needs a scheme and a token: `Authorization: Bearer TOKEN`")]
    NoScheme,
    #[error(
        "the authorization scheme {0:?} is not accepted: haltd takes `Authorization: Bearer TOKEN` \
         or `x-api-key: TOKEN`"
    )]
    Scheme(String),
    #[error(
        "the {0} token is not one RFC 6750 token (letters, digits and -._~+/, then any =): \
         quotes, spaces and other characters are refused"
    )]
    Token(&'static str),
    #[error("authorization and x-api-key carry different tokens: send one credential")]
    Conflict,
}

/// The longest scheme an error message repeats.
const MAX_SCHEME_IN_ERROR: usize = 32;

/// The token of an `Authorization` value (already free of surrounding whitespace).
pub fn bearer_of_authorization(value: &str) -> Result<&str, CredentialError> {
    let Some((scheme, token)) = value.split_once([' ', '\t']) else {
        return Err(CredentialError::NoScheme);
    };
    if !scheme.eq_ignore_ascii_case("bearer") {
        let shown = crate::wire::text::truncate_text(scheme, MAX_SCHEME_IN_ERROR);
        return Err(CredentialError::Scheme(shown.to_owned()));
    }
    let token = token.trim_matches([' ', '\t']);
    if !is_b64token(token) {
        return Err(CredentialError::Token("bearer"));
    }
    Ok(token)
}

/// The token of an `x-api-key` value (already free of surrounding whitespace).
pub fn api_key(value: &str) -> Result<&str, CredentialError> {
    if is_b64token(value) {
        Ok(value)
    } else {
        Err(CredentialError::Token("x-api-key"))
    }
}

/// The bearer token of a request: `authorization`'s and `api_key`'s, which must agree.
pub fn bearer<'a>(
    authorization: Option<&'a str>,
    api_key_value: Option<&'a str>,
) -> Result<Option<&'a str>, CredentialError> {
    let from_auth = authorization.map(bearer_of_authorization).transpose()?;
    let from_key = api_key_value.map(api_key).transpose()?;
    match (from_auth, from_key) {
        (Some(a), Some(k)) if a != k => Err(CredentialError::Conflict),
        (a, k) => Ok(a.or(k)),
    }
}

/// RFC 6750 §2.1 `b64token`: `1*( ALPHA / DIGIT / "-" / "." / "_" / "~" / "+" / "/" ) *"="`.
fn is_b64token(s: &str) -> bool {
    let body = s.trim_end_matches('=');
    !body.is_empty()
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~+/".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scheme_folds_and_the_token_never_does() {
        for v in [
            "Bearer sk-1",
            "bearer sk-1",
            "BEARER sk-1",
            "Bearer \t sk-1",
        ] {
            assert_eq!(bearer_of_authorization(v), Ok("sk-1"), "{v:?}");
        }
        assert_eq!(bearer_of_authorization("Bearer SK-1"), Ok("SK-1"));
        assert_eq!(bearer_of_authorization("Bearer abc+/=="), Ok("abc+/=="));
    }

    #[test]
    fn other_spellings_are_refused() {
        assert_eq!(bearer_of_authorization("K"), Err(CredentialError::NoScheme));
        assert_eq!(
            bearer_of_authorization("Basic K"),
            Err(CredentialError::Scheme("Basic".into()))
        );
        for v in ["Bearer \"K\"", "Bearer K extra", "Bearer =", "Bearer K=x"] {
            assert_eq!(
                bearer_of_authorization(v),
                Err(CredentialError::Token("bearer")),
                "{v:?}"
            );
        }
        let long = format!("{} K", "é".repeat(40));
        match bearer_of_authorization(&long) {
            Err(CredentialError::Scheme(s)) => assert!(s.len() <= MAX_SCHEME_IN_ERROR),
            other => panic!("{other:?}"),
        }
        assert_eq!(api_key("\"K\""), Err(CredentialError::Token("x-api-key")));
    }

    #[test]
    fn x_api_key_is_the_bearer_token_and_must_agree_with_authorization() {
        assert_eq!(bearer(None, Some("K")), Ok(Some("K")));
        assert_eq!(bearer(Some("Bearer K"), Some("K")), Ok(Some("K")));
        assert_eq!(
            bearer(Some("Bearer K"), Some("L")),
            Err(CredentialError::Conflict)
        );
        assert_eq!(bearer(None, None), Ok(None));
    }

    #[test]
    fn a_header_value_is_its_own_namespace() {
        let h = Credential::of(Some("K"), Some("K"));
        assert_eq!(h, Credential::Header("K"));
        assert_ne!(
            h.domain_and_bytes(),
            Credential::Bearer("K").domain_and_bytes()
        );
        assert_eq!(Credential::of(None, None), Credential::None);
    }
}
