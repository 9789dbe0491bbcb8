//! The report's views, as text and as JSON. All of them read the replayed Profile.
use std::fmt::Write as _;

use serde_json::{Value, json};

use crate::view::{
    export::{flame_roots, folded},
    tree,
};
use crate::{
    cli::{ReportArgs, View},
    error::{Error, Result},
    profile::Profile,
    record::Recording,
    run_info::TargetKind,
    view::json as doc,
    view::summary::{processes, summary},
    view::units::bytes,
    view::{names::Names, site_tables},
};

fn need_size(args: &ReportArgs) -> Result<u64> {
    args.size
        .ok_or_else(|| Error::Usage("report filter needs --size BYTES".into()))
}

fn overview_head(rec: &Recording) -> String {
    let h = &rec.header;
    let elapsed = rec
        .end
        .as_ref()
        .map(|e| e.elapsed_ms)
        .or(rec.last_elapsed_ms)
        .unwrap_or(0);
    let target = match h.target_mode {
        TargetKind::Command => format!(
            "command `{}` (pid {})",
            h.command.join(" "),
            h.pids
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
        TargetKind::Pid => format!(
            "pid {} ({})",
            h.pids.first().copied().unwrap_or(0),
            h.cmdlines.first().map(|c| c.1.as_str()).unwrap_or("?")
        ),
        TargetKind::All => {
            crate::view::summary::all_processes(h.comm.as_deref(), h.cgroup.as_deref())
        }
    };
    let mut s = String::new();
    let _ = writeln!(s, "target: {target}");
    let _ = writeln!(
        s,
        "recorded by heaptrace {} on {} (kernel {}), {:.1} s in {} rounds of {} ms, mode {}{}",
        h.heaptrace_version,
        h.host,
        h.kernel,
        elapsed as f64 / 1000.0,
        rec.round_count,
        h.interval_ms,
        h.mode,
        match h.run_info().collector {
            crate::run_info::Collector::InProcess => ", counted in process",
            crate::run_info::Collector::InProcessAttached => ", counted in process (attached)",
            crate::run_info::Collector::Kernel => "",
        }
    );
    let _ = writeln!(s, "allocator: {}", h.provider);
    if let Some(end) = &rec.end {
        let _ = writeln!(s, "end: {}", end.reason);
    } else {
        let _ = writeln!(s, "end: not recorded (the recording was cut short)");
    }
    s
}

pub fn text(
    view: View,
    rec: &Recording,
    p: &Profile,
    names: &Names,
    args: &ReportArgs,
) -> Result<String> {
    let top = args.top;
    // Every view but the overview (whose summary says it) and the folded stacks (a format
    // other tools read) begins with the sampling rate when there was one.
    let head = match view {
        View::Overview | View::Flame => String::new(),
        _ => crate::view::summary::sampling_line(p.sample_bytes),
    };
    Ok(head
        + &match view {
            View::Overview => {
                let mut s = overview_head(rec);
                s += &summary(p, args.pid, &rec.header.aliases());
                // A group (`--group-by command`) stands for several processes.
                if p.procs.len() > 1
                    || p.procs
                        .keys()
                        .any(|k| crate::profile::grouped::is_group(*k))
                {
                    s += &processes(p, top);
                }
                s
            }
            View::Timeline => timeline(p),
            View::Histogram => histogram(p, args.pid),
            View::Filter => {
                let size = need_size(args)?;
                let mut s = format!("sites that allocated exactly {size} bytes:\n");
                if p.sample_bytes > 0 {
                    s += "  (counts of sampled allocations; [no stack: not sampled] has the others)\n";
                }
                let rows: Vec<_> = p.sites_with_size(size).into_iter().take(top).collect();
                let ids: Vec<_> = rows.iter().map(|r| r.0).collect();
                for ((_, n), label) in rows.iter().zip(site_tables::labels(p, &ids, names)) {
                    let _ = writeln!(s, "  {n:>9} x  {label}");
                }
                s
            }
            View::Tree => tree::render(&tree::build(p, names, args.reverse), top),
            View::Hotspots => {
                site_tables::wrappers_note(p).unwrap_or_default()
                    + &site_tables::top_by_calls(p, top, names)
                    + &site_tables::top_by_bytes(p, top, names)
            }
            View::Flame => {
                folded(p, names, args.by, flame_roots(p, args.merge_processes)).join("\n") + "\n"
            }
            View::Leaks => site_tables::leaks(p, top, names),
            View::Temporary => site_tables::temporary(p, top, rec.header.temporary(), names),
            View::Peak => site_tables::peak(p, top, names),
            View::Memory => match crate::view::summary::memory(p, top, attached(rec)) {
                s if s.is_empty() => "no memory reservations recorded\n".into(),
                s => s,
            },
        })
}

/// A view as a JSON document. The long per-stack lists are made as the document is written;
/// `tree` holds the call tree the `tree` view's document reads.
pub fn json<'a>(
    view: View,
    rec: &Recording,
    p: &'a Profile,
    names: &Names,
    args: &ReportArgs,
    tree: &'a mut Option<tree::Node>,
) -> Result<doc::Node<'a>> {
    let h = &rec.header;
    Ok(match view {
        View::Overview => {
            let info = h.run_info();
            let exit_code = rec.end.as_ref().and_then(|e| e.exit_code);
            return Ok(doc::document(p, &doc::Run::described(&info, exit_code)));
        }
        View::Timeline => serde_json::to_value(&p.rounds).unwrap_or(Value::Null),
        View::Histogram => return Ok(doc::sizes(p, args.pid)),
        View::Filter => {
            let size = need_size(args)?;
            return Ok(doc::Node::list(move || {
                let w = p.wrappers();
                p.sites_with_size(size).into_iter().map(move |(id, n)| {
                    let mut m = doc::site(p, &w, &id);
                    m.insert("count".into(), n.into());
                    Value::Object(m)
                })
            }));
        }
        View::Tree => return Ok(tree::json(tree.insert(tree::build(p, names, args.reverse)))),
        View::Hotspots => json!({
            "sample_bytes": p.sample_bytes,
            "estimated": p.sample_bytes > 0,
            "by_calls": p.top_sites(args.top, |t| t.calls as i64).iter()
                .map(|(id, t)| { let mut m = doc::site(p, &p.wrappers(), id); m.insert("calls".into(), t.calls.into()); m.insert("bytes".into(), t.bytes.into()); Value::Object(m) })
                .collect::<Vec<_>>(),
            "by_bytes": p.top_sites(args.top, |t| t.bytes as i64).iter()
                .map(|(id, t)| { let mut m = doc::site(p, &p.wrappers(), id); m.insert("calls".into(), t.calls.into()); m.insert("bytes".into(), t.bytes.into()); Value::Object(m) })
                .collect::<Vec<_>>(),
        }),
        View::Flame => folded(p, names, args.by, flame_roots(p, args.merge_processes))
            .iter()
            .filter_map(|l| {
                let (stack, v) = l.rsplit_once(' ')?;
                Some(json!({ "stack": stack, "value": v.parse::<u64>().ok()? }))
            })
            .collect(),
        View::Leaks => return Ok(doc::leaks(p, args.pid)),
        View::Temporary => return Ok(doc::temporary(p, h.temporary())),
        View::Peak => return Ok(doc::peak(p)),
        View::Memory => {
            return Ok(doc::Node::object([
                ("processes", doc::memory_by_process(p).into()),
                ("reservations", doc::reservations(p)),
            ]));
        }
    }
    .into())
}

fn timeline(p: &Profile) -> String {
    // Three kinds of column: what a row's rounds did, the state at its end, and a running sum.
    let row = match p.timeline_step {
        0 | 1 => "a row per round".to_string(),
        n => format!("a row per {n} rounds"),
    };
    // A sum of RSS counts the pages processes share once per process.
    let rss = match p.rounds.iter().map(|r| r.rss_processes).max().unwrap_or(0) {
        0 | 1 => "RSS",
        _ => "sum of RSS",
    };
    let mut s = format!(
        "{row}: allocs and frees made in it; live and {rss} at its end; allocated since the start\n\
         {:>8} {:>10} {:>10} {:>12} {:>12} {:>10} {:>14}\n",
        "time", "allocs", "frees", "live blocks", "live", "RSS", "allocated"
    );
    let mut cumulative = 0u64;
    for r in &p.rounds {
        cumulative += r.bytes_allocated;
        let _ = writeln!(
            s,
            "{:>7.1}s {:>10} {:>10} {:>12} {:>12} {:>10} {:>14}",
            r.elapsed_ms as f64 / 1000.0,
            r.allocations,
            r.frees,
            // Calls mode keeps no live map.
            if p.calls {
                "-".into()
            } else {
                r.live_blocks.to_string()
            },
            if p.calls {
                "-".into()
            } else {
                bytes(r.live_bytes)
            },
            if r.rss_kb > 0 {
                bytes(r.rss_kb as i64 * 1024)
            } else {
                "-".into()
            },
            bytes(cumulative as i64)
        );
    }
    s
}

fn histogram(p: &Profile, pid: Option<u32>) -> String {
    let mut by_size: std::collections::BTreeMap<u64, u64> = Default::default();
    for ((_, size), n) in p.sizes_by_func(pid) {
        *by_size.entry(size).or_default() += n;
    }
    let max = by_size.values().copied().max().unwrap_or(1).max(1);
    let mut s = format!("{:>12} {:>12}\n", "size", "count");
    for (size, n) in by_size {
        let bar = "#".repeat(((n as f64 / max as f64) * 40.0).ceil() as usize);
        let _ = writeln!(s, "{size:>12} {n:>12} {bar}");
    }
    s
}

/// Whether the recorded trace began with processes already running (see `summary::memory`).
fn attached(rec: &crate::record::Recording) -> bool {
    rec.header.target_mode != crate::run_info::TargetKind::Command
}
