//! Issue 14, point 9: the release as an operator installs it. Run by `cargo xtask bench` (after
//! `cargo xtask dist`; `cargo xtask bench --ops-only` runs it alone), not by the CI suite: it
//! needs a Debian mirror (or a cached base), minutes, root and podman.
//!
//! 1. **The package.** `dpkg-deb` reads the control file and the file list of the `.deb`.
//! 2. **The install.** `deploy/container/build-image.sh` makes a Debian root file system with
//!    debootstrap (cached as a tarball after the first run) and installs the package in it with
//!    `dpkg -i`, as on a host: the throwaway root. In it: dpkg has the package installed with
//!    its conffiles, every file is in place, the binaries are stripped with a debug link, the
//!    unit's `ExecStart` and `ExecStartPre` programs exist there, `haltd --version`
//!    names the commit and no fault injection, and `haltd check-config` accepts the shipped
//!    config.
//! 3. **The image.** The same script builds the image from that root with podman
//!    (`deploy/container/Containerfile`). The image is started with the capabilities, seccomp
//!    profile and cgroup v2 mount that `deploy/container/README.md` documents, its API on a
//!    loopback port of the host: `/healthz` and `/readyz` answer, the kernel gate is enforcing,
//!    a stream from the built-in source completes, and `podman stop` drains it to exit 0.
//!
//! Each step's wall time is printed (`[ops] ... s`). Exits 1 on any failure.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use clap::Parser;
use haltd_tests::{get_json_here, require_root, sse};
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// The package to check (`cargo xtask dist` builds it).
    #[arg(long, env = "HALTD_DEB")]
    deb: PathBuf,
    /// Work directory: the base tarball cache, the installed root, the seccomp profile.
    #[arg(long, default_value = "target/ops")]
    work: PathBuf,
    /// Host loopback port the container's API is published on.
    #[arg(long, default_value_t = 18480)]
    port: u16,
    /// The image's tag.
    #[arg(long, default_value = "localhost/haltd:ops-test")]
    tag: String,
}

/// Only this works on these machines: crun refuses the hybrid cgroup layout.
const PODMAN: [&str; 4] = ["podman", "--runtime", "runc", "--cgroup-manager=cgroupfs"];
const CONTAINER: &str = "haltd-ops-test";

fn main() -> Result<()> {
    let args = Args::parse();
    require_root()?;
    let repo = repo();
    let work = repo.join(&args.work);
    fs::create_dir_all(&work)?;
    // Raising RLIMIT_NPROC is not permitted here: podman must set no ulimits of its own.
    let conf = work.join("containers.conf");
    fs::write(&conf, "[containers]\ndefault_ulimits = []\n")?;
    std::env::set_var("CONTAINERS_CONF", &conf);

    let t = Instant::now();
    check_package(&args.deb)?;
    println!("[ops] package read in {:.1} s", t.elapsed().as_secs_f64());

    let t = Instant::now();
    let rootfs = build_image(&repo, &args, &work)?;
    println!(
        "[ops] base, install and image in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    check_installed(&rootfs)?;
    println!(
        "[ops] image {} is {:.1} MiB",
        args.tag,
        image_size(&args.tag)? as f64 / (1024.0 * 1024.0)
    );

    let profile = work.join("seccomp.json");
    let script = repo.join("deploy/container/seccomp-profile.sh");
    let out = capture(&mut Command::new(script))?;
    fs::write(&profile, out)?;
    let _ = podman(&["rm", "--force", CONTAINER]);
    let result = run_container(&args, &profile);
    if result.is_err() {
        if let Ok(logs) = container_log() {
            eprintln!("[ops] container log:\n{logs}");
        }
    }
    let _ = podman(&["rm", "--force", CONTAINER]);
    result?;
    println!("[ops] all checks passed");
    Ok(())
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Runs `cmd`; its stdout, or an error with its output.
fn capture(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        out.status.success(),
        "{cmd:?}: {}\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(stdout)
}

fn podman(args: &[&str]) -> Result<String> {
    capture(Command::new(PODMAN[0]).args(&PODMAN[1..]).args(args))
}

/// The container's output, stdout and stderr (haltd logs to stderr).
fn container_log() -> Result<String> {
    let out = Command::new(PODMAN[0])
        .args(&PODMAN[1..])
        .args(["logs", CONTAINER])
        .output()
        .context("running podman logs")?;
    ensure!(out.status.success(), "podman logs: {}", out.status);
    Ok(format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

/// The control file and the file list, read from the `.deb` itself.
fn check_package(deb: &Path) -> Result<()> {
    let control = capture(Command::new("dpkg-deb").arg("--field").arg(deb))?;
    for field in [
        "Package: haltd",
        "Architecture: amd64",
        "Depends: libc6 (>= ",
    ] {
        ensure!(control.contains(field), "{field:?} missing:\n{control}");
    }
    let list = capture(Command::new("dpkg-deb").arg("--contents").arg(deb))?;
    for path in INSTALLED {
        ensure!(
            list.lines().any(|l| l.ends_with(&format!(".{path}"))),
            "{path} is not in the package:\n{list}"
        );
    }
    Ok(())
}

/// Every file the package installs that an operator relies on.
const INSTALLED: [&str; 13] = [
    "/usr/bin/haltd",
    "/usr/bin/haltctl",
    "/lib/systemd/system/haltd.service",
    "/lib/systemd/system/haltd@.service",
    "/etc/haltd/haltd.toml",
    "/etc/logrotate.d/haltd",
    "/usr/share/man/man1/haltd.1.gz",
    "/usr/share/man/man1/haltctl.1.gz",
    "/usr/share/bash-completion/completions/haltd",
    "/usr/share/zsh/vendor-completions/_haltd",
    "/usr/share/fish/vendor_completions.d/haltd.fish",
    "/usr/share/doc/haltd/README.md",
    "/usr/share/doc/haltd/copyright",
];

/// `build-image.sh`, keeping the installed root; returns it.
fn build_image(repo: &Path, args: &Args, work: &Path) -> Result<PathBuf> {
    let script = repo.join("deploy/container/build-image.sh");
    let status = Command::new(&script)
        .arg(&args.deb)
        .arg(&args.tag)
        .env("HALTD_IMAGE_WORK", work.join("image"))
        .env("HALTD_IMAGE_BASE", work.join("base-bookworm-minbase.tar"))
        .env("HALTD_IMAGE_KEEP", "1")
        .status()
        .with_context(|| format!("running {}", script.display()))?;
    ensure!(status.success(), "{} failed: {status}", script.display());
    Ok(work.join("image/rootfs"))
}

fn chroot(rootfs: &Path, args: &[&str]) -> Result<String> {
    capture(Command::new("chroot").arg(rootfs).args(args))
}

/// The throwaway root the package was installed in.
fn check_installed(rootfs: &Path) -> Result<()> {
    let status = chroot(
        rootfs,
        &["dpkg-query", "-W", "-f=${Status} ${Version}", "haltd"],
    )?;
    ensure!(
        status.starts_with("install ok installed "),
        "dpkg says {status:?}"
    );
    let conffiles = chroot(rootfs, &["dpkg-query", "-W", "-f=${Conffiles}", "haltd"])?;
    for c in ["/etc/haltd/haltd.toml", "/etc/logrotate.d/haltd"] {
        ensure!(
            conffiles.contains(c),
            "{c} is not a conffile: {conffiles:?}"
        );
    }
    for path in INSTALLED {
        ensure!(
            rootfs.join(&path[1..]).is_file(),
            "{path} missing after the install"
        );
    }
    for bin in ["usr/bin/haltd", "usr/bin/haltctl"] {
        let sections = capture(Command::new("objdump").arg("-h").arg(rootfs.join(bin)))?;
        ensure!(
            sections.contains(".gnu_debuglink") && !sections.contains(".debug_info"),
            "{bin} is not stripped with a debug link"
        );
    }
    check_unit(rootfs)?;
    let version = chroot(rootfs, &["haltd", "--version"])?;
    ensure!(
        version.starts_with("haltd ")
            && version.contains("commit")
            && version.contains("features: none"),
        "haltd --version: {version:?}"
    );
    let ok = chroot(rootfs, &["haltd", "check-config", "/etc/haltd/haltd.toml"])?;
    println!(
        "[ops] installed: {status}; {}; check-config: {}",
        version.trim(),
        ok.trim()
    );
    Ok(())
}

/// The packaged unit runs programs that the package (or Debian) installed.
fn check_unit(rootfs: &Path) -> Result<()> {
    let unit = fs::read_to_string(rootfs.join("lib/systemd/system/haltd.service"))?;
    ensure!(
        unit.contains("\nExecStart=/usr/bin/haltd serve --config /etc/haltd/haltd.toml")
            && unit.contains("\nExecStartPre=/usr/bin/haltd check-config /etc/haltd/haltd.toml"),
        "the unit does not run the packaged binary:\n{unit}"
    );
    // (ExecReload's /bin/kill is procps', on every host but not in a minimal base.)
    for line in unit.lines().filter(|l| l.starts_with("ExecStart")) {
        let (_, cmd) = line.split_once('=').context("an Exec line has a value")?;
        let program = cmd.split_whitespace().next().unwrap_or_default();
        ensure!(
            rootfs.join(program.trim_start_matches('/')).is_file(),
            "{line}: {program} is not in the installed root"
        );
    }
    Ok(())
}

fn image_size(tag: &str) -> Result<u64> {
    let size = podman(&["image", "inspect", "--format", "{{.Size}}", tag])?;
    size.trim()
        .parse()
        .with_context(|| format!("image size {size:?}"))
}

/// Starts the image as documented, checks it serves, and stops it (a drain, exit 0).
fn run_container(args: &Args, profile: &Path) -> Result<()> {
    let publish = format!("127.0.0.1:{}:8080", args.port);
    let seccomp = format!("seccomp={}", profile.display());
    let t = Instant::now();
    podman(&[
        "run",
        "--detach",
        "--name",
        CONTAINER,
        "--publish",
        &publish,
        "--cap-drop",
        "all",
        "--cap-add",
        "BPF,NET_ADMIN",
        "--security-opt",
        &seccomp,
        "--volume",
        "/sys/fs/cgroup/unified:/sys/fs/cgroup/unified",
        &args.tag,
    ])?;
    let base = format!("http://127.0.0.1:{}", args.port);
    let health = wait_healthy(&format!("{base}/healthz"), Duration::from_secs(30))?;
    println!(
        "[ops] container healthy {:.1} s after podman run: {health}",
        t.elapsed().as_secs_f64()
    );
    ensure!(health["kernel_gate"] == "enforcing", "{health}");
    get_json_here(&format!("{base}/readyz")).context("/readyz is not 200")?;
    let body = json!({"model": "builtin", "stream": true, "max_tokens": 4,
                      "messages": [{"role": "user", "content": "Tell me about rivers"}]});
    let o = sse::stream(
        &format!("{base}/v1/chat/completions"),
        &body,
        Duration::from_secs(30),
        |_, _| {},
    )?;
    ensure!(
        o.status == 200 && o.tokens == 4 && o.finish_reason.is_some() && o.done_at.is_some(),
        "stream: {o:?}"
    );
    println!("[ops] streamed {} tokens: {:?}", o.tokens, o.text);
    let t = Instant::now();
    podman(&["stop", "--time", "45", CONTAINER])?;
    let code = podman(&["inspect", "--format", "{{.State.ExitCode}}", CONTAINER])?;
    let logs = container_log()?;
    ensure!(code.trim() == "0", "exit code {code}; log:\n{logs}");
    // The ready line (text or JSON, as the config says) and the drain's last line.
    ensure!(
        logs.contains("haltd ready") && logs.contains("drain over"),
        "log:\n{logs}"
    );
    println!(
        "[ops] stopped (drained, exit 0) in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Polls `url` until it answers 200 with JSON (the container is starting).
fn wait_healthy(url: &str, timeout: Duration) -> Result<serde_json::Value> {
    let deadline = Instant::now() + timeout;
    loop {
        match get_json_here(url) {
            Ok(v) => return Ok(v),
            Err(_) if Instant::now() < deadline => thread::sleep(Duration::from_millis(200)),
            Err(e) => return Err(e).context(format!("{url} not healthy after {timeout:?}")),
        }
    }
}
