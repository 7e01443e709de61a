//! Resume keys: where a row sits in a read, as recorded, and what a record means for a table.

use std::sync::Arc;

use super::Selection;

/// Where a row sits: its table, the tables a read had finished before it,
/// then its `created_at` and its place in the table's order, in text form.
///
/// With a `sequence` column, that order is the order rows were written, in
/// and across transactions (where writes to one aggregate are serialized,
/// its commit order). Without one it is `(created_at, tableoid, ctid)`:
/// rows of one transaction share `created_at` (its start), the partitions
/// of a partitioned outbox hand out the same ctids (so the partition is
/// part of the key), and within one partition the physical order is
/// usually, not always, the order rows were written: an insert can land in
/// space vacuum freed before an earlier row of the same transaction. (A
/// `VACUUM FULL` or `CLUSTER` during a recovery moves rows: the ctid key
/// then skips or repeats some; do not run one then.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    /// The outbox (index in `Config::outboxes`).
    pub outbox: usize,
    /// Its table, as `schema.table`.
    pub table: String,
    /// Tables wholly read (and, once this row is confirmed, confirmed)
    /// before this one.
    pub done: Arc<[String]>,
    /// `created_at::text`.
    pub created: String,
    /// `<tableoid>/<ctid>`, or the `sequence` column's value.
    pub id: String,
}

/// A recovery's resume key as recorded: which tables are done, which one
/// it is in, and after which row.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Place {
    done: Vec<String>,
    at: String,
}

impl Key {
    /// As recorded in the checkpoint table: `(created_at, "#<place> <id>")`
    /// where the place names tables, not positions in the config, so that
    /// a config changed between two runs of a recovery cannot make it skip
    /// a table.
    pub fn to_record(&self) -> (String, String) {
        let place = Place {
            done: self.done.to_vec(),
            at: self.table.clone(),
        };
        let place = serde_json::to_string(&place).unwrap_or_default();
        (self.created.clone(), format!("#{place} {}", self.id))
    }
}

/// What a recorded resume key means for one table.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Resume {
    /// Wholly confirmed already: skip it.
    Done,
    /// Resume after this key (`created_at`, then its place or sequence value).
    After(String, String),
    /// From the window's start.
    Start,
}

/// What the record `after` says of `table`, when the config's tables are
/// `tables`. A record of the single-table versions (no `#`) applies to the
/// table of a single-table config only; any record that cannot be placed
/// restarts every table from the window's start: more sent, none lost.
fn resume(after: &(String, String), table: &str, tables: &[String]) -> Resume {
    let (created, id) = after;
    let Some(rest) = id.strip_prefix('#') else {
        return match tables {
            [only] if only == table => Resume::After(created.clone(), id.clone()),
            _ => Resume::Start,
        };
    };
    let parsed = rest
        .rsplit_once(' ')
        .and_then(|(place, ctid)| Some((serde_json::from_str::<Place>(place).ok()?, ctid)));
    let Some((place, ctid)) = parsed else {
        return Resume::Start;
    };
    if place.at == table {
        Resume::After(created.clone(), ctid.to_owned())
    } else if place.done.iter().any(|d| d == table) {
        Resume::Done
    } else {
        Resume::Start
    }
}

/// What `sel` means for the table of outbox `t` (of the tables `tables`,
/// by name): `None` when a window's resume key says it is done, else the
/// selection with the key that applies to it.
pub(super) fn for_table(sel: &Selection, t: &str, tables: &[String]) -> Option<Selection> {
    let Selection::Window {
        since,
        commit_ts,
        after: Some(after),
    } = sel
    else {
        return Some(sel.clone());
    };
    let after = match resume(after, t, tables) {
        Resume::Done => return None,
        Resume::After(created, id) => Some((created, id)),
        Resume::Start => None,
    };
    Some(Selection::Window {
        since: since.clone(),
        commit_ts: *commit_ts,
        after,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resume_keys_name_tables_not_positions() {
        let tables: Vec<String> = ["s.a", "s.b", "s.c"].map(String::from).to_vec();
        let key = Key {
            outbox: 1,
            table: "s.b".into(),
            done: Arc::from(vec!["s.a".to_owned()]),
            created: "2026-12-01 10:00:00+00".into(),
            id: "16384/(0,5)".into(),
        };
        let rec = key.to_record();
        assert_eq!(resume(&rec, "s.a", &tables), Resume::Done);
        assert_eq!(
            resume(&rec, "s.b", &tables),
            Resume::After(key.created.clone(), "16384/(0,5)".into())
        );
        assert_eq!(resume(&rec, "s.c", &tables), Resume::Start);
        // Reordered, or a table added before it: still by name.
        let reordered: Vec<String> = ["s.x", "s.b", "s.a"].map(String::from).to_vec();
        assert_eq!(resume(&rec, "s.x", &reordered), Resume::Start);
        assert_eq!(resume(&rec, "s.a", &reordered), Resume::Done);
        // A name with a space or a quote survives the record.
        let odd = Key {
            table: "\"my schema\".\"a b\"".into(),
            done: Arc::from(Vec::new()),
            ..key.clone()
        };
        assert!(matches!(
            resume(&odd.to_record(), &odd.table, &tables),
            Resume::After(..)
        ));
        // A single-table version's record: that table, if it is the only one.
        let legacy = ("t".to_owned(), "(0,7)".to_owned());
        let one = vec!["s.a".to_owned()];
        assert_eq!(
            resume(&legacy, "s.a", &one),
            Resume::After("t".into(), "(0,7)".into())
        );
        assert_eq!(resume(&legacy, "s.a", &tables), Resume::Start);
        // Garbage: from the start.
        let junk = ("t".to_owned(), "#{not json (0,1)".to_owned());
        assert_eq!(resume(&junk, "s.a", &tables), Resume::Start);
        let sel = Selection::Window {
            since: "s".into(),
            commit_ts: false,
            after: Some(rec),
        };
        assert!(for_table(&sel, "s.a", &tables).is_none());
        assert!(matches!(
            for_table(&sel, "s.c", &tables),
            Some(Selection::Window { after: None, .. })
        ));
    }
}
