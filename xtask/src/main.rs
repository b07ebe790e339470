//! `cargo xtask <task>`: haltd's developer and CI tasks.
//!
//! Every task that builds or runs something first runs `setup`, which is idempotent: it checks
//! what is present and installs only what is missing, so `cargo xtask run` and
//! `cargo xtask test` work on a fresh Debian machine with rustup (stable + nightly). Setup also
//! keeps a Python virtual environment with the official `openai` SDK at
//! `~/.local/share/haltd/venv`, which the integration tests use as a real client.
//!
//! Nested cargo runs inherit stdio, so their progress shows as it happens.

use std::{
    env,
    ffi::{OsStr, OsString},
    fs,
    io::Read,
    os::unix::{fs::MetadataExt, process::CommandExt},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

/// Debian packages the tasks and tests need, with the reason (shown when one is installed).
const DEBIAN_PACKAGES: &[(&str, &str)] = &[
    (
        "iproute2",
        "`ip netns` and veth pairs for the namespace tests",
    ),
    ("iputils-ping", "reachability checks in the namespace tests"),
    ("curl", "the quick-start demo"),
    ("ca-certificates", "HTTPS to crates.io"),
    (
        "python3-venv",
        "client checks with the official OpenAI Python SDK",
    ),
    (
        "build-essential",
        "the C linker rustc needs for host binaries",
    ),
    (
        "prometheus",
        "promtool (checks of deploy/prometheus and of /metrics) and the Prometheus server for the ops-pack tests",
    ),
    (
        "systemd",
        "systemd-analyze, which checks deploy/systemd/haltd.service in the ops-pack tests",
    ),
];

/// bpf-linker release verified with the nightly's LLVM 22 (notes/ebpf-toolchain.md).
const BPF_LINKER_VERSION: &str = "0.13.0";
/// LLVM major version of the nightly toolchain and of bpf-linker's `llvm-22` feature.
const LLVM_MAJOR: &str = "22";
const EBPF_TARGET: &str = "bpfel-unknown-none";
const EBPF_RUSTFLAGS: &str = "-C debuginfo=2 -C link-arg=--btf";
/// Version of the official `openai` Python SDK in the test venv (pinned; known to work here).
const OPENAI_SDK_VERSION: &str = "3.57.0";
/// The Python client the integration tests run, relative to the workspace root.
const OPENAI_CLIENT_SCRIPT: &str = "tests/py/openai_client.py";

/// Benches run by `cargo xtask bench`: (package, binary). A bench not written yet is skipped.
/// All binaries of a bench's package are built first: a bench may run its siblings
/// (`bench-halt-slo` runs `bench-gate-send` and `bench-proxy-overhead`, which runs
/// `scripted-upstream` and `bench-proxy`). The first one is the halt SLO bench, and the
/// arguments after `cargo xtask bench --` go to it.
const BENCHES: &[(&str, &str)] = &[
    ("haltd-tests", "bench-halt-slo"),
    ("haltd-tests", "bench-detectors"),
];

#[derive(Debug, Parser)]
#[command(
    name = "cargo xtask",
    about = "haltd developer and CI tasks",
    long_about = "haltd developer and CI tasks. `run` and `test` do all set-up themselves."
)]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// Install what is missing: Debian packages, nightly rust-src, bpf-linker, the openai SDK
    /// venv; mount bpffs.
    Setup,
    /// Build the BPF halt gate (nightly, bpfel-unknown-none, with BTF).
    BuildEbpf,
    /// Build the BPF gate, then haltd and haltctl with the gate embedded.
    Build(BuildArgs),
    /// Build a release haltd and run it on localhost with the built-in token source.
    Run {
        /// Extra arguments for `haltd serve` (after `--`); they override the defaults.
        #[arg(last = true)]
        args: Vec<OsString>,
    },
    /// Unit and property tests, then the root-only integration tests (serially).
    Test(TestArgs),
    /// Build a release haltd with fault injection and run the benches: the halt SLO bench
    /// (with the gate cost per send and the streaming overhead), then the detector cost.
    Bench {
        /// Extra arguments for `bench-halt-slo` (after `--`), e.g. `--quick` or
        /// `--streams 1,100`.
        #[arg(last = true)]
        args: Vec<OsString>,
    },
    /// Build the BPF gate and have haltd load and attach it once (`haltd check-gate`).
    Load,
}

#[derive(Debug, Args)]
struct BuildArgs {
    /// Release profile (target/release) instead of debug.
    #[arg(long)]
    release: bool,
    /// haltd features; default `fault-injection` (the test and bench build). Repeatable or
    /// comma-separated; pass `--features ''` for a production build.
    #[arg(long, value_delimiter = ',', default_value = "fault-injection")]
    features: Vec<String>,
}

#[derive(Debug, Args)]
struct TestArgs {
    /// Run the integration tests against a release haltd instead of a debug one.
    #[arg(long)]
    release: bool,
    /// Skip the unit and property tests.
    #[arg(long)]
    no_unit: bool,
    /// Skip the root-only integration tests.
    #[arg(long)]
    no_integration: bool,
    /// Arguments for the integration test binary (after `--`), e.g. a test name filter.
    #[arg(last = true)]
    args: Vec<OsString>,
}

fn main() {
    let cli = Cli::parse();
    let result = Ctx::new().and_then(|ctx| match cli.task {
        Task::Setup => ctx.setup(),
        Task::BuildEbpf => ctx.build_ebpf().map(drop),
        Task::Build(args) => {
            let built = ctx.build(args.release, &args.features)?;
            println!("[build] haltd:   {}", built.haltd.display());
            println!("[build] haltctl: {}", built.haltctl.display());
            println!("[build] gate:    {}", built.object.display());
            Ok(())
        }
        Task::Run { args } => ctx.run_demo(args),
        Task::Test(args) => ctx.test(args),
        Task::Bench { args } => ctx.bench(&args),
        Task::Load => ctx.load(),
    });
    if let Err(e) = result {
        eprintln!("xtask: error: {e:#}");
        std::process::exit(1);
    }
}

/// Where things are, worked out once.
#[derive(Debug)]
struct Ctx {
    root: PathBuf,
    target_dir: PathBuf,
    /// `PATH` for children, with `$CARGO_HOME/bin` (rustup proxies, bpf-linker) in it.
    path: OsString,
    home: PathBuf,
}

/// Paths of a finished build.
#[derive(Debug)]
struct Built {
    haltd: PathBuf,
    haltctl: PathBuf,
    object: PathBuf,
}

impl Ctx {
    fn new() -> Result<Self> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .context("xtask lives one level below the workspace root")?
            .to_path_buf();
        let home = PathBuf::from(env::var_os("HOME").context("HOME is not set")?);
        let cargo_home =
            env::var_os("CARGO_HOME").map_or_else(|| home.join(".cargo"), PathBuf::from);
        let mut dirs = vec![cargo_home.join("bin")];
        dirs.extend(env::split_paths(&env::var_os("PATH").unwrap_or_default()));
        dirs.dedup();
        let path = env::join_paths(dirs).context("PATH holds an entry with a ':'")?;
        let mut ctx = Ctx {
            target_dir: root.join("target"),
            root,
            path,
            home,
        };
        if let Some(dir) = env::var_os("CARGO_TARGET_DIR") {
            ctx.target_dir = ctx.root.join(dir);
        }
        Ok(ctx)
    }

    /// A command with our `PATH`.
    fn cmd(&self, program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new(program);
        c.env("PATH", &self.path);
        c
    }

    /// The cargo that runs xtask (same toolchain), in the workspace root.
    fn cargo(&self) -> Command {
        let mut c = self.cmd(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
        c.current_dir(&self.root);
        c
    }

    /// The rustup proxy `cargo` for another toolchain, with the outer cargo's environment
    /// scrubbed so that nothing of the stable build (toolchain pin, rustc, flags, target) leaks.
    fn toolchain_cargo(&self, toolchain: &str) -> Command {
        let mut c = self.cmd("rustup");
        c.args(["run", toolchain, "cargo"]);
        scrub_cargo_env(&mut c);
        c
    }

    fn setup(&self) -> Result<()> {
        let mut present = Vec::new();
        let mut installed = Vec::new();
        self.setup_packages(&mut present, &mut installed)?;
        let sysroot = self.setup_nightly(&mut present, &mut installed)?;
        self.setup_bpf_linker(&sysroot, &mut present, &mut installed)?;
        self.setup_openai_sdk(&mut present, &mut installed)?;
        setup_bpffs(&mut present, &mut installed);
        if !Path::new("/sys/kernel/btf/vmlinux").exists() {
            println!("[setup] warning: /sys/kernel/btf/vmlinux is missing; the gate needs a kernel with BTF");
        }
        println!(
            "setup: ok (present: {}; installed: {})",
            if present.is_empty() {
                "-".to_owned()
            } else {
                present.join(", ")
            },
            if installed.is_empty() {
                "nothing".to_owned()
            } else {
                installed.join(", ")
            },
        );
        Ok(())
    }

    fn setup_packages(&self, present: &mut Vec<String>, installed: &mut Vec<String>) -> Result<()> {
        let mut missing = Vec::new();
        for &(pkg, why) in DEBIAN_PACKAGES {
            let out = self
                .cmd("dpkg-query")
                .args(["-W", "-f=${Status}", pkg])
                .stderr(Stdio::null())
                .output();
            match out {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    println!(
                        "[setup] dpkg-query not found (not Debian?): make sure these are installed: {}",
                        DEBIAN_PACKAGES.iter().map(|p| p.0).collect::<Vec<_>>().join(" ")
                    );
                    return Ok(());
                }
                Err(e) => return Err(e).context("running dpkg-query"),
                Ok(out)
                    if String::from_utf8_lossy(&out.stdout).trim() == "install ok installed" => {}
                Ok(_) => missing.push((pkg, why)),
            }
        }
        if missing.is_empty() {
            println!(
                "[setup] Debian packages: all {} present",
                DEBIAN_PACKAGES.len()
            );
            present.push("packages".into());
            return Ok(());
        }
        let names: Vec<&str> = missing.iter().map(|m| m.0).collect();
        for (pkg, why) in &missing {
            println!("[setup] Debian package {pkg} missing (needed for {why})");
        }
        if !is_root() {
            bail!("Debian packages missing: {}; run `cargo xtask setup` as root, or `apt-get install -y {}`", names.join(", "), names.join(" "));
        }
        println!("[setup] apt-get update");
        run(self
            .cmd("apt-get")
            .args(["update", "-q"])
            .env("DEBIAN_FRONTEND", "noninteractive"))
        .context("apt-get update failed (are the Debian mirrors reachable?)")?;
        println!("[setup] apt-get install {}", names.join(" "));
        run(self
            .cmd("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&names)
            .env("DEBIAN_FRONTEND", "noninteractive"))
        .context("apt-get install failed")?;
        installed.extend(names.iter().map(|n| (*n).to_owned()));
        Ok(())
    }

    /// Makes sure the nightly toolchain and its rust-src are there; returns its sysroot.
    fn setup_nightly(
        &self,
        present: &mut Vec<String>,
        installed: &mut Vec<String>,
    ) -> Result<PathBuf> {
        if capture(self.cmd("rustup").arg("--version")).is_none() {
            bail!("rustup not found on PATH ({:?}): haltd needs rustup with a stable (>= 1.95) and a nightly toolchain with LLVM {LLVM_MAJOR}", self.path);
        }
        let sysroot_cmd = || {
            let mut c = self.cmd("rustup");
            c.args(["run", "nightly", "rustc", "--print", "sysroot"]);
            scrub_cargo_env(&mut c);
            capture(&mut c)
        };
        let sysroot = match sysroot_cmd() {
            Some(s) => {
                present.push("nightly".into());
                s
            }
            None => {
                println!("[setup] nightly toolchain missing: rustup toolchain install nightly");
                run(self.cmd("rustup").args(["toolchain", "install", "nightly", "--profile", "minimal", "--component", "rust-src"]))
                    .with_context(|| {
                        format!("could not install the nightly toolchain (is static.rust-lang.org reachable from here?); the BPF build needs a nightly with LLVM {LLVM_MAJOR} and rust-src (tested: nightly 1.97, 2026-05-19)")
                    })?;
                installed.push("nightly".into());
                sysroot_cmd().context(
                    "the nightly toolchain was installed but `rustc --print sysroot` still fails",
                )?
            }
        };
        let sysroot = PathBuf::from(sysroot.trim());
        if sysroot.join("lib/rustlib/src/rust/library").is_dir() {
            println!("[setup] nightly: {} (rust-src present)", sysroot.display());
            present.push("rust-src".into());
        } else {
            println!("[setup] nightly rust-src missing: rustup component add rust-src --toolchain nightly");
            run(self.cmd("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]))
                .context("could not add rust-src to the nightly toolchain (is static.rust-lang.org reachable?); `-Z build-std=core` needs it")?;
            installed.push("rust-src".into());
        }
        Ok(sysroot)
    }

    fn setup_bpf_linker(
        &self,
        sysroot: &Path,
        present: &mut Vec<String>,
        installed: &mut Vec<String>,
    ) -> Result<()> {
        if let Some(v) = capture(self.cmd("bpf-linker").arg("--version")) {
            println!("[setup] {}: present", v.trim());
            present.push("bpf-linker".into());
            return Ok(());
        }
        // Build bpf-linker against the nightly's own libLLVM (notes/ebpf-toolchain.md, way 2).
        let lib = find_libllvm(&sysroot.join("lib"))?;
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
        let prefix = self.home.join(".local/share/haltd/llvm");
        let libdir = prefix.join("lib");
        fs::create_dir_all(&libdir).with_context(|| format!("creating {}", libdir.display()))?;
        for link in [OsStr::new("libLLVM.so"), name.as_os_str()] {
            let at = libdir.join(link);
            if fs::read_link(&at).is_ok_and(|t| t == lib) {
                continue;
            }
            if fs::symlink_metadata(&at).is_ok() {
                fs::remove_file(&at).with_context(|| format!("removing stale {}", at.display()))?;
            }
            std::os::unix::fs::symlink(&lib, &at)
                .with_context(|| format!("symlinking {} -> {}", at.display(), lib.display()))?;
        }
        println!(
            "[setup] bpf-linker missing: building {BPF_LINKER_VERSION} against {} (LLVM_PREFIX={})",
            lib.display(),
            prefix.display()
        );
        let mut c = self.cmd("cargo");
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
        let v = capture(self.cmd("bpf-linker").arg("--version"))
            .context("bpf-linker was installed but `bpf-linker --version` fails (its rpath needs ~/.local/share/haltd/llvm/lib)")?;
        println!("[setup] {} installed", v.trim());
        installed.push("bpf-linker".into());
        Ok(())
    }

    /// The virtual environment that holds the `openai` SDK for the integration tests.
    fn venv_dir(&self) -> PathBuf {
        self.home.join(".local/share/haltd/venv")
    }

    /// The venv's interpreter (`HALTD_PYTHON` for the integration tests).
    fn venv_python(&self) -> PathBuf {
        self.venv_dir().join("bin/python")
    }

    /// Makes sure the venv exists and holds `openai==OPENAI_SDK_VERSION`.
    fn setup_openai_sdk(
        &self,
        present: &mut Vec<String>,
        installed: &mut Vec<String>,
    ) -> Result<()> {
        let venv = self.venv_dir();
        let python = self.venv_python();
        let sdk_version = || {
            capture(
                self.cmd(&python)
                    .args(["-c", "import openai; print(openai.__version__)"]),
            )
            .map(|v| v.trim().to_owned())
        };
        match sdk_version() {
            Some(v) if v == OPENAI_SDK_VERSION => {
                println!("[setup] openai SDK {v}: present in {}", venv.display());
                present.push("openai SDK".into());
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
        // A venv whose interpreter runs and has pip is kept; anything else is made anew
        // (`--clear` empties a broken one, e.g. after its base interpreter went away).
        let usable = capture(self.cmd(&python).args([
            "-m",
            "pip",
            "--version",
            "--disable-pip-version-check",
        ]))
        .is_some();
        if !usable {
            // Debian's interpreter, which the python3-venv package completes; else PATH's.
            let base = if Path::new("/usr/bin/python3").is_file() {
                PathBuf::from("/usr/bin/python3")
            } else {
                PathBuf::from("python3")
            };
            let Some(base_version) = capture(self.cmd(&base).arg("--version")) else {
                bail!("python3 not found (tried /usr/bin/python3 and PATH {:?}): the integration tests need Python 3 with venv (`apt-get install python3 python3-venv`)", self.path);
            };
            if let Some(parent) = venv.parent() {
                fs::create_dir_all(parent)
                    .with_context(|| format!("creating {}", parent.display()))?;
            }
            println!(
                "[setup] creating venv: {} -m venv --clear {} ({})",
                base.display(),
                venv.display(),
                base_version.trim()
            );
            run(self.cmd(&base).args(["-m", "venv", "--clear"]).arg(&venv)).with_context(|| {
                format!(
                    "could not create the venv at {} (on Debian `python3 -m venv` needs the python3-venv package for ensurepip: `apt-get install python3-venv`)",
                    venv.display()
                )
            })?;
        }
        println!(
            "[setup] pip install openai=={OPENAI_SDK_VERSION} into {}",
            venv.display()
        );
        run(self.cmd(&python).args([
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
        })?;
        match sdk_version() {
            Some(v) if v == OPENAI_SDK_VERSION => {
                println!("[setup] openai SDK {v} installed in {}", venv.display());
            }
            other => bail!(
                "pip installed openai=={OPENAI_SDK_VERSION} into {}, but `{} -c 'import openai; print(openai.__version__)'` gives {other:?}",
                venv.display(),
                python.display()
            ),
        }
        installed.push("openai SDK".into());
        Ok(())
    }

    /// Builds the BPF gate; returns the object's absolute path.
    fn build_ebpf(&self) -> Result<PathBuf> {
        let dir = self.root.join("ebpf/haltd-ebpf");
        if !dir.join("src/main.rs").is_file() {
            bail!(
                "the BPF crate is not there yet: {} has no src/main.rs",
                dir.display()
            );
        }
        println!(
            "[build-ebpf] cargo +nightly build --release --target {EBPF_TARGET} -Z build-std=core"
        );
        let t = Instant::now();
        let mut c = self.toolchain_cargo("nightly");
        c.current_dir(&dir)
            .args([
                "build",
                "--release",
                "--target",
                EBPF_TARGET,
                "-Z",
                "build-std=core",
            ])
            .env("RUSTFLAGS", EBPF_RUSTFLAGS);
        run(&mut c).context("building the BPF gate failed (has `cargo xtask setup` run?)")?;
        let object = dir
            .join("target")
            .join(EBPF_TARGET)
            .join("release/haltd-ebpf");
        let size = fs::metadata(&object)
            .with_context(|| {
                format!(
                    "the BPF build succeeded but left no object at {}",
                    object.display()
                )
            })?
            .len();
        println!(
            "[build-ebpf] {} ({size} bytes) in {}",
            object.display(),
            secs(t.elapsed())
        );
        Ok(object)
    }

    fn build(&self, release: bool, features: &[String]) -> Result<Built> {
        let object = self.build_ebpf()?;
        let features: Vec<&str> = features
            .iter()
            .map(|f| f.trim())
            .filter(|f| !f.is_empty())
            .collect();
        let profile = if release { "release" } else { "debug" };
        println!(
            "[build] haltd ({profile}, features: {})",
            if features.is_empty() {
                "none".into()
            } else {
                features.join(",")
            }
        );
        let t = Instant::now();
        let mut c = self.cargo();
        c.args(["build", "-p", "haltd", "--bins"])
            .env("HALTD_BPF_OBJECT", &object);
        if release {
            c.arg("--release");
        }
        if !features.is_empty() {
            c.arg("--features").arg(features.join(","));
        }
        run(&mut c).context("building haltd failed")?;
        let dir = self.target_dir.join(profile);
        let built = Built {
            haltd: dir.join("haltd"),
            haltctl: dir.join("haltctl"),
            object,
        };
        for bin in [&built.haltd, &built.haltctl] {
            if !bin.is_file() {
                bail!("cargo built haltd but {} is missing", bin.display());
            }
        }
        println!("[build] done in {}", secs(t.elapsed()));
        Ok(built)
    }

    fn run_demo(&self, args: Vec<OsString>) -> Result<()> {
        self.setup()?;
        let built = self.build(true, &[])?;
        let given = |flag: &str| {
            args.iter().any(|a| {
                a.to_str()
                    .is_some_and(|a| a == flag || a.starts_with(&format!("{flag}=")))
            })
        };
        let ledger = self.root.join("haltd-ledger.jsonl");
        let mut serve: Vec<OsString> = vec!["serve".into()];
        for (flag, value) in [
            ("--listen", OsString::from("127.0.0.1:8080")),
            ("--admin", "127.0.0.1:8081".into()),
            ("--metrics", "127.0.0.1:9464".into()),
            ("--ledger", ledger.clone().into()),
        ] {
            if !given(flag) {
                serve.extend([flag.into(), value]);
            }
        }
        serve.extend(args);
        let haltctl = built
            .haltctl
            .strip_prefix(&self.root)
            .unwrap_or(&built.haltctl);
        // Print commands for the addresses haltd will really use (defaults or overrides).
        let value_of = |flag: &str| -> String {
            let mut it = serve.iter().filter_map(|a| a.to_str());
            while let Some(a) = it.next() {
                if a == flag {
                    return it.next().unwrap_or_default().to_owned();
                }
                if let Some(v) = a.strip_prefix(&format!("{flag}=")) {
                    return v.to_owned();
                }
            }
            String::new()
        };
        let (listen, admin, metrics, ledger) = (
            value_of("--listen"),
            value_of("--admin"),
            value_of("--metrics"),
            value_of("--ledger"),
        );
        println!();
        println!("haltd is starting (Ctrl-C stops it). In another terminal, stream tokens with:");
        println!();
        println!(
            r#"  curl -sN -i http://{listen}/v1/chat/completions -H 'content-type: application/json' -d '{{"model":"builtin","stream":true,"max_tokens":400,"ignore_eos":true,"messages":[{{"role":"user","content":"Tell me about rivers"}}]}}' | tee /tmp/haltd-demo.sse"#
        );
        println!();
        println!("and trip that stream while it runs (from a third terminal):");
        println!(
            r#"  {} --admin {admin} trip "$(grep -i '^x-haltd-stream-id' /tmp/haltd-demo.sse | cut -d' ' -f2 | tr -d '\r')""#,
            haltctl.display()
        );
        println!();
        println!(
            "The stream then ends within the halt budget (--budget, default 5 tokens) with finish_reason"
        );
        println!("\"content_filter\", an error event of type \"halted\" and [DONE].");
        println!();
        println!("Metrics: http://{metrics}/metrics   Admin API: http://{admin}/admin/streams");
        println!(
            "Ledger:  {ledger}   (check it: {} ledger verify {ledger})",
            haltctl.display()
        );
        if !is_root() {
            println!("note: not root: loading the kernel gate needs CAP_BPF and CAP_NET_ADMIN; haltd refuses to serve without it unless given `-- --no-kernel-gate`");
        }
        println!();
        let err = Command::new(&built.haltd)
            .args(&serve)
            .current_dir(&self.root)
            .exec();
        Err(err).with_context(|| format!("exec {}", built.haltd.display()))
    }

    fn test(&self, args: TestArgs) -> Result<()> {
        if !is_root() {
            bail!("`cargo xtask test` must run as root: the integration tests create network namespaces and load the BPF gate (try `sudo -E env PATH=$PATH cargo xtask test`)");
        }
        let t0 = Instant::now();
        self.setup()?;
        let t_setup = t0.elapsed();
        let t = Instant::now();
        let built = self.build(args.release, &["fault-injection".to_owned()])?;
        let t_build = t.elapsed();
        let mut steps: Vec<(&str, Duration, Result<()>)> = Vec::new();
        if !args.no_unit {
            println!("[test] unit and property tests: cargo test --workspace --exclude haltd-tests --features haltd/fault-injection");
            let t = Instant::now();
            let mut c = self.cargo();
            c.args([
                "test",
                "--workspace",
                "--exclude",
                "haltd-tests",
                "--features",
                "haltd/fault-injection",
            ])
            .env("HALTD_BPF_OBJECT", &built.object);
            let r = run(&mut c);
            steps.push(("unit", t.elapsed(), r));
        }
        if !args.no_integration {
            println!("[test] integration tests (root, serial): cargo test --no-fail-fast -p haltd-tests -- --test-threads=1");
            let t = Instant::now();
            let mut c = self.cargo();
            // Same haltd features as the unit tests, so the haltd library builds once.
            // --nocapture: the scenario tests print their measured distributions.
            // --no-fail-fast: one red test binary must not hide the others' results.
            c.args([
                "test",
                "--no-fail-fast",
                "-p",
                "haltd-tests",
                "--features",
                "haltd/fault-injection",
                "--",
                "--test-threads=1",
                "--nocapture",
            ])
            .args(&args.args)
            .env("HALTD_BIN", &built.haltd)
            .env("HALTCTL_BIN", &built.haltctl)
            .env("HALTD_BPF_OBJECT", &built.object)
            // The official OpenAI SDK as a client: setup made the venv.
            .env("HALTD_PYTHON", self.venv_python())
            .env("HALTD_OPENAI_CLIENT", self.root.join(OPENAI_CLIENT_SCRIPT));
            let r = run(&mut c);
            steps.push(("integration", t.elapsed(), r));
        }
        let parts: Vec<String> = steps
            .iter()
            .map(|(name, took, r)| {
                format!(
                    "{name} {} ({})",
                    if r.is_ok() { "ok" } else { "FAILED" },
                    secs(*took)
                )
            })
            .collect();
        let failed: Vec<&str> = steps.iter().filter(|s| s.2.is_err()).map(|s| s.0).collect();
        println!(
            "xtask test: {} — setup {}, build {}, {}; total {}",
            if failed.is_empty() { "ok" } else { "FAILED" },
            secs(t_setup),
            secs(t_build),
            if parts.is_empty() {
                "no tests run".to_owned()
            } else {
                parts.join(", ")
            },
            secs(t0.elapsed()),
        );
        if !failed.is_empty() {
            bail!("{} tests failed", failed.join(" and "));
        }
        Ok(())
    }

    fn bench(&self, halt_slo_args: &[OsString]) -> Result<()> {
        self.setup()?;
        let built = self.build(true, &["fault-injection".to_owned()])?;
        let bins = self.workspace_bins()?;
        let mut ran = 0;
        let mut built_pkgs: Vec<&str> = Vec::new();
        for &(pkg, bin) in BENCHES {
            if !bins.iter().any(|(p, b)| p == pkg && b == bin) {
                println!("[bench] {bin}: package {pkg} has no such binary yet, skipped");
                continue;
            }
            if !built_pkgs.contains(&pkg) {
                // `cargo run --bin` builds only that binary; the siblings it runs must be current.
                let mut c = self.cargo();
                c.args(["build", "--release", "-p", pkg, "--bins"])
                    .env("HALTD_BPF_OBJECT", &built.object);
                run(&mut c).with_context(|| format!("building the binaries of {pkg} failed"))?;
                built_pkgs.push(pkg);
            }
            println!("[bench] {bin}: cargo run --release -p {pkg} --bin {bin}");
            let mut c = self.cargo();
            c.args(["run", "--release", "-p", pkg, "--bin", bin]);
            if bin == BENCHES[0].1 && !halt_slo_args.is_empty() {
                c.arg("--").args(halt_slo_args);
            }
            c.env("HALTD_BIN", &built.haltd)
                .env("HALTCTL_BIN", &built.haltctl)
                .env("HALTD_BPF_OBJECT", &built.object);
            run(&mut c).with_context(|| format!("bench {bin} failed"))?;
            ran += 1;
        }
        println!("bench: {ran} of {} benches ran", BENCHES.len());
        Ok(())
    }

    fn load(&self) -> Result<()> {
        self.setup()?;
        let built = self.build(true, &[])?;
        let supported = self
            .cmd(&built.haltd)
            .args(["check-gate", "--help"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !supported {
            bail!(
                "this haltd has no `check-gate` subcommand, so the gate cannot be loaded on its own; the BPF object built fine at {}",
                built.object.display()
            );
        }
        println!(
            "[load] haltd check-gate --bpf-object {}",
            built.object.display()
        );
        run(self
            .cmd(&built.haltd)
            .arg("check-gate")
            .arg("--bpf-object")
            .arg(&built.object))
        .context("loading and attaching the gate failed")?;
        println!("load: ok");
        Ok(())
    }

    /// (package, binary) for every binary target in the workspace.
    fn workspace_bins(&self) -> Result<Vec<(String, String)>> {
        let out = self
            .cargo()
            .args(["metadata", "--no-deps", "--format-version", "1"])
            .stderr(Stdio::inherit())
            .output()
            .context("running cargo metadata")?;
        if !out.status.success() {
            bail!("cargo metadata failed: {}", out.status);
        }
        let meta: serde_json::Value =
            serde_json::from_slice(&out.stdout).context("parsing cargo metadata")?;
        let mut bins = Vec::new();
        for pkg in meta["packages"].as_array().into_iter().flatten() {
            for target in pkg["targets"].as_array().into_iter().flatten() {
                let is_bin = target["kind"]
                    .as_array()
                    .is_some_and(|k| k.iter().any(|k| k == "bin"));
                if let (true, Some(p), Some(t)) =
                    (is_bin, pkg["name"].as_str(), target["name"].as_str())
                {
                    bins.push((p.to_owned(), t.to_owned()));
                }
            }
        }
        Ok(bins)
    }
}

/// Mounts bpffs at /sys/fs/bpf unless it is there (only pinned maps need it; failure is a note).
fn setup_bpffs(present: &mut Vec<String>, installed: &mut Vec<String>) {
    let mounted = fs::read_to_string("/proc/mounts").is_ok_and(|m| {
        m.lines().any(|l| {
            l.split_whitespace().nth(1) == Some("/sys/fs/bpf")
                && l.split_whitespace().nth(2) == Some("bpf")
        })
    });
    if mounted {
        println!("[setup] bpffs: mounted at /sys/fs/bpf");
        present.push("bpffs".into());
    } else if !is_root() {
        println!("[setup] bpffs: not mounted at /sys/fs/bpf and not root; skipped");
    } else {
        match Command::new("mount").args(["-t", "bpf", "bpf", "/sys/fs/bpf"]).status() {
            Ok(s) if s.success() => {
                println!("[setup] bpffs: mounted at /sys/fs/bpf");
                installed.push("bpffs mount".into());
            }
            other => println!("[setup] bpffs: `mount -t bpf bpf /sys/fs/bpf` failed ({other:?}); only pinned maps need it"),
        }
    }
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

fn is_elf(path: &Path) -> bool {
    let mut magic = [0_u8; 4];
    fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && magic == *b"\x7fELF"
}

/// Removes what the outer `cargo run` put into the environment for xtask, so a nested cargo
/// (another toolchain, another workspace) starts clean.
fn scrub_cargo_env(c: &mut Command) {
    const KEEP: &[&str] = &[
        "CARGO_HOME",
        "CARGO_NET_",
        "CARGO_HTTP_",
        "CARGO_REGISTRY_",
        "CARGO_REGISTRIES_",
        "CARGO_TERM_",
    ];
    for (key, _) in env::vars_os() {
        let Some(k) = key.to_str() else { continue };
        let cargo_var = (k == "CARGO" || k.starts_with("CARGO_") || k.starts_with("__CARGO"))
            && !KEEP.iter().any(|p| k.starts_with(p));
        let rust_var = matches!(
            k,
            "RUSTC"
                | "RUSTDOC"
                | "RUSTC_WRAPPER"
                | "RUSTC_WORKSPACE_WRAPPER"
                | "RUSTUP_TOOLCHAIN"
                | "RUSTFLAGS"
                | "RUSTDOCFLAGS"
        );
        if cargo_var || rust_var {
            c.env_remove(&key);
        }
    }
    // `cargo run` prepends the stable toolchain's and the target dir's library folders.
    if let Some(ld) = env::var_os("LD_LIBRARY_PATH") {
        let kept: Vec<PathBuf> = env::split_paths(&ld)
            .filter(|p| {
                !p.to_string_lossy().contains("/toolchains/")
                    && !p.to_string_lossy().contains("/target/")
            })
            .collect();
        match env::join_paths(kept) {
            Ok(v) if !v.is_empty() => c.env("LD_LIBRARY_PATH", v),
            _ => c.env_remove("LD_LIBRARY_PATH"),
        };
    }
}

fn is_root() -> bool {
    // /proc/self belongs to the effective user.
    fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// Runs a command with inherited stdio; an error names the command and its exit status.
fn run(c: &mut Command) -> Result<()> {
    let shown = show(c);
    let status = c.status().with_context(|| format!("starting `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// Stdout of a command that succeeded; `None` if it could not start or failed.
fn capture(c: &mut Command) -> Option<String> {
    let out = c.stderr(Stdio::null()).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn show(c: &Command) -> String {
    std::iter::once(c.get_program())
        .chain(c.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

fn secs(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}
