//! More shapes of outbox on one slot: several `[[outbox]]` tables, and the
//! table-less outbox (`pg_logical_emit_message`). One slot, one ordered
//! stream: events of a transaction that spans tables (and messages) are
//! published in the order they were written.

use crate::common;
mod support;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_tables_on_one_slot_survive_kill9_in_order() {
    let mut fx = Fixture::new("tables3").await;
    let mut pg = pg_connect().await;
    let (a, b, c) = (
        fx.table.clone(),
        format!("{}_b", fx.table),
        format!("{}_c", fx.table),
    );
    create_table(&pg, &b).await;
    create_table(&pg, &c).await;
    set_outboxes(
        &fx,
        "",
        "",
        &format!(
            "[[outbox]]\ntable = \"public.{a}\"\n\n[[outbox]]\ntable = \"public.{b}\"\n\n\
             [[outbox]]\ntable = \"public.{c}\"\n"
        ),
    );
    let said = fx.relay_ok("setup", &[]);
    assert!(
        said.contains(&b) && said.contains(&c),
        "setup added: {said}"
    );
    fx.start_consumer().await;
    let relay = fx.spawn_relay();

    // Interleaved and mixed transactions: each spans 1..4 events over the
    // three tables and six aggregates; one in five rolls back.
    let tables = [a.clone(), b.clone(), c.clone()];
    let producer = tokio::spawn(async move {
        let mut rng = XorShift::new(15);
        let (mut committed, mut rolled_back) = (Vec::new(), Vec::new());
        let mut seqs = HashMap::new();
        for _ in 0..300 {
            let n = 1 + rng.below(4);
            let events: Vec<(Into, String)> = (0..n)
                .map(|_| {
                    let t = tables[rng.below(3) as usize].clone();
                    (Into::Table(t), format!("agg{}", rng.below(6)))
                })
                .collect();
            let commit = rng.below(5) != 0;
            let w = write_tx(&mut pg, &events, &mut seqs, commit).await;
            if commit {
                committed.extend(w);
            } else {
                rolled_back.extend(w);
            }
            tokio::time::sleep(Duration::from_millis(4)).await;
        }
        (committed, rolled_back)
    });

    let mut got = fx.drain_for(Duration::from_millis(1200)).await;
    assert!(
        !got.is_empty(),
        "nothing before the kill:\n{}",
        relay.log_tail()
    );
    relay.kill9();
    got.extend(fx.drain_for(Duration::from_millis(300)).await);
    let relay = fx.spawn_relay();
    let (committed, rolled_back) = producer.await.unwrap();
    let seen = count_by_id(&got);
    let left: Vec<String> = (committed.iter())
        .filter(|w| !seen.contains_key(&w.id))
        .map(|w| w.id.clone())
        .collect();
    got.extend(
        fx.collect_until(
            &left,
            Duration::from_secs(60),
            Duration::from_secs(1),
            Some(&relay),
        )
        .await,
    );
    let per_table: Vec<usize> = [&a, &b, &c]
        .iter()
        .map(|t| committed.iter().filter(|w| &&w.into == t).count())
        .collect();
    assert!(per_table.iter().all(|&n| n > 0), "{per_table:?}");
    let dups = check(&committed, &rolled_back, &got);
    println!(
        "three tables: {} committed, {} rolled back, {} deliveries, {dups} duplicates ({per_table:?})",
        committed.len(),
        rolled_back.len(),
        got.len()
    );
    relay.stop_ok();
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_added_to_the_config_is_picked_up_after_setup_and_a_restart() {
    let mut fx = Fixture::new("addtable").await;
    let pg = pg_connect().await;
    let b = format!("{}_b", fx.table);
    create_table(&pg, &b).await;
    fx.grant_to_relay(&pg, &b).await;
    fx.start_consumer().await;
    let insert = |t: &str, agg: &str| {
        format!(
            "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', '{agg}', 'placed', '{{}}') RETURNING id::text"
        )
    };
    let relay = fx.spawn_relay();
    let a1: String = pg
        .query_one(&insert(&fx.table, "a"), &[])
        .await
        .unwrap()
        .get(0);
    // Not an outbox yet: not published, and never streamed (the
    // publication decides as of each change's WAL position).
    let early_b: String = pg.query_one(&insert(&b, "b"), &[]).await.unwrap().get(0);
    fx.expect_delivered(std::slice::from_ref(&a1), &relay).await;
    relay.stop_ok();

    set_outboxes(
        &fx,
        "",
        "",
        &format!(
            "[[outbox]]\ntable = \"public.{}\"\n\n[[outbox]]\ntable = \"public.{b}\"\n",
            fx.table
        ),
    );
    let said = fx.relay_ok("setup", &[]);
    assert!(said.contains(&format!("added public.{b}")), "{said}");
    let relay = fx.spawn_relay();
    let b1: String = pg.query_one(&insert(&b, "b"), &[]).await.unwrap().get(0);
    let a2: String = pg
        .query_one(&insert(&fx.table, "a"), &[])
        .await
        .unwrap()
        .get(0);
    let got = fx
        .collect_until(
            &[b1.clone(), a2.clone()],
            Duration::from_secs(30),
            Duration::from_secs(1),
            Some(&relay),
        )
        .await;
    assert!(
        !got.iter().any(|r| r.message_id() == early_b),
        "a row written before its table was published arrived"
    );
    // What was written before: `republish --table` sends it on purpose.
    fx.relay_ok(
        "republish",
        &["--table", &format!("public.{b}"), "--id", &early_b],
    );
    fx.expect_delivered(std::slice::from_ref(&early_b), &relay)
        .await;
    // --table names one of the config's tables, or is refused.
    let out = fx
        .relay_cmd("republish")
        .args(["--table", "public.no_such", "--id", &early_b])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not one of the outbox tables"));
    relay.stop_ok();
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_less_messages_and_rows_arrive_in_wal_order() {
    let mut fx = Fixture::new("messages").await;
    let prefix = fx.scoped("events");
    let dlx = fx.scoped("dlx");
    fx.declare_bound(&dlx, Some(&fx.scoped("dlq")), "#").await;
    set_outboxes(
        &fx,
        &format!("dead_letter_exchange = \"{dlx}\""),
        "heartbeat_secs = 1",
        &format!(
            "[[outbox]]\ntable = \"public.{}\"\n\n[[outbox]]\nsource = \"message\"\n\
             prefix = \"{prefix}\"\n",
            fx.table
        ),
    );
    fx.relay_ok("setup", &[]);
    fx.start_consumer().await;
    let mut dlq = fx.consume(&fx.scoped("dlq")).await;
    let relay = fx.spawn_relay_env(&[("OUTBOX_RELAY_LOG_FORMAT", "json")]);
    let addr = relay.http_addr().await;
    let mut pg = pg_connect().await;

    // Rows and messages in the same transactions, same aggregates.
    let mut rng = XorShift::new(16);
    let (mut committed, mut rolled_back) = (Vec::new(), Vec::new());
    let mut seqs = HashMap::new();
    for _ in 0..120 {
        let n = 1 + rng.below(4);
        let events: Vec<(Into, String)> = (0..n)
            .map(|_| {
                let into = if rng.below(2) == 0 {
                    Into::Table(fx.table.clone())
                } else {
                    Into::Message(prefix.clone())
                };
                (into, format!("agg{}", rng.below(4)))
            })
            .collect();
        let commit = rng.below(4) != 0;
        let w = write_tx(&mut pg, &events, &mut seqs, commit).await;
        if commit {
            committed.extend(w);
        } else {
            rolled_back.extend(w);
        }
    }
    assert!(committed.iter().any(|w| w.into == "message"));
    assert!(rolled_back.iter().any(|w| w.into == "message"));
    // Not transactional: skipped (it may belong to a transaction that
    // rolls back); another application's prefix: ignored.
    pg.execute(
        "SELECT pg_logical_emit_message(false, $1, '{\"id\": \"nontx\"}')",
        &[&prefix],
    )
    .await
    .unwrap();
    pg.execute(
        "SELECT pg_logical_emit_message(true, 'someone-else', '{\"id\": \"other\"}')",
        &[],
    )
    .await
    .unwrap();
    // Two malformed ones in one transaction: dead-lettered with the
    // reason, each named by its own WAL position (what the emit returns).
    let tx = pg.transaction().await.unwrap();
    let mut bad_at = Vec::new();
    for content in ["this is not json", "{\"payload\": 1}"] {
        let at: String = tx
            .query_one(
                "SELECT pg_logical_emit_message(true, $1, $2::text)::text",
                &[&prefix, &content],
            )
            .await
            .unwrap()
            .get(0);
        bad_at.push(format!("lsn-{at}"));
    }
    tx.commit().await.unwrap();
    let last = write_tx(
        &mut pg,
        &[(Into::Message(prefix.clone()), "agg0".into())],
        &mut seqs,
        true,
    )
    .await;
    committed.extend(last);

    let ids: Vec<String> = committed.iter().map(|w| w.id.clone()).collect();
    // Settle past two heartbeats: they must not be published.
    let got = fx
        .collect_until(
            &ids,
            Duration::from_secs(60),
            Duration::from_secs(3),
            Some(&relay),
        )
        .await;
    let dups = check(&committed, &rolled_back, &got);
    let m = got
        .iter()
        .find(|r| r.message_id().starts_with("m-"))
        .expect("a message event");
    assert_eq!(
        m.json()["aggregate"],
        m.header_str("aggregate_id").unwrap().as_str()
    );
    assert_eq!(
        m.properties.content_type().as_ref().map(|c| c.as_str()),
        Some("application/json")
    );
    let mut dead = Vec::new();
    for _ in 0..2 {
        dead.push(
            tokio::time::timeout(Duration::from_secs(10), dlq.recv())
                .await
                .expect("the malformed messages dead-lettered")
                .unwrap(),
        );
    }
    let why = dead[0].header_str("x-outbox-error").unwrap_or_default();
    assert!(
        why.contains("not a JSON object") && why.contains(&prefix),
        "{why}"
    );
    assert_eq!(&dead[0].body[..], b"this is not json");
    let why = dead[1].header_str("x-outbox-error").unwrap_or_default();
    assert!(why.contains("\"id\" field is missing"), "{why}");
    // Each named by its own WAL position (stable on replay), never by a
    // name they share.
    let ids: Vec<String> = dead.iter().map(|d| d.message_id()).collect();
    assert_eq!(ids, bad_at);
    assert!(
        relay.log_text().contains("non-transactional"),
        "the skip is logged"
    );
    let (_, metrics) = http_get(&addr, "/metrics").await;
    assert_eq!(
        sample(&metrics, "outbox_relay_skipped_messages_total"),
        1.0,
        "the skip is counted"
    );
    println!(
        "rows and messages: {} committed ({} messages), {} deliveries, {dups} duplicates",
        committed.len(),
        committed.iter().filter(|w| w.into == "message").count(),
        got.len()
    );
    relay.stop_ok();
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_and_status_cover_every_outbox() {
    let fx = Fixture::new("chk_outboxes").await;
    let pg = pg_connect().await;
    let b = format!("{}_b", fx.table);
    // A second outbox without the payload column the config names.
    pg.batch_execute(&format!(
        "CREATE TABLE {b} (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), aggregate_type text, \
         aggregate_id text, event_type text, body jsonb, created_at timestamptz DEFAULT now())"
    ))
    .await
    .unwrap();
    set_outboxes(
        &fx,
        "",
        "",
        &format!(
            "[[outbox]]\ntable = \"public.{}\"\n\n[[outbox]]\ntable = \"public.{b}\"\n\n\
             [[outbox]]\nsource = \"message\"\nprefix = \"audit\"\n",
            fx.table
        ),
    );
    fx.relay_ok("setup", &[]);
    let out = fx.relay_cmd("check").output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(1), "{said}");
    let line = |start: &str| {
        said.lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no line starting {start:?}:\n{said}"))
            .to_owned()
    };
    let publication = line(&format!("ok publication {:?}", fx.publication));
    assert!(
        publication.contains(&fx.table) && publication.contains(&b),
        "{publication}"
    );
    assert!(line(&format!("ok outbox table public.{}", fx.table)).contains("columns"));
    let failed = line(&format!("FAIL outbox table public.{b}"));
    assert!(failed.contains("outbox[1].payload"), "{failed}");
    let table_less = line("warn outbox outbox[2]");
    assert!(
        table_less.contains("lost slot") && table_less.contains("recover"),
        "{table_less}"
    );
    // The harness's server is stock: PUBLIC may emit logical messages, so
    // anyone who can connect could forge table-less events. The warning
    // names every overload the server has (17 added a `flush` argument to
    // each).
    let pg = pg_connect().await;
    let overloads: String = pg
        .query_one(
            "SELECT string_agg(oid::regprocedure::text, ', ' ORDER BY oid) FROM pg_proc \
             WHERE proname = 'pg_logical_emit_message'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let emit = line("warn who may write table-less events");
    let each: Vec<&str> = overloads.split(", ").collect();
    assert_eq!(each.len(), 2, "{overloads}");
    for o in &each {
        assert!(
            emit.contains(&format!("REVOKE EXECUTE ON FUNCTION {o} FROM PUBLIC")),
            "{o} not in: {emit}"
        );
    }
    // Every overload revoked (as the warning says), `check` says so; the
    // grants are put back at once (other tests' relays emit heartbeats).
    pg.batch_execute(&format!(
        "REVOKE EXECUTE ON FUNCTION {overloads} FROM PUBLIC"
    ))
    .await
    .unwrap();
    let again = fx.relay_cmd("check").output().unwrap();
    pg.batch_execute(&format!("GRANT EXECUTE ON FUNCTION {overloads} TO PUBLIC"))
        .await
        .unwrap();
    let again = String::from_utf8_lossy(&again.stdout).into_owned();
    assert!(
        again.contains("ok who may write table-less events"),
        "{again}"
    );
    let out = fx.relay_cmd("status").output().unwrap();
    let status = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && status.contains("table-less outboxes  audit"),
        "{status}"
    );
    let out = fx.relay_cmd("status").arg("--json").output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["table_less_prefixes"], serde_json::json!(["audit"]));
    fx.cleanup().await;
}

/// `recover` and `prune` over every outbox at once: after the slot is
/// lost, the rows of both tables written meanwhile are re-published, and
/// the table-less outbox's are said to be lost (they were never stored);
/// `prune` then deletes the old confirmed rows of both tables, and only
/// those.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recover_and_prune_cover_every_table() {
    let mut fx = Fixture::new("recoverall").await;
    let mut pg = pg_connect().await;
    let (a, b) = (fx.table.clone(), format!("{}_b", fx.table));
    create_table(&pg, &b).await;
    fx.grant_to_relay(&pg, &b).await;
    let prefix = fx.scoped("events");
    // A checkpoint table of its own: prune weighs every slot's row, and
    // refuses while any slot's recovery is under way (another test's, on a
    // shared table).
    let checkpoint = format!("public.ckpt_{}", fx.name);
    set_outboxes(
        &fx,
        "",
        &format!("checkpoint_table = \"{checkpoint}\""),
        &format!(
            "[[outbox]]\ntable = \"public.{a}\"\n\n[[outbox]]\ntable = \"public.{b}\"\n\n\
             [[outbox]]\nsource = \"message\"\nprefix = \"{prefix}\"\n"
        ),
    );
    fx.relay_ok("setup", &[]);
    // As `sql/role.sql` grants the relay's role the checkpoint table.
    if let Some(role) = &fx.relay_role {
        pg.batch_execute(&format!(
            "GRANT SELECT, INSERT, UPDATE ON {checkpoint} TO \"{}\"",
            role.name
        ))
        .await
        .unwrap();
    }
    fx.start_consumer().await;
    let mut seqs = HashMap::new();
    let one_each = |tag: &str| {
        vec![
            (Into::Table(a.clone()), format!("{tag}-a")),
            (Into::Table(b.clone()), format!("{tag}-b")),
            (Into::Message(prefix.clone()), format!("{tag}-m")),
        ]
    };
    let relay = fx.spawn_relay();
    let old = write_tx(&mut pg, &one_each("old"), &mut seqs, true).await;
    let old_ids: Vec<String> = old.iter().map(|w| w.id.clone()).collect();
    fx.expect_delivered(&old_ids, &relay).await;
    tokio::time::sleep(Duration::from_millis(1500)).await; // the checkpoint
    relay.stop_ok();

    // While no relay runs: one event into each outbox; then the slot goes.
    let down = write_tx(&mut pg, &one_each("down"), &mut seqs, true).await;
    fx.drop_slot(&pg).await;
    let out = fx.relay_cmd("recover").output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "recover: {said}");
    assert!(
        said.contains("LOST") && said.contains(&prefix),
        "recover did not say the table-less events are lost: {said}"
    );
    let relay = fx.spawn_relay();
    let (rows, message): (Vec<&Written>, Vec<&Written>) =
        down.iter().partition(|w| w.into != "message");
    let row_ids: Vec<String> = rows.iter().map(|w| w.id.clone()).collect();
    assert_eq!(row_ids.len(), 2);
    let got = fx
        .collect_until(
            &row_ids,
            Duration::from_secs(30),
            Duration::from_secs(1),
            Some(&relay),
        )
        .await;
    assert!(
        !got.iter().any(|r| r.message_id() == message[0].id),
        "a table-less event from before the slot was recreated arrived"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await; // the checkpoint
    relay.stop_ok();

    // The first rows of both tables made old (an UPDATE is not published).
    for (t, w) in [(&a, &old[0]), (&b, &old[1])] {
        pg.execute(
            &format!("UPDATE {t} SET created_at = now() - interval '2 days' WHERE id::text = $1"),
            &[&w.id],
        )
        .await
        .unwrap();
    }
    let said = fx.relay_ok("prune", &["--older-than", "1d"]);
    for t in [&a, &b] {
        assert!(
            said.contains(&format!("deleted 1 rows of public.{t} ")),
            "{said}"
        );
        let left: Vec<String> = pg
            .query(&format!("SELECT id::text FROM {t}"), &[])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        let want = down.iter().find(|w| w.into == *t).unwrap();
        assert_eq!(left, std::slice::from_ref(&want.id), "{t}");
    }
    fx.cleanup().await;
}

/// Three outboxes that each name their own exchange need no
/// `rabbitmq.exchange`: `setup`, `check` and `run` all work without it,
/// and each outbox's events reach its exchange.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outboxes_with_their_own_exchanges_need_no_global_one() {
    let mut fx = Fixture::new("ownexchanges").await;
    let pg = pg_connect().await;
    let (b, c) = (format!("{}_b", fx.table), format!("{}_c", fx.table));
    create_table(&pg, &b).await;
    create_table(&pg, &c).await;
    let (xb, xc) = (fx.scoped("xb"), fx.scoped("xc"));
    fx.declare_bound(&xb, Some(&fx.queue), "#").await;
    fx.declare_bound(&xc, Some(&fx.queue), "#").await;
    set_outboxes(
        &fx,
        "",
        "",
        &format!(
            "[[outbox]]\ntable = \"public.{}\"\nexchange = \"{}\"\n\n\
             [[outbox]]\ntable = \"public.{b}\"\nexchange = \"{xb}\"\n\n\
             [[outbox]]\ntable = \"public.{c}\"\nexchange = \"{xc}\"\n",
            fx.table, fx.exchange
        ),
    );
    let global = format!("exchange = \"{}\"\nrouting_key", fx.exchange);
    let text = std::fs::read_to_string(&fx.config).unwrap();
    assert!(text.contains(&global), "{text}");
    std::fs::write(&fx.config, text.replace(&global, "routing_key")).unwrap();

    fx.relay_ok("setup", &[]);
    let out = fx.relay_cmd("check").output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    for x in [&fx.exchange, &xb, &xc] {
        assert!(
            said.contains(&format!("ok exchange {x:?}")),
            "{x}:\n{said}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(!said.contains("FAIL"), "{said}");
    fx.start_consumer().await;
    let relay = fx.spawn_relay();
    let mut ids = Vec::new();
    for t in [fx.table.clone(), b.clone(), c.clone()] {
        let id: String = pg
            .query_one(
                &format!(
                    "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload) \
                     VALUES ('order', '1', 'placed', '{{}}') RETURNING id::text"
                ),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        ids.push(id);
    }
    fx.expect_delivered(&ids, &relay).await;
    relay.stop_ok();
    for t in [&b, &c] {
        pg.batch_execute(&format!("DROP TABLE IF EXISTS {t}"))
            .await
            .unwrap();
    }
    fx.cleanup().await;
}
