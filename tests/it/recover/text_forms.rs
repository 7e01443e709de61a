//! Columns read back from the table come out as the stream sends them
//! (`tests/it/recover.rs`): the text of the type's output function, whatever
//! the type and the server's settings.

use std::time::Duration;

use super::common::*;

/// The default table with its `id` a `char(40)` (a uuid, padded).
fn char_id_ddl() -> String {
    let ddl = std::fs::read_to_string(repo_path("sql/outbox.sql"))
        .unwrap()
        .replace("CREATE TABLE outbox", "CREATE TABLE {table}");
    let changed = ddl.replacen("uuid        PRIMARY KEY", "char(40)    PRIMARY KEY", 1);
    assert_ne!(changed, ddl, "sql/outbox.sql changed its id column");
    changed
}

/// A `char(n)` id is padded in its text form (`bpcharout`), and pgoutput
/// sends it so: the stream's `message_id` has the padding. Read back for
/// `republish` (and `recover`: the same read), it must be the same id,
/// and `republish --id` must find the row by it. (A cast to text drops the
/// padding: the re-published copy had another `message_id`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_char_n_id_gives_one_message_id_streamed_and_read_back() {
    let _serial = super::SERIAL.lock().await;
    let mut fx = Fixture::with_ddl("char_id", "", &char_id_ddl()).await;
    fx.start_consumer().await;
    let pg = pg_connect().await;
    let relay = fx.spawn_relay();
    let padded: String = pg
        .query_one(
            &format!(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ('ok', 'c', 'e', '{{}}') RETURNING rpad(id::text, 40)",
                fx.table
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(padded.ends_with("    "), "{padded:?}");
    let ids = [padded.clone()];
    fx.expect_delivered(&ids, &relay).await;
    relay.stop_ok();
    let said = fx.relay_ok("republish", &["--since", "2000-01-01"]);
    assert!(said.contains("re-published 1 events"), "{said}");
    fx.collect_until(&ids, Duration::from_secs(30), Duration::ZERO, None)
        .await;
    let said = fx.relay_ok("republish", &["--id", &padded]);
    assert!(said.contains("re-published 1 events"), "{said}");
    fx.collect_until(&ids, Duration::from_secs(30), Duration::ZERO, None)
        .await;
    fx.cleanup().await;
}

/// A server whose `bytea_output` is `escape` (`ALTER DATABASE ... SET`,
/// which the walsender's session takes too) sends a bytea payload in the
/// escape format: it must arrive as its bytes, streamed and read back,
/// not be dead-lettered as undecodable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bytea_payload_arrives_when_the_server_s_bytea_output_is_escape() {
    let _serial = super::SERIAL.lock().await;
    let admin = pg_connect().await;
    let db = format!("bytea_escape_{}", std::process::id());
    for sql in [
        format!("CREATE DATABASE {db}"),
        format!("ALTER DATABASE {db} SET bytea_output = 'escape'"),
    ] {
        admin.batch_execute(&sql).await.unwrap();
    }
    let url = pg_url();
    let url = format!("{}/{db}", &url[..url.rfind('/').expect("a database")]);
    let mut fx = Fixture::on_servers("bytea_esc", &url, &[amqp_url()]).await;
    let pg = pg_connect_retry_to(&url).await;
    let output: String = pg.query_one("SHOW bytea_output", &[]).await.unwrap().get(0);
    assert_eq!(output, "escape", "set-up");
    pg.batch_execute(&format!(
        "ALTER TABLE {} ALTER COLUMN payload TYPE bytea USING convert_to(payload::text, 'UTF8')",
        fx.table
    ))
    .await
    .unwrap();
    fx.start_consumer().await;
    let relay = fx.spawn_relay();
    // A zero byte, one over 127, a backslash, then a printable byte.
    let id: String = pg
        .query_one(
            &format!(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ('ok', 'b', 'e', '\\x00ff5c78'::bytea) RETURNING id::text",
                fx.table
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let want: &[u8] = b"\x00\xff\\x";
    let got = fx.expect_delivered(std::slice::from_ref(&id), &relay).await;
    assert_eq!(got.last().unwrap().body, want, "streamed");
    relay.stop_ok();
    fx.relay_ok("republish", &["--id", &id]);
    let got = fx
        .collect_until(&[id], Duration::from_secs(30), Duration::ZERO, None)
        .await;
    assert_eq!(got.last().unwrap().body, want, "read back");
    drop(pg);
    fx.cleanup().await;
    admin
        .batch_execute(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .await
        .unwrap();
}
