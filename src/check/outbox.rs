//! The outbox checks: the publication covers every outbox table, each table has its columns.

use super::{CheckError, Line, oid};
use crate::config::Config;
use crate::config::OutboxConfig;
use crate::config::TableName;
use crate::config::quote_ident;
use crate::outbox::PayloadKind;
use crate::source::publication;
use tokio_postgres::Client;

/// One column of the outbox table.
pub(super) struct TableColumn {
    name: String,
    type_oid: u32,
    type_name: String,
    not_null: bool,
}

/// `None` when the table does not exist; else its kind and columns.
pub(super) async fn table_columns(
    client: &Client,
    t: &TableName,
) -> Result<Option<(String, Vec<TableColumn>)>, CheckError> {
    let Some(kind) = client
        .query_opt(
            "SELECT c.relkind::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2",
            &[&t.schema, &t.name],
        )
        .await?
    else {
        return Ok(None);
    };
    let rows = client
        .query(
            "SELECT a.attname::text, a.atttypid::oid, format_type(a.atttypid, a.atttypmod), \
             a.attnotnull FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped \
             ORDER BY a.attnum",
            &[&t.schema, &t.name],
        )
        .await?;
    let columns = rows
        .iter()
        .map(|r| TableColumn {
            name: r.get(0),
            type_oid: r.get(1),
            type_name: r.get(2),
            not_null: r.get(3),
        })
        .collect();
    Ok(Some((kind.get(0), columns)))
}

/// Required columns, by config key: `run` cannot map a row without them.
pub(super) fn required_columns(o: &OutboxConfig) -> Vec<(String, &str)> {
    let c = &o.columns;
    vec![
        (o.key_of("id"), c.id.as_str()),
        (o.key_of("aggregate_type"), c.aggregate_type.as_str()),
        (o.key_of("aggregate_id"), c.aggregate_id.as_str()),
        (o.key_of("event_type"), c.event_type.as_str()),
        (o.key_of("payload"), c.payload.as_str()),
    ]
}

/// Columns the exchange and routing key templates read, with their key.
pub(super) fn template_columns(o: &OutboxConfig) -> Vec<(&'static str, &str)> {
    let cols = &o.columns;
    o.exchange
        .columns()
        .map(|c| ("the exchange", cols.resolve(c)))
        .chain(
            o.routing_key
                .columns()
                .map(|c| ("the routing key", cols.resolve(c))),
        )
        .collect()
}

/// A table-less outbox: nothing to check in the database, and one thing to
/// know.
pub(super) fn message_outbox(o: &OutboxConfig) -> Line {
    Line::warn(
        format!("outbox {} ({})", o.key, o.source),
        "table-less: its events live only in the WAL the slot retains. A lost slot (a failover \
         before PostgreSQL 17, max_slot_wal_keep_size exceeded) loses them, and `recover` cannot \
         re-publish what was never stored: on PostgreSQL 17+ use failover slots \
         (sync_replication_slots on the standby), and keep max_slot_wal_keep_size generous",
    )
}

/// Who may write table-less events: `pg_logical_emit_message` (every
/// overload: text and bytea content, and PostgreSQL 17's `flush` argument)
/// is executable by PUBLIC in stock PostgreSQL, so any role that can connect
/// could emit events (ids, routes and all) into a table-less outbox, where a
/// table outbox needs INSERT on its table.
pub(super) async fn emit_privilege(client: &Client) -> Result<Vec<Line>, CheckError> {
    let open: Vec<String> = client
        .query(
            "SELECT p.oid::regprocedure::text FROM pg_proc p \
             WHERE p.proname = 'pg_logical_emit_message' \
               AND p.pronamespace = 'pg_catalog'::regnamespace \
               AND has_function_privilege('public', p.oid, 'EXECUTE') \
             ORDER BY 1",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let what = "who may write table-less events";
    if open.is_empty() {
        return Ok(vec![Line::ok(
            what,
            "no pg_logical_emit_message is executable by PUBLIC",
        )]);
    }
    let revoke: Vec<String> = (open.iter())
        .map(|f| format!("REVOKE EXECUTE ON FUNCTION {f} FROM PUBLIC;"))
        .collect();
    Ok(vec![Line::warn(
        what,
        format!(
            "PUBLIC may call {}: any role that can connect to this database can publish events, \
             with ids and routes of its choosing. As a superuser: {} then GRANT EXECUTE ON \
             FUNCTION ... TO the application's role (and the relay's, for \
             postgres.heartbeat_secs)",
            open.join(", "),
            revoke.join(" ")
        ),
    )])
}

pub(super) async fn publication(client: &Client, cfg: &Config) -> Result<Vec<Line>, CheckError> {
    let pg = &cfg.postgres;
    let tables: Vec<(&OutboxConfig, &TableName)> = (cfg.outboxes.iter())
        .filter_map(|o| Some((o, o.table()?)))
        .collect();
    let all_quoted = (tables.iter().map(|(_, t)| t.quoted()))
        .collect::<Vec<_>>()
        .join(", ");
    let what = format!("publication {:?}", pg.publication);
    let pub_q = quote_ident(&pg.publication);
    // The tables by name, as the config says them (`run` follows them by
    // id, which is the same table unless one was renamed since).
    let mut roots = Vec::with_capacity(tables.len());
    for (_, t) in &tables {
        let root: Option<u32> = client
            .query_one("SELECT to_regclass($1)::oid", &[&t.quoted()])
            .await?
            .get(0);
        roots.push(((*t).clone(), root));
    }
    let Some(info) = publication::read(client, &pg.publication, &roots).await? else {
        return Ok(vec![Line::fail(
            what,
            format!(
                "does not exist (postgres.publication): run `outbox-relay setup`, or \
                 CREATE PUBLICATION {pub_q}{} \
                 WITH (publish = 'insert', publish_via_partition_root = true)",
                if tables.is_empty() {
                    String::new()
                } else {
                    format!(" FOR TABLE {all_quoted}")
                }
            ),
        )]);
    };
    let any_partitioned = info.tables.iter().any(|h| h.partitioned);
    let mut problems: Vec<String> = (info.problems().iter())
        .map(|p| p.text(&pg.publication))
        .collect();
    // Anything else it publishes would stop the relay at its first INSERT.
    let schemas: Vec<&str> = tables.iter().map(|(_, t)| t.schema.as_str()).collect();
    let names: Vec<&str> = tables.iter().map(|(_, t)| t.name.as_str()).collect();
    let others: Vec<String> = client
        .query_one(
            "SELECT ARRAY(SELECT format('%I.%I', pt.schemaname, pt.tablename) \
             FROM pg_publication_tables pt JOIN pg_namespace n ON n.nspname = pt.schemaname \
             JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename \
             WHERE pt.pubname = $1 AND c.oid <> ALL (ARRAY( \
               SELECT r.oid FROM pg_class r JOIN pg_namespace rn ON rn.oid = r.relnamespace \
               JOIN unnest($2::text[], $3::text[]) o(s, t) ON rn.nspname = o.s AND r.relname = o.t \
               UNION ALL SELECT p.relid::oid FROM pg_class r \
               JOIN pg_namespace rn ON rn.oid = r.relnamespace \
               JOIN unnest($2::text[], $3::text[]) o(s, t) ON rn.nspname = o.s AND r.relname = o.t \
               CROSS JOIN LATERAL pg_partition_tree(r.oid) p)) ORDER BY 1 LIMIT 5)",
            &[&pg.publication, &schemas, &names],
        )
        .await?
        .get(0);
    if !others.is_empty() {
        problems.push(format!(
            "also publishes {}: an INSERT into any of them stops the relay (it never skips a \
             change); publish only the outboxes: ALTER PUBLICATION {pub_q} SET TABLE {all_quoted}",
            others.join(", "),
        ));
    }
    if problems.is_empty() {
        let via = match (any_partitioned, tables.len()) {
            (false, _) => "",
            (true, 1) => " (partitioned, via its root)",
            (true, _) => " (partitioned tables via their root)",
        };
        let into = if tables.is_empty() {
            "exists (the outboxes are table-less: logical messages need no table)".to_owned()
        } else {
            format!(
                "publishes inserts into {}{via}",
                (tables.iter().map(|(_, t)| t.to_string()))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        Ok(vec![Line::ok(what, into)])
    } else {
        Ok(vec![Line::fail(what, problems.join("; "))])
    }
}

pub(super) async fn outbox_table(
    client: &Client,
    o: &OutboxConfig,
) -> Result<Vec<Line>, CheckError> {
    let t = o.table().expect("a table outbox");
    let what = format!("outbox table {t}");
    let key = |field: &str| o.key_of(field);
    let Some((kind, columns)) = table_columns(client, t).await? else {
        return Ok(vec![Line::fail(
            what,
            format!(
                "does not exist ({0}): create it, e.g. with sql/outbox.sql, or fix {0}",
                key("table")
            ),
        )]);
    };
    if kind != "r" && kind != "p" {
        return Ok(vec![Line::fail(
            what,
            format!(
                "is not a table (pg_class.relkind {kind:?}); only tables can be published: fix {}",
                key("table")
            ),
        )]);
    }
    let find = |name: &str| columns.iter().find(|c| c.name == name);
    let cols = &o.columns;

    let mut problems = Vec::new();
    let mut found = Vec::new();
    let mut reported: Vec<&str> = Vec::new();
    for (k, name) in required_columns(o) {
        let key = k.as_str();
        match find(name) {
            None => {
                problems.push(format!("no column {name:?} ({key})"));
                reported.push(name);
            }
            Some(c) => {
                if k == o.key_of("payload") && PayloadKind::of_type(c.type_oid).is_none() {
                    problems.push(format!(
                        "payload column {name:?} ({key}) has type {} (use jsonb, json, text, varchar, char or bytea)",
                        c.type_name
                    ));
                }
                found.push(format!("{name} {}", c.type_name));
            }
        }
    }
    for (key, name) in template_columns(o) {
        if find(name).is_none() && !reported.contains(&name) {
            problems.push(format!("no column {name:?} (a placeholder of {key})"));
            reported.push(name);
        }
    }

    let mut warnings = Vec::new();
    match find(&cols.headers) {
        None => warnings.push(Line::warn(
            what.clone(),
            format!(
                "no headers column {:?} ({}): messages carry no extra headers",
                cols.headers,
                key("headers")
            ),
        )),
        Some(c) if c.type_oid != oid::JSON && c.type_oid != oid::JSONB => problems.push(format!(
            "headers column {:?} ({}) has type {} (use jsonb or json, holding a JSON object)",
            cols.headers,
            key("headers"),
            c.type_name
        )),
        Some(c) => found.push(format!("{} {}", c.name, c.type_name)),
    }
    match find(&cols.created_at) {
        None => warnings.push(Line::warn(
            what.clone(),
            format!(
                "no column {:?} ({}): `outbox-relay recover` and `republish --since` need it",
                cols.created_at,
                key("created_at")
            ),
        )),
        Some(c) if c.type_oid != oid::TIMESTAMPTZ && c.type_oid != oid::TIMESTAMP => {
            warnings.push(Line::warn(
                what.clone(),
                format!(
                    "column {:?} ({}) has type {}; `outbox-relay recover` and \
                     `republish --since` expect timestamptz",
                    cols.created_at,
                    key("created_at"),
                    c.type_name
                ),
            ))
        }
        Some(c) => found.push(format!("{} {}", c.name, c.type_name)),
    }
    if let Some(seq) = &cols.sequence {
        const INTEGERS: [u32; 4] = [oid::INT2, oid::INT4, oid::INT8, oid::NUMERIC];
        match find(seq) {
            None => problems.push(format!("no column {seq:?} ({})", key("sequence"))),
            Some(c) if !INTEGERS.contains(&c.type_oid) || !c.not_null => problems.push(format!(
                "sequence column {seq:?} ({}) is {}{}: recover and republish need a NOT NULL \
                 integer that increases in the order rows are written (an identity or \
                 bigserial column)",
                key("sequence"),
                c.type_name,
                if c.not_null { "" } else { ", nullable" }
            )),
            Some(c) => found.push(format!("{} {} (the re-read order)", c.name, c.type_name)),
        }
    }

    // A foreign table as a partition takes its rows to another server: no
    // WAL here, nothing relayed. Often old rows in other storage, so said,
    // not refused (an unlogged partition is: see the publication's line).
    if kind == "p" {
        let foreign: Vec<String> = client
            .query_one(
                "SELECT ARRAY(SELECT t.relid::regclass::text FROM pg_partition_tree($1::text::regclass) t \
                 JOIN pg_class c ON c.oid = t.relid WHERE c.relkind = 'f' ORDER BY 1)",
                &[&t.quoted()],
            )
            .await?
            .get(0);
        if !foreign.is_empty() {
            warnings.push(Line::warn(
                what.clone(),
                format!(
                    "partition(s) {} are foreign tables: rows inserted into them go to another \
                     server and are never relayed; keep new outbox rows out of them",
                    foreign.join(", ")
                ),
            ));
        }
    }
    let partitioned = if kind == "p" {
        "partitioned (its partitions' rows are relayed as the table's); "
    } else {
        ""
    };
    let mut lines = vec![if problems.is_empty() {
        Line::ok(what, format!("{partitioned}columns {}", found.join(", ")))
    } else {
        Line::fail(
            what,
            format!(
                "{}: add the columns, or change the config keys named",
                problems.join("; ")
            ),
        )
    }];
    lines.extend(warnings);
    Ok(lines)
}
