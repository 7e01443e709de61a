//! Shrinking a failing schedule: faults, transactions and producers are
//! taken away, a chunk at a time, while the run still fails, within a
//! budget of runs (each is a whole run against the real servers).

use crate::run;
use crate::schedule::Schedule;

/// The smallest failing schedule found within `budget` runs.
pub async fn shrink(failing: &Schedule, budget: usize) -> Schedule {
    let mut best = failing.clone();
    let mut runs = 0;
    let mut chunk = best.faults.len().max(1).div_ceil(2);
    // Faults first (they dominate a run's time), halves, then one by one.
    loop {
        let mut progressed = false;
        for (label, candidate) in candidates(&best, chunk) {
            if runs >= budget {
                return best;
            }
            runs += 1;
            let r = run::bounded(&candidate).await;
            println!(
                "checker: shrink run {runs}/{budget} ({label}): {}",
                if r.failed() {
                    "still fails, kept"
                } else {
                    "passes, undone"
                }
            );
            if r.failed() {
                best = candidate;
                progressed = true;
                break;
            }
        }
        if !progressed {
            if chunk == 1 {
                return best;
            }
            chunk = chunk.div_ceil(2);
        }
    }
}

/// Smaller schedules: `chunk` faults away, half of a producer's
/// transactions away, a producer away.
fn candidates(s: &Schedule, chunk: usize) -> Vec<(String, Schedule)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < s.faults.len() {
        let mut c = s.clone();
        let end = (i + chunk).min(c.faults.len());
        c.faults.drain(i..end);
        out.push((format!("without faults {i}..{end}"), c));
        i += chunk;
    }
    for p in 0..s.producers.len() {
        let n = s.producers[p].len();
        if n > 1 {
            for half in [0, 1] {
                let mut c = s.clone();
                let keep: Vec<_> = if half == 0 {
                    c.producers[p][..n / 2].to_vec()
                } else {
                    c.producers[p][n / 2..].to_vec()
                };
                c.producers[p] = keep;
                out.push((format!("p{p} with half its transactions"), c));
            }
        }
        if s.producers.len() > 1 {
            let mut c = s.clone();
            c.producers.remove(p);
            out.push((format!("without p{p}"), c));
        }
    }
    out
}
