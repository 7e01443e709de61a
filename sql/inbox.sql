-- inbox.sql: the table an idempotent consumer records handled events in.
--
-- What: one row per (consumer, event id). The relay delivers each event at
-- least once, with the outbox row's id as the AMQP message_id; a consumer
-- turns that into exactly one business effect by inserting the inbox row
-- and applying the business change in ONE transaction, and acking the
-- message only after it commits. A redelivered message then fails the
-- insert with a unique violation (SQLSTATE 23505): it was handled already,
-- so the consumer acks it without applying it again. See README,
-- "Consuming".
-- When: once per consumer database, before the consumer starts.
-- As whom: the consumer service's schema owner (the role that runs its
-- migrations); the consumer's own role needs INSERT (and SELECT, to look
-- up what it handled).
--   psql "$CONSUMER_DATABASE_URL" -v ON_ERROR_STOP=1 -f sql/inbox.sql
CREATE TABLE IF NOT EXISTS consumed_events (
  consumer    text        NOT NULL,  -- which consumer (one inbox may serve several)
  event_id    text        NOT NULL,  -- the message's message_id (the outbox row's id)
  consumed_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (consumer, event_id)
);
-- Old rows can go once their events can no longer come again: older than
-- what the broker may still redeliver AND than the outbox rows the producer
-- keeps (`outbox-relay republish --since` and `recover` re-send those), e.g.
-- with outbox rows pruned after 7 days:
--   DELETE FROM consumed_events WHERE consumed_at < now() - interval '30 days';
