//! `cargo xtask load`: builds a release haltd and has it load, verify and attach the gate once
//! (`haltd check-gate`).

use std::process::Stdio;

use anyhow::{bail, Context, Result};

use crate::{build, ctx::Ctx, setup, util::run};

pub(crate) fn load(ctx: &Ctx) -> Result<()> {
    setup::setup(ctx)?;
    let built = build::build(ctx, true, &[])?;
    let supported = ctx
        .cmd(&built.haltd)
        .args(["check-gate", "--help"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !supported {
        bail!(
            "this haltd has no `check-gate` subcommand, so the gate cannot be loaded on its own; the BPF object built fine at {}",
            built.object.display()
        );
    }
    println!(
        "[load] haltd check-gate --bpf-object {}",
        built.object.display()
    );
    run(ctx
        .cmd(&built.haltd)
        .arg("check-gate")
        .arg("--bpf-object")
        .arg(&built.object))
    .context("loading and attaching the gate failed")?;
    println!("load: ok");
    Ok(())
}
