//! Waiting out the transactions in flight before re-publishing from the
//! table.
//!
//! PostgreSQL decodes each change with the catalog as it was when the change
//! was written. A transaction that wrote outbox rows while the publication
//! did not hold the table (re-created, or not yet added) is never streamed,
//! even if it commits after `setup` added the table. `republish` is the
//! remedy for those rows, so it must see them: a snapshot taken while such a
//! transaction is still open would not, and once it commits nothing would
//! send them. So `republish` first waits until every transaction that was
//! open when it started has ended (prepared ones included), then reads.

use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::config::PostgresConfig;
use crate::error::RelayError;
use crate::source::sql_err;

/// How often the oldest open transaction is looked at.
const POLL: Duration = Duration::from_millis(100);
/// How often a wait that goes on is said in the log.
const SAY_EVERY: Duration = Duration::from_secs(10);

/// Returns once every transaction open now has committed or rolled back;
/// says in the log, every [`SAY_EVERY`], which ones it waits for. A signal
/// (`stop`) ends the wait with [`RelayError::Interrupted`].
pub async fn wait_for_open_transactions(
    client: &Client,
    pg: &PostgresConfig,
    stop: &CancellationToken,
) -> Result<(), RelayError> {
    let err = || {
        sql_err(
            pg,
            "waiting for the transactions open before the re-publishing",
        )
    };
    // Every transaction with an id below the snapshot's xmax was open or
    // done when it was taken; the wait is over when the oldest one still
    // open is not below it.
    let horizon: String = client
        .query_one("SELECT pg_snapshot_xmax(pg_current_snapshot())::text", &[])
        .await
        .map_err(err())?
        .get(0);
    let started = Instant::now();
    let mut said = started;
    loop {
        let done: bool = client
            .query_one(
                "SELECT pg_snapshot_xmin(pg_current_snapshot()) >= $1::text::xid8",
                &[&horizon],
            )
            .await
            .map_err(err())?
            .get(0);
        if done {
            return Ok(());
        }
        if said.elapsed() >= SAY_EVERY {
            said = Instant::now();
            let open = describe_open(client).await;
            warn!(
                waited_secs = started.elapsed().as_secs(),
                open = %open,
                "republish waits for the transactions open when it started to end: rows they \
                 wrote before the publication held the table are on neither the stream nor \
                 (until they commit) the table; end them (COMMIT, ROLLBACK, or COMMIT PREPARED / \
                 ROLLBACK PREPARED) or stop republish"
            );
        }
        tokio::select! {
            _ = stop.cancelled() => {
                return Err(RelayError::Interrupted(
                    "republish stopped while waiting for the transactions open when it started; \
                     nothing was sent: run it again"
                        .to_owned(),
                ));
            }
            _ = tokio::time::sleep(POLL) => {}
        }
    }
}

/// The transactions holding an id now, oldest first, in words (backend
/// pids and prepared transactions' names), as far as this role may see
/// them.
async fn describe_open(client: &Client) -> String {
    let rows = client
        .query(
            "SELECT what FROM ( \
               SELECT 'pid ' || pid::text AS what, age(backend_xid) AS age \
                 FROM pg_stat_activity \
                WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid() \
               UNION ALL \
               SELECT 'prepared ' || quote_literal(gid), age(transaction) \
                 FROM pg_prepared_xacts \
             ) open ORDER BY age DESC LIMIT 20",
            &[],
        )
        .await;
    match rows {
        Ok(rows) if rows.is_empty() => "none visible to this role".to_owned(),
        Ok(rows) => rows
            .iter()
            .map(|r| crate::logtext::Shown(&r.get::<_, String>(0)).to_string())
            .collect::<Vec<_>>()
            .join(", "),
        Err(e) => format!("not readable ({e})"),
    }
}
