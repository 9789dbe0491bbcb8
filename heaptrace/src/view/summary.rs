//! Text views of a Profile: the line printed each round and the final summary.
use std::fmt::Write as _;

use heaptrace_common::{Func, Loss};

use crate::drain::round::Totals;
use crate::profile::{Profile, TimelineRow};
use crate::view::{lower_bound, units::bytes};

/// A system-wide trace's target, with what `--comm` and `--cgroup` narrowed it to: the words
/// every output (the attach line, the live view, a recording's report) gives it.
pub fn all_processes(comm: Option<&str>, cgroup: Option<&str>) -> String {
    match (comm, cgroup) {
        (None, None) => "all processes".into(),
        (Some(c), None) => format!("all processes whose name contains {c:?}"),
        (None, Some(g)) => format!("all processes whose cgroup path contains {g:?}"),
        (Some(c), Some(g)) => {
            format!("all processes whose name contains {c:?} and cgroup path contains {g:?}")
        }
    }
}

/// "~" before a figure that sampling made an estimate.
pub fn est(sample_bytes: u64) -> &'static str {
    if sample_bytes > 0 { "~" } else { "" }
}

pub fn round_line(row: &TimelineRow, profile: &Profile) -> String {
    let sample_bytes = profile.sample_bytes;
    let e = est(sample_bytes);
    let mut s = format!(
        "[{:>7.1}s] round {}: {} allocs, {} frees, {} allocated",
        row.elapsed_ms as f64 / 1000.0,
        row.index,
        row.allocations,
        row.frees,
        bytes(row.bytes_allocated as i64),
    );
    if !profile.calls {
        let at_least = lower_bound::prefix(lower_bound::untracked(profile, None));
        let _ = write!(
            s,
            ", live {at_least}{e}{} blocks / {e}{}",
            row.live_blocks,
            bytes(row.live_bytes)
        );
    }
    if row.reserved_bytes > 0 {
        let _ = write!(s, ", reserved {}", bytes(row.reserved_bytes as i64));
    }
    if row.rss_kb > 0 {
        let _ = write!(
            s,
            ", {} {}",
            rss_label(row),
            bytes(row.rss_kb as i64 * 1024)
        );
    }
    if sample_bytes > 0 {
        let _ = write!(s, " (sampled 1/{sample_bytes} B)");
    }
    s
}

/// What a row's RSS is: one process's, or a sum over several that counts their shared pages
/// (a database's buffers, a pre-forked server's copy-on-write heap) once per process.
pub fn rss_label(row: &TimelineRow) -> String {
    match row.rss_processes {
        0 | 1 => "RSS".into(),
        n => format!("sum of RSS of {n} processes"),
    }
}

/// The sampling line of every text output: what was sampled and which figures estimate.
pub fn sampling_line(sample_bytes: u64) -> String {
    if sample_bytes == 0 {
        return String::new();
    }
    format!(
        "sampling: {}; per-function counts and sizes are exact, figures marked ~ (sites, \
         live, leaks, peak, temporaries) are estimates from the sampled allocations\n",
        crate::profile::sampling::describe(sample_bytes)
    )
}

/// The memory behind malloc, per process (most reserved first, at most `top`): requested and
/// still live, held by the allocator, RSS and VIRT; then the sites that reserved the most.
/// `attached`: the trace began with processes already running (`-p`, `--all`), whose arenas
/// and mapped blocks made before it are not known: said, rather than shown as nothing.
pub fn memory(profile: &Profile, top: usize, attached: bool) -> String {
    let mut procs: Vec<_> = profile
        .procs
        .iter()
        .filter_map(|(pid, p)| p.reserved.map(|r| (*pid, p, r)))
        .collect();
    if procs.is_empty() {
        return String::new();
    }
    procs.sort_by_key(|(pid, _, r)| (std::cmp::Reverse(r.total()), *pid));
    let mut s = String::from(if attached {
        "memory behind malloc (arenas and mapped blocks: those made since the attach; a process \
         running before it may hold more, in its RSS):\n"
    } else {
        "memory behind malloc:\n"
    });
    if procs.iter().any(|(_, p, _)| p.resident.is_some()) {
        s.push_str(
            "  (resident: Rss of the brk heap and private anonymous mappings but threads' stacks, \
             from smaps at the end, made before the attach too: the allocator's, with any other \
             anonymous memory of the program; an estimate)\n",
        );
    }
    for (pid, p, r) in procs.iter().take(top) {
        let pid = crate::profile::incarnation::Pid(*pid);
        let _ = writeln!(
            s,
            "  pid {pid} {}: requested and live {}{}; allocator holds {} (heap {}, arenas {}, \
             mmapped {}{}){}; RSS {}; VIRT {}",
            p.comm,
            est(profile.sample_bytes),
            bytes(p.totals.live_bytes),
            bytes(r.total() as i64),
            bytes(r.heap as i64),
            bytes(r.arenas as i64),
            bytes(r.mmapped as i64),
            match r.pymalloc {
                0 => String::new(),
                b => format!(", pymalloc arenas {}", bytes(b as i64)),
            },
            p.resident.map_or(String::new(), |m| format!(
                "; resident ~{}{}",
                bytes(m.total() as i64),
                if m.truncated { " or more" } else { "" }
            )),
            p.mem.map_or("?".into(), |m| bytes(m.rss_kb as i64 * 1024)),
            p.mem.map_or("?".into(), |m| bytes(m.virt_kb as i64 * 1024)),
        );
    }
    reservation_lines(&mut s, profile, top);
    s
}

/// The sites that reserved the most, one line each: lines that would read alike (a pymalloc
/// arena's Python line, reached through several native stacks) are one, their figures summed.
fn reservation_lines(s: &mut String, profile: &Profile, top: usize) {
    use crate::reserve::{Area, Kind};
    // (process, kind, label) -> (calls, bytes, bytes given back)
    let mut lines: std::collections::HashMap<(u32, Kind, String), (u64, u64, u64)> =
        Default::default();
    for (&(pid, kind, stack_id, func), t) in &profile.reservations {
        if kind.of().is_some() {
            continue;
        }
        let site = (pid, stack_id, func);
        let label = match kind {
            Kind::Pymalloc => python_line(profile, &site),
            _ => None,
        }
        .unwrap_or_else(|| match stack_id {
            heaptrace_common::NO_SITE => Func::from_u32(func).map_or("?", |f| f.name()).into(),
            _ => crate::view::site_tables::site_label(profile, &site, 2),
        });
        let back = match kind {
            Kind::Arena => Some(Area::Arena),
            Kind::Mmap => Some(Area::Mmap),
            Kind::Pymalloc => Some(Area::Pymalloc),
            _ => None,
        }
        .and_then(|of| {
            profile
                .reservations
                .get(&(pid, Kind::Munmap { of }, stack_id, func))
        })
        .map_or(0, |b| b.bytes);
        let e = lines.entry((pid, kind, label)).or_default();
        (e.0, e.1, e.2) = (e.0 + t.calls, e.1 + t.bytes, e.2 + back);
    }
    let mut lines: Vec<_> = lines.into_iter().collect();
    lines.sort_by(|a, b| (b.1.1, &a.0).cmp(&(a.1.1, &b.0)));
    for ((pid, kind, site), (calls, made, back)) in lines.into_iter().take(top) {
        let back = match back {
            0 => String::new(),
            b => format!(" ({} given back)", bytes(b as i64)),
        };
        let _ = writeln!(
            s,
            "  {calls:>6} {:<5} {:>10}{back}  pid {}: {site}",
            kind.name(),
            bytes(made as i64),
            crate::profile::incarnation::Pid(pid),
        );
    }
}

/// A pymalloc arena's site: the innermost Python frame of its stack (the line whose object
/// needed a new arena), as `function (file:line)`.
fn python_line(profile: &Profile, site: &crate::drain::round::SiteId) -> Option<String> {
    let frames = profile.frames(site);
    let f = frames
        .iter()
        .find(|f| &*f.module == crate::unwind::python::PYTHON_MODULE)?;
    let file = f.file.as_deref().unwrap_or("?");
    let base = file.rsplit('/').next().unwrap_or(file);
    Some(format!("{} ({base}:{})", f.function, f.line.unwrap_or(0)))
}

/// Functions shown in tables: every family member except those probed as another's alias.
pub fn shown_funcs(aliased: &[Func]) -> impl Iterator<Item = Func> + '_ {
    Func::ALL.into_iter().filter(move |f| !aliased.contains(f))
}

pub fn summary(profile: &Profile, pid: Option<u32>, aliased: &[(Func, Func)]) -> String {
    let totals = match pid {
        Some(p) => profile.procs.get(&p).map(|p| p.totals).unwrap_or_default(),
        None => profile.totals(),
    };
    let hidden: Vec<Func> = aliased.iter().map(|(a, _)| *a).collect();
    let mut s = sampling_line(profile.sample_bytes);
    if profile.calls {
        s.push_str(CALLS_LINE);
    }
    let e = est(profile.sample_bytes);
    let _ = writeln!(
        s,
        "{:<24} {:>12} {:>16} {:>8}",
        "function", "calls", "bytes", "failed"
    );
    for f in shown_funcs(&hidden) {
        let t = totals.func(f);
        let mut name = f.name().to_string();
        for (a, of) in aliased {
            if *of == f {
                let _ = write!(name, "/{}", a.name());
            }
        }
        if f == Func::Free && profile.calls {
            let _ = writeln!(s, "{:<24} {:>12} {:>16} {:>8}", name, t.calls, "-", "-");
        } else if f == Func::Free && profile.sample_bytes > 0 {
            // Frees of blocks that were not sampled miss the live map, like untracked ones,
            // and their sizes are not known: the two cannot be told apart.
            let _ = writeln!(
                s,
                "{:<24} {:>12} {:>16} {:>8}   ({} of blocks not sampled or not seen allocated)",
                name, t.calls, "-", "-", totals.untracked_frees
            );
        } else if f == Func::Free {
            let _ = writeln!(
                s,
                "{:<24} {:>12} {:>16} {:>8}   ({} untracked: of blocks not seen allocated)",
                name, t.calls, t.bytes, "-", totals.untracked_frees
            );
        } else {
            let _ = writeln!(
                s,
                "{:<24} {:>12} {:>16} {:>8}",
                name, t.calls, t.bytes, t.failed
            );
        }
    }
    let _ = writeln!(
        s,
        "realloc: {} moved, {} in place, {} realloc(p, 0) frees",
        totals.realloc_moves, totals.realloc_in_place, totals.realloc_frees
    );
    let _ = write!(
        s,
        "total: {} allocations, {} frees, {} allocated",
        totals.allocations(),
        totals.frees(),
        bytes(totals.bytes_allocated() as i64),
    );
    if profile.calls {
        s.push('\n');
    } else {
        let ended = if pid.is_none() {
            profile.ended_live()
        } else {
            (0, 0)
        };
        let untracked = lower_bound::untracked(profile, pid);
        let live = live(&totals, ended, profile.sample_bytes);
        let live = live.replacen(
            "live ",
            &format!("live {}", lower_bound::prefix(untracked)),
            1,
        );
        let _ = writeln!(s, "; {live}{}", lower_bound::why(untracked));
        if let Some(line) = before_attach_line(profile) {
            s.push_str(&line);
        }
        if let Some(line) = peak_line(profile, pid) {
            s.push_str(&line);
        }
    }
    if let Some(l) = profile.leak_totals(pid).filter(|_| !profile.calls) {
        let _ = writeln!(
            s,
            "not freed at the end: {e}{} blocks, {e}{} ({e}{} bytes)",
            l.blocks,
            bytes(l.bytes as i64),
            l.bytes
        );
    }
    let lost = losses(profile, pid);
    let _ = writeln!(
        s,
        "lost: {}",
        if lost.is_empty() {
            "none".to_string()
        } else {
            lost.join(", ")
        }
    );
    s
}

/// "live at attach ...": the blocks `-p` took in from a census of the heap, part of the live
/// figures, and how many of them were still live at the end.
pub fn before_attach_line(profile: &Profile) -> Option<String> {
    let b = profile.before_attach?;
    let mut line = format!(
        "live at attach (heap census): {} blocks / {}",
        b.blocks,
        bytes(b.bytes as i64)
    );
    if let Some(leaks) = &profile.leaks {
        let left = leaks
            .iter()
            .filter(|(id, _)| id.1 == heaptrace_common::BEFORE_ATTACH)
            .fold((0, 0), |(n, y), (_, l)| (n + l.blocks, y + l.bytes));
        let _ = write!(
            line,
            ", {} blocks / {} of them not freed at the end",
            left.0,
            bytes(left.1 as i64)
        );
    }
    if b.lost_blocks > 0 {
        let _ = write!(
            line,
            "; {} more did not fit in the live map (--live-map-size)",
            b.lost_blocks
        );
    }
    line.push('\n');
    Some(line)
}

/// "peak live heap ..." of one process (the kernel's, exact) or of the trace.
fn peak_line(profile: &Profile, pid: Option<u32>) -> Option<String> {
    let e = est(profile.sample_bytes);
    // Blocks where they are the peak's own (`PeakHeld`), not a round end's.
    let (bytes_at, blocks, how) = match pid {
        Some(p) => {
            let proc = profile.procs.get(&p)?;
            match proc.peak {
                Some(k) => {
                    let blocks = proc.peak_held.as_ref().map(|h| h.blocks as i64);
                    (k.bytes as i64, blocks, "at the allocation that reached it")
                }
                None => (profile.peak.as_ref()?.live_bytes, None, "at a round's end"),
            }
        }
        None => {
            let p = profile.peak.as_ref()?;
            let how = match p.exact {
                true => "one process's, at the allocation that reached it",
                false => "at a round's end",
            };
            (p.live_bytes, p.held.then_some(p.live_blocks), how)
        }
    };
    let untracked = lower_bound::untracked(profile, pid);
    let blocks = blocks.map_or(String::new(), |b| format!(" in {e}{b} blocks"));
    Some(format!(
        "peak live heap: {}{e}{}{blocks} ({how}{})\n",
        lower_bound::prefix(untracked),
        bytes(bytes_at),
        lower_bound::why_within(untracked)
    ))
}

/// "live N blocks / B" of `totals`. When processes that ended hold `ended` of them (system-wide
/// mode), those are told apart: their blocks went with them, and only the rest are live now.
pub fn live(totals: &Totals, ended: (i64, i64), sample_bytes: u64) -> String {
    let e = est(sample_bytes);
    if ended == (0, 0) {
        return format!(
            "live {e}{} blocks / {e}{}",
            totals.live_blocks,
            bytes(totals.live_bytes)
        );
    }
    format!(
        "live {e}{} blocks / {e}{} in running processes (ended ones left {e}{} blocks / {e}{})",
        totals.live_blocks - ended.0,
        bytes(totals.live_bytes - ended.1),
        ended.0,
        bytes(ended.1)
    )
}

/// What was lost, of process `pid` or of every process shown: "stack 12", ... When other
/// processes lost stacks too (filtered out, or an image dropped at its exec), the kernel's
/// count for every process traced follows: the stack maps are shared, so theirs take room.
pub fn losses(profile: &Profile, pid: Option<u32>) -> Vec<String> {
    let shown = profile.losses_of(pid);
    let files =
        (profile.unsafe_files > 0).then(|| format!("unsafe_files {}", profile.unsafe_files));
    let region = profile.region_lost;
    let overwritten = (region.region_overwritten > 0).then(|| {
        format!(
            "region_overwritten {} (the command wrote over heaptrace's region: its figures \
             are partly its own writing)",
            region.region_overwritten
        )
    });

    Loss::ALL
        .iter()
        .filter(|l| shown[**l as usize] > 0 || profile.losses[**l as usize] > 0)
        .map(|l| {
            let (n, all) = (shown[*l as usize], profile.losses[*l as usize]);
            let late = late_reads(profile)
                .filter(|_| matches!(l, Loss::Stack | Loss::SiteMap | Loss::SizeHistogram))
                .map_or(String::new(), |s| {
                    format!("; the reads came up to {s:.1} s apart")
                });
            let more = room_flag(*l, profile.collector)
                .map_or(String::new(), |f| format!(", raise {f}{late}"));
            if n == all && more.is_empty() {
                format!("{} {n}", l.name())
            } else if n == all {
                format!("{} {n} ({})", l.name(), &more[2..])
            } else {
                format!("{} {n} ({all} in all processes traced{more})", l.name())
            }
        })
        .chain(files)
        .chain(overwritten)
        .chain((region.nested_calls > 0).then(|| {
            format!(
                "nested_calls {} (signal handlers' calls inside a call being counted, in \
                 process: not counted)",
                region.nested_calls
            )
        }))
        .collect()
}

/// The longest time between two rounds' reads, in seconds, where it was at least twice their
/// mean: the maps that hold what is new since a read (stacks, sites, sizes) filled for want
/// of a read as much as of room (a daemon kept from the CPU on a busy host, or slow to name a
/// burst of new stacks).
fn late_reads(profile: &Profile) -> Option<f64> {
    let (first, last) = (profile.rounds.first()?, profile.rounds.last()?);
    let mean = (last.elapsed_ms.saturating_sub(first.elapsed_ms))
        .checked_div(last.index.checked_sub(first.index)?)?;
    (profile.max_round_gap_ms >= 2 * mean.max(1)).then(|| profile.max_round_gap_ms as f64 / 1e3)
}

/// The option that gives the kernel map (or the in-process region's table) behind a loss
/// more room, where one does (the guide: a loss names the flag that would have avoided it).
/// The rings' and the process map's are fixed.
pub fn room_flag(loss: Loss, collector: crate::run_info::Collector) -> Option<&'static str> {
    if collector.in_process() && loss == Loss::InFlight {
        return Some("--in-process-threads");
    }
    match loss {
        Loss::LiveMap => Some("--live-map-size"),
        Loss::SizeHistogram => Some("--size-map-size"),
        Loss::Stack => Some("--stack-map-size"),
        Loss::SiteMap => Some("--site-map-size"),
        Loss::UnwindTable => Some("--unwind-table-size"),
        Loss::InFlight
        | Loss::ProcessMap
        | Loss::ProcessEvents
        | Loss::MemEvents
        | Loss::UnwindNoRule
        | Loss::StackDepth
        | Loss::UnwindLate => None,
    }
}

/// The first line of a calls-mode summary: what it did not track.
pub const CALLS_LINE: &str = "calls mode: malloc counted at its entry, no live map: live blocks, \
     leaks and bytes freed are not tracked; malloc's failures are only requests above PTRDIFF_MAX\n";

/// The per-process breakdown of a system-wide trace, busiest first.
pub fn processes(profile: &Profile, top: usize) -> String {
    let mut rows: Vec<_> = profile.procs.iter().collect();
    rows.sort_by_key(|(_, p)| std::cmp::Reverse(p.totals.allocations() + p.totals.frees()));
    // A group's name ("cc1plus (40 processes)") is longer than a command's 15 bytes.
    let w = rows
        .iter()
        .take(top)
        .map(|(_, p)| p.comm.chars().count())
        .max()
        .unwrap_or(0)
        .clamp(16, 48);
    let mut s = format!(
        "{:>8} {:<w$} {:>12} {:>12} {:>14} {:>14}\n",
        "pid",
        "command",
        "allocs",
        "frees",
        "allocated",
        if profile.calls {
            "live".to_string()
        } else {
            format!("{}live", est(profile.sample_bytes))
        }
    );
    for (pid, p) in rows.iter().take(top) {
        let _ = writeln!(
            s,
            "{:>8} {:<w$} {:>12} {:>12} {:>14} {:>14}{}",
            crate::profile::incarnation::Pid(**pid),
            p.comm,
            p.totals.allocations(),
            p.totals.frees(),
            bytes(p.totals.bytes_allocated() as i64),
            if profile.calls {
                "-".to_string()
            } else {
                bytes(p.totals.live_bytes)
            },
            // Its live figure is what it had not freed when it ended.
            match (p.oom_killed, p.exited) {
                (true, _) => "  killed by the OOM killer",
                (false, true) => "  ended",
                (false, false) => "",
            }
        );
    }
    if rows.len() > top {
        let _ = writeln!(s, "... and {} more processes", rows.len() - top);
    }
    s
}

#[cfg(test)]
mod tests;
