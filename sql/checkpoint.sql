-- checkpoint.sql: the table where outbox-relay records its progress.
--
-- What: one row per replication slot: the confirmed LSN, the commit time of
-- the newest transaction the broker confirmed, and when the row was written.
-- The relay writes it at most every 200 ms, only when a new transaction has
-- become durable. `outbox-relay status` shows it; `outbox-relay recover` uses
-- last_commit_time to re-publish outbox rows when the slot itself was lost.
-- When: `outbox-relay setup` creates it; run this by hand only if setup runs
-- without the privilege to create tables.
-- As whom: the owner of the outbox table (or a superuser); then grant the
-- relay's role the right to write it (see role.sql).
CREATE TABLE IF NOT EXISTS public.outbox_relay_checkpoint (
  slot_name        text PRIMARY KEY,
  confirmed_lsn    pg_lsn NOT NULL,
  last_commit_time timestamptz,
  written_at       timestamptz NOT NULL DEFAULT now()
);
-- Added in 0.2 (`outbox-relay setup` and `recover` add them too): the
-- longest transaction the relay has seen, a recovery under way (its window
-- and the last row it confirmed; see README, "Recovery"), and the cluster
-- the row was written on (a restart resumes from confirmed_lsn only there).
ALTER TABLE public.outbox_relay_checkpoint
  ADD COLUMN IF NOT EXISTS longest_tx_secs        float8,
  ADD COLUMN IF NOT EXISTS recovery_since         timestamptz,
  ADD COLUMN IF NOT EXISTS recovery_after_created timestamptz,
  ADD COLUMN IF NOT EXISTS recovery_after_id      text,
  ADD COLUMN IF NOT EXISTS recovery_done          bigint,
  ADD COLUMN IF NOT EXISTS system_identifier      text;
-- Added next: what the publication held of the outbox tables when the
-- relay last started, and the time from which rows of a table changed since
-- may date: a table dropped and created again while no relay ran stops the
-- next start until `outbox-relay republish --since` has sent its rows.
ALTER TABLE public.outbox_relay_checkpoint
  ADD COLUMN IF NOT EXISTS coverage       jsonb,
  ADD COLUMN IF NOT EXISTS coverage_since timestamptz;
