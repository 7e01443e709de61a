//! Whom PostgreSQL and RabbitMQ TLS trust: libpq's `sslmode` and
//! `sslrootcert` rules, and CA files checked when the config is read.

use std::path::PathBuf;

use super::{ConfigError, key_err};
use crate::pgurl::PgTarget;
use crate::tls::SslMode;

/// libpq's rules for `sslmode` and `sslrootcert` (`ca_file`): the mode and
/// the CA file both connections verify with.
///
/// - `sslrootcert=system` means the system's CA bundle, makes `verify-full`
///   the default, and refuses any weaker mode: a public CA signs a
///   certificate for anyone's domain, so only the host name check makes it
///   mean anything.
/// - `verify-ca` and `verify-full` need a CA file; there is no fallback to
///   public roots (over a Unix socket, where there is no TLS, they are
///   accepted, as libpq does).
pub(super) fn postgres_trust(
    mode: Option<SslMode>,
    ca_file: Option<String>,
    sslrootcert: Option<String>,
    target: &PgTarget,
    ssl_cert_file: Option<&str>,
) -> Result<(SslMode, Option<PathBuf>), ConfigError> {
    let (key, root) = match (ca_file, sslrootcert) {
        (Some(f), Some(u)) if u == "system" && f != "system" => {
            return Err(key_err(
                "postgres.ca_file",
                "is set, and postgres.url says sslrootcert=system: keep one of the two",
            ));
        }
        (Some(f), _) => ("postgres.ca_file", Some(f)),
        (None, Some(f)) => ("postgres.url", Some(f)),
        (None, None) => ("postgres.ca_file", None),
    };
    let system = root.as_deref() == Some("system");
    let mode = match mode {
        Some(m) => m,
        None if system => SslMode::VerifyFull,
        None => SslMode::default(),
    };
    if system && mode != SslMode::VerifyFull {
        return Err(key_err(
            "postgres.sslmode",
            format!(
                "sslrootcert=system trusts every public CA, so it is allowed only with \
                 sslmode = \"verify-full\" (as libpq), which also checks the host name; got \
                 {mode}. Use verify-full, or set postgres.ca_file to your own CA"
            ),
        ));
    }
    let ca = match root {
        Some(_) if system => {
            let bundle = crate::tls::system_ca_bundle(ssl_cert_file).ok_or_else(|| {
                key_err(
                    key,
                    "sslrootcert=system: no system CA bundle found (SSL_CERT_FILE, \
                     /etc/ssl/certs/ca-certificates.crt...); install the system's CA \
                     certificates or set postgres.ca_file",
                )
            })?;
            Some(check_ca_file(key, &bundle.display().to_string())?)
        }
        Some(f) if key == "postgres.url" => {
            let path = PathBuf::from(f);
            crate::tls::load_ca_file(&path)
                .map_err(|e| key_err(key, format!("sslrootcert: {e}")))?;
            Some(path)
        }
        Some(f) => Some(check_ca_file(key, &f)?),
        None => None,
    };
    let verifies = matches!(mode, SslMode::VerifyCa | SslMode::VerifyFull);
    if verifies && ca.is_none() && matches!(target, PgTarget::Tcp { .. }) {
        return Err(key_err(
            "postgres.ca_file",
            format!(
                "sslmode = \"{mode}\" verifies the server's certificate, which needs the CA \
                 that signed it: set postgres.ca_file (or sslrootcert= in postgres.url). As \
                 libpq, the relay does not fall back to the public CAs, which sign a \
                 certificate for anyone's domain; for a server with a public certificate use \
                 sslmode = \"verify-full\" with sslrootcert=system"
            ),
        ));
    }
    Ok((mode, ca))
}

/// The CA file must be readable and hold a certificate now, not at the
/// first connection.
pub(super) fn check_ca_file(key: &str, path: &str) -> Result<PathBuf, ConfigError> {
    let path = PathBuf::from(path);
    crate::tls::load_ca_file(&path).map_err(|e| key_err(key, e))?;
    Ok(path)
}
