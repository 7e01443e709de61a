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
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Hold {
    /// The relation (the partition root) still exists.
    exists: bool,
    /// The publication's own id: a publication dropped and created again
    /// is another one.
    publication: Option<u32>,
    /// The transaction that last wrote the publication's row: `ALTER
    /// PUBLICATION ... SET (publish = ...)` turning inserts off and on again
    /// leaves the flags as they were, not this.
    publication_xmin: Option<i64>,
    inserts: bool,
    all_tables: bool,
    /// The `pg_publication_rel` and `pg_publication_namespace` entries that
    /// hold the table or its partitions: removed and added back, an entry
    /// has a new id, and rows written in between were not published.
    entries: Vec<u32>,
    /// A partition of the table is not published: neither it nor a table
    /// above it is in the publication (nor their schema), which lists some
    /// partitions by name and not the table. A session starts only when
    /// every partition is covered (`publication::require`); a partition
    /// created or attached since, while the publication lists partitions,
    /// turns this on, and its rows would never be decoded. (Absent from
    /// records written before it existed: false, as it was then.)
    #[serde(default)]
    uncovered: bool,
    /// The table or a partition is unlogged (its inserts write no WAL):
    /// one set unlogged or attached since (a publication of the root does
    /// not stop either), whose rows are never decoded. Partitions only, as
    /// `publication::hold` reads them (not tables that merely INHERIT).
    /// (Absent from records written before it existed: false, as a session
    /// then started only with every partition logged.)
    #[serde(default)]
    no_wal: bool,
    /// The relation the configured name resolves to now: none after a
    /// RENAME (the relay follows the table by its id), another one when a
    /// new table took the name (a rename-and-swap), whose rows the
    /// publication does not hold. Not part of the comparison, nor of the
    /// record.
    #[serde(skip)]
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
    Changed(Change),
    /// The reading failed (the SQL connection): try again.
    Unread(SourceError),
}

/// The outbox tables and the publication's hold on them, as a session
/// found them when it started.
#[derive(Debug)]
pub struct Coverage {
    publication: String,
    tables: Vec<Watched>,
    /// Several outbox tables: a stop names the one to republish.
    several: bool,
    /// Seconds `last_good` is taken earlier by (see [`read_position`]).
    widen_secs: f64,
    /// A minute before the last reading that found them unchanged, by the
    /// server's clock (the clock of `created_at`), as `--since` takes it.
    last_good: String,
}

/// The partitions are walked through `pg_inherits`, which takes no lock
/// (`pg_partition_tree` locks every partition, and would queue behind a
/// DETACH or DROP of an old partition).
const HOLD_SQL: &str = "SELECT r.root, EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = r.root), \
       p.oid, coalesce(p.pubinsert, false), coalesce(p.puballtables, false), p.xmin::text::int8, \
       ARRAY(WITH RECURSIVE tree(relid) AS (SELECT r.root UNION ALL \
           SELECT i.inhrelid FROM pg_inherits i JOIN tree t ON i.inhparent = t.relid) \
         SELECT pr.oid FROM pg_publication_rel pr WHERE pr.prpubid = p.oid AND \
           pr.prrelid IN (SELECT relid FROM tree) \
         UNION ALL SELECT pn.oid FROM pg_publication_namespace pn JOIN pg_class c \
           ON c.relnamespace = pn.pnnspid WHERE pn.pnpubid = p.oid AND c.oid = r.root ORDER BY 1), \
       to_regclass(r.name)::oid, \
       coalesce((SELECT c.relkind = 'p' FROM pg_class c WHERE c.oid = r.root), false) \
       AND NOT coalesce(p.puballtables, false) AND EXISTS ( \
         WITH RECURSIVE up(relid) AS (SELECT r.root UNION ALL \
             SELECT i.inhparent FROM pg_inherits i JOIN up u ON i.inhrelid = u.relid), \
           cov(relid, covered) AS (SELECT r.root, EXISTS (SELECT 1 FROM up JOIN pg_class c \
               ON c.oid = up.relid WHERE up.relid IN (SELECT pr.prrelid FROM pg_publication_rel pr \
                 WHERE pr.prpubid = p.oid) OR c.relnamespace IN (SELECT pn.pnnspid \
                 FROM pg_publication_namespace pn WHERE pn.pnpubid = p.oid)) \
             UNION ALL SELECT i.inhrelid, t.covered OR EXISTS (SELECT 1 FROM pg_publication_rel pr \
               WHERE pr.prpubid = p.oid AND pr.prrelid = i.inhrelid) OR EXISTS (SELECT 1 \
               FROM pg_class c JOIN pg_publication_namespace pn ON pn.pnnspid = c.relnamespace \
               WHERE pn.pnpubid = p.oid AND c.oid = i.inhrelid) \
             FROM pg_inherits i JOIN cov t ON i.inhparent = t.relid) \
         SELECT 1 FROM cov WHERE NOT cov.covered \
           AND NOT EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhparent = cov.relid)), \
       EXISTS (WITH RECURSIVE tree(relid) AS (SELECT r.root UNION ALL \
           SELECT i.inhrelid FROM pg_inherits i JOIN tree t ON i.inhparent = t.relid) \
         SELECT 1 FROM tree JOIN pg_class c ON c.oid = tree.relid \
         WHERE (c.oid = r.root OR c.relispartition) AND c.relkind = 'r' \
           AND c.relpersistence <> 'p') \
     FROM unnest($2::oid[], $3::text[]) WITH ORDINALITY r(root, name, n) \
     LEFT JOIN pg_publication p ON p.pubname = $1 ORDER BY r.n";

async fn read_holds(
    client: &Client,
    pg: &PostgresConfig,
    publication: &str,
    roots: &[u32],
    names: &[String],
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
            publication_xmin: r.get(5),
            entries: r.get(6),
            named: r.get(7),
            uncovered: r.get(8),
            no_wal: r.get(9),
        })
        .collect())
}

/// The WAL position now (replayed, on a standby), and, as `--since` takes
/// it, the earliest `created_at` a row written after now may carry: a
/// minute before now, or the start of the oldest transaction running if
/// earlier (a migration's rows carry its start time), less `widen_secs`
/// (the longest transaction seen, plus a margin: without
/// `pg_read_all_stats` other roles' transactions show no start).
/// Republishing from a little early sends duplicates, never gaps.
async fn read_position(
    client: &Client,
    pg: &PostgresConfig,
    widen_secs: f64,
) -> Result<(Lsn, String), SourceError> {
    let row = client
        .query_one(
            "SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() \
             ELSE pg_current_wal_lsn() END)::text, to_char((least(now() - interval '1 minute', \
               (SELECT min(xact_start) FROM pg_stat_activity)) - make_interval(secs => $1)) \
             AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')",
            &[&widen_secs],
        )
        .await
        .map_err(sql_err(pg, "reading the WAL position"))?;
    let at: String = row.get(0);
    let at = at
        .parse()
        .map_err(|_| SourceError::Timeout(format!("an unreadable WAL position {at:?}")))?;
    Ok((at, row.get(1)))
}

/// A change in what the publication holds of an outbox table: the stop's
/// words but for the time to republish from, which the caller knows.
#[derive(Debug)]
pub struct Change {
    what: String,
    /// The table to name with `--table` (one of several).
    table: Option<TableName>,
}

impl Change {
    /// The error that stops the relay, naming `republish --since since`.
    pub fn error(&self, since: &str) -> SourceError {
        SourceError::Setup(format!(
            "{}; the relay stopped before reporting any position past the change. Rows written \
             to the table after it were not decoded: make sure the publication holds the table \
             (`outbox-relay setup`), then send them with `outbox-relay republish --since \
             {since}`{}, before the relay starts again",
            self.what,
            self.table
                .as_ref()
                .map(|t| format!(" --table {t}"))
                .unwrap_or_default()
        ))
    }
}

/// What a session's coverage started from: the next session starts from
/// the same, or stops (a change while no session streamed, during a
/// reconnect or while no relay ran, is a change all the same). Kept in this
/// process, and recorded in the checkpoint row (`coverage`,
/// `coverage_since`) for the next process: a relay killed before its next
/// reading would otherwise start from the changed catalog and vouch for
/// the positions past the change.
#[derive(Debug, Clone)]
pub struct Seen {
    tables: Vec<Table>,
    /// As `--since` takes it: rows of a table changed after the reading
    /// that found the hold unchanged date from no earlier.
    last_good: String,
    /// The record as read (JSON text), for the compare-and-set that
    /// replaces it: `None` when none was read.
    read: Option<String>,
}

/// One outbox table's hold, as recorded.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Table {
    /// The outbox's key in the config (`outbox.table`, `outbox[1].table`).
    key: String,
    /// Its table's name as configured, quoted: a record of another name
    /// (the config changed) says nothing of this table.
    name: String,
    root: u32,
    hold: Hold,
}

/// The record of the configured slot (see [`Seen`]), `None` when none was
/// recorded (a first start, a table `setup` has not updated, a standby's
/// read of a row the primary never wrote).
pub async fn recorded(client: &Client, cfg: &Config) -> Result<Option<Seen>, SourceError> {
    // A record without its time (edited by hand) names the epoch: every
    // row, rather than none.
    let sql = format!(
        "SELECT coverage::text, to_char(coalesce(coverage_since, 'epoch') AT TIME ZONE 'UTC', \
                'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') \
         FROM {} WHERE slot_name = $1 AND coverage IS NOT NULL",
        cfg.postgres.checkpoint_table.quoted()
    );
    let row = match client.query_opt(&sql, &[&cfg.postgres.slot]).await {
        Ok(row) => row,
        // 42P01 no table, 42703 no column: nothing recorded.
        Err(e)
            if e.code()
                .is_some_and(|c| ["42P01", "42703"].contains(&c.code())) =>
        {
            return Ok(None);
        }
        Err(e) => return Err(sql_err(&cfg.postgres, "reading the recorded coverage")(e)),
    };
    let Some(row) = row else { return Ok(None) };
    let text: String = row.get(0);
    let tables: Vec<Table> = serde_json::from_str(&text).map_err(|e| {
        SourceError::Setup(format!(
            "the coverage recorded in {} for slot {:?} cannot be read ({e}); a relay of another \
             version wrote it? Set the column to NULL to start from the catalog as it is now, \
             after making sure no outbox table was dropped or re-created since the relay last ran",
            cfg.postgres.checkpoint_table, cfg.postgres.slot
        ))
    })?;
    Ok(Some(Seen {
        tables,
        last_good: row.get(1),
        read: Some(text),
    }))
}

/// The outbox tables of the config and their roots (`oids`: the session's,
/// `None` for table-less outboxes), as (name, key, root).
fn table_roots(cfg: &Config, oids: &[Option<OutboxOids>]) -> Vec<(TableName, String, u32)> {
    let mut tables = Vec::new();
    for (outbox, oids) in cfg.outboxes.iter().zip(oids) {
        if let (Some(table), Some(oids)) = (outbox.table(), oids) {
            tables.push((table.clone(), outbox.key_of("table"), oids.root));
        }
    }
    tables
}

/// The outbox tables and the publication's hold on them, read before rows
/// are re-published: what a `republish` or a recovery acknowledges (a
/// change after this reading is not covered by the rows it read).
#[derive(Debug)]
pub struct Snapshot {
    tables: Vec<Table>,
}

impl Snapshot {
    /// Reads the hold on the outbox tables (`oids`, `None` for table-less
    /// outboxes) now.
    pub async fn read(
        client: &Client,
        cfg: &Config,
        oids: &[Option<OutboxOids>],
    ) -> Result<Snapshot, SourceError> {
        let tables = table_roots(cfg, oids);
        let roots: Vec<u32> = tables.iter().map(|t| t.2).collect();
        let names: Vec<String> = tables.iter().map(|t| t.0.quoted()).collect();
        let publication = &cfg.postgres.publication;
        let holds = read_holds(client, &cfg.postgres, publication, &roots, &names).await?;
        Ok(Snapshot {
            tables: (tables.into_iter().zip(holds))
                .map(|((table, key, root), hold)| Table {
                    key,
                    name: table.quoted(),
                    root,
                    hold,
                })
                .collect(),
        })
    }

    /// The rows of the tables `keys` name were sent from `since` (`None`: a
    /// recovery, whose window starts at the checkpoint, before any change
    /// the coverage could have missed): where their hold changed since the
    /// recorded one, and `since` is no later than the time the record
    /// names, the record takes the hold of this snapshot, and the relay
    /// starts again. Returns the changed tables not acknowledged (their
    /// config keys), with the time they need.
    pub async fn acknowledge(
        &self,
        client: &Client,
        cfg: &Config,
        keys: &[String],
        since: Option<&str>,
    ) -> Result<Vec<(String, String)>, SourceError> {
        let Some(seen) = recorded(client, cfg).await? else {
            return Ok(Vec::new());
        };
        let covers = match since {
            None => true,
            Some(since) => client
                .query_one(
                    "SELECT $1::text::timestamptz <= $2::text::timestamptz",
                    &[&since, &seen.last_good],
                )
                .await
                .map_err(sql_err(
                    &cfg.postgres,
                    "comparing --since with the recorded coverage",
                ))?
                .get(0),
        };
        let mut record = seen.tables.clone();
        let mut unacknowledged = Vec::new();
        for now in &self.tables {
            let Some(t) = (record.iter_mut()).find(|t| t.key == now.key && t.name == now.name)
            else {
                continue;
            };
            if t.root == now.root && t.hold.same(&now.hold) || !keys.contains(&now.key) {
                continue;
            }
            if covers {
                t.clone_from(now);
            } else {
                unacknowledged.push((now.key.clone(), seen.last_good.clone()));
            }
        }
        if record != seen.tables {
            let text = serde_json::to_string(&record).expect("plain data");
            let sql = format!(
                "UPDATE {} SET coverage = $2::text::jsonb WHERE slot_name = $1 \
                 AND coverage IS NOT DISTINCT FROM $3::text::jsonb",
                cfg.postgres.checkpoint_table.quoted()
            );
            let n = client
                .execute(&sql, &[&cfg.postgres.slot, &text, &seen.read])
                .await
                .map_err(sql_err(
                    &cfg.postgres,
                    "recording the outbox tables' coverage",
                ))?;
            if n == 0 {
                return Err(SourceError::Raced(
                    "the outbox tables' coverage recorded in the checkpoint table changed while \
                     it was updated (a relay started meanwhile)"
                        .into(),
                ));
            }
        }
        Ok(unacknowledged)
    }
}

impl Coverage {
    /// What this session started from, for the next one.
    pub fn seen(&self) -> Seen {
        Seen {
            tables: self
                .tables
                .iter()
                .map(|w| Table {
                    key: w.key.clone(),
                    name: w.table.quoted(),
                    root: w.root,
                    hold: w.hold.clone(),
                })
                .collect(),
            last_good: self.last_good.clone(),
            read: None,
        }
    }

    /// Reads the hold the session starts with (`oids`: the session's
    /// outbox tables, `None` for table-less outboxes), and refuses one that
    /// differs from what the previous session started from (`previous`:
    /// the record in the checkpoint row, else this process's memory).
    /// `widen_secs`: see [`read_position`].
    pub async fn baseline(
        client: &Client,
        cfg: &Config,
        oids: &[Option<OutboxOids>],
        widen_secs: f64,
        previous: Option<&Seen>,
    ) -> Result<Coverage, SourceError> {
        // The time first, then the hold, as in `verify`: a change after
        // the time is in the reading or after it.
        let last_good = read_position(client, &cfg.postgres, widen_secs).await?.1;
        let tables = table_roots(cfg, oids);
        let roots: Vec<u32> = tables.iter().map(|t| t.2).collect();
        let names: Vec<String> = tables.iter().map(|t| t.0.quoted()).collect();
        let publication = &cfg.postgres.publication;
        let holds = read_holds(client, &cfg.postgres, publication, &roots, &names).await?;
        let coverage = Coverage {
            publication: cfg.postgres.publication.clone(),
            several: tables.len() > 1,
            widen_secs,
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
            last_good,
        };
        let Some(previous) = previous else {
            return Ok(coverage);
        };
        let mut changes = Vec::new();
        for w in &coverage.tables {
            let was =
                (previous.tables.iter()).find(|t| t.key == w.key && t.name == w.table.quoted());
            let Some(was) = was else {
                continue;
            };
            if was.root != w.root || !was.hold.same(&w.hold) {
                let before = Watched {
                    table: w.table.clone(),
                    key: w.key.clone(),
                    root: was.root,
                    hold: was.hold.clone(),
                };
                let now = Hold {
                    exists: was.root == w.root && w.hold.exists,
                    ..w.hold.clone()
                };
                changes.push(coverage.changed(&before, &now));
            }
        }
        match changes.len() {
            0 => Ok(coverage),
            1 => Err(changes.remove(0).error(&previous.last_good)),
            // Several tables changed: one `republish` of them all.
            _ => {
                let what: Vec<String> = changes.into_iter().map(|c| c.what).collect();
                let change = Change {
                    what: what.join("; and "),
                    table: None,
                };
                Err(change.error(&previous.last_good))
            }
        }
    }

    /// Records what this session starts from in the checkpoint row
    /// (creating the row at `start`, without a commit time, if there is
    /// none), unless the record changed since `previous` read it. Where the
    /// row cannot be written (a table `setup` has not updated, a role
    /// without the grant, a read-only server), says so and goes on: the
    /// record only guards against a change while no relay runs.
    pub async fn record(
        &self,
        client: &Client,
        cfg: &Config,
        previous: Option<&Seen>,
        start: Lsn,
        system_id: &str,
    ) -> Result<(), SourceError> {
        let seen = self.seen();
        let text = serde_json::to_string(&seen.tables).expect("plain data");
        let read = previous.and_then(|p| p.read.as_deref());
        let sql = format!(
            "INSERT INTO {} AS c (slot_name, confirmed_lsn, system_identifier, coverage, \
                coverage_since) VALUES ($1, $2::text::pg_lsn, $3, $4::text::jsonb, \
                $5::text::timestamptz) \
             ON CONFLICT (slot_name) DO UPDATE SET coverage = EXCLUDED.coverage, \
                coverage_since = EXCLUDED.coverage_since \
             WHERE c.coverage IS NOT DISTINCT FROM $6::text::jsonb",
            cfg.postgres.checkpoint_table.quoted()
        );
        let start = start.to_string();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 6] = [
            &cfg.postgres.slot,
            &start,
            &system_id,
            &text,
            &seen.last_good,
            &read,
        ];
        match client.execute(&sql, &params).await {
            Ok(1) => Ok(()),
            Ok(_) => Err(SourceError::Raced(
                "the outbox tables' coverage recorded in the checkpoint table changed since it \
                 was read (a `republish` acknowledged a change, or another relay started)"
                    .into(),
            )),
            // 25006: read-only; 42P01, 42703: no table or column yet;
            // 42501: no grant.
            Err(e)
                if e.code()
                    .is_some_and(|c| ["25006", "42P01", "42703", "42501"].contains(&c.code())) =>
            {
                tracing::warn!(
                    error = %e,
                    "cannot record the outbox tables' coverage in the checkpoint table (run \
                     `outbox-relay setup` to update it): a table dropped and created again while \
                     no relay runs would go unnoticed"
                );
                Ok(())
            }
            Err(e) => Err(sql_err(
                &cfg.postgres,
                "recording the outbox tables' coverage",
            )(e)),
        }
    }

    /// The time the last reading that found the hold unchanged names (see
    /// [`Seen`]): what the checkpoint row records as `coverage_since`.
    pub fn last_good(&self) -> &str {
        &self.last_good
    }

    /// Takes the longest transaction seen since the session started into
    /// account (see [`read_position`]), when it grew.
    pub fn widen(&mut self, longest_secs: f64) {
        self.widen_secs = self.widen_secs.max(longest_secs + WIDEN_MARGIN_SECS);
    }

    /// Records [`Coverage::last_good`] as the row's `coverage_since` (after
    /// a change, so that the `republish --since` the stop names is taken as
    /// covering it).
    pub async fn record_since(&self, client: &Client, cfg: &Config) -> Result<(), SourceError> {
        let sql = format!(
            "UPDATE {} SET coverage_since = $2::text::timestamptz WHERE slot_name = $1",
            cfg.postgres.checkpoint_table.quoted()
        );
        client
            .execute(&sql, &[&cfg.postgres.slot, &self.last_good])
            .await
            .map_err(sql_err(&cfg.postgres, "recording the coverage's time"))?;
        Ok(())
    }

    /// Reads the WAL position, then the hold: unchanged, every row written
    /// before that position was published as the session expects, and the
    /// position may be reported.
    pub async fn verify(&mut self, client: &Client, pg: &PostgresConfig) -> Result<Lsn, Uncertain> {
        let (at, since) = read_position(client, pg, self.widen_secs)
            .await
            .map_err(Uncertain::Unread)?;
        let roots: Vec<u32> = self.tables.iter().map(|t| t.root).collect();
        if roots.is_empty() {
            return Ok(at);
        }
        let names: Vec<String> = self.tables.iter().map(|t| t.table.quoted()).collect();
        let holds = read_holds(client, pg, &self.publication, &roots, &names)
            .await
            .map_err(Uncertain::Unread)?;
        for (watched, now) in self.tables.iter().zip(&holds) {
            let swapped = now.named.is_some_and(|n| n != watched.root);
            if swapped || !now.same(&watched.hold) {
                return Err(Uncertain::Changed(self.changed(watched, now)));
            }
        }
        self.last_good = since;
        Ok(at)
    }

    fn changed(&self, w: &Watched, now: &Hold) -> Change {
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
        } else if now.uncovered && !w.hold.uncovered {
            format!(
                "a partition of outbox table {} is not in publication {:?} \
                 (postgres.publication), which lists partitions rather than the table: one \
                 created or attached since, whose rows are never decoded; add the table itself \
                 to the publication",
                w.table, self.publication
            )
        } else if now.no_wal && !w.hold.no_wal {
            format!(
                "a partition of outbox table {} (or the table) writes no WAL now: set unlogged, \
                 or an unlogged table attached, whose rows are never decoded; make it a logged \
                 table (ALTER TABLE ... SET LOGGED)",
                w.table
            )
        } else {
            format!(
                "publication {:?} (postgres.publication) changed what it publishes of outbox \
                 table {}",
                self.publication, w.table
            )
        };
        Change {
            what,
            table: self.several.then(|| w.table.clone()),
        }
    }
}

/// Added to the longest transaction seen, for [`Coverage::widen`] (as
/// `recover` adds to it).
pub const WIDEN_MARGIN_SECS: f64 = 10.0;
