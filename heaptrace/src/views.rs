//! Text views of where the heap goes (stacks mode): top sites, leaks, temporaries, peak,
//! lifetimes and latency. They read only the Profile.
use std::fmt::Write as _;

use heaptrace_common::Func;

use crate::{
    aggregate::Profile, hist::percentiles, model::SiteId, report::bytes, symbolize::Frame,
};

/// "function (file:line)", with the file's base name.
pub fn frame_label(f: &Frame) -> String {
    match (&f.file, f.line) {
        (Some(file), Some(line)) => {
            let base = file.rsplit('/').next().unwrap_or(file);
            format!("{} ({base}:{line})", f.function)
        }
        _ => f.function.clone(),
    }
}

/// A site in one line: the allocating function, then the innermost frames.
pub fn site_label(profile: &Profile, site: &SiteId, depth: usize) -> String {
    let func = Func::from_u32(site.2).map(|f| f.name()).unwrap_or("?");
    let frames: Vec<String> = profile
        .frames(site)
        .iter()
        .take(depth)
        .map(frame_label)
        .collect();
    format!("{func} <- {}", frames.join(" <- "))
}

fn pid_prefix(profile: &Profile, site: &SiteId) -> String {
    if profile.procs.len() > 1 {
        format!("[{}] ", site.0)
    } else {
        String::new()
    }
}

pub fn nanos(ns: u64) -> String {
    match ns {
        0..1_000 => format!("{ns} ns"),
        1_000..1_000_000 => format!("{:.1} us", ns as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} ms", ns as f64 / 1e6),
        _ => format!("{:.2} s", ns as f64 / 1e9),
    }
}

pub fn sites(profile: &Profile, top: usize, temporary_ms: u64) -> String {
    let mut s = String::new();
    let depth = 4;
    let _ = writeln!(s, "\ntop sites by bytes allocated:");
    for (id, t) in profile.top_sites(top, |t| t.bytes as i64) {
        let life = percentiles(&t.lifetimes, 1024)
            .map(|p| format!(", lifetime p50 {}", nanos(p.p50)))
            .unwrap_or_default();
        let _ = writeln!(
            s,
            "  {:>10} {:>9} calls, live {:>10}{life}  {}{}",
            bytes(t.bytes as i64),
            t.calls,
            bytes(t.live_bytes),
            pid_prefix(profile, &id),
            site_label(profile, &id, depth)
        );
    }
    let _ = writeln!(s, "top sites by calls:");
    for (id, t) in profile.top_sites(top, |t| t.calls as i64) {
        let _ = writeln!(
            s,
            "  {:>9} calls {:>10}  {}{}",
            t.calls,
            bytes(t.bytes as i64),
            pid_prefix(profile, &id),
            site_label(profile, &id, depth)
        );
    }
    let leaks = profile.top_leaks(top);
    if !leaks.is_empty() {
        let _ = writeln!(s, "not freed at the end, by site:");
        for (id, l) in leaks {
            let _ = writeln!(
                s,
                "  {:>10} in {:>7} blocks  {}{}",
                bytes(l.bytes as i64),
                l.blocks,
                pid_prefix(profile, &id),
                site_label(profile, &id, depth)
            );
        }
    }
    let temp = profile.top_sites(top, |t| t.temp_blocks as i64);
    if !temp.is_empty() {
        let _ = writeln!(s, "temporary (freed within {temporary_ms} ms), by site:");
        for (id, t) in temp {
            let _ = writeln!(
                s,
                "  {:>9} of {:>9} blocks ({:>10})  {}{}",
                t.temp_blocks,
                t.calls,
                bytes(t.temp_bytes as i64),
                pid_prefix(profile, &id),
                site_label(profile, &id, depth)
            );
        }
    }
    if let Some(peak) = &profile.peak
        && peak.live_bytes > 0
    {
        let _ = writeln!(
            s,
            "peak: {} live in {} blocks at {:.1}s (round {}), held by:",
            bytes(peak.live_bytes),
            peak.live_blocks,
            peak.elapsed_ms as f64 / 1000.0,
            peak.round
        );
        for (id, blocks, b) in peak.sites.iter().take(top) {
            let _ = writeln!(
                s,
                "  {:>10} in {:>7} blocks  {}{}",
                bytes(*b),
                blocks,
                pid_prefix(profile, id),
                site_label(profile, id, depth)
            );
        }
    }
    s
}

pub fn latency(profile: &Profile) -> String {
    let mut s = String::new();
    let rows: Vec<String> = Func::ALL
        .iter()
        .filter_map(|f| {
            let p = percentiles(&profile.latency[*f as usize], 1)?;
            Some(format!(
                "  {:<16} {:>10} {:>10} {:>10} {:>10}",
                f.name(),
                p.count,
                nanos(p.p50),
                nanos(p.p99),
                nanos(p.max)
            ))
        })
        .collect();
    if !rows.is_empty() {
        let _ = writeln!(
            s,
            "\ntime per call, entry to return (power-of-two buckets):\n  {:<16} {:>10} {:>10} {:>10} {:>10}",
            "function", "calls", "p50", "p99", "max <"
        );
        for r in rows {
            let _ = writeln!(s, "{r}");
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::SiteTotals;

    fn frame(function: &str, file: Option<&str>, line: Option<u32>) -> Frame {
        Frame {
            function: function.into(),
            file: file.map(Into::into),
            line,
            module: "m".into(),
            offset: 0,
            inlined: false,
        }
    }

    #[test]
    fn labels_sites_innermost_first() {
        let mut p = Profile::default();
        p.stacks.insert(
            (1, 5),
            vec![
                frame("alloc_a", Some("/src/fx.c"), Some(12)),
                frame("main", None, None),
            ]
            .into(),
        );
        assert_eq!(
            site_label(&p, &(1, 5, 0), 4),
            "malloc <- alloc_a (fx.c:12) <- main"
        );
        assert_eq!(
            site_label(&p, &(1, -17, 1), 4),
            "calloc <- [stack lost: errno 17]"
        );
    }

    #[test]
    fn sites_view_lists_sites_by_bytes_and_leaks() {
        let mut p = Profile::default();
        p.stacks
            .insert((1, 5), vec![frame("big", None, None)].into());
        p.stacks
            .insert((1, 6), vec![frame("small", None, None)].into());
        let site = |calls, bytes| SiteTotals {
            calls,
            bytes,
            ..Default::default()
        };
        p.sites.insert((1, 5, 0), site(1, 1000));
        p.sites.insert((1, 6, 0), site(10, 10));
        let mut leaks = std::collections::BTreeMap::new();
        leaks.insert(
            (1, 6, 0),
            crate::aggregate::Leak {
                blocks: 2,
                bytes: 2,
            },
        );
        p.leaks = Some(leaks);
        let text = sites(&p, 5, 1000);
        let by_bytes = text.split("top sites by calls").next().unwrap();
        assert!(
            by_bytes.find("big").unwrap() < by_bytes.find("small").unwrap(),
            "{text}"
        );
        let by_calls = text.split("top sites by calls").nth(1).unwrap();
        assert!(
            by_calls.find("small").unwrap() < by_calls.find("big").unwrap(),
            "{text}"
        );
        assert!(text.contains("not freed at the end"), "{text}");
        assert!(nanos(1500).contains("1.5 us"));
    }
}
