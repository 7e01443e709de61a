//! What the catalog says of the publication and its hold on the outbox
//! tables: one verdict for every command. `run` stops on the first problem
//! it cannot stream with; `setup` fixes what it can; `check` shows each.

use tokio_postgres::Client;

use crate::config::{TableName, quote_ident};

/// The publication as the catalog has it; `None` from [`read`] when there
/// is none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicationInfo {
    /// `postgres.publication`.
    pub name: String,
    /// It publishes inserts.
    pub inserts: bool,
    /// `publish_via_partition_root`.
    pub via_root: bool,
    /// Its hold on each outbox table, in the config's order.
    pub tables: Vec<Hold>,
}

/// The publication's hold on one outbox table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    /// The table as configured.
    pub table: TableName,
    /// Its relation (the partition root): `run` follows it by id, `check`
    /// and `setup` by name; `None`: no such table.
    pub root: Option<u32>,
    /// It is partitioned.
    pub partitioned: bool,
    /// The publication lists it under its own name (rows of a partitioned
    /// table then come as its own).
    pub listed: bool,
    /// Every partition's inserts are published (the table itself, or each
    /// leaf partition through itself or a partitioned table above it):
    /// none is left out of the stream.
    pub covered: bool,
    /// A row filter or a column list on it or a partition: (the relation
    /// it is set on, which).
    pub partial: Option<(String, &'static str)>,
    /// It or a partition is unlogged: (the relation, what it is). An
    /// unlogged partition is covered by a publication of the root
    /// (PostgreSQL refuses SET UNLOGGED only for a table the publication
    /// lists by name), yet its inserts write no WAL and are never decoded:
    /// keepalives would carry the slot past them. (A foreign table as a
    /// partition is not refused: it holds old rows in tiered storage more
    /// often than it takes new ones; the README says what it means.)
    pub no_wal: Option<(String, &'static str)>,
}

/// What is wrong with the publication, in the order `run` meets it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PublicationProblem {
    /// No such publication.
    Missing,
    /// It does not publish inserts.
    NoInserts,
    /// The outbox table does not exist.
    NoTable(TableName),
    /// It does not hold the outbox table (a table dropped and created
    /// again is no longer in a `FOR TABLE` publication).
    NotCovered(TableName),
    /// It publishes a partitioned outbox's partitions under their own
    /// names. `run` decodes them by relation id, so it streams; `check`
    /// asks for `publish_via_partition_root`, which `setup` sets.
    PartitionsByOwnName(TableName),
    /// A relation of the outbox table writes no WAL: its rows would never
    /// be decoded.
    NoWal {
        /// The outbox table.
        table: TableName,
        /// The relation (the table or a partition).
        on: String,
        /// "an unlogged table".
        what: &'static str,
    },
    /// A row filter or a column list would drop rows or columns before
    /// the relay sees them.
    Partial {
        /// The outbox table.
        table: TableName,
        /// The relation it is set on (the table or a partition).
        on: String,
        /// "a row filter", "a column list", or both.
        what: &'static str,
    },
}

/// Reads the publication `name` and its hold on `tables` (each with its
/// relation, `None` when it does not exist).
pub async fn read(
    client: &Client,
    name: &str,
    tables: &[(TableName, Option<u32>)],
) -> Result<Option<PublicationInfo>, tokio_postgres::Error> {
    let Some(row) = client
        .query_opt(
            "SELECT pubinsert, pubviaroot FROM pg_publication WHERE pubname = $1",
            &[&name],
        )
        .await?
    else {
        return Ok(None);
    };
    let mut holds = Vec::with_capacity(tables.len());
    for (table, root) in tables {
        holds.push(hold(client, name, table, *root).await?);
    }
    Ok(Some(PublicationInfo {
        name: name.to_owned(),
        inserts: row.get(0),
        via_root: row.get(1),
        tables: holds,
    }))
}

async fn hold(
    client: &Client,
    publication: &str,
    table: &TableName,
    root: Option<u32>,
) -> Result<Hold, tokio_postgres::Error> {
    let mut hold = Hold {
        table: table.clone(),
        root,
        partitioned: false,
        listed: false,
        covered: false,
        partial: None,
        no_wal: None,
    };
    let Some(root) = root else {
        return Ok(hold);
    };
    // By relation id: a table renamed since is still the one the relay
    // follows. A leaf is published when the publication lists it or a
    // partitioned table above it (with publish_via_partition_root it lists
    // the topmost one it holds, else the leaves); a plain table, or a
    // partitioned one with no partition yet, is its own leaf.
    // (pg_partition_tree and pg_partition_ancestors return nothing for a
    // plain table.) One partition left out
    // (`FOR TABLE outbox_2024` only) would lose the others' rows. Only
    // ancestors within the outbox's own tree count: a table above it
    // listed with publish_via_partition_root sends the rows under its own
    // relation id, which is not the outbox's (the stream would stop at
    // the first row); without it, the leaves are listed themselves.
    let row = client
        .query_one(
            "WITH listed AS (SELECT c.oid FROM pg_publication_tables pt \
               JOIN pg_namespace n ON n.nspname = pt.schemaname \
               JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename \
               WHERE pt.pubname = $1), \
             tree AS (SELECT relid, parentrelid FROM pg_partition_tree($2::oid::regclass)), \
             nodes AS (SELECT $2::oid AS relid UNION SELECT relid FROM tree), \
             leaves AS (SELECT n.relid FROM nodes n \
               WHERE NOT EXISTS (SELECT 1 FROM tree t WHERE t.parentrelid = n.relid)) \
             SELECT coalesce((SELECT relkind = 'p' FROM pg_class WHERE oid = $2), false), \
               EXISTS (SELECT 1 FROM listed WHERE oid = $2), \
               EXISTS (SELECT 1 FROM pg_class WHERE oid = $2) AND NOT EXISTS ( \
                 SELECT 1 FROM leaves l WHERE NOT EXISTS (SELECT 1 FROM listed \
                   WHERE listed.oid = l.relid OR listed.oid IN ( \
                     SELECT a.relid FROM pg_partition_ancestors(l.relid) a \
                     WHERE a.relid IN (SELECT relid FROM nodes))))",
            &[&publication, &root],
        )
        .await?;
    hold.partitioned = row.get(0);
    hold.listed = row.get(1);
    hold.covered = row.get(2);
    if hold.covered {
        hold.partial = partial_rows(client, publication, root).await?;
    }
    hold.no_wal = without_wal(client, root).await?;
    Ok(hold)
}

/// The first relation of the table `root` (itself or a partition, as
/// `source::coverage` reads them) whose inserts write no WAL: (the
/// relation, what it is).
async fn without_wal(
    client: &Client,
    root: u32,
) -> Result<Option<(String, &'static str)>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT c.oid::regclass::text FROM pg_class c \
             WHERE (c.oid = $1 OR c.oid IN (SELECT t.relid FROM pg_partition_tree($1::oid::regclass) t)) \
               AND c.relkind = 'r' AND c.relpersistence <> 'p' \
             ORDER BY 1 LIMIT 1",
            &[&root],
        )
        .await?;
    Ok(row.map(|row| (row.get(0), "an unlogged table")))
}

/// The first entry of the publication with a row filter or a column list
/// on the table `root` or one of its partitions: (the relation, which).
async fn partial_rows(
    client: &Client,
    publication: &str,
    root: u32,
) -> Result<Option<(String, &'static str)>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT pr.prrelid::regclass::text, pr.prqual IS NOT NULL, pr.prattrs IS NOT NULL \
             FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid \
             WHERE p.pubname = $1 AND (pr.prqual IS NOT NULL OR pr.prattrs IS NOT NULL) \
               AND (pr.prrelid = $2 OR pr.prrelid IN ( \
                 SELECT t.relid FROM pg_partition_tree($2::oid::regclass) t)) \
             ORDER BY 1",
            &[&publication, &root],
        )
        .await?;
    Ok(rows.first().map(|row| {
        let (rel, filter, columns): (String, bool, bool) = (row.get(0), row.get(1), row.get(2));
        let what = match (filter, columns) {
            (true, true) => "a row filter and a column list",
            (true, false) => "a row filter",
            _ => "a column list",
        };
        (rel, what)
    }))
}

impl PublicationInfo {
    /// Every problem, in the order `run` meets them; none: the relay
    /// streams every outbox row whole.
    pub fn problems(&self) -> Vec<PublicationProblem> {
        let mut found = Vec::new();
        // Table-less outboxes only: logical messages need no inserts.
        if !self.inserts && !self.tables.is_empty() {
            found.push(PublicationProblem::NoInserts);
        }
        for h in &self.tables {
            let t = || h.table.clone();
            if h.root.is_none() {
                found.push(PublicationProblem::NoTable(t()));
            } else if !h.covered {
                found.push(PublicationProblem::NotCovered(t()));
            } else if h.partitioned && !h.listed && !self.via_root {
                found.push(PublicationProblem::PartitionsByOwnName(t()));
            }
            if let Some((on, what)) = &h.no_wal {
                found.push(PublicationProblem::NoWal {
                    table: t(),
                    on: on.clone(),
                    what,
                });
            }
            if let Some((on, what)) = &h.partial {
                found.push(PublicationProblem::Partial {
                    table: t(),
                    on: on.clone(),
                    what,
                });
            }
        }
        found
    }
}

impl PublicationProblem {
    /// Whether `run` refuses to stream with it.
    pub fn stops_run(&self) -> bool {
        !matches!(self, PublicationProblem::PartitionsByOwnName(_))
    }

    /// What is wrong and its fix, after the publication's name.
    pub fn text(&self, publication: &str) -> String {
        let q = quote_ident(publication);
        // Rows written while the publication did not hold them were never
        // in the stream.
        let lost = "then send the rows written meanwhile with `outbox-relay republish --since \
                    <time>` (the stream never carried them)";
        match self {
            PublicationProblem::Missing => "does not exist (postgres.publication): run \
                 `outbox-relay setup`"
                .to_owned(),
            PublicationProblem::NoInserts => format!(
                "does not publish inserts (postgres.publication): ALTER PUBLICATION {q} SET \
                 (publish = 'insert'), {lost}"
            ),
            PublicationProblem::NoTable(t) => {
                format!("does not cover {t}, which does not exist (see the outbox table check)")
            }
            PublicationProblem::NotCovered(t) => format!(
                "does not cover {t} (was the table dropped and created again, or are only \
                 some of its partitions published?): run `outbox-relay setup` (or: ALTER \
                 PUBLICATION {q} ADD TABLE {}), {lost}",
                t.quoted()
            ),
            PublicationProblem::PartitionsByOwnName(t) => format!(
                "publishes the partitions of {t} under their own names: ALTER PUBLICATION {q} \
                 SET (publish_via_partition_root = true)"
            ),
            PublicationProblem::NoWal { table, on, what } => format!(
                "cannot carry the rows of {on}, {what} in outbox table {table}: it writes no \
                 WAL, so its rows are never decoded and the slot would move past them; make it \
                 a logged table (ALTER TABLE {on} SET LOGGED), {lost}"
            ),
            PublicationProblem::Partial { table, on, what } => format!(
                "has {what} on {on}, part of outbox table {table}: rows or columns it leaves out \
                 would never be relayed; publish whole rows with ALTER PUBLICATION {q} SET TABLE \
                 {}",
                table.quoted()
            ),
        }
    }

    /// The whole sentence, naming the publication (as `run` says it).
    pub fn sentence(&self, publication: &str) -> String {
        format!("publication {publication:?} {}", self.text(publication))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(name: &str) -> TableName {
        TableName {
            schema: "public".into(),
            name: name.into(),
        }
    }

    fn healthy() -> PublicationInfo {
        PublicationInfo {
            name: "p".into(),
            inserts: true,
            via_root: true,
            tables: vec![Hold {
                table: table("outbox"),
                root: Some(16384),
                partitioned: false,
                listed: true,
                covered: true,
                partial: None,
                no_wal: None,
            }],
        }
    }

    #[test]
    fn one_verdict_in_the_order_run_meets_it() {
        assert!(healthy().problems().is_empty());

        let mut p = healthy();
        p.inserts = false;
        p.tables[0].covered = false;
        p.tables[0].listed = false;
        assert_eq!(
            p.problems(),
            [
                PublicationProblem::NoInserts,
                PublicationProblem::NotCovered(table("outbox"))
            ]
        );

        // Partitions under their own names: check asks for the root; run
        // streams (it decodes partitions by relation id).
        let mut p = healthy();
        p.via_root = false;
        p.tables[0].partitioned = true;
        p.tables[0].listed = false;
        let problems = p.problems();
        assert_eq!(
            problems,
            [PublicationProblem::PartitionsByOwnName(table("outbox"))]
        );
        assert!(!problems[0].stops_run());

        let mut p = healthy();
        p.tables[0].partial = Some(("public.outbox_2024".into(), "a row filter"));
        let problems = p.problems();
        assert!(problems[0].stops_run());
        let said = problems[0].sentence("p");
        assert!(
            said.starts_with("publication \"p\" has a row filter on public.outbox_2024")
                && said.contains("SET TABLE \"public\".\"outbox\""),
            "{said}"
        );

        let mut p = healthy();
        p.tables[0].no_wal = Some(("outbox_2025".into(), "an unlogged table"));
        let problems = p.problems();
        assert!(problems[0].stops_run());
        let said = problems[0].sentence("p");
        assert!(
            said.starts_with("publication \"p\" cannot carry the rows of outbox_2025, an unlogged")
                && said.contains("SET LOGGED")
                && said.contains("republish --since"),
            "{said}"
        );

        // Table-less outboxes only: a publication without inserts will do.
        let mut p = healthy();
        p.inserts = false;
        p.tables.clear();
        assert!(p.problems().is_empty());

        let said = PublicationProblem::NotCovered(table("outbox")).sentence("p");
        assert!(
            said.contains("ADD TABLE \"public\".\"outbox\"")
                && said.contains("outbox-relay republish --since <time>"),
            "{said}"
        );
    }
}
