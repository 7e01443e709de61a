//! The file's text and the environment: syntax errors that do not show the
//! line (it may hold a password), and `OUTBOX_RELAY_<SECTION>_<KEY>`
//! overrides.

use super::{ConfigError, ENV_PREFIX, ENV_RESERVED, SECTIONS, key_err};
use std::collections::BTreeMap;

/// The parser's message with the line and column, but not the line
/// itself, which may hold a password.
pub(super) fn syntax_message(text: &str, e: &toml::de::Error) -> String {
    match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            format!("line {line}, column {column}: {}", e.message().trim_end())
        }
        None => e.message().trim_end().to_owned(),
    }
}

/// Writes `OUTBOX_RELAY_<SECTION>_<KEY>=value` into the table as strings.
pub(super) fn apply_env(
    table: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<(), ConfigError> {
    let overrides: BTreeMap<String, String> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with(ENV_PREFIX) && !ENV_RESERVED.contains(&k.as_str()))
        .collect();
    for (var, value) in overrides {
        let rest = var[ENV_PREFIX.len()..].to_ascii_lowercase();
        let (section, key) = SECTIONS
            .iter()
            .find_map(|s| {
                rest.strip_prefix(s)
                    .and_then(|r| r.strip_prefix('_'))
                    .filter(|k| !k.is_empty())
                    .map(|k| (*s, k.to_owned()))
            })
            .ok_or_else(|| ConfigError::UnknownEnv(var.clone()))?;
        let mut entry = table
            .entry(section)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        // `[[outbox]]` with one entry takes the outbox overrides; with
        // several, which one is meant cannot be said.
        if let toml::Value::Array(list) = entry {
            if list.len() != 1 {
                return Err(key_err(
                    section,
                    format!(
                        "{var} cannot say which of the {} [[{section}]] entries it is for; set it \
                         in the file",
                        list.len()
                    ),
                ));
            }
            entry = &mut list[0];
        }
        let toml::Value::Table(section_table) = entry else {
            return Err(key_err(section, "must be a table"));
        };
        section_table.insert(key, toml::Value::String(value));
    }
    Ok(())
}
