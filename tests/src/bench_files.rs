//! Where a bench finds the binaries built beside it and writes its report.

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};

/// A binary of this package, next to the running executable.
pub fn sibling(name: &str) -> Result<String> {
    let exe = std::env::current_exe().context("locating this executable")?;
    let path = exe.with_file_name(name);
    ensure!(
        path.is_file(),
        "{} is missing: build the package's binaries",
        path.display()
    );
    Ok(path.display().to_string())
}

/// `target/bench/<file>` when the running executable lies in `target/<profile>/` (`release`
/// or `debug`), else `./target/bench/<file>`.
pub fn default_out(file: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating this executable")?;
    let target = exe
        .parent()
        .filter(|d| {
            d.file_name()
                .is_some_and(|n| n == "release" || n == "debug")
        })
        .and_then(Path::parent)
        .map_or_else(|| PathBuf::from("target"), Path::to_path_buf);
    Ok(target.join("bench").join(file))
}

/// Writes `report` as pretty JSON to `out`, or to [`default_out`]`(file)` without one
/// (creating its directory), and says where on stderr.
pub fn write_report(out: Option<PathBuf>, file: &str, report: &serde_json::Value) -> Result<()> {
    let path = match out {
        Some(p) => p,
        None => default_out(file)?,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(&path, serde_json::to_string_pretty(report)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!("report: {}", path.display());
    Ok(())
}
