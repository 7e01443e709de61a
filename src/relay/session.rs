//! One replication session: [`Session::connect`] checks the slot and the
//! outbox tables and opens the three connections; [`Session::stream`] runs
//! the two halves of the pipeline and the tasks beside them until one ends
//! the session, then reports the final position and closes.

use std::sync::Arc;
use std::time::Duration;

use pgwire_replication::ReplicationClient;
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::gate::Gate;
use super::side::{Beside, Liveness, liveness, side_tasks};
use super::{CHANNEL_CAPACITY, REPLICATION_BUFFER, bounded};
use crate::checkpoint::Progress;
use crate::config::Config;
use crate::error::RelayError;
use crate::handoff::ByteBudget;
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::outbox::{OutboxDecoder, OutboxOids};
use crate::sink::nodes::Nodes;
use crate::sink::publisher::{self, Publishing};
use crate::sink::refusals::{Head, Refusals};
use crate::sink::{AmqpSink, SinkError};
use crate::source::coverage::{self, Coverage, Seen};
use crate::source::longest_tx::LongestTx;
use crate::source::resume::{self, Server};
use crate::source::silence::{self, Silence};
use crate::source::stream::Stream;
use crate::source::{
    SourceError, StreamLimits, checkpoint_table, connect_sql, slot, slot::usable_slot,
    start_replication,
};

/// What outlives a session: what one learns, the next uses.
pub(super) struct Memory {
    /// Each outbox's relation ids as this process has known them: a RENAME
    /// followed by its relation id stays followed across reconnects.
    known_oids: Vec<Option<OutboxOids>>,
    /// The publication's hold on them that the last session started from.
    seen: Option<Seen>,
    /// What the broker refused in earlier sessions (see `sink::replies`).
    pub(super) refusals: Refusals,
    /// An open transaction is timed from when it was first seen, whatever
    /// reconnects happen meanwhile.
    longest: Arc<tokio::sync::Mutex<LongestTx>>,
    /// The last position confirmed, and on which server: the next session
    /// starts there if the slot lags behind it (see `source::resume`).
    last: Option<resume::Confirmed>,
    /// The broker nodes, tried from after the one whose session failed.
    nodes: Nodes,
}

impl Memory {
    pub(super) fn new(cfg: &Config) -> Self {
        Memory {
            known_oids: vec![None; cfg.outboxes.len()],
            seen: None,
            refusals: Refusals::default(),
            longest: Arc::default(),
            last: None,
            nodes: Nodes::new(&cfg.rabbitmq),
        }
    }
}

/// How a session ended.
pub(super) struct Ended {
    /// The final confirmed LSN (`None`: stopped while connecting), or why
    /// it failed.
    pub result: Result<Option<Lsn>, RelayError>,
    /// It confirmed something past where it started.
    pub progressed: bool,
    /// The oldest unconfirmed event when the publisher failed (see
    /// `sink::refusals::learn`).
    pub head: Option<Head>,
}

/// A session, connected: the slot and the outbox tables checked, the
/// broker and the replication stream open.
pub(super) struct Session {
    sql: Arc<tokio_postgres::Client>,
    /// Where the stream starts (see `source::resume`).
    start: Lsn,
    server: Server,
    oids: Vec<Option<OutboxOids>>,
    coverage: Coverage,
    silence_limit: Duration,
    sinks: Vec<AmqpSink>,
    repl: ReplicationClient,
}

/// Where a session starts, and how far back rows of a table changed later
/// may date.
struct Resume {
    start: Lsn,
    widen_secs: f64,
    /// The coverage the last session (of any process) recorded.
    recorded: Option<Seen>,
}

impl Session {
    /// Connects and streams until the session ends.
    pub(super) async fn run(
        cfg: &Config,
        memory: &mut Memory,
        shutdown: &CancellationToken,
        metrics: &Metrics,
    ) -> Ended {
        // Connecting can take a while (each step has its deadline): a stop
        // asked for meanwhile ends it at once, with nothing in flight.
        let connected = tokio::select! {
            biased;
            _ = shutdown.cancelled() => {
                info!("stopped while connecting");
                Ok(None)
            }
            r = Session::connect(cfg, memory) => r.map(Some),
        };
        match connected {
            Ok(Some(session)) => session.stream(cfg, memory, shutdown, metrics).await,
            Ok(None) => Ended {
                result: Ok(None),
                progressed: false,
                head: None,
            },
            Err(e) => Ended {
                result: Err(e),
                progressed: false,
                head: None,
            },
        }
    }

    /// The slot, the outbox tables, the broker, then the stream.
    async fn connect(cfg: &Config, memory: &mut Memory) -> Result<Session, RelayError> {
        let sql = connect_sql(&cfg.postgres).await?;
        // Everything this connection runs is bounded: so are its waits for
        // a lock on the server.
        crate::source::bound_lock_waits(&sql, &cfg.postgres, true).await?;
        let sql = Arc::new(sql);
        // First: a standby (reached through an address that moved, while a
        // failover is under way) fails here, and is retried; its missing
        // slot is not taken for a lost one.
        let server = bounded(
            "identifying the server",
            resume::server(&sql, &cfg.postgres),
        )
        .await?;
        let resume = resume_point(&sql, cfg, &server, memory).await?;
        let (oids, coverage) = outbox_tables(&sql, cfg, &server, &resume, memory).await?;
        let silence_limit = bounded(
            "reading wal_sender_timeout",
            silence::limit(&sql, &cfg.postgres),
        )
        .await?;
        let sinks = open_broker(cfg, memory).await?;
        // Last, so that a broker that is down costs no walsender. (Its
        // connect has a deadline; an AMQP heartbeat interval above a few
        // seconds outlasts it.)
        let limits = StreamLimits {
            buffer_events: REPLICATION_BUFFER,
            silence_limit,
        };
        let repl = start_replication(&cfg.postgres, resume.start, Some(&server), limits).await?;
        Ok(Session {
            sql,
            start: resume.start,
            server,
            oids,
            coverage,
            silence_limit,
            sinks,
            repl,
        })
    }

    /// Streams: the source half and the sink half joined by the hand-off,
    /// the coverage gate between the sink's watermark and what is
    /// reported, and the tasks beside them.
    async fn stream(
        self,
        cfg: &Config,
        memory: &mut Memory,
        shutdown: &CancellationToken,
        metrics: &Metrics,
    ) -> Ended {
        let Session {
            sql,
            start,
            server,
            oids,
            coverage,
            silence_limit,
            mut sinks,
            mut repl,
        } = self;
        info!(slot = %cfg.postgres.slot, lsn = %start, "streaming from LSN");
        metrics.streaming.set(1);
        metrics.confirmed_lsn.set(start.0);

        let stop = shutdown.child_token();
        let (items_tx, items_rx) = mpsc::channel(CHANNEL_CAPACITY);
        let budget = ByteBudget::default();
        let (wm_tx, wm_rx) = watch::channel(Progress {
            lsn: start,
            commit_time_us: None,
        });
        // What is reported: the watermark, held back to what the outbox
        // tables' coverage vouches for, until the sink has confirmed its
        // last.
        let (reported_tx, mut reported) = watch::channel(*wm_rx.borrow());
        let sink_done = CancellationToken::new();
        let mut decoder = OutboxDecoder::new(&cfg.outboxes, oids);
        let dead_letters = cfg.dead_letters();

        // Tasks on the SQL connection; they end with the session.
        let (probe, alive) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let watch_liveness = tokio::spawn(liveness(Liveness {
            cfg: cfg.clone(),
            sql: Arc::clone(&sql),
            limit: silence_limit,
            probe: Arc::clone(&probe),
            alive: Arc::clone(&alive),
            stop: stop.clone(),
        }));
        let (since_tx, since_rx) = watch::channel(coverage.last_good().to_owned());
        let row_writes = Arc::new(tokio::sync::Mutex::new(()));
        let gated = tokio::spawn(
            Gate {
                cfg: cfg.clone(),
                sql: Arc::clone(&sql),
                coverage,
                since: since_tx,
                row_writes: Arc::clone(&row_writes),
                longest: Arc::clone(&memory.longest),
                watermark: wm_rx,
                reported: reported_tx,
                stop: stop.clone(),
                sink_done: sink_done.clone(),
            }
            .run(),
        );
        let side = tokio::spawn(side_tasks(Beside {
            cfg: cfg.clone(),
            sql,
            longest: Arc::clone(&memory.longest),
            system_id: server.system_id.clone(),
            coverage_since: since_rx,
            row_writes,
            progress: reported.clone(),
            metrics: metrics.clone(),
            stop: stop.clone(),
        }));

        let source = Stream {
            repl: &mut repl,
            decoder: &mut decoder,
            items: items_tx,
            budget: &budget,
            reported: &mut reported,
            silence: Silence::new(silence_limit),
            probe: &probe,
            alive: &alive,
            metrics,
        }
        .run(&stop);
        let publishing = Publishing {
            cfg: &cfg.rabbitmq,
            dead_letters: &dead_letters,
            refusals: &mut memory.refusals,
            budget: &budget,
            start,
            metrics,
        };
        let sink_half = async {
            let r = publisher::run(&mut sinks, items_rx, &wm_tx, publishing, &stop).await;
            // Whatever ends the sink ends the session: stop reading WAL.
            stop.cancel();
            r
        };
        let (source_res, sink_res) = tokio::join!(source, sink_half);
        metrics.streaming.set(0);
        let (sink_res, head, lane) = match sink_res {
            Ok(()) => (Ok(()), None, None),
            Err(publisher::Failed { error, head, lane }) => {
                // The broker's doing (not a row's, nor the stream's): the
                // next session keeps off the node (channel 0's when no
                // channel was named).
                let broker = matches!(error, publisher::PublishError::Sink(_));
                let lane = broker.then(|| lane.unwrap_or(0));
                (Err(RelayError::from(error)), head, lane)
            }
        };
        if let Some(lane) = lane
            && !shutdown.is_cancelled()
        {
            memory.nodes.failed(sinks[lane].node());
        }

        // The gate's last word: the position it vouches for, or why none.
        stop.cancel();
        sink_done.cancel();
        let gate_res = gated.await.unwrap_or_else(|e| {
            Err(SourceError::Timeout(format!(
                "the coverage gate failed ({e}); the position after its last report will be replayed"
            )))
        });
        let confirmed = reported.borrow().lsn;
        memory.last = Some(resume::Confirmed {
            system_id: server.system_id,
            timeline: server.timeline,
            lsn: confirmed,
        });
        report_final(&mut repl, confirmed, cfg.postgres.status_interval).await;
        // A broker that stopped answering would not answer a close either:
        // waiting for it would only delay the next session.
        if matches!(
            &sink_res,
            Err(RelayError::Sink(SinkError::ConfirmTimeout { .. }))
        ) {
            drop(sinks);
        } else {
            futures_util::future::join_all(sinks.into_iter().map(AmqpSink::close)).await;
        }
        stop.cancel();
        let _ = side.await;
        let _ = watch_liveness.await;

        let res = (gate_res.map_err(RelayError::from))
            .and(sink_res)
            .and(source_res.map_err(RelayError::from));
        let result = match res {
            // A transient failure while shutting down ends the drain early;
            // the position reported is still only what was confirmed.
            Err(e) if shutdown.is_cancelled() && e.is_transient() => {
                warn!(error = %e, "failure while draining; unconfirmed messages will be replayed");
                Ok(())
            }
            other => other,
        };
        if result.is_ok() {
            info!(lsn = %confirmed, "stopped; final confirmed LSN");
        }
        Ended {
            result: result.map(|()| Some(confirmed)),
            progressed: confirmed > start,
            head,
        }
    }
}

/// Where the stream starts: the slot's confirmed position, or a newer one
/// known confirmed (see `source::resume`). Fails while a recovery is under
/// way (its rows first).
async fn resume_point(
    sql: &tokio_postgres::Client,
    cfg: &Config,
    server: &Server,
    memory: &mut Memory,
) -> Result<Resume, RelayError> {
    let slot_lsn = bounded("reading the slot", usable_slot(sql, cfg)).await?;
    // A recovery under way (another relay re-publishing after a failover):
    // its rows first, then the stream.
    let pending = checkpoint_table::pending_recovery(sql, cfg);
    if bounded("reading the checkpoint", pending).await?.is_some() {
        return Err(SourceError::RecoveryPending(cfg.postgres.slot.clone()).into());
    }
    // A checkpoint that cannot be read only costs replays.
    let checkpoint = match bounded("reading the checkpoint", checkpoint_table::read(sql, cfg)).await
    {
        Ok(c) => c,
        Err(e) => {
            debug!(error = %e, "cannot read the checkpoint");
            None
        }
    };
    // What the outbox tables' coverage was when the last session (of any
    // process) started: a change since, while no relay streamed, is found
    // by `outbox_tables`.
    let recorded = bounded(
        "reading the recorded coverage",
        coverage::recorded(sql, cfg),
    )
    .await?;
    // Rows of a table changed later may date from as long before as the
    // longest transaction seen (see coverage::read_position).
    let longest_secs = (checkpoint.as_ref())
        .and_then(|c| c.longest_tx_secs)
        .unwrap_or(0.0)
        .max(memory.longest.lock().await.longest_secs);
    let checkpoint = checkpoint.and_then(|c| {
        let lsn = c.confirmed_lsn.parse::<Lsn>().ok()?;
        Some((c.system_identifier, lsn))
    });
    let (start, origin) = resume::choose(
        slot_lsn,
        server,
        checkpoint.as_ref().map(|(id, lsn)| (id.as_deref(), *lsn)),
        memory.last.as_ref(),
    );
    // A position from another server or timeline, or past this end of WAL
    // (a disk rolled back), never applies again: forget it, so that WAL
    // written later cannot make it look plausible.
    if (memory.last.as_ref()).is_some_and(|c| !resume::still_applies(c, server)) {
        warn!(
            "forgetting the last session's position: the server is not the one it was confirmed on"
        );
        memory.last = None;
    }
    if origin != resume::Origin::Slot {
        info!(slot_lsn = %slot_lsn, lsn = %start, from = origin.as_str(), "resuming past the slot's confirmed position");
    }
    Ok(Resume {
        start,
        widen_secs: longest_secs + coverage::WIDEN_MARGIN_SECS,
        recorded,
    })
}

/// The outbox tables found (a rename followed), their coverage compared
/// with the last one recorded and recorded anew, and the publication
/// checked. A change while no relay streamed stops here, naming the
/// `republish` it needs.
async fn outbox_tables(
    sql: &tokio_postgres::Client,
    cfg: &Config,
    server: &Server,
    resume: &Resume,
    memory: &mut Memory,
) -> Result<(Vec<Option<OutboxOids>>, Coverage), RelayError> {
    let mut oids = Vec::with_capacity(cfg.outboxes.len());
    for (outbox, known) in cfg.outboxes.iter().zip(memory.known_oids.iter()) {
        let found = slot::outbox_oids(sql, cfg, outbox, known.as_ref());
        oids.push(bounded("looking up the outbox table", found).await?);
    }
    slot::check_overlap(cfg, &oids)?;
    // Before the publication's check: a table re-created since, and added
    // back by `setup`, needs `republish`, which this names.
    let previous = resume.recorded.as_ref().or(memory.seen.as_ref());
    let baseline = Coverage::baseline(sql, cfg, &oids, resume.widen_secs, previous);
    let coverage = match bounded("reading the publication", baseline).await {
        Ok(c) => c,
        // A change: what the publication lacks now is said too (a row
        // filter, a table not added back), after the `republish` the change
        // needs.
        Err(RelayError::Source(change @ SourceError::Setup(_))) => {
            let publication = slot::require_publication(sql, cfg, &oids);
            return Err(
                match bounded("reading the publication", publication).await {
                    Err(RelayError::Source(SourceError::Setup(lacks))) => {
                        SourceError::Setup(format!("{change}; besides: {lacks}"))
                    }
                    _ => change,
                }
                .into(),
            );
        }
        Err(e) => return Err(e),
    };
    // Recorded before the publication is checked: a table the publication
    // does not hold yet is recorded so, and once `setup` adds it, the next
    // start names the `republish` its rows need.
    let record = coverage.record(
        sql,
        cfg,
        resume.recorded.as_ref(),
        resume.start,
        &server.system_id,
    );
    bounded("recording the outbox tables' coverage", record).await?;
    bounded(
        "reading the publication",
        slot::require_publication(sql, cfg, &oids),
    )
    .await?;
    memory.known_oids.clone_from(&oids);
    memory.seen = Some(coverage.seen());
    Ok((oids, coverage))
}

/// The broker, from after the node whose session failed: a connection per
/// publishing channel (`rabbitmq.channels`), spread over the nodes; an
/// exchange declared since it was found missing is used again.
async fn open_broker(cfg: &Config, memory: &mut Memory) -> Result<Vec<AmqpSink>, RelayError> {
    let channels = cfg.rabbitmq.channels.max(1);
    // All at once: a connection that waits out an unreachable node's
    // connect timeout must not leave those already open without their
    // heartbeats for as long.
    let connects = (0..channels).map(|lane| {
        let name = if channels == 1 {
            format!("outbox-relay (slot {})", cfg.postgres.slot)
        } else {
            format!("outbox-relay (slot {}, channel {lane})", cfg.postgres.slot)
        };
        let nodes = memory.nodes.for_lane(lane);
        async move { AmqpSink::connect(&cfg.rabbitmq, &name, &nodes).await }
    });
    let mut sinks: Vec<AmqpSink> = futures_util::future::join_all(connects)
        .await
        .into_iter()
        .collect::<Result<_, _>>()?;
    memory.nodes.reached(sinks[0].node());
    let sink = &mut sinks[0];
    let refused = &mut memory.refusals.missing;
    // Only the missing: a passive declare asks for no permission, so it
    // would find a write-forbidden exchange "there" at every session and
    // send its events to be refused again (that one is tried again once
    // its refusal is a minute old).
    let missing = (refused.names().into_iter())
        .filter(|x| refused.refusal(x) != Some(crate::sink::refused::Refusal::Forbidden));
    for exchange in missing.collect::<Vec<_>>() {
        match sink.check_exchange(&exchange).await {
            Ok(()) => {
                info!(exchange = %crate::logtext::Shown(&exchange), "the exchange exists now");
                refused.remove(&exchange);
            }
            Err(SinkError::NoExchange(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(sinks)
}

/// Hands the final watermark to the server before ending the stream: waits
/// (bounded) until a status update carrying it has been sent.
async fn report_final(repl: &mut ReplicationClient, confirmed: Lsn, interval: Duration) {
    repl.update_applied_lsn(confirmed.into());
    let sent = repl.metrics();
    let deadline = Instant::now() + interval * 2 + Duration::from_secs(1);
    while repl.is_running()
        && Lsn::from(sent.last_applied_lsn()) < confirmed
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if Lsn::from(sent.last_applied_lsn()) < confirmed {
        debug!(lsn = %confirmed, "final position not acknowledged in time; it will be replayed");
    }
    if tokio::time::timeout(Duration::from_secs(5), repl.shutdown())
        .await
        .is_err()
    {
        repl.abort();
    }
}
