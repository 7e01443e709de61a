//! `postgres://` URLs: libpq's TLS parameters that tokio-postgres does not
//! know, and the servers that both PostgreSQL connections may reach.
//!
//! The SQL connection (tokio-postgres) and the replication connection
//! (pgwire-replication) are opened by two libraries that read a URL
//! differently: tokio-postgres honours `hostaddr`, host lists and
//! `target_session_attrs` and refuses a URL without a host,
//! pgwire-replication knows none of them. So the URL is read once, here,
//! into [`PgTarget`]s. The SQL connection goes to the first that answers
//! (and is the primary, with `target_session_attrs=read-write`); the
//! replication connection then tries them in the same order and opens only
//! on the same cluster and timeline, and on the primary when asked (see
//! `source::start_replication`). Forms that cannot mean the same server for
//! both (no host, a `hostaddr` beside a socket directory, load balancing)
//! are refused when the configuration is loaded.

use std::path::PathBuf;

use tokio_postgres::config::Host;

/// A `postgres://` URL split into the part tokio-postgres understands and
/// libpq's parameters it does not know (`verify-ca`, `verify-full`,
/// `sslrootcert`, `require_auth`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgUrl {
    /// The URL without `sslmode` and `sslrootcert`.
    pub url: String,
    /// `sslmode=` as written.
    pub sslmode: Option<String>,
    /// `sslrootcert=`, percent-decoded.
    pub sslrootcert: Option<String>,
    /// `require_auth=`, percent-decoded.
    pub require_auth: Option<String>,
    /// `sslcert=`, percent-decoded.
    pub sslcert: Option<String>,
    /// `sslkey=`, percent-decoded.
    pub sslkey: Option<String>,
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

/// Splits `sslmode`, `sslrootcert`, `require_auth`, `sslcert` and `sslkey`
/// out of the URL's query string.
pub fn split_pg_url(url: &str) -> PgUrl {
    let Some(q) = query_start(url) else {
        return PgUrl {
            url: url.to_owned(),
            sslmode: None,
            sslrootcert: None,
            require_auth: None,
            sslcert: None,
            sslkey: None,
        };
    };
    let (base, query) = (&url[..q], &url[q + 1..]);
    let (mut sslmode, mut sslrootcert, mut require_auth) = (None, None, None);
    let (mut sslcert, mut sslkey) = (None, None);
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match percent_decode(k).as_str() {
            "sslmode" => sslmode = Some(percent_decode(v)),
            "sslrootcert" => sslrootcert = Some(percent_decode(v)),
            "require_auth" => require_auth = Some(percent_decode(v)),
            "sslcert" => sslcert = Some(percent_decode(v)),
            "sslkey" => sslkey = Some(percent_decode(v)),
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
        require_auth,
        sslcert,
        sslkey,
    }
}

/// True when the query of a `postgres://` URL sets `password`, as
/// tokio-postgres reads the keys: percent-decoded (`?pass%77ord=` too).
pub fn query_has_password(url: &str) -> bool {
    query_start(url).is_some_and(|q| {
        (url[q + 1..].split('&'))
            .any(|pair| percent_decode(pair.split_once('=').map_or(pair, |(k, _)| k)) == "password")
    })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%'
            && i + 2 < b.len()
            && let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2]))
        {
            out.push((h * 16 + l) as u8);
            i += 3;
            continue;
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

impl std::fmt::Display for PgTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PgTarget::Tcp { name, port, .. } if name.contains(':') => write!(f, "[{name}]:{port}"),
            PgTarget::Tcp { name, port, .. } => write!(f, "{name}:{port}"),
            PgTarget::Unix { dir, port } => write!(f, "{}:{port}", dir.display()),
        }
    }
}

impl PgTarget {
    /// Reads the target of a parsed URL; the message says which form is not
    /// supported and why (the caller names `postgres.url`).
    pub fn of(pg: &tokio_postgres::Config) -> Result<PgTarget, String> {
        let mut all = PgTarget::all(pg)?;
        if all.len() > 1 {
            return Err(format!("lists {} hosts where one is wanted", all.len()));
        }
        Ok(all.remove(0))
    }

    /// The servers of a parsed URL, in order, as libpq reads a list:
    /// `h1:5432,h2:5433`, one port for all or one each, and as many
    /// `hostaddr`s as hosts if any. The message says which form is not
    /// supported and why (the caller names `postgres.url`).
    pub fn all(pg: &tokio_postgres::Config) -> Result<Vec<PgTarget>, String> {
        let hosts = pg.get_hosts();
        let addrs = pg.get_hostaddrs();
        let ports = pg.get_ports();
        if (addrs.len() > 1 || !addrs.is_empty() && hosts.len() > 1) && addrs.len() != hosts.len() {
            return Err(format!(
                "lists {} hosts and {} hostaddrs; give one hostaddr per host, or none",
                hosts.len(),
                addrs.len()
            ));
        }
        if ports.len() > 1 && ports.len() != hosts.len() {
            return Err(format!(
                "lists {} hosts and {} ports; give one port for all, or one per host",
                hosts.len(),
                ports.len()
            ));
        }
        let no_host = |h: &Host| matches!(h, Host::Tcp(name) if name.is_empty());
        if hosts.is_empty() || hosts.iter().any(no_host) {
            return Err(
                "names no host (write it after @, e.g. postgres://user@db.example:5432/app, or \
                 host=/var/run/postgresql for a Unix socket); without one the two connections \
                 could reach different servers"
                    .to_owned(),
            );
        }
        hosts
            .iter()
            .enumerate()
            .map(|(i, host)| {
                let port = ports
                    .get(i)
                    .or_else(|| ports.first())
                    .copied()
                    .unwrap_or(5432);
                match (host, addrs.get(i)) {
                    (Host::Unix(_), Some(_)) => Err(
                        "gives hostaddr beside a Unix-socket host; use one or the other".to_owned(),
                    ),
                    (Host::Unix(dir), None) => Ok(PgTarget::Unix {
                        dir: dir.clone(),
                        port,
                    }),
                    (Host::Tcp(name), addr) => Ok(PgTarget::Tcp {
                        name: name.clone(),
                        addr: addr.map_or_else(|| name.clone(), |a| a.to_string()),
                        port,
                    }),
                }
            })
            .collect()
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
        if !matches!(
            pg.get_target_session_attrs(),
            TargetSessionAttrs::Any | TargetSessionAttrs::ReadWrite
        ) {
            return Err(
                "sets target_session_attrs to a value the relay does not honour; it \
                 needs the primary: use read-write (or leave it out)"
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
            .map_err(|_| format!("is {}", crate::redact::NOT_A_URL))?;
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

        for (url, has) in [
            ("postgres://u@db/app?password=x", true),
            ("postgres://u@db/app?sslmode=require&pass%77ord=x", true),
            ("postgres://u@db/app?%70assword=x", true),
            ("postgres://u:x@db/app?sslmode=require", false),
            ("postgres://u:a?password=b@db/app", false),
            ("postgres://u@db/app?old_password=x", false),
        ] {
            assert_eq!(query_has_password(url), has, "{url}");
        }
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
            "postgres://u@h/app?hostaddr=127.0.0.1,127.0.0.2",
            "postgres://u@h1,h2,h3/app?port=1,2",
            "postgres://u@%2Ftmp/app?hostaddr=127.0.0.1",
        ] {
            assert!(t(bad).is_err(), "{bad} was accepted");
        }
        assert!(t("postgres:///app").unwrap_err().contains("no host"));
        for (q, refused) in [
            ("channel_binding=require", true),
            ("channel_binding=prefer", false),
            ("target_session_attrs=read-write", false),
            ("target_session_attrs=any", false),
            ("load_balance_hosts=random", true),
            ("sslnegotiation=direct", true),
            ("application_name=x", false),
        ] {
            let pg: tokio_postgres::Config = format!("postgres://u@h/db?{q}").parse().unwrap();
            assert_eq!(PgTarget::check_parameters(&pg).is_err(), refused, "{q}");
        }
        assert!(t("postgres://u@h1,h2/app").unwrap_err().contains("2 hosts"));
        let all = |u: &str| {
            let pg: tokio_postgres::Config = u.parse().unwrap();
            PgTarget::all(&pg)
        };
        let tcp = |name: &str, port| PgTarget::Tcp {
            name: name.into(),
            addr: name.into(),
            port,
        };
        assert_eq!(
            all("postgres://u@h1:5432,h2:5433/app?target_session_attrs=read-write"),
            Ok(vec![tcp("h1", 5432), tcp("h2", 5433)])
        );
        assert_eq!(
            all("postgres://u@h1,h2/app"),
            Ok(vec![tcp("h1", 5432), tcp("h2", 5432)])
        );
    }
}
