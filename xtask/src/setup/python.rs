//! A Python virtual environment with the official `openai` and `anthropic` SDKs and the OpenAI
//! Agents SDK, the integration tests' real clients (`tests/py/openai_client.py`,
//! `tests/py/anthropic_client.py`, `tests/py/openai_agents_loop.py`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::Report;
use crate::{
    ctx::Ctx,
    util::{capture, run},
};

/// An SDK of the test venv, pinned at a version known to work here.
#[derive(Debug, Clone, Copy)]
struct Sdk {
    /// Its PyPI package.
    package: &'static str,
    /// The module it imports as (`openai-agents` imports as `agents`).
    import: &'static str,
    version: &'static str,
}

/// The official SDKs in the test venv. The Agents SDK depends on `openai`: its pin is one that
/// works with `openai`'s.
const PINNED_SDKS: [Sdk; 3] = [
    Sdk {
        package: "openai",
        import: "openai",
        version: "3.57.0",
    },
    Sdk {
        package: "anthropic",
        import: "anthropic",
        version: "2.17.0",
    },
    Sdk {
        package: "openai-agents",
        import: "agents",
        version: "0.24.0",
    },
];

/// The virtual environment that holds the SDKs for the integration tests.
fn venv_dir(ctx: &Ctx) -> PathBuf {
    ctx.home.join(".local/share/haltd/venv")
}

/// The venv's interpreter (`HALTD_PYTHON` for the integration tests).
pub(crate) fn venv_python(ctx: &Ctx) -> PathBuf {
    venv_dir(ctx).join("bin/python")
}

/// Makes sure the venv exists and imports every SDK of [`PINNED_SDKS`] at its pinned version.
/// When one is missing or at another version, one pip run installs them all: pip resolves the
/// pins together, so the dependencies they share (pydantic, the HTTP client) suit both.
pub(super) fn ensure_sdks(ctx: &Ctx, report: &mut Report) -> Result<()> {
    let venv = venv_dir(ctx);
    let mut missing = Vec::new();
    for sdk in PINNED_SDKS {
        let Sdk {
            package, version, ..
        } = sdk;
        match sdk_version(ctx, sdk) {
            Some(v) if v == version => {
                println!("[setup] {package} SDK {v}: present in {}", venv.display());
                report.present(&format!("{package} SDK"));
            }
            Some(v) => {
                println!(
                    "[setup] {package} SDK {v} in {} is not the pinned {version}: reinstalling",
                    venv.display()
                );
                missing.push(package);
            }
            None => {
                println!(
                    "[setup] {package} SDK {version} missing from {}",
                    venv.display()
                );
                missing.push(package);
            }
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    ensure_venv(ctx)?;
    pip_install(ctx)?;
    // All of them, not only the missing ones: the run may have moved a shared dependency.
    for sdk in PINNED_SDKS {
        let Sdk {
            package, version, ..
        } = sdk;
        match sdk_version(ctx, sdk) {
            Some(v) if v == version => {
                if missing.contains(&package) {
                    println!("[setup] {package} SDK {v} installed in {}", venv.display());
                    report.installed(&format!("{package} SDK"));
                }
            }
            other => bail!(
                "pip installed {package}=={version} into {}, but `{} -c '{}'` gives {other:?}",
                venv.display(),
                venv_python(ctx).display(),
                version_probe(sdk)
            ),
        }
    }
    Ok(())
}

/// The Python one-liner that imports `sdk` and prints its package's installed version (from
/// the package's metadata: not every SDK has a `__version__`).
fn version_probe(sdk: Sdk) -> String {
    format!(
        "import {}; from importlib.metadata import version; print(version({:?}))",
        sdk.import, sdk.package
    )
}

/// The version of `sdk` that the venv's interpreter imports; `None` if it cannot.
fn sdk_version(ctx: &Ctx, sdk: Sdk) -> Option<String> {
    capture(ctx.cmd(venv_python(ctx)).arg("-c").arg(version_probe(sdk)))
        .map(|v| v.trim().to_owned())
}

/// A venv whose interpreter runs and has pip is kept; anything else is made anew (`--clear`
/// empties a broken one, e.g. after its base interpreter went away).
fn ensure_venv(ctx: &Ctx) -> Result<()> {
    let venv = venv_dir(ctx);
    let usable = capture(ctx.cmd(venv_python(ctx)).args([
        "-m",
        "pip",
        "--version",
        "--disable-pip-version-check",
    ]))
    .is_some();
    if usable {
        return Ok(());
    }
    // Debian's interpreter, which the python3-venv package completes; else PATH's.
    let base = if Path::new("/usr/bin/python3").is_file() {
        PathBuf::from("/usr/bin/python3")
    } else {
        PathBuf::from("python3")
    };
    let Some(base_version) = capture(ctx.cmd(&base).arg("--version")) else {
        bail!("python3 not found (tried /usr/bin/python3 and PATH {:?}): the integration tests need Python 3 with venv (`apt-get install python3 python3-venv`)", ctx.path);
    };
    if let Some(parent) = venv.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    println!(
        "[setup] creating venv: {} -m venv --clear {} ({})",
        base.display(),
        venv.display(),
        base_version.trim()
    );
    run(ctx.cmd(&base).args(["-m", "venv", "--clear"]).arg(&venv)).with_context(|| {
        format!(
            "could not create the venv at {} (on Debian `python3 -m venv` needs the python3-venv package for ensurepip: `apt-get install python3-venv`)",
            venv.display()
        )
    })
}

/// `pip install` every pin of [`PINNED_SDKS`] into the venv, in one run.
fn pip_install(ctx: &Ctx) -> Result<()> {
    let venv = venv_dir(ctx);
    let requirements: Vec<String> = PINNED_SDKS
        .iter()
        .map(|sdk| format!("{}=={}", sdk.package, sdk.version))
        .collect();
    let shown = requirements.join(" ");
    println!("[setup] pip install {shown} into {}", venv.display());
    run(ctx
        .cmd(venv_python(ctx))
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-input",
        ])
        .args(&requirements))
    .with_context(|| {
        format!(
            "pip could not install {shown} into {} (is PyPI reachable from here?)",
            venv.display()
        )
    })
}
