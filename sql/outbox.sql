-- outbox.sql: the transactional-outbox table that outbox-relay reads.
--
-- What: the application inserts one row per domain event here, in the same
-- transaction as the business change it describes; the relay picks rows up
-- from the WAL (pgoutput) and publishes each one to RabbitMQ, routed by
-- aggregate_type/event_type, with `id` as the message id.
-- When: once per database, before publication.sql, role.sql and slot.sql
-- (the publication and the grants name this table).
-- As whom: the application's schema owner (the role that runs migrations);
-- in the tests, the superuser `postgres`.
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f sql/outbox.sql
-- gen_random_uuid() is built into PostgreSQL 13 and later (no pgcrypto).
CREATE TABLE outbox (
  id             uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
  aggregate_type text        NOT NULL,
  aggregate_id   text        NOT NULL,
  event_type     text        NOT NULL,
  payload        jsonb       NOT NULL,
  headers        jsonb,
  created_at     timestamptz NOT NULL DEFAULT now()
);
