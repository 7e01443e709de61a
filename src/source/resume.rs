//! Where a session starts streaming: the newest position known to be
//! confirmed by the broker, so that a restart replays no more than it must.
//!
//! Three records of that position exist, each newer than the others in some
//! failure:
//!
//! - the slot's `confirmed_flush_lsn`: what the relay last reported. After
//!   a PostgreSQL restart it can be far older: PostgreSQL 15 does not write
//!   a slot to disk when only its confirmed position moved;
//! - the checkpoint table: written (WAL-logged) every 200 ms after broker
//!   confirms. It survives a server restart and a failover to a physical
//!   standby (which has the table, not the slot);
//! - this process's own last confirmed position: exact after a walsender
//!   was terminated or PostgreSQL restarted, but only on the same server
//!   and timeline.
//!
//! PostgreSQL streams the transactions that commit at or after the start
//! position asked for (never before the slot's own), so starting at the
//! newest of the three skips exactly what was confirmed. A position from
//! another cluster (a table restored from a dump) or from a timeline the
//! server has left (a failover that lost the old primary's last
//! transactions) could skip transactions that were never sent: such a
//! position is not used.

use tokio_postgres::Client;

use super::{SourceError, sql_err};
use crate::config::PostgresConfig;
use crate::lsn::Lsn;

/// Which server a position was read on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Server {
    /// `pg_control_system().system_identifier`: the same on a physical
    /// standby, different on any other cluster.
    pub system_id: String,
    /// The timeline WAL is being written on: it changes when a standby is
    /// promoted or a backup is recovered to a point in time.
    pub timeline: u32,
    /// The current end of WAL: no confirmed position can be past it.
    pub wal_end: Lsn,
}

/// A position this process confirmed, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confirmed {
    /// The server's system identifier.
    pub system_id: String,
    /// The timeline it was on.
    pub timeline: u32,
    /// The position.
    pub lsn: Lsn,
}

/// Where the start position came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The slot's `confirmed_flush_lsn`.
    Slot,
    /// The checkpoint table.
    Checkpoint,
    /// This process's last session.
    LastSession,
}

impl Origin {
    /// For logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Slot => "the slot",
            Origin::Checkpoint => "the checkpoint table",
            Origin::LastSession => "the last session",
        }
    }
}

/// Reads which server the SQL connection reached.
pub async fn server(client: &Client, cfg: &PostgresConfig) -> Result<Server, SourceError> {
    // pg_walfile_name() names the segment after the timeline WAL is being
    // inserted on: its first eight hex digits.
    let row = client
        .query_one(
            "SELECT system_identifier::text, pg_walfile_name(pg_current_wal_lsn()), \
             pg_current_wal_lsn()::text FROM pg_control_system()",
            &[],
        )
        .await
        .map_err(sql_err(cfg, "identifying the server"))?;
    let bad = |what: &str| SourceError::Setup(format!("unexpected {what} from the server"));
    let walfile: String = row.get(1);
    let timeline = walfile
        .get(..8)
        .and_then(|t| u32::from_str_radix(t, 16).ok())
        .ok_or_else(|| bad("WAL file name"))?;
    let wal_end = row
        .get::<_, String>(2)
        .parse()
        .map_err(|_| bad("WAL position"))?;
    Ok(Server {
        system_id: row.get(0),
        timeline,
        wal_end,
    })
}

/// Whether `c`, confirmed earlier by this process, can still be a start
/// position on `server`.
pub fn still_applies(c: &Confirmed, server: &Server) -> bool {
    c.system_id == server.system_id && c.timeline == server.timeline && c.lsn <= server.wal_end
}

/// The start position: the newest of the slot's, the checkpoint's (if it
/// was written on this cluster) and the last session's (if on this server
/// and timeline), none past the end of WAL.
pub fn choose(
    slot: Lsn,
    server: &Server,
    checkpoint: Option<(Option<&str>, Lsn)>,
    last: Option<&Confirmed>,
) -> (Lsn, Origin) {
    let checkpoint = checkpoint
        .filter(|(id, _)| *id == Some(server.system_id.as_str()))
        .map(|(_, lsn)| (lsn, Origin::Checkpoint));
    let last = last
        .filter(|c| still_applies(c, server))
        .map(|c| (c.lsn, Origin::LastSession));
    let mut best = (slot, Origin::Slot);
    for (lsn, origin) in [checkpoint, last].into_iter().flatten() {
        if lsn > best.0 && lsn <= server.wal_end {
            best = (lsn, origin);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server() -> Server {
        Server {
            system_id: "7".into(),
            timeline: 2,
            wal_end: Lsn(1000),
        }
    }

    fn last(system_id: &str, timeline: u32, lsn: u64) -> Confirmed {
        Confirmed {
            system_id: system_id.into(),
            timeline,
            lsn: Lsn(lsn),
        }
    }

    #[test]
    fn the_newest_trustworthy_position_wins() {
        let s = server();
        assert_eq!(choose(Lsn(100), &s, None, None), (Lsn(100), Origin::Slot));
        assert_eq!(
            choose(Lsn(100), &s, Some((Some("7"), Lsn(200))), None),
            (Lsn(200), Origin::Checkpoint)
        );
        assert_eq!(
            choose(
                Lsn(100),
                &s,
                Some((Some("7"), Lsn(200))),
                Some(&last("7", 2, 300))
            ),
            (Lsn(300), Origin::LastSession)
        );
        // Older than the slot: the slot.
        assert_eq!(
            choose(
                Lsn(500),
                &s,
                Some((Some("7"), Lsn(200))),
                Some(&last("7", 2, 300))
            ),
            (Lsn(500), Origin::Slot)
        );
    }

    #[test]
    fn positions_from_elsewhere_are_not_used() {
        let s = server();
        // Another cluster's checkpoint (a restored dump), or one written
        // before the table recorded the cluster.
        assert_eq!(
            choose(Lsn(100), &s, Some((Some("8"), Lsn(200))), None).1,
            Origin::Slot
        );
        assert_eq!(
            choose(Lsn(100), &s, Some((None, Lsn(200))), None).1,
            Origin::Slot
        );
        // Past the end of WAL: not from this server's history.
        assert_eq!(
            choose(Lsn(100), &s, Some((Some("7"), Lsn(2000))), None).1,
            Origin::Slot
        );
        // The last session on another timeline (a promoted standby that
        // never saw the old primary's last transactions) or cluster.
        assert_eq!(
            choose(Lsn(100), &s, None, Some(&last("7", 1, 300))).1,
            Origin::Slot
        );
        assert_eq!(
            choose(Lsn(100), &s, None, Some(&last("8", 2, 300))).1,
            Origin::Slot
        );
        assert_eq!(
            choose(Lsn(100), &s, None, Some(&last("7", 2, 3000))).1,
            Origin::Slot
        );
    }
}
