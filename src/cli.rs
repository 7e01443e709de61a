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
        #[arg(long, default_value_t = 60)]
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
            | Command::Republish { config: c, .. } => &c.config,
        }
    }
}

/// `run`: returns the final confirmed LSN (`None`: stopped before or
/// between sessions).
pub async fn run(
    cfg: &Config,
    shutdown: CancellationToken,
    metrics: &crate::metrics::Metrics,
) -> Result<Option<Lsn>, RelayError> {
    relay::run(cfg, shutdown, metrics).await
}

/// `setup`: prints what it did.
pub async fn setup(cfg: &Config) -> Result<(), SourceError> {
    let client = connect_sql(&cfg.postgres).await?;
    let report = slot::setup(&client, cfg).await?;
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
    println!(
        "replication slot {}: {}",
        cfg.postgres.slot,
        said(report.created_slot)
    );
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
    /// PID of the walsender streaming from it.
    pub active_pid: Option<i32>,
    /// Whether a walsender is streaming from it.
    pub active: bool,
    /// `safe_wal_size`: bytes that can still be written before the slot is
    /// in danger of losing WAL (null when unlimited).
    pub safe_wal_size: Option<i64>,
    /// The relay's recorded checkpoint, if any.
    pub checkpoint: Option<crate::source::checkpoint_table::Recorded>,
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
        active_pid: info.as_ref().and_then(|i| i.active_pid),
        active: info.as_ref().is_some_and(|i| i.active_pid.is_some()),
        safe_wal_size,
        checkpoint,
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
    Ok(())
}

/// `recover`.
pub async fn recover(cfg: &Config, dry_run: bool, overlap_secs: u64) -> Result<(), RelayError> {
    use crate::recover::RecoverOutcome;
    match crate::recover::recover(cfg, dry_run, overlap_secs).await? {
        RecoverOutcome::Healthy(info) => println!(
            "slot {} is healthy (wal_status {}); nothing to recover",
            cfg.postgres.slot,
            info.wal_status.unwrap_or_else(|| "-".into())
        ),
        RecoverOutcome::Republished {
            since,
            rows,
            first_last,
            dry_run,
        } => {
            let verb = if dry_run {
                "would re-publish"
            } else {
                "re-published"
            };
            println!("{verb} {rows} outbox rows created since {since}");
            if let Some((first, last)) = first_last {
                println!("first {first}, last {last}");
            }
            if dry_run {
                println!("(dry run: slot not recreated, nothing published)");
            } else {
                println!(
                    "slot {} recreated; start `outbox-relay run`",
                    cfg.postgres.slot
                );
            }
        }
    }
    Ok(())
}

/// `republish`.
pub async fn republish(cfg: &Config, sel: crate::recover::Selection) -> Result<(), RelayError> {
    let client = connect_sql(&cfg.postgres).await?;
    let events = crate::recover::select_events(&client, cfg, &sel).await?;
    if let crate::recover::Selection::Ids(ids) = &sel {
        if events.len() < ids.len() {
            eprintln!(
                "outbox-relay: {} of {} ids not found in {}",
                ids.len() - events.len(),
                ids.len(),
                cfg.outbox.table
            );
        }
    }
    let n = crate::recover::publish_all(cfg, &events).await?;
    println!("re-published {n} events");
    Ok(())
}
