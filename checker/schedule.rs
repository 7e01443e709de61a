//! A run's whole plan, drawn from a seed: the outbox shape and settings,
//! each producer's transactions, and the nemesis' faults and operator
//! commands. It prints as text, one step a line, and parses back, so a
//! failing run (or a shrunk one) replays exactly what it did.

use std::fmt;
use std::str::FromStr;

use crate::rng::Rng;

/// The outbox tables the run writes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// The default table.
    Single,
    /// The default table partitioned by list of `aggregate_type`; a
    /// partition may be attached mid-run.
    Partitioned,
    /// Two `[[outbox]]` tables on the one slot.
    Multi,
    /// The default table and a table-less outbox (logical messages).
    Messages,
}

impl Shape {
    const ALL: [Shape; 4] = [
        Shape::Single,
        Shape::Partitioned,
        Shape::Multi,
        Shape::Messages,
    ];

    fn name(self) -> &'static str {
        match self {
            Shape::Single => "single",
            Shape::Partitioned => "partitioned",
            Shape::Multi => "multi",
            Shape::Messages => "messages",
        }
    }

    /// Outbox tables (the table-less outbox not counted).
    pub fn tables(self) -> usize {
        if self == Shape::Multi { 2 } else { 1 }
    }
}

/// The run's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setup {
    pub shape: Shape,
    /// `wal_sender_timeout` of the relay's role, in seconds.
    pub wal_sender_timeout: u32,
    /// The exchange is `chk_{aggregate_type}`-like template (hostile rows
    /// may then name a missing exchange, or the default one; not yet one
    /// the broker refuses with 403).
    pub templated: bool,
    /// `rabbitmq.shutdown_grace_secs`.
    pub grace: u32,
    /// The main queue is `x-max-length` with `reject-publish`: a consumer
    /// that stops draining it makes the broker nack.
    pub bounded_queue: bool,
    /// `rabbitmq.channels`: events spread over this many publishing
    /// channels by aggregate. Drawn after everything else, so that the
    /// seeds drawn before it existed keep their schedules (with 1).
    pub channels: u32,
}

/// One transaction of a producer. Counts are outbox events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tx {
    Commit(u32),
    Rollback(u32),
    /// `n` events, a savepoint with `m` more rolled back to, `n` again.
    SavepointRollback(u32, u32),
    /// As `SavepointRollback`, released instead.
    SavepointRelease(u32, u32),
    /// A PL/pgSQL block: `n` events, then an inner block writing `m` that
    /// raises and is caught (its writes undone).
    Exception(u32, u32),
    /// `PREPARE TRANSACTION`, then `COMMIT PREPARED` or `ROLLBACK PREPARED`
    /// after `delay` ms.
    Prepared {
        events: u32,
        commit: bool,
        delay: u32,
    },
    /// `events` events, then the transaction stays open `delay` ms before
    /// it commits (across a fault, or an operator's remedy).
    Slow {
        events: u32,
        delay: u32,
    },
    /// One transaction of `n` events written by one statement.
    Big(u32),
    /// `n` rows into an unpublished table, then one outbox event.
    Unpublished(u32),
    /// One event of a hostile kind, committed.
    Hostile(Hostile),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hostile {
    /// `CC` header naming a queue's binding the row must not reach.
    Cc,
    /// Row headers forging the relay's own `x-outbox-*` keys.
    ForgedHeaders,
    /// A headers column of megabytes.
    HugeHeaders,
    /// CR/LF in the aggregate id.
    NewlineId,
    /// With a templated exchange: one that does not exist.
    MissingExchange,
    /// With a templated exchange: the default exchange (`""`).
    EmptyExchange,
}

const HOSTILE: [Hostile; 6] = [
    Hostile::Cc,
    Hostile::ForgedHeaders,
    Hostile::HugeHeaders,
    Hostile::NewlineId,
    Hostile::MissingExchange,
    Hostile::EmptyExchange,
];

impl Hostile {
    fn name(self) -> &'static str {
        match self {
            Hostile::Cc => "cc",
            Hostile::ForgedHeaders => "forged-headers",
            Hostile::HugeHeaders => "huge-headers",
            Hostile::NewlineId => "newline-id",
            Hostile::MissingExchange => "missing-exchange",
            Hostile::EmptyExchange => "empty-exchange",
        }
    }
}

/// What the nemesis (or an operator) does. Durations in ms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// `kill -9` of the relay; restarted after `down`.
    Kill9 {
        down: u32,
    },
    /// `SIGSTOP`, `SIGCONT` after `ms`.
    Pause {
        ms: u32,
    },
    /// A second relay on the same config; `ms` later the first is killed
    /// (`kill -9`) and the second carries on.
    Takeover {
        ms: u32,
    },
    BrokerRestart {
        ms: u32,
    },
    MemoryAlarm {
        ms: u32,
    },
    /// The consumer stops draining the (bounded) queue for `ms`.
    FullQueue {
        ms: u32,
    },
    PgRestart,
    TerminateWalsender,
    /// The walsender stopped (`SIGSTOP`) with its socket open for `ms`.
    StopWalsender {
        ms: u32,
    },
    /// The relay's slot dropped under it (`on_slot_lost = "recover"`);
    /// with `kill`, the relay is killed (`kill -9`, restarted at once)
    /// that many ms into the recovery that follows, so that a recovery is
    /// resumed from its record (saved each second, hence up to 4 s);
    /// `graceful`: stopped by SIGTERM instead (a deploy), which records
    /// the last confirmed row exactly.
    DropSlot {
        kill: Option<u32>,
        graceful: bool,
    },
    /// The proxy in front of PostgreSQL (`pg`) or RabbitMQ stops moving
    /// bytes for `ms`, connections open.
    Stall {
        pg: bool,
        ms: u32,
    },
    /// The proxy closes every connection.
    Cut {
        pg: bool,
    },
    /// The proxy ends the relay's side of every connection (the relay
    /// reads end-of-file; its writes still go through).
    HalfClose {
        pg: bool,
    },
    /// `ALTER TABLE ... ADD COLUMN`: the relay follows.
    AddColumn,
    /// The (first) outbox table dropped and created again: the relay stops
    /// naming `republish --since`, and the operator does what it says.
    Recreate,
    /// With a partitioned outbox: a new partition attached.
    AttachPartition,
    /// Operators' commands while the relay runs.
    Prune,
    Republish,
    SetupCmd,
}

/// A run's plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    pub seed: u64,
    pub setup: Setup,
    /// Per producer: (pause before, transaction).
    pub producers: Vec<Vec<(u32, Tx)>>,
    /// (gap before, fault), done one after the other.
    pub faults: Vec<(u32, Fault)>,
}

/// How big a run is drawn.
#[derive(Debug, Clone, Copy)]
pub struct Size {
    pub producers: usize,
    pub txs: usize,
    pub faults: usize,
}

impl Schedule {
    /// The plan `seed` stands for.
    pub fn generate(seed: u64, size: Size) -> Schedule {
        let mut r = Rng::new(seed);
        let shape = Shape::ALL[r.below(4) as usize];
        let setup = Setup {
            shape,
            wal_sender_timeout: *r.pick(&[4, 10, 60]),
            templated: r.one_in(3),
            grace: *r.pick(&[1, 10]),
            bounded_queue: r.one_in(3),
            channels: 1,
        };
        let producers = (0..size.producers)
            .map(|_| {
                (0..size.txs)
                    .map(|_| (r.range(0, 60) as u32, tx(&mut r, &setup)))
                    .collect()
            })
            .collect();
        let mut faults: Vec<(u32, Fault)> = Vec::new();
        while faults.len() < size.faults {
            let f = (r.range(500, 3000) as u32, fault(&mut r, &setup));
            // A lost slot and a dropped table in one run can lose rows for
            // good, whatever the relay does: once no slot holds their WAL
            // and the table is gone, nothing has them. Either, not both.
            let gone = |f: &Fault| matches!(f, Fault::DropSlot { .. } | Fault::Recreate);
            if gone(&f.1)
                && faults.iter().any(|(_, x)| {
                    gone(x) && std::mem::discriminant(x) != std::mem::discriminant(&f.1)
                })
            {
                continue;
            }
            faults.push(f);
        }
        let setup = Setup {
            channels: *r.pick(&[1, 1, 2, 4]),
            ..setup
        };
        Schedule {
            seed,
            setup,
            producers,
            faults,
        }
    }
}

fn tx(r: &mut Rng, setup: &Setup) -> Tx {
    let small = |r: &mut Rng| r.range(1, 6) as u32;
    match r.below(100) {
        0..=41 => Tx::Commit(small(r)),
        42..=44 => Tx::Slow {
            events: small(r),
            delay: r.range(500, 8000) as u32,
        },
        45..=54 => Tx::Rollback(small(r)),
        55..=60 => Tx::SavepointRollback(small(r), small(r)),
        61..=66 => Tx::SavepointRelease(small(r), small(r)),
        67..=71 => Tx::Exception(small(r), small(r)),
        72..=77 => Tx::Prepared {
            events: small(r),
            commit: r.one_in(2),
            delay: r.range(0, 1500) as u32,
        },
        // Mostly hundreds to thousands, once in a while 100k.
        78..=83 => Tx::Big(if r.one_in(30) {
            100_000
        } else {
            r.range(100, 2000) as u32
        }),
        // Once in a while 5M rows: their replay, with nothing for the
        // relay, outlasts a short wal_sender_timeout (a busy walsender is
        // not a dead one).
        84..=88 => Tx::Unpublished(if r.one_in(8) {
            5_000_000
        } else {
            *r.pick(&[10_000, 200_000, 1_000_000])
        }),
        _ => {
            let pool: Vec<Hostile> = HOSTILE
                .iter()
                .copied()
                .filter(|h| {
                    setup.templated
                        || !matches!(h, Hostile::MissingExchange | Hostile::EmptyExchange)
                })
                .collect();
            Tx::Hostile(*r.pick(&pool))
        }
    }
}

fn fault(r: &mut Rng, setup: &Setup) -> Fault {
    loop {
        let f = match r.below(19) {
            0 => Fault::Kill9 {
                down: r.range(0, 1000) as u32,
            },
            1 => Fault::Pause {
                ms: r.range(200, 4000) as u32,
            },
            2 => Fault::Takeover {
                ms: r.range(500, 3000) as u32,
            },
            3 => Fault::BrokerRestart {
                ms: r.range(200, 2000) as u32,
            },
            4 => Fault::MemoryAlarm {
                ms: r.range(500, 4000) as u32,
            },
            5 => Fault::FullQueue {
                ms: r.range(500, 4000) as u32,
            },
            6 => Fault::PgRestart,
            7 => Fault::TerminateWalsender,
            8 => Fault::StopWalsender {
                ms: r.range(500, 8000) as u32,
            },
            9 => {
                let kill = r.one_in(2).then(|| r.range(0, 4000) as u32);
                Fault::DropSlot {
                    kill,
                    graceful: kill.is_some() && r.one_in(2),
                }
            }
            10 => Fault::Stall {
                pg: r.one_in(2),
                ms: r.range(200, 8000) as u32,
            },
            11 => Fault::Cut { pg: r.one_in(2) },
            12 => Fault::HalfClose { pg: r.one_in(2) },
            13 => Fault::AddColumn,
            14 => Fault::Recreate,
            15 => Fault::AttachPartition,
            16 => Fault::Prune,
            17 => Fault::Republish,
            _ => Fault::SetupCmd,
        };
        let fits = match f {
            Fault::FullQueue { .. } => setup.bounded_queue,
            Fault::AttachPartition => setup.shape == Shape::Partitioned,
            // Logical messages written while the slot is gone are in no
            // table: nothing can re-publish them (README, "recover").
            Fault::DropSlot { .. } => setup.shape != Shape::Messages,
            _ => true,
        };
        if fits {
            return f;
        }
    }
}

impl Tx {
    /// Outbox events it writes (committed or not).
    pub fn events(&self) -> u32 {
        match *self {
            Tx::Commit(n) | Tx::Rollback(n) | Tx::Big(n) => n,
            Tx::SavepointRollback(n, m) | Tx::SavepointRelease(n, m) | Tx::Exception(n, m) => {
                2 * n + m
            }
            Tx::Prepared { events, .. } | Tx::Slow { events, .. } => events,
            Tx::Unpublished(_) | Tx::Hostile(_) => 1,
        }
    }
}

// ------------------------------------------------------------ text form

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.setup;
        writeln!(f, "seed {}", self.seed)?;
        writeln!(
            f,
            "setup {} wal_sender_timeout={} templated={} grace={} bounded_queue={} channels={}",
            s.shape.name(),
            s.wal_sender_timeout,
            s.templated,
            s.grace,
            s.bounded_queue,
            s.channels
        )?;
        for (i, p) in self.producers.iter().enumerate() {
            for (pause, t) in p {
                writeln!(f, "p{i} +{pause} {t}")?;
            }
        }
        for (gap, x) in &self.faults {
            writeln!(f, "fault +{gap} {x}")?;
        }
        Ok(())
    }
}

impl fmt::Display for Tx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tx::Commit(n) => write!(f, "commit {n}"),
            Tx::Rollback(n) => write!(f, "rollback {n}"),
            Tx::SavepointRollback(n, m) => write!(f, "savepoint-rollback {n} {m}"),
            Tx::SavepointRelease(n, m) => write!(f, "savepoint-release {n} {m}"),
            Tx::Exception(n, m) => write!(f, "exception {n} {m}"),
            Tx::Prepared {
                events,
                commit,
                delay,
            } => write!(
                f,
                "prepared {events} {} {delay}",
                if *commit { "commit" } else { "rollback" }
            ),
            Tx::Slow { events, delay } => write!(f, "slow {events} {delay}"),
            Tx::Big(n) => write!(f, "big {n}"),
            Tx::Unpublished(n) => write!(f, "unpublished {n}"),
            Tx::Hostile(h) => write!(f, "hostile {}", h.name()),
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let side = |pg: bool| if pg { "pg" } else { "amqp" };
        match self {
            Fault::Kill9 { down } => write!(f, "kill9 {down}"),
            Fault::Pause { ms } => write!(f, "pause {ms}"),
            Fault::Takeover { ms } => write!(f, "takeover {ms}"),
            Fault::BrokerRestart { ms } => write!(f, "broker-restart {ms}"),
            Fault::MemoryAlarm { ms } => write!(f, "memory-alarm {ms}"),
            Fault::FullQueue { ms } => write!(f, "full-queue {ms}"),
            Fault::PgRestart => write!(f, "pg-restart"),
            Fault::TerminateWalsender => write!(f, "terminate-walsender"),
            Fault::StopWalsender { ms } => write!(f, "stop-walsender {ms}"),
            Fault::DropSlot { kill: None, .. } => write!(f, "drop-slot"),
            Fault::DropSlot {
                kill: Some(ms),
                graceful,
            } => write!(
                f,
                "drop-slot {} {ms}",
                if *graceful { "term" } else { "kill" }
            ),
            Fault::Stall { pg, ms } => write!(f, "stall {} {ms}", side(*pg)),
            Fault::Cut { pg } => write!(f, "cut {}", side(*pg)),
            Fault::HalfClose { pg } => write!(f, "half-close {}", side(*pg)),
            Fault::AddColumn => write!(f, "add-column"),
            Fault::Recreate => write!(f, "recreate"),
            Fault::AttachPartition => write!(f, "attach-partition"),
            Fault::Prune => write!(f, "prune"),
            Fault::Republish => write!(f, "republish"),
            Fault::SetupCmd => write!(f, "setup"),
        }
    }
}

impl Fault {
    /// The fault's kind, for the report.
    pub fn kind(&self) -> String {
        let text = self.to_string();
        let mut words = text.split(' ');
        let first = words.next().unwrap_or_default();
        match self {
            Fault::Stall { .. } | Fault::Cut { .. } | Fault::HalfClose { .. } => {
                format!("{first} {}", words.next().unwrap_or_default())
            }
            _ => first.to_owned(),
        }
    }
}

impl FromStr for Schedule {
    type Err = String;

    fn from_str(text: &str) -> Result<Schedule, String> {
        let mut seed = None;
        let mut setup = None;
        let mut producers: Vec<Vec<(u32, Tx)>> = Vec::new();
        let mut faults = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |what: &str| format!("schedule line {}: {what}: {line:?}", n + 1);
            let w: Vec<&str> = line.split_whitespace().collect();
            let num = |i: usize| -> Result<u32, String> {
                w.get(i)
                    .and_then(|s| s.trim_start_matches('+').parse().ok())
                    .ok_or_else(|| bad("a number expected"))
            };
            match w[0] {
                "seed" => {
                    seed = Some(
                        w.get(1)
                            .and_then(|s| s.parse().ok())
                            .ok_or_else(|| bad("seed"))?,
                    )
                }
                "setup" => setup = Some(parse_setup(&w[1..]).ok_or_else(|| bad("setup"))?),
                "fault" => {
                    faults.push((num(1)?, parse_fault(&w[2..]).ok_or_else(|| bad("fault"))?))
                }
                p if p.starts_with('p') => {
                    let i: usize = p[1..].parse().map_err(|_| bad("producer"))?;
                    if producers.len() <= i {
                        producers.resize(i + 1, Vec::new());
                    }
                    producers[i].push((
                        num(1)?,
                        parse_tx(&w[2..]).ok_or_else(|| bad("transaction"))?,
                    ));
                }
                _ => return Err(bad("unknown step")),
            }
        }
        Ok(Schedule {
            seed: seed.ok_or("schedule: no seed line")?,
            setup: setup.ok_or("schedule: no setup line")?,
            producers,
            faults,
        })
    }
}

fn parse_setup(w: &[&str]) -> Option<Setup> {
    let first = *w.first()?;
    let shape = *Shape::ALL.iter().find(|s| s.name() == first)?;
    let get = |k: &str| w.iter().find_map(|x| x.strip_prefix(k)?.strip_prefix('='));
    Some(Setup {
        shape,
        wal_sender_timeout: get("wal_sender_timeout")?.parse().ok()?,
        templated: get("templated")?.parse().ok()?,
        grace: get("grace")?.parse().ok()?,
        bounded_queue: get("bounded_queue")?.parse().ok()?,
        // Absent from schedules written before it was drawn.
        channels: get("channels").map_or(Some(1), |c| c.parse().ok())?,
    })
}

fn parse_tx(w: &[&str]) -> Option<Tx> {
    let n = |i: usize| w.get(i)?.parse::<u32>().ok();
    Some(match *w.first()? {
        "commit" => Tx::Commit(n(1)?),
        "rollback" => Tx::Rollback(n(1)?),
        "savepoint-rollback" => Tx::SavepointRollback(n(1)?, n(2)?),
        "savepoint-release" => Tx::SavepointRelease(n(1)?, n(2)?),
        "exception" => Tx::Exception(n(1)?, n(2)?),
        "prepared" => Tx::Prepared {
            events: n(1)?,
            commit: *w.get(2)? == "commit",
            delay: n(3)?,
        },
        "slow" => Tx::Slow {
            events: n(1)?,
            delay: n(2)?,
        },
        "big" => Tx::Big(n(1)?),
        "unpublished" => Tx::Unpublished(n(1)?),
        "hostile" => Tx::Hostile(
            *HOSTILE
                .iter()
                .find(|h| h.name() == *w.get(1).unwrap_or(&""))?,
        ),
        _ => return None,
    })
}

fn parse_fault(w: &[&str]) -> Option<Fault> {
    let n = |i: usize| w.get(i)?.parse::<u32>().ok();
    let pg = |i: usize| match *w.get(i)? {
        "pg" => Some(true),
        "amqp" => Some(false),
        _ => None,
    };
    Some(match *w.first()? {
        "kill9" => Fault::Kill9 { down: n(1)? },
        "pause" => Fault::Pause { ms: n(1)? },
        "takeover" => Fault::Takeover { ms: n(1)? },
        "broker-restart" => Fault::BrokerRestart { ms: n(1)? },
        "memory-alarm" => Fault::MemoryAlarm { ms: n(1)? },
        "full-queue" => Fault::FullQueue { ms: n(1)? },
        "pg-restart" => Fault::PgRestart,
        "terminate-walsender" => Fault::TerminateWalsender,
        "stop-walsender" => Fault::StopWalsender { ms: n(1)? },
        "drop-slot" => match w.get(1) {
            None => Fault::DropSlot {
                kill: None,
                graceful: false,
            },
            Some(&"kill") => Fault::DropSlot {
                kill: Some(n(2)?),
                graceful: false,
            },
            Some(&"term") => Fault::DropSlot {
                kill: Some(n(2)?),
                graceful: true,
            },
            Some(_) => return None,
        },
        "stall" => Fault::Stall {
            pg: pg(1)?,
            ms: n(2)?,
        },
        "cut" => Fault::Cut { pg: pg(1)? },
        "half-close" => Fault::HalfClose { pg: pg(1)? },
        "add-column" => Fault::AddColumn,
        "recreate" => Fault::Recreate,
        "attach-partition" => Fault::AttachPartition,
        "prune" => Fault::Prune,
        "republish" => Fault::Republish,
        "setup" => Fault::SetupCmd,
        _ => return None,
    })
}

/// The text form reads back as the schedule it shows (a replayed seed or
/// a kept regression is the run it names), and a setup line written
/// before `channels` was drawn reads as one channel.
pub fn self_check() -> Result<(), String> {
    let size = Size {
        producers: 3,
        txs: 30,
        faults: 6,
    };
    let mut several = false;
    for seed in 0..64 {
        let s = Schedule::generate(seed, size);
        several |= s.setup.channels > 1;
        let back: Schedule = s.to_string().parse()?;
        if back != s {
            return Err(format!("seed {seed}: its text reads back otherwise"));
        }
        let old: String = (s.to_string().lines())
            .map(|l| match l.split_once(" channels=") {
                Some((before, _)) => format!("{before}\n"),
                None => format!("{l}\n"),
            })
            .collect();
        let old: Schedule = old.parse()?;
        if old.setup.channels != 1 {
            return Err(format!(
                "seed {seed}: a setup without channels= reads as {}",
                old.setup.channels
            ));
        }
    }
    if !several {
        return Err("no seed of 0..64 draws several channels".into());
    }
    Ok(())
}
