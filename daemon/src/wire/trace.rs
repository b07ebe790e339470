//! Correlation headers: the client's `x-request-id` (accepted when it is well formed, else
//! replaced by one haltd generates) and the W3C `traceparent` (passed to the upstream only
//! when it has the W3C format). With them haltd's access log, records and response heads join
//! the gateway's and the backend's logs.
//!
//! A request id is echoed in the response head, so it must be a safe header value and a
//! bounded log field: 1 to [`MAX_REQUEST_ID_BYTES`] visible ASCII bytes.
//!
//! Upstream, haltd names each request with an id of its own, a v4 UUID, by default
//! (`--upstream-request-id`, [`UpstreamRequestId`]): backends check that header's shape
//! (llama-cpp-python answers 400 to an `x-request-id` that is not a UUID), and a client's id can
//! be anything. The client's own id, when it sent one, goes along as
//! `x-haltd-client-request-id` ([`upstream_correlation`]).

/// Longest `x-request-id` accepted from a client.
pub const MAX_REQUEST_ID_BYTES: usize = 128;

/// The client's `x-request-id` if haltd accepts it: 1 to 128 visible ASCII bytes (no space,
/// no control byte).
pub fn accept_request_id(value: &[u8]) -> Option<String> {
    let ok = !value.is_empty()
        && value.len() <= MAX_REQUEST_ID_BYTES
        && value.iter().all(u8::is_ascii_graphic);
    // Visible ASCII is UTF-8.
    ok.then(|| String::from_utf8_lossy(value).into_owned())
}

/// A new request id: 32 lowercase hex digits of randomness (the shape of a W3C trace id).
pub fn generate_request_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// What haltd sends upstream as `x-request-id` (`--upstream-request-id`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum UpstreamRequestId {
    /// A v4 UUID haltd makes for each upstream request; the client's id, if it sent one, as
    /// `x-haltd-client-request-id`.
    #[default]
    Uuid,
    /// The request's id as the access log has it (the client's, or one haltd generated), as
    /// before issue 29; a backend that checks the header's shape may refuse it.
    Client,
    /// No `x-request-id` (the client's id, if any, still as `x-haltd-client-request-id`).
    Off,
}

/// The header fields haltd adds to an upstream request for correlation (`--upstream-request-id`
/// `mode`): `x-haltd-stream-id`, `x-request-id` (`mode`'s), `x-haltd-client-request-id` (the
/// client's id, if the client sent one; not under `client`, where it is `x-request-id`
/// already), `traceparent` (well-formed only). `request_id` is the request's id as the access
/// log has it, `from_client` whether the client sent it. One allocation per upstream request.
pub fn upstream_correlation(
    mode: UpstreamRequestId,
    stream_id: &str,
    (request_id, from_client): (Option<&str>, bool),
    traceparent: Option<&str>,
) -> Vec<(&'static str, String)> {
    let mut fields = vec![("x-haltd-stream-id", stream_id.to_owned())];
    match mode {
        UpstreamRequestId::Uuid => {
            fields.push(("x-request-id", uuid::Uuid::new_v4().to_string()));
        }
        UpstreamRequestId::Client => {
            if let Some(rid) = request_id {
                fields.push(("x-request-id", rid.to_owned()));
            }
        }
        UpstreamRequestId::Off => {}
    }
    if let (Some(rid), true, false) = (request_id, from_client, mode == UpstreamRequestId::Client) {
        fields.push(("x-haltd-client-request-id", rid.to_owned()));
    }
    if let Some(tp) = traceparent {
        fields.push(("traceparent", tp.to_owned()));
    }
    fields
}

/// The `traceparent` value if it has the W3C Trace Context format (level 1): `VV-TTTT-PPPP-FF`
/// with a 2-digit version other than `ff`, a 32-digit trace id and a 16-digit parent id that
/// are not all zero, 2-digit flags, all lowercase hex. Version `00` is exactly that long; a
/// later version may append `-` and more, which is passed on as it is.
pub fn accept_traceparent(value: &[u8]) -> Option<String> {
    const LEN: usize = 55;
    let hex = |b: &[u8]| b.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'));
    let zero = |b: &[u8]| b.iter().all(|&c| c == b'0');
    if value.len() < LEN {
        return None;
    }
    let (version, trace, parent, flags) =
        (&value[0..2], &value[3..35], &value[36..52], &value[53..55]);
    let dashes = value[2] == b'-' && value[35] == b'-' && value[52] == b'-';
    let fields = hex(version) && hex(trace) && hex(parent) && hex(flags);
    let tail_ok = match version {
        b"00" => value.len() == LEN,
        _ => {
            value.len() == LEN
                || (value[LEN] == b'-' && value[LEN..].iter().all(u8::is_ascii_graphic))
        }
    };
    let ok = dashes && fields && version != b"ff" && !zero(trace) && !zero(parent) && tail_ok;
    ok.then(|| String::from_utf8_lossy(value).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(fields: &[(&'static str, String)]) -> Vec<&'static str> {
        fields.iter().map(|(n, _)| *n).collect()
    }

    #[test]
    fn the_upstream_gets_a_uuid_and_the_clients_id_apart() {
        let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let f = upstream_correlation(
            UpstreamRequestId::Uuid,
            "hs_1",
            (Some("req-1"), true),
            Some(tp),
        );
        assert_eq!(
            names(&f),
            [
                "x-haltd-stream-id",
                "x-request-id",
                "x-haltd-client-request-id",
                "traceparent"
            ]
        );
        let id = uuid::Uuid::parse_str(&f[1].1).expect("a UUID");
        assert_eq!(id.get_version_num(), 4);
        assert_eq!(f[1].1.len(), 36, "hyphenated: {}", f[1].1);
        assert_eq!(f[2].1, "req-1");
        // Another request, another id.
        let g = upstream_correlation(UpstreamRequestId::Uuid, "hs_1", (None, false), None);
        assert_ne!(g[1].1, f[1].1);
        assert_eq!(names(&g), ["x-haltd-stream-id", "x-request-id"]);
    }

    #[test]
    fn client_mode_forwards_the_id_and_off_sends_none() {
        let f = upstream_correlation(
            UpstreamRequestId::Client,
            "hs_1",
            (Some("req-1"), true),
            None,
        );
        assert_eq!(names(&f), ["x-haltd-stream-id", "x-request-id"]);
        assert_eq!(f[1].1, "req-1");
        // A generated id (the client sent none) is the request's id too.
        let f = upstream_correlation(
            UpstreamRequestId::Client,
            "hs_1",
            (Some("abc"), false),
            None,
        );
        assert_eq!(f[1].1, "abc");
        let f = upstream_correlation(UpstreamRequestId::Off, "hs_1", (Some("req-1"), true), None);
        assert_eq!(
            names(&f),
            ["x-haltd-stream-id", "x-haltd-client-request-id"]
        );
        let f = upstream_correlation(UpstreamRequestId::Off, "hs_1", (Some("gen"), false), None);
        assert_eq!(names(&f), ["x-haltd-stream-id"]);
    }

    #[test]
    fn request_ids_are_bounded_visible_ascii() {
        assert_eq!(
            accept_request_id(b"req-1:abc/DEF").as_deref(),
            Some("req-1:abc/DEF")
        );
        assert_eq!(
            accept_request_id(&[b'a'; MAX_REQUEST_ID_BYTES]).map(|s| s.len()),
            Some(MAX_REQUEST_ID_BYTES)
        );
        for bad in [
            &b""[..],
            &[b'a'; MAX_REQUEST_ID_BYTES + 1][..],
            b"has space",
            b"tab\there",
            b"new\r\nline",
            "caf\u{e9}".as_bytes(),
            b"nul\0",
        ] {
            assert_eq!(accept_request_id(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn generated_ids_are_distinct_and_acceptable() {
        let (a, b) = (generate_request_id(), generate_request_id());
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
        assert_eq!(accept_request_id(a.as_bytes()), Some(a));
    }

    #[test]
    fn traceparent_follows_the_w3c_format() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(accept_traceparent(good.as_bytes()).as_deref(), Some(good));
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra";
        assert_eq!(accept_traceparent(later.as_bytes()).as_deref(), Some(later));
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\nx: y",
        ] {
            assert_eq!(accept_traceparent(bad.as_bytes()), None, "{bad:?}");
        }
    }
}
