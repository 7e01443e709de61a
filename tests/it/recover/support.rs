//! What the recovery tests share (`tests/it/recover.rs`): a slot made lost
//! for real, and its `wal_status`.

use super::common::*;

/// Makes the slot's WAL go away: a tiny `max_slot_wal_keep_size`, WAL written
/// past it, checkpoints. Restores the setting afterwards.
pub async fn lose_slot(fx: &Fixture, pg: &tokio_postgres::Client) {
    // One statement per call: ALTER SYSTEM refuses to run in the implicit
    // transaction of a multi-statement query.
    for sql in [
        "ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'",
        "SELECT pg_reload_conf()",
    ] {
        pg.batch_execute(sql).await.unwrap();
    }
    let noise = fx.scoped("noise");
    pg.batch_execute(&format!("CREATE TABLE {noise} (pad text)"))
        .await
        .unwrap();
    let mut lost = false;
    for _ in 0..40 {
        for sql in [
            format!(
                "INSERT INTO {noise} SELECT repeat(md5(g::text), 30) FROM generate_series(1, 20000) g"
            ),
            "SELECT pg_switch_wal()".to_owned(),
            "CHECKPOINT".to_owned(),
        ] {
            pg.batch_execute(&sql).await.unwrap();
        }
        if wal_status(fx, pg).await.as_deref() == Some("lost") {
            lost = true;
            break;
        }
    }
    for sql in [
        "ALTER SYSTEM RESET max_slot_wal_keep_size".to_owned(),
        "SELECT pg_reload_conf()".to_owned(),
        format!("DROP TABLE {noise}"),
    ] {
        pg.batch_execute(&sql).await.unwrap();
    }
    assert!(lost, "could not invalidate the slot");
}

/// The fixture's slot's `wal_status` (`lost` once its WAL is gone).
pub async fn wal_status(fx: &Fixture, pg: &tokio_postgres::Client) -> Option<String> {
    fx.slot_column(pg, "wal_status").await
}
