//! Builds the BPF halt gate, `ebpf/haltd-ebpf`, for `bpfel-unknown-none` with the nightly
//! toolchain: the one recipe behind `daemon/build.rs` (so a plain `cargo build -p haltd` embeds
//! the gate) and `cargo xtask build-ebpf`.
//!
//! Both build into `ebpf/haltd-ebpf/target` with the same command and flags, so whichever runs
//! second finds the object fresh; a differing flag would make them rebuild it in turn.
//!
//! This is cargo-in-cargo, as in aya-build and the aya template (an artifact dependency cannot
//! use `-Z build-std`). The nested cargo gets its own target dir (a shared one would deadlock on
//! the outer cargo's lock, rust-lang/cargo#6412) and an environment without the outer build's
//! cargo, rustc and build-script variables ([`scrub_cargo_env`]).

use std::{
    env,
    ffi::OsString,
    fmt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

/// Toolchain that builds the gate: `-Z build-std=core` needs a nightly (with `rust-src`).
pub const TOOLCHAIN: &str = "nightly";
/// Target of the gate object.
pub const TARGET: &str = "bpfel-unknown-none";
/// BTF (needed by the `sk_storage` map definitions) comes from debug info; bpf-linker turns it
/// into BTF with `--btf`.
pub const RUSTFLAGS: &str = "-C debuginfo=2 -C link-arg=--btf";
/// The gate crate, relative to the workspace root.
const CRATE_DIR: &str = "ebpf/haltd-ebpf";
/// The crate the gate shares its `#[repr(C)]` types with, relative to the workspace root.
const COMMON_DIR: &str = "ebpf/haltd-common";

/// The gate crate of one checkout.
#[derive(Debug, Clone)]
pub struct Gate {
    root: PathBuf,
}

impl Gate {
    /// The gate of the workspace at `workspace_root`.
    pub fn new(workspace_root: &Path) -> Self {
        Self {
            root: workspace_root.to_path_buf(),
        }
    }

    /// The gate crate's folder.
    pub fn dir(&self) -> PathBuf {
        self.root.join(CRATE_DIR)
    }

    /// The nested build's target dir: the crate's own, whatever `CARGO_TARGET_DIR` or
    /// `build.target-dir` say for the outer build.
    pub fn target_dir(&self) -> PathBuf {
        self.dir().join("target")
    }

    /// Where [`Gate::command`] leaves the object.
    pub fn object(&self) -> PathBuf {
        self.target_dir().join(TARGET).join("release/haltd-ebpf")
    }

    /// What the object is built from: the gate crate and `haltd-common` (for
    /// `cargo:rerun-if-changed`). The root `Cargo.toml` is left out: `haltd-common` takes only
    /// its version, edition and licence from it.
    pub fn inputs(&self) -> Vec<PathBuf> {
        let gate = self.dir();
        let common = self.root.join(COMMON_DIR);
        vec![
            gate.join("src"),
            gate.join("Cargo.toml"),
            gate.join("Cargo.lock"),
            common.join("src"),
            common.join("Cargo.toml"),
        ]
    }

    /// `rustup run nightly cargo build --release --target bpfel-unknown-none -Z build-std=core`
    /// in the gate crate, with `RUSTFLAGS` [`RUSTFLAGS`] and a scrubbed environment.
    pub fn command(&self) -> Command {
        let mut c = toolchain_command("cargo");
        c.current_dir(self.dir())
            .args([
                "build",
                "--release",
                "--target",
                TARGET,
                "-Z",
                "build-std=core",
            ])
            .arg("--target-dir")
            .arg(self.target_dir())
            .env("RUSTFLAGS", RUSTFLAGS);
        c
    }

    /// The command line [`Gate::command`] runs, for progress lines.
    pub fn command_line() -> String {
        format!("cargo +{TOOLCHAIN} build --release --target {TARGET} -Z build-std=core")
    }
}

/// What the gate build needs and is not there; `cargo xtask setup` installs each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Missing {
    /// `rustup` does not run.
    Rustup,
    /// `rustup run nightly rustc` does not run.
    Nightly,
    /// The nightly has no `rust-src`, which `-Z build-std=core` needs.
    RustSrc { sysroot: PathBuf },
    /// `bpf-linker --version` does not run.
    BpfLinker,
}

impl fmt::Display for Missing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Rustup => write!(f, "rustup is not on PATH ({})", tool_path().display()),
            Self::Nightly => write!(f, "the {TOOLCHAIN} toolchain is not installed"),
            Self::RustSrc { sysroot } => write!(
                f,
                "the {TOOLCHAIN} toolchain at {} has no rust-src (`-Z build-std=core` needs it)",
                sysroot.display()
            ),
            Self::BpfLinker => write!(f, "bpf-linker is not on PATH ({})", tool_path().display()),
        }
    }
}

impl std::error::Error for Missing {}

/// Checks that the nightly toolchain, its `rust-src` and bpf-linker are there.
///
/// # Errors
///
/// The first of them that is missing.
pub fn check_toolchain() -> Result<(), Missing> {
    if capture(
        Command::new("rustup")
            .arg("--version")
            .env("PATH", tool_path()),
    )
    .is_none()
    {
        return Err(Missing::Rustup);
    }
    let sysroot =
        capture(toolchain_command("rustc").args(["--print", "sysroot"])).ok_or(Missing::Nightly)?;
    let sysroot = PathBuf::from(sysroot.trim());
    if !sysroot.join("lib/rustlib/src/rust/library").is_dir() {
        return Err(Missing::RustSrc { sysroot });
    }
    let mut linker = Command::new("bpf-linker");
    linker.arg("--version").env("PATH", tool_path());
    scrub_cargo_env(&mut linker);
    if capture(&mut linker).is_none() {
        return Err(Missing::BpfLinker);
    }
    Ok(())
}

/// `rustup run nightly <program>` with [`tool_path`] and a scrubbed environment.
pub fn toolchain_command(program: &str) -> Command {
    let mut c = Command::new("rustup");
    c.args(["run", TOOLCHAIN, program]).env("PATH", tool_path());
    scrub_cargo_env(&mut c);
    c
}

/// `PATH` with `$CARGO_HOME/bin` (rustup's proxies, bpf-linker) first: a build script or
/// `cargo run` may have a `PATH` without it.
pub fn tool_path() -> OsString {
    let cargo_home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    let mut dirs: Vec<PathBuf> = cargo_home.map(|h| h.join("bin")).into_iter().collect();
    for dir in env::split_paths(&env::var_os("PATH").unwrap_or_default()) {
        if !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    // An entry with a ':' cannot be joined; leave PATH as it is then.
    env::join_paths(dirs).unwrap_or_else(|_| env::var_os("PATH").unwrap_or_default())
}

/// Removes from `c`'s environment what an outer cargo (`cargo run` for xtask, or the cargo
/// running `daemon/build.rs`) put there, so a nested cargo for another toolchain and target
/// starts clean: `CARGO_*` (`CARGO_TARGET_DIR`, `CARGO_BUILD_*`, `CARGO_ENCODED_RUSTFLAGS`,
/// which would override `RUSTFLAGS`, ...), the rustc and rustup variables (`RUSTC_WRAPPER`,
/// clippy's `RUSTC_WORKSPACE_WRAPPER`, `RUSTUP_TOOLCHAIN`, `RUSTFLAGS`, ...), the variables
/// cargo sets for build scripts, and the outer toolchain's and target dir's library folders in
/// `LD_LIBRARY_PATH`. Kept: `CARGO_HOME`, network, registry and terminal settings, and
/// `CARGO_MAKEFLAGS`, the jobserver, so a nested build in a build script shares the outer `-j`.
pub fn scrub_cargo_env(c: &mut Command) {
    for (key, _) in env::vars_os() {
        if key.to_str().is_some_and(is_outer_build_var) {
            c.env_remove(&key);
        }
    }
    if let Some(ld) = env::var_os("LD_LIBRARY_PATH") {
        let kept: Vec<PathBuf> = env::split_paths(&ld)
            .filter(|p| {
                let p = p.to_string_lossy();
                !p.contains("/toolchains/") && !p.contains("/target/")
            })
            .collect();
        match env::join_paths(kept) {
            Ok(v) if !v.is_empty() => c.env("LD_LIBRARY_PATH", v),
            _ => c.env_remove("LD_LIBRARY_PATH"),
        };
    }
}

/// Whether [`scrub_cargo_env`] removes the variable `key`.
fn is_outer_build_var(key: &str) -> bool {
    const KEEP: &[&str] = &[
        "CARGO_HOME",
        "CARGO_NET_",
        "CARGO_HTTP_",
        "CARGO_REGISTRY_",
        "CARGO_REGISTRIES_",
        "CARGO_TERM_",
        "CARGO_MAKEFLAGS",
    ];
    const RUST: &[&str] = &[
        "RUSTC",
        "RUSTDOC",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTC_LINKER",
        "RUSTUP_TOOLCHAIN",
        "RUSTFLAGS",
        "RUSTDOCFLAGS",
    ];
    // Set by cargo for build scripts; the nested cargo sets its own for its build scripts.
    const BUILD_SCRIPT: &[&str] = &[
        "OUT_DIR",
        "TARGET",
        "HOST",
        "NUM_JOBS",
        "OPT_LEVEL",
        "PROFILE",
        "DEBUG",
    ];
    let cargo = (key == "CARGO" || key.starts_with("CARGO_") || key.starts_with("__CARGO"))
        && !KEEP.iter().any(|p| key.starts_with(p));
    cargo || RUST.contains(&key) || BUILD_SCRIPT.contains(&key) || key.starts_with("CLIPPY_")
}

/// Stdout of a command that succeeded; `None` if it could not start or failed.
fn capture(c: &mut Command) -> Option<String> {
    let out = c.stdin(Stdio::null()).stderr(Stdio::null()).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::is_outer_build_var;

    #[test]
    fn scrubs_the_outer_build_and_keeps_the_jobserver_and_network() {
        for var in [
            "CARGO",
            "CARGO_TARGET_DIR",
            "CARGO_BUILD_TARGET",
            "CARGO_ENCODED_RUSTFLAGS",
            "CARGO_MANIFEST_DIR",
            "__CARGO_FIX_PLZ",
            "RUSTFLAGS",
            "RUSTC_WRAPPER",
            "RUSTC_WORKSPACE_WRAPPER",
            "RUSTUP_TOOLCHAIN",
            "OUT_DIR",
            "CLIPPY_ARGS",
        ] {
            assert!(is_outer_build_var(var), "{var} is kept");
        }
        for var in [
            "CARGO_HOME",
            "CARGO_MAKEFLAGS",
            "CARGO_NET_OFFLINE",
            "CARGO_TERM_COLOR",
            "PATH",
            "HOME",
            "RUSTUP_HOME",
        ] {
            assert!(!is_outer_build_var(var), "{var} is removed");
        }
    }
}
