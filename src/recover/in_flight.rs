//! Waiting out the transactions writing to the outbox tables before
//! re-publishing from them.
//!
//! PostgreSQL decodes each change with the catalog as it was when the change
//! was written. A transaction that wrote outbox rows while the publication
//! did not hold the table (re-created, or not yet added) is never streamed,
//! even if it commits after `setup` added the table. `republish` is the
//! remedy for those rows, so it must see them: a snapshot taken while such a
//! transaction is still open would not, and once it commits nothing would
//! send them. So `republish` first waits until every transaction that held
//! a write lock on an outbox table (or one of its partitions) when it
//! started has ended, prepared ones included; then it reads. (A committing
//! transaction is visible before it releases its locks.) Transactions
//! that write later, or elsewhere, are not waited for: what they write to
//! the outbox after `setup` is streamed.
//!
//! (A transaction id horizon would not do: a snapshot's `xmax` is one past
//! the newest *completed* transaction, and an open transaction at or above
//! it appears in no snapshot's list.)

use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::config::PostgresConfig;
use crate::error::RelayError;
use crate::source::sql_err;

/// How often the writers are looked at.
const POLL: Duration = Duration::from_millis(100);
/// How often a wait that goes on is said in the log.
const SAY_EVERY: Duration = Duration::from_secs(10);

/// The transaction ids of the transactions holding a write lock
/// (`RowExclusiveLock`: every INSERT or COPY takes it, whatever else it
/// holds) on one of `$1` (qualified table names) or their partitions
/// (`pg_partition_tree` lists none for a plain table), in this database,
/// other than this session. By transaction id, not virtual one: the id
/// survives `PREPARE TRANSACTION` and a restart on every version.
const WRITERS_SQL: &str = "SELECT DISTINCT x.transactionid::text FROM pg_locks l \
     JOIN pg_locks x ON x.virtualtransaction = l.virtualtransaction \
      AND x.locktype = 'transactionid' AND x.mode = 'ExclusiveLock' AND x.granted \
     WHERE l.locktype = 'relation' AND l.granted AND l.mode = 'RowExclusiveLock' \
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
       AND l.pid IS DISTINCT FROM pg_backend_pid() \
       AND l.relation IN ( \
             SELECT t.name::regclass FROM unnest($1::text[]) t(name) \
             UNION SELECT p.relid FROM unnest($1::text[]) t(name), \
                   LATERAL pg_partition_tree(t.name::regclass) p)";

/// Of `$1` (transaction ids), those still open, in words: the backend's
/// pid, or the prepared transaction's name.
const STILL_SQL: &str = "SELECT DISTINCT x.transactionid::text, \
       coalesce('pid ' || x.pid::text, \
                'prepared ' || (SELECT quote_literal(p.gid) FROM pg_prepared_xacts p \
                                 WHERE p.transaction = x.transactionid), \
                'transaction ' || x.transactionid::text) \
     FROM pg_locks x WHERE x.locktype = 'transactionid' AND x.mode = 'ExclusiveLock' \
      AND x.transactionid::text = ANY($1::text[])";

/// Returns once every transaction writing to `tables` (qualified names)
/// now has committed or rolled back; says in the log, every
/// [`SAY_EVERY`], which ones it waits for. A signal (`stop`) ends the wait
/// with [`RelayError::Interrupted`].
pub async fn wait_for_writers(
    client: &Client,
    pg: &PostgresConfig,
    tables: &[String],
    stop: &CancellationToken,
) -> Result<(), RelayError> {
    let err = || {
        sql_err(
            pg,
            "waiting for the transactions writing to the outbox tables",
        )
    };
    let writers: Vec<String> = client
        .query(WRITERS_SQL, &[&tables])
        .await
        .map_err(err())?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if writers.is_empty() {
        return Ok(());
    }
    let started = Instant::now();
    let mut said = started;
    loop {
        let still = client.query(STILL_SQL, &[&writers]).await.map_err(err())?;
        if still.is_empty() {
            return Ok(());
        }
        if said.elapsed() >= SAY_EVERY {
            said = Instant::now();
            let open: Vec<String> = still
                .iter()
                .take(20)
                .map(|r| crate::logtext::Shown(&r.get::<_, String>(1)).to_string())
                .collect();
            warn!(
                waited_secs = started.elapsed().as_secs(),
                open = %open.join(", "),
                "republish waits for the transactions that were writing to the outbox when it \
                 started: rows they wrote before the publication held the table are on neither \
                 the stream nor (until they commit) the table; end them (COMMIT, ROLLBACK, or \
                 COMMIT PREPARED / ROLLBACK PREPARED) or stop republish"
            );
        }
        tokio::select! {
            _ = stop.cancelled() => {
                return Err(RelayError::Interrupted(
                    "republish stopped while waiting for the transactions writing to the outbox; \
                     nothing was sent: run it again"
                        .to_owned(),
                ));
            }
            _ = tokio::time::sleep(POLL) => {}
        }
    }
}
