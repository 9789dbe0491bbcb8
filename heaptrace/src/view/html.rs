//! `report FILE --export html`: one self-contained page to open in a browser, offline. The
//! figures go in as one JSON document (in a `<script type="application/json">`, every `<`, `>`
//! and `&` escaped, so no name from a recording can end the element); the page's own script
//! draws the charts, the flame graph and the tables with `textContent` only, never markup
//! built from the data. No request leaves the page: no external script, style, font or image.
use serde_json::{Value, json};

use crate::{
    drain::round::SiteId,
    profile::Profile,
    record::Recording,
    view::{names::Names, site_tables, summary},
};

const TEMPLATE: &str = include_str!("html/report.html");
/// Rows of each table; the flame graph takes every stack.
const TOP: usize = 50;

/// The whole page.
pub fn report(rec: &Recording, p: &Profile, names: &Names) -> String {
    let data = data(rec, p, names).to_string();
    // Inside a string every one of these is valid as a JSON escape, and outside strings JSON
    // has none of them.
    let data = data
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026");
    let title = html_escape(&title(rec));
    // Cut at the markers, not replaced in turn: a title holding "{{DATA}}" stays text.
    let (head, rest) = TEMPLATE
        .split_once("{{TITLE}}")
        .expect("the template's title");
    let (middle, tail) = rest.split_once("{{DATA}}").expect("the template's data");
    [head, &title, middle, &data, tail].concat()
}

fn title(rec: &Recording) -> String {
    format!("heaptrace: {}", target(rec))
}

/// What was traced, as the command line named it.
fn target(rec: &Recording) -> String {
    if rec.header.command.is_empty() {
        match rec.header.pids.as_slice() {
            [] => "all processes".to_string(),
            pids => format!(
                "pid {}",
                pids.iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    } else {
        rec.header.command.join(" ")
    }
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Everything the page shows.
fn data(rec: &Recording, p: &Profile, names: &Names) -> Value {
    let h = &rec.header;
    let t = p.totals();
    let leaks = p.leak_totals(None);
    json!({
        "title": title(rec),
        "run": {
            "target": target(rec),
            "command": h.command,
            "pids": h.pids,
            "mode": h.mode.name(),
            "host": h.host,
            "kernel": h.kernel,
            "start_unix_ms": h.start_unix_ms,
            "interval_ms": h.interval_ms,
            "allocator": h.provider,
            "heaptrace": h.heaptrace_version,
            "elapsed_ms": rec.end.as_ref().map(|e| e.elapsed_ms).or(rec.last_elapsed_ms),
            "end": rec.end.as_ref().map(|e| e.reason.clone()),
            "exit_code": rec.end.as_ref().and_then(|e| e.exit_code),
            "sample_bytes": p.sample_bytes,
        },
        "totals": {
            "allocations": t.allocations(),
            "frees": t.frees(),
            "bytes_allocated": t.bytes_allocated(),
            "leaked_blocks": leaks.map(|l| l.blocks),
            "leaked_bytes": leaks.map(|l| l.bytes),
        },
        "processes": processes(p),
        "timeline": timeline(p),
        "flame": stacks(p, names),
        "sites": sites(p, names),
        "leaks": leak_sites(p, names),
        "peak": p.peak.as_ref().map(|pk| json!({
            "live_bytes": pk.live_bytes,
            "live_blocks": pk.live_blocks,
            "elapsed_ms": pk.elapsed_ms,
            "held": pk.held,
            "sites": peak_sites(pk, p, names),
        })),
        "wrappers": site_tables::wrappers_note(p),
        "memory": summary::memory(
            p,
            TOP,
            rec.header.target_mode != crate::run_info::TargetKind::Command
        ),
    })
}

fn comm(p: &Profile, pid: u32) -> &str {
    p.procs.get(&pid).map_or("", |pp| pp.comm.as_str())
}

/// Every process traced, the busiest first: the page tells them apart when there are several.
fn processes(p: &Profile) -> Vec<Value> {
    let mut procs: Vec<_> = p.procs.iter().collect();
    procs.sort_by_key(|(pid, pp)| (std::cmp::Reverse(pp.totals.bytes_allocated()), **pid));
    procs
        .iter()
        .map(|(pid, pp)| {
            json!({
                "pid": pid,
                "comm": pp.comm,
                "allocations": pp.totals.allocations(),
                "bytes_allocated": pp.totals.bytes_allocated(),
                "live_bytes": pp.totals.live_bytes,
                "exited": pp.exited,
            })
        })
        .collect()
}

/// The top sites by bytes, each named as the summary names it (no two alike), with whose.
fn sites(p: &Profile, names: &Names) -> Vec<Value> {
    let rows = p.top_sites(TOP, |s| s.bytes as i64);
    let ids: Vec<SiteId> = rows.iter().map(|r| r.0).collect();
    let labels = site_tables::labels(p, &ids, names);
    rows.iter()
        .zip(labels)
        .map(|((id, s), label)| {
            json!({
                "pid": id.0,
                "comm": comm(p, id.0),
                "site": label,
                "calls": s.calls,
                "bytes": s.bytes,
                "live_bytes": s.live_bytes,
                "temporary_blocks": s.temp_blocks,
            })
        })
        .collect()
}

fn leak_sites(p: &Profile, names: &Names) -> Vec<Value> {
    let rows = p.top_leaks(TOP);
    let ids: Vec<SiteId> = rows.iter().map(|r| r.0).collect();
    let labels = site_tables::labels(p, &ids, names);
    rows.iter()
        .zip(labels)
        .map(|((id, l), label)| {
            json!({ "pid": id.0, "comm": comm(p, id.0), "site": label, "blocks": l.blocks, "bytes": l.bytes })
        })
        .collect()
}

fn peak_sites(pk: &crate::profile::Peak, p: &Profile, names: &Names) -> Vec<Value> {
    let rows: Vec<_> = pk.sites.iter().take(TOP).collect();
    let ids: Vec<SiteId> = rows.iter().map(|r| r.0).collect();
    let labels = site_tables::labels(p, &ids, names);
    rows.iter()
        .zip(labels)
        .map(|((id, blocks, bytes), label)| {
            json!({ "pid": id.0, "comm": comm(p, id.0), "site": label, "blocks": blocks, "bytes": bytes })
        })
        .collect()
}

/// The timeline's rows: time, live heap, RSS, and the allocation rate of each row.
fn timeline(p: &Profile) -> Vec<Value> {
    let mut prev_ms = 0u64;
    p.rounds
        .iter()
        .map(|r| {
            let span = r.elapsed_ms.saturating_sub(prev_ms).max(1);
            prev_ms = r.elapsed_ms;
            json!({
                "t_ms": r.elapsed_ms,
                "live_bytes": r.live_bytes,
                "rss_bytes": r.rss_kb * 1024,
                "allocations_per_s": r.allocations as f64 * 1000.0 / span as f64,
                "bytes_per_s": r.bytes_allocated as f64 * 1000.0 / span as f64,
            })
        })
        .collect()
}

/// Each stack once, `[frames, bytes, allocations, live bytes at the end, pid]`: its frames
/// outermost first, the allocating function last; the page picks the value for the width, and
/// merges the processes' stacks or roots each process's under a frame of its own.
fn stacks(p: &Profile, names: &Names) -> Vec<Value> {
    let mut ids: Vec<SiteId> = p.sites.keys().copied().collect();
    if let Some(l) = &p.leaks {
        ids.extend(l.keys().copied().filter(|k| !p.sites.contains_key(k)));
    }
    ids.iter()
        .filter_map(|id| {
            let site = p.sites.get(id);
            let bytes = site.map_or(0, |s| s.bytes);
            let calls = site.map_or(0, |s| s.calls);
            let live = p
                .leaks
                .as_ref()
                .and_then(|l| l.get(id))
                .map_or(0, |l| l.bytes);
            if bytes == 0 && calls == 0 && live == 0 {
                return None;
            }
            let mut frames: Vec<String> = p
                .frames(id)
                .iter()
                .rev()
                .map(|f| names.function(f))
                .collect();
            frames.push(
                heaptrace_common::Func::from_u32(id.2)
                    .map(|f| f.name())
                    .unwrap_or("?")
                    .into(),
            );
            Some(json!([frames, bytes, calls, live, id.0]))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_from_a_recording_cannot_break_out_of_the_page() {
        let mut rec = Recording::default();
        rec.header.command = vec!["</script><script>alert(1)</script>".into()];
        let page = report(&rec, &Profile::default(), &Names::SHORT);
        // The title is escaped as HTML, the data as JSON: one script element of each kind.
        assert!(!page.contains("<script>alert"), "{page}");
        assert!(page.contains("&lt;/script&gt;"));
        assert_eq!(page.matches("</script>").count(), 2, "data and code only");
        // Nothing is fetched when the page is opened (the SVG namespace is a name, not a
        // request).
        for needle in [
            "src=",
            "href=",
            "url(",
            "<link",
            "@import",
            "fetch(",
            "XMLHttpRequest",
            "WebSocket",
            "sendBeacon",
            "<iframe",
            "<img",
        ] {
            assert!(!page.contains(needle), "{needle}");
        }
    }
}
