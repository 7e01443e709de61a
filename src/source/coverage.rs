//! Knowing, before the slot moves past a position, that the publication
//! still carried the outbox tables' rows up to it.
//!
//! A `FOR TABLE` publication loses a table that is dropped; a table created
//! again under the same name is a new relation the publication does not
//! hold. Its rows are never decoded, so nothing in the stream says they
//! exist, and keepalives (or other tables' commits) would carry the slot
//! past them: lost without a trace. So the session reads, often, the
//! outbox tables' relation ids and the publication's hold on them, and the
//! position reported to the server (and recorded in the checkpoint row)
//! never passes the WAL position read just before the last reading that
//! found them unchanged ([`Coverage::verify`]). When they changed, the
//! relay stops, naming the time from which to `republish`.
//!
//! The WAL position is read in a statement of its own, before the catalog
//! snapshot of the reading: a DDL whose commit precedes the position is
//! visible to the reading unless it is still between writing its commit
//! record and becoming visible (microseconds; with synchronous replication,
//! until the standby acknowledges). Even then the next reading, a moment
//! later, sees it and stops the relay: the change is never silent.

use tokio_postgres::Client;

use super::{SourceError, sql_err};
use crate::config::{Config, PostgresConfig, TableName};
use crate::lsn::Lsn;
use crate::outbox::OutboxOids;

/// What the publication holds of one outbox table.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Hold {
    /// The relation (the partition root) still exists.
    exists: bool,
    /// The publication's own id: a publication dropped and created again
    /// is another one.
    publication: Option<u32>,
    inserts: bool,
    all_tables: bool,
    /// The `pg_publication_rel` and `pg_publication_namespace` entries that
    /// hold the table or its partitions: removed and added back, an entry
    /// has a new id, and rows written in between were not published.
    entries: Vec<u32>,
    /// The relation the configured name resolves to now: none after a
    /// RENAME (the relay follows the table by its id), another one when a
    /// new table took the name (a rename-and-swap), whose rows the
    /// publication does not hold. Not part of the comparison.
    named: Option<u32>,
}

impl Hold {
    /// The same hold, whatever the configured name resolves to.
    fn same(&self, other: &Hold) -> bool {
        Hold {
            named: None,
            ..self.clone()
        } == Hold {
            named: None,
            ..other.clone()
        }
    }
}

#[derive(Debug)]
struct Watched {
    table: TableName,
    key: String,
    root: u32,
    hold: Hold,
}

/// Why [`Coverage::verify`] did not vouch for a position.
#[derive(Debug)]
pub enum Uncertain {
    /// The tables or the publication changed: the relay must stop.
    Changed(SourceError),
    /// The reading failed (the SQL connection): try again.
    Unread(SourceError),
}

/// The outbox tables and the publication's hold on them, as a session
/// found them when it started.
#[derive(Debug)]
pub struct Coverage {
    publication: String,
    tables: Vec<Watched>,
    /// A minute before the last reading that found them unchanged, by the
    /// server's clock (the clock of `created_at`), as `--since` takes it.
    last_good: String,
}

/// The partitions are walked through `pg_inherits`, which takes no lock
/// (`pg_partition_tree` locks every partition, and would queue behind a
/// DETACH or DROP of an old partition).
const HOLD_SQL: &str = "SELECT r.root, EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = r.root), \
       p.oid, coalesce(p.pubinsert, false), coalesce(p.puballtables, false), \
       ARRAY(WITH RECURSIVE tree(relid) AS (SELECT r.root UNION ALL \
           SELECT i.inhrelid FROM pg_inherits i JOIN tree t ON i.inhparent = t.relid) \
         SELECT pr.oid FROM pg_publication_rel pr WHERE pr.prpubid = p.oid AND \
           pr.prrelid IN (SELECT relid FROM tree) \
         UNION ALL SELECT pn.oid FROM pg_publication_namespace pn JOIN pg_class c \
           ON c.relnamespace = pn.pnnspid WHERE pn.pnpubid = p.oid AND c.oid = r.root ORDER BY 1), \
       to_regclass(r.name)::oid \
     FROM unnest($2::oid[], $3::text[]) WITH ORDINALITY r(root, name, n) \
     LEFT JOIN pg_publication p ON p.pubname = $1 ORDER BY r.n";

async fn read_holds(
    client: &Client,
    pg: &PostgresConfig,
    publication: &str,
    (roots, names): (&[u32], &[String]),
) -> Result<Vec<Hold>, SourceError> {
    let rows = client
        .query(HOLD_SQL, &[&publication, &roots, &names])
        .await
        .map_err(sql_err(
            pg,
            "reading the publication's hold on the outbox tables",
        ))?;
    Ok(rows
        .iter()
        .map(|r| Hold {
            exists: r.get(1),
            publication: r.get(2),
            inserts: r.get(3),
            all_tables: r.get(4),
            entries: r.get(5),
            named: r.get(6),
        })
        .collect())
}

/// The WAL position now (replayed, on a standby), and, as `--since` takes
/// it, a minute before now or the start of the oldest transaction running,
/// whichever is earlier (a migration's rows carry its start time;
/// republishing from a little early sends duplicates, never gaps).
async fn read_position(client: &Client, pg: &PostgresConfig) -> Result<(Lsn, String), SourceError> {
    let row = client
        .query_one(
            "SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() \
             ELSE pg_current_wal_lsn() END)::text, to_char(least(now() - interval '1 minute', \
               (SELECT min(xact_start) FROM pg_stat_activity)) \
             AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')",
            &[],
        )
        .await
        .map_err(sql_err(pg, "reading the WAL position"))?;
    let at: String = row.get(0);
    let at = at
        .parse()
        .map_err(|_| SourceError::Timeout(format!("an unreadable WAL position {at:?}")))?;
    Ok((at, row.get(1)))
}

/// What a session's coverage started from: the next session of the same
/// process starts from the same, or stops (a change while no session
/// streamed, during a reconnect, is a change all the same).
#[derive(Debug, Clone)]
pub struct Seen {
    tables: Vec<(String, u32, Hold)>,
    last_good: String,
}

impl Coverage {
    /// What this session started from, for the next one.
    pub fn seen(&self) -> Seen {
        Seen {
            tables: self
                .tables
                .iter()
                .map(|w| (w.key.clone(), w.root, w.hold.clone()))
                .collect(),
            last_good: self.last_good.clone(),
        }
    }

    /// Reads the hold the session starts with (`oids`: the session's
    /// outbox tables, `None` for table-less outboxes), and refuses one that
    /// differs from what the previous session of this process started from.
    pub async fn baseline(
        client: &Client,
        cfg: &Config,
        oids: &[Option<OutboxOids>],
        previous: Option<&Seen>,
    ) -> Result<Coverage, SourceError> {
        let mut tables = Vec::new();
        for (outbox, oids) in cfg.outboxes.iter().zip(oids) {
            if let (Some(table), Some(oids)) = (outbox.table(), oids) {
                tables.push((table.clone(), outbox.key_of("table"), oids.root));
            }
        }
        let roots: Vec<u32> = tables.iter().map(|t| t.2).collect();
        let names: Vec<String> = tables.iter().map(|t| t.0.quoted()).collect();
        let publication = &cfg.postgres.publication;
        let holds = read_holds(client, &cfg.postgres, publication, (&roots, &names)).await?;
        if let Some(previous) = previous {
            let before = Coverage {
                publication: publication.clone(),
                tables: Vec::new(),
                last_good: previous.last_good.clone(),
            };
            for ((table, key, root), hold) in tables.iter().zip(&holds) {
                let Some((_, was_root, was)) = previous.tables.iter().find(|t| t.0 == *key) else {
                    continue;
                };
                if was_root != root || !was.same(hold) {
                    let w = Watched {
                        table: table.clone(),
                        key: key.clone(),
                        root: *was_root,
                        hold: was.clone(),
                    };
                    let now = Hold {
                        exists: was_root == root && hold.exists,
                        ..hold.clone()
                    };
                    return Err(SourceError::Setup(before.changed(&w, &now)));
                }
            }
        }
        Ok(Coverage {
            publication: cfg.postgres.publication.clone(),
            tables: tables
                .into_iter()
                .zip(holds)
                .map(|((table, key, root), hold)| Watched {
                    table,
                    key,
                    root,
                    hold,
                })
                .collect(),
            last_good: read_position(client, &cfg.postgres).await?.1,
        })
    }

    /// Reads the WAL position, then the hold: unchanged, every row written
    /// before that position was published as the session expects, and the
    /// position may be reported.
    pub async fn verify(&mut self, client: &Client, pg: &PostgresConfig) -> Result<Lsn, Uncertain> {
        let (at, since) = read_position(client, pg).await.map_err(Uncertain::Unread)?;
        let roots: Vec<u32> = self.tables.iter().map(|t| t.root).collect();
        if roots.is_empty() {
            return Ok(at);
        }
        let names: Vec<String> = self.tables.iter().map(|t| t.table.quoted()).collect();
        let holds = read_holds(client, pg, &self.publication, (&roots, &names))
            .await
            .map_err(Uncertain::Unread)?;
        for (watched, now) in self.tables.iter().zip(&holds) {
            let swapped = now.named.is_some_and(|n| n != watched.root);
            if swapped || !now.same(&watched.hold) {
                return Err(Uncertain::Changed(SourceError::Setup(
                    self.changed(watched, now),
                )));
            }
        }
        self.last_good = since;
        Ok(at)
    }

    fn changed(&self, w: &Watched, now: &Hold) -> String {
        let what = if now.exists && now.named.is_some_and(|n| n != w.root) {
            format!(
                "outbox table {} ({}) now names another table (renamed, and a new one took the \
                 name), which publication {:?} does not hold unless added",
                w.table, w.key, self.publication
            )
        } else if !now.exists {
            format!(
                "outbox table {} ({}) was dropped (or dropped and created again: a new table, \
                 which publication {:?} does not hold unless added again)",
                w.table, w.key, self.publication
            )
        } else if now.publication.is_none() {
            format!(
                "publication {:?} (postgres.publication) was dropped",
                self.publication
            )
        } else if now.publication != w.hold.publication {
            format!(
                "publication {:?} (postgres.publication) was dropped and created again",
                self.publication
            )
        } else {
            format!(
                "publication {:?} (postgres.publication) changed what it publishes of outbox \
                 table {}",
                self.publication, w.table
            )
        };
        let since = &self.last_good;
        format!(
            "{what}; the relay stopped before reporting any position past the change. Rows \
             written to the table after it were not decoded: make sure the publication holds the \
             table (`outbox-relay setup`), then send them with `outbox-relay republish --since \
             {since}`{}",
            if self.tables.len() > 1 {
                format!(" --table {}", w.table)
            } else {
                String::new()
            }
        )
    }
}
