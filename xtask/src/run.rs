//! `cargo xtask run`: the quick-start demo. Builds a release haltd, prints ready-to-paste
//! `curl` and `haltctl ... trip` commands for the addresses it really uses, then execs
//! `haltd serve` on localhost with the built-in token source.

use std::{ffi::OsString, os::unix::process::CommandExt, path::Path, process::Command};

use anyhow::{Context, Result};
use clap::Args;

use crate::{build, ctx::Ctx, setup, util::is_root};

#[derive(Debug, Args)]
pub(crate) struct Options {
    /// Extra arguments for `haltd serve` (after `--`); they override the defaults.
    #[arg(last = true)]
    args: Vec<OsString>,
}

pub(crate) fn run(ctx: &Ctx, opts: Options) -> Result<()> {
    setup::setup(ctx)?;
    let built = build::build(ctx, true, &[])?;
    let serve = serve_args(ctx, opts.args);
    let haltctl = built
        .haltctl
        .strip_prefix(&ctx.root)
        .unwrap_or(&built.haltctl);
    print_instructions(&serve, haltctl);
    let err = Command::new(&built.haltd)
        .args(&serve)
        .current_dir(&ctx.root)
        .exec();
    Err(err).with_context(|| format!("exec {}", built.haltd.display()))
}

/// `serve` with the demo's localhost defaults for the flags `args` does not give, then `args`.
fn serve_args(ctx: &Ctx, args: Vec<OsString>) -> Vec<OsString> {
    let given = |flag: &str| {
        args.iter().any(|a| {
            a.to_str()
                .is_some_and(|a| a == flag || a.starts_with(&format!("{flag}=")))
        })
    };
    let ledger = ctx.root.join("haltd-ledger.jsonl");
    let mut serve: Vec<OsString> = vec!["serve".into()];
    for (flag, value) in [
        ("--listen", OsString::from("127.0.0.1:8080")),
        // Its own socket, so the demo runs beside a haltd installed on the node.
        ("--admin", "unix:/run/haltd/demo-admin.sock".into()),
        ("--metrics", "127.0.0.1:9464".into()),
        ("--ledger", ledger.into()),
    ] {
        if !given(flag) {
            serve.extend([flag.into(), value]);
        }
    }
    serve.extend(args);
    serve
}

/// The value of `flag` in `serve` (`--flag VALUE` or `--flag=VALUE`), or "".
fn value_of(serve: &[OsString], flag: &str) -> String {
    let mut it = serve.iter().filter_map(|a| a.to_str());
    while let Some(a) = it.next() {
        if a == flag {
            return it.next().unwrap_or_default().to_owned();
        }
        if let Some(v) = a.strip_prefix(&format!("{flag}=")) {
            return v.to_owned();
        }
    }
    String::new()
}

/// Prints commands for the addresses haltd will really use (defaults or overrides).
fn print_instructions(serve: &[OsString], haltctl: &Path) {
    let (listen, admin, metrics, ledger) = (
        value_of(serve, "--listen"),
        value_of(serve, "--admin"),
        value_of(serve, "--metrics"),
        value_of(serve, "--ledger"),
    );
    println!();
    println!("haltd is starting (Ctrl-C stops it). In another terminal, stream tokens with:");
    println!();
    println!(
        r#"  curl -sN -i http://{listen}/v1/chat/completions -H 'content-type: application/json' -d '{{"model":"builtin","stream":true,"max_tokens":400,"ignore_eos":true,"messages":[{{"role":"user","content":"Tell me about rivers"}}]}}' | tee /tmp/haltd-demo.sse"#
    );
    println!();
    println!("and trip that stream while it runs (from a third terminal):");
    println!(
        r#"  {} --admin {admin} trip "$(grep -i '^x-haltd-stream-id' /tmp/haltd-demo.sse | cut -d' ' -f2 | tr -d '\r')""#,
        haltctl.display()
    );
    println!();
    println!(
        "The stream then ends within the halt budget (--budget, default 5 tokens) with finish_reason"
    );
    println!("\"content_filter\", an error event of type \"halted\" and [DONE].");
    println!();
    println!(
        "Metrics: http://{metrics}/metrics   Admin API: {} --admin {admin} streams",
        haltctl.display()
    );
    println!(
        "Ledger:  {ledger}   (check it: {} ledger verify {ledger})",
        haltctl.display()
    );
    if !is_root() {
        println!("note: not root: loading the kernel gate needs CAP_BPF and CAP_NET_ADMIN; haltd refuses to serve without it unless given `-- --no-kernel-gate`");
    }
    println!();
}
