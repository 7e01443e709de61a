//! The producers: each runs its list of transactions on its own
//! connection, reconnecting after a fault. Every outbox event also writes
//! a row of the side record in the same transaction (or subtransaction),
//! so the record holds exactly the events that committed.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio_postgres::Client;

use crate::common::pg_url;
use crate::rng::Rng;
use crate::schedule::{Hostile, Shape, Tx};
use crate::world::{AGGREGATES, World};

/// What a producer saw.
#[derive(Debug, Default)]
pub struct Produced {
    pub committed_txs: usize,
    /// Commits whose outcome the producer could not learn, and transactions
    /// that failed (the record says which committed).
    pub failed_txs: usize,
    pub rolled_back_txs: usize,
    /// When each event of a small committed transaction was committed
    /// (commit-to-delivery latency).
    pub committed_at: HashMap<String, Instant>,
    /// Ids of hostile rows (the only ones that may be dead-lettered).
    pub hostile: Vec<String>,
    pub last_error: Option<String>,
}

/// One event to write: (table index or None for a logical message,
/// aggregate type, aggregate id, headers SQL expression).
struct Event {
    id: String,
    table: Option<usize>,
    aggregate_type: String,
    aggregate_id: String,
    headers: String,
}

pub struct Producer<'a> {
    world: &'a World,
    name: String,
    rng: Rng,
    pg: Option<Client>,
    out: Produced,
    /// Unique per transaction, for prepared transactions' gids.
    n: u64,
}

impl<'a> Producer<'a> {
    pub fn new(world: &'a World, index: usize, seed: u64) -> Producer<'a> {
        Producer {
            world,
            name: format!("p{index}"),
            rng: Rng::new(seed ^ (0x5eed_0000 + index as u64)),
            pg: None,
            out: Produced::default(),
            n: 0,
        }
    }

    /// Runs `txs`; once `written` (events of every producer) reaches
    /// `cap`, only those of the first round (`first`).
    pub async fn run(
        mut self,
        txs: &[(u32, Tx)],
        written: Arc<AtomicU64>,
        cap: u64,
        first: bool,
    ) -> Produced {
        for (pause, tx) in txs {
            if !first && written.load(Ordering::SeqCst) >= cap {
                break;
            }
            written.fetch_add(u64::from(tx.events()), Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(u64::from(*pause))).await;
            let pg = match self.pg.take() {
                Some(c) if !c.is_closed() => c,
                _ => match tokio::time::timeout(Duration::from_secs(5), pg_connect_try()).await {
                    Ok(Ok(c)) => c,
                    _ => {
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        continue;
                    }
                },
            };
            self.n += 1;
            let started = Instant::now();
            let result = tokio::time::timeout(Duration::from_secs(60), self.one(&pg, tx)).await;
            match result {
                Ok(Ok(Some(ids))) => {
                    self.out.committed_txs += 1;
                    for id in ids {
                        self.out.committed_at.insert(id, Instant::now());
                    }
                }
                Ok(Ok(None)) => self.out.rolled_back_txs += 1,
                Ok(Err(e)) => {
                    self.out.failed_txs += 1;
                    self.out.last_error = Some(e.to_string());
                    let _ = pg.batch_execute("ROLLBACK").await;
                }
                Err(_) => {
                    self.out.failed_txs += 1;
                    self.out.last_error = Some(format!("no answer in {:?}", started.elapsed()));
                    continue; // the connection is dropped
                }
            }
            self.pg = Some(pg);
        }
        self.out
    }

    fn event(&mut self, hostile: Option<Hostile>) -> Event {
        let w = self.world;
        let r = &mut self.rng;
        let id = format!(
            "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            r.next_u64() as u32,
            r.next_u64() as u16,
            r.next_u64() & 0xfff,
            r.next_u64() & 0xfff,
            r.next_u64() & 0xffff_ffff_ffff
        );
        let table = match w.shape {
            Shape::Multi => Some(r.below(2) as usize),
            Shape::Messages if hostile.is_none() && r.one_in(2) => None,
            _ => Some(0),
        };
        let mut e = Event {
            id,
            table,
            aggregate_type: w.aggregate_type(r.below(3) as usize),
            aggregate_id: format!("a{}", r.below(AGGREGATES)),
            headers: "NULL".into(),
        };
        match hostile {
            None => {}
            Some(Hostile::Cc) => {
                e.headers = r#"'{"CC": ["victim.cc"], "BCC": ["victim.cc"]}'"#.into()
            }
            Some(Hostile::ForgedHeaders) => {
                e.headers = r#"'{"x-outbox-error": "forged", "x-outbox-attempts": 99}'"#.into()
            }
            Some(Hostile::HugeHeaders) => {
                e.headers = "jsonb_build_object('big', repeat('x', 3000000))".into()
            }
            Some(Hostile::NewlineId) => e.aggregate_id = format!("a0\nforged: {}", e.id),
            Some(Hostile::MissingExchange) => e.aggregate_type = format!("{}_ghost", w.p),
            Some(Hostile::EmptyExchange) => e.aggregate_type = String::new(),
        }
        e
    }

    /// The statement that writes `e` and its record row.
    fn write_sql(&self, e: &Event) -> String {
        let w = self.world;
        let q = |s: &str| format!("'{}'", s.replace('\'', "''"));
        let payload = format!(
            "jsonb_build_object('by', {}, 'id', {})",
            q(&self.name),
            q(&e.id)
        );
        match e.table {
            Some(t) => format!(
                "WITH e AS (INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, headers) \
                 VALUES ({id}::uuid, {ty}, {agg}, 'e', {payload}, {headers}) RETURNING id::text, aggregate_type || '/' || aggregate_id) \
                 INSERT INTO {rec} SELECT * FROM e",
                t = w.tables[t],
                id = q(&e.id),
                ty = q(&e.aggregate_type),
                agg = q(&e.aggregate_id),
                headers = e.headers,
                rec = w.record,
            ),
            None => format!(
                "WITH m AS (SELECT pg_logical_emit_message(true, {prefix}, jsonb_build_object('id', {id}, \
                 'aggregate_type', {ty}, 'aggregate_id', {agg}, 'event_type', 'e', 'payload', {payload})::text) AS l) \
                 INSERT INTO {rec} SELECT {id}, {ty} || '/' || {agg} FROM m",
                prefix = q(&w.prefix),
                id = q(&e.id),
                ty = q(&e.aggregate_type),
                agg = q(&e.aggregate_id),
                rec = w.record,
            ),
        }
    }

    /// `n` events' statements, and their ids.
    fn events(&mut self, n: u32) -> (String, Vec<String>) {
        let mut sql = String::new();
        let mut ids = Vec::new();
        for _ in 0..n {
            let e = self.event(None);
            sql.push_str(&self.write_sql(&e));
            sql.push_str(";\n");
            ids.push(e.id);
        }
        (sql, ids)
    }

    /// Runs one transaction: the ids it committed, None if it rolled back.
    async fn one(
        &mut self,
        pg: &Client,
        tx: &Tx,
    ) -> Result<Option<Vec<String>>, tokio_postgres::Error> {
        let w = self.world;
        match *tx {
            Tx::Commit(n) => {
                let (sql, ids) = self.events(n);
                pg.batch_execute(&format!("BEGIN;\n{sql}COMMIT")).await?;
                Ok(Some(ids))
            }
            Tx::Slow { events, delay } => {
                let (sql, ids) = self.events(events);
                pg.batch_execute(&format!("BEGIN;\n{sql}")).await?;
                tokio::time::sleep(Duration::from_millis(u64::from(delay))).await;
                pg.batch_execute("COMMIT").await?;
                Ok(Some(ids))
            }
            Tx::Rollback(n) => {
                let (sql, _) = self.events(n);
                pg.batch_execute(&format!("BEGIN;\n{sql}ROLLBACK")).await?;
                Ok(None)
            }
            Tx::SavepointRollback(n, m) | Tx::SavepointRelease(n, m) => {
                let (a, mut ids) = self.events(n);
                let (b, inner) = self.events(m);
                let (c, after) = self.events(n);
                let end = if matches!(tx, Tx::SavepointRelease(..)) {
                    ids.extend(inner);
                    "RELEASE SAVEPOINT s"
                } else {
                    "ROLLBACK TO SAVEPOINT s"
                };
                ids.extend(after);
                pg.batch_execute(&format!("BEGIN;\n{a}SAVEPOINT s;\n{b}{end};\n{c}COMMIT"))
                    .await?;
                Ok(Some(ids))
            }
            Tx::Exception(n, m) => {
                let (a, mut ids) = self.events(n);
                let (b, _) = self.events(m);
                let (c, after) = self.events(n);
                ids.extend(after);
                pg.batch_execute(&format!(
                    "DO $chk$ BEGIN\n{a}BEGIN\n{b}RAISE EXCEPTION 'undo';\nEXCEPTION WHEN raise_exception THEN NULL;\nEND;\n{c}END $chk$"
                ))
                .await?;
                Ok(Some(ids))
            }
            Tx::Prepared {
                events,
                commit,
                delay,
            } => {
                let (sql, ids) = self.events(events);
                let gid = format!("{}_{}_{}", w.p, self.name, self.n);
                pg.batch_execute(&format!("BEGIN;\n{sql}PREPARE TRANSACTION '{gid}'"))
                    .await?;
                tokio::time::sleep(Duration::from_millis(u64::from(delay))).await;
                let end = if commit { "COMMIT" } else { "ROLLBACK" };
                // The prepared transaction outlives the connection (and a
                // restart): finish it from wherever.
                let mut last = None;
                for _ in 0..50 {
                    let r = match pg.batch_execute(&format!("{end} PREPARED '{gid}'")).await {
                        Ok(()) => Ok(()),
                        Err(_) if !pg.is_closed() => {
                            pg.batch_execute(&format!("{end} PREPARED '{gid}'")).await
                        }
                        Err(e) => Err(e),
                    };
                    match r {
                        Ok(()) => return Ok(commit.then_some(ids)),
                        Err(e) => last = Some(e),
                    }
                    if let Ok(c) = pg_connect_try().await
                        && c.batch_execute(&format!("{end} PREPARED '{gid}'"))
                            .await
                            .is_ok()
                    {
                        return Ok(commit.then_some(ids));
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(last.expect("tried"))
            }
            Tx::Big(n) => {
                let t = w.tables[0].clone();
                // Over two aggregate types, so over two partitions of a
                // partitioned outbox: one transaction's rows share their
                // created_at there, and partitions filling in step share
                // ctids (what a resumed recovery must tell apart).
                let k = self.rng.below(2) as usize;
                let (ty0, ty1) = (w.aggregate_type(k), w.aggregate_type(1 - k));
                let salt = self.rng.next_u64();
                pg.batch_execute(&format!(
                    "WITH e AS (INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload) \
                     SELECT md5('{salt}-' || g)::uuid, CASE WHEN g % 2 = 0 THEN '{ty0}' ELSE '{ty1}' END, \
                     'a' || (g % {AGGREGATES}), 'big', jsonb_build_object('g', g) \
                     FROM generate_series(1, {n}) g RETURNING id::text, aggregate_type || '/' || aggregate_id) \
                     INSERT INTO {rec} SELECT * FROM e",
                    rec = w.record
                ))
                .await?;
                Ok(Some(Vec::new()))
            }
            Tx::Unpublished(n) => {
                let (sql, ids) = self.events(1);
                pg.batch_execute(&format!(
                    "BEGIN;\nINSERT INTO {} SELECT generate_series(1, {n});\n{sql}COMMIT",
                    w.bulk
                ))
                .await?;
                Ok(Some(ids))
            }
            Tx::Hostile(h) => {
                let e = self.event(Some(h));
                self.out.hostile.push(e.id.clone());
                pg.batch_execute(&self.write_sql(&e)).await?;
                Ok(Some(vec![e.id]))
            }
        }
    }
}

pub async fn pg_connect_try() -> Result<Client, tokio_postgres::Error> {
    let (client, conn) = tokio_postgres::connect(&pg_url(), tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    Ok(client)
}
