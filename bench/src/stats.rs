//! Percentiles of samples, and of a Prometheus histogram.

use serde::Serialize;

/// Latency summary in milliseconds.
#[derive(Debug, Clone, Copy, Serialize, Default)]
pub struct Percentiles {
    pub count: u64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
}

/// Nearest-rank percentiles of latencies given in microseconds.
pub fn percentiles(mut us: Vec<i64>) -> Percentiles {
    if us.is_empty() {
        return Percentiles::default();
    }
    us.sort_unstable();
    let n = us.len();
    let at = |q: f64| {
        let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
        us[rank - 1] as f64 / 1000.0
    };
    Percentiles {
        count: n as u64,
        mean_ms: us.iter().map(|&v| v as f64).sum::<f64>() / n as f64 / 1000.0,
        p50_ms: at(0.50),
        p90_ms: at(0.90),
        p99_ms: at(0.99),
        p999_ms: at(0.999),
        max_ms: us[n - 1] as f64 / 1000.0,
    }
}

/// A cumulative Prometheus histogram: `(le, count)` buckets, sum, count.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Histogram {
    pub buckets: Vec<(f64, f64)>,
    pub sum: f64,
    pub count: f64,
}

impl Histogram {
    /// Parses metric `name` out of Prometheus text exposition.
    pub fn parse(text: &str, name: &str) -> Option<Histogram> {
        let mut h = Histogram::default();
        let bucket = format!("{name}_bucket{{");
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix(&bucket) {
                let le = rest.split("le=\"").nth(1)?.split('"').next()?;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                let v: f64 = rest.rsplit(' ').next()?.parse().ok()?;
                h.buckets.push((le, v));
            } else if let Some(v) = line.strip_prefix(&format!("{name}_sum ")) {
                h.sum = v.trim().parse().ok()?;
            } else if let Some(v) = line.strip_prefix(&format!("{name}_count ")) {
                h.count = v.trim().parse().ok()?;
            }
        }
        h.buckets
            .sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal));
        (!h.buckets.is_empty()).then_some(h)
    }

    /// What was observed between `before` and `self`.
    pub fn minus(&self, before: &Histogram) -> Histogram {
        Histogram {
            buckets: self
                .buckets
                .iter()
                .map(|&(le, v)| {
                    let b = before
                        .buckets
                        .iter()
                        .find(|(l, _)| *l == le)
                        .map_or(0.0, |x| x.1);
                    (le, v - b)
                })
                .collect(),
            sum: self.sum - before.sum,
            count: self.count - before.count,
        }
    }

    /// Quantile `q` in seconds, interpolated linearly inside its bucket (as
    /// Prometheus' histogram_quantile does); `None` without observations.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let rank = q * self.count;
        let mut lower = 0.0;
        let mut below = 0.0;
        for &(le, cum) in &self.buckets {
            if cum >= rank {
                if le.is_infinite() {
                    return Some(lower);
                }
                let inside = cum - below;
                let frac = if inside > 0.0 {
                    (rank - below) / inside
                } else {
                    1.0
                };
                return Some(lower + (le - lower) * frac);
            }
            lower = le;
            below = cum;
        }
        Some(lower)
    }

    /// The upper bound of the bucket holding quantile `q` (a safe ceiling).
    pub fn quantile_upper(&self, q: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let rank = q * self.count;
        self.buckets
            .iter()
            .find(|(_, cum)| *cum >= rank)
            .map(|&(le, _)| le)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let p = percentiles((1..=100).map(|v| v * 1000).collect());
        assert_eq!(p.p50_ms, 50.0);
        assert_eq!(p.p99_ms, 99.0);
        assert_eq!(p.max_ms, 100.0);
    }

    #[test]
    fn histogram_quantile() {
        let text = "x_bucket{le=\"0.001\"} 50\nx_bucket{le=\"0.01\"} 100\nx_bucket{le=\"+Inf\"} 100\nx_sum 0.3\nx_count 100\n";
        let h = Histogram::parse(text, "x").unwrap();
        assert!((h.quantile(0.5).unwrap() - 0.001).abs() < 1e-9);
        assert!((h.quantile(0.75).unwrap() - 0.0055).abs() < 1e-9);
        assert_eq!(h.quantile_upper(0.99), Some(0.01));
    }
}
