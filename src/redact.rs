//! Secrets out of what is printed: a connection target is shown rebuilt
//! from the parts its driver parsed (scheme, user, hosts, ports, database
//! or vhost), never from the text the user wrote.
//!
//! Masking the text (as earlier versions did) kept missing shapes that the
//! drivers read differently from any mask: percent-encoded query keys
//! (`?pass%77ord=`), values that only `&` ends (`password=ab#cd`), an AMQP
//! URL without a host. A shown URL holds no byte the user wrote: what
//! cannot be parsed is shown as [`NOT_A_URL`] and nothing more.

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use tokio_postgres::config::Host;

/// What is shown for a URL that does not parse.
pub const NOT_A_URL: &str = "not a valid URL";

/// Everything but letters, digits and `-._~` is percent-encoded in the
/// parts shown, so that a part can neither forge a log line nor look like
/// another part.
const PART: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

fn part(s: &str) -> String {
    utf8_percent_encode(s, PART).to_string()
}

/// `url` as it may be printed: `postgres://user@host:port/database` or
/// `amqp://user@host:port/vhost` rebuilt from what the driver reads, with
/// no password and no query; [`NOT_A_URL`] when the driver refuses it.
pub fn shown_url(url: &str) -> String {
    let shown = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        shown_postgres(url)
    } else if url.starts_with("amqp://") || url.starts_with("amqps://") {
        shown_amqp(url)
    } else {
        None
    };
    shown.unwrap_or_else(|| NOT_A_URL.to_owned())
}

/// As tokio-postgres reads it (after libpq's TLS parameters, which it does
/// not know, are taken out).
fn shown_postgres(url: &str) -> Option<String> {
    let pg: tokio_postgres::Config = crate::pgurl::split_pg_url(url).url.parse().ok()?;
    let ports = pg.get_ports();
    let hosts: Vec<String> = (pg.get_hosts().iter().enumerate())
        .map(|(i, host)| {
            let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
            match host {
                Host::Tcp(name) if name.contains(':') => format!("[{name}]:{port}"),
                Host::Tcp(name) => format!("{}:{port}", part(name)),
                Host::Unix(dir) => format!("{}:{port}", part(&dir.to_string_lossy())),
            }
        })
        .collect();
    let user = pg
        .get_user()
        .map_or(String::new(), |u| format!("{}@", part(u)));
    let db = pg
        .get_dbname()
        .map_or(String::new(), |d| format!("/{}", part(d)));
    Some(format!("postgres://{user}{}{db}", hosts.join(",")))
}

/// As the relay's AMQP client reads it.
fn shown_amqp(url: &str) -> Option<String> {
    let uri = crate::sink::parse_amqp_url(url).ok()?;
    let host = &uri.authority.host;
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        part(host)
    };
    Some(format!(
        "{}://{}@{host}:{}/{}",
        uri.scheme,
        part(&uri.authority.userinfo.username),
        uri.authority.port,
        part(&uri.vhost)
    ))
}

#[cfg(test)]
mod tests;
