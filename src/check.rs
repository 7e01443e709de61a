//! `outbox-relay check`: a preflight of everything `run` needs, against the
//! real servers, without changing anything on them.
//!
//! One line per check, in a fixed order:
//!
//! ```text
//! ok <what>[: <details>]
//! warn <what>: <what to know>
//! FAIL <what>: <what is wrong and how to fix it>
//! ```
//!
//! 1. PostgreSQL reachable and authenticated (when not, the other PostgreSQL
//!    checks are skipped, in one line saying so);
//! 2. `wal_level = logical`;
//! 3. a free replication slot (unless ours exists) and a free WAL sender;
//! 4. the role may replicate (a warning when it is a superuser); the
//!    checkpoint table's owner is trusted and it has no triggers;
//! 5. the publication exists, covers the outbox table, publishes inserts;
//! 6. the outbox table has every mapped column, each of a supported type;
//! 7. the replication slot exists, uses pgoutput, is not lost; active or not;
//! 8. RabbitMQ reachable, credentials and vhost accepted (when not, the
//!    exchange checks are skipped);
//! 9. the exchange exists (when it is not a template), and the dead-letter
//!    exchange when configured.
//!
//! Each check has its own deadline ([`CHECK_TIMEOUT`]). Passwords are never
//! printed: URLs go through [`shown_url`], and errors from the drivers do
//! not carry them.

use std::fmt;
use std::future::Future;
use std::process::ExitCode;
use std::time::Duration;

use crate::config::Config;
use crate::source::SourceError;

mod broker;
mod outbox;
mod postgres;
use crate::sink::AmqpSink;
use broker::{broker_connect, broker_in_the_clear, exchanges};
use outbox::{emit_privilege, message_outbox, outbox_table, publication};
use postgres::{
    checkpoint_table, hosts, pg_error_text, postgres_connect, replication_slot, role,
    server_identity, slots_and_senders, wal_level,
};

/// Deadline of each check (connecting included).
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(15);

/// Type OIDs the checks name.
mod oid {
    pub const JSON: u32 = 114;
    pub const JSONB: u32 = 3802;
    pub const TIMESTAMP: u32 = 1114;
    pub const TIMESTAMPTZ: u32 = 1184;
    pub const INT2: u32 = 21;
    pub const INT4: u32 = 23;
    pub const INT8: u32 = 20;
    pub const NUMERIC: u32 = 1700;
}

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// Fine.
    Ok,
    /// Fine for `run`, but worth knowing.
    Warn,
    /// `run` would fail, or misbehave, until this is fixed.
    Fail,
}

impl Level {
    /// The word that starts the line.
    pub fn word(self) -> &'static str {
        match self {
            Level::Ok => "ok",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        }
    }
}

/// One output line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    /// Outcome.
    pub level: Level,
    /// What was checked, e.g. `publication "outbox_pub"`.
    pub what: String,
    /// Details; for `warn` and `FAIL`, what is wrong and how to fix it.
    pub detail: Option<String>,
}

impl Line {
    fn new(level: Level, what: impl Into<String>, detail: Option<String>) -> Line {
        Line {
            level,
            what: what.into(),
            detail,
        }
    }
    fn ok(what: impl Into<String>, detail: impl Into<String>) -> Line {
        Line::new(Level::Ok, what, Some(detail.into()))
    }
    fn warn(what: impl Into<String>, detail: impl Into<String>) -> Line {
        Line::new(Level::Warn, what, Some(detail.into()))
    }
    fn fail(what: impl Into<String>, detail: impl Into<String>) -> Line {
        Line::new(Level::Fail, what, Some(detail.into()))
    }
}

impl fmt::Display for Line {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.level.word(), self.what)?;
        if let Some(d) = &self.detail {
            write!(f, ": {d}")?;
        }
        Ok(())
    }
}

/// Why a check could not be completed (a query failed).
#[derive(Debug)]
struct CheckError(String);

impl From<tokio_postgres::Error> for CheckError {
    fn from(e: tokio_postgres::Error) -> Self {
        CheckError(pg_error_text(&e))
    }
}

impl From<SourceError> for CheckError {
    fn from(e: SourceError) -> Self {
        match e {
            SourceError::Sql { what, source, .. } => {
                CheckError(format!("{what}: {}", pg_error_text(&source)))
            }
            other => CheckError(other.to_string()),
        }
    }
}

/// `check`: prints one line per check to stdout as each completes; exit code
/// 1 when any check failed.
pub async fn run(cfg: &Config) -> ExitCode {
    use std::io::Write;
    let lines = check(cfg, |line| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    })
    .await;
    let failed = lines.iter().filter(|l| l.level == Level::Fail).count();
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        let s = if failed == 1 { "" } else { "s" };
        eprintln!("outbox-relay: check: {failed} check{s} failed");
        ExitCode::FAILURE
    }
}

/// Runs every check in order, handing each line to `emit` as soon as it is
/// known; returns them all.
pub async fn check(cfg: &Config, mut emit: impl FnMut(&Line)) -> Vec<Line> {
    let mut lines = Vec::new();
    let mut push = |new: Vec<Line>| {
        for l in new {
            emit(&l);
            lines.push(l);
        }
    };

    // PostgreSQL.
    let (line, client) = postgres_connect(cfg).await;
    push(vec![line, server_identity(cfg)]);
    match client {
        Some(client) => {
            let pg = &cfg.postgres;
            push(guarded("wal_level", wal_level(&client)).await);
            push(
                guarded(
                    "replication slots and WAL senders",
                    slots_and_senders(&client, cfg),
                )
                .await,
            );
            push(guarded("replication role", role(&client)).await);
            push(
                guarded(
                    &format!("checkpoint table {}", pg.checkpoint_table),
                    checkpoint_table(&client, cfg),
                )
                .await,
            );
            push(
                guarded(
                    &format!("publication {:?}", pg.publication),
                    publication(&client, cfg),
                )
                .await,
            );
            for o in &cfg.outboxes {
                match o.table() {
                    Some(table) => push(
                        guarded(&format!("outbox table {table}"), outbox_table(&client, o)).await,
                    ),
                    None => push(vec![message_outbox(o)]),
                }
            }
            if cfg.outboxes.iter().any(|o| o.table().is_none()) {
                push(guarded("who may write table-less events", emit_privilege(&client)).await);
            }
            push(
                guarded(
                    &format!("replication slot {:?}", pg.slot),
                    replication_slot(&client, cfg),
                )
                .await,
            );
            push(guarded("hosts of postgres.url", hosts(&client, cfg)).await);
        }
        None => push(vec![Line::warn(
            "PostgreSQL checks skipped",
            "wal_level, replication slots and WAL senders, replication role, publication, \
             checkpoint table, outbox table and replication slot were not checked because \
             PostgreSQL is not reachable",
        )]),
    }

    // RabbitMQ: every node of the list. With several, one that does not
    // answer is a warning as long as another does (the relay moves on).
    // The exchanges are looked for on the first node that answers, at
    // once: the client sends heartbeats only while it is read, so a
    // connection left idle while other nodes time out could be closed by
    // the broker, and every exchange then look unchecked.
    let mut exchange_lines: Option<Vec<Line>> = None;
    let mut node_lines = Vec::new();
    for (node, url) in cfg.rabbitmq.urls.iter().enumerate() {
        let (line, c) = broker_connect(cfg, node).await;
        node_lines.push(line);
        node_lines.extend(broker_in_the_clear(url.expose()));
        if let Some(mut c) = c {
            if exchange_lines.is_none() {
                exchange_lines = Some(exchanges(cfg, &mut c).await);
            }
            close(c).await;
        }
    }
    if exchange_lines.is_some() && node_lines.len() > 1 {
        for line in &mut node_lines {
            if line.level == Level::Fail {
                line.level = Level::Warn;
            }
        }
    }
    push(node_lines);
    push(exchange_lines.unwrap_or_else(|| {
        vec![Line::warn(
            "RabbitMQ checks skipped",
            "the exchange and the dead-letter exchange were not checked because RabbitMQ is not reachable",
        )]
    }));
    lines
}

/// Closes a broker connection `check` opened, without waiting long for a
/// broker that does not answer.
async fn close(sink: AmqpSink) {
    let _ = tokio::time::timeout(Duration::from_secs(5), sink.close()).await;
}

/// Runs one check under [`CHECK_TIMEOUT`]; a failed query or the deadline
/// becomes a `FAIL` line for `what`.
async fn guarded(
    what: &str,
    fut: impl Future<Output = Result<Vec<Line>, CheckError>>,
) -> Vec<Line> {
    match tokio::time::timeout(CHECK_TIMEOUT, fut).await {
        Ok(Ok(lines)) => lines,
        Ok(Err(CheckError(e))) => vec![Line::fail(what, format!("could not be checked: {e}"))],
        Err(_) => vec![Line::fail(
            what,
            format!(
                "could not be checked: no answer within {} s",
                CHECK_TIMEOUT.as_secs()
            ),
        )],
    }
}

// ------------------------------------------------------------- PostgreSQL

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_start_with_their_level() {
        assert_eq!(
            Line::new(Level::Ok, "wal_level = logical", None).to_string(),
            "ok wal_level = logical"
        );
        assert_eq!(
            Line::warn("slot", "is active (pid 7)").to_string(),
            "warn slot: is active (pid 7)"
        );
        assert_eq!(
            Line::fail("publication \"p\"", "does not exist").to_string(),
            "FAIL publication \"p\": does not exist"
        );
    }
}
