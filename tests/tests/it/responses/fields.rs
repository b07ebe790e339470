//! The table of request fields (docs/wire-format.md, "Responses API requests") against the
//! pinned `openai` SDK: every field `responses.create` can send has a row, so that none is
//! refused as unknown without the table saying why, and no row names a field the SDK lacks.

use std::{collections::BTreeSet, env, process::Command};

use anyhow::{ensure, Context, Result};

/// The request fields of the SDK's `ResponseCreateParams` (its streaming and non-streaming
/// forms), printed one a line by the venv's Python.
const SDK_FIELDS: &str = "\
from openai.types.responses import response_create_params as p
names = set()
for cls in (p.ResponseCreateParamsStreaming, p.ResponseCreateParamsNonStreaming):
    for klass in cls.__mro__:
        names.update(getattr(klass, '__annotations__', {}))
print('\\n'.join(sorted(names)))
";

/// The field names of the docs' table.
fn documented() -> BTreeSet<String> {
    const DOC: &str = include_str!("../../../../docs/wire-format.md");
    let section = DOC
        .split_once("\n## Responses API requests\n")
        .map(|(_, s)| s.split("\n## ").next().unwrap_or_default())
        .unwrap_or_default();
    section
        .lines()
        .skip_while(|l| *l != "| field | haltd |")
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .filter_map(|row| row.trim_matches('|').split('|').next())
        .map(|name| name.trim().trim_matches('`').to_owned())
        .collect()
}

#[test]
fn the_field_table_names_every_field_the_sdk_sends() -> Result<()> {
    let python = env::var("HALTD_PYTHON")
        .context("HALTD_PYTHON is not set: run the tests with `cargo xtask test`")?;
    let out = Command::new(&python)
        .args(["-c", SDK_FIELDS])
        .output()
        .with_context(|| format!("running {python}"))?;
    ensure!(
        out.status.success(),
        "{python}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sdk: BTreeSet<String> = String::from_utf8(out.stdout)?
        .lines()
        .map(str::to_owned)
        .collect();
    ensure!(sdk.len() > 20, "too few SDK fields: {sdk:?}");
    let documented = documented();
    let missing: Vec<_> = sdk.difference(&documented).collect();
    let extra: Vec<_> = documented.difference(&sdk).collect();
    ensure!(
        missing.is_empty() && extra.is_empty(),
        "the SDK's fields without a row: {missing:?}; rows the SDK lacks: {extra:?}"
    );
    Ok(())
}
