//! outbox-relay: a change-data-capture relay for the transactional outbox
//! pattern, from a PostgreSQL logical replication slot to RabbitMQ.
//!
//! ```text
//! PostgreSQL WAL ──pgoutput──▶ source ──▶ decode ──▶ map ──▶ sink (AMQP, confirms)
//!         ▲                                                     │ acks
//!         └────────── standby status (confirmed LSN) ◀── checkpoint (watermark)
//! ```
//!
//! Layers, each using only those below it (a read of the `use crate::`
//! lines shows it):
//!
//! | layer | module: what it is |
//! |---|---|
//! | commands | [`cli`]: the subcommands; [`check`]: the preflight report |
//! | sessions | [`relay`]: one supervisor (recover, stream, stand by, stop) and its sessions; [`recover`]: re-publishing from the tables, `prune` |
//! | why a session ended | [`error`]: retry or stop, wrapping the source's and the sink's errors |
//! | the two sides | [`source`]: the stream's half of a session, slot, publication, checkpoint table; [`sink`]: the AMQP client and the publishing half (neither uses the other) |
//! | what they share | [`handoff`]: the items from source to sink and their byte budget; [`outbox`]: relation cache, outbox INSERT or logical message -> event; [`message`]: event -> AMQP message; [`template`]: `{column}` templates; [`checkpoint`]: the confirmed-LSN watermark and [`checkpoint::Progress`]; [`pgoutput`]: the wire format |
//! | foundations | [`config`]: validated configuration; [`tls`]: sslmode and CAs; [`pgurl`]: PostgreSQL URLs; [`redact`]: masking secrets; [`smallfile`]: reading password and certificate files; [`logtext`]: row text in logs; [`metrics`] and [`http`]: metrics, health; [`lsn`]: WAL positions |
//!
//! # LSN invariants
//!
//! 1. The only position ever reported to PostgreSQL is
//!    [`checkpoint::Checkpoint::confirmed`]: the end LSN of the newest
//!    transaction such that it and all before it are fully confirmed by the
//!    broker, or a keepalive's position while nothing at all is pending.
//! 2. A session starts at the newest position known to be confirmed (the
//!    slot's `confirmed_flush_lsn`, the checkpoint table's, or the last
//!    session's on the same server and timeline: [`source::resume`]) and
//!    reports that same position until it has confirmed more, so a restart
//!    replays everything not yet durable and little else (at-least-once;
//!    `message_id` is stable).
//! 3. A confirm counts only as an `Ack` without a returned message: a nack, a
//!    `basic.return` (unroutable with `mandatory`) or a timeout is a failure.
//! 4. Events are published on one channel in WAL order, so the first delivery
//!    of each event follows commit order.

#![forbid(unsafe_code)]

pub(crate) mod amqpurl;
pub mod check;
pub(crate) mod checkpoint;
pub mod cli;
pub mod config;
pub(crate) mod dial;
pub(crate) mod error;
pub(crate) mod handoff;
pub mod http;
pub mod logtext;
pub mod lsn;
pub mod message;
pub mod metrics;
pub(crate) mod outbox;
pub mod pgoutput;
pub(crate) mod pgurl;
pub mod recover;
pub(crate) mod redact;
pub(crate) mod relay;
pub mod sink;
pub(crate) mod smallfile;
pub mod source;
pub(crate) mod template;
pub mod tls;
