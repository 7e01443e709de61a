//! The `outbox-relay` binary: parse, load config, set up logging, run, map
//! errors to exit codes (0 ok, 1 runtime failure, 2 bad configuration).

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use outbox_relay::cli::{self, Cli, Command, LogFormat};
use outbox_relay::config::Config;
use outbox_relay::metrics::Metrics;
use tokio_util::sync::CancellationToken;

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("OUTBOX_RELAY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        // Row-derived text cannot start a log line of its own.
        .with_writer(|| outbox_relay::logtext::OneLine(std::io::stderr()));
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

/// First SIGINT/SIGTERM: graceful stop. Second: exit at once.
fn install_signals(token: CancellationToken) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    tokio::spawn(async move {
        for round in 0.. {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            if round == 0 {
                tracing::info!("signal received; draining (send again to exit at once)");
                token.cancel();
            } else {
                tracing::warn!("second signal; exiting without draining");
                std::process::exit(130);
            }
        }
    });
    Ok(())
}

async fn run(cfg: &Config) -> anyhow::Result<()> {
    let token = CancellationToken::new();
    install_signals(token.clone())?;
    let metrics = Metrics::new();
    let addr = outbox_relay::http::serve(cfg.http.listen, metrics.clone(), token.clone()).await?;
    tracing::info!(%addr, "serving /metrics /healthz /readyz");
    match cli::run(cfg, token, &metrics).await? {
        Some(lsn) => println!("final confirmed LSN {lsn}"),
        None => println!("stopped before streaming; the slot keeps its position"),
    }
    Ok(())
}

/// One thread: the relay is a single ordered pipeline (WAL in, messages out)
/// waiting on two sockets, and the publishing task writes its own socket.
/// Worker threads only added cross-thread wake-ups between the replication
/// reader and the publisher (`make bench`: about 13% less CPU per event).
#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let cfg = match Config::load(cli.command.config_path()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("outbox-relay: configuration error: {e}");
            return ExitCode::from(2);
        }
    };
    let result: anyhow::Result<()> = match &cli.command {
        Command::Run(_) => run(&cfg).await,
        Command::Setup(_) => cli::setup(&cfg).await.map_err(anyhow::Error::from),
        Command::Check(_) => return outbox_relay::check::run(&cfg).await,
        Command::Status { json, .. } => cli::status(&cfg, *json).await.map_err(anyhow::Error::from),
        Command::Recover {
            dry_run,
            overlap_secs,
            ..
        } => {
            let stop = CancellationToken::new();
            match install_signals(stop.clone()) {
                Ok(()) => cli::recover(&cfg, *dry_run, *overlap_secs, &stop)
                    .await
                    .map_err(anyhow::Error::from),
                Err(e) => Err(e),
            }
        }
        Command::Prune {
            older_than,
            batch,
            dry_run,
            table,
            ..
        } => {
            let stop = CancellationToken::new();
            match install_signals(stop.clone()) {
                Ok(()) => cli::prune(&cfg, *older_than, *batch, *dry_run, table.as_deref(), &stop)
                    .await
                    .map_err(anyhow::Error::from),
                Err(e) => Err(e),
            }
        }
        Command::Republish {
            ids,
            since,
            until,
            table,
            ..
        } => {
            let sel = match since {
                Some(since) => outbox_relay::recover::Selection::Since {
                    since: since.clone(),
                    until: until.clone(),
                },
                None => outbox_relay::recover::Selection::Ids(ids.clone()),
            };
            let stop = CancellationToken::new();
            match install_signals(stop.clone()) {
                Ok(()) => cli::republish(&cfg, sel, table.as_deref(), &stop)
                    .await
                    .map_err(anyhow::Error::from),
                Err(e) => Err(e),
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let text = error_text(&e);
            tracing::error!(error = %text, "stopped");
            // Through the log's writer: an error can carry a server's (or a
            // row's) text, and stays one line.
            let mut err = outbox_relay::logtext::OneLine(std::io::stderr());
            let _ =
                std::io::Write::write_all(&mut err, format!("outbox-relay: {text}\n").as_bytes());
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, as `{:#}` writes them, less each cause whose
/// text the one before it already showed (an error that shows its source,
/// then the source again: "reset by peer: reset by peer").
fn error_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    let mut before = String::new();
    for cause in e.chain() {
        let c = cause.to_string();
        if !before.contains(&c) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&c);
        }
        before = c;
    }
    text
}
