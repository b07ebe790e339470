//! The built-in rules: what counts as a secret, as regexes (see [`builtin_rule_names`]).

use super::ExfilConfig;

/// Longest value a value-checked rule looks at: a longer run of value characters is judged on
/// its first `VALUE_MAX` bytes (so a long value is neither released undecided nor held without
/// bound).
pub(super) const VALUE_MAX: usize = 256;

/// Names of the built-in rules, in pattern order (matches decided by the same byte are reported
/// in this order, earlier start first). Examples (all in the tests):
///
/// | rule | matches (shortest complete match) | example |
/// |---|---|---|
/// | `private_key_block` | `-----BEGIN (<word> ){0,2}PRIVATE KEY( BLOCK)?-----`, up to two `Name: value` header lines, then 32 base64 chars (newlines may be JSON `\n` escapes) | `-----BEGIN RSA PRIVATE KEY-----\nMIIEow...` |
/// | `aws_access_key_id` | `\b(AKIA\|ASIA)[A-Z0-9]{16}\b` | `AKIAIOSFODNN7EXAMPLE` |
/// | `aws_secret_access_key` | `aws secret( access)?( key)?` (any case, joined by nothing, space, `_`, `.` or `-`), then `:`/`=`/`:=`/`=>`/` is `, then 40 of `[A-Za-z0-9/+]` | `AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY` |
/// | `gcp_service_account_key` | `"private_key": "-----BEGIN` or `"private_key_id": "<40 hex>"` | service-account JSON |
/// | `azure_storage_key` | `AccountKey=` / `SharedAccessKey=` then 40 base64 chars | connection strings |
/// | `github_token` | `gh[pousr]_` + 36 alnum, or `github_pat_` + 50 of `[A-Za-z0-9_]` | `ghp_` + 36 chars |
/// | `slack_token` | `xox[abpr]-` + 20 of `[A-Za-z0-9-]` | `xoxb-123456789012-...` |
/// | `stripe_live_key` | `(sk\|rk)_live_` + 20 alnum | `sk_live_...` |
/// | `openai_api_key` | `\bsk-` + a value of 32+ of `[A-Za-z0-9_-]` (value-checked) | `sk-proj-...` |
/// | `bearer_token` | `Bearer` + a value of 20+ of `[A-Za-z0-9._~+/=-]` (value-checked) | `Authorization: Bearer ...` |
/// | `basic_auth` | `Authorization: Basic` + 12 base64 chars | `Authorization: Basic dXNlcjpwYXNzd29yZA==` |
/// | `jwt` | `eyJ` + 8..200 base64url, `.`, `e[wy]` + 8 base64url | `eyJhbGciOi...eyJzdWIi...` |
/// | `keyword_entropy` | a key word (password, passwd, pwd, passphrase, secret, token, api key, access key, account key, private key, signing key, credential(s)), up to 24 identifier chars, optional quote, `:`/`=`/`:=`/`=>`/` is `, optional quote, then a value of `entropy_min_len`+ of `[A-Za-z0-9+/=_!@#$%^&*~-]` (value-checked) | `password = "Xk9#mP2vR7qL4wZ8tN3s"` |
pub fn builtin_rule_names() -> impl Iterator<Item = &'static str> {
    builtin_rules(&ExfilConfig::default())
        .into_iter()
        .map(|(name, _, _)| name)
}

/// A value of `class` characters: at least `min`, ended by a non-class character or the end of
/// the turn; or exactly [`VALUE_MAX`] of them (a longer value is judged on its first bytes).
fn value(class: &str, min: usize) -> String {
    format!(
        "(?:(?P<value>[{class}]{{{min},{VALUE_MAX}}})(?:[^{class}]|$)|(?P<value_max>[{class}]{{{VALUE_MAX}}}))"
    )
}

/// Separator between a key word and its value: `:`, `=`, `:=`, `=>` (spaces allowed), or ` is `.
const SEP: &str = r"(?:[ \t]{0,4}(?::=|=>|[:=])[ \t]{0,4}|[ \t]{1,4}(?i-u:is)[ \t]{1,4})";

/// The built-in rules that begin with a letter and cannot start right after an ASCII letter:
/// only at the start of the turn or after any other byte (`_`, a digit, punctuation, a space).
/// A secret's key word or prefix is written after such a byte (`DB_PASSWORD=`, `"token":`,
/// `Bearer `), so this costs no match that matters, and it keeps the letters in the middle of a
/// word from starting candidates: a token that ends in `s`, `r`, `t`, `e` or `a` no longer holds
/// its last bytes back in case `sk_live_`, `rk_live_`, `token`, `eyJ` or `aws` follows (it did
/// for 61 % of the built-in model's tokens). The price: a key word glued to the letters before
/// it (`userPassword: ...`, `MYTOKEN=...`) is not a key word. (`aws_access_key_id` and
/// `openai_api_key` start with a word boundary of their own.) The scanner applies this as a
/// look-behind on the byte before a candidate's start; it is not part of the match.
pub(super) const STARTS_AFTER_NON_LETTER: [&str; 9] = [
    "aws_secret_access_key",
    "azure_storage_key",
    "github_token",
    "slack_token",
    "stripe_live_key",
    "bearer_token",
    "basic_auth",
    "jwt",
    "keyword_entropy",
];

/// (name, pattern, value-checked).
pub(super) fn builtin_rules(cfg: &ExfilConfig) -> Vec<(&'static str, String, bool)> {
    let nl = r"(?:(?-u:\s)|\\[nr])";
    vec![
        (
            "private_key_block",
            format!(
                r"-----BEGIN (?:[A-Z0-9]{{1,10}} ){{0,2}}PRIVATE KEY(?: BLOCK)?-----{nl}{{1,8}}(?:[A-Za-z-]{{1,32}}:[ -\[\]-~]{{1,80}}(?:\r?\n|\\r?\\n)){{0,2}}{nl}{{0,8}}[A-Za-z0-9+/=]{{32}}"
            ),
            false,
        ),
        (
            "aws_access_key_id",
            r"(?-u:\b)(?:AKIA|ASIA)[A-Z0-9]{16}(?-u:\b)".to_owned(),
            false,
        ),
        (
            "aws_secret_access_key",
            format!(
                r#"(?i-u:aws)[ _.-]?(?i-u:secret)(?:[ _.-]?(?i-u:access))?(?:[ _.-]?(?i-u:key))?["'`]?{SEP}["'`]?[A-Za-z0-9/+]{{40}}"#
            ),
            false,
        ),
        (
            "gcp_service_account_key",
            r#""private_key(?:_id)?"[ \t]{0,4}:[ \t]{0,4}"(?:-----BEGIN|[0-9a-f]{40})"#.to_owned(),
            false,
        ),
        (
            "azure_storage_key",
            r"(?i-u:AccountKey|SharedAccessKey)[ \t]{0,4}=[ \t]{0,4}[A-Za-z0-9+/]{40}".to_owned(),
            false,
        ),
        (
            "github_token",
            r"(?:gh[pousr]_[A-Za-z0-9]{36}|github_pat_[A-Za-z0-9_]{50})".to_owned(),
            false,
        ),
        (
            "slack_token",
            r"xox[abpr]-[A-Za-z0-9-]{20}".to_owned(),
            false,
        ),
        (
            "stripe_live_key",
            r"(?:sk|rk)_live_[A-Za-z0-9]{20}".to_owned(),
            false,
        ),
        (
            "openai_api_key",
            format!(r"(?-u:\b)sk-{}", value("A-Za-z0-9_-", 32)),
            true,
        ),
        (
            "bearer_token",
            format!(r"(?i-u:bearer)[ \t]{{1,4}}{}", value("A-Za-z0-9._~+/=-", 20)),
            true,
        ),
        (
            "basic_auth",
            r#"(?i-u:authorization)["']?[ \t]{0,4}[:=][ \t]{0,4}["']?(?i-u:basic)[ \t]{1,4}[A-Za-z0-9+/]{12}"#
                .to_owned(),
            false,
        ),
        (
            "jwt",
            r"eyJ[A-Za-z0-9_-]{8,200}\.e[wy][A-Za-z0-9_-]{8}".to_owned(),
            false,
        ),
        (
            "keyword_entropy",
            format!(
                r#"(?i-u:passw(?:or)?d|passphrase|pwd|secret|token|api[_-]?key|access[_-]?key|account[_-]?key|private[_-]?key|signing[_-]?key|credentials?)[A-Za-z0-9_.-]{{0,24}}["'`]?{SEP}["'`]?{}"#,
                value("A-Za-z0-9+/=_!@#$%^&*~-", cfg.entropy_min_len)
            ),
            true,
        ),
    ]
}
