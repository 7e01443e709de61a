//! The PostgreSQL side: a plain SQL connection for setup and status, and the
//! replication stream.

mod auth_guard;
pub(crate) mod checkpoint_table;
pub(crate) mod coverage;
#[cfg(test)]
mod hostile;
#[cfg(test)]
mod impostor;
pub(crate) mod longest_tx;
pub(crate) mod publication;
pub(crate) mod resume;
#[cfg(test)]
mod scripted;
pub(crate) mod silence;
pub(crate) mod slot;
pub(crate) mod stream;

use std::sync::Arc;
use std::time::Duration;

use pgwire_replication::{ReplicationClient, ReplicationConfig};

use crate::config::{AuthMethod, Login, PostgresConfig, quote_ident, shown_url};
use crate::lsn::Lsn;
use crate::pgurl::{PgTarget, split_pg_url};
use crate::redact::NOT_A_URL;
use crate::tls::{self, TlsFailure};
use auth_guard::{AuthGuard, AuthRefused, GuardedTls};

/// What went wrong on the PostgreSQL side.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// A SQL call failed.
    #[error("{what} ({url}): {source}")]
    Sql {
        /// The call that failed.
        what: String,
        /// The URL, password masked.
        url: String,
        /// tokio-postgres's error.
        source: tokio_postgres::Error,
    },
    /// The replication connection failed.
    #[error("replication stream ({url}): {source}")]
    Replication {
        /// The URL, password masked.
        url: String,
        /// pgwire-replication's error.
        source: pgwire_replication::PgWireError,
    },
    /// A server of the URL could not be reached (or was a standby where
    /// the primary is wanted): worth retrying.
    #[error("connecting to PostgreSQL at {server}: {source}")]
    Connect {
        /// The server, as `host:port`.
        server: String,
        /// What the socket said.
        source: std::io::Error,
    },
    /// The server did not answer in time (hung host, lost packets,
    /// failover in progress): worth retrying.
    #[error("{0} timed out")]
    Timeout(String),
    /// The server ended the stream.
    #[error("replication stream ended by the server")]
    Ended,
    /// The replication connection reached another server, or another
    /// timeline, than the SQL connection just did (a failover under way).
    #[error(
        "the replication connection reached {0}, not the server the SQL connection reached (a failover under way?)"
    )]
    Moved(String),
    /// The stream said nothing, not even to a probe, for this long: a
    /// stopped walsender or a dead connection.
    #[error(
        "the replication stream was silent for {0:?}, even after a probe message (a stalled \
         walsender or a dead connection; the limit is the server's wal_sender_timeout)"
    )]
    Stalled(Duration),
    /// Something the operator must fix (missing slot, wrong settings...).
    #[error("{0}")]
    Setup(String),
    /// The slot is missing or invalidated: its events since the last
    /// confirmed position can only be re-published from the outbox table.
    #[error("{0}")]
    SlotLost(String),
    /// A recovery of this slot is recorded and not finished (another
    /// relay's, or `outbox-relay recover`'s, or one left half way): its
    /// rows go out before anything is streamed, or per-aggregate order
    /// would break. `run` finishes it (or waits for whoever holds it).
    #[error(
        "a recovery of replication slot {0:?} is under way (recorded in the checkpoint table): \
         it is finished before streaming"
    )]
    RecoveryPending(String),
    /// The slot is in use by another process.
    #[error("replication slot {slot:?} is active for PID {pid} (another relay?)")]
    SlotBusy {
        /// The slot.
        slot: String,
        /// The process holding it.
        pid: i32,
    },
    /// Another process wrote what this one was about to replace (a
    /// compare-and-set that found the row changed): read again.
    #[error("{0}; trying again")]
    Raced(String),
    /// The WAL stream could not be understood.
    #[error(transparent)]
    Stream(#[from] crate::outbox::StreamError),
    /// The server refused the password of a `password_file` within
    /// `ROTATION_GRACE` of the first refusal: the next connect reads the
    /// file again.
    #[error(transparent)]
    PasswordRotating(crate::config::Rotating<SourceError>),
}

impl SourceError {
    /// True when retrying later may succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            SourceError::Sql { source, .. } => match source.code() {
                // Class 28: invalid authorization; 3D: no such database;
                // 42: syntax or access rule violation. The operator must act.
                Some(code) => !["28", "3D", "42"]
                    .iter()
                    .any(|c| code.code().starts_with(c)),
                None => true,
            },
            SourceError::Replication { source, .. } => {
                use pgwire_replication::PgWireError as E;
                match source {
                    E::Auth(_) => false,
                    // Certificate and configuration problems became
                    // `Setup` in `start_replication`; what is left is the
                    // connection breaking during a handshake.
                    E::Tls(msg) => !TlsFailure::from_text(msg).is_permanent(),
                    // Class 28 (a login the server refused: pg_hba.conf,
                    // a client certificate) and 3D, as on the SQL side.
                    E::Server(msg) => {
                        !(msg.contains("(SQLSTATE 28")
                            || msg.contains("(SQLSTATE 3D")
                            || msg.contains("does not exist")
                            || msg.contains("permission denied")
                            || msg.contains("must be superuser or replication role"))
                    }
                    _ => true,
                }
            }
            SourceError::Ended
            | SourceError::PasswordRotating(_)
            | SourceError::Moved(_)
            | SourceError::Stalled(_)
            | SourceError::Raced(_)
            | SourceError::SlotBusy { .. }
            | SourceError::Connect { .. }
            | SourceError::Timeout(_) => true,
            // Not retried by a session: `run` goes back to finishing it.
            SourceError::RecoveryPending(_) => false,
            SourceError::Setup(_) | SourceError::SlotLost(_) | SourceError::Stream(_) => false,
        }
    }
}

impl SourceError {
    /// The refusal itself, without the retry a rotating password file
    /// earns (`check` reports it, it does not retry).
    pub fn without_rotation(self) -> SourceError {
        match self {
            SourceError::PasswordRotating(r) => *r.source,
            other => other,
        }
    }
}

/// Startup options of every session the relay opens, SQL and replication:
/// names resolve in `pg_catalog` only (then `pg_temp`, last), whatever
/// search_path the role or database was given (`ALTER ROLE ... SET`,
/// which the client's options outrank). A function or operator someone
/// made in a schema on that path cannot stand in for a built-in one in the
/// relay's SQL, which names its own tables with their schema. PostgreSQL's
/// own logical replication workers do the same.
///
/// And the server keeps TCP keepalives on them (ignored on a Unix socket):
/// a relay whose host died or was cut off without a reset is noticed in
/// about a minute, not the two hours of the kernel's defaults, so that its
/// session's locks (a recovery's advisory lock) do not hold the relay
/// taking over.
pub const SESSION_OPTIONS: &str = "-c search_path=pg_catalog,pg_temp \
     -c tcp_keepalives_idle=30 -c tcp_keepalives_interval=10 -c tcp_keepalives_count=3";

/// Deadline of each SQL call beside the stream (and before a recovery
/// publishes).
pub(crate) const SQL_DEADLINE: Duration = Duration::from_secs(10);

/// `fut` within [`SQL_DEADLINE`]: a server that accepted the connection and
/// then hangs, or a table another session holds locked, ends the attempt
/// (transient, with `what` in the log), not the relay, and never in silence.
pub(crate) async fn bounded<T>(
    what: &str,
    fut: impl std::future::Future<Output = Result<T, SourceError>>,
) -> Result<T, SourceError> {
    match tokio::time::timeout(SQL_DEADLINE, fut).await {
        Ok(r) => r,
        Err(_) => Err(SourceError::Timeout(what.to_owned())),
    }
}

/// Makes the server give up waiting for a lock a second after
/// [`SQL_DEADLINE`] on `client`'s connection (`on`), or wait as long as it
/// takes again: a query [`bounded`] gives up on is not cancelled on the
/// server, so a backend queued behind a lock someone holds for an hour
/// would stay queued, one more at every retry, until `max_connections` ran
/// out. (A second after: the relay's own deadline, which names what it
/// waited for, comes first.)
pub(crate) async fn bound_lock_waits(
    client: &tokio_postgres::Client,
    cfg: &PostgresConfig,
    on: bool,
) -> Result<(), SourceError> {
    let sql = if on {
        let after = SQL_DEADLINE + Duration::from_secs(1);
        format!("SET lock_timeout = '{}ms'", after.as_millis())
    } else {
        "RESET lock_timeout".to_owned()
    };
    bounded("setting lock_timeout", async {
        (client.batch_execute(&sql).await).map_err(sql_err(cfg, "setting lock_timeout"))
    })
    .await
}

/// Deadline for opening a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
/// Deadline for reaching each host of a list.
const HOST_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The deadline of a whole connect to `hosts` hosts, each address with
/// `each` (see `dial`): room for each host's lookup and two of its
/// addresses, then the startup; saturating, whatever connect_timeout the
/// URL says.
fn outer_deadline(each: Duration, hosts: usize) -> Duration {
    CONNECT_TIMEOUT.max(
        each.saturating_mul(3 * hosts as u32)
            .saturating_add(Duration::from_secs(5)),
    )
}

/// Opens a SQL connection; its driver task runs until the client is dropped.
pub async fn connect_sql(cfg: &PostgresConfig) -> Result<tokio_postgres::Client, SourceError> {
    // The password as the password file holds it now (see `Secret`).
    let secret = cfg.url.current();
    let url = secret.expose();
    // The URL was validated with the same split when the config was loaded.
    // The URL was checked to name exactly `cfg.target` when the config was
    // loaded: the replication connection reaches the same server.
    let mut pg: tokio_postgres::Config = split_pg_url(url)
        .url
        .parse()
        .map_err(|_| SourceError::Setup(format!("postgres.url is {NOT_A_URL}")))?;
    // After any options of the URL's, so that ours win.
    let options = match pg.get_options() {
        Some(theirs) if !theirs.trim().is_empty() => format!("{theirs} {SESSION_OPTIONS}"),
        _ => SESSION_OPTIONS.to_owned(),
    };
    pg.options(&options);
    // TCP keepalives notice a dead host or path on a quiet connection
    // (about 30 s), unless the URL chose its own idle time.
    if pg.get_keepalives_idle() == tokio_postgres::Config::new().get_keepalives_idle() {
        pg.keepalives(true)
            .keepalives_idle(Duration::from_secs(15))
            .keepalives_interval(Duration::from_secs(5))
            .keepalives_retries(3);
    }
    // Each host gets its own connect deadline (a host that drops packets
    // would otherwise use up the whole attempt before the next is tried),
    // unless the URL chose one.
    if pg.get_connect_timeout().is_none() {
        pg.connect_timeout(HOST_CONNECT_TIMEOUT);
    }
    let deadline = outer_deadline(
        *pg.get_connect_timeout().expect("set"),
        pg.get_hosts().len(),
    );
    let connector = tls::postgres_sql_tls(
        &mut pg,
        cfg.sslmode,
        cfg.ca_file.as_deref(),
        cfg.client_cert.as_ref(),
    )
    .map_err(|e| {
        SourceError::Setup(format!(
            "TLS for PostgreSQL (postgres.ca_file, cert_file, key_file, or sslrootcert=, \
             sslcert=, sslkey= in postgres.url): {e}"
        ))
    })?;
    let explain = |source: tokio_postgres::Error| {
        if source.code() == Some(&tokio_postgres::error::SqlState::INVALID_PASSWORD) {
            return password_refused(
                cfg,
                Login::Sql,
                SourceError::Sql {
                    what: "connecting to PostgreSQL".into(),
                    url: shown_url(url),
                    source,
                },
            );
        }
        if let Some(refused) = AuthRefused::find(&source) {
            return SourceError::Setup(format!("SQL connection to {}: {refused}", shown_url(url)));
        }
        match TlsFailure::find(&source) {
            Some(f) if f.is_permanent() => {
                SourceError::Setup(tls::postgres_failure(&f, &shown_url(url), cfg.sslmode))
            }
            _ => match source
                .as_db_error()
                .and_then(|db| tls::postgres_wants_tls(db.message(), &shown_url(url), cfg.sslmode))
            {
                Some(msg) => SourceError::Setup(msg),
                None => SourceError::Sql {
                    what: "connecting to PostgreSQL".into(),
                    url: shown_url(url),
                    source,
                },
            },
        }
    };
    let fut = connect_guarded(&pg, cfg, connector, explain);
    match tokio::time::timeout(deadline, fut).await {
        Ok(r) => r,
        Err(_) => Err(SourceError::Timeout(format!(
            "connecting to PostgreSQL ({})",
            shown_url(url)
        ))),
    }
}

/// The servers of `postgres.url` in order, as tokio-postgres's `connect`
/// tries them (each with its own connect deadline and TCP keepalive, the
/// primary only with `target_session_attrs=read-write`), over sockets the
/// relay opens itself: so that both ends of the startup are read by an
/// [`AuthGuard`], which holds the server to `postgres.require_auth`.
async fn connect_guarded(
    pg: &tokio_postgres::Config,
    cfg: &PostgresConfig,
    mut tls: tokio_postgres_rustls::MakeRustlsConnect,
    explain: impl Fn(tokio_postgres::Error) -> SourceError,
) -> Result<tokio_postgres::Client, SourceError> {
    use tokio_postgres::tls::MakeTlsConnect;
    let policy = Arc::new(cfg.require_auth.clone());
    let mut failed = None;
    for target in &cfg.targets {
        let (socket, name) = match open_socket(pg, target).await {
            Ok(s) => s,
            Err(source) => {
                if failed.as_ref().is_none_or(SourceError::is_transient) {
                    failed = Some(SourceError::Connect {
                        server: target.to_string(),
                        source,
                    });
                }
                continue;
            }
        };
        let connector = MakeTlsConnect::<AuthGuard<Socket>>::make_tls_connect(&mut tls, &name)
            .map_err(|e| SourceError::Setup(format!("postgres.url: {e}")))?;
        let guarded = AuthGuard::socket(socket, Arc::clone(&policy));
        let (client, conn) = match pg
            .connect_raw(guarded, GuardedTls::new(connector, Arc::clone(&policy)))
            .await
        {
            Ok(c) => c,
            Err(e) => {
                // A refusal for good is what the operator must see, unless
                // another server lets the relay in.
                if failed.as_ref().is_none_or(SourceError::is_transient) {
                    failed = Some(explain(e));
                }
                continue;
            }
        };
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "SQL connection closed");
            }
        });
        if cfg.read_write {
            let rows = client
                .simple_query("SHOW transaction_read_only")
                .await
                .map_err(&explain)?;
            let read_only = rows.iter().any(|m| {
                matches!(m, tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some("on"))
            });
            if read_only {
                if failed.as_ref().is_none_or(SourceError::is_transient) {
                    failed = Some(SourceError::Connect {
                        server: target.to_string(),
                        source: std::io::Error::new(
                            std::io::ErrorKind::PermissionDenied,
                            "database does not allow writes (a standby)",
                        ),
                    });
                }
                continue;
            }
        }
        cfg.url.login_accepted(Login::Sql);
        return Ok(client);
    }
    Err(failed.expect("postgres.url names at least one server"))
}

/// A socket to one server of the URL.
type Socket = Box<dyn SocketIo>;
trait SocketIo: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> SocketIo for T {}

/// Connects to `target` within the URL's connect deadline, with its TCP
/// keepalive; also returns the name TLS checks the certificate against.
async fn open_socket(
    pg: &tokio_postgres::Config,
    target: &PgTarget,
) -> std::io::Result<(Socket, String)> {
    let deadline = pg
        .get_connect_timeout()
        .copied()
        .unwrap_or(HOST_CONNECT_TIMEOUT);
    let timed_out = || std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out");
    match target {
        PgTarget::Tcp { name, addr, port } => {
            // The deadline for each address the name resolves to, as
            // libpq's connect_timeout.
            let tcp = crate::dial::connect(addr, *port, deadline).await?;
            tcp.set_nodelay(true)?;
            if pg.get_keepalives() {
                let keepalive = socket2::TcpKeepalive::new()
                    .with_time(pg.get_keepalives_idle())
                    .with_interval(
                        pg.get_keepalives_interval()
                            .unwrap_or(Duration::from_secs(5)),
                    )
                    .with_retries(pg.get_keepalives_retries().unwrap_or(3));
                socket2::SockRef::from(&tcp).set_tcp_keepalive(&keepalive)?;
            }
            Ok((Box::new(tcp), name.clone()))
        }
        PgTarget::Unix { dir, port } => {
            let path = dir.join(format!(".s.PGSQL.{port}"));
            let unix = tokio::time::timeout(deadline, tokio::net::UnixStream::connect(path))
                .await
                .map_err(|_| timed_out())??;
            Ok((Box::new(unix), String::new()))
        }
    }
}

/// Wraps a SQL error with what was being done.
pub fn sql_err(
    cfg: &PostgresConfig,
    what: impl Into<String>,
) -> impl FnOnce(tokio_postgres::Error) -> SourceError {
    let url = shown_url(cfg.url.expose());
    let what = what.into();
    move |source| SourceError::Sql { what, url, source }
}

/// How much the replication client buffers, and how long its stream may be
/// silent.
#[derive(Debug, Clone, Copy)]
pub struct StreamLimits {
    /// Events buffered inside the client (a count, not bytes).
    pub buffer_events: usize,
    /// See [`silence`].
    pub silence_limit: Duration,
}

/// Starts streaming from the slot at `start` (a position known confirmed,
/// see [`resume`]), reporting it as flushed until the relay reports more.
/// The servers of `postgres.url` are tried in order; the stream opens on
/// the first that answers, is `server` when given (same cluster, same
/// timeline: the one the SQL connection read), and is the primary when the
/// URL asks for `target_session_attrs=read-write`.
pub async fn start_replication(
    cfg: &PostgresConfig,
    start: Lsn,
    server: Option<&resume::Server>,
    limits: StreamLimits,
) -> Result<ReplicationClient, SourceError> {
    // When every server fails, a refusal for good (credentials, TLS, no
    // slot) is what the operator must see; it only ends the attempt when
    // no other server took the stream (pg_hba.conf and certificates differ
    // between servers).
    let mut failed: Option<SourceError> = None;
    for target in &cfg.targets {
        let opened = open_replication(cfg, target, start, server, limits, true);
        match opened.await {
            Ok(client) => return Ok(client),
            Err(e) => {
                if cfg.targets.len() > 1 {
                    tracing::debug!(server = %target, error = %e, "not streaming from this server");
                }
                if failed.as_ref().is_none_or(SourceError::is_transient) {
                    failed = Some(e);
                }
            }
        }
    }
    Err(failed.expect("postgres.url names at least one server"))
}

/// Makes the slot a failover slot (`ALTER_REPLICATION_SLOT … (FAILOVER
/// true)`, PostgreSQL 17+), over a replication connection to the first
/// server of `postgres.url` that takes one (the primary, with
/// `target_session_attrs=read-write`): the only way to change an existing
/// slot. The server refuses it for a slot in use.
pub async fn make_failover_slot(cfg: &PostgresConfig) -> Result<(), SourceError> {
    const ALTER_TIMEOUT: Duration = Duration::from_secs(10);
    let limits = StreamLimits {
        buffer_events: 1,
        silence_limit: Duration::from_secs(60),
    };
    let mut failed: Option<SourceError> = None;
    for target in &cfg.targets {
        let mut client = match open_replication(cfg, target, Lsn(0), None, limits, false).await {
            Ok(c) => c,
            Err(e) => {
                if failed.as_ref().is_none_or(SourceError::is_transient) {
                    failed = Some(e);
                }
                continue;
            }
        };
        // The server waits for a slot in use to be freed (no error, no
        // statement_timeout for replication commands): a relay that took
        // the slot since it was looked at would hold this up for as long
        // as it streams.
        let altered = tokio::time::timeout(
            ALTER_TIMEOUT,
            client.simple_query(&format!(
                "ALTER_REPLICATION_SLOT {} (FAILOVER true)",
                quote_ident(&cfg.slot)
            )),
        )
        .await;
        client.abort();
        return match altered {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(source)) => Err(SourceError::Setup(format!(
                "making replication slot {:?} a failover slot (ALTER_REPLICATION_SLOT): {source}",
                cfg.slot
            ))),
            Err(_) => Err(SourceError::Timeout(format!(
                "making replication slot {:?} a failover slot (in use: a relay took it \
                 meanwhile? it may still become one once freed)",
                cfg.slot
            ))),
        };
    }
    Err(failed.expect("postgres.url names at least one server"))
}

/// `refusal`, the server's refusal of the password, retried as
/// [`SourceError::PasswordRotating`] when the password comes from a file
/// that may be being rotated.
fn password_refused(cfg: &PostgresConfig, login: Login, refusal: SourceError) -> SourceError {
    (cfg.url).refusal(login, refusal, SourceError::PasswordRotating)
}

/// The server's refusal of START_REPLICATION for a slot that does not
/// exist (`replication slot "x" does not exist`, SQLSTATE 42704): by its
/// English text, or, in any `lc_messages`, by its code and the slot's name
/// (quoted as the language quotes). (A slot taken for missing that exists
/// costs a recovery that finds it healthy; one missed costs the remedy.)
fn slot_missing(msg: &str, slot: &str) -> bool {
    msg.contains(&format!("replication slot \"{slot}\" does not exist"))
        || (msg.ends_with("(SQLSTATE 42704)")
            && !msg.starts_with("publication ")
            && msg.contains(slot))
}

async fn open_replication(
    cfg: &PostgresConfig,
    target: &PgTarget,
    start: Lsn,
    server: Option<&resume::Server>,
    StreamLimits {
        buffer_events,
        silence_limit,
    }: StreamLimits,
    stream: bool,
) -> Result<ReplicationClient, SourceError> {
    let secret = cfg.url.current();
    let url = secret.expose();
    let pg: tokio_postgres::Config = split_pg_url(url)
        .url
        .parse()
        .map_err(|_| SourceError::Setup(format!("postgres.url is {NOT_A_URL}")))?;
    let user = pg.get_user().unwrap_or("postgres").to_owned();
    let password = pg
        .get_password()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .unwrap_or_default();
    let database = pg.get_dbname().unwrap_or(&user).to_owned();
    let address_timeout = (pg.get_connect_timeout().copied()).unwrap_or(HOST_CONNECT_TIMEOUT);
    // pgwire-replication reads the client certificate's files itself: a
    // pair that cannot be used right now (replaced one file after the
    // other, read in between) is tried again, not a refusal for good.
    if let (Some(client), PgTarget::Tcp { .. }) = (&cfg.client_cert, target)
        && cfg.sslmode != tls::SslMode::Disable
        && let Err(e) = client.fresh()
    {
        return Err(SourceError::Connect {
            server: target.to_string(),
            source: std::io::Error::other(format!(
                "postgres.cert_file/key_file (or sslcert=/sslkey= in postgres.url): {e}; \
                 trying again (a certificate being replaced?)"
            )),
        });
    }
    let tls_config = tls::postgres_replication_tls_for(
        cfg.sslmode,
        cfg.ca_file.as_deref(),
        target,
        cfg.client_cert.as_ref(),
    )
    .await
    .map_err(SourceError::Setup)?;
    // `hostaddr` when the URL gives one (the name is still what the
    // certificate is checked against).
    // pgoutput reads publication_names as a list of identifiers: quoted,
    // `OutboxPub` stays mixed-case and `a,b` stays one name.
    let (slot, publication) = (cfg.slot.clone(), quote_ident(&cfg.publication));
    let base = match target {
        PgTarget::Unix { dir, port } => ReplicationConfig::unix(
            dir.display().to_string(),
            *port,
            user,
            password,
            database,
            slot,
            publication,
        ),
        PgTarget::Tcp { addr, port, .. } => {
            ReplicationConfig::new(addr.clone(), user, password, database, slot, publication)
                .with_port(*port)
                // Each address of the name, as the SQL connection does.
                .with_address_timeout(address_timeout)
        }
    };
    let rc = base
        .with_tls(tls_config)
        .with_start_lsn(start.into())
        .with_ack_lsn(start.into())
        .with_status_interval(cfg.status_interval)
        .with_wakeup_interval(silence::ask_every(silence_limit))
        .with_buffer_size(buffer_events)
        .with_application_name("outbox-relay")
        .with_options(SESSION_OPTIONS)
        .with_auth_allowed(cfg.require_auth.for_replication());
    // `connect` only spawns the worker: wait until the server accepted
    // START_REPLICATION, so that TLS, authentication and slot errors surface
    // here, where they can be explained. Before it, on the same session:
    // is this the server the SQL connection read, and the primary?
    let open = async {
        let mut client = ReplicationClient::connect_gated(rc).await?;
        if let Some(server) = server {
            let id = client.identify_system().await?;
            if id.system_id != server.system_id || id.timeline != server.timeline {
                return Ok(Err(SourceError::Moved(format!(
                    "{target} (system {} timeline {})",
                    id.system_id, id.timeline
                ))));
            }
        }
        if cfg.read_write {
            // As the SQL connection does (`SHOW transaction_read_only`): a
            // primary fenced read only is not the one to use either.
            let rows = client
                .simple_query(
                    "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'",
                )
                .await?;
            let standby = rows
                .first()
                .and_then(|r| r.first())
                .and_then(|v| v.as_deref())
                != Some(b"f".as_slice());
            if standby {
                return Ok(Err(SourceError::Moved(format!(
                    "{target}, a standby (or read only)"
                ))));
            }
        }
        if stream {
            client.start().await?;
            client.wait_started().await?;
        }
        Ok::<_, pgwire_replication::PgWireError>(Ok(client))
    };
    let deadline = outer_deadline(address_timeout, 1);
    match tokio::time::timeout(deadline, open).await {
        Ok(Ok(r)) => {
            cfg.url.login_accepted(Login::Replication);
            r
        }
        Ok(Err(source)) => Err(match &source {
            // Accepted on the SQL connection a moment before: a rotation
            // in between, or a password that only this one refuses.
            pgwire_replication::PgWireError::Server(msg) if msg.ends_with("(SQLSTATE 28P01)") => {
                password_refused(
                    cfg,
                    Login::Replication,
                    SourceError::Setup(format!(
                        "replication connection to {target}: {msg}: fix the password (postgres.url, \
                         OUTBOX_RELAY_POSTGRES_URL or postgres.password_file)"
                    )),
                )
            }
            pgwire_replication::PgWireError::AuthNotAllowed { method } => {
                let m = AuthMethod::by_name(method).unwrap_or(AuthMethod::None);
                SourceError::Setup(format!(
                    "replication connection to {target}: {}",
                    cfg.require_auth.refusal(m)
                ))
            }
            // The server's alert about our certificate comes after the
            // handshake under TLS 1.3, on the first read.
            pgwire_replication::PgWireError::Io(io)
                if matches!(
                    TlsFailure::find(io.as_ref()),
                    Some(TlsFailure::ClientCertRefused(_))
                ) =>
            {
                let f = TlsFailure::find(io.as_ref()).expect("matched");
                SourceError::Setup(tls::postgres_failure(&f, &shown_url(url), cfg.sslmode))
            }
            pgwire_replication::PgWireError::Tls(msg)
                if TlsFailure::from_text(msg).is_permanent() =>
            {
                SourceError::Setup(tls::postgres_failure(
                    &TlsFailure::from_text(msg),
                    &shown_url(url),
                    cfg.sslmode,
                ))
            }
            // Dropped since `usable_slot` read it (a drop between the SQL
            // check and the stream, seen by the checker under load): lost,
            // as a slot missing at the check is, so that it is recovered
            // (on_slot_lost = "recover") or the stop names `recover`.
            pgwire_replication::PgWireError::Server(msg) if slot_missing(msg, &cfg.slot) => {
                slot::SlotProblem::Missing.error(&cfg.slot)
            }
            _ => match tls::postgres_wants_tls(&source.to_string(), &shown_url(url), cfg.sslmode) {
                Some(msg) => SourceError::Setup(msg),
                None => SourceError::Replication {
                    url: shown_url(url),
                    source,
                },
            },
        }),
        Err(_) => Err(SourceError::Timeout(format!(
            "opening the replication connection ({})",
            shown_url(url)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A login the server refuses on the replication connection (no or a
    /// wrong client certificate, pg_hba.conf) is the operator's, as on the
    /// SQL connection; a connection lost in the handshake is not.
    #[test]
    fn a_refused_replication_login_is_not_retried() {
        let e = |msg: &str| SourceError::Replication {
            url: "postgres://relay@db/app".into(),
            source: pgwire_replication::PgWireError::Server(msg.into()),
        };
        for refused in [
            "connection requires a valid client certificate (SQLSTATE 28000)",
            "password authentication failed for user \"relay\" (SQLSTATE 28P01)",
            // Not English (lc_messages): the code alone says it.
            "la base de données « app » n'existe pas (SQLSTATE 3D000)",
            "authentification par mot de passe échouée (SQLSTATE 28P01)",
        ] {
            assert!(!e(refused).is_transient(), "{refused}");
        }
        assert!(
            e("terminating connection due to administrator command (SQLSTATE 57P01)")
                .is_transient()
        );
    }

    /// A slot dropped between the SQL check and START_REPLICATION is lost
    /// (recovered, or the stop names `recover`), not a failure without a
    /// remedy; another server error about another slot is not.
    #[test]
    fn a_slot_dropped_before_the_stream_opens_is_lost() {
        let msg = "replication slot \"outbox_relay\" does not exist";
        assert!(slot_missing(msg, "outbox_relay"));
        assert!(!slot_missing(msg, "other"));
        assert!(!slot_missing(
            "publication \"outbox_relay\" does not exist",
            "outbox_relay"
        ));
        // As pgwire-replication words it, and in another language.
        let code = "replication slot \"outbox_relay\" does not exist (SQLSTATE 42704)";
        assert!(slot_missing(code, "outbox_relay"));
        let de = "Replikations-Slot »outbox_relay« existiert nicht (SQLSTATE 42704)";
        assert!(slot_missing(de, "outbox_relay"));
        assert!(!slot_missing(de, "other"));
        assert!(!slot_missing(
            "publication \"outbox_relay\" does not exist (SQLSTATE 42704)",
            "outbox_relay"
        ));
        let other = "Replikations-Slot »outbox_relay« ist aktiv (SQLSTATE 55006)";
        assert!(!slot_missing(other, "outbox_relay"));
        let e = slot::SlotProblem::Missing.error("outbox_relay");
        assert!(matches!(&e, SourceError::SlotLost(t) if t.contains("outbox-relay recover")));
    }
}
