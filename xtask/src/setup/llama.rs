//! llama.cpp's OpenAI-compatible server (`python -m llama_cpp.server`, from the PyPI package
//! `llama-cpp-python`, pinned) in the test venv, and the tiny model it serves, made from a
//! seed by `tests/llama/make_model.py`: the real inference server of the `real_backend`
//! integration tests (docs/building.md).
//!
//! pip compiles llama.cpp from source (about 10 minutes on 2 cores) and keeps the wheel in its
//! cache; a venv that already imports the pinned version is kept. The model is cached under
//! the name of the script's hash and the seed, so a changed script makes a new one and an
//! unchanged one is never rebuilt.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::{python::venv_python, Report};
use crate::{
    ctx::Ctx,
    util::{capture, run},
};

/// Version of `llama-cpp-python` (llama.cpp's engine and its OpenAI server), pinned.
pub(crate) const LLAMA_CPP_PYTHON_VERSION: &str = "0.3.36";
/// The packages `make_model.py` writes the model with, pinned so that a seed gives one file.
const MODEL_PACKAGES: [&str; 2] = ["gguf==0.19.0", "numpy==2.4.6"];
/// llama.cpp built for any x86-64 machine (no `-march=native`) and without a BLAS.
const CMAKE_ARGS: &str = "-DGGML_NATIVE=OFF -DGGML_BLAS=OFF";
/// The model generator, relative to the workspace root.
const MODEL_SCRIPT: &str = "tests/llama/make_model.py";
/// The seed of the tests' model.
const MODEL_SEED: u32 = 17;

/// What the venv must import for the server and the model script; prints the versions.
const PROBE: &str = "import importlib.metadata as m, llama_cpp, gguf, numpy, uvicorn, fastapi, \
sse_starlette; print(llama_cpp.__version__, m.version('gguf'), numpy.__version__)";

/// Makes sure the venv (made by the SDK step) holds the pinned server and model packages.
pub(super) fn ensure_server(ctx: &Ctx, report: &mut Report) -> Result<()> {
    let want = format!(
        "{LLAMA_CPP_PYTHON_VERSION} {} {}",
        pinned(MODEL_PACKAGES[0]),
        pinned(MODEL_PACKAGES[1])
    );
    let have = installed(ctx);
    if have.as_deref() == Some(want.as_str()) {
        println!(
            "[setup] llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (server), gguf, numpy: present"
        );
        report.present("llama.cpp server");
        return Ok(());
    }
    println!(
        "[setup] llama-cpp-python[server]=={LLAMA_CPP_PYTHON_VERSION} with {MODEL_PACKAGES:?}: have {have:?}; installing (pip compiles llama.cpp once, about 10 minutes on 2 cores, then reuses its cached wheel)"
    );
    run(ctx
        .cmd(venv_python(ctx))
        .args(["-m", "pip", "install", "--disable-pip-version-check", "--no-input"])
        .arg(format!("llama-cpp-python[server]=={LLAMA_CPP_PYTHON_VERSION}"))
        .args(MODEL_PACKAGES)
        .env("CMAKE_ARGS", CMAKE_ARGS))
    .context("pip could not install llama-cpp-python[server] (is PyPI reachable, and are cmake and a C++ compiler installed?)")?;
    match installed(ctx) {
        Some(v) if v == want => println!("[setup] llama-cpp-python, gguf, numpy: installed ({v})"),
        other => bail!("after pip install, the venv imports {other:?}, not {want:?}"),
    }
    report.installed("llama.cpp server");
    Ok(())
}

/// The version after `==` of a pinned requirement.
fn pinned(req: &str) -> &str {
    req.split_once("==").map_or(req, |(_, v)| v)
}

/// `"<llama-cpp-python> <gguf> <numpy>"` as the venv imports them; `None` if it cannot.
fn installed(ctx: &Ctx) -> Option<String> {
    capture(ctx.cmd(venv_python(ctx)).args(["-c", PROBE])).map(|v| v.trim().to_owned())
}

/// Where the tests' model is cached: named by the seed and the generator's hash.
pub(crate) fn model_path(ctx: &Ctx) -> Result<PathBuf> {
    let script = ctx.root.join(MODEL_SCRIPT);
    let text = std::fs::read(&script).with_context(|| format!("reading {}", script.display()))?;
    Ok(ctx.home.join(format!(
        ".local/share/haltd/models/tiny-llama-s{MODEL_SEED}-{:016x}.gguf",
        fnv1a(&text)
    )))
}

/// Makes the model unless the cache has it.
pub(super) fn ensure_model(ctx: &Ctx, report: &mut Report) -> Result<()> {
    let path = model_path(ctx)?;
    if path.is_file() {
        println!("[setup] tiny llama model: present at {}", path.display());
        report.present("llama model");
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    println!(
        "[setup] tiny llama model: writing {} (seed {MODEL_SEED})",
        path.display()
    );
    run(ctx
        .cmd(venv_python(ctx))
        .arg(ctx.root.join(MODEL_SCRIPT))
        .arg("--out")
        .arg(&path)
        .args(["--seed", &MODEL_SEED.to_string()]))
    .context("tests/llama/make_model.py could not write the model")?;
    ensure_written(&path)?;
    report.installed("llama model");
    Ok(())
}

fn ensure_written(path: &Path) -> Result<()> {
    let len = std::fs::metadata(path)
        .with_context(|| format!("the model script wrote no {}", path.display()))?
        .len();
    if len < 1024 {
        bail!("{} is {len} bytes: not a model", path.display());
    }
    Ok(())
}

/// FNV-1a, 64 bits: a cache key, not a checksum against tampering.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
