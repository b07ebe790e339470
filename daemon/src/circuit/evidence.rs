//! Evidence from a tool result: what its content says about the call's outcome.
//!
//! A tool result reaches haltd as the `content` of a `role: "tool"` message: JSON from an
//! HTTP tool, a Python exception, a shell error, plain text. haltd reads only what the
//! content carries, never the model's opinion of it:
//! * an HTTP status (`status`, `status_code`, `statusCode`, `http_status` fields; `HTTP
//!   503`, `status 403`, `error 404` in text);
//! * error codes and exception names (in the error fields of JSON, or anywhere in text),
//!   matched against fixed vocabularies ([`Signal`]);
//! * `Retry-After` (a `retry_after`/`retryAfter`/`Retry-After` field, or the header in
//!   text), in seconds;
//! * timeouts and lost connections (as signals, or a `timed_out`/`timeout: true` field);
//! * empty results (empty content, `null`, `[]`, `{}`, or `results`/`rows`/`items`/
//!   `data`/`records`/`hits`/`matches` being an empty list);
//! * content that starts like JSON but does not parse: a truncated, unparseable reply.

use std::time::Duration;

use serde_json::Value;

/// A recognized error signal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Signal {
    Permission,
    Validation,
    NotFound,
    Timeout,
    ConnectionLost,
    RateLimited,
    Unavailable,
    Invariant,
    /// JSON-looking content that does not parse.
    Unparseable,
}

/// Phrases (lowercase) that name a signal in an error string or exception name.
const VOCABULARY: &[(Signal, &[&str])] = &[
    (
        Signal::Invariant,
        &[
            "invariant",
            "assertionerror",
            "assertion failed",
            "integrityerror",
            "constraint violation",
            "corrupt",
        ],
    ),
    (
        Signal::Permission,
        &[
            "permission denied",
            "permissionerror",
            "permission_denied",
            "forbidden",
            "unauthorized",
            "unauthenticated",
            "access denied",
            "accessdenied",
            "not authorized",
            "insufficient scope",
            "insufficient_scope",
            "insufficient privilege",
            "eacces",
            "authenticationerror",
        ],
    ),
    (
        Signal::Validation,
        &[
            "validationerror",
            "validation error",
            "valueerror",
            "typeerror",
            "invalid argument",
            "invalid_argument",
            "invalid parameter",
            "invalid input",
            "bad request",
            "malformed",
            "syntax error",
            "jsondecodeerror",
            "missing required",
            "unprocessable",
        ],
    ),
    (
        Signal::NotFound,
        &[
            "not found",
            "notfound",
            "not_found",
            "no such",
            "filenotfounderror",
            "keyerror",
            "does not exist",
            "doesn't exist",
            "enoent",
            "nosuchkey",
        ],
    ),
    (
        Signal::Timeout,
        &[
            "timed out",
            "timeout",
            "deadline exceeded",
            "deadline_exceeded",
            "etimedout",
        ],
    ),
    (
        Signal::ConnectionLost,
        &[
            "connection reset",
            "connectionreseterror",
            "connection aborted",
            "connectionabortederror",
            "broken pipe",
            "econnreset",
            "remote end closed",
            "remotedisconnected",
            "unexpected eof",
        ],
    ),
    (
        Signal::RateLimited,
        &[
            "rate limit",
            "ratelimit",
            "rate_limit",
            "too many requests",
            "throttl",
        ],
    ),
    (
        Signal::Unavailable,
        &[
            "service unavailable",
            "temporarily unavailable",
            "unavailable",
            "overloaded",
            "bad gateway",
            "internal server error",
            "try again",
        ],
    ),
];

/// Words that mark a text as an error report even when no signal is recognized.
const ERROR_MARKERS: &[&str] = &["error", "exception", "traceback", "failed", "failure"];

/// JSON fields that carry an HTTP status.
const STATUS_FIELDS: &[&str] = &["status", "status_code", "statusCode", "http_status", "code"];
/// JSON fields whose text names an error.
const ERROR_FIELDS: &[&str] = &[
    "error",
    "errors",
    "error_code",
    "errorCode",
    "code",
    "type",
    "exception",
    "name",
    "reason",
    "message",
    "detail",
    "title",
    "errorType",
];
const RETRY_AFTER_FIELDS: &[&str] = &["retry_after", "retryAfter", "Retry-After", "retry-after"];
const RESULT_LIST_FIELDS: &[&str] = &[
    "results", "rows", "items", "data", "records", "hits", "matches",
];

/// What a tool result carries.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Evidence {
    pub http_status: Option<u16>,
    /// Recognized signals, sorted, without duplicates.
    pub signals: Vec<Signal>,
    pub retry_after: Option<Duration>,
    /// The result is empty (no rows, no content).
    pub empty: bool,
    /// Something marks the result as an error (an `error` field, `ok: false`, an error word
    /// in text) even if no signal names it.
    pub error_marker: bool,
    /// Signals found in JSON fields outside an error (`message`, `code`, `detail`): they
    /// count only when the result is otherwise marked as an error, so a successful result
    /// whose message says "try again" is not a failure.
    soft: Vec<Signal>,
}

impl Evidence {
    /// Reads a tool result's content.
    pub fn read(content: &str) -> Evidence {
        let trimmed = content.trim();
        let mut ev = Evidence::default();
        match serde_json::from_str::<Value>(trimmed) {
            Ok(value) => ev.read_json(&value, 0),
            Err(_) if trimmed.starts_with('{') || trimmed.starts_with('[') => {
                ev.signals.push(Signal::Unparseable);
                ev.read_text(trimmed);
            }
            Err(_) => ev.read_text(trimmed),
        }
        ev.empty = ev.empty || trimmed.is_empty();
        if ev.error_marker || ev.http_status.is_some_and(|s| s >= 400) {
            ev.signals.append(&mut ev.soft);
        }
        ev.soft.clear();
        ev.signals.sort();
        ev.signals.dedup();
        ev
    }

    /// An error status, a signal or an error marker: the call failed.
    pub fn is_failure(&self) -> bool {
        self.http_status.is_some_and(|s| s >= 400) || !self.signals.is_empty() || self.error_marker
    }

    pub fn has(&self, signal: Signal) -> bool {
        self.signals.contains(&signal)
    }

    fn read_json(&mut self, value: &Value, depth: usize) {
        const MAX_DEPTH: usize = 4;
        match value {
            Value::Null => self.empty |= depth == 0,
            Value::Array(items) => {
                self.empty |= depth == 0 && items.is_empty();
            }
            Value::Object(map) => {
                self.empty |= depth == 0 && map.is_empty();
                for (key, v) in map {
                    self.read_field(key, v, depth);
                    if depth < MAX_DEPTH && v.is_object() {
                        self.read_json(v, depth + 1);
                    }
                }
            }
            Value::String(s) if depth == 0 => self.read_text(s),
            _ => {}
        }
    }

    fn read_field(&mut self, key: &str, v: &Value, depth: usize) {
        if STATUS_FIELDS.contains(&key) {
            if let Some(status) = v.as_u64().filter(|s| (100..600).contains(s)) {
                self.http_status.get_or_insert(status as u16);
            }
        }
        if ERROR_FIELDS.contains(&key) {
            self.read_error_value(key, v);
        }
        if RETRY_AFTER_FIELDS.contains(&key) {
            let secs = v
                .as_f64()
                .or_else(|| v.as_str().and_then(|s| s.trim().parse().ok()));
            if let Some(secs) = secs.filter(|s| s.is_finite() && *s >= 0.0) {
                self.retry_after = Some(Duration::from_secs_f64(secs.min(86_400.0)));
            }
        }
        match (key, v) {
            ("timed_out" | "timeout", Value::Bool(true)) => self.signals.push(Signal::Timeout),
            ("ok" | "success", Value::Bool(false)) => self.error_marker = true,
            (k, Value::Array(items)) if depth == 0 && RESULT_LIST_FIELDS.contains(&k) => {
                self.empty |= items.is_empty();
            }
            _ => {}
        }
    }

    fn read_error_value(&mut self, key: &str, v: &Value) {
        let is_error_key = matches!(key, "error" | "errors" | "exception" | "errorType");
        match v {
            Value::Null | Value::Bool(false) => {}
            Value::String(s) => {
                self.error_marker |= is_error_key;
                self.scan_signals(&s.to_lowercase(), !is_error_key);
            }
            Value::Array(items) => {
                self.error_marker |= is_error_key && !items.is_empty();
                for item in items.iter().filter_map(Value::as_str) {
                    self.scan_signals(&item.to_lowercase(), !is_error_key);
                }
            }
            _ => self.error_marker |= is_error_key,
        }
    }

    fn read_text(&mut self, text: &str) {
        let lower = text.to_lowercase();
        self.scan_signals(&lower, false);
        self.error_marker |= ERROR_MARKERS.iter().any(|m| lower.contains(m));
        let words: Vec<&str> = lower
            .split(|c: char| !c.is_ascii_alphanumeric() && c != '-')
            .filter(|w| !w.is_empty())
            .collect();
        for (i, word) in words.iter().enumerate() {
            let before = &words[i.saturating_sub(3)..i];
            let named = |names: &[&str]| before.iter().any(|w| names.contains(w));
            if let Ok(status) = word.parse::<u16>() {
                if (400..600).contains(&status) && named(&["http", "status", "code", "error"]) {
                    self.http_status.get_or_insert(status);
                }
            }
            let after_retry =
                i >= 1 && (words[i - 1] == "retry-after" || named(&["after"]) && named(&["retry"]));
            if after_retry {
                if let Ok(secs) = word.trim_end_matches('s').parse::<u64>() {
                    self.retry_after
                        .get_or_insert(Duration::from_secs(secs.min(86_400)));
                }
            }
        }
    }

    fn scan_signals(&mut self, lower: &str, soft: bool) {
        for (signal, phrases) in VOCABULARY {
            if phrases.iter().any(|p| lower.contains(p)) {
                if soft {
                    self.soft.push(*signal);
                } else {
                    self.signals.push(*signal);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_errors_give_status_signals_and_retry_after() {
        let ev = Evidence::read(
            r#"{"error": {"code": 503, "message": "Service Unavailable"}, "retry_after": 2}"#,
        );
        assert_eq!(ev.http_status, Some(503));
        assert_eq!(ev.signals, [Signal::Unavailable]);
        assert_eq!(ev.retry_after, Some(Duration::from_secs(2)));
        assert!(ev.is_failure());
    }

    #[test]
    fn text_errors_give_exception_names_and_status() {
        let ev = Evidence::read("Traceback (most recent call last):\nPermissionError: [Errno 13]");
        assert_eq!(ev.signals, [Signal::Permission]);
        let ev = Evidence::read("upstream said HTTP/1.1 429 Too Many Requests; Retry-After: 7");
        assert_eq!(ev.http_status, Some(429));
        assert!(ev.has(Signal::RateLimited));
        assert_eq!(ev.retry_after, Some(Duration::from_secs(7)));
    }

    #[test]
    fn empty_results_are_told_apart_from_errors() {
        for empty in ["", "  ", "[]", "{}", "null", r#"{"rows": [], "count": 0}"#] {
            let ev = Evidence::read(empty);
            assert!(ev.empty, "{empty:?}");
            assert!(!ev.is_failure(), "{empty:?}");
        }
        let ev = Evidence::read(r#"{"rows": [{"id": 1}]}"#);
        assert!(!ev.empty && !ev.is_failure());
        assert!(!Evidence::read("42 rows: alice, bob").is_failure());
    }

    #[test]
    fn truncated_json_is_unparseable() {
        let ev = Evidence::read(r#"{"order_id": "A1", "stat"#);
        assert_eq!(ev.signals, [Signal::Unparseable]);
        assert!(ev.is_failure());
    }

    #[test]
    fn a_message_of_a_successful_result_is_not_an_error() {
        let ev = Evidence::read(r#"{"id": 7, "message": "created; try again later for status"}"#);
        assert!(!ev.is_failure(), "{ev:?}");
        let ev = Evidence::read(r#"{"status": 404, "message": "order not found"}"#);
        assert_eq!(
            (ev.http_status, ev.signals),
            (Some(404), vec![Signal::NotFound])
        );
    }

    #[test]
    fn a_timeout_flag_and_ok_false_count() {
        assert!(Evidence::read(r#"{"timed_out": true}"#).has(Signal::Timeout));
        let ev = Evidence::read(r#"{"ok": false}"#);
        assert!(ev.error_marker && ev.signals.is_empty());
    }
}
