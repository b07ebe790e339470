//! haltd with `--source openai` in front of the scripted upstream (or llama.cpp's server),
//! both in the server namespace of one pair, clients in the client namespace: the set-up of
//! the proxy and detector tests.

use std::{fs, path::PathBuf, time::Duration};

use anyhow::{Context, Result};
use serde_json::{json, Value};

use crate::{
    daemon::Haltd,
    http::{agent, get_json_here, header},
    netns::{in_netns, NetPair},
    sse::{self, StreamOutcome},
    temp_dir,
    upstream::ScriptedUpstream,
};

/// haltd, its upstream and their namespaces; dropped in this order. The upstream is the
/// scripted one, or llama.cpp's server ([`crate::llama::LlamaServer`]).
#[derive(Debug)]
pub struct Rig<U = ScriptedUpstream> {
    pub haltd: Haltd,
    pub up: U,
    pub pair: NetPair,
    /// The directory of haltd's config file, if it was given one (kept, like a failed
    /// test's logs).
    pub config_dir: Option<PathBuf>,
}

impl Rig {
    /// Starts the upstream (`upstream_bin`: pass `env!("CARGO_BIN_EXE_scripted-upstream")`)
    /// and haltd proxying it, with `haltd_extra` after `--source openai --upstream URL`.
    pub fn start(upstream_bin: &str, haltd_extra: &[&str]) -> Result<Self> {
        Self::start_with(upstream_bin, &[], haltd_extra)
    }

    /// Like [`Rig::start`], with `upstream_extra` on the upstream's command line (e.g.
    /// `--keep-alive`).
    pub fn start_with(
        upstream_bin: &str,
        upstream_extra: &[&str],
        haltd_extra: &[&str],
    ) -> Result<Self> {
        let pair = NetPair::new()?;
        let up = ScriptedUpstream::start(&pair, upstream_bin, upstream_extra)?;
        let mut args = vec!["--source", "openai", "--upstream", up.url.as_str()];
        args.extend_from_slice(haltd_extra);
        let haltd = Haltd::start(&pair, &args)?;
        Ok(Rig {
            haltd,
            up,
            pair,
            config_dir: None,
        })
    }

    /// haltd in front of an `https://` upstream: the scripted upstream serves `serve`'s
    /// certificate (or, with `None`, plain HTTP on the same port), and haltd trusts `trust`'s
    /// CA (`--upstream-ca-file`).
    pub fn start_tls(
        upstream_bin: &str,
        serve: Option<&crate::tls::TestPki>,
        trust: &crate::tls::TestPki,
        upstream_extra: &[&str],
        haltd_extra: &[&str],
    ) -> Result<Self> {
        let pair = NetPair::new()?;
        let tls_args = serve
            .map(crate::tls::TestPki::upstream_args)
            .unwrap_or_default();
        let mut up_args: Vec<&str> = tls_args.iter().map(String::as_str).collect();
        up_args.extend_from_slice(upstream_extra);
        let up = ScriptedUpstream::start(&pair, upstream_bin, &up_args)?;
        let url = format!("https://127.0.0.1:{}", crate::upstream::PORT_UPSTREAM);
        let ca = trust.ca.display().to_string();
        let mut args = vec![
            "--source",
            "openai",
            "--upstream",
            url.as_str(),
            "--upstream-ca-file",
            ca.as_str(),
        ];
        args.extend_from_slice(haltd_extra);
        let haltd = Haltd::start(&pair, &args)?;
        Ok(Rig {
            haltd,
            up,
            pair,
            config_dir: None,
        })
    }

    /// Like [`Rig::start`], with `config` written to a file that haltd gets as `--config`
    /// (before `extra`).
    pub fn with_config(upstream_bin: &str, config: &str, extra: &[&str]) -> Result<Self> {
        let pair = NetPair::new()?;
        let up = ScriptedUpstream::start(&pair, upstream_bin, &[])?;
        let dir = temp_dir("detectors")?;
        let path = dir.join("haltd.toml");
        fs::write(&path, config)?;
        let path = path.display().to_string();
        let mut args = vec![
            "--source",
            "openai",
            "--upstream",
            up.url.as_str(),
            "--config",
            path.as_str(),
        ];
        args.extend_from_slice(extra);
        let haltd = Haltd::start(&pair, &args)?;
        Ok(Rig {
            haltd,
            up,
            pair,
            config_dir: Some(dir),
        })
    }
}

impl<U> Rig<U> {
    /// `http://<haltd's API><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.haltd.api_url())
    }

    /// Streams `body` to `path` with `auth` (no `authorization` header when `None`), calling
    /// `on_event` per event.
    pub fn stream(
        &self,
        path: &str,
        body: &Value,
        auth: Option<&str>,
        on_event: impl FnMut(&sse::Progress<'_>, &sse::SseEvent) + Send,
    ) -> Result<StreamOutcome> {
        let headers: Vec<(&str, &str)> =
            auth.map(|a| vec![("authorization", a)]).unwrap_or_default();
        self.stream_headers(path, body, &headers, on_event)
    }

    /// [`Rig::stream`] with any request headers.
    pub fn stream_headers(
        &self,
        path: &str,
        body: &Value,
        headers: &[(&str, &str)],
        on_event: impl FnMut(&sse::Progress<'_>, &sse::SseEvent) + Send,
    ) -> Result<StreamOutcome> {
        let (url, body) = (self.url(path), body.clone());
        let owned: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        in_netns(&self.haltd.client_ns, move || {
            let headers: Vec<(&str, &str)> = owned
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            sse::stream_with(&url, &body, &headers, Duration::from_secs(30), on_event)
        })
    }

    /// A non-streaming request: (status, headers we care about, body as JSON or Null).
    pub fn post(
        &self,
        path: &str,
        body: &Value,
        auth: Option<&str>,
    ) -> Result<(u16, Value, Value)> {
        let (url, body) = (self.url(path), body.clone());
        let auth = auth.map(str::to_owned);
        in_netns(
            &self.haltd.client_ns,
            move || -> Result<(u16, Value, Value)> {
                let mut req = agent(Duration::from_secs(30))
                    .post(&url)
                    .header("content-type", "application/json");
                if let Some(a) = &auth {
                    req = req
                        .header("authorization", a.as_str())
                        .header(crate::daemon::TEST_TENANT_HEADER, a.as_str());
                }
                let mut resp = req
                    .send_json(&body)
                    .with_context(|| format!("POST {url}"))?;
                let headers = json!({
                    "x-haltd-mode": header(&resp, "x-haltd-mode"),
                    "x-haltd-stream-id": header(&resp, "x-haltd-stream-id"),
                    "content-type": header(&resp, "content-type"),
                    "retry-after": header(&resp, "retry-after"),
                });
                let text = resp.body_mut().read_to_string().unwrap_or_default();
                let json = serde_json::from_str(&text).unwrap_or(Value::String(text));
                Ok((resp.status().as_u16(), headers, json))
            },
        )
    }

    /// `POST <upstream><path>` straight to the upstream, past haltd (from the server
    /// namespace): what the backend itself answers, e.g. its own batch answer to compare
    /// with haltd's. (status, body as JSON or Null).
    pub fn post_upstream(&self, path: &str, body: &Value) -> Result<(u16, Value)> {
        let url = format!("http://127.0.0.1:{}{path}", crate::upstream::PORT_UPSTREAM);
        let body = body.clone();
        in_netns(&self.pair.srv, move || -> Result<(u16, Value)> {
            let mut resp = agent(Duration::from_secs(60))
                .post(&url)
                .header("content-type", "application/json")
                .send_json(&body)
                .with_context(|| format!("POST {url}"))?;
            let text = resp.body_mut().read_to_string().unwrap_or_default();
            let json = serde_json::from_str(&text).unwrap_or(Value::String(text));
            Ok((resp.status().as_u16(), json))
        })
    }

    /// Streams a long turn of `auth` and trips it through the admin API at its second token;
    /// returns its stream id once the halt ended the stream cleanly (`OPERATOR_TRIP`).
    pub fn trip_stream_of(&self, auth: &str) -> Result<String> {
        let admin = self.haltd.admin_url();
        let o = self.stream(
            "/v1/chat/completions",
            &chat("[[script:normal tokens=200 pace_ms=5]]", true),
            Some(auth),
            |p, ev| {
                if matches!(ev.kind, crate::EventKind::Token(_)) && p.tokens == 2 {
                    let _ = crate::trip_here(
                        &format!("{admin}/admin/streams/{}/trip", p.stream_id),
                        None,
                    );
                }
            },
        )?;
        o.halted_cleanly("OPERATOR_TRIP")?;
        Ok(o.stream_id)
    }

    /// `haltctl [--json] ARGS` against this rig's haltd, from the client namespace; its
    /// standard output (fails on a non-zero exit, with its standard error).
    pub fn haltctl(&self, json: bool, args: &[&str]) -> Result<String> {
        let mut c = std::process::Command::new("ip");
        c.args(["netns", "exec", &self.pair.cli])
            .arg(crate::haltctl_bin()?)
            .arg("--admin")
            .arg(self.haltd.admin.to_string())
            .arg("--admin-token-file")
            .arg(self.haltd.admin_token_file());
        if json {
            c.arg("--json");
        }
        let out = c.args(args).output()?;
        anyhow::ensure!(
            out.status.success(),
            "haltctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `GET <admin API><path>` as JSON, from the client namespace.
    pub fn get_admin(&self, path: &str) -> Result<Value> {
        let url = format!("{}{path}", self.haltd.admin_url());
        in_netns(&self.haltd.client_ns, move || get_json_here(&url))
    }

    /// Waits until the ledger holds a record matching `pred` (records land asynchronously).
    pub fn wait_record(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Result<Value> {
        self.haltd.wait_record(what, pred)
    }

    /// The record of `kind` (`turn`, `incident`, ...) for stream `stream_id`, once written.
    pub fn record(&self, kind: &str, stream_id: &str) -> Result<Value> {
        self.wait_record(&format!("{kind} for {stream_id}"), |r| {
            r["kind"] == kind && r["stream_id"] == stream_id
        })
    }

    /// The turn record of stream `stream_id`, once written.
    pub fn turn_record(&self, stream_id: &str) -> Result<Value> {
        self.record("turn", stream_id)
    }
}

/// A chat request to the scripted model; `directive` (`[[script:...]]`) scripts its answer.
pub fn chat(directive: &str, stream: bool) -> Value {
    json!({
        "model": "scripted",
        "stream": stream,
        "messages": [{"role": "user", "content": directive}],
    })
}
