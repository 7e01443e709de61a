//! The subcommands: `run`, `setup`, `status`.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::lsn::Lsn;
use crate::relay::{self, RelayError};
use crate::source::{SourceError, connect_sql, slot, sql_err};

/// Command line.
#[derive(Debug, Parser)]
#[command(
    name = "outbox-relay",
    version,
    about = "Relays transactional-outbox rows from a PostgreSQL logical replication slot to RabbitMQ, with publisher confirms"
)]
pub struct Cli {
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true, env = "OUTBOX_RELAY_LOG_FORMAT")]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Log output format.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the relay in the foreground until SIGINT/SIGTERM.
    Run(ConfigArg),
    /// Create the publication and the replication slot (idempotent).
    Setup(ConfigArg),
    /// After a lost slot: recreate it and re-publish the outbox rows written
    /// since the last checkpoint.
    Recover {
        /// Config file.
        #[command(flatten)]
        config: ConfigArg,
        /// Only show what would be re-published.
        #[arg(long)]
        dry_run: bool,
        /// Seconds before the checkpoint's commit time to start from, to
        /// cover rows created earlier but committed later.
        #[arg(long, default_value_t = crate::recover::DEFAULT_OVERLAP_SECS)]
        overlap_secs: u64,
    },
    /// Re-send chosen outbox rows on purpose (same message ids).
    Republish {
        /// Config file.
        #[command(flatten)]
        config: ConfigArg,
        /// Event id to re-send (repeatable).
        #[arg(
            long = "id",
            required_unless_present = "since",
            conflicts_with = "since"
        )]
        ids: Vec<String>,
        /// Re-send rows created at or after this time (e.g. 2026-11-29T10:00:00Z).
        #[arg(long)]
        since: Option<String>,
        /// With --since: only rows created before this time.
        #[arg(long, requires = "since")]
        until: Option<String>,
        /// Only this outbox table (as in the config); default: every one.
        #[arg(long)]
        table: Option<String>,
    },
    /// Delete outbox rows older than an age and behind the last checkpoint
    /// (confirmed, and outside `recover`'s window), in short batches.
    Prune {
        /// Config file.
        #[command(flatten)]
        config: ConfigArg,
        /// Only rows created longer ago than this: 30d, 12h, 90m, 3600s, 2w.
        #[arg(long, value_parser = crate::recover::prune::parse_age)]
        older_than: std::time::Duration,
        /// Rows per transaction.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
        batch: i64,
        /// Only count what would be deleted.
        #[arg(long)]
        dry_run: bool,
        /// Only this outbox table (as in the config); default: every one.
        #[arg(long)]
        table: Option<String>,
    },
    /// Preflight: check the servers and the configuration without changing
    /// anything; one `ok`/`warn`/`FAIL` line per check, exit 1 on any FAIL.
    Check(ConfigArg),
    /// Show the slot's position, retained WAL and activity.
    Status {
        /// Config file.
        #[command(flatten)]
        config: ConfigArg,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// `--config FILE`.
#[derive(Debug, clap::Args)]
pub struct ConfigArg {
    /// Path of the TOML config file.
    #[arg(long, short, env = "OUTBOX_RELAY_CONFIG")]
    pub config: PathBuf,
}

impl Command {
    /// The config file argument.
    pub fn config_path(&self) -> &std::path::Path {
        match self {
            Command::Run(c)
            | Command::Setup(c)
            | Command::Check(c)
            | Command::Status { config: c, .. }
            | Command::Recover { config: c, .. }
            | Command::Republish { config: c, .. }
            | Command::Prune { config: c, .. } => &c.config,
        }
    }
}

/// `run`: returns the final confirmed LSN (`None`: stopped before or
/// between sessions). What it does next at each turn (finish a recovery,
/// recover a lost slot, stream, stand by, stop) is decided in one place,
/// `relay::supervisor`.
pub async fn run(
    cfg: &Config,
    shutdown: CancellationToken,
    metrics: &crate::metrics::Metrics,
) -> Result<Option<Lsn>, RelayError> {
    relay::run(cfg, shutdown, metrics).await
}

/// The refusal to make slot `postgres.slot` again, if a relay has
/// confirmed events from a slot of that name.
async fn streamed_from(
    client: &tokio_postgres::Client,
    cfg: &Config,
) -> Result<Option<SourceError>, SourceError> {
    let row = crate::source::checkpoint_table::read(client, cfg).await?;
    Ok(row.filter(|c| c.last_commit_time.is_some()).map(|c| {
        SourceError::Setup(format!(
            "slot {:?} is gone, but a relay has streamed from a slot of that name (checkpoint \
                 at {}, commit {}, in {}): a slot made now would skip every event committed \
                 since; run `outbox-relay recover`, which makes it again and re-publishes the \
                 outbox rows since the checkpoint (or, to start afresh on purpose, delete that \
                 checkpoint row first)",
            cfg.postgres.slot,
            c.confirmed_lsn,
            c.last_commit_time.as_deref().unwrap_or("-"),
            cfg.postgres.checkpoint_table.quoted()
        ))
    }))
}

/// `setup`: prints what it did.
pub async fn setup(cfg: &Config) -> Result<(), SourceError> {
    let client = connect_sql(&cfg.postgres).await?;
    // A recovery resumes after its last confirmed row only while the slot
    // it made lives: a slot made here would hide that it is gone.
    let missing = slot::slot_info(&client, cfg).await?.is_none();
    if missing
        && crate::source::checkpoint_table::pending_recovery(&client, cfg)
            .await?
            .is_some()
    {
        return Err(SourceError::Setup(format!(
            "a recovery is under way for slot {:?} and the slot is gone: run `outbox-relay \
             recover`, which makes it again and re-publishes the recovery's window from its start",
            cfg.postgres.slot
        )));
    }
    // A relay has confirmed events from a slot of this name (its
    // checkpoint row has a commit time): a new slot starts at the current
    // WAL position, so every event committed since the last confirmed one
    // would never be sent, and `run` could not tell (checker seed
    // 1808600037: setup between a dropped slot and the relay noticing).
    // `recover` re-publishes from that commit. A row without one (no
    // commit confirmed yet) has no window for `recover`: README's remedy
    // there is this `setup` and `republish --since`.
    if missing && let Some(refusal) = streamed_from(&client, cfg).await? {
        return Err(refusal);
    }
    let report = slot::setup(&client, cfg).await?;
    // The slot may have gone between that look and the slot's creation
    // (a drop racing this setup): a slot made now is undone, the same way.
    if report.created_slot
        && let Some(refusal) = streamed_from(&client, cfg).await?
    {
        let undone = client
            .execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                 WHERE slot_name = $1 AND active_pid IS NULL",
                &[&cfg.postgres.slot],
            )
            .await
            .map_err(sql_err(&cfg.postgres, "dropping the slot just made"))?;
        return Err(if undone == 1 {
            refusal
        } else {
            SourceError::Setup(format!(
                "{refusal}; the slot this setup made is already in use: stop the relay, drop it \
                 (SELECT pg_drop_replication_slot('{}')) and run `outbox-relay recover`",
                cfg.postgres.slot
            ))
        });
    }
    let said = |created: bool| {
        if created {
            "created"
        } else {
            "already present"
        }
    };
    println!(
        "publication {}: {}",
        cfg.postgres.publication,
        said(report.created_publication)
    );
    for table in &report.added_tables {
        println!(
            "publication {}: added {table} (its inserts are relayed from now on)",
            cfg.postgres.publication
        );
    }
    println!(
        "replication slot {}: {}",
        cfg.postgres.slot,
        said(report.created_slot)
    );
    if report.made_failover {
        println!(
            "replication slot {}: made a failover slot (a standby with sync_replication_slots \
             = on keeps it through a promotion)",
            cfg.postgres.slot
        );
    }
    if let Some(why) = &report.not_failover {
        println!(
            "replication slot {}: not a failover slot, {why}",
            cfg.postgres.slot
        );
    }
    Ok(())
}

/// The `status --json` document. Field names are a stable interface.
#[derive(Debug, Serialize)]
pub struct Status {
    /// Slot name.
    pub slot: String,
    /// Whether the slot exists.
    pub exists: bool,
    /// `confirmed_flush_lsn`.
    pub confirmed_flush_lsn: Option<String>,
    /// `restart_lsn`.
    pub restart_lsn: Option<String>,
    /// `pg_current_wal_lsn() - restart_lsn`.
    pub retained_wal_bytes: Option<i64>,
    /// `wal_status`.
    pub wal_status: Option<String>,
    /// `invalidation_reason` (17+), if the server invalidated the slot.
    pub invalidation_reason: Option<String>,
    /// `inactive_since` (17+): since when no walsender has used it.
    pub inactive_since: Option<String>,
    /// PID of the walsender streaming from it.
    pub active_pid: Option<i32>,
    /// Whether a walsender is streaming from it.
    pub active: bool,
    /// `safe_wal_size`: bytes that can still be written before the slot is
    /// in danger of losing WAL (null when unlimited).
    pub safe_wal_size: Option<i64>,
    /// The relay's recorded checkpoint, if any.
    pub checkpoint: Option<crate::source::checkpoint_table::Recorded>,
    /// Prefixes of the table-less outboxes: their events exist only in the
    /// WAL the slot retains, so a lost slot loses them.
    pub table_less_prefixes: Vec<String>,
}

/// `status`.
pub async fn status(cfg: &Config, json: bool) -> Result<(), SourceError> {
    let client = connect_sql(&cfg.postgres).await?;
    let info = slot::slot_info(&client, cfg).await?;
    let (retained, safe_wal_size): (Option<i64>, Option<i64>) = match &info {
        Some(_) => {
            let row = client
                .query_one(
                    "SELECT (pg_current_wal_lsn() - restart_lsn)::bigint, safe_wal_size FROM pg_replication_slots WHERE slot_name = $1",
                    &[&cfg.postgres.slot],
                )
                .await
                .map_err(sql_err(&cfg.postgres, "measuring retained WAL"))?;
            (row.get(0), row.get(1))
        }
        None => (None, None),
    };
    let checkpoint = crate::source::checkpoint_table::read(&client, cfg).await?;
    let s = Status {
        slot: cfg.postgres.slot.clone(),
        exists: info.is_some(),
        confirmed_flush_lsn: info
            .as_ref()
            .and_then(|i| i.confirmed_flush_lsn)
            .map(|l| l.to_string()),
        restart_lsn: info
            .as_ref()
            .and_then(|i| i.restart_lsn)
            .map(|l| l.to_string()),
        retained_wal_bytes: retained,
        wal_status: info.as_ref().and_then(|i| i.wal_status.clone()),
        invalidation_reason: info.as_ref().and_then(|i| i.invalidation_reason.clone()),
        inactive_since: info.as_ref().and_then(|i| i.inactive_since.clone()),
        active_pid: info.as_ref().and_then(|i| i.active_pid),
        active: info.as_ref().is_some_and(|i| i.active_pid.is_some()),
        safe_wal_size,
        checkpoint,
        table_less_prefixes: (cfg.outboxes.iter())
            .filter_map(|o| o.prefix().map(str::to_owned))
            .collect(),
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&s).unwrap_or_default());
    } else if !s.exists {
        println!("slot {}: does not exist (run `outbox-relay setup`)", s.slot);
    } else {
        let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
        println!("slot                 {}", s.slot);
        println!("confirmed_flush_lsn  {}", opt(&s.confirmed_flush_lsn));
        println!("restart_lsn          {}", opt(&s.restart_lsn));
        println!(
            "retained WAL         {}",
            s.retained_wal_bytes
                .map_or("-".into(), |b| format!("{b} bytes"))
        );
        println!("wal_status           {}", opt(&s.wal_status));
        if let Some(r) = &s.invalidation_reason {
            println!("invalidated          {r} (run `outbox-relay recover`)");
        }
        if let Some(t) = &s.inactive_since {
            println!("inactive since       {t}");
        }
        println!(
            "active               {}",
            s.active_pid
                .map_or("no".into(), |p| format!("yes (pid {p})"))
        );
        println!(
            "safe_wal_size        {}",
            s.safe_wal_size
                .map_or("unlimited".into(), |b| format!("{b} bytes"))
        );
        match &s.checkpoint {
            Some(c) => println!(
                "checkpoint           {} at commit {} (written {:.0} s ago)",
                c.confirmed_lsn,
                c.last_commit_time.as_deref().unwrap_or("-"),
                c.age_seconds
            ),
            None => println!("checkpoint           none recorded"),
        }
    }
    if !json && !s.table_less_prefixes.is_empty() {
        println!(
            "table-less outboxes  {}: their events exist only in the WAL this slot retains; if \
             the slot is lost they are lost (`recover` re-publishes tables only)",
            s.table_less_prefixes.join(", ")
        );
    }
    Ok(())
}

/// `recover`.
pub async fn recover(
    cfg: &Config,
    dry_run: bool,
    overlap_secs: u64,
    stop: &CancellationToken,
) -> Result<(), RelayError> {
    use crate::recover::RecoverOutcome;
    match crate::recover::recover(cfg, dry_run, overlap_secs, stop).await? {
        RecoverOutcome::Healthy(info) => println!(
            "slot {} is healthy (wal_status {}) and no recovery is under way; nothing to recover",
            cfg.postgres.slot,
            info.wal_status.unwrap_or_else(|| "-".into())
        ),
        RecoverOutcome::Republished {
            window,
            selected,
            published,
            resumed,
        } => {
            if resumed {
                println!("resuming the recovery recorded earlier");
            }
            println!("window: {window}");
            let Some(p) = published else {
                println!("would re-publish {selected} outbox rows");
                println!("(dry run: nothing recorded, slot not recreated, nothing published)");
                return Ok(());
            };
            println!("re-published {} of {selected} outbox rows", p.confirmed);
            if let Some(k) = &p.last {
                println!("last confirmed: created_at {}, id {}", k.created, k.id);
            }
            if !p.complete {
                return Err(RelayError::Interrupted(format!(
                    "recovery stopped after {} of {selected} rows; it is recorded: run \
                     `outbox-relay recover` again (or start `outbox-relay run`) to finish",
                    p.confirmed
                )));
            }
            println!(
                "recovery complete; slot {} is ready: start `outbox-relay run`",
                cfg.postgres.slot
            );
        }
    }
    Ok(())
}

/// `prune`: prints what it deleted (or would) and what it kept.
pub async fn prune(
    cfg: &Config,
    older_than: std::time::Duration,
    batch: i64,
    dry_run: bool,
    table: Option<&str>,
    stop: &CancellationToken,
) -> Result<(), RelayError> {
    let reports =
        crate::recover::prune::prune(cfg, older_than, batch, dry_run, table, stop).await?;
    let verb = if dry_run { "would delete" } else { "deleted" };
    for (table, r) in reports {
        println!(
            "{verb} {} rows of {table} created before {}",
            r.deleted, r.cutoff
        );
        if r.kept > 0 {
            println!(
                "kept {} older rows of {table}: the last checkpoint does not cover them yet (not \
                 confirmed, or inside the window `recover` would re-publish)",
                r.kept
            );
        }
    }
    Ok(())
}

/// `republish`.
pub async fn republish(
    cfg: &Config,
    sel: crate::recover::Selection,
    table: Option<&str>,
    stop: &CancellationToken,
) -> Result<(), RelayError> {
    let crate::recover::Republished {
        selected,
        published: p,
        unacknowledged,
    } = crate::recover::republish(cfg, &sel, table, stop).await?;
    if let crate::recover::Selection::Ids(ids) = &sel
        && (selected as usize) < ids.len()
    {
        let tables: Vec<String> = (cfg.outboxes.iter())
            .filter_map(|o| o.table().map(|t| t.to_string()))
            .collect();
        eprintln!(
            "outbox-relay: {} of {} ids not found in {}",
            ids.len() - selected as usize,
            ids.len(),
            tables.join(", ")
        );
    }
    println!("re-published {} events", p.confirmed);
    if !p.complete {
        return Err(RelayError::Interrupted(format!(
            "stopped after {} of {selected} rows",
            p.confirmed
        )));
    }
    if let Some((_, needs)) = unacknowledged.first() {
        let tables: Vec<String> = (unacknowledged.iter())
            .filter_map(|(key, _)| {
                let o = cfg.outboxes.iter().find(|o| o.key_of("table") == *key)?;
                Some(o.table()?.to_string())
            })
            .collect();
        return Err(crate::source::SourceError::Setup(format!(
            "outbox table {} was dropped and created again (or its publication changed) since \
             the relay last ran, and its rows may date from {needs}, before --since: the relay \
             refuses to start until `outbox-relay republish --since {needs}`{} has run",
            tables.join(", "),
            if cfg.outboxes.len() > 1 && tables.len() == 1 {
                format!(" --table {}", tables[0])
            } else {
                String::new()
            }
        ))
        .into());
    }
    Ok(())
}
