//! PostgreSQL side: tables, backlogs, WAL positions, pg_recvlogical.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio_postgres::{Client, NoTls};

use crate::workload::{AGGREGATE_TYPE, EVENT_TYPE, aggregate_id_sql, payload, payload_sql};

/// A session of the "application": the backlog, the producers, the polling
/// dispatcher. It commits with `synchronous_commit = on`, PostgreSQL's
/// default, overriding the throwaway server's `off`: with `off` a commit's
/// WAL is flushed only by the WAL writer (every `wal_writer_delay`, 200 ms),
/// and logical decoding, which reads flushed WAL only, would wait for it.
/// (The server still runs with `fsync = off`, so a flush is a write.)
pub async fn connect(url: &str) -> Result<Client> {
    let (client, conn) = tokio_postgres::connect(url, NoTls)
        .await
        .context("connecting to PostgreSQL")?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
        .batch_execute("SET synchronous_commit = on")
        .await
        .context("SET synchronous_commit")?;
    Ok(client)
}

/// Parses "X/Y".
pub fn parse_lsn(s: &str) -> Result<u64> {
    let (hi, lo) = s.split_once('/').context("LSN without '/'")?;
    Ok((u64::from_str_radix(hi, 16)? << 32) | u64::from_str_radix(lo, 16)?)
}

pub fn fmt_lsn(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xffff_ffff)
}

/// The WAL insert position: everything written so far, flushed or not.
pub async fn wal_lsn(pg: &Client) -> Result<u64> {
    let s: String = pg
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await?
        .get(0);
    parse_lsn(&s)
}

/// `server_version`.
pub async fn version(pg: &Client) -> Result<String> {
    Ok(pg.query_one("SHOW server_version", &[]).await?.get(0))
}

/// The relay's outbox table: `sql/outbox.sql` under another name.
pub async fn create_outbox(pg: &Client, ddl_file: &str, table: &str) -> Result<()> {
    let ddl = std::fs::read_to_string(ddl_file).with_context(|| format!("reading {ddl_file}"))?;
    if !ddl.contains("CREATE TABLE outbox") {
        bail!("{ddl_file} has no `CREATE TABLE outbox`");
    }
    pg.batch_execute(&format!("DROP TABLE IF EXISTS {table}"))
        .await?;
    pg.batch_execute(&ddl.replace("CREATE TABLE outbox", &format!("CREATE TABLE {table}")))
        .await
        .with_context(|| format!("creating {table}"))?;
    Ok(())
}

/// The classic polling outbox: the same columns plus the dispatcher's
/// bookkeeping, and a partial index on the claimable rows so that the claim
/// is an index scan.
pub async fn create_poll_table(pg: &Client, table: &str) -> Result<()> {
    pg.batch_execute(&format!(
        "DROP TABLE IF EXISTS {table};
         CREATE TABLE {table} (
           id             uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
           aggregate_type text        NOT NULL,
           aggregate_id   text        NOT NULL,
           event_type     text        NOT NULL,
           payload        jsonb       NOT NULL,
           headers        jsonb,
           created_at     timestamptz NOT NULL DEFAULT now(),
           status         text        NOT NULL DEFAULT 'pending',
           attempts       int         NOT NULL DEFAULT 0,
           claimed_by     text,
           claimed_at     timestamptz,
           published_at   timestamptz
         );
         CREATE INDEX {table}_pending ON {table} (created_at) WHERE status = 'pending';"
    ))
    .await
    .with_context(|| format!("creating {table}"))?;
    Ok(())
}

/// A server-side loop committing `statement` (which ends `SELECT ...`
/// over `i`, the event number) for events `first..first+count`, `tx_rows`
/// per transaction.
fn backlog_loop(statement: &str, first: u64, count: u64, tx_rows: u64) -> String {
    format!(
        "DO $$
         BEGIN
           FOR b IN 0..{last_tx} LOOP
             {statement}
             FROM generate_series({first}::bigint + b::bigint * {tx_rows}, {first}::bigint + b::bigint * {tx_rows} + {tx_rows} - 1) AS i;
             COMMIT;
           END LOOP;
         END $$",
        last_tx = count / tx_rows - 1,
    )
}

/// Commits events `first..first+count` into `table`, `tx_rows` rows per
/// transaction, in one server-side loop (no client round trips in the way).
pub async fn insert_backlog(
    pg: &Client,
    table: &str,
    first: u64,
    count: u64,
    tx_rows: u64,
) -> Result<Duration> {
    let sql = backlog_loop(
        &format!(
            "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload)
             SELECT '{AGGREGATE_TYPE}', {agg}, '{EVENT_TYPE}', {payload}",
            agg = aggregate_id_sql("i"),
            payload = payload_sql("i"),
        ),
        first,
        count,
        tx_rows,
    );
    let t = Instant::now();
    pg.batch_execute(&sql)
        .await
        .with_context(|| format!("inserting the backlog into {table}"))?;
    let took = t.elapsed();
    // The relay publishes `payload::text`: check it is the 300-byte body the
    // ceiling publishers send.
    let row = pg
        .query_one(
            &format!(
                "SELECT payload::text FROM {table} WHERE aggregate_id = 'order-' || lpad($1::text, 9, '0') LIMIT 1"
            ),
            &[&(first as i64).to_string()],
        )
        .await?;
    let text: String = row.get(0);
    if text != payload(first) {
        bail!(
            "stored payload differs from the benchmark body:\n  {text}\n  {}",
            payload(first)
        );
    }
    Ok(took)
}

/// The same events as [`insert_backlog`], written to the WAL only: one
/// transactional logical message with `prefix` per event, the fields as a
/// JSON object (the payload the same 300 bytes), `tx_rows` per transaction.
pub async fn emit_backlog(
    pg: &Client,
    prefix: &str,
    first: u64,
    count: u64,
    tx_rows: u64,
) -> Result<Duration> {
    let sql = backlog_loop(
        &format!(
            "PERFORM pg_logical_emit_message(true, '{prefix}', format(
               '{{\"id\": \"%s\", \"aggregate_type\": \"{AGGREGATE_TYPE}\", \"aggregate_id\": \"%s\", \"event_type\": \"{EVENT_TYPE}\", \"payload\": %s}}',
               gen_random_uuid(), {agg}, ({payload})::text))",
            agg = aggregate_id_sql("i"),
            payload = payload_sql("i"),
        ),
        first,
        count,
        tx_rows,
    );
    let t = Instant::now();
    pg.batch_execute(&sql)
        .await
        .with_context(|| format!("emitting the backlog as messages {prefix:?}"))?;
    Ok(t.elapsed())
}

/// `EXPLAIN (ANALYZE, BUFFERS)` of `sql`, run inside a transaction that is
/// rolled back.
pub async fn explain_analyze(pg: &Client, sql: &str) -> Result<String> {
    pg.batch_execute("BEGIN").await?;
    let res = pg
        .simple_query(&format!("EXPLAIN (ANALYZE, BUFFERS, COSTS) {sql}"))
        .await;
    pg.batch_execute("ROLLBACK").await?;
    let mut out = String::new();
    for m in res? {
        if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
            out.push_str(r.get(0).unwrap_or(""));
            out.push('\n');
        }
    }
    Ok(out)
}

/// Newest `/usr/lib/postgresql/<v>/bin`.
pub fn pg_bin_dir() -> Option<std::path::PathBuf> {
    let mut dirs: Vec<(u32, std::path::PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            Some((v, e.path().join("bin")))
        })
        .collect();
    dirs.sort();
    dirs.pop().map(|(_, p)| p)
}

/// Streams `slot` (pgoutput) up to `endpos` into /dev/null with
/// pg_recvlogical; returns the wall time.
pub fn recvlogical(url: &str, slot: &str, publication: &str, endpos: u64) -> Result<Duration> {
    let bin = pg_bin_dir()
        .map(|d| d.join("pg_recvlogical"))
        .filter(|p| p.exists())
        .context("pg_recvlogical not found under /usr/lib/postgresql/*/bin")?;
    let t = Instant::now();
    let mut child = std::process::Command::new(&bin)
        .arg("-d")
        .arg(url)
        .arg("--slot")
        .arg(slot)
        .arg("--start")
        .arg("--no-loop")
        .arg("-o")
        .arg("proto_version=1")
        .arg("-o")
        .arg(format!("publication_names={publication}"))
        .arg("--endpos")
        .arg(fmt_lsn(endpos))
        .arg("-f")
        .arg("/dev/null")
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let status = crate::procs::wait_timeout(&mut child, Duration::from_secs(600))?;
    let took = t.elapsed();
    if !status.success() {
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut err);
        }
        bail!("pg_recvlogical failed ({status}): {err}");
    }
    Ok(took)
}
