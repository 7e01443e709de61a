//! `postgres://` URLs: libpq's TLS parameters that tokio-postgres does not
//! know, and the one server that both PostgreSQL connections reach.
//!
//! The SQL connection (tokio-postgres) and the replication connection
//! (pgwire-replication) are opened by two libraries that read a URL
//! differently: tokio-postgres honours `hostaddr` and refuses a URL without
//! a host, pgwire-replication knows neither. So the URL is read once, here,
//! into a [`PgTarget`], and both connections are opened to that target: the
//! password is only ever sent to the server the SQL connection reaches.
//! Forms that cannot mean the same server for both (several hosts, no host,
//! a `hostaddr` beside a socket directory) are refused when the
//! configuration is loaded.

use std::path::PathBuf;

use tokio_postgres::config::Host;

/// A `postgres://` URL split into the part tokio-postgres understands and
/// libpq's TLS parameters, which it does not (`verify-ca`, `verify-full`,
/// `sslrootcert`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgUrl {
    /// The URL without `sslmode` and `sslrootcert`.
    pub url: String,
    /// `sslmode=` as written.
    pub sslmode: Option<String>,
    /// `sslrootcert=`, percent-decoded.
    pub sslrootcert: Option<String>,
}

/// Where the query string of a `postgres://` URL starts, found as
/// tokio-postgres finds it: the user and password run to the first `@`
/// (so a `?` inside an unencoded password is not the query), the host to
/// the next `/` or `?`, the path to the next `?`.
fn query_start(url: &str) -> Option<usize> {
    let after_scheme = url.find("://")? + 3;
    let rest = &url[after_scheme..];
    let host_start = rest.find('@').map_or(0, |at| at + 1);
    rest[host_start..]
        .find('?')
        .map(|q| after_scheme + host_start + q)
}

/// Splits `sslmode` and `sslrootcert` out of the URL's query string.
pub fn split_pg_url(url: &str) -> PgUrl {
    let Some(q) = query_start(url) else {
        return PgUrl {
            url: url.to_owned(),
            sslmode: None,
            sslrootcert: None,
        };
    };
    let (base, query) = (&url[..q], &url[q + 1..]);
    let (mut sslmode, mut sslrootcert) = (None, None);
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match percent_decode(k).as_str() {
            "sslmode" => sslmode = Some(percent_decode(v)),
            "sslrootcert" => sslrootcert = Some(percent_decode(v)),
            _ => kept.push(pair),
        }
    }
    let url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    PgUrl {
        url,
        sslmode,
        sslrootcert,
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The one PostgreSQL server both connections go to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PgTarget {
    /// TCP.
    Tcp {
        /// The host name of the URL: what the certificate is checked
        /// against (and sent as SNI).
        name: String,
        /// Where to connect: `hostaddr` when the URL gives one (libpq then
        /// skips the name lookup), else `name`.
        addr: String,
        /// The port.
        port: u16,
    },
    /// A Unix-socket directory (never TLS).
    Unix {
        /// The directory holding `.s.PGSQL.<port>`.
        dir: PathBuf,
        /// The port, part of the socket's file name.
        port: u16,
    },
}

impl PgTarget {
    /// Reads the target of a parsed URL; the message says which form is not
    /// supported and why (the caller names `postgres.url`).
    pub fn of(pg: &tokio_postgres::Config) -> Result<PgTarget, String> {
        let hosts = pg.get_hosts();
        let addrs = pg.get_hostaddrs();
        let ports = pg.get_ports();
        if hosts.len() > 1 || addrs.len() > 1 || ports.len() > 1 {
            return Err(format!(
                "lists {} hosts, {} hostaddrs and {} ports; the replication connection reaches \
                 one server: give exactly one host (and at most one hostaddr and port)",
                hosts.len(),
                addrs.len(),
                ports.len()
            ));
        }
        let port = ports.first().copied().unwrap_or(5432);
        let no_host = |h: &Host| matches!(h, Host::Tcp(name) if name.is_empty());
        match (hosts.first().filter(|h| !no_host(h)), addrs.first()) {
            (None, _) => Err(
                "names no host (write it after @, e.g. postgres://user@db.example:5432/app, or \
                 host=/var/run/postgresql for a Unix socket); without one the two connections \
                 could reach different servers"
                    .to_owned(),
            ),
            (Some(Host::Unix(_)), Some(_)) => {
                Err("gives hostaddr beside a Unix-socket host; use one or the other".to_owned())
            }
            (Some(Host::Unix(dir)), None) => Ok(PgTarget::Unix {
                dir: dir.clone(),
                port,
            }),
            (Some(Host::Tcp(name)), addr) => Ok(PgTarget::Tcp {
                name: name.clone(),
                addr: addr.map_or_else(|| name.clone(), |a| a.to_string()),
                port,
            }),
        }
    }

    /// Refuses connection parameters that tokio-postgres honours on the SQL
    /// connection but pgwire-replication cannot on the replication
    /// connection, so that the two are never held to different rules (the
    /// replication connection would, for example, answer a cleartext
    /// password request that `channel_binding=require` forbids).
    pub fn check_parameters(pg: &tokio_postgres::Config) -> Result<(), String> {
        use tokio_postgres::config::{ChannelBinding, LoadBalanceHosts, TargetSessionAttrs};
        if pg.get_channel_binding() == ChannelBinding::Require {
            return Err(
                "sets channel_binding=require, which the replication connection cannot \
                 honour; authenticate the server with sslmode = \"verify-full\" instead"
                    .to_owned(),
            );
        }
        if pg.get_target_session_attrs() != TargetSessionAttrs::Any {
            return Err(
                "sets target_session_attrs, which the replication connection does not \
                 honour yet; remove it"
                    .to_owned(),
            );
        }
        if pg.get_load_balance_hosts() != LoadBalanceHosts::Disable {
            return Err(
                "sets load_balance_hosts, which could send the two connections to \
                 different servers; remove it"
                    .to_owned(),
            );
        }
        if pg.get_ssl_negotiation() != tokio_postgres::config::SslNegotiation::Postgres {
            return Err(
                "sets sslnegotiation=direct, which the replication connection does not \
                 support; remove it"
                    .to_owned(),
            );
        }
        Ok(())
    }

    /// The target of a URL (with or without libpq's TLS parameters).
    pub fn of_url(url: &str) -> Result<PgTarget, String> {
        let pg: tokio_postgres::Config = split_pg_url(url)
            .url
            .parse()
            .map_err(|e| format!("is not a valid PostgreSQL URL: {e}"))?;
        PgTarget::of(&pg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_tls_parameters_are_split_out() {
        let u = split_pg_url(
            "postgres://u:p@db:5432/app?sslmode=verify-full&application_name=x&sslrootcert=%2Fetc%2Fca.pem",
        );
        assert_eq!(u.url, "postgres://u:p@db:5432/app?application_name=x");
        assert_eq!(u.sslmode.as_deref(), Some("verify-full"));
        assert_eq!(u.sslrootcert.as_deref(), Some("/etc/ca.pem"));

        let u = split_pg_url("postgres://db/app?sslmode=require");
        assert_eq!(u.url, "postgres://db/app");
        assert_eq!(u.sslmode.as_deref(), Some("require"));
        assert_eq!(u.sslrootcert, None);

        // A `?` in an unencoded password is not the query (tokio-postgres
        // reads the credentials up to the first `@`).
        let u = split_pg_url("postgres://relay:ab?cd@db/app?sslmode=require");
        assert_eq!(u.sslmode.as_deref(), Some("require"));
        assert_eq!(u.url, "postgres://relay:ab?cd@db/app");
        let pg: tokio_postgres::Config = u.url.parse().unwrap();
        assert_eq!(pg.get_password(), Some(&b"ab?cd"[..]));

        let u = split_pg_url("postgres://db/app");
        assert_eq!(u.url, "postgres://db/app");
        assert_eq!(u.sslmode, None);
        assert_eq!(percent_decode("a%2"), "a%2");
        assert_eq!(percent_decode("%41%zz"), "A%zz");
    }

    #[test]
    fn one_target_for_both_connections() {
        let t = |u: &str| PgTarget::of_url(u);
        assert_eq!(
            t("postgres://u:p@db.example:5433/app?sslmode=verify-full"),
            Ok(PgTarget::Tcp {
                name: "db.example".into(),
                addr: "db.example".into(),
                port: 5433
            })
        );
        // hostaddr: connect there, check the certificate against the name.
        assert_eq!(
            t("postgres://u@db.example/app?hostaddr=127.0.0.2"),
            Ok(PgTarget::Tcp {
                name: "db.example".into(),
                addr: "127.0.0.2".into(),
                port: 5432
            })
        );
        assert_eq!(
            t("postgres://u@%2Fvar%2Frun%2Fpostgresql:5434/app"),
            Ok(PgTarget::Unix {
                dir: "/var/run/postgresql".into(),
                port: 5434
            })
        );
        for bad in [
            "postgres:///app",
            "postgres://u:p@:5432/app",
            "postgres://u@/app?hostaddr=127.0.0.1",
            "postgres://u@h1,h2/app",
            "postgres://u@h1:5432,h2:5433/app",
            "postgres://u@h/app?hostaddr=127.0.0.1,127.0.0.2",
            "postgres://u@%2Ftmp/app?hostaddr=127.0.0.1",
        ] {
            assert!(t(bad).is_err(), "{bad} was accepted");
        }
        assert!(t("postgres:///app").unwrap_err().contains("no host"));
        for (q, refused) in [
            ("channel_binding=require", true),
            ("channel_binding=prefer", false),
            ("target_session_attrs=read-write", true),
            ("target_session_attrs=any", false),
            ("load_balance_hosts=random", true),
            ("sslnegotiation=direct", true),
            ("application_name=x", false),
        ] {
            let pg: tokio_postgres::Config = format!("postgres://u@h/db?{q}").parse().unwrap();
            assert_eq!(PgTarget::check_parameters(&pg).is_err(), refused, "{q}");
        }
        assert!(t("postgres://u@h1,h2/app").unwrap_err().contains("2 hosts"));
    }
}
