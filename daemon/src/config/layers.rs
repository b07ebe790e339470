//! One configuration from four places: every setting of `haltd serve` (and of `check-gate`
//! and `check-config`, which take the same settings) is a clap flag, and the same setting can
//! come from an environment variable (`HALTD_<FLAG>`, for systemd's `EnvironmentFile=`) or
//! from the `--config` file (`flag_name = value` at its top). Precedence: flag, then the
//! environment, then the file, then the flag's default.
//!
//! The subcommands layered are those that take the serve settings (they have a `config`
//! arg). The mechanism is generic on purpose: it walks the subcommand's clap arguments, so a flag
//! added as an ordinary clap arg is covered with no code here. The environment's and the
//! file's values become the args' default values before the one real parse, so clap's own
//! precedence (a given flag beats a default) and its own value parsers apply; each value is
//! first parsed alone, so that a bad one is reported where it came from (`haltd.toml:12:
//! budget: ...`, `HALTD_BUDGET: ...`). Since clap does not count defaults as present, flags
//! must not `requires` or `conflicts_with` each other: such rules live in
//! [`super::ServeArgs::validate`] (a test checks).
//!
//! A few flags set what a file section already holds (`--hard-limit`, `--turn-sample-rate`,
//! `--record-token-text`): their file form is that section's key ([`IN_SECTIONS`]), which
//! the section's loader reads, the flag or variable over it.

use std::{any::TypeId, collections::BTreeMap, ffi::OsString, fmt, path::PathBuf};

use clap::{
    builder::{ArgAction, Resettable},
    parser::ValueSource,
    Arg, ArgMatches, Command,
};

use super::file::{ConfigFile, FileError};

/// Prefix of the settings' environment variables.
pub const ENV_PREFIX: &str = "HALTD_";

/// The sections of the config file, each read by its own loader.
pub const SECTIONS: [&str; 7] = [
    "detectors",
    "safety",
    "flight_recorder",
    "tool_circuit",
    "grounding",
    "log",
    "routes",
];

/// [`SECTIONS`] as messages show them.
pub const SECTIONS_SHOWN: &str =
    "[detectors.*], [safety], [flight_recorder], [tool_circuit], [grounding], [log], [[routes]]";

/// Flags (by clap id) whose file form is a key of a section, read by that section's loader.
pub const IN_SECTIONS: [(&str, &str); 3] = [
    ("hard_limit", "detectors.halt_monitor.hard_limit"),
    ("turn_sample_rate", "flight_recorder.turn_sample_rate"),
    ("record_token_text", "flight_recorder.record_token_text"),
];

/// Flags (by clap id) whose variable is not the derived name.
const ENV_NAMES: [(&str, &str); 1] = [
    // HALTD_BPF_OBJECT is the build's variable (daemon/build.rs embeds the object it names),
    // set in the environment of `cargo xtask` and so of every haltd the tests start.
    ("bpf_object", "HALTD_BPF_OBJECT_FILE"),
];

/// `HALTD_*` variables that are not settings: no setting may take one of these names (a
/// test checks), and `haltd check-config` does not call them unknown.
pub const OTHER_ENV: [&str; 14] = [
    "HALTD_LOG", // the log level (an EnvFilter directive), over `[log] level`
    "HALTD_BPF_OBJECT",
    "HALTD_FEATURES",
    "HALTD_GIT_COMMIT",
    "HALTD_LONG_VERSION",
    "HALTD_BIN",
    "HALTD_PRODUCTION_BIN",
    "HALTD_PYTHON",
    "HALTD_OPENAI_CLIENT",
    "HALTD_LLAMA_MODEL", // the real-backend tests' model (`cargo xtask test`)
    "HALTD_TEST_STREAMS",
    "HALTD_SCORER_SOCKET",
    "HALTD_CRASH_HOOK_CHILD",
    "HALTD_KILL_LOOP_KILLS",
];

/// Where a setting's place in the config file is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FileKey {
    /// `key = value` at the top of the file.
    Top(String),
    /// A key of a section, read by that section's loader.
    Section(&'static str),
    /// Not in the file: `config` itself (a file does not name another).
    None,
}

/// What a value must be, from the flag's value parser.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Bool,
    Integer,
    Float,
    Text,
}

/// One setting: a flag, its variable and its key in the file.
#[derive(Clone, Debug)]
pub struct Setting {
    /// clap's id of the arg.
    pub id: String,
    /// The flag's name (`listen` for `--listen`).
    pub name: String,
    pub env: String,
    pub file: FileKey,
    pub kind: Kind,
    /// Takes several values (`--fault A --fault B`; a TOML array).
    pub list: bool,
}

/// Where a setting's value came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Flag,
    Env(String),
    File { line: Option<usize> },
    Default,
}

/// Where a bad value was.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    Flag(String),
    Env(String),
    File {
        path: PathBuf,
        line: Option<usize>,
        key: String,
    },
}

/// A bad value, and where it was.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{at}: {message}")]
pub struct Problem {
    pub at: Location,
    pub message: String,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Flag(name) => write!(f, "--{name}"),
            Location::Env(var) => write!(f, "{var} (environment)"),
            Location::File { path, line, key } => match line {
                Some(l) => write!(f, "{}:{l}: {key}", path.display()),
                None => write!(f, "{}: {key}", path.display()),
            },
        }
    }
}

/// Why the layered settings could not be parsed.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// clap's own: a bad flag, `--help`, `--version` (print with [`clap::Error::exit`]).
    #[error(transparent)]
    Clap(#[from] clap::Error),
    #[error(transparent)]
    File(#[from] FileError),
    /// Bad values from the environment or the file, every one of them.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<Problem>),
}

/// The parsed command line with the environment and the file under it.
#[derive(Debug)]
pub struct Layered {
    pub matches: ArgMatches,
    /// The settings of the subcommand run, with where each value came from.
    pub sources: Vec<(Setting, Source)>,
    /// The config file, when one was named.
    pub file: Option<ConfigFile>,
}

/// The settings of `cmd` (a subcommand such as `serve`), in its order.
pub fn settings(cmd: &Command) -> Vec<Setting> {
    let mut built = cmd.clone();
    built.build();
    built
        .get_arguments()
        .filter(|a| !is_meta(a))
        .map(|a| {
            let id = a.get_id().as_str().to_owned();
            let name = a.get_long().unwrap_or(&id).to_owned();
            let env = ENV_NAMES
                .iter()
                .find(|(i, _)| *i == id)
                .map_or_else(|| env_name(&name), |(_, e)| (*e).to_owned());
            let file = match IN_SECTIONS.iter().find(|(i, _)| *i == id) {
                Some((_, key)) => FileKey::Section(key),
                None if id == "config" => FileKey::None,
                None => FileKey::Top(name.replace('-', "_")),
            };
            Setting {
                kind: kind(a),
                list: matches!(a.get_action(), ArgAction::Append)
                    || a.get_num_args().is_some_and(|r| r.max_values() > 1),
                id,
                name,
                env,
                file,
            }
        })
        .collect()
}

/// Whether `key` at the top of a config file is a setting of `haltd serve` (read with the
/// flags at start, left alone by the sections' loaders).
pub fn is_serve_key(key: &str) -> bool {
    static KEYS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    KEYS.get_or_init(|| {
        settings(&super::ServeArgs::command())
            .into_iter()
            .filter_map(|s| match s.file {
                FileKey::Top(k) => Some(k),
                _ => None,
            })
            .collect()
    })
    .iter()
    .any(|k| k == key)
}

/// `--help`, `--version`: not settings.
fn is_meta(a: &Arg) -> bool {
    matches!(
        a.get_action(),
        ArgAction::Help | ArgAction::HelpShort | ArgAction::HelpLong | ArgAction::Version
    )
}

/// `HALTD_` and the flag's name in capitals, `_` for `-`.
pub fn env_name(flag: &str) -> String {
    format!(
        "{ENV_PREFIX}{}",
        flag.replace('-', "_").to_ascii_uppercase()
    )
}

fn kind(a: &Arg) -> Kind {
    let t = a.get_value_parser().type_id();
    let is = |ids: &[TypeId]| ids.iter().any(|i| t == *i);
    if is(&[TypeId::of::<bool>()]) {
        Kind::Bool
    } else if is(&[
        TypeId::of::<u8>(),
        TypeId::of::<u16>(),
        TypeId::of::<u32>(),
        TypeId::of::<u64>(),
        TypeId::of::<usize>(),
        TypeId::of::<i32>(),
        TypeId::of::<i64>(),
    ]) {
        Kind::Integer
    } else if is(&[TypeId::of::<f64>(), TypeId::of::<f32>()]) {
        Kind::Float
    } else {
        Kind::Text
    }
}

/// A setting's values, with where they came from.
type Layer = BTreeMap<String, (Vec<OsString>, Source)>;

/// Parses `argv` with `cmd` (haltd's command), the subcommand's settings taken from `env`
/// (a variable's value, `std::env::var_os` in the daemon) and the config file where the
/// command line does not give them.
pub fn parse(
    cmd: Command,
    argv: &[OsString],
    env: &dyn Fn(&str) -> Option<OsString>,
) -> Result<Layered, LayerError> {
    let given = cmd.clone().try_get_matches_from(argv)?;
    let Some((name, given)) = given.subcommand() else {
        return Ok(Layered {
            matches: given,
            sources: Vec::new(),
            file: None,
        });
    };
    let sub = cmd
        .find_subcommand(name)
        .expect("clap matched this subcommand")
        .clone();
    // Layered: the subcommands that take the serve settings (they have `config`), not
    // e.g. `completions SHELL`.
    if !sub.get_arguments().any(|a| a.get_id() == "config") {
        return Ok(Layered {
            matches: cmd.try_get_matches_from(argv)?,
            sources: Vec::new(),
            file: None,
        });
    }
    let settings = settings(&sub);
    let on_line = |s: &Setting| given.value_source(&s.id) == Some(ValueSource::CommandLine);
    let mut problems = Vec::new();
    let mut layer = Layer::new();
    for s in settings.iter().filter(|s| !on_line(s)) {
        let Some(raw) = env(&s.env).filter(|v| !v.is_empty()) else {
            continue;
        };
        match env_values(&sub, s, raw) {
            Ok(v) => {
                layer.insert(s.id.clone(), (v, Source::Env(s.env.clone())));
            }
            Err(message) => problems.push(Problem {
                at: Location::Env(s.env.clone()),
                message,
            }),
        }
    }
    let path = match given.try_get_one::<PathBuf>("config") {
        Ok(Some(p)) if given.value_source("config") == Some(ValueSource::CommandLine) => {
            Some(p.clone())
        }
        _ => layer.get("config").map(|(v, _)| PathBuf::from(&v[0])),
    };
    let file = path.map(|p| ConfigFile::read(&p)).transpose()?;
    if let Some(f) = &file {
        problems.extend(file_layer(&sub, &settings, f, &mut layer, &on_line));
    }
    if !problems.is_empty() {
        return Err(LayerError::Invalid(problems));
    }
    let sources = settings
        .into_iter()
        .map(|s| {
            let source = match layer.get(&s.id) {
                _ if on_line(&s) => Source::Flag,
                Some((_, src)) => src.clone(),
                None => Source::Default,
            };
            (s, source)
        })
        .collect();
    let name = name.to_owned();
    let cmd = cmd.mut_subcommand(&name, |c| {
        layer.iter().fold(c, |c, (id, (values, _))| {
            c.mut_arg(id, |a| a.default_values(values.iter().cloned()))
        })
    });
    let matches = cmd.try_get_matches_from(argv)?;
    Ok(Layered {
        matches,
        sources,
        file,
    })
}

/// A variable's value as the flag's values: a boolean as `true`/`false` (also 1/0, yes/no,
/// on/off), a list split at the flag's delimiter if it has one; checked by the flag's parser.
fn env_values(sub: &Command, s: &Setting, raw: OsString) -> Result<Vec<OsString>, String> {
    let values = if s.kind == Kind::Bool {
        let b = match raw.to_string_lossy().to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => true,
            "0" | "false" | "no" | "off" => false,
            _ => {
                return Err(format!(
                    "{raw:?} is not true or false (nor 1/0, yes/no, on/off)"
                ))
            }
        };
        vec![OsString::from(b.to_string())]
    } else {
        let delimiter = arg_of(sub, &s.id).get_value_delimiter();
        match (s.list, delimiter, raw.to_str()) {
            (true, Some(d), Some(text)) => text.split(d).map(OsString::from).collect(),
            _ => vec![raw],
        }
    };
    check(sub, s, values)
}

/// The top-level keys of the file: settings go into `layer` (unless the command line or the
/// environment gives them), sections are left to their loaders; the rest is reported.
fn file_layer(
    sub: &Command,
    settings: &[Setting],
    f: &ConfigFile,
    layer: &mut Layer,
    on_line: &dyn Fn(&Setting) -> bool,
) -> Vec<Problem> {
    let mut problems = Vec::new();
    for (key, value) in &f.table {
        if SECTIONS.contains(&key.as_str()) {
            continue;
        }
        let line = f.line_of(key);
        let at = Location::File {
            path: f.path.clone(),
            line,
            key: key.clone(),
        };
        let Some(s) = settings
            .iter()
            .find(|s| s.file == FileKey::Top(key.clone()))
        else {
            problems.push(Problem {
                at,
                message: unknown_key(settings, key, value),
            });
            continue;
        };
        // Checked even when a flag or variable overrides it: a file haltd would refuse on
        // its own is not a file to keep.
        match file_values(s, value).and_then(|v| check(sub, s, v)) {
            Ok(_) if on_line(s) || layer.contains_key(&s.id) => {}
            Ok(v) => {
                layer.insert(s.id.clone(), (v, Source::File { line }));
            }
            Err(message) => problems.push(Problem { at, message }),
        }
    }
    problems
}

/// Why a top-level `key` of the file is not a setting.
fn unknown_key(settings: &[Setting], key: &str, value: &toml::Value) -> String {
    let flag_named = |s: &&Setting| s.name.replace('-', "_") == key;
    match settings.iter().find(flag_named).map(|s| &s.file) {
        Some(FileKey::Section(at)) => {
            let (section, k) = at.rsplit_once('.').unwrap_or(("", at));
            format!("set it as `{k}` in [{section}]")
        }
        Some(_) => "is not read from the file (use the flag or its variable)".into(),
        None if value.is_table() => {
            format!("unknown section [{key}] (known: {SECTIONS_SHOWN})")
        }
        None => format!(
            "unknown setting (settings: the flags of `haltd serve`, with _ for -, docs/configuration.md; sections: {SECTIONS_SHOWN})"
        ),
    }
}

/// A TOML value as the flag's values, if it has the flag's type.
fn file_values(s: &Setting, value: &toml::Value) -> Result<Vec<OsString>, String> {
    match value {
        toml::Value::Array(items) if s.list => items.iter().map(|v| scalar(s.kind, v)).collect(),
        toml::Value::Array(_) => Err("takes one value, not a list".into()),
        v => Ok(vec![scalar(s.kind, v)?]),
    }
}

fn scalar(kind: Kind, v: &toml::Value) -> Result<OsString, String> {
    use toml::Value as V;
    let text = match (kind, v) {
        (Kind::Bool, V::Boolean(b)) => b.to_string(),
        (Kind::Integer | Kind::Float, V::Integer(i)) => i.to_string(),
        (Kind::Float, V::Float(x)) => x.to_string(),
        (Kind::Text, V::String(s)) => s.clone(),
        (kind, v) => {
            let want = match kind {
                Kind::Bool => "true or false",
                Kind::Integer => "a whole number",
                Kind::Float => "a number",
                Kind::Text => "a string (in quotes)",
            };
            return Err(format!("must be {want}, not the {} {v}", v.type_str()));
        }
    };
    Ok(text.into())
}

fn arg_of<'a>(sub: &'a Command, id: &str) -> &'a Arg {
    sub.get_arguments()
        .find(|a| a.get_id() == id)
        .expect("a setting is an arg of its command")
}

/// Parses `values` with the flag's own parser, alone, and returns them if they parse.
pub(crate) fn check(
    sub: &Command,
    s: &Setting,
    values: Vec<OsString>,
) -> Result<Vec<OsString>, String> {
    let arg = arg_of(sub, &s.id)
        .clone()
        .requires(Resettable::Reset)
        .conflicts_with(Resettable::Reset)
        .required(false)
        .default_values(values.iter().cloned());
    Command::new("haltd")
        .no_binary_name(true)
        .arg(arg)
        .try_get_matches_from(Vec::<OsString>::new())
        .map(|_| values)
        .map_err(|e| reason(&e))
}

/// The part of clap's message that says what is wrong with the value.
fn reason(e: &clap::Error) -> String {
    use clap::error::{ContextKind, ContextValue};
    let value = match e.get(ContextKind::InvalidValue) {
        Some(ContextValue::String(v)) => v.clone(),
        _ => String::new(),
    };
    if let Some(ContextValue::Strings(valid)) = e.get(ContextKind::ValidValue) {
        return format!("{value:?} is not one of: {}", valid.join(", "));
    }
    if let Some(cause) = std::error::Error::source(e) {
        return format!("invalid value {value:?}: {cause}");
    }
    let text = e.render().to_string();
    let first = text.lines().next().unwrap_or_default();
    first.strip_prefix("error: ").unwrap_or(first).to_owned()
}

/// The `HALTD_*` variables of `vars` that are no setting of `cmd` and not one of
/// [`OTHER_ENV`]: most likely misspelt.
pub fn unknown_env(cmd: &Command, vars: impl Iterator<Item = OsString>) -> Vec<String> {
    let settings = settings(cmd);
    vars.filter_map(|v| v.into_string().ok())
        .filter(|v| v.starts_with(ENV_PREFIX) && !OTHER_ENV.contains(&v.as_str()))
        .filter(|v| !settings.iter().any(|s| s.env == *v))
        .collect()
}

#[cfg(test)]
mod tests;
