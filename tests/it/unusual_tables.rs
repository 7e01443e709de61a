//! Outbox tables the default DDL does not make: partitioned, renamed while
//! streaming, and a publication that publishes more than the outbox. Each
//! must end with every outbox row relayed, or with the relay stopped and
//! saying why: never with a row skipped while the slot moves past it.

use crate::common;

use std::time::Duration;

use common::*;
use serde_json::json;

/// The default outbox table, partitioned by aggregate type.
fn partitioned() -> String {
    partitioned_ddl(
        "aggregate_type",
        "CREATE TABLE {table}_orders PARTITION OF {table} FOR VALUES IN ('order');
CREATE TABLE {table}_rest PARTITION OF {table} DEFAULT;",
    )
}

/// `setup` publishes a partitioned outbox via its root and `check` says so;
/// rows inserted into every partition, including one attached while the
/// relay streams, arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_outbox_is_relayed_from_every_partition() {
    let mut f = Fixture::with_ddl("partitioned", "", &partitioned()).await;
    let pg = pg_connect().await;
    let out = f.relay_cmd("check").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let table_line = stdout
        .lines()
        .find(|l| l.contains("outbox table"))
        .unwrap_or_else(|| panic!("no outbox table line:\n{stdout}"));
    assert!(
        table_line.starts_with("ok ") && table_line.contains("partitioned"),
        "{stdout}"
    );
    let pub_line = stdout.lines().find(|l| l.contains("publication")).unwrap();
    assert!(
        pub_line.starts_with("ok ") && pub_line.contains("via its root"),
        "{stdout}"
    );

    f.start_consumer().await;
    let relay = f.spawn_relay();
    let mut ids = Vec::new();
    for (i, kind) in ["order", "invoice", "order", "user"].iter().enumerate() {
        let id = f
            .insert(&pg, kind, &format!("a-{i}"), "created", &json!({ "i": i }))
            .await;
        ids.push(id);
    }
    // A partition attached while streaming.
    pg.batch_execute(&format!(
        "CREATE TABLE {0}_users PARTITION OF {0} FOR VALUES IN ('account')",
        f.table
    ))
    .await
    .unwrap_or_else(|e| {
        // The DEFAULT partition must not hold 'account' rows yet: it does not.
        panic!("attaching a partition: {e}")
    });
    ids.push(f.insert(&pg, "account", "u-1", "opened", &json!({})).await);
    let got = f
        .collect_until(
            &ids,
            Duration::from_secs(30),
            Duration::from_millis(300),
            Some(&relay),
        )
        .await;
    let counts = count_by_id(&got);
    for id in &ids {
        assert!(counts.contains_key(id), "{id} missing");
    }
    assert!(
        got.iter()
            .any(|r| r.header_str("aggregate_type").as_deref() == Some("account")),
        "the new partition's row did not arrive"
    );
    relay.stop_ok();
    f.cleanup().await;
}

/// A RENAME of the outbox table while streaming is followed by its relation
/// id: rows inserted under the new name arrive. A restart with the old name
/// in the config stops with an error that says the table is gone and why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rename_while_streaming_loses_no_row() {
    let mut f = Fixture::new("renamed").await;
    let pg = pg_connect().await;
    f.start_consumer().await;
    let relay = f.spawn_relay();
    let first = f.insert(&pg, "order", "o-1", "placed", &json!({})).await;
    f.expect_delivered(&[first], &relay).await;

    let renamed = format!("{}_renamed", f.table);
    pg.batch_execute(&format!("ALTER TABLE {} RENAME TO {renamed}", f.table))
        .await
        .unwrap();
    let after = insert_into(&pg, &renamed, "o-2").await;
    f.expect_delivered(&[after], &relay).await;
    assert!(
        relay
            .wait_log("the outbox table was renamed", Duration::from_secs(5))
            .await,
        "the rename was not logged:\n{}",
        relay.log_tail()
    );

    // A reconnect (the walsender terminated) keeps following it.
    let walsender = fx_walsender(&f, &pg).await;
    pg.execute("SELECT pg_terminate_backend($1)", &[&walsender])
        .await
        .unwrap();
    let later = insert_into(&pg, &renamed, "o-3").await;
    f.expect_delivered(&[later], &relay).await;
    assert!(
        relay.log_text().matches("streaming from LSN").count() >= 2,
        "no reconnect happened:\n{}",
        relay.log_tail()
    );
    relay.stop_ok();

    // The config still names the old table: the next start says so.
    let mut relay = f.spawn_relay();
    let (status, log) = Fixture::wait_exit(&mut relay, Duration::from_secs(30));
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("does not exist") && log.contains("outbox.table") && log.contains("renamed"),
        "{log}"
    );
    pg.batch_execute(&format!("ALTER TABLE {renamed} RENAME TO {}", f.table))
        .await
        .unwrap();
    f.cleanup().await;
}

/// The outbox dropped and created again (from `sql/outbox.sql`) while
/// streaming: the publication no longer holds it, so its rows are never
/// decoded. The relay stops, naming `republish --since`, and the slot
/// never passes the new table's rows, though WAL (and keepalives) go on.
/// The next start refuses until the publication holds the table again;
/// then the printed `republish` sends the rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_and_recreated_outbox_stops_the_relay() {
    let f = Fixture::new("recreated").await;
    let drop = format!("DROP TABLE {}", f.table);
    replaced_outbox_stops_the_relay(f, &drop, "was dropped").await;
}

/// The same when the outbox is renamed away and a new table takes its name
/// (a rename-and-swap migration): the relay follows the old table by its
/// id, but the rows now go to the new one, which the publication does not
/// hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_swapped_by_rename_stops_the_relay() {
    let f = Fixture::new("swapped").await;
    let rename = format!("ALTER TABLE {0} RENAME TO {0}_old", f.table);
    replaced_outbox_stops_the_relay(f, &rename, "now names another table").await;
}

/// The outbox dropped and created again while no relay runs (killed
/// before its next reading of the publication could see the change), and
/// added back by `setup` before the next start: the new table's rows
/// written before `setup` were never decoded. The next relay must not take
/// the catalog as it finds it: the checkpoint row records what the last
/// session started from, and the start refuses, naming `republish
/// --since`; a `republish` from a later time does not lift the refusal, the
/// named one does, and every row arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_recreated_while_no_relay_runs_stops_the_next_start() {
    let mut f = Fixture::new("recreatedoff").await;
    let (pg, relay) = f.streaming().await;
    let first = f
        .insert(&pg, "order", "o-first", "placed", &json!({}))
        .await;
    f.expect_delivered(std::slice::from_ref(&first), &relay)
        .await;
    // The checkpoint row records the coverage (written at the session's
    // start) before the relay dies.
    relay.kill9();
    pg.batch_execute(&format!(
        "DROP TABLE {}; {} {}",
        f.table,
        outbox_ddl(&f),
        f.grant_sql(&f.table)
    ))
    .await
    .unwrap();
    let mut ids = Vec::new();
    for i in 0..20 {
        ids.push(
            f.insert(&pg, "order", &format!("before-{i}"), "placed", &json!({}))
                .await,
        );
    }
    f.relay_ok("setup", &[]);
    for i in 0..10 {
        ids.push(
            f.insert(&pg, "order", &format!("after-{i}"), "placed", &json!({}))
                .await,
        );
    }

    let mut relay = f.spawn_relay();
    let (status, log) = Fixture::wait_exit(&mut relay, Duration::from_secs(30));
    assert!(
        !status.success() && log.contains("was dropped") && log.contains("republish --since"),
        "the start after the table was re-created must refuse: {log}"
    );
    let since = republish_since(&log);

    // A republish of the last seconds (an operator's unrelated one) does
    // not cover the change: the start still refuses.
    let now: String = pg
        .query_one(
            "SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let out = f
        .relay_cmd("republish")
        .args(["--since", &now])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains(&format!("republish --since {since}")),
        "a republish that does not cover the change must say so: {said}"
    );
    let mut relay = f.spawn_relay();
    let (status, log) = Fixture::wait_exit(&mut relay, Duration::from_secs(30));
    assert!(
        !status.success() && log.contains(&format!("republish --since {since}")),
        "a republish from after the change must not lift the refusal: {log}"
    );

    republish_then_stream(&mut f, &since, &ids).await;
    f.cleanup().await;
}

/// The publication told to publish no inserts, and back, while no relay
/// runs: the flags are as they were, but the rows written meanwhile were
/// never decoded. The publication's row was rewritten, which the record
/// in the checkpoint row tells: the next start refuses until `republish`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_toggled_while_no_relay_runs_stops_the_next_start() {
    let mut f = Fixture::new("toggledoff").await;
    let (pg, relay) = f.streaming().await;
    let first = f
        .insert(&pg, "order", "o-first", "placed", &json!({}))
        .await;
    f.expect_delivered(std::slice::from_ref(&first), &relay)
        .await;
    relay.stop_ok();
    let publication = format!("ALTER PUBLICATION \"{}\"", f.publication);
    pg.batch_execute(&format!("{publication} SET (publish = 'update')"))
        .await
        .unwrap();
    let unpublished = f.insert(&pg, "order", "o-gap", "placed", &json!({})).await;
    pg.batch_execute(&format!("{publication} SET (publish = 'insert')"))
        .await
        .unwrap();
    let mut relay = f.spawn_relay();
    let (status, log) = Fixture::wait_exit(&mut relay, Duration::from_secs(30));
    assert!(
        !status.success() && log.contains("changed what it publishes"),
        "the start after the publication changed must refuse: {log}"
    );
    let since = republish_since(&log);
    republish_then_stream(&mut f, &since, &[unpublished]).await;
    f.cleanup().await;
}

/// The remedy a stop named: `republish --since since`, then a relay that
/// starts streaming and delivers `ids`.
async fn republish_then_stream(f: &mut Fixture, since: &str, ids: &[String]) {
    f.relay_ok("republish", &["--since", since]);
    let relay = f.spawn_relay();
    f.expect_delivered(ids, &relay).await;
    assert!(
        relay
            .wait_log("streaming from LSN", Duration::from_secs(30))
            .await,
        "{}",
        relay.log_tail()
    );
    relay.stop_ok();
}

/// `sql/outbox.sql`, creating the fixture's outbox table.
fn outbox_ddl(f: &Fixture) -> String {
    std::fs::read_to_string(repo_path("sql/outbox.sql"))
        .unwrap()
        .replace("CREATE TABLE outbox", &format!("CREATE TABLE {}", f.table))
}

/// The time in the `republish --since` a stop names.
fn republish_since(log: &str) -> String {
    log.split("republish --since ")
        .nth(1)
        .and_then(|s| s.split(['`', ' ', '\n']).next())
        .expect("a time to republish from")
        .to_owned()
}

/// A new connection with a transaction left open after inserting one
/// event for `aggregate_id`; its id.
async fn open_insert(f: &Fixture, aggregate_id: &str) -> (tokio_postgres::Client, String) {
    let pg = pg_connect_retry_to(&f.pg_url).await;
    pg.batch_execute("BEGIN").await.unwrap();
    let id: String = pg
        .query_one(
            &f.insert_sql(),
            &[&"order", &aggregate_id, &"placed", &json!({}).to_string()],
        )
        .await
        .unwrap()
        .get(0);
    (pg, id)
}

/// A transaction that wrote to the re-created outbox before `setup` added
/// it to the publication, and commits after, is never streamed: PostgreSQL
/// decodes a change with the catalog as it was when the change was written.
/// The remedy's `republish` must send it, though it started while the
/// transaction was open: it waits for the transactions writing to the
/// outbox (a prepared one too) to end before it reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_open_across_the_remedy_is_republished() {
    let mut f = Fixture::new("openremedy").await;
    let (pg, mut relay) = f.streaming().await;
    let drop = format!("DROP TABLE {}", f.table);
    pg.batch_execute(&format!(
        "{drop}; {} {}",
        outbox_ddl(&f),
        f.grant_sql(&f.table)
    ))
    .await
    .unwrap();
    let before = f.insert(&pg, "order", "o-1", "placed", &json!({})).await;
    let other = f.scoped("other");
    pg.batch_execute(&format!(
        "CREATE TABLE {other} (i int); INSERT INTO {other} SELECT generate_series(1, 10000)"
    ))
    .await
    .unwrap();
    let (status, log) = Fixture::wait_exit(&mut relay, Duration::from_secs(30));
    // Read while the DDL commits, the old table can still show in the
    // statement's snapshot while the name already resolves to the new one
    // (catalog lookups see the newest catalog): then the stop says the
    // name "now names another table". The remedy it names is the same.
    assert!(
        !status.success() && (log.contains("was dropped") || log.contains("now names another")),
        "{log}"
    );
    let since = republish_since(&log);

    // Open across `setup` and the start of `republish`.
    let (open_tx, open) = open_insert(&f, "o-2").await;
    // And a prepared one (no session holds it; its locks stay).
    let (prep, prepared) = open_insert(&f, "o-3").await;
    let gid = f.scoped("remedy_gid");
    prep.batch_execute(&format!("PREPARE TRANSACTION '{gid}'"))
        .await
        .unwrap();
    f.relay_ok("setup", &[]);
    let mut republish = f
        .relay_cmd("republish")
        .args(["--since", &since])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    open_tx.batch_execute("COMMIT").await.unwrap();
    prep.batch_execute(&format!("COMMIT PREPARED '{gid}'"))
        .await
        .unwrap();
    let status = wait_timeout(&mut republish, Duration::from_secs(60)).expect("republish ended");
    let out = republish.wait_with_output().unwrap();
    assert!(
        status.success(),
        "republish: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let relay = f.spawn_relay();
    f.expect_delivered(&[before, open, prepared], &relay).await;
    assert!(
        relay
            .wait_log("streaming from LSN", Duration::from_secs(30))
            .await,
        "{}",
        relay.log_tail()
    );
    relay.stop_ok();
    pg.batch_execute(&format!("DROP TABLE {other}"))
        .await
        .unwrap();
    f.cleanup().await;
}

/// Streams, runs `away` (the outbox table goes) and creates the outbox
/// again from `sql/outbox.sql`, writes 30 rows: the relay stops saying
/// `said`, the slot stays before the rows, and the remedy it names sends
/// them.
async fn replaced_outbox_stops_the_relay(mut f: Fixture, away: &str, said: &str) {
    let (pg, mut relay) = f.streaming().await;
    pg.batch_execute(&format!(
        "{away}; {} {}",
        outbox_ddl(&f),
        f.grant_sql(&f.table)
    ))
    .await
    .unwrap();
    let recreated = wal_insert_lsn(&pg).await;
    let mut ids = Vec::new();
    for i in 0..30 {
        ids.push(
            f.insert(&pg, "order", &format!("o-{i}"), "placed", &json!({}))
                .await,
        );
    }
    // WAL goes on (keepalives would carry the slot past the rows).
    let other = f.scoped("other");
    pg.batch_execute(&format!(
        "CREATE TABLE {other} (i int); INSERT INTO {other} SELECT generate_series(1, 10000)"
    ))
    .await
    .unwrap();
    let (status, log) = Fixture::wait_exit(&mut relay, Duration::from_secs(30));
    assert!(!status.success(), "{log}");
    assert!(
        log.contains(said) && log.contains("republish --since"),
        "{log}"
    );
    let confirmed = f.confirmed_flush_lsn(&pg).await;
    assert!(
        confirmed <= recreated,
        "the slot moved past the new table's rows: {confirmed} > {recreated}"
    );
    let since = republish_since(&log);

    // The next start refuses while the publication does not hold it, and
    // after `setup` added it, until `republish` sent the rows.
    for remedy in [None, Some("setup")] {
        if let Some(cmd) = remedy {
            f.relay_ok(cmd, &[]);
        }
        let mut relay = f.spawn_relay();
        let (status, log) = Fixture::wait_exit(&mut relay, Duration::from_secs(30));
        assert!(!status.success(), "after {remedy:?}: {log}");
        assert!(
            log.contains(&format!("republish --since {since}")),
            "after {remedy:?}: {log}"
        );
    }

    // The remedy: setup added the table, republish sends its rows.
    republish_then_stream(&mut f, &since, &ids).await;
    pg.batch_execute(&format!(
        "DROP TABLE {other}; DROP TABLE IF EXISTS {}_old",
        f.table
    ))
    .await
    .unwrap();
    f.cleanup().await;
}

/// The publication also publishes another table: an INSERT into it stops
/// the relay with an error naming the table, before the outbox row behind
/// it is confirmed, and the slot does not move past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_insert_into_another_published_table_stops_the_relay() {
    let mut f = Fixture::new("foreign").await;
    let pg = pg_connect().await;
    let other = format!("{}_other", f.table);
    pg.batch_execute(&format!(
        "CREATE TABLE {other} (n int); ALTER PUBLICATION {} ADD TABLE {other}",
        f.publication
    ))
    .await
    .unwrap();
    f.start_consumer().await;
    let mut relay = f.spawn_relay();
    let first = f.insert(&pg, "order", "o-1", "placed", &json!({})).await;
    f.expect_delivered(&[first], &relay).await;
    // The bound: a position inside the foreign transaction, before its
    // commit record. (Not one read before it: other tests write WAL
    // meanwhile, and a keepalive past their records, still before the
    // foreign commit, may rightly be confirmed.)
    let before_foreign: String = pg
        .simple_query(&format!(
            "BEGIN; INSERT INTO {other} VALUES (1); \
             SELECT pg_current_wal_insert_lsn()::text; COMMIT"
        ))
        .await
        .unwrap()
        .into_iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .unwrap();
    let before_foreign: outbox_relay::lsn::Lsn = before_foreign.parse().unwrap();
    let behind = f.insert(&pg, "order", "o-2", "shipped", &json!({})).await;

    let (status, log) = Fixture::wait_exit(&mut relay, Duration::from_secs(30));
    assert!(!status.success(), "{log}");
    assert!(
        log.contains(&other)
            && log.contains("not the outbox table")
            && log.contains("pg_replication_slot_advance")
            && log.contains("xmin"),
        "{log}"
    );
    // check says so before a relay runs into it.
    let out = f.relay_cmd("check").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        stdout.lines().any(|l| l.starts_with("FAIL publication")
            && l.contains("also publishes")
            && l.contains(&other)),
        "{stdout}"
    );
    let late = f.drain_for(Duration::from_millis(500)).await;
    assert!(
        !late.iter().any(|r| r.message_id() == behind),
        "the outbox row behind the foreign insert was published past it"
    );
    let confirmed = f.confirmed_flush_lsn(&pg).await;
    assert!(
        confirmed <= before_foreign,
        "the slot moved past the foreign insert: {confirmed} > {before_foreign}"
    );
    f.cleanup().await;
}

/// Publication names reach pgoutput as written: mixed case and a comma are
/// part of the name, not folded or split.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusual_publication_name_is_sent_quoted() {
    let mut f = Fixture::new("pubname").await;
    let pg = pg_connect().await;
    let odd = format!("Outbox Pub,{}", f.name);
    let text = std::fs::read_to_string(&f.config).unwrap().replace(
        &format!("publication = \"{}\"", f.publication),
        &format!("publication = \"{odd}\""),
    );
    std::fs::write(&f.config, text).unwrap();
    // pgoutput looks publications up as of the WAL it decodes: the slot
    // must be made after the publication, as `setup` does.
    f.drop_slot(&pg).await;
    let out = f.relay_cmd("setup").output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    f.start_consumer().await;
    let relay = f.spawn_relay();
    let id = f.insert(&pg, "order", "o-1", "placed", &json!({})).await;
    f.expect_delivered(&[id], &relay).await;
    relay.stop_ok();
    pg.batch_execute(&format!("DROP PUBLICATION \"{odd}\""))
        .await
        .unwrap();
    f.cleanup().await;
}

/// A slot made for two-phase decoding would stream prepared transactions
/// before they commit: `run` refuses it and says how to replace it, and
/// `check` fails it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_phase_slot_is_refused() {
    let f = Fixture::new("twophase").await;
    let pg = pg_connect().await;
    f.drop_slot(&pg).await;
    pg.execute(
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput', false, true)",
        &[&f.slot],
    )
    .await
    .unwrap();
    let mut relay = f.spawn_relay();
    let (status, log) = Fixture::wait_exit(&mut relay, Duration::from_secs(30));
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("two-phase") && log.contains("pg_drop_replication_slot"),
        "{log}"
    );
    let out = f.relay_cmd("check").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("FAIL replication slot") && l.contains("two-phase")),
        "{stdout}"
    );
    f.cleanup().await;
}

/// A partitioned outbox listed beside one of its own partitions: its rows
/// would come twice, or under the wrong mapping. `setup` and `run` both
/// refuse, naming the two entries; nothing is streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_listed_beside_its_root_is_refused() {
    let f = Fixture::with_ddl("partoverlap", "", &partitioned()).await;
    let text = f.config_text("");
    let single = format!("[outbox]\ntable = \"public.{}\"\n", f.table);
    assert!(text.contains(&single), "{text}");
    let both = format!(
        "[[outbox]]\ntable = \"public.{0}\"\n\n[[outbox]]\ntable = \"public.{0}_orders\"\n",
        f.table
    );
    std::fs::write(&f.config, text.replace(&single, &both)).unwrap();
    let said = |out: &std::process::Output| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    let names_both = |text: &str| {
        text.contains("are the same table or partitions of one another")
            && text.contains("outbox[0].table")
            && text.contains("outbox[1].table")
    };
    let out = f.relay_cmd("setup").output().unwrap();
    assert!(!out.status.success(), "setup took both:\n{}", said(&out));
    assert!(names_both(&said(&out)), "{}", said(&out));
    let mut relay = f.spawn_relay();
    let (status, log) = Fixture::wait_exit(&mut relay, Duration::from_secs(30));
    assert!(!status.success(), "run took both: {status}");
    assert!(names_both(&log), "{log}");
    f.cleanup().await;
}

/// A publication entry with a row filter or a column list would drop, before
/// the relay sees them, the rows or columns it leaves out: `run` refuses
/// each, naming it and the table, and `check` fails on it; nothing streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_filter_or_column_list_is_refused() {
    let f = Fixture::new("partialpub").await;
    let pg = pg_connect().await;
    let before = f.confirmed_flush_lsn(&pg).await;
    for (what, entry) in [
        ("a row filter", "WHERE (aggregate_type <> 'secret')"),
        (
            "a column list",
            "(id, aggregate_type, aggregate_id, event_type, payload, created_at)",
        ),
    ] {
        pg.batch_execute(&format!(
            "ALTER PUBLICATION \"{}\" SET TABLE public.\"{}\" {entry}",
            f.publication, f.table
        ))
        .await
        .unwrap();
        f.insert(&pg, "secret", "a", "e", &json!({})).await;
        let mut relay = f.spawn_relay();
        let (status, log) = Fixture::wait_exit(&mut relay, Duration::from_secs(30));
        assert!(!status.success(), "run streamed with {what}: {log}");
        assert!(
            log.contains(&format!("has {what} on")) && log.contains(&f.table),
            "{log}"
        );
        let out = f.relay_cmd("check").output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(!out.status.success(), "{stdout}");
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with("FAIL publication") && l.contains(what)),
            "{stdout}"
        );
    }
    let after = f.confirmed_flush_lsn(&pg).await;
    assert_eq!(before, after, "the slot moved while the relay refused");
    f.cleanup().await;
}

/// A publication that holds only some partitions of a partitioned outbox
/// (`FOR TABLE outbox_orders`) would never carry the other partitions'
/// rows, and the slot would move past them: `run` refuses it, naming the
/// table, and `check` fails on it; nothing streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_of_some_partitions_only_is_refused() {
    let f = Fixture::with_ddl("somepartitions", "", &partitioned()).await;
    let pg = pg_connect().await;
    let before = f.confirmed_flush_lsn(&pg).await;
    pg.batch_execute(&format!(
        "ALTER PUBLICATION \"{}\" SET TABLE public.\"{}_orders\"",
        f.publication, f.table
    ))
    .await
    .unwrap();
    f.insert(&pg, "customer", "a", "e", &json!({})).await;
    let relay = f.spawn_relay();
    refused_as_not_covered(f, &pg, relay, before).await;
}

/// An outbox that is itself a partition of a larger table, published only
/// through that table's root (`publish_via_partition_root`): its rows
/// would come under the other table's relation id. Refused by run and
/// check alike, before the slot moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_published_through_a_root_above_it_is_refused() {
    let f = Fixture::new("aboveroot").await;
    let pg = pg_connect().await;
    let before = f.confirmed_flush_lsn(&pg).await;
    pg.batch_execute(&format!(
        "CREATE TABLE {0}_top (LIKE {0}) PARTITION BY LIST (aggregate_type); \
         ALTER TABLE {0}_top ATTACH PARTITION {0} FOR VALUES IN ('order'); \
         ALTER PUBLICATION \"{1}\" SET TABLE {0}_top; \
         ALTER PUBLICATION \"{1}\" SET (publish_via_partition_root = true)",
        f.table, f.publication
    ))
    .await
    .unwrap();
    f.insert(&pg, "order", "o-1", "placed", &json!({})).await;
    let relay = f.spawn_relay();
    refused_as_not_covered(f, &pg, relay, before).await;
}

/// `relay` stops saying the publication does not cover the outbox,
/// `check` fails the publication for it, and the slot stays at `before`.
async fn refused_as_not_covered(
    f: Fixture,
    pg: &tokio_postgres::Client,
    mut relay: Relay,
    before: outbox_relay::lsn::Lsn,
) {
    let (status, log) = Fixture::wait_exit(&mut relay, Duration::from_secs(30));
    assert!(!status.success(), "run streamed: {log}");
    assert!(
        log.contains("does not cover") && log.contains(&f.table),
        "{log}"
    );
    let out = f.relay_cmd("check").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("FAIL publication") && l.contains("does not cover")),
        "{stdout}"
    );
    let after = f.confirmed_flush_lsn(pg).await;
    assert_eq!(before, after, "the slot moved while the relay refused");
    f.cleanup().await;
}

/// A publication that lists the partitions by name, and not the table:
/// the relay streams while it covers every one, and stops, before the slot
/// passes it, when a partition is created that it does not list (its rows
/// would never be decoded), naming what to add.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_created_outside_a_publication_of_partitions_stops_the_relay() {
    let mut f = Fixture::with_ddl("newpartition", "", &partitioned()).await;
    let pg = pg_connect().await;
    pg.batch_execute(&format!(
        "ALTER PUBLICATION \"{0}\" SET TABLE public.\"{1}_orders\", public.\"{1}_rest\"",
        f.publication, f.table
    ))
    .await
    .unwrap();
    f.start_consumer().await;
    let relay = f.spawn_relay();
    let first = f.insert(&pg, "order", "o-1", "placed", &json!({})).await;
    f.expect_delivered(&[first], &relay).await;
    let ddl = format!(
        "CREATE TABLE {0}_users PARTITION OF {0} FOR VALUES IN ('account')",
        f.table
    );
    stops_before_a_row_after(
        f,
        &pg,
        relay,
        &ddl,
        "account",
        &["a partition of outbox table", "not in publication"],
    )
    .await;
}

/// After `ddl`, a row of `aggregate_type` (in the partition the DDL left
/// out of the stream), then a row in a published partition and WAL
/// besides: the relay stops, saying each of `said` and the `republish
/// --since` that sends the row, and the slot never passes the row (a
/// relay that did not notice would confirm past it).
async fn stops_before_a_row_after(
    f: Fixture,
    pg: &tokio_postgres::Client,
    mut relay: Relay,
    ddl: &str,
    aggregate_type: &str,
    said: &[&str],
) {
    pg.batch_execute(ddl).await.unwrap();
    // The bound: a position before the row.
    let before: String = pg
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let before: outbox_relay::lsn::Lsn = before.parse().unwrap();
    f.insert(pg, aggregate_type, "u-1", "opened", &json!({}))
        .await;
    f.insert(pg, "order", "o-2", "shipped", &json!({})).await;
    let (status, log) = Fixture::wait_exit(&mut relay, Duration::from_secs(30));
    assert!(!status.success(), "{log}");
    assert!(
        said.iter().all(|s| log.contains(s)) && log.contains("republish --since"),
        "{log}"
    );
    // (The later row may have been published before the relay noticed: the
    // slot is what must not move.)
    let confirmed = f.confirmed_flush_lsn(pg).await;
    assert!(
        confirmed <= before,
        "the slot moved past the row left out of the stream: {confirmed} > {before}"
    );
    f.cleanup().await;
}

/// A partition that writes no WAL: unlogged when `run` starts. A
/// publication of the root covers it (PostgreSQL refuses unlogged tables
/// only where a publication lists them by name), but its rows are never
/// decoded: `run` refuses to stream and `check` fails it, naming the
/// partition, before the slot moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unlogged_partition_is_refused() {
    let f = Fixture::with_ddl("unloggedpart", "", &partitioned()).await;
    let pg = pg_connect().await;
    pg.batch_execute(&format!(
        "CREATE UNLOGGED TABLE {0}_users PARTITION OF {0} FOR VALUES IN ('account')",
        f.table
    ))
    .await
    .unwrap();
    let before = f.confirmed_flush_lsn(&pg).await;
    f.insert(&pg, "account", "u-1", "opened", &json!({})).await;
    f.insert(&pg, "order", "o-1", "placed", &json!({})).await;
    let mut relay = f.spawn_relay();
    let (status, log) = Fixture::wait_exit(&mut relay, Duration::from_secs(30));
    assert!(!status.success(), "run streamed: {log}");
    let partition = format!("{}_users", f.table);
    assert!(
        log.contains("writes no WAL") && log.contains(&partition) && log.contains("SET LOGGED"),
        "{log}"
    );
    let out = f.relay_cmd("check").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stdout.lines().any(|l| l.starts_with("FAIL publication")
            && l.contains(&partition)
            && l.contains("an unlogged table")),
        "{stdout}"
    );
    assert_eq!(
        before,
        f.confirmed_flush_lsn(&pg).await,
        "the slot moved while the relay refused"
    );
    f.cleanup().await;
}

/// A partition set unlogged while the relay streams: the relay stops
/// before the slot passes a row inserted into it, naming the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_set_unlogged_while_streaming_stops_the_relay() {
    let mut f = Fixture::with_ddl("setunlogged", "", &partitioned()).await;
    let pg = pg_connect().await;
    f.start_consumer().await;
    let relay = f.spawn_relay();
    let first = f.insert(&pg, "order", "o-1", "placed", &json!({})).await;
    f.expect_delivered(&[first], &relay).await;
    let ddl = format!("ALTER TABLE {}_rest SET UNLOGGED", f.table);
    let said = ["writes no WAL now", "SET LOGGED"];
    stops_before_a_row_after(f, &pg, relay, &ddl, "customer", &said).await;
}

/// The headers column renamed while streaming: the rows after it go out
/// without their headers (the column is optional), and the relay says so,
/// naming the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_headers_column_renamed_while_streaming_is_said() {
    let mut f = Fixture::new("lostheaders").await;
    let pg = pg_connect().await;
    f.start_consumer().await;
    let relay = f.spawn_relay();
    let first = f.insert(&pg, "order", "o-1", "placed", &json!({})).await;
    f.expect_delivered(&[first], &relay).await;
    pg.batch_execute(&format!(
        "ALTER TABLE {} RENAME COLUMN headers TO meta",
        f.table
    ))
    .await
    .unwrap();
    let second = insert_into(&pg, &f.table, "o-1").await;
    f.expect_delivered(&[second], &relay).await;
    let log = relay.log_text();
    assert!(
        log.contains("lost its headers column") && log.contains("outbox.headers"),
        "{log}"
    );
    relay.stop_ok();
    f.cleanup().await;
}

/// The pid of the walsender streaming the fixture's slot.
async fn fx_walsender(f: &Fixture, pg: &tokio_postgres::Client) -> i32 {
    for _ in 0..100 {
        if let Some(pid) = f.slot_active_pid(pg).await {
            return pid;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no walsender streams {}", f.slot);
}

/// Inserts one order event for `aggregate_id` into `table` (the outbox by
/// another name); returns its id.
async fn insert_into(pg: &tokio_postgres::Client, table: &str, aggregate_id: &str) -> String {
    pg.query_one(
        &format!(
            "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', $1, 'changed', '{{}}') RETURNING id::text"
        ),
        &[&aggregate_id],
    )
    .await
    .unwrap()
    .get(0)
}
