//! Embeds the BPF halt gate into haltd, so a plain `cargo build -p haltd` (or `cargo install`)
//! gives a binary whose kernel gate loads.
//!
//! - `HALTD_BPF_OBJECT` set (`cargo xtask` sets it to the object it just built): that file is
//!   embedded as it is.
//! - Otherwise the gate crate, `ebpf/haltd-ebpf`, is built here with the nightly toolchain for
//!   `bpfel-unknown-none` (`haltd-ebpf-build`: the command `cargo xtask build-ebpf` runs) into
//!   its own target dir, where cargo caches it: clippy, doc and test runs pay for it once.
//!
//! There is no empty fallback: a haltd without its gate refuses to start, so a missing
//! toolchain fails the build here, with the fix (`cargo xtask setup`) in the message.
use std::{
    env, fs,
    io::Read,
    path::{Path, PathBuf},
    process::{exit, Command, Stdio},
};

use haltd_ebpf_build::Gate;

/// The file `gate::embedded_object` includes, in `OUT_DIR`.
const EMBEDDED: &str = "haltd-gate.bpf.o";

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=HALTD_BPF_OBJECT");
    describe_build();
    let Some(out_dir) = env::var_os("OUT_DIR") else {
        fail("OUT_DIR is not set (this is cargo's build script for haltd)")
    };
    let object = match env::var_os("HALTD_BPF_OBJECT") {
        Some(path) => {
            let path = PathBuf::from(path);
            println!("cargo::rerun-if-changed={}", path.display());
            path
        }
        None => build_gate(),
    };
    if let Err(why) = check_object(&object) {
        fail(&why);
    }
    let embedded = PathBuf::from(out_dir).join(EMBEDDED);
    if let Err(e) = fs::copy(&object, &embedded) {
        fail(&format!(
            "copying the gate object {} to {}: {e}",
            object.display(),
            embedded.display()
        ));
    }
}

/// Sets `HALTD_GIT_COMMIT`, `HALTD_FEATURES` and `HALTD_LONG_VERSION` for `build_info`: what
/// `--version`, the ready line, the start record and `haltd_build_info` say this binary is.
///
/// The commit is `HALTD_GIT_COMMIT` when set (a packager building from a tarball), else what
/// `git rev-parse` says of the checkout being built, else `unknown`.
fn describe_build() {
    println!("cargo::rerun-if-env-changed=HALTD_GIT_COMMIT");
    let commit = env::var("HALTD_GIT_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(git_commit)
        .unwrap_or_else(|| "unknown".to_owned());
    // Cargo sets CARGO_FEATURE_<NAME> for each enabled feature of this crate.
    let features = if env::var_os("CARGO_FEATURE_FAULT_INJECTION").is_some() {
        "fault-injection"
    } else {
        "none"
    };
    let version = env::var("CARGO_PKG_VERSION").unwrap_or_default();
    println!("cargo::rustc-env=HALTD_GIT_COMMIT={commit}");
    println!("cargo::rustc-env=HALTD_FEATURES={features}");
    println!(
        "cargo::rustc-env=HALTD_LONG_VERSION={version} (commit {commit}, features: {features})"
    );
}

/// The checked-out commit (12 hex digits), watching HEAD and its branch so that a new commit
/// rebuilds; `None` outside a git checkout.
fn git_commit() -> Option<String> {
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git")
            .args(args)
            .stderr(Stdio::null())
            .output()
            .ok()?;
        let text = String::from_utf8(out.stdout).ok()?;
        (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_owned())
    };
    let commit = git(&["rev-parse", "--short=12", "HEAD"])?;
    // `--git-path` resolves worktrees' own HEAD and the shared refs.
    let mut watched = vec!["HEAD".to_owned(), "packed-refs".to_owned()];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(branch);
    }
    for path in watched {
        // A watched path that does not exist would rerun this script on every build.
        let found = git(&["rev-parse", "--path-format=absolute", "--git-path", &path]);
        if let Some(p) = found.filter(|p| Path::new(p).exists()) {
            println!("cargo::rerun-if-changed={p}");
        }
    }
    Some(commit)
}

/// Builds `ebpf/haltd-ebpf` (cached in its own target dir); returns the object's path.
fn build_gate() -> PathBuf {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let Some(root) = manifest_dir.parent() else {
        fail("CARGO_MANIFEST_DIR has no parent (the daemon crate lives in <workspace>/daemon)")
    };
    let gate = Gate::new(root);
    for input in gate.inputs() {
        println!("cargo::rerun-if-changed={}", input.display());
    }
    if let Err(missing) = haltd_ebpf_build::check_toolchain() {
        fail(&format!(
            "haltd embeds its BPF halt gate, built from {} with the {} toolchain, but {missing}.\n\
             Run `cargo xtask setup` (it installs the nightly, its rust-src and bpf-linker), \
             or set HALTD_BPF_OBJECT to a gate object built by `cargo xtask build-ebpf`.",
            gate.dir().display(),
            haltd_ebpf_build::TOOLCHAIN,
        ));
    }
    run_nested(gate.command(), &gate);
    gate.object()
}

/// Runs the nested cargo; its output shows only if it fails (cargo keeps a build script's
/// stderr), and its stdout must not be read as build-script directives.
fn run_nested(mut c: Command, gate: &Gate) {
    let line = Gate::command_line();
    match c.stdout(Stdio::null()).stderr(Stdio::inherit()).status() {
        Ok(s) if s.success() => {}
        Ok(s) => fail(&format!(
            "building the BPF halt gate failed ({s}): `{line}` in {} (output above). \
             If the toolchain is incomplete, run `cargo xtask setup`.",
            gate.dir().display()
        )),
        Err(e) => fail(&format!("starting `{line}`: {e}")),
    }
}

/// A gate object is a non-empty ELF file.
fn check_object(path: &Path) -> Result<(), String> {
    let mut head = Vec::with_capacity(4);
    fs::File::open(path)
        .and_then(|f| f.take(4).read_to_end(&mut head))
        .map_err(|e| format!("reading the gate object {}: {e}", path.display()))?;
    if head == b"\x7fELF" {
        Ok(())
    } else {
        Err(format!(
            "{} is not a BPF object (empty, or no ELF header); HALTD_BPF_OBJECT must name the \
             file `cargo xtask build-ebpf` built",
            path.display()
        ))
    }
}

/// Stops the build with `message` (cargo shows a build script's stderr when it fails).
fn fail(message: &str) -> ! {
    eprintln!("error: {message}");
    exit(1)
}
