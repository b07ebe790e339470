//! llama.cpp's OpenAI-compatible server (`python -m llama_cpp.server`, the package `cargo
//! xtask setup` installs) on a free loopback port, serving the tiny seeded model
//! (`HALTD_LLAMA_MODEL`): a real inference server with real logprobs and llama.cpp's
//! assistant prefill, for the harness to run against beside the stand-in. Its random weights
//! answer nothing right; the harness reports what it measures all the same.
//!
//! It runs with `--interrupt_requests False` ([`crate::llama::server_args`]).

use std::{env, path::Path, process::Command};

use anyhow::{Context, Result};

use super::{free_port, Backend, Continuation, Proc};
use crate::{
    get_json_here,
    llama::{server_args, LLAMA_MODEL_ALIAS},
};

/// The server, killed on drop, and the backend it is.
#[derive(Debug)]
pub struct LlamaBackend {
    pub proc: Proc,
    pub backend: Backend,
}

/// Starts the server with files in `dir` when `HALTD_PYTHON` and `HALTD_LLAMA_MODEL` are set
/// (as `cargo xtask bench` and `cargo xtask test` set them); `None` otherwise.
pub fn start_if_set_up(dir: &Path) -> Result<Option<LlamaBackend>> {
    let (Some(python), Some(model)) = (
        env::var_os("HALTD_PYTHON"),
        env::var_os("HALTD_LLAMA_MODEL"),
    ) else {
        return Ok(None);
    };
    let port = free_port()?;
    let url = format!("http://127.0.0.1:{port}");
    let mut cmd = Command::new(python);
    cmd.args(["-u", "-m", "llama_cpp.server"])
        .args(server_args(Path::new(&model), port, 2048));
    let probe = format!("{url}/v1/models");
    let proc = Proc::spawn(cmd, dir, "llama", |_| get_json_here(&probe).is_ok())
        .context("starting llama_cpp.server")?;
    Ok(Some(LlamaBackend {
        proc,
        backend: Backend::Server {
            name: "llama.cpp (tiny model)".into(),
            url,
            model: LLAMA_MODEL_ALIAS.into(),
            continuation: Continuation::LlamaCpp,
        },
    }))
}
