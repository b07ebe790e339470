//! Debian packages the tasks and tests need.

use std::process::Stdio;

use anyhow::{bail, Context, Result};

use super::Report;
use crate::{
    ctx::Ctx,
    util::{is_root, run},
};

/// Debian packages the tasks and tests need, with the reason (shown when one is installed).
const DEBIAN_PACKAGES: &[(&str, &str)] = &[
    (
        "iproute2",
        "`ip netns` and veth pairs for the namespace tests",
    ),
    ("iputils-ping", "reachability checks in the namespace tests"),
    ("curl", "the quick-start demo"),
    ("ca-certificates", "HTTPS to crates.io"),
    (
        "python3-venv",
        "client checks with the official OpenAI Python SDK",
    ),
    (
        "build-essential",
        "the C linker rustc needs for host binaries",
    ),
    (
        "prometheus",
        "promtool (checks of deploy/prometheus and of /metrics) and the Prometheus server for the ops-pack tests",
    ),
    (
        "systemd",
        "systemd-analyze, which checks deploy/systemd/haltd.service in the ops-pack tests",
    ),
    (
        "nginx",
        "the plain reverse proxy `cargo xtask bench` sets beside haltd (bench-proxy-overhead)",
    ),
    (
        "valgrind",
        "callgrind's instruction counts per proxied token (`cargo xtask bench`, bench-token-instructions)",
    ),
    (
        "debootstrap",
        "the Debian base of the container image (deploy/container, `cargo xtask bench` ops checks)",
    ),
    (
        "podman",
        "building and running the container image in the `cargo xtask bench` ops checks",
    ),
    (
        "runc",
        "podman's runtime there (crun refuses the hybrid cgroup layout)",
    ),
];

type Package = (&'static str, &'static str);

pub(super) fn ensure(ctx: &Ctx, report: &mut Report) -> Result<()> {
    let Some(missing) = missing(ctx)? else {
        println!(
            "[setup] dpkg-query not found (not Debian?): make sure these are installed: {}",
            DEBIAN_PACKAGES
                .iter()
                .map(|p| p.0)
                .collect::<Vec<_>>()
                .join(" ")
        );
        return Ok(());
    };
    if missing.is_empty() {
        println!(
            "[setup] Debian packages: all {} present",
            DEBIAN_PACKAGES.len()
        );
        report.present("packages");
        return Ok(());
    }
    for (pkg, why) in &missing {
        println!("[setup] Debian package {pkg} missing (needed for {why})");
    }
    let names: Vec<&str> = missing.iter().map(|m| m.0).collect();
    if !is_root() {
        bail!("Debian packages missing: {}; run `cargo xtask setup` as root, or `apt-get install -y {}`", names.join(", "), names.join(" "));
    }
    install(ctx, &names)?;
    names.iter().for_each(|n| report.installed(n));
    Ok(())
}

/// The packages dpkg does not have installed; `None` without dpkg-query (not Debian).
fn missing(ctx: &Ctx) -> Result<Option<Vec<Package>>> {
    let mut missing = Vec::new();
    for &(pkg, why) in DEBIAN_PACKAGES {
        let out = ctx
            .cmd("dpkg-query")
            .args(["-W", "-f=${Status}", pkg])
            .stderr(Stdio::null())
            .output();
        match out {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).context("running dpkg-query"),
            Ok(out) if String::from_utf8_lossy(&out.stdout).trim() == "install ok installed" => {}
            Ok(_) => missing.push((pkg, why)),
        }
    }
    Ok(Some(missing))
}

fn install(ctx: &Ctx, names: &[&str]) -> Result<()> {
    println!("[setup] apt-get update");
    run(ctx
        .cmd("apt-get")
        .args(["update", "-q"])
        .env("DEBIAN_FRONTEND", "noninteractive"))
    .context("apt-get update failed (are the Debian mirrors reachable?)")?;
    println!("[setup] apt-get install {}", names.join(" "));
    run(ctx
        .cmd("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(names)
        .env("DEBIAN_FRONTEND", "noninteractive"))
    .context("apt-get install failed")
}
