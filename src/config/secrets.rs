//! Passwords kept out of the config: read from a `password_file`, put into
//! the URL in place of any password it had.

use std::path::Path;

use super::{ConfigError, key_err};

/// Puts the password read from `file` into `url` (percent-encoded), in place
/// of any password the URL had: secrets can live in a file only root and the
/// relay can read (e.g. a Kubernetes or systemd credential).
///
/// As libpq does with `.pgpass`: a file others may read or write draws a
/// warning; the file holds the password alone, every byte of it (spaces
/// too), and at most one line ending (`\n` or `\r\n`) after it.
pub(super) fn with_password_file(url: &str, key: &str, file: &str) -> Result<String, ConfigError> {
    let dir = std::env::var("CREDENTIALS_DIRECTORY").ok();
    let file = &credential_path(key, file, dir.as_deref())?;
    let text = std::fs::read_to_string(file)
        .map_err(|e| key_err(key, format!("cannot read {file}: {e}")))?;
    if let Some(warning) = password_file_warning(key, Path::new(file)) {
        tracing::warn!("{warning}");
    }
    let password = match text.strip_suffix('\n') {
        Some(line) => line.strip_suffix('\r').unwrap_or(line),
        None => &text,
    };
    if password.is_empty() {
        return Err(key_err(key, format!("{file} is empty")));
    }
    if password.contains(['\n', '\r']) {
        return Err(key_err(
            key,
            format!("{file} holds more than one line; it must hold only the password"),
        ));
    }
    let encoded: String =
        percent_encoding::utf8_percent_encode(password, percent_encoding::NON_ALPHANUMERIC)
            .collect();
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| key_err(key, "the URL it applies to has no scheme"))?;
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let Some(at) = authority.rfind('@') else {
        return Err(key_err(
            key,
            "the URL it applies to names no user (user@host) to give the password to",
        ));
    };
    let user = authority[..at].split(':').next().unwrap_or_default();
    Ok(format!(
        "{scheme}://{user}:{encoded}{}{tail}",
        &authority[at..]
    ))
}

/// How a password file names the directory where systemd puts the unit's
/// credentials (`LoadCredential=`): the variable systemd sets, as a shell
/// would write it, and the unit files' own specifier for it.
const CREDENTIALS_DIRECTORY: [&str; 3] =
    ["${CREDENTIALS_DIRECTORY}", "$CREDENTIALS_DIRECTORY", "%d"];

/// `file` with a leading `$CREDENTIALS_DIRECTORY`, `${CREDENTIALS_DIRECTORY}`
/// or `%d` replaced by `dir`, the value of `CREDENTIALS_DIRECTORY` (set by
/// systemd for a unit with credentials); other paths as they are.
pub(super) fn credential_path(
    key: &str,
    file: &str,
    dir: Option<&str>,
) -> Result<String, ConfigError> {
    let Some(rest) = CREDENTIALS_DIRECTORY
        .iter()
        .find_map(|v| file.strip_prefix(v).filter(|r| r.starts_with('/')))
    else {
        return Ok(file.to_owned());
    };
    match dir.filter(|d| !d.is_empty()) {
        Some(dir) => Ok(format!("{}{rest}", dir.trim_end_matches('/'))),
        None => Err(key_err(
            key,
            format!(
                "{file} is in the credentials directory, but CREDENTIALS_DIRECTORY is not set: \
                 systemd sets it for a unit that loads credentials (LoadCredential=, see the \
                 packaged unit); elsewhere give the file's own path"
            ),
        )),
    }
}

/// The warning for a password file that group or others may read or write
/// (libpq ignores such a `.pgpass`; we only warn).
pub(super) fn password_file_warning(key: &str, path: &Path) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode();
    (mode & 0o077 != 0).then(|| {
        format!(
            "{key}: {} is accessible by group or others (mode {:03o}); restrict it with `chmod 600`",
            path.display(),
            mode & 0o777
        )
    })
}
