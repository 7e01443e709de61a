//! Passwords kept out of the config: read from a `password_file`, put into
//! the URL in place of any password it had.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{ConfigError, Secret, key_err};

/// Puts the password read from `file` into `url` (percent-encoded), in place
/// of any password the URL had: secrets can live in a file only root and the
/// relay can read (e.g. a Kubernetes or systemd credential).
#[cfg(test)]
pub(super) fn with_password_file(
    url: &str,
    key: &'static str,
    file: &str,
) -> Result<String, ConfigError> {
    PasswordFile::open(key, file)?.first(url)
}

/// How long after the first refused login in a row the relay keeps trying
/// again with what a `password_file` holds: a rotation changes the server's
/// password and the file at nearly the same time, in either order, and a
/// Kubernetes secret reaches a pod's volume within about a minute and a
/// half (the kubelet's sync period and cache).
pub const ROTATION_GRACE: Duration = Duration::from_secs(300);

/// A server's refusal of a password that comes from a `password_file`,
/// within [`ROTATION_GRACE`] of the first refusal in a row: a rotation may
/// be under way (the server's password and the file change in either
/// order), so the next connect reads the file again.
#[derive(Debug, thiserror::Error)]
#[error(
    "{source}; {key} may be in the middle of a rotation: the relay tries again with what it \
     then holds, for up to {} minutes after the first refusal",
    ROTATION_GRACE.as_secs() / 60
)]
pub struct Rotating<E: std::error::Error + 'static> {
    /// The setting the password comes from.
    pub key: &'static str,
    /// The refusal.
    pub source: Box<E>,
}

/// Which login a refusal or an acceptance is about: each has its own
/// grace, so that a login that always succeeds (PostgreSQL's SQL
/// connection) cannot keep renewing the grace of one that is always
/// refused (a replication line of pg_hba.conf with another method).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Login {
    /// PostgreSQL's SQL connection, or the broker's.
    Sql,
    /// PostgreSQL's replication connection.
    Replication,
}

/// A `password_file`, read at load and again at every connect.
pub struct PasswordFile {
    key: &'static str,
    /// The file's path, the credentials directory resolved.
    path: String,
    /// The password read last that was well formed.
    last: Mutex<String>,
    /// When the server first refused the password, since it last took
    /// one, for each [`Login`].
    refused_since: Mutex<[Option<Instant>; 2]>,
    /// The file's mode was warned about (once is enough).
    warned: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for PasswordFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PasswordFile")
            .field("key", &self.key)
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl PasswordFile {
    /// Reads `file` (`key` is the setting naming it) once, so that a wrong
    /// path or content fails the config's load.
    pub(super) fn open(key: &'static str, file: &str) -> Result<Arc<PasswordFile>, ConfigError> {
        let dir = std::env::var("CREDENTIALS_DIRECTORY").ok();
        let path = credential_path(key, file, dir.as_deref())?;
        let password = read_password(key, &path, true)?;
        Ok(Arc::new(PasswordFile {
            key,
            path,
            last: Mutex::new(password),
            refused_since: Mutex::new([None; 2]),
            warned: std::sync::atomic::AtomicBool::new(true),
        }))
    }

    /// `url` with the password read at load, checked to take one.
    pub(super) fn first(&self, url: &str) -> Result<String, ConfigError> {
        put_password(url, self.key, &self.last.lock().expect("not poisoned"))
    }

    /// `url` with what the file holds now; if that cannot be read or is not
    /// a password, the one read last (warned about, naming the setting).
    pub(super) fn apply(&self, url: &str) -> String {
        let mut last = self.last.lock().expect("not poisoned");
        let warn = !self.warned.swap(true, std::sync::atomic::Ordering::Relaxed);
        match read_password(self.key, &self.path, warn) {
            Ok(password) => *last = password,
            Err(e) => tracing::warn!("{e}; connecting with the password read before"),
        }
        // The URL took a password at load: only its password changes.
        put_password(url, self.key, &last).unwrap_or_else(|_| url.to_owned())
    }

    pub(super) fn refused(&self, login: Login) -> bool {
        self.refused_at(login, Instant::now())
    }

    /// A refusal at `now`: still within the grace of the first one.
    pub(super) fn refused_at(&self, login: Login, now: Instant) -> bool {
        let mut since = self.refused_since.lock().expect("not poisoned");
        let first = *since[login as usize].get_or_insert(now);
        now.saturating_duration_since(first) < ROTATION_GRACE
    }

    pub(super) fn accepted(&self, login: Login) {
        self.refused_since.lock().expect("not poisoned")[login as usize] = None;
    }

    pub(super) fn key(&self) -> &'static str {
        self.key
    }
}

/// The password `file` holds. As libpq does with `.pgpass`: a file others
/// may read or write draws a warning; the file holds the password alone,
/// every byte of it (spaces too), and at most one line ending (`\n` or
/// `\r\n`) after it.
fn read_password(key: &str, file: &str, warn: bool) -> Result<String, ConfigError> {
    let text = crate::smallfile::read_text(Path::new(file), crate::smallfile::PASSWORD_LIMIT)
        .map_err(|e| key_err(key, e))?;
    if let Some(warning) = warn
        .then(|| password_file_warning(key, Path::new(file)))
        .flatten()
    {
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
    Ok(password.to_owned())
}

/// `url` with `password` (percent-encoded) in place of any it had.
fn put_password(url: &str, key: &str, password: &str) -> Result<String, ConfigError> {
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

impl Secret {
    /// `value`, whose password comes from `file` when there is one.
    pub(super) fn with_file(value: String, file: Option<&Arc<PasswordFile>>) -> Secret {
        Secret {
            value,
            file: file.map(Arc::clone),
        }
    }
}
