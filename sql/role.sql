-- role.sql: a least-privilege login role for running outbox-relay.
--
-- What: creates a role (outbox_relay) that can open a logical replication
-- connection (REPLICATION: IDENTIFY_SYSTEM, START_REPLICATION on its slot,
-- and create or drop slots), read the outbox table (SELECT: the relay looks
-- rows up, e.g. `recover`), and read and write its own row of the
-- checkpoint table, nothing else: not a superuser, cannot create
-- databases, roles or tables, cannot write to the outbox, cannot touch
-- the checkpoint rows of other slots (a row-level security policy).
-- When: once per database, after `outbox-relay setup` (or sql/outbox.sql
-- and sql/checkpoint.sql) has made the outbox and checkpoint tables.
-- As whom: a superuser (only a superuser may grant REPLICATION), connected
-- to the database holding the outbox table. Pass the password as a psql
-- variable, so that it never sits in this file or in the shell history:
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 \
--        -v relay_password="$OUTBOX_RELAY_PASSWORD" -f sql/role.sql
-- (:'relay_password' below is psql's quoted-literal interpolation.) The
-- other names have defaults matching the relay's; set them the same way
-- when yours differ: -v relay_role=... (the role), -v slot=...
-- (postgres.slot), -v outbox_table=schema.table (outbox.table) and
-- -v checkpoint_table=schema.table (postgres.checkpoint_table), the tables
-- written as in SQL (e.g. public."Outbox").
--
-- pg_hba.conf: the relay's replication connection is a *logical* one: it
-- connects to the database, and a database line admits it, e.g.
--   host  app  outbox_relay  10.0.0.0/8  scram-sha-256
-- Do not add a `host replication outbox_relay ...` line: that admits
-- physical replication connections (pg_basebackup, a standby), which the
-- relay never opens. Know, though, that PostgreSQL lets any role with
-- REPLICATION run BASE_BACKUP over its logical replication connection too:
-- treat the relay's password as one that can read a copy of the cluster's
-- files, and keep it as well as a superuser's.
\if :{?relay_password}
\else
  \set ON_ERROR_STOP on
  DO $$ BEGIN RAISE EXCEPTION 'role.sql: pass the password with  -v relay_password=...'; END $$;
\endif
\if :{?relay_role}
\else
  \set relay_role outbox_relay
\endif
\if :{?slot}
\else
  \set slot outbox_relay
\endif
\if :{?outbox_table}
\else
  \set outbox_table public.outbox
\endif
\if :{?checkpoint_table}
\else
  \set checkpoint_table public.outbox_relay_checkpoint
\endif

CREATE ROLE :"relay_role" WITH LOGIN REPLICATION
  NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT
  PASSWORD :'relay_password';

-- :"DBNAME" is psql's quoted identifier for the current database.
GRANT CONNECT ON DATABASE :"DBNAME" TO :"relay_role";
-- USAGE on the schemas of both tables (\gexec runs each line it selects).
SELECT DISTINCT pg_catalog.format('GRANT USAGE ON SCHEMA %I TO %I', n.nspname, :'relay_role')
  FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
 WHERE c.oid IN (:'outbox_table'::pg_catalog.regclass, :'checkpoint_table'::pg_catalog.regclass)
\gexec
GRANT SELECT ON TABLE :outbox_table TO :"relay_role";

-- The relay records its checkpoint in one row, keyed by its slot's name.
-- It may read and upsert that row and no other: with row-level security
-- on, a role other than the table's owner (and superusers) sees and writes
-- only the rows a policy gives it. Roles that read the table for
-- monitoring need a policy of their own (or BYPASSRLS).
GRANT SELECT, INSERT, UPDATE ON TABLE :checkpoint_table TO :"relay_role";
ALTER TABLE :checkpoint_table ENABLE ROW LEVEL SECURITY;
CREATE POLICY :"relay_role" ON :checkpoint_table TO :"relay_role"
  USING (slot_name = :'slot') WITH CHECK (slot_name = :'slot');
