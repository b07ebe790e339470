//! The `--config` file: TOML, then the flight recorder's sampling and every detector's and
//! SafetyCheck's settings, as `ServeArgs::validate` reads them.

use std::sync::OnceLock;

use clap::Parser;

use crate::{
    config::{parse_config_text, ServeArgs},
    sampling::MIN_TURN_SAMPLE_RATE,
};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

/// `haltd serve` with every flag at its default.
fn default_args() -> &'static ServeArgs {
    static ARGS: OnceLock<ServeArgs> = OnceLock::new();
    ARGS.get_or_init(|| {
        Cli::try_parse_from(["haltd"])
            .expect("the defaults parse")
            .serve
    })
}

/// A config file's bytes, loaded as `haltd serve --config FILE` loads it (a file that is not
/// UTF-8 is refused when read, before any parsing).
///
/// One step is left out: the exfiltration detector's rules are read and checked but not
/// compiled into their DFAs ([`exfil_off`]). The compile, which `regex-automata` does, takes
/// a third of a second per input under coverage instrumentation and would leave the loader
/// itself a few executions a second; `detect::exfil`'s own tests cover it.
///
/// Checks: an accepted file gives a sampling rate within [`MIN_TURN_SAMPLE_RATE`, 1].
pub fn config_file(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(mut table) = parse_config_text(text, "fuzz.toml") else {
        return;
    };
    exfil_off(&mut table);
    let args = default_args();
    let Ok((sampling, _circuit, _grounding, _detectors)) = args.file_settings(Some(table)) else {
        return;
    };
    assert!(
        (MIN_TURN_SAMPLE_RATE..=1.0).contains(&sampling.turn_sample_rate),
        "{sampling:?}"
    );
}

/// Sets `[detectors.exfil] mode = "off"` where the file leaves room for it (a `detectors`
/// table, with no `exfil` key or an `exfil` table), so that its rules are not compiled.
fn exfil_off(table: &mut toml::Table) {
    let detectors = table
        .entry("detectors")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let Some(detectors) = detectors.as_table_mut() else {
        return;
    };
    let exfil = detectors
        .entry("exfil")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    if let Some(exfil) = exfil.as_table_mut() {
        exfil.insert("mode".to_owned(), toml::Value::String("off".to_owned()));
    }
}
