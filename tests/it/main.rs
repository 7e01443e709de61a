//! The integration tests, one module per concern, in one test binary:
//! one link of the dependency tree instead of one per file. Each module is
//! run on its own (`integration/suite.sh` runs `cargo test --test it --
//! <module>::`, one module after another in each lane), so that a module's
//! faults (a broker stopped, PostgreSQL restarted) never meet another
//! module's tests: modules serialize their own disruptive tests, as they
//! did as separate binaries.

#[path = "../common/mod.rs"]
mod common;

mod broker_alarm;
mod broker_faults;
mod channels;
mod chaos;
mod check;
mod commands;
mod config_schema;
mod crash_windows;
mod deploy;
mod failover_slots;
mod ha;
mod idle_slot;
mod idle_wal;
mod kill9;
mod large_tx;
mod observability;
mod outboxes;
mod package;
mod pg_faults;
mod poison;
mod prune;
mod recover;
mod relay_e2e;
mod rotation;
mod takeover;
mod tls;
mod unusual_tables;
