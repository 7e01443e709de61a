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
