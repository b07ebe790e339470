//! `cargo xtask build-ebpf` and `cargo xtask build`: the BPF gate, then haltd and haltctl with
//! that object embedded (`HALTD_BPF_OBJECT`, so the daemon's build script does not build it a
//! second time).

use std::{fs, path::PathBuf, time::Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use haltd_ebpf_build::Gate;

use crate::{
    ctx::Ctx,
    util::{run, secs},
};

#[derive(Debug, Args)]
pub(crate) struct Options {
    /// Release profile (target/release) instead of debug.
    #[arg(long)]
    release: bool,
    /// haltd features; default none (the production build). `--features fault-injection` is
    /// the test build (`--fault`), which `cargo xtask test` and `bench` build for themselves.
    /// Repeatable or comma-separated.
    #[arg(long, value_delimiter = ',')]
    features: Vec<String>,
}

/// Paths of a finished build.
#[derive(Debug)]
pub(crate) struct Built {
    pub(crate) haltd: PathBuf,
    pub(crate) haltctl: PathBuf,
    pub(crate) object: PathBuf,
}

pub(crate) fn build_task(ctx: &Ctx, opts: &Options) -> Result<()> {
    let built = build(ctx, opts.release, &opts.features)?;
    println!("[build] haltd:   {}", built.haltd.display());
    println!("[build] haltctl: {}", built.haltctl.display());
    println!("[build] gate:    {}", built.object.display());
    Ok(())
}

/// Builds the BPF gate; returns the object's absolute path.
pub(crate) fn build_ebpf(ctx: &Ctx) -> Result<PathBuf> {
    let dir = ctx.gate.dir();
    if !dir.join("src/main.rs").is_file() {
        bail!(
            "the BPF crate is not there yet: {} has no src/main.rs",
            dir.display()
        );
    }
    haltd_ebpf_build::check_toolchain().map_err(|missing| {
        anyhow!("cannot build the BPF gate: {missing}; run `cargo xtask setup`")
    })?;
    println!("[build-ebpf] {}", Gate::command_line());
    let t = Instant::now();
    run(&mut ctx.gate.command())
        .context("building the BPF gate failed (has `cargo xtask setup` run?)")?;
    let object = ctx.gate.object();
    let size = fs::metadata(&object)
        .with_context(|| {
            format!(
                "the BPF build succeeded but left no object at {}",
                object.display()
            )
        })?
        .len();
    println!(
        "[build-ebpf] {} ({size} bytes) in {}",
        object.display(),
        secs(t.elapsed())
    );
    Ok(object)
}

/// Builds a production haltd (no features) and copies it to `target/<profile>/production/haltd`,
/// where a later build with other features does not overwrite it; returns that path.
pub(crate) fn build_production_copy(ctx: &Ctx, release: bool) -> Result<PathBuf> {
    let built = build(ctx, release, &[])?;
    let dir = built
        .haltd
        .parent()
        .context("the haltd binary has no parent folder")?
        .join("production");
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let copy = dir.join("haltd");
    fs::copy(&built.haltd, &copy)
        .with_context(|| format!("copying {} to {}", built.haltd.display(), copy.display()))?;
    println!("[build] production haltd kept at {}", copy.display());
    Ok(copy)
}

/// The cargo profile a build uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Profile {
    /// `dev`, in target/debug.
    Debug,
    /// `release`: optimised, no debug info (target/release).
    Release,
    /// `distribution`: `release` with line tables, for `cargo xtask dist` to split off
    /// (target/distribution).
    Distribution,
}

impl Profile {
    /// The directory under the target directory.
    fn dir(self) -> &'static str {
        match self {
            Profile::Debug => "debug",
            Profile::Release => "release",
            Profile::Distribution => "distribution",
        }
    }
}

/// Builds the gate, then haltd and haltctl (`release` or debug, with `features`).
pub(crate) fn build(ctx: &Ctx, release: bool, features: &[String]) -> Result<Built> {
    let profile = if release {
        Profile::Release
    } else {
        Profile::Debug
    };
    build_profile(ctx, profile, features)
}

/// Builds the gate, then haltd and haltctl in `profile`, with `features`.
pub(crate) fn build_profile(ctx: &Ctx, profile: Profile, features: &[String]) -> Result<Built> {
    let object = build_ebpf(ctx)?;
    let features: Vec<&str> = features
        .iter()
        .map(|f| f.trim())
        .filter(|f| !f.is_empty())
        .collect();
    println!(
        "[build] haltd ({}, features: {})",
        profile.dir(),
        if features.is_empty() {
            "none".into()
        } else {
            features.join(",")
        }
    );
    let t = Instant::now();
    let mut c = ctx.cargo_with_gate(&object);
    c.args(["build", "-p", "haltd", "--bins"]);
    match profile {
        Profile::Debug => {}
        Profile::Release => {
            c.arg("--release");
        }
        Profile::Distribution => {
            c.args(["--profile", "distribution"]);
        }
    }
    if !features.is_empty() {
        c.arg("--features").arg(features.join(","));
    }
    run(&mut c).context("building haltd failed")?;
    let dir = ctx.target_dir.join(profile.dir());
    let built = Built {
        haltd: dir.join("haltd"),
        haltctl: dir.join("haltctl"),
        object,
    };
    for bin in [&built.haltd, &built.haltctl] {
        if !bin.is_file() {
            bail!("cargo built haltd but {} is missing", bin.display());
        }
    }
    println!("[build] done in {}", secs(t.elapsed()));
    Ok(built)
}
