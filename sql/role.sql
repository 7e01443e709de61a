-- role.sql: a least-privilege login role for running outbox-relay.
--
-- What: creates role outbox_relay that can open a replication connection
-- (REPLICATION: IDENTIFY_SYSTEM, START_REPLICATION on its slot, and create
-- or drop slots) and read the outbox table (SELECT: the relay may look rows
-- up, e.g. when checking its configuration), and nothing else: not a
-- superuser, cannot create databases, roles or tables, cannot write to the
-- outbox. Also add a pg_hba.conf line that allows it `replication`
-- connections, e.g.  host replication outbox_relay 10.0.0.0/8 scram-sha-256
-- When: once per database, after outbox.sql.
-- As whom: a superuser (only a superuser may grant REPLICATION), connected
-- to the database holding the outbox table. Pass the password as a psql
-- variable, so that it never sits in this file or in the shell history:
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 \
--        -v relay_password="$OUTBOX_RELAY_PASSWORD" -f sql/role.sql
-- (:'relay_password' below is psql's quoted-literal interpolation.)
\if :{?relay_password}
\else
  \set ON_ERROR_STOP on
  DO $$ BEGIN RAISE EXCEPTION 'role.sql: pass the password with  -v relay_password=...'; END $$;
\endif

CREATE ROLE outbox_relay WITH LOGIN REPLICATION
  NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT
  PASSWORD :'relay_password';

-- :"DBNAME" is psql's quoted identifier for the current database.
GRANT CONNECT ON DATABASE :"DBNAME" TO outbox_relay;
GRANT USAGE ON SCHEMA public TO outbox_relay;
GRANT SELECT ON TABLE public.outbox TO outbox_relay;

-- The relay records its checkpoint here (sql/checkpoint.sql); it needs to
-- read and upsert its own row, nothing more.
GRANT SELECT, INSERT, UPDATE ON TABLE public.outbox_relay_checkpoint TO outbox_relay;
