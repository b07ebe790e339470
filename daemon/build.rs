//! Embeds the halt-gate BPF object when `cargo xtask build-ebpf` has produced one.
//!
//! `cargo xtask` sets `HALTD_BPF_OBJECT` to the object it built. Without it (a plain
//! `cargo build`, clippy, docs) the daemon still compiles, with an empty embedded object; such
//! a binary refuses to start unless it is given `--bpf-object PATH` or `--no-kernel-gate`
//! (fail closed), so a missing gate is never silent.
use std::{env, fs, path::PathBuf};

fn main() {
    println!("cargo:rerun-if-env-changed=HALTD_BPF_OBJECT");
    let out =
        PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("haltd-gate.bpf.o");
    match env::var_os("HALTD_BPF_OBJECT") {
        Some(path) => {
            let path = PathBuf::from(path);
            println!("cargo:rerun-if-changed={}", path.display());
            let bytes = fs::read(&path)
                .unwrap_or_else(|e| panic!("reading HALTD_BPF_OBJECT {}: {e}", path.display()));
            fs::write(&out, bytes).expect("writing embedded BPF object");
        }
        None => fs::write(&out, []).expect("writing empty BPF object placeholder"),
    }
}
