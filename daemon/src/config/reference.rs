//! docs/configuration.md, generated from the clap definitions of `haltd serve`: every setting
//! with its flag, variable, file key and default, so the reference cannot drift from the
//! code. A test renders it and fails when the committed file differs; regenerate with
//! `UPDATE_DOCS=1 cargo test -p haltd config::reference`.

use std::fmt::Write as _;

use super::layers::{self, FileKey, Kind, Setting};

/// The reference's path, from the workspace root.
pub const PATH: &str = "docs/configuration.md";

const HEAD: &str = r#"# Configuration reference

<!-- Generated from the flags of `haltd serve` (daemon/src/config.rs) by
`UPDATE_DOCS=1 cargo test -p haltd config::reference`; do not edit by hand: the test fails
when this file and the flags differ. -->

Every setting of `haltd serve` (and of `haltd check-gate` and `haltd check-config`, which take
the same settings) can be given in four places. The first that gives it wins:

1. its **flag**: `--budget 8`;
2. its **environment variable**: `HALTD_BUDGET=8`, e.g. from systemd's `EnvironmentFile=`;
3. the **config file** named by `--config FILE` (or `HALTD_CONFIG`): `budget = 8` at the top
   of the file, before its first `[section]`;
4. its **default**.

- Names: the variable is `HALTD_` and the flag's name in capitals, `_` for `-`; the file key
  is the flag's name with `_` for `-`. Exceptions are in the table below: `--bpf-object` is
  `HALTD_BPF_OBJECT_FILE`, since `HALTD_BPF_OBJECT` names the object a build embeds.
  `HALTD_ADMIN` and `HALTD_ADMIN_TOKEN_FILE` are also haltctl's, with the same meaning.
- File values have the flag's type: strings in quotes (`listen = "127.0.0.1:8080"`), numbers
  and booleans bare (`ledger_no_fsync = true`), several values as an array
  (`fault = ["emitter-ignores-halt"]`). A variable of a boolean flag takes `true`/`false`,
  `1`/`0`, `yes`/`no` or `on`/`off`; an empty variable counts as unset.
- A list given in a higher place replaces the lower one's; lists are not merged.
- A file value is checked even when a flag or variable overrides it: a file haltd would refuse
  on its own is refused.
- `--listen` and `--metrics` take `IP:PORT` or `HOST:PORT`; a name is resolved once, at start.
- The file's sections: `[detectors.*]` and `[safety]` ([detectors.md](detectors.md)),
  `[flight_recorder]`, `[tool_circuit]` (TokenCircuit on proxied chat turns, off unless
  `enabled = true`: [tokencircuit.md](tokencircuit.md)), `[grounding]` (the arms, deadlines
  and arm orders of a grounding round: [grounding.md](grounding.md)), `[[routes]]` (which turns
  get their own B, batch-only, detector modes, TokenCircuit budgets and sampling rate:
  [operations.md](operations.md), "Policy at runtime") and `[log]` (`level`, an
  `EnvFilter` directive; the variable `HALTD_LOG` wins over it). [deploy/haltd.toml](../deploy/haltd.toml) is a full example. An
  unknown key or section stops haltd with an error naming its line.
- SIGHUP re-reads the file. The column "on SIGHUP" says what it does with each setting:
  `applied` (to turns and connections that start afterwards), `restart` (it takes effect at
  the next start; when the file changed it, the reload names it in a WARN line, `changed in
  --config but applied only at the next start: ...`, and in its `lifecycle` record) or
  `refused` (applied, except that with `--lock-policy` a change that loosens enforcement is
  refused, and the whole reload with it: a higher B, batch-only lifted, a detector less
  strict, a threshold that trips later, a route removed; [operations.md](operations.md),
  "Policy at runtime"). Flags and variables never change under a running haltd.
  The file's sections are in the second table below.
- `haltd check-config FILE [FLAGS]` checks the file, the `HALTD_*` variables and the flags as
  `haltd serve --config FILE [FLAGS]` would take them, binding and loading nothing, and says
  what is wrong with the line of each bad key (exit 0: valid, 2: not). The systemd unit runs it
  as `ExecStartPre`.

## Settings

"#;

/// The head of the sections' table, after the settings' table.
const SECTIONS_HEAD: &str = "\nThe config file's sections:\n\n| section | on SIGHUP |\n|---|---|\n";

/// The reference, from `serve`'s command ([`super::ServeArgs::command`]).
pub fn render(serve: &clap::Command) -> String {
    let mut built = serve.clone();
    built.build();
    let settings = layers::settings(&built);
    let mut out = HEAD.to_owned();
    out.push_str("| flag | variable | file | default | on SIGHUP |\n|---|---|---|---|---|\n");
    for s in &settings {
        let default = defaults(&built, s);
        let on = super::sighup::of(&s.name).map_or("?", super::sighup::OnSighup::as_str);
        let _ = writeln!(
            out,
            "| [`--{name}`](#{name}) | `{env}` | {file} | {default} | {on} |",
            name = s.name,
            env = s.env,
            file = file_cell(&s.file),
        );
    }
    out.push_str(SECTIONS_HEAD);
    for (section, on) in super::sighup::SECTIONS {
        let _ = writeln!(out, "| `[{section}]` | {on} |");
    }
    for s in &settings {
        out.push_str(&section(&built, s));
    }
    out
}

fn file_cell(key: &FileKey) -> String {
    match key {
        FileKey::Top(k) => format!("`{k}`"),
        FileKey::Section(path) => {
            let (section, k) = path.rsplit_once('.').unwrap_or(("", path));
            format!("`{k}` in `[{section}]`")
        }
        FileKey::None => "—".to_owned(),
    }
}

fn arg<'a>(cmd: &'a clap::Command, s: &Setting) -> &'a clap::Arg {
    cmd.get_arguments()
        .find(|a| a.get_id() == s.id.as_str())
        .expect("a setting is an arg")
}

fn defaults(cmd: &clap::Command, s: &Setting) -> String {
    let values: Vec<String> = arg(cmd, s)
        .get_default_values()
        .iter()
        .map(|v| format!("`{}`", v.to_string_lossy()))
        .collect();
    if values.is_empty() {
        "—".to_owned()
    } else {
        values.join(", ")
    }
}

/// One setting's entry: its forms, its type, its help.
fn section(cmd: &clap::Command, s: &Setting) -> String {
    let a = arg(cmd, s);
    let value = a
        .get_value_names()
        .and_then(|n| n.first())
        .map(|n| format!(" <{n}>"))
        .unwrap_or_default();
    let value = if s.kind == Kind::Bool {
        String::new()
    } else {
        value
    };
    let kind = match (s.kind, s.list) {
        (Kind::Bool, _) => "boolean",
        (Kind::Integer, _) => "whole number",
        (Kind::Float, _) => "number",
        (Kind::Text, true) => "strings (a list)",
        (Kind::Text, false) => "string",
    };
    let help = a
        .get_long_help()
        .or(a.get_help())
        .map(ToString::to_string)
        .unwrap_or_default();
    let mut out = format!(
        "\n### {name}\n\n`--{name}{value}` · `{env}` · file: {file} · {kind} · default: {default}\n\n{help}\n",
        name = s.name,
        env = s.env,
        file = file_cell(&s.file),
        default = defaults(cmd, s),
    );
    let possible: Vec<String> = a
        .get_possible_values()
        .iter()
        .filter(|_| s.kind != Kind::Bool)
        .map(|p| format!("`{}`", p.get_name()))
        .collect();
    if !possible.is_empty() {
        let _ = writeln!(out, "\nValues: {}.", possible.join(", "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/configuration.md is what [`render`] makes of today's flags.
    #[test]
    fn reference_is_current() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(PATH);
        let want = render(&crate::config::ServeArgs::command());
        if std::env::var_os("UPDATE_DOCS").is_some() {
            std::fs::write(&path, &want).expect("writing the reference");
            return;
        }
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            have == want,
            "{PATH} is stale: regenerate it with `UPDATE_DOCS=1 cargo test -p haltd config::reference` and commit it"
        );
    }

    /// The flag table of docs/operations.md repeats each flag's default, with more words than
    /// the reference: a default written there as one code span is the flag's real one.
    #[test]
    fn operations_md_defaults_are_the_flags_defaults() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations.md");
        let text = std::fs::read_to_string(&path).expect("docs/operations.md");
        let cmd = crate::config::ServeArgs::command();
        let mut checked = 0;
        for line in text.lines() {
            // `| `--flag VALUE` | `default` | meaning |`
            let cells: Vec<&str> = line.split(" | ").collect();
            let (Some(flag_cell), Some(default_cell)) = (cells.first(), cells.get(1)) else {
                continue;
            };
            let Some(flag) = flag_cell.strip_prefix("| `--") else {
                continue;
            };
            let name = flag.split([' ', '`', '[']).next().unwrap_or_default();
            let Some(arg) = cmd.get_arguments().find(|a| a.get_long() == Some(name)) else {
                continue;
            };
            let written = default_cell.trim();
            let one_span = written.len() > 2
                && written.starts_with('`')
                && written.ends_with('`')
                && written.matches('`').count() == 2;
            if !one_span {
                continue;
            }
            let real: Vec<String> = arg
                .get_default_values()
                .iter()
                .map(|v| v.to_string_lossy().into_owned())
                .collect();
            if real.is_empty() {
                // No default in the flag itself (an `Option` the code resolves later).
                continue;
            }
            assert_eq!(
                real.join(","),
                written.trim_matches('`'),
                "docs/operations.md gives --{name} the default {written}"
            );
            checked += 1;
        }
        assert!(
            checked >= 20,
            "only {checked} defaults found in docs/operations.md's flag table"
        );
    }
}
