//! chart.svg: throughput and latency per design, drawn by hand (no plotting crate).

use super::*;

pub(super) fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

const RELAY: &str = "#1f77b4";
const POLLING: &str = "#d62728";
const BROKER: &str = "#7f7f7f";
const DECODE: &str = "#2ca02c";

pub(super) fn svg(r: &Report) -> String {
    let width = 1060.0;
    let label_w = 330.0;
    let bar_w = width - label_w - 170.0;
    let row_h = 22.0;
    let mut rows: Vec<(String, f64, &str)> = Vec::new();
    for q in &r.queue_types {
        let qt = &q.queue_type;
        if let Some(d) = &q.relay {
            rows.push((format!("relay drain ({qt})"), d.events_per_s, RELAY));
        }
        if let Some(d) = &q.polling {
            rows.push((
                format!("polling dispatcher drain ({qt})"),
                d.events_per_s,
                POLLING,
            ));
        }
        for p in &q.publishers {
            rows.push((format!("broker: {} ({qt})", p.name), p.events_per_s, BROKER));
        }
        if let Some(d) = &q.decode {
            rows.push((
                format!("PostgreSQL decode, pg_recvlogical ({qt})"),
                d.rows_per_s,
                DECODE,
            ));
        }
    }
    // The scale is set by the designs and the broker; PostgreSQL's decode
    // rate, usually far higher, is drawn cut off with its value.
    let max = rows
        .iter()
        .filter(|r| r.2 != DECODE)
        .map(|r| r.1)
        .fold(1.0, f64::max)
        * 1.15;
    // Latency rows: (label, p50, p99, max) in ms.
    let mut lrows: Vec<(String, f64, f64, f64, &str)> = Vec::new();
    for l in &r.latency {
        let color = if l.design == "relay" { RELAY } else { POLLING };
        let c = &l.commit_to_consume;
        lrows.push((
            format!(
                "{} @ {}/s: commit→consume",
                l.design,
                num(l.target_rate as f64)
            ),
            c.p50_ms,
            c.p99_ms,
            c.max_ms,
            color,
        ));
        let f = &l.commit_to_confirm;
        lrows.push((
            format!(
                "{} @ {}/s: commit→confirm{}",
                l.design,
                num(l.target_rate as f64),
                if l.commit_to_confirm_measured {
                    ""
                } else {
                    " (est.)"
                }
            ),
            f.p50_ms,
            f.p99_ms,
            f.max_ms,
            color,
        ));
    }
    let top1 = 82.0;
    let h1 = rows.len() as f64 * row_h;
    let top2 = top1 + h1 + 90.0;
    let h2 = lrows.len() as f64 * row_h;
    let height = top2 + h2 + 70.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="10" y="24" font-size="16" font-weight="bold">outbox-relay benchmark — {}</text>"#,
        esc(&r.started_at)
    );
    let _ = writeln!(
        s,
        r#"<text x="10" y="{}" font-size="14" font-weight="bold">Throughput, events/s ({} events; higher is better)</text>"#,
        top1 - 32.0,
        num(r.settings.events as f64)
    );
    for (i, (color, what)) in [
        (RELAY, "relay"),
        (POLLING, "polling dispatcher"),
        (BROKER, "bare publishers (broker ceiling)"),
        (DECODE, "PostgreSQL decode limit"),
    ]
    .iter()
    .enumerate()
    {
        let x = 10.0 + i as f64 * 240.0;
        let _ = writeln!(
            s,
            r#"<rect x="{x}" y="{}" width="12" height="12" fill="{color}"/><text x="{}" y="{}">{what}</text>"#,
            top1 - 24.0,
            x + 16.0,
            top1 - 14.0
        );
    }
    for (i, (label, v, color)) in rows.iter().enumerate() {
        let y = top1 + i as f64 * row_h;
        let cut = *v > max;
        let w = (v.min(max) / max * bar_w).max(1.0);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{}</text><rect x="{label_w}" y="{}" width="{w:.1}" height="{}" fill="{color}"/><text x="{}" y="{}">{}</text>"#,
            label_w - 8.0,
            y + 15.0,
            esc(label),
            y + 3.0,
            row_h - 6.0,
            label_w + w + 5.0,
            y + 15.0,
            if cut {
                format!("» {} (off scale)", num(*v))
            } else {
                num(*v)
            }
        );
    }
    if !lrows.is_empty() {
        let _ = writeln!(
            s,
            r#"<text x="10" y="{}" font-size="14" font-weight="bold">Latency under load, ms, log scale ({} queue; lower is better)</text>"#,
            top2 - 30.0,
            esc(&r.settings.latency_queue_type)
        );
        let _ = writeln!(
            s,
            r##"<text x="10" y="{}" fill="#444">dark: p50 · medium: p99 · light: max (relay commit→confirm max: its histogram bucket's upper bound)</text>"##,
            top2 - 12.0
        );
        let lo: f64 = 0.1;
        let hi = lrows
            .iter()
            .flat_map(|r| [r.1, r.2, r.3])
            .filter(|v| v.is_finite())
            .fold(10.0, f64::max)
            * 1.5;
        let x = |v: f64| {
            let v = v.max(lo);
            label_w + (v.ln() - lo.ln()) / (hi.ln() - lo.ln()) * bar_w
        };
        // Decade grid lines.
        let mut d = lo;
        while d <= hi {
            let gx = x(d);
            let _ = writeln!(
                s,
                r##"<line x1="{gx:.1}" y1="{}" x2="{gx:.1}" y2="{}" stroke="#ddd"/><text x="{gx:.1}" y="{}" text-anchor="middle" fill="#666">{}</text>"##,
                top2 - 4.0,
                top2 + h2,
                top2 + h2 + 14.0,
                if d < 1.0 { format!("{d}") } else { num(d) }
            );
            d *= 10.0;
        }
        for (i, (label, p50, p99, pmax, color)) in lrows.iter().enumerate() {
            let y = top2 + i as f64 * row_h;
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
                label_w - 8.0,
                y + 15.0,
                esc(label)
            );
            for (v, op) in [(*pmax, 0.25), (*p99, 0.55), (*p50, 1.0)] {
                if v.is_finite() && v > 0.0 {
                    let _ = writeln!(
                        s,
                        r#"<rect x="{label_w}" y="{}" width="{:.1}" height="{}" fill="{color}" fill-opacity="{op}"/>"#,
                        y + 3.0,
                        (x(v) - label_w).max(1.0),
                        row_h - 6.0
                    );
                }
            }
            let end = [*pmax, *p99, *p50]
                .into_iter()
                .find(|v| v.is_finite() && *v > 0.0)
                .unwrap_or(lo);
            let _ = writeln!(
                s,
                r##"<text x="{:.1}" y="{}" fill="#333">{} / {} / {}</text>"##,
                x(end) + 5.0,
                y + 15.0,
                ms(*p50),
                ms(*p99),
                ms(*pmax)
            );
        }
    }
    s.push_str("</svg>\n");
    s
}
