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
            Command::Run(c) | Command::Setup(c) | Command::Status { config: c, .. } => &c.config,
        }
    }
}

/// `run`: returns the final confirmed LSN.
pub async fn run(
    cfg: &Config,
    shutdown: CancellationToken,
    metrics: &crate::metrics::Metrics,
) -> Result<Lsn, RelayError> {
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
}

/// `status`.
pub async fn status(cfg: &Config, json: bool) -> Result<(), SourceError> {
    let client = connect_sql(&cfg.postgres).await?;
    let info = slot::slot_info(&client, cfg).await?;
    let retained: Option<i64> = match &info {
        Some(_) => client
            .query_one(
                "SELECT (pg_current_wal_lsn() - restart_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
                &[&cfg.postgres.slot],
            )
            .await
            .map_err(sql_err(&cfg.postgres, "measuring retained WAL"))?
            .get(0),
        None => None,
    };
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
    }
    Ok(())
}
