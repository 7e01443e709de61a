//! Re-publishing outbox rows from the table itself: `recover` after a lost
//! slot, `republish` on purpose.
//!
//! # A recovery that can be re-run
//!
//! `recover` records its window in the checkpoint table *before* it
//! recreates the slot, then re-publishes the window's rows in the order of
//! the outbox's `sequence` column, or else `(created_at, tableoid, ctid)` (see
//! [`rows::Key`]), recording the last confirmed row about once a second.
//! Whatever stops it half way (the broker gone, an undeliverable row,
//! SIGINT), the record stays: running `recover` again, or `run`,
//! resumes after the last confirmed row, and only a complete pass clears it.
//! Rows committed after the slot was made are streamed by `run`; rows in
//! both are delivered twice, never zero times.
//!
//! # The window
//!
//! A row's `created_at` is usually its transaction's start, so a row that
//! committed after the last checkpoint may carry an older time. With
//! `track_commit_timestamp` on, the window also takes every row committed
//! since the checkpoint (`pg_xact_commit_timestamp(xmin)`), exactly. With it
//! off, the overlap before the checkpoint is at least the longest
//! transaction the relay has seen (see [`crate::source::longest_tx`]) plus
//! its sampling interval.

mod in_flight;
pub(crate) mod prune;
pub(crate) mod publish;
pub(crate) mod rows;

use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

pub use publish::Published;
pub use rows::{Key, Selection};

use crate::config::Config;
use crate::error::RelayError;
use crate::sink::refusals::{Refusals, learn};
use crate::sink::replies::Disposition;
use crate::source::checkpoint_table::{self, Recovery};
use crate::source::coverage::Snapshot;
use crate::source::slot::{self, SlotInfo};
use crate::source::{SourceError, bound_lock_waits, bounded, connect_sql, sql_err};

/// Added to the longest transaction seen: it may have gone on for up to a
/// sampling interval after the last sample, and shorter ones go unseen.
pub const LONGEST_TX_MARGIN_SECS: f64 = 10.0;

/// What `recover` found and did.
#[derive(Debug)]
pub enum RecoverOutcome {
    /// The slot is fine and no recovery is under way: nothing to do.
    Healthy(SlotInfo),
    /// Rows that were (or, with `--dry-run`, would be) re-published.
    Republished {
        /// The window, in words (its start, and how it was chosen).
        window: String,
        /// Rows the window selects now (after the resume point, if any).
        selected: i64,
        /// What was done (`None` for a dry run).
        published: Option<Published>,
        /// A recovery recorded earlier was resumed.
        resumed: bool,
    },
}

/// Whether the server records commit timestamps.
async fn commit_timestamps(client: &Client, cfg: &Config) -> Result<bool, SourceError> {
    let row = client
        .query_one(
            "SELECT current_setting('track_commit_timestamp') = 'on'",
            &[],
        )
        .await
        .map_err(sql_err(&cfg.postgres, "reading track_commit_timestamp"))?;
    Ok(row.get(0))
}

/// The window of a new recovery, from the checkpoint.
async fn new_window(
    client: &Client,
    cfg: &Config,
    overlap_secs: u64,
    commit_ts: bool,
) -> Result<(Recovery, String), RelayError> {
    let checkpoint = checkpoint_table::read(client, cfg).await?;
    let Some(c) = checkpoint.filter(|c| c.last_commit_time_us.is_some()) else {
        return Err(SourceError::Setup(format!(
            "no checkpoint recorded for slot {:?} in {}; choose the rows yourself with \
             `outbox-relay republish --since TIME`, after `outbox-relay setup` recreates the slot",
            cfg.postgres.slot, cfg.postgres.checkpoint_table
        ))
        .into());
    };
    let longest = c.longest_tx_secs.unwrap_or(0.0);
    let (overlap, how) = if commit_ts {
        (
            overlap_secs as f64,
            "rows created, or committed (track_commit_timestamp is on), since".to_owned(),
        )
    } else {
        let sized = (longest + LONGEST_TX_MARGIN_SECS).ceil();
        let overlap = (overlap_secs as f64).max(sized);
        (
            overlap,
            format!(
                "rows created since (track_commit_timestamp is off: the overlap is the larger \
                 of --overlap-secs and the longest transaction seen, {longest:.0} s, plus \
                 {LONGEST_TX_MARGIN_SECS:.0} s)"
            ),
        )
    };
    let since_us = c.last_commit_time_us.unwrap_or(0) - (overlap * 1e6) as i64;
    let since: String = client
        .query_one(
            "SELECT to_timestamp($1::float8 / 1e6)::text",
            &[&(since_us as f64)],
        )
        .await
        .map_err(sql_err(&cfg.postgres, "computing the recovery start"))?
        .get(0);
    let window = format!(
        "{how} {since}: the checkpoint's commit time {} minus {overlap:.0} s",
        c.last_commit_time.as_deref().unwrap_or("?")
    );
    Ok((
        Recovery {
            since,
            after: None,
            done: 0,
        },
        window,
    ))
}

/// `recover`: when the slot is missing or lost (or a recovery is under
/// way), record the window, recreate the slot, and re-publish the window's
/// rows; resumable (see the module docs).
pub async fn recover(
    cfg: &Config,
    dry_run: bool,
    overlap_secs: u64,
    stop: &CancellationToken,
) -> Result<RecoverOutcome, RelayError> {
    let busy = || {
        SourceError::Setup(format!(
            "another `outbox-relay recover` (or a `run` finishing a recovery) is working on \
             slot {:?}; wait for it",
            cfg.postgres.slot
        ))
        .into()
    };
    recover_with(cfg, dry_run, overlap_secs, stop, busy).await
}

/// `run`'s own recovery of a lost slot (`postgres.on_slot_lost =
/// "recover"`), with `recover`'s default overlap. Another process
/// recovering the slot is the slot being busy: the caller waits, as a
/// standby relay does.
pub async fn recover_lost_slot(
    cfg: &Config,
    stop: &CancellationToken,
) -> Result<RecoverOutcome, RelayError> {
    let busy = || {
        SourceError::SlotBusy {
            slot: cfg.postgres.slot.clone(),
            pid: 0,
        }
        .into()
    };
    recover_with(cfg, false, DEFAULT_OVERLAP_SECS, stop, busy).await
}

/// `recover`'s default `--overlap-secs`.
pub const DEFAULT_OVERLAP_SECS: u64 = 60;

async fn recover_with(
    cfg: &Config,
    dry_run: bool,
    overlap_secs: u64,
    stop: &CancellationToken,
    busy: impl FnOnce() -> RelayError,
) -> Result<RecoverOutcome, RelayError> {
    let client = connect_sql(&cfg.postgres).await?;
    if !dry_run && lock_recovery(&client, cfg).await.is_err() {
        return Err(busy());
    }
    let info = slot::slot_info(&client, cfg).await?;
    let pending = checkpoint_table::pending_recovery(&client, cfg).await?;
    let slot_ok = |i: &Option<SlotInfo>| {
        i.as_ref()
            .is_some_and(|i| i.wal_status.as_deref() != Some("lost"))
    };
    if pending.is_none() && slot_ok(&info) {
        return Ok(RecoverOutcome::Healthy(info.expect("checked")));
    }
    let commit_ts = commit_timestamps(&client, cfg).await?;
    let (mut recovery, mut window, resumed) = match pending {
        Some(r) => {
            let w = format!("rows of the recovery recorded earlier, since {}", r.since);
            (r, w, true)
        }
        None => {
            let (r, w) = new_window(&client, cfg, overlap_secs, commit_ts).await?;
            (r, w, false)
        }
    };
    if !slot_ok(&info) && recovery.after.is_some() {
        // Lost again while the recovery was under way: rows committed after
        // the last slot was made may sort before the resume point. Start
        // the window over.
        recovery.after = None;
        recovery.done = 0;
        window.push_str(" (the slot was lost again: from the start)");
    }
    let sel = window_selection(&recovery, commit_ts);
    let selected = rows::count(&client, cfg, &sel, &rows::tables(cfg, None)?).await?;
    if dry_run {
        return Ok(RecoverOutcome::Republished {
            window,
            selected,
            published: None,
            resumed,
        });
    }
    // The window is durable before the slot is made: whatever happens
    // next, a re-run finds it.
    client
        .batch_execute(&format!(
            "BEGIN; SET LOCAL client_min_messages = warning; {}; COMMIT",
            checkpoint_table::create_sql(cfg)
        ))
        .await
        .map_err(sql_err(
            &cfg.postgres,
            "updating the checkpoint table (run `outbox-relay setup`)",
        ))?;
    checkpoint_table::set_recovery(&client, cfg, Some(&recovery)).await?;
    info!(%window, rows = selected, "recovery recorded");
    if !resumed {
        // Its window starts at the checkpoint, before any change the
        // coverage could have missed, and its rows are read after this:
        // the tables as they are now are covered (a change from now on is
        // found by the next start).
        let keys = table_keys(cfg, &rows::tables(cfg, None)?);
        snapshot(&client, cfg)
            .await?
            .acknowledge(&client, cfg, &keys, None)
            .await?;
    }
    if !slot_ok(&info) {
        // New slot first: every commit after its creation is streamed by
        // `run`; every row visible now is re-published here.
        if info.is_some() {
            client
                .execute("SELECT pg_drop_replication_slot($1)", &[&cfg.postgres.slot])
                .await
                .map_err(sql_err(&cfg.postgres, "dropping the lost slot"))?;
        }
        slot::setup(&client, cfg).await?;
        info!(slot = %cfg.postgres.slot, "replication slot recreated");
        let table_less: Vec<&str> = cfg.outboxes.iter().filter_map(|o| o.prefix()).collect();
        if !table_less.is_empty() {
            tracing::error!(
                prefixes = %table_less.join(", "),
                since = %recovery.since,
                "the table-less outboxes' events written since the last checkpoint are LOST with \
                 the slot: they were never stored in a table, so nothing can re-publish them \
                 (PostgreSQL 17 failover slots and a generous max_slot_wal_keep_size guard \
                 against this; see README, High availability)"
            );
        }
    }
    let published = finish(cfg, &client, recovery, commit_ts, selected, stop).await?;
    unfinished(&published, selected, stop)?;
    Ok(RecoverOutcome::Republished {
        window,
        selected,
        published: Some(published),
        resumed,
    })
}

fn window_selection(r: &Recovery, commit_ts: bool) -> Selection {
    Selection::Window {
        since: r.since.clone(),
        commit_ts,
        after: r.after.clone(),
    }
}

/// Re-publishes what is left of `recovery`, recording progress through
/// `book`; clears the record once every row is confirmed. A refusal the
/// stream would route around (a missing templated exchange, the broker's
/// body limit, a message it keeps refusing) is learnt as the stream learns
/// it, and the publish resumes after the last confirmed row.
async fn finish(
    cfg: &Config,
    book: &Client,
    mut recovery: Recovery,
    commit_ts: bool,
    selected: i64,
    stop: &CancellationToken,
) -> Result<Published, RelayError> {
    let mut refusals = Refusals::default();
    let mut total = Published::default();
    let done_before = recovery.done;
    loop {
        let mut reader = connect_sql(&cfg.postgres).await?;
        let sel = window_selection(&recovery, commit_ts);
        let mut rows = rows::Rows::open(&mut reader, cfg, &sel, &rows::tables(cfg, None)?).await?;
        let (base, since) = (recovery.done, recovery.since.clone());
        let save = |p: Published| {
            let r = Recovery {
                since: since.clone(),
                after: p.last.map(|k| k.to_record()),
                done: base + p.confirmed as i64,
            };
            async move {
                if r.after.is_none() {
                    return;
                }
                if let Err(e) = checkpoint_table::set_recovery(book, cfg, Some(&r)).await {
                    warn!(error = %e, "cannot record the recovery's progress; a re-run repeats more rows");
                }
            }
        };
        let left = selected - (recovery.done - done_before);
        let publish::Pass { done, failed, head } =
            publish::publish_rows(cfg, &mut rows, Some(left), &mut refusals, stop, save).await;
        drop(rows);
        total.confirmed += done.confirmed;
        total.sent += done.sent;
        if let Some(k) = done.last.clone() {
            total.last = Some(k.clone());
            recovery.after = Some(k.to_record());
        }
        recovery.done += done.confirmed as i64;
        let e = match failed {
            None => {
                total.complete = done.complete;
                break;
            }
            Some(RelayError::Sink(e)) => e,
            Some(other) => return Err(other),
        };
        if let Some(fatal) = learn(cfg, &e, head, &mut refusals) {
            return Err(fatal.into());
        }
        if !matches!(
            e.disposition(),
            Disposition::MissingExchange(_) | Disposition::BodyLimit(_) | Disposition::HeadOfWindow
        ) {
            return Err(RelayError::Sink(e));
        }
        warn!(error = %e, confirmed = recovery.done, "re-publishing again after the last confirmed row");
    }
    if total.complete {
        checkpoint_table::set_recovery(book, cfg, None).await?;
        info!(rows = recovery.done, "recovery complete");
    }
    Ok(total)
}

/// One recovery at a time per slot (`recover` and `run`s finishing it):
/// a session-level advisory lock on `client`, held until it disconnects.
async fn lock_recovery(client: &Client, cfg: &Config) -> Result<(), RelayError> {
    let got: bool = client
        .query_one(
            "SELECT pg_try_advisory_lock(hashtext('outbox-relay recovery'), hashtext($1))",
            &[&cfg.postgres.slot],
        )
        .await
        .map_err(sql_err(&cfg.postgres, "locking the recovery"))?
        .get(0);
    if got {
        return Ok(());
    }
    Err(SourceError::SlotBusy {
        slot: cfg.postgres.slot.clone(),
        pid: 0,
    }
    .into())
}

/// For `run`: finishes a recovery under way, if any. `Ok(false)`: `stop`
/// stopped it before the end (the record stays). A pass that ends without
/// a stop and without every row confirmed is an error, never `Ok`.
pub async fn finish_pending(cfg: &Config, stop: &CancellationToken) -> Result<bool, RelayError> {
    let client = connect_sql(&cfg.postgres).await?;
    // Every start reads this: these reads are bounded (here, and their
    // lock waits on the server), so a checkpoint table someone holds
    // locked (a migration, `VACUUM FULL`) costs a logged retry, not a
    // silent hang. (Counting and publishing the rows, below, may take as
    // long as they take.)
    bound_lock_waits(&client, &cfg.postgres, true).await?;
    let pending = checkpoint_table::pending_recovery(&client, cfg);
    if bounded("reading the checkpoint", pending).await?.is_none() {
        return Ok(true);
    }
    // Only the relay that may stream the slot finishes its recovery (a
    // standby waits, as for streaming), and only one (the lock). A server
    // still in recovery (an address that points at a standby during a
    // failover) has no slot yet, and is no proof the slot was lost: it
    // fails here, as it fails the stream, and is retried.
    let server = crate::source::resume::server(&client, &cfg.postgres);
    bounded("identifying the server", server).await?;
    bounded("reading the slot", slot::usable_slot(&client, cfg)).await?;
    lock_recovery(&client, cfg).await?;
    // Finished by another meanwhile?
    let pending = checkpoint_table::pending_recovery(&client, cfg);
    let Some(recovery) = bounded("reading the checkpoint", pending).await? else {
        return Ok(true);
    };
    info!(since = %recovery.since, done = recovery.done, "finishing the recovery recorded earlier");
    let commit_ts = bounded(
        "reading track_commit_timestamp",
        commit_timestamps(&client, cfg),
    )
    .await?;
    bound_lock_waits(&client, &cfg.postgres, false).await?;
    let sel = window_selection(&recovery, commit_ts);
    let selected = rows::count(&client, cfg, &sel, &rows::tables(cfg, None)?).await?;
    let done = finish(cfg, &client, recovery, commit_ts, selected, stop).await?;
    unfinished(&done, selected, stop)?;
    Ok(done.complete)
}

/// A pass that ended by itself with rows unconfirmed: an error (the record
/// stays, and the next `run` or `recover` resumes it).
fn unfinished(done: &Published, selected: i64, stop: &CancellationToken) -> Result<(), RelayError> {
    if done.complete || stop.is_cancelled() {
        return Ok(());
    }
    Err(RelayError::Interrupted(format!(
        "the recovery ended with {} of {selected} rows confirmed; it is recorded: \
         `outbox-relay run` or `outbox-relay recover` resumes it",
        done.confirmed
    )))
}

/// What `republish` did.
#[derive(Debug)]
pub struct Republished {
    /// Rows the selection took.
    pub selected: i64,
    /// What was sent and confirmed.
    pub published: Published,
    /// Tables dropped and created again (or whose publication changed)
    /// since the relay last ran that this `republish` did not cover, each
    /// with the `--since` it needs: the relay refuses to start until then.
    pub unacknowledged: Vec<(String, String)>,
}

/// `republish`: the selected rows of every outbox table (or of the one
/// `table` names), table by table in their order (see [`rows::Key`]).
pub async fn republish(
    cfg: &Config,
    sel: &Selection,
    table: Option<&str>,
    stop: &CancellationToken,
) -> Result<Republished, RelayError> {
    let tables = rows::tables(cfg, table)?;
    let mut client = connect_sql(&cfg.postgres).await?;
    // Before any row is read: a change after this is not covered by them.
    let hold = snapshot(&client, cfg).await?;
    let names: Vec<String> = (tables.iter())
        .filter_map(|&i| Some(cfg.outboxes[i].table()?.quoted()))
        .collect();
    in_flight::wait_for_writers(&client, &cfg.postgres, &names, stop).await?;
    let selected = rows::count(&client, cfg, sel, &tables).await?;
    let mut rows = rows::Rows::open(&mut client, cfg, sel, &tables).await?;
    let mut refusals = Refusals::default();
    let pass = publish::publish_rows(
        cfg,
        &mut rows,
        Some(selected),
        &mut refusals,
        stop,
        |_| async {},
    )
    .await;
    drop(rows);
    if let Some(e) = pass.failed {
        return Err(e);
    }
    let published = pass.done;
    let mut unacknowledged = Vec::new();
    if let Selection::Since { since, until: None } = sel
        && published.complete
    {
        let keys = table_keys(cfg, &tables);
        unacknowledged = hold.acknowledge(&client, cfg, &keys, Some(since)).await?;
    }
    Ok(Republished {
        selected,
        published,
        unacknowledged,
    })
}

/// What the publication holds of the outbox tables now (see
/// `source::coverage`): read before rows are, for [`Snapshot::acknowledge`]
/// once they are sent.
async fn snapshot(client: &Client, cfg: &Config) -> Result<Snapshot, RelayError> {
    let mut oids = Vec::with_capacity(cfg.outboxes.len());
    for outbox in &cfg.outboxes {
        oids.push(slot::outbox_oids(client, cfg, outbox, None).await?);
    }
    Ok(Snapshot::read(client, cfg, &oids).await?)
}

/// The config keys of the outbox `tables` (indices into the config).
fn table_keys(cfg: &Config, tables: &[usize]) -> Vec<String> {
    (tables.iter())
        .map(|&i| cfg.outboxes[i].key_of("table"))
        .collect()
}
