//! What SafetyCheck reads from a turn, and the helpers the data plane calls for it: URLs in
//! text and in a request's messages, their normal form and digest, the system prompt, the
//! model's identity digest.

use std::collections::BTreeSet;

use serde_json::Value;
use sha2::{Digest, Sha256};

/// Characters that end a URL in running text (besides whitespace and control characters).
fn ends_url(c: char) -> bool {
    matches!(
        c,
        '<' | '>'
            | '"'
            | '\''
            | '`'
            | '{'
            | '}'
            | '|'
            | '\\'
            | '^'
            | '“'
            | '”'
            | '‘'
            | '’'
            | '«'
            | '»'
            | '‹'
            | '›'
            | '「'
            | '」'
            | '『'
            | '』'
            | '（'
            | '）'
            | '【'
            | '】'
            | '。'
            | '，'
            | '、'
            | '；'
            | '：'
            | '！'
            | '？'
    ) || c.is_whitespace()
        || c.is_control()
}

/// Length of the `http://` or `https://` scheme at the start of `s` (ASCII case-insensitive).
pub(super) fn scheme_len(s: &str) -> Option<usize> {
    let b = s.as_bytes();
    let has = |p: &str| b.len() >= p.len() && b[..p.len()].eq_ignore_ascii_case(p.as_bytes());
    if has("https://") {
        Some(8)
    } else if has("http://") {
        Some(7)
    } else {
        None
    }
}

/// Trims what running text puts after a URL: `. , ; : ! ? * _ ~`, and a closing `)` or `]`
/// that has no opening partner inside the URL (`(see https://a.b/c).` → `https://a.b/c`, but
/// `https://en.wikipedia.org/wiki/Rust_(language)` stays whole).
fn trim_url_end(url: &str) -> &str {
    let mut url = url;
    loop {
        let Some(last) = url.chars().next_back() else {
            return url;
        };
        let trim = match last {
            '.' | ',' | ';' | ':' | '!' | '?' | '*' | '_' | '~' => true,
            ')' => url.matches(')').count() > url.matches('(').count(),
            ']' => url.matches(']').count() > url.matches('[').count(),
            _ => false,
        };
        if !trim {
            return url;
        }
        url = &url[..url.len() - last.len_utf8()];
    }
}

/// The `http`/`https` URLs in `text`, as written (trailing punctuation trimmed), deduplicated.
///
/// A URL starts at `http://` or `https://` (any case) not preceded by a letter or digit and
/// needs a host after the scheme. It ends at whitespace, a control character, one of
/// `` < > " ' ` { } | \ ^ ``, typographic quotes and CJK punctuation, a `[` or `]` outside an
/// IPv6 host, or a `,`/`;` directly followed by another `http(s)://` (a list of URLs without
/// spaces). Then trailing `. , ; : ! ? * _ ~` and unbalanced `)`/`]` are trimmed, so markdown
/// links `[x](https://a.b/c)` and prose `(https://a.b/c).` give `https://a.b/c`.
pub fn extract_urls(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        // `h` is ASCII, so `i` is a char boundary whenever it matches.
        if !matches!(bytes[i], b'h' | b'H') || (i > 0 && bytes[i - 1].is_ascii_alphanumeric()) {
            i += 1;
            continue;
        }
        let Some(slen) = scheme_len(&text[i..]) else {
            i += 1;
            continue;
        };
        let start = i;
        let host_at = start + slen;
        let mut end = host_at;
        let mut in_ipv6 = false;
        for (off, c) in text[host_at..].char_indices() {
            let at = host_at + off;
            let stop = match c {
                _ if ends_url(c) => true,
                '[' if at == host_at => {
                    in_ipv6 = true;
                    false
                }
                ']' if in_ipv6 => {
                    in_ipv6 = false;
                    false
                }
                '[' | ']' => true,
                // A list of URLs without spaces: `https://a.b,https://c.d`.
                ',' | ';' => scheme_len(&text[at + 1..]).is_some(),
                _ => false,
            };
            if stop {
                break;
            }
            end = at + c.len_utf8();
        }
        let url = trim_url_end(&text[start..end]);
        // A host must follow the scheme.
        if url
            .get(slen..)
            .unwrap_or_default()
            .chars()
            .next()
            .is_some_and(|c| c.is_alphanumeric() || c == '[')
        {
            out.insert(url.to_owned());
            i = start + url.len();
        } else {
            i = host_at;
        }
    }
    out
}

/// The comparison form of a URL for `no_fabricated_source`: scheme and host lowercased, the
/// default port (`:80` for http, `:443` for https) dropped, the fragment dropped, trailing
/// slashes of the path and an empty query (`?`) dropped. User info, path and query keep their
/// case and encoding. A string without `://` is only trimmed.
pub fn normalize_url(url: &str) -> String {
    let url = url.trim();
    let Some(sep) = url.find("://") else {
        return url.to_owned();
    };
    let scheme = url[..sep].to_ascii_lowercase();
    let rest = &url[sep + 3..];
    let rest = rest.split_once('#').map_or(rest, |(r, _)| r);
    let auth_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(auth_end);
    let (userinfo, hostport) = match authority.rfind('@') {
        Some(at) => authority.split_at(at + 1),
        None => ("", authority),
    };
    let mut hostport = hostport.to_lowercase();
    let default_port = match scheme.as_str() {
        "http" => Some(":80"),
        "https" => Some(":443"),
        _ => None,
    };
    if let Some(port) = default_port {
        while let Some(h) = hostport.strip_suffix(port) {
            hostport = h.to_owned();
        }
    }
    let (path, query) = match tail.find('?') {
        Some(q) => tail.split_at(q),
        None => (tail, ""),
    };
    let path = path.trim_end_matches('/');
    let query = if query == "?" { "" } else { query };
    format!("{scheme}://{userinfo}{hostport}{path}{query}")
}

/// First 16 hex digits of the SHA-256 of [`normalize_url`]`(url)`: how evidence names a URL
/// without putting output text into the flight recorder.
pub fn url_digest(url: &str) -> String {
    let digest = Sha256::digest(normalize_url(url).as_bytes());
    hex::encode(&digest[..8])
}

/// URLs as `no_fabricated_source` compares them: the set of their [`url_digest`]s (equal
/// digests, equal [`normalize_url`] forms). The record keeps these, never the URLs.
pub type UrlKeys = BTreeSet<String>;

/// The [`UrlKeys`] of `urls`.
pub fn url_keys<I, S>(urls: I) -> UrlKeys
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    urls.into_iter().map(|u| url_digest(u.as_ref())).collect()
}

/// Whether `key` has the form of a [`url_digest`]: 16 lower-case hex digits.
pub fn is_url_key(key: &str) -> bool {
    key.len() == 16 && key.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Most nesting levels of `sources`/`documents` searched for URLs.
const MAX_SOURCE_DEPTH: usize = 8;

fn urls_in_content(content: &Value, out: &mut BTreeSet<String>) {
    match content {
        Value::String(s) => out.extend(extract_urls(s)),
        Value::Array(parts) => {
            for part in parts {
                match part {
                    Value::String(s) => out.extend(extract_urls(s)),
                    _ => {
                        if let Some(s) = part.get("text").and_then(Value::as_str) {
                            out.extend(extract_urls(s));
                        }
                    }
                }
            }
        }
        _ => {}
    }
}

fn urls_in_strings(v: &Value, depth: usize, out: &mut BTreeSet<String>) {
    if depth > MAX_SOURCE_DEPTH {
        return;
    }
    match v {
        Value::String(s) => out.extend(extract_urls(s)),
        Value::Array(items) => {
            for item in items {
                urls_in_strings(item, depth + 1, out);
            }
        }
        Value::Object(map) => {
            for item in map.values() {
                urls_in_strings(item, depth + 1, out);
            }
        }
        _ => {}
    }
}

/// The URLs a request body gives the model as sources, as written:
///
/// * chat completions: every message's `content` (a string, or parts with `text`), except
///   `assistant` messages (earlier outputs are not sources: a URL the model made up in one
///   turn must not become a "source" in the next);
/// * completions: `prompt` (a string or an array of strings; token arrays have no text);
/// * both: the optional top-level `sources` (haltd's field: an array of URL strings) and
///   `documents` (the RAG field vLLM and others pass to chat templates), searched for URLs in
///   every string they contain. Entries without an `http(s)://` URL add nothing.
pub fn request_sources(body: &Value) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        for m in messages {
            if m.get("role").and_then(Value::as_str) == Some("assistant") {
                continue;
            }
            if let Some(content) = m.get("content") {
                urls_in_content(content, &mut out);
            }
        }
    }
    match body.get("prompt") {
        Some(Value::String(s)) => out.extend(extract_urls(s)),
        Some(Value::Array(items)) => {
            for s in items.iter().filter_map(Value::as_str) {
                out.extend(extract_urls(s));
            }
        }
        _ => {}
    }
    for key in ["sources", "documents"] {
        if let Some(v) = body.get(key) {
            urls_in_strings(v, 0, &mut out);
        }
    }
    out
}

/// The system prompt of a chat request: the text of its `system` and `developer` messages,
/// joined with `\n` (empty for completions and chats without one).
pub fn system_prompt(body: &Value) -> String {
    let Some(messages) = body.get("messages").and_then(Value::as_array) else {
        return String::new();
    };
    messages
        .iter()
        .filter(|m| {
            matches!(
                m.get("role").and_then(Value::as_str),
                Some("system" | "developer")
            )
        })
        .filter_map(|m| m.get("content"))
        .map(|c| match c {
            Value::String(s) => s.clone(),
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p.as_str().or_else(|| p.get("text").and_then(Value::as_str)))
                .collect::<Vec<_>>()
                .join(" "),
            _ => String::new(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}
