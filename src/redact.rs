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
    let uri = crate::amqpurl::parse_amqp_url(url).ok()?;
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
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn targets_are_rebuilt_from_their_parts() {
        assert_eq!(
            shown_url("postgres://relay:s3cret@127.0.0.1:5432/app?sslmode=require"),
            "postgres://relay@127.0.0.1:5432/app"
        );
        assert_eq!(
            shown_url("postgresql://relay@h1:5432,h2:5433/app?target_session_attrs=read-write"),
            "postgres://relay@h1:5432,h2:5433/app"
        );
        assert_eq!(
            shown_url("postgres://u@%2Fvar%2Frun%2Fpostgresql/app"),
            "postgres://u@%2Fvar%2Frun%2Fpostgresql:5432/app"
        );
        // The URL parser reads the credentials up to the last `@`.
        assert_eq!(shown_url("amqp://u:p@ss@h/v?x=1"), "amqp://u@h:5672/v");
        assert_eq!(
            shown_url("amqps://relay:s3cret@[::1]:5671/%2f"),
            "amqps://relay@[::1]:5671/%2F"
        );
        assert_eq!(
            shown_url("amqp://127.0.0.1"),
            "amqp://guest@127.0.0.1:5672/%2F"
        );
        assert_eq!(shown_url("host=db password=s3cret"), NOT_A_URL);
        // A line break in a part cannot forge a log line.
        assert_eq!(
            shown_url("postgres://re%0Alay@db/app"),
            "postgres://re%0Alay@db:5432/app"
        );
    }

    /// The four shapes that masking missed (issue 25, C11).
    #[test]
    fn shapes_masking_missed() {
        for url in [
            "postgres://postgres@host:5432/app?pass%77ord=Sup3rS3cret",
            "postgres://postgres@host:5432/app?%70assword=Sup3rS3cret",
            "postgres://postgres@host:5432/app?password=ab#Sup3rS3cret",
            "amqp://user:Sup3rS3cret",
        ] {
            let shown = shown_url(url);
            assert!(!shown.contains("S3cret"), "{url} -> {shown}");
        }
        let pg: tokio_postgres::Config =
            "postgres://postgres@host:5432/app?password=ab#Sup3rS3cret"
                .parse()
                .unwrap();
        assert_eq!(pg.get_password(), Some(&b"ab#Sup3rS3cret"[..]));
        assert_eq!(
            shown_url("postgres://postgres@host:5432/app?password=ab#Sup3rS3cret"),
            "postgres://postgres@host:5432/app"
        );
    }

    /// Every generated password holds `Zq` once, at its start; no other part
    /// of a generated URL holds a `Z`. So a printed form that holds the
    /// password the driver sends (which starts where the password was
    /// written) holds `Zq`.
    const MARK: &str = "Zq";

    /// The characters drivers treat specially, and others (never `Z`).
    fn password() -> impl Strategy<Value = String> {
        "[a-zA-Y0-9/?#@:%&= ._'\\\\+-]{0,16}".prop_map(|p| format!("{MARK}{p}"))
    }

    fn encoded(s: &str) -> String {
        utf8_percent_encode(s, NON_ALPHANUMERIC).to_string()
    }

    /// Where and how a PostgreSQL URL carries its password.
    fn pg_url() -> impl Strategy<Value = (String, String)> {
        let hosts = prop::sample::select(vec![
            "db.example",
            "127.0.0.1",
            "[::1]",
            "h1:5432,h2:5433",
            "db.example:6432",
        ]);
        let place = prop::sample::select(vec![
            "userinfo",
            "userinfo-encoded",
            "password=",
            "password=encoded",
            "pass%77ord=",
            "%70assword=",
            "%70%61ss%77ord=",
            "PASSWORD=",
            "userinfo+query",
        ]);
        let extra = prop::sample::select(vec![
            "",
            "sslmode=require",
            "application_name=a",
            "sslmode=verify-full&sslrootcert=%2Fca.pem",
        ]);
        (
            "[a-y]{1,8}",
            password(),
            hosts,
            "(/[a-y]{1,8})?",
            place,
            extra,
            any::<bool>(),
        )
            .prop_map(|(user, pw, hosts, db, place, extra, extra_first)| {
                let (userinfo, param) = match place {
                    "userinfo" => (format!("{user}:{pw}@"), None),
                    "userinfo-encoded" => (format!("{user}:{}@", encoded(&pw)), None),
                    "password=" => (format!("{user}@"), Some(format!("password={pw}"))),
                    "password=encoded" => (
                        format!("{user}@"),
                        Some(format!("password={}", encoded(&pw))),
                    ),
                    "userinfo+query" => (
                        format!("{user}:other@"),
                        Some(format!("password={}", encoded(&pw))),
                    ),
                    key => (format!("{user}@"), Some(format!("{key}{pw}"))),
                };
                let query: Vec<String> = match (param, extra) {
                    (None, "") => vec![],
                    (None, e) => vec![e.to_owned()],
                    (Some(p), "") => vec![p],
                    (Some(p), e) if extra_first => vec![e.to_owned(), p],
                    (Some(p), e) => vec![p, e.to_owned()],
                };
                let query = if query.is_empty() {
                    String::new()
                } else {
                    format!("?{}", query.join("&"))
                };
                let db = if db.is_empty() && !query.is_empty() {
                    "/".to_owned()
                } else {
                    db
                };
                (format!("postgres://{userinfo}{hosts}{db}{query}"), user)
            })
    }

    /// Where and how an AMQP URL carries its password; with and without a host.
    fn amqp_url() -> impl Strategy<Value = String> {
        let shape = prop::sample::select(vec![
            "amqp://{u}:{p}@db.example:5672/%2f",
            "amqps://{u}:{p}@127.0.0.1/vh",
            "amqp://{u}:{p}@[::1]:5672/%2f?heartbeat=10",
            "amqp://{u}:{p}",
            "amqp://{u}:{p}@",
            "amqp://{u}:{p}@/%2f",
            "amqp://{u}:{p}/vh",
        ]);
        ("[a-y]{1,8}", password(), shape, any::<bool>()).prop_map(|(user, pw, shape, enc)| {
            let pw = if enc { encoded(&pw) } else { pw };
            shape.replace("{u}", &user).replace("{p}", &pw)
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn no_postgres_url_prints_the_password_sent((url, user) in pg_url()) {
            let shown = shown_url(&url);
            let driver = crate::pgurl::split_pg_url(&url).url.parse::<tokio_postgres::Config>();
            match driver {
                Ok(pg) => {
                    let rebuilt = shown.starts_with(&format!("postgres://{user}@"));
                    prop_assert!(rebuilt, "{url} -> {shown}");
                    if let Some(sent) = pg.get_password() {
                        let sent = String::from_utf8_lossy(sent);
                        prop_assert!(sent.starts_with(MARK), "{url}: sends {sent}");
                        prop_assert!(!shown.contains(sent.as_ref()), "{url} -> {shown}");
                    }
                    prop_assert!(!shown.contains(MARK), "{url} -> {shown}");
                }
                Err(_) => prop_assert_eq!(shown, NOT_A_URL, "{}", url),
            }
        }

        #[test]
        fn no_amqp_url_prints_the_password_sent(url in amqp_url()) {
            let shown = shown_url(&url);
            match crate::amqpurl::parse_amqp_url(&url) {
                Ok(uri) => {
                    let sent = &uri.authority.userinfo.password;
                    prop_assert!(shown.starts_with("amqp"), "{url} -> {shown}");
                    prop_assert!(!sent.is_empty() && !shown.contains(sent.as_str()), "{url} -> {shown}");
                    prop_assert!(!shown.contains(MARK), "{url} -> {shown}");
                }
                Err(_) => prop_assert_eq!(shown, NOT_A_URL, "{}", url),
            }
        }
    }
}
