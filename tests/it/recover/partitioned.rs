//! Resuming a recovery of a partitioned outbox (`tests/it/recover.rs`): its
//! partitions hand out the same ctids, and one transaction's rows share
//! `created_at`, so a resume key without the partition ties with rows of
//! the other partitions and skips them.

use std::time::{Duration, Instant};

use super::common::*;

/// The default outbox table in three partitions by `event_type`: one
/// statement inserting `e1, e2, e3, e1, ...` fills them in step, giving
/// their rows the same ctids.
fn three_way_ddl() -> String {
    partitioned_ddl(
        "event_type",
        "CREATE TABLE {table}_1 PARTITION OF {table} FOR VALUES IN ('e1');
CREATE TABLE {table}_2 PARTITION OF {table} FOR VALUES IN ('e2');
CREATE TABLE {table}_3 PARTITION OF {table} DEFAULT;",
    )
}

/// A checkpointed fixture on the three-way table.
async fn three_way(test: &str) -> (Fixture, tokio_postgres::Client) {
    let mut fx = Fixture::with_ddl(test, "", &three_way_ddl()).await;
    let pg = fx.checkpointed().await;
    (fx, pg)
}

/// One transaction of `n` rows written after the checkpoint, then the slot
/// dropped: the rows `recover` must re-publish, as `(id, event_type)`
/// (their partition). `aggregate_type`: an SQL expression of the row's
/// number `g` (row `g` goes to partition `g % 3 + 1`).
async fn one_large_transaction(
    fx: &Fixture,
    pg: &tokio_postgres::Client,
    n: i64,
    aggregate_type: &str,
) -> Vec<(String, String)> {
    let rows = pg
        .query(
            &format!(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) \
                 SELECT {aggregate_type}, 'a' || g / 3, 'e' || (g % 3 + 1), \
                 jsonb_build_object('g', g) FROM generate_series(0, $1::int8 - 1) g \
                 RETURNING id::text, event_type",
                fx.table
            ),
            &[&n],
        )
        .await
        .unwrap();
    // Set-up: the partitions did fill in step (but for the checkpointed
    // fixture's first row, in the default partition).
    let tied: i64 = pg
        .query_one(
            &format!(
                "SELECT count(*) FROM (SELECT ctid FROM {} GROUP BY created_at, ctid \
                 HAVING count(*) = 3) t",
                fx.table
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(tied * 10 >= n / 3 * 9, "set-up: only {tied} ctids shared");
    fx.drop_slot(pg).await;
    rows.iter().map(|r| (r.get(0), r.get(1))).collect()
}

/// `window = 1` (each row confirmed before the next is sent, so a stop
/// leaves the resume key at a known row), and any other `[rabbitmq]`
/// lines; `exchange`, if given, replaces the fixture's exchange.
fn configure(fx: &Fixture, extra: &str, exchange: Option<&str>) {
    fx.set_config_extra(&format!("window = 1\n{extra}"), "");
    if let Some(exchange) = exchange {
        let text = std::fs::read_to_string(&fx.config).unwrap();
        let line = format!("exchange = \"{}\"", fx.exchange);
        assert!(text.contains(&line), "{text}");
        let text = text.replace(&line, &format!("exchange = \"{exchange}\""));
        std::fs::write(&fx.config, text).unwrap();
    }
}

/// One large transaction into a three-way partitioned outbox, `recover`
/// interrupted (SIGINT) four times half way and run again: every row
/// arrives.
/// With `(created_at, ctid)` as the key, each resume skipped the rows of
/// the other partitions that tie with the last confirmed one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_recovery_of_a_partitioned_outbox_skips_no_row() {
    let _serial = super::SERIAL.lock().await;
    let (mut fx, pg) = three_way("rec_part_int").await;
    let ids = one_large_transaction(&fx, &pg, 30000, "'p'").await;
    configure(&fx, "", None);
    let mut done_before = 0i64;
    // On a fast machine the last rounds may finish the rest between two
    // progress records (about a second): the rounds before were the
    // interruptions, and the recovery is complete.
    let mut finished = false;
    for round in 0..4 {
        let mut rec = fx.spawn_subcommand("recover", &[]);
        // Progress is recorded about once a second: stop once it moved.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let done: Option<i64> = fx.checkpoint_column(&pg, "recovery_done").await;
            if done.is_some_and(|d| d > done_before) {
                break;
            }
            if round > 0 && !rec.is_running() {
                finished = true;
                break;
            }
            assert!(
                rec.is_running() && Instant::now() < deadline,
                "round {round}: no progress recorded before the end:\n{}",
                rec.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if !finished {
            signal(rec.pid(), "INT");
        }
        let (status, log) = Fixture::wait_exit(&mut rec, Duration::from_secs(30));
        if round > 0 && status.success() && log.contains("recovery complete") {
            finished = true;
            break;
        }
        assert!(
            !finished && !status.success() && log.contains("recovery stopped after"),
            "round {round}: set-up: recover was not interrupted half way ({status}):\n{log}"
        );
        done_before = fx
            .checkpoint_column::<Option<i64>>(&pg, "recovery_done")
            .await
            .unwrap_or_default();
        assert!(done_before < ids.len() as i64, "round {round}: all done");
    }
    if !finished {
        let said = fx.relay_ok("recover", &[]);
        assert!(said.contains("recovery complete"), "{said}");
    }
    let want: Vec<String> = ids.into_iter().map(|(id, _)| id).collect();
    fx.collect_until(&want, Duration::from_secs(120), Duration::ZERO, None)
        .await;
    fx.cleanup().await;
}

/// The refusal path: a templated exchange (`{aggregate_type}`) that is
/// missing for one partition's rows stops the publish at the first row of
/// each missing name; the recovery learns it and resumes after the last
/// confirmed row. Every row of the other partitions arrives, and every row
/// of that one is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_during_a_partitioned_recovery_skips_no_row() {
    let _serial = super::SERIAL.lock().await;
    let (mut fx, pg) = three_way("rec_part_ref").await;
    // The third partition's first rows each name an exchange of their own:
    // each costs a refusal, and a resume.
    let (there, missing) = (&fx.exchange, fx.scoped("missing"));
    let kind =
        format!("CASE WHEN g % 3 = 2 THEN '{missing}_' || least(g / 3, 8) ELSE '{there}' END");
    let ids = one_large_transaction(&fx, &pg, 600, &kind).await;
    let dlx = fx.scoped("dlx");
    fx.declare_bound(&dlx, Some(&fx.scoped("dlq")), "#").await;
    let mut dlq = fx.consume(&fx.scoped("dlq")).await;
    configure(
        &fx,
        &format!("dead_letter_exchange = \"{dlx}\""),
        Some("{aggregate_type}"),
    );
    let said = fx.relay_ok("recover", &[]);
    assert!(said.contains("recovery complete"), "{said}");
    let (dead, delivered): (Vec<_>, Vec<_>) = ids.into_iter().partition(|(_, e)| e == "e3");
    let delivered: Vec<String> = delivered.into_iter().map(|(id, _)| id).collect();
    fx.collect_until(&delivered, Duration::from_secs(60), Duration::ZERO, None)
        .await;
    let mut want: std::collections::HashSet<String> = dead.into_iter().map(|(id, _)| id).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !want.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, dlq.recv()).await {
            Ok(Some(r)) => {
                want.remove(&r.message_id());
            }
            _ => panic!("{} rows neither delivered nor dead-lettered", want.len()),
        }
    }
    fx.cleanup().await;
}
