//! `cargo xtask setup`: installs what is missing, idempotently, and says what was present or
//! installed. Each sub-step checks first and fails with what to do when it cannot install.

mod llama;
mod packages;
mod python;
mod toolchain;

use std::{fs, path::Path, process::Command};

use anyhow::Result;

pub(crate) use self::{llama::model_path as llama_model_path, python::venv_python};
use crate::{ctx::Ctx, util::is_root};

/// What setup found present and what it installed, for its summary line.
#[derive(Debug, Default)]
struct Report {
    present: Vec<String>,
    installed: Vec<String>,
}

impl Report {
    fn present(&mut self, what: &str) {
        self.present.push(what.to_owned());
    }

    fn installed(&mut self, what: &str) {
        self.installed.push(what.to_owned());
    }

    fn summary(&self) -> String {
        let or = |list: &[String], none: &str| {
            if list.is_empty() {
                none.to_owned()
            } else {
                list.join(", ")
            }
        };
        format!(
            "setup: ok (present: {}; installed: {})",
            or(&self.present, "-"),
            or(&self.installed, "nothing")
        )
    }
}

/// Whether setup also installs the real inference server (llama.cpp's, compiled by pip: about
/// 10 minutes the first time) and makes its model: `cargo xtask setup` and `test` do, since
/// the integration tests serve it; building, running or benching haltd does not need it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RealBackend {
    Install,
    Skip,
}

/// Setup without the real inference server.
pub(crate) fn setup(ctx: &Ctx) -> Result<()> {
    setup_with(ctx, RealBackend::Skip)
}

pub(crate) fn setup_with(ctx: &Ctx, real_backend: RealBackend) -> Result<()> {
    let mut report = Report::default();
    packages::ensure(ctx, &mut report)?;
    let sysroot = toolchain::ensure_nightly(ctx, &mut report)?;
    toolchain::ensure_bpf_linker(ctx, &sysroot, &mut report)?;
    python::ensure_sdks(ctx, &mut report)?;
    if real_backend == RealBackend::Install {
        llama::ensure_server(ctx, &mut report)?;
        llama::ensure_model(ctx, &mut report)?;
    }
    ensure_bpffs(&mut report);
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        println!(
            "[setup] warning: /sys/kernel/btf/vmlinux is missing; the gate needs a kernel with BTF"
        );
    }
    println!("{}", report.summary());
    Ok(())
}

/// Mounts bpffs at /sys/fs/bpf unless it is there (only pinned maps need it; failure is a note).
fn ensure_bpffs(report: &mut Report) {
    if bpffs_mounted() {
        println!("[setup] bpffs: mounted at /sys/fs/bpf");
        report.present("bpffs");
    } else if !is_root() {
        println!("[setup] bpffs: not mounted at /sys/fs/bpf and not root; skipped");
    } else {
        match Command::new("mount").args(["-t", "bpf", "bpf", "/sys/fs/bpf"]).status() {
            Ok(s) if s.success() => {
                println!("[setup] bpffs: mounted at /sys/fs/bpf");
                report.installed("bpffs mount");
            }
            other => println!("[setup] bpffs: `mount -t bpf bpf /sys/fs/bpf` failed ({other:?}); only pinned maps need it"),
        }
    }
}

fn bpffs_mounted() -> bool {
    fs::read_to_string("/proc/mounts").is_ok_and(|m| {
        m.lines().any(|l| {
            l.split_whitespace().nth(1) == Some("/sys/fs/bpf")
                && l.split_whitespace().nth(2) == Some("bpf")
        })
    })
}
