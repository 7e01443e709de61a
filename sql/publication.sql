-- publication.sql: the publication that outbox-relay subscribes to.
--
-- What: makes pgoutput stream the outbox table's INSERTs, and nothing else:
-- the relay never needs UPDATEs or DELETEs (pruning old outbox rows must not
-- turn into messages), nor any other table.
-- When: once per database, after outbox.sql and before slot.sql (a slot
-- only streams changes made after it was created, so create the publication
-- and the slot before the application starts writing events).
-- As whom: the owner of the outbox table, or a superuser (CREATE PUBLICATION
-- ... FOR TABLE needs ownership of the table and CREATE on the database).
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f sql/publication.sql
-- `outbox-relay setup` does the same; run this instead when the relay's
-- role must not own the table.
-- publish_via_partition_root: a partitioned outbox's rows arrive as rows of
-- the outbox table itself, whichever partition holds them.
CREATE PUBLICATION outbox_pub FOR TABLE outbox
  WITH (publish = 'insert', publish_via_partition_root = true);
