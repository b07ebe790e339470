//! Where things are, worked out once per run from `cargo metadata`.

use std::{
    env,
    ffi::{OsStr, OsString},
    path::PathBuf,
    process::Command,
};

use anyhow::{Context, Result};
use cargo_metadata::{Metadata, MetadataCommand, TargetKind};
use haltd_ebpf_build::Gate;

#[derive(Debug)]
pub(crate) struct Ctx {
    /// The workspace root.
    pub(crate) root: PathBuf,
    /// The workspace's target dir (`CARGO_TARGET_DIR` and `build.target-dir` included).
    pub(crate) target_dir: PathBuf,
    /// `PATH` for children, with `$CARGO_HOME/bin` (rustup proxies, bpf-linker) in it.
    pub(crate) path: OsString,
    pub(crate) home: PathBuf,
    /// The BPF gate crate and its build.
    pub(crate) gate: Gate,
    metadata: Metadata,
}

impl Ctx {
    pub(crate) fn new() -> Result<Self> {
        let metadata = MetadataCommand::new()
            .manifest_path(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
            .no_deps()
            .exec()
            .context("running `cargo metadata` for the workspace")?;
        let root = metadata.workspace_root.clone().into_std_path_buf();
        let home = PathBuf::from(env::var_os("HOME").context("HOME is not set")?);
        Ok(Ctx {
            target_dir: metadata.target_directory.clone().into_std_path_buf(),
            gate: Gate::new(&root),
            path: haltd_ebpf_build::tool_path(),
            root,
            home,
            metadata,
        })
    }

    /// A command with our `PATH`.
    pub(crate) fn cmd(&self, program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new(program);
        c.env("PATH", &self.path);
        c
    }

    /// The cargo that runs xtask (same toolchain), in the workspace root.
    pub(crate) fn cargo(&self) -> Command {
        let mut c = self.cmd(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
        c.current_dir(&self.root);
        c
    }

    /// The cargo that runs xtask with `HALTD_BPF_OBJECT` set, so the daemon's build script
    /// embeds this object instead of building the gate itself.
    pub(crate) fn cargo_with_gate(&self, object: &std::path::Path) -> Command {
        let mut c = self.cargo();
        c.env("HALTD_BPF_OBJECT", object);
        c
    }

    /// (package, binary) for every binary target in the workspace.
    pub(crate) fn workspace_bins(&self) -> Vec<(String, String)> {
        self.metadata
            .workspace_packages()
            .into_iter()
            .flat_map(|pkg| {
                pkg.targets
                    .iter()
                    .filter(|t| t.kind.contains(&TargetKind::Bin))
                    .map(|t| (pkg.name.to_string(), t.name.clone()))
            })
            .collect()
    }
}
