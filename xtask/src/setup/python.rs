//! A Python virtual environment with the official `openai` SDK, the integration tests' real
//! client (`tests/py/openai_client.py`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::Report;
use crate::{
    ctx::Ctx,
    util::{capture, run},
};

/// Version of the official `openai` Python SDK in the test venv (pinned; known to work here).
const OPENAI_SDK_VERSION: &str = "3.57.0";

/// The virtual environment that holds the `openai` SDK for the integration tests.
fn venv_dir(ctx: &Ctx) -> PathBuf {
    ctx.home.join(".local/share/haltd/venv")
}

/// The venv's interpreter (`HALTD_PYTHON` for the integration tests).
pub(crate) fn venv_python(ctx: &Ctx) -> PathBuf {
    venv_dir(ctx).join("bin/python")
}

/// Makes sure the venv exists and holds `openai==OPENAI_SDK_VERSION`.
pub(super) fn ensure_openai_sdk(ctx: &Ctx, report: &mut Report) -> Result<()> {
    let venv = venv_dir(ctx);
    match sdk_version(ctx) {
        Some(v) if v == OPENAI_SDK_VERSION => {
            println!("[setup] openai SDK {v}: present in {}", venv.display());
            report.present("openai SDK");
            return Ok(());
        }
        Some(v) => println!(
            "[setup] openai SDK {v} in {} is not the pinned {OPENAI_SDK_VERSION}: reinstalling",
            venv.display()
        ),
        None => println!(
            "[setup] openai SDK {OPENAI_SDK_VERSION} missing from {}",
            venv.display()
        ),
    }
    ensure_venv(ctx)?;
    pip_install(ctx)?;
    match sdk_version(ctx) {
        Some(v) if v == OPENAI_SDK_VERSION => {
            println!("[setup] openai SDK {v} installed in {}", venv.display());
        }
        other => bail!(
            "pip installed openai=={OPENAI_SDK_VERSION} into {}, but `{} -c 'import openai; print(openai.__version__)'` gives {other:?}",
            venv.display(),
            venv_python(ctx).display()
        ),
    }
    report.installed("openai SDK");
    Ok(())
}

/// The SDK version the venv's interpreter imports; `None` if it cannot.
fn sdk_version(ctx: &Ctx) -> Option<String> {
    capture(
        ctx.cmd(venv_python(ctx))
            .args(["-c", "import openai; print(openai.__version__)"]),
    )
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

fn pip_install(ctx: &Ctx) -> Result<()> {
    let venv = venv_dir(ctx);
    println!(
        "[setup] pip install openai=={OPENAI_SDK_VERSION} into {}",
        venv.display()
    );
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
        .arg(format!("openai=={OPENAI_SDK_VERSION}")))
    .with_context(|| {
        format!(
            "pip could not install openai=={OPENAI_SDK_VERSION} into {} (is PyPI reachable from here?)",
            venv.display()
        )
    })
}
