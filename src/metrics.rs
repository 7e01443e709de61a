//! Prometheus metrics. Names follow `outbox_relay_<what>_<unit>[_total]`;
//! labels are bounded enums. (prometheus-client appends `_total` to counters
//! itself, so counters are registered without it.)

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Metric names, in one place.
pub mod names {
    /// Events by outcome.
    pub const EVENTS: &str = "outbox_relay_events";
    /// Body bytes confirmed by the broker.
    pub const PUBLISHED_BYTES: &str = "outbox_relay_published_bytes";
    /// Transactions seen (BEGIN..COMMIT), with or without outbox rows.
    pub const TRANSACTIONS: &str = "outbox_relay_transactions";
    /// Re-publishes after a return or nack.
    pub const RETRIES: &str = "outbox_relay_retries";
    /// Publish to confirm.
    pub const CONFIRM_LATENCY: &str = "outbox_relay_confirm_latency_seconds";
    /// Commit (the transaction's commit timestamp in the WAL) to confirm.
    pub const COMMIT_TO_CONFIRM: &str = "outbox_relay_commit_to_confirm_seconds";
    /// Messages awaiting a confirm.
    pub const IN_FLIGHT: &str = "outbox_relay_in_flight_messages";
    /// Messages awaiting a confirm, per publishing channel.
    pub const CHANNEL_IN_FLIGHT: &str = "outbox_relay_channel_in_flight_messages";
    /// Events received and not yet confirmed (queued, in flight, retrying).
    pub const UNCONFIRMED_EVENTS: &str = "outbox_relay_unconfirmed_events";
    /// Bytes of the messages in flight or waiting for a retry.
    pub const UNCONFIRMED_BYTES: &str = "outbox_relay_unconfirmed_bytes";
    /// Newest LSN received from the server.
    pub const RECEIVED_LSN: &str = "outbox_relay_received_lsn";
    /// Watermark reported to the server.
    pub const CONFIRMED_LSN: &str = "outbox_relay_confirmed_lsn";
    /// WAL the slot retains, polled.
    pub const RETAINED_WAL: &str = "outbox_relay_retained_wal_bytes";
    /// WAL that may still be written before the slot is lost, polled.
    pub const SAFE_WAL: &str = "outbox_relay_slot_safe_wal_bytes";
    /// Now minus commit time of the oldest unconfirmed transaction.
    pub const LAG: &str = "outbox_relay_replication_lag_seconds";
    /// Sessions restarted, by the side that failed.
    pub const RECONNECTS: &str = "outbox_relay_reconnects";
    /// 1 while the broker blocks publishing.
    pub const BLOCKED: &str = "outbox_relay_broker_blocked";
    /// 1 while streaming from the slot with the broker connected.
    pub const STREAMING: &str = "outbox_relay_streaming";
    /// Lost slots recreated, and their outbox rows re-published, by `run`.
    pub const SLOT_RECOVERIES: &str = "outbox_relay_slot_recoveries";
    /// Non-transactional logical messages with an outbox's prefix, skipped.
    pub const SKIPPED_MESSAGES: &str = "outbox_relay_skipped_messages";
}

/// What became of an event.
/// Label values are the variant names as written, hence lower case.
#[allow(non_camel_case_types)]
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum Outcome {
    /// Confirmed by the broker on its exchange.
    published,
    /// Confirmed by the broker on the dead-letter exchange.
    dead_lettered,
}

/// `outcome` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// The outcome.
    pub outcome: Outcome,
}

/// Why a message was published again.
/// Label values are the variant names as written, hence lower case.
#[allow(non_camel_case_types)]
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum RetryReason {
    /// Unroutable (basic.return).
    returned,
    /// basic.nack.
    nacked,
}

/// `reason` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// The reason.
    pub reason: RetryReason,
}

/// Which side failed.
/// Label values are the variant names as written, hence lower case.
#[allow(non_camel_case_types)]
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum Target {
    /// PostgreSQL.
    postgres,
    /// RabbitMQ.
    rabbitmq,
}

/// `channel` label: the publishing channel's number, from 0
/// (`rabbitmq.channels`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ChannelLabel {
    /// The channel.
    pub channel: u32,
}

/// `target` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetLabel {
    /// The side.
    pub target: Target,
}

/// All metrics of one relay process. Cheap to clone (shared handles).
#[derive(Clone)]
pub struct Metrics {
    /// See [`names::EVENTS`].
    pub events: Family<OutcomeLabel, Counter>,
    /// See [`names::PUBLISHED_BYTES`].
    pub published_bytes: Counter,
    /// See [`names::TRANSACTIONS`].
    pub transactions: Counter,
    /// See [`names::RETRIES`].
    pub retries: Family<ReasonLabel, Counter>,
    /// See [`names::CONFIRM_LATENCY`].
    pub confirm_latency: Histogram,
    /// See [`names::COMMIT_TO_CONFIRM`].
    pub commit_to_confirm: Histogram,
    /// See [`names::IN_FLIGHT`].
    pub in_flight: Gauge,
    /// See [`names::CHANNEL_IN_FLIGHT`].
    pub channel_in_flight: Family<ChannelLabel, Gauge>,
    /// See [`names::UNCONFIRMED_EVENTS`].
    pub unconfirmed_events: Gauge,
    /// See [`names::UNCONFIRMED_BYTES`].
    pub unconfirmed_bytes: Gauge,
    /// See [`names::RECEIVED_LSN`].
    pub received_lsn: Gauge<u64, AtomicU64>,
    /// See [`names::CONFIRMED_LSN`].
    pub confirmed_lsn: Gauge<u64, AtomicU64>,
    /// See [`names::RETAINED_WAL`].
    pub retained_wal_bytes: Gauge,
    /// See [`names::SAFE_WAL`]; -1 while unknown or unlimited.
    pub safe_wal_bytes: Gauge,
    /// See [`names::LAG`].
    pub lag_seconds: Gauge<f64, AtomicU64>,
    /// See [`names::RECONNECTS`].
    pub reconnects: Family<TargetLabel, Counter>,
    /// See [`names::BLOCKED`].
    pub blocked: Gauge,
    /// See [`names::STREAMING`].
    pub streaming: Gauge,
    /// See [`names::SLOT_RECOVERIES`].
    pub slot_recoveries: Counter,
    /// See [`names::SKIPPED_MESSAGES`].
    pub skipped_messages: Counter,
    registry: Arc<Registry>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let mut r = Registry::default();
        let m = Metrics {
            events: Family::default(),
            published_bytes: Counter::default(),
            transactions: Counter::default(),
            retries: Family::default(),
            confirm_latency: Histogram::new([
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0,
            ]),
            // Fine below 100 ms: this is what users compare with polling.
            commit_to_confirm: Histogram::new([
                0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
            ]),
            in_flight: Gauge::default(),
            channel_in_flight: Family::default(),
            unconfirmed_events: Gauge::default(),
            unconfirmed_bytes: Gauge::default(),
            received_lsn: Gauge::default(),
            confirmed_lsn: Gauge::default(),
            retained_wal_bytes: Gauge::default(),
            safe_wal_bytes: Gauge::default(),
            lag_seconds: Gauge::default(),
            reconnects: Family::default(),
            blocked: Gauge::default(),
            streaming: Gauge::default(),
            slot_recoveries: Counter::default(),
            skipped_messages: Counter::default(),
            registry: Arc::new(Registry::default()),
        };
        r.register(names::EVENTS, "Outbox events by outcome", m.events.clone());
        r.register(
            names::PUBLISHED_BYTES,
            "Message body bytes confirmed by the broker",
            m.published_bytes.clone(),
        );
        r.register(
            names::TRANSACTIONS,
            "Committed transactions received from the slot",
            m.transactions.clone(),
        );
        r.register(
            names::RETRIES,
            "Messages published again after a return or a nack",
            m.retries.clone(),
        );
        r.register(
            names::CONFIRM_LATENCY,
            "Time from publish to broker confirm",
            m.confirm_latency.clone(),
        );
        r.register(
            names::COMMIT_TO_CONFIRM,
            "Time from the transaction's commit (its WAL timestamp, the database server's clock) to the broker confirm of its message",
            m.commit_to_confirm.clone(),
        );
        r.register(
            names::IN_FLIGHT,
            "Messages published and not yet confirmed",
            m.in_flight.clone(),
        );
        r.register(
            names::CHANNEL_IN_FLIGHT,
            "Messages published on each publishing channel (rabbitmq.channels) and not yet confirmed; one channel high while the others drain is the one holding the confirmed position back",
            m.channel_in_flight.clone(),
        );
        r.register(
            names::UNCONFIRMED_EVENTS,
            "Events received from the slot and not yet confirmed by the broker: queued for the publisher (its queue's transaction boundaries count too), awaiting a confirm, or awaiting a retry",
            m.unconfirmed_events.clone(),
        );
        r.register(
            names::UNCONFIRMED_BYTES,
            "Bytes of the messages awaiting a confirm or a retry (against rabbitmq.window_bytes)",
            m.unconfirmed_bytes.clone(),
        );
        r.register(
            names::RECEIVED_LSN,
            "Newest WAL position received from PostgreSQL",
            m.received_lsn.clone(),
        );
        r.register(
            names::CONFIRMED_LSN,
            "WAL position reported to PostgreSQL as confirmed",
            m.confirmed_lsn.clone(),
        );
        r.register(
            names::RETAINED_WAL,
            "WAL retained by the slot (pg_current_wal_lsn - restart_lsn), polled",
            m.retained_wal_bytes.clone(),
        );
        m.safe_wal_bytes.set(-1);
        // Every label value from 0, so that the first retry or reconnect is
        // an increase an alert can see (a series born at 1 shows none).
        for reason in [RetryReason::returned, RetryReason::nacked] {
            let _ = m.retries.get_or_create(&ReasonLabel { reason });
        }
        for target in [Target::postgres, Target::rabbitmq] {
            let _ = m.reconnects.get_or_create(&TargetLabel { target });
        }
        r.register(
            names::SAFE_WAL,
            "WAL that may still be written before the slot is invalidated (pg_replication_slots.safe_wal_size, bounded by max_slot_wal_keep_size), polled; -1 when unlimited or not yet read",
            m.safe_wal_bytes.clone(),
        );
        r.register(
            names::LAG,
            "Now minus commit time of the oldest unconfirmed transaction; 0 when idle",
            m.lag_seconds.clone(),
        );
        r.register(
            names::RECONNECTS,
            "Sessions restarted after a failure, by the side that failed",
            m.reconnects.clone(),
        );
        r.register(
            names::BLOCKED,
            "1 while the broker blocks publishing (resource alarm)",
            m.blocked.clone(),
        );
        r.register(
            names::STREAMING,
            "1 while streaming from the slot with the broker connected",
            m.streaming.clone(),
        );
        r.register(
            names::SLOT_RECOVERIES,
            "Lost replication slots recreated, and their outbox rows re-published, by run (postgres.on_slot_lost = \"recover\")",
            m.slot_recoveries.clone(),
        );
        r.register(
            names::SKIPPED_MESSAGES,
            "Non-transactional logical messages with an outbox prefix, skipped (emit them with pg_logical_emit_message(true, ...)); counted each time one is decoded, so again if a session replays it",
            m.skipped_messages.clone(),
        );
        Metrics {
            registry: Arc::new(r),
            ..m
        }
    }

    /// Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// Counts one event with `outcome`.
    pub fn event(&self, outcome: Outcome) {
        self.events.get_or_create(&OutcomeLabel { outcome }).inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_with_the_documented_names() {
        let m = Metrics::new();
        m.event(Outcome::published);
        m.event(Outcome::dead_lettered);
        m.confirmed_lsn.set(42);
        m.reconnects
            .get_or_create(&TargetLabel {
                target: Target::rabbitmq,
            })
            .inc();
        (m.channel_in_flight
            .get_or_create(&ChannelLabel { channel: 3 }))
        .set(7);
        let text = m.encode();
        for needle in [
            "outbox_relay_events_total{outcome=\"published\"} 1",
            "outbox_relay_events_total{outcome=\"dead_lettered\"} 1",
            "outbox_relay_confirmed_lsn 42",
            "outbox_relay_reconnects_total{target=\"rabbitmq\"} 1",
            "outbox_relay_confirm_latency_seconds_bucket",
            "outbox_relay_slot_recoveries_total 0",
            "outbox_relay_skipped_messages_total 0",
            "outbox_relay_slot_safe_wal_bytes -1",
            "outbox_relay_retries_total{reason=\"nacked\"} 0",
            "outbox_relay_reconnects_total{target=\"postgres\"} 0",
            "outbox_relay_channel_in_flight_messages{channel=\"3\"} 7",
        ] {
            assert!(text.contains(needle), "{needle} missing from:\n{text}");
        }
    }
}
