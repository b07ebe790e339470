//! Shell completions and man pages, generated from the binaries' own clap definitions, so they
//! never disagree with `--help`.
//!
//! `haltd completions SHELL` and `haltctl completions SHELL` print a completion script;
//! `haltd man DIR` and `haltctl man DIR` (hidden: packaging runs them) write one roff page per
//! command and subcommand (`haltd.1`, `haltd-serve.1`, `haltctl-ledger-show.1`, ...).
//! `cargo xtask dist` puts both into the release tree and the Debian package.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

pub use clap_complete::Shell;

/// Writes `cmd`'s completion script for `shell` to `out`.
pub fn write_completions(cmd: &mut clap::Command, shell: Shell, out: &mut dyn Write) {
    let name = cmd.get_name().to_owned();
    clap_complete::generate(shell, cmd, name, out);
}

/// Writes a man page (section 1) for `cmd` and for each of its visible subcommands, at any
/// depth, into `dir`; returns the files written.
pub fn write_man_pages(cmd: &clap::Command, dir: &Path) -> io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut cmd = cmd.clone();
    cmd.build();
    let mut written = Vec::new();
    write_page(&cmd, cmd.get_name(), dir, &mut written)?;
    Ok(written)
}

fn write_page(
    cmd: &clap::Command,
    name: &str,
    dir: &Path,
    written: &mut Vec<PathBuf>,
) -> io::Result<()> {
    // A subcommand's page is named after its full path, as git's are (`haltctl-ledger-show`).
    let page = cmd.clone().name(name.to_owned());
    let path = dir.join(format!("{name}.1"));
    let mut buf = Vec::new();
    clap_mangen::Man::new(page).render(&mut buf)?;
    std::fs::write(&path, buf)?;
    written.push(path);
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        if sub.get_name() == "help" {
            continue;
        }
        write_page(sub, &format!("{name}-{}", sub.get_name()), dir, written)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demo() -> clap::Command {
        clap::Command::new("demo")
            .about("A demo")
            .arg(clap::Arg::new("level").long("level").help("How loud"))
            .subcommand(
                clap::Command::new("ledger")
                    .about("Ledger tools")
                    .subcommand(clap::Command::new("show").about("Show records")),
            )
            .subcommand(clap::Command::new("secret").hide(true))
    }

    #[test]
    fn a_page_per_visible_command_named_by_its_path() {
        let dir = std::env::temp_dir().join(format!("haltd-man-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let pages = write_man_pages(&demo(), &dir).expect("written");
        let names: Vec<String> = pages
            .iter()
            .filter_map(|p| p.file_name()?.to_str().map(str::to_owned))
            .collect();
        assert_eq!(names, ["demo.1", "demo-ledger.1", "demo-ledger-show.1"]);
        let top = std::fs::read_to_string(dir.join("demo.1")).expect("read");
        assert!(top.contains(".TH demo 1"), "{top}");
        assert!(top.contains("level"), "{top}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn completions_name_the_subcommands_and_flags() {
        let mut out = Vec::new();
        write_completions(&mut demo(), Shell::Bash, &mut out);
        let script = String::from_utf8(out).expect("utf-8");
        assert!(
            script.contains("ledger") && script.contains("--level"),
            "{script}"
        );
    }
}
