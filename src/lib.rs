//! outbox-relay: a change-data-capture relay for the transactional outbox
//! pattern, from a PostgreSQL logical replication slot to RabbitMQ.
//!
//! ```text
//! PostgreSQL WAL ──pgoutput──▶ source ──▶ decode ──▶ map ──▶ sink (AMQP, confirms)
//!         ▲                                                     │ acks
//!         └────────── standby status (confirmed LSN) ◀── checkpoint (watermark)
//! ```
//!
//! | stage | module |
//! |---|---|
//! | replication stream, slot and publication | [`source`] |
//! | pgoutput wire format | [`pgoutput`] |
//! | relation cache, outbox INSERT -> event | [`outbox`] |
//! | event -> AMQP message | [`message`], [`template`] |
//! | publish with confirms | [`sink`] |
//! | confirmed-LSN watermark | [`checkpoint`] |
//! | why a session ended, retry or stop | [`error`] |
//! | sessions, reconnects, shutdown | [`relay`] |
//! | re-publishing from the table | [`recover`] |
//! | operator commands, preflight | [`cli`], [`check`] |
//! | metrics, health | [`metrics`], [`http`] |
//! | configuration, TLS, PostgreSQL URLs, masking secrets | [`config`], [`tls`], [`pgurl`], [`redact`] |
//!
//! Dependencies run one way, down this list: `relay` and `recover` use
//! `source` and `sink` (and [`error`], which wraps their errors); `source`
//! and `sink` use neither each other nor anything above them. What they
//! share sits below both: the watermark ([`checkpoint::Progress`]), the
//! configuration, the message.
//!
//! # LSN invariants
//!
//! 1. The only position ever reported to PostgreSQL is
//!    [`checkpoint::Checkpoint::confirmed`]: the end LSN of the newest
//!    transaction such that it and all before it are fully confirmed by the
//!    broker, or a keepalive's position while nothing at all is pending.
//! 2. A session starts at the slot's `confirmed_flush_lsn` and reports that
//!    same position until it has confirmed more, so a restart replays
//!    everything not yet durable (at-least-once; `message_id` is stable).
//! 3. A confirm counts only as an `Ack` without a returned message: a nack, a
//!    `basic.return` (unroutable with `mandatory`) or a timeout is a failure.
//! 4. Events are published on one channel in WAL order, so the first delivery
//!    of each event follows commit order.

#![forbid(unsafe_code)]

pub mod check;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod error;
pub mod http;
pub mod lsn;
pub mod message;
pub mod metrics;
pub mod outbox;
pub mod pgoutput;
pub mod pgurl;
pub mod recover;
pub mod redact;
pub mod relay;
pub mod sink;
pub mod source;
pub mod template;
pub mod tls;
