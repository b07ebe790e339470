use super::*;

fn ok(s: &str) -> UpstreamUrl {
    UpstreamUrl::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

#[test]
fn plain_host_port() {
    let u = ok("http://127.0.0.1:8000");
    assert_eq!(u.host, "127.0.0.1");
    assert_eq!(u.port, 8000);
    assert_eq!(u.base_path, "");
    assert_eq!(u.path_for("/v1/chat/completions"), "/v1/chat/completions");
    assert_eq!(u.host_header(), "127.0.0.1:8000");
    assert_eq!(u.to_string(), "http://127.0.0.1:8000");
}

#[test]
fn default_port_and_host_header() {
    let u = ok("http://Backend.Local");
    assert_eq!(u.host, "backend.local");
    assert_eq!(u.port, 80);
    assert_eq!(u.host_header(), "backend.local");
    let u = ok("HTTP://backend:80/");
    assert_eq!(u.port, 80);
    assert_eq!(u.base_path, "");
}

#[test]
fn openai_base_urls_drop_v1() {
    for s in [
        "http://vllm:8000/v1",
        "http://vllm:8000/v1/",
        "http://vllm:8000/v1//",
        "http://vllm:8000/",
        "  http://vllm:8000/v1\n",
    ] {
        let u = ok(s);
        assert_eq!(u.base_path, "", "{s}");
        assert_eq!(u.path_for("/v1/completions"), "/v1/completions");
    }
    let u = ok("http://gw:8080/ollama/v1/");
    assert_eq!(u.base_path, "/ollama");
    assert_eq!(
        u.path_for("/v1/chat/completions"),
        "/ollama/v1/chat/completions"
    );
    assert_eq!(u.path_for("v1/models"), "/ollama/v1/models");
    // Only a trailing /v1 is dropped.
    assert_eq!(ok("http://gw/v1/x").base_path, "/v1/x");
    assert_eq!(ok("http://gw/api/v10").base_path, "/api/v10");
}

#[test]
fn ipv6() {
    let u = ok("http://[::1]:8000/v1");
    assert_eq!(u.host, "::1");
    assert_eq!(u.port, 8000);
    assert_eq!(u.host_header(), "[::1]:8000");
    assert_eq!(u.to_string(), "http://[::1]:8000");
    let u = ok("http://[fe80::1]");
    assert_eq!(u.port, 80);
    assert_eq!(u.host_header(), "[fe80::1]");
    assert!(matches!(
        UpstreamUrl::parse("http://[::1"),
        Err(UrlError::InvalidHost { .. })
    ));
    assert!(matches!(
        UpstreamUrl::parse("http://[zz]:80"),
        Err(UrlError::InvalidHost { .. })
    ));
    assert!(matches!(
        UpstreamUrl::parse("http://[::1]8000"),
        Err(UrlError::InvalidHost { .. })
    ));
    // Unbracketed IPv6 splits at the first colon and fails on the port.
    assert!(matches!(
        UpstreamUrl::parse("http://::1:8000"),
        Err(UrlError::MissingHost | UrlError::InvalidPort { .. })
    ));
}

#[test]
fn https_is_tls_with_its_own_default_port() {
    let u = ok("https://API.example.com/v1");
    assert!(u.tls);
    assert_eq!(u.host, "api.example.com");
    assert_eq!(u.port, 443);
    assert_eq!(u.host_header(), "api.example.com");
    assert_eq!(u.to_string(), "https://api.example.com:443");
    let u = ok("HTTPS://10.0.0.1:8443/gw/v1");
    assert!(u.tls);
    assert_eq!(u.host_header(), "10.0.0.1:8443");
    assert_eq!(u.base_path, "/gw");
    // Port 80 is not https's default: it is named.
    assert_eq!(ok("https://h:80").host_header(), "h:80");
    assert_eq!(ok("http://h:443").host_header(), "h:443");
    assert!(!ok("http://h").tls);
    assert_eq!(ok("https://[::1]").port, 443);
}

type Check = fn(&UrlError) -> bool;

#[test]
fn refusals() {
    let cases: &[(&str, Check)] = &[
        ("", |e| matches!(e, UrlError::Empty)),
        ("   ", |e| matches!(e, UrlError::Empty)),
        ("localhost:8000", |e| {
            matches!(e, UrlError::UnsupportedScheme { .. })
        }),
        ("ftp://x", |e| {
            matches!(e, UrlError::UnsupportedScheme { .. })
        }),
        ("http://user:pw@host:8000", |e| {
            matches!(e, UrlError::Userinfo)
        }),
        ("http://host:8000/v1?key=1", |e| {
            matches!(e, UrlError::Query)
        }),
        ("http://host:8000/v1#x", |e| matches!(e, UrlError::Fragment)),
        ("http://", |e| matches!(e, UrlError::MissingHost)),
        ("http:///v1", |e| matches!(e, UrlError::MissingHost)),
        ("http://:8000", |e| matches!(e, UrlError::MissingHost)),
        ("http://host:0", |e| {
            matches!(e, UrlError::InvalidPort { .. })
        }),
        ("http://host:65536", |e| {
            matches!(e, UrlError::InvalidPort { .. })
        }),
        ("http://host:", |e| {
            matches!(e, UrlError::InvalidPort { .. })
        }),
        ("http://host:+80", |e| {
            matches!(e, UrlError::InvalidPort { .. })
        }),
        ("http://host:80:81", |e| {
            matches!(e, UrlError::InvalidPort { .. })
        }),
        ("http://ho st", |e| {
            matches!(e, UrlError::InvalidHost { .. })
        }),
        ("http://host\r\nx:1", |e| {
            matches!(e, UrlError::InvalidHost { .. })
        }),
        ("http://hóst", |e| {
            matches!(e, UrlError::InvalidHost { .. })
        }),
        ("http://host/a b", |e| {
            matches!(e, UrlError::InvalidPath { .. })
        }),
        ("http://host/a\r\nx", |e| {
            matches!(e, UrlError::InvalidPath { .. })
        }),
        ("http://host/v1/chat/completions", |e| {
            matches!(e, UrlError::EndpointPath { .. })
        }),
        ("http://host/v1/completions/", |e| {
            matches!(e, UrlError::EndpointPath { .. })
        }),
    ];
    for (s, check) in cases {
        match UpstreamUrl::parse(s) {
            Ok(u) => panic!("{s:?} parsed as {u:?}"),
            Err(e) => assert!(check(&e), "{s:?}: {e:?}"),
        }
    }
}

#[test]
fn error_messages_name_the_input() {
    let e = UpstreamUrl::parse("http://host:99999").expect_err("port");
    assert_eq!(
        e.to_string(),
        "upstream port \"99999\" is not a number from 1 to 65535"
    );
    let e = UpstreamUrl::parse("gopher://x").expect_err("scheme");
    assert_eq!(
        e.to_string(),
        "upstream URL must start with http:// or https:// (got \"gopher\")"
    );
}

#[test]
fn resolve_literal_addresses() {
    let u = ok("http://127.0.0.1:8000/v1");
    assert_eq!(
        u.resolve().expect("literal v4"),
        vec!["127.0.0.1:8000".parse().expect("addr")]
    );
    assert_eq!(u.authority(), "127.0.0.1:8000");
    let u = ok("http://[::1]:9000");
    assert_eq!(
        u.resolve().expect("literal v6"),
        vec!["[::1]:9000".parse().expect("addr")]
    );
    assert_eq!(u.authority(), "[::1]:9000");
}

#[test]
fn resolve_failure_names_the_host() {
    let u = ok("http://no-such-host.invalid:8000");
    let e = u.resolve().expect_err(".invalid never resolves");
    assert!(e.to_string().contains("no-such-host.invalid"), "{e}");
}

proptest::proptest! {
    #[test]
    fn parse_never_panics(s in "\\PC{0,64}") {
        let _ = UpstreamUrl::parse(&s);
        let _ = UpstreamUrl::parse(&format!("http://{s}"));
    }

    #[test]
    fn accepted_urls_are_safe_in_a_request_head(s in "[a-z0-9:/\\[\\]%.@?#\\-]{0,40}") {
        if let Ok(u) = UpstreamUrl::parse(&format!("http://{s}")) {
            let target = u.path_for("/v1/chat/completions");
            let host = u.host_header();
            proptest::prop_assert!(target.bytes().all(|b| b.is_ascii_graphic()));
            proptest::prop_assert!(host.bytes().all(|b| b.is_ascii_graphic()));
            proptest::prop_assert!(target.starts_with('/'));
        }
    }
}
