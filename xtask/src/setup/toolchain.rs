//! The nightly toolchain with `rust-src`, and bpf-linker built against the nightly's LLVM
//! (docs/building.md): what the BPF gate build needs.

use std::{
    ffi::OsStr,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use haltd_ebpf_build::{scrub_cargo_env, toolchain_command, TOOLCHAIN};

use super::Report;
use crate::{
    ctx::Ctx,
    util::{capture, is_elf, run},
};

/// bpf-linker release verified with the nightly's LLVM 22 (docs/building.md).
const BPF_LINKER_VERSION: &str = "0.13.0";
/// LLVM major version of the nightly toolchain and of bpf-linker's `llvm-22` feature.
const LLVM_MAJOR: &str = "22";

/// Makes sure the nightly toolchain and its rust-src are there; returns its sysroot.
pub(super) fn ensure_nightly(ctx: &Ctx, report: &mut Report) -> Result<PathBuf> {
    if capture(ctx.cmd("rustup").arg("--version")).is_none() {
        bail!("rustup not found on PATH ({:?}): haltd needs rustup with a stable (>= 1.95) and a nightly toolchain with LLVM {LLVM_MAJOR}", ctx.path);
    }
    let sysroot = match nightly_sysroot() {
        Some(s) => {
            report.present("nightly");
            s
        }
        None => install_nightly(ctx, report)?,
    };
    if sysroot.join("lib/rustlib/src/rust/library").is_dir() {
        println!("[setup] nightly: {} (rust-src present)", sysroot.display());
        report.present("rust-src");
    } else {
        println!(
            "[setup] nightly rust-src missing: rustup component add rust-src --toolchain nightly"
        );
        run(ctx.cmd("rustup").args(["component", "add", "rust-src", "--toolchain", TOOLCHAIN]))
            .context("could not add rust-src to the nightly toolchain (is static.rust-lang.org reachable?); `-Z build-std=core` needs it")?;
        report.installed("rust-src");
    }
    Ok(sysroot)
}

fn nightly_sysroot() -> Option<PathBuf> {
    let out = capture(toolchain_command("rustc").args(["--print", "sysroot"]))?;
    Some(PathBuf::from(out.trim()))
}

fn install_nightly(ctx: &Ctx, report: &mut Report) -> Result<PathBuf> {
    println!("[setup] nightly toolchain missing: rustup toolchain install nightly");
    run(ctx.cmd("rustup").args(["toolchain", "install", TOOLCHAIN, "--profile", "minimal", "--component", "rust-src"]))
        .with_context(|| {
            format!("could not install the nightly toolchain (is static.rust-lang.org reachable from here?); the BPF build needs a nightly with LLVM {LLVM_MAJOR} and rust-src (tested: nightly 1.97, 2026-05-19)")
        })?;
    report.installed("nightly");
    nightly_sysroot()
        .context("the nightly toolchain was installed but `rustc --print sysroot` still fails")
}

pub(super) fn ensure_bpf_linker(ctx: &Ctx, sysroot: &Path, report: &mut Report) -> Result<()> {
    if let Some(v) = capture(ctx.cmd("bpf-linker").arg("--version")) {
        println!("[setup] {}: present", v.trim());
        report.present("bpf-linker");
        return Ok(());
    }
    // Build bpf-linker against the nightly's own libLLVM (docs/building.md).
    let lib = find_libllvm(&sysroot.join("lib"))?;
    let prefix = llvm_prefix(ctx, &lib)?;
    println!(
        "[setup] bpf-linker missing: building {BPF_LINKER_VERSION} against {} (LLVM_PREFIX={})",
        lib.display(),
        prefix.display()
    );
    let mut c = ctx.cmd("cargo");
    c.args([
        "install",
        "bpf-linker",
        "--version",
        BPF_LINKER_VERSION,
        "--locked",
        "--no-default-features",
        "--features",
    ])
    .arg(format!("llvm-{LLVM_MAJOR}"));
    scrub_cargo_env(&mut c);
    c.env("LLVM_PREFIX", &prefix);
    run(&mut c).context("building bpf-linker failed")?;
    let v = capture(ctx.cmd("bpf-linker").arg("--version"))
        .context("bpf-linker was installed but `bpf-linker --version` fails (its rpath needs ~/.local/share/haltd/llvm/lib)")?;
    println!("[setup] {} installed", v.trim());
    report.installed("bpf-linker");
    Ok(())
}

/// An `LLVM_PREFIX` for bpf-linker's build: `~/.local/share/haltd/llvm/lib` with links to the
/// nightly's libLLVM `lib`, after checking it is LLVM [`LLVM_MAJOR`].
fn llvm_prefix(ctx: &Ctx, lib: &Path) -> Result<PathBuf> {
    let name = lib
        .file_name()
        .context("libLLVM path has a file name")?
        .to_owned();
    let major = name
        .to_string_lossy()
        .trim_start_matches("libLLVM.so.")
        .split('.')
        .next()
        .unwrap_or_default()
        .to_owned();
    if major != LLVM_MAJOR {
        bail!("the nightly's libLLVM is {} (LLVM {major}); bpf-linker is built here with its llvm-{LLVM_MAJOR} feature: install a nightly with LLVM {LLVM_MAJOR} (e.g. nightly-2026-05-19)", lib.display());
    }
    let prefix = ctx.home.join(".local/share/haltd/llvm");
    let libdir = prefix.join("lib");
    fs::create_dir_all(&libdir).with_context(|| format!("creating {}", libdir.display()))?;
    for link in [OsStr::new("libLLVM.so"), name.as_os_str()] {
        symlink(lib, &libdir.join(link))?;
    }
    Ok(prefix)
}

/// Makes `at` a symlink to `target`, replacing a stale one.
fn symlink(target: &Path, at: &Path) -> Result<()> {
    if fs::read_link(at).is_ok_and(|t| t == target) {
        return Ok(());
    }
    if fs::symlink_metadata(at).is_ok() {
        fs::remove_file(at).with_context(|| format!("removing stale {}", at.display()))?;
    }
    std::os::unix::fs::symlink(target, at)
        .with_context(|| format!("symlinking {} -> {}", at.display(), target.display()))
}

/// The real `libLLVM.so.<version>` ELF file in the nightly's lib dir (not the small
/// `libLLVM-22-rust-*.so` linker script next to it).
fn find_libllvm(libdir: &Path) -> Result<PathBuf> {
    let entries = fs::read_dir(libdir).with_context(|| format!("reading {}", libdir.display()))?;
    for entry in entries {
        let path = entry?.path();
        let is_candidate = path
            .file_name()
            .and_then(OsStr::to_str)
            .is_some_and(|n| n.starts_with("libLLVM.so."));
        if is_candidate && is_elf(&path) {
            return Ok(path);
        }
    }
    bail!(
        "no libLLVM.so.<version> ELF library in {}; the nightly toolchain looks incomplete",
        libdir.display()
    )
}
