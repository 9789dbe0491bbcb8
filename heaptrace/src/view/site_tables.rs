//! Text views of where the heap goes (stacks mode): top sites, leaks, temporaries, peak,
//! lifetimes and latency. They read only the Profile.
use std::fmt::Write as _;

use heaptrace_common::Func;

use crate::{
    drain::round::SiteId,
    profile::Profile,
    profile::histogram::percentiles,
    run_info::Temporary,
    symbolize::Frame,
    view::names::Names,
    view::units::{bytes, nanos},
};

/// "function (file:line)", with the file's base name.
pub fn frame_label(f: &Frame) -> String {
    Names::SHORT.label(f)
}

pub(crate) fn pid_prefix(profile: &Profile, site: &SiteId) -> String {
    // A group (`--group-by command`) by its command and count.
    if crate::profile::grouped::is_group(site.0) {
        let comm = profile.procs.get(&site.0).map_or("", |p| p.comm.as_str());
        return format!("[{comm}] ");
    }
    if profile.procs.len() > 1 {
        format!("[{}] ", crate::profile::incarnation::Pid(site.0))
    } else {
        String::new()
    }
}

/// The note on a title whose figures sampling made estimates.
pub fn estimated(profile: &Profile) -> String {
    if profile.sample_bytes == 0 {
        String::new()
    } else {
        format!(
            " (~ estimated from samples, 1 per {} bytes)",
            profile.sample_bytes
        )
    }
}

pub fn top_by_bytes(profile: &Profile, top: usize, names: &Names) -> String {
    let lifetimes = match profile.latency_sampled() {
        Some(n) => format!(" (lifetimes of 1 call in {n}, timed at random)"),
        None => String::new(),
    };
    let mut s = format!(
        "top sites by bytes allocated{}{lifetimes}:\n",
        estimated(profile)
    );
    let rows = profile.top_sites(top, |t| t.bytes as i64);
    let ids: Vec<SiteId> = rows.iter().map(|r| r.0).collect();
    for ((_, t), label) in rows.iter().zip(labels(profile, &ids, names)) {
        let life = percentiles(&t.lifetimes.dense(), 1024)
            .map(|p| format!(", lifetime p50 {}", nanos(p.p50)))
            .unwrap_or_default();
        let _ = writeln!(
            s,
            "  {:>10} {:>9} calls, live {:>10}{life}  {label}",
            bytes(t.bytes as i64),
            t.calls,
            bytes(t.live_bytes),
        );
    }
    s
}

pub fn top_by_calls(profile: &Profile, top: usize, names: &Names) -> String {
    let mut s = format!("top sites by calls{}:\n", estimated(profile));
    let rows = profile.top_sites(top, |t| t.calls as i64);
    let ids: Vec<SiteId> = rows.iter().map(|r| r.0).collect();
    for ((_, t), label) in rows.iter().zip(labels(profile, &ids, names)) {
        let _ = writeln!(
            s,
            "  {:>9} calls {:>10}  {label}",
            t.calls,
            bytes(t.bytes as i64),
        );
    }
    s
}

pub fn leaks(profile: &Profile, top: usize, names: &Names) -> String {
    let leaks = profile.top_leaks(top);
    if leaks.is_empty() {
        return String::new();
    }
    let mut s = format!("not freed at the end, by site{}:\n", estimated(profile));
    let ids: Vec<SiteId> = leaks.iter().map(|r| r.0).collect();
    for ((_, l), label) in leaks.iter().zip(labels(profile, &ids, names)) {
        let _ = writeln!(
            s,
            "  {:>10} in {:>7} blocks  {label}",
            bytes(l.bytes as i64),
            l.blocks,
        );
    }
    s
}

pub fn temporary(profile: &Profile, top: usize, rule: Temporary, names: &Names) -> String {
    let temp = profile.top_sites(top, |t| t.temp_blocks as i64);
    if temp.is_empty() {
        return String::new();
    }
    let mut s = format!("temporary ({rule}), by site{}:\n", estimated(profile));
    let ids: Vec<SiteId> = temp.iter().map(|r| r.0).collect();
    for ((_, t), label) in temp.iter().zip(labels(profile, &ids, names)) {
        let _ = writeln!(
            s,
            "  {:>9} of {:>9} blocks ({:>10})  {label}",
            t.temp_blocks,
            t.calls,
            bytes(t.temp_bytes as i64),
        );
    }
    s
}

pub fn peak(profile: &Profile, top: usize, names: &Names) -> String {
    let Some(peak) = profile.peak.as_ref().filter(|p| p.live_bytes > 0) else {
        return String::new();
    };
    let mut s = match peak.reached_by {
        // Taken by the kernel between two round ends, with what held it then.
        Some((pid, stack_id, size)) if peak.held => {
            let label = labels(profile, &[(pid, stack_id, u32::MAX)], names);
            format!(
                "peak: {} live in {} blocks, reached in round {} by {} from {}; held by:\n",
                bytes(peak.live_bytes),
                peak.live_blocks,
                peak.round,
                bytes(size as i64),
                label.first().map_or("?", |l| l.trim_start_matches("? <- ")),
            )
        }
        // Taken by the kernel where what held it then was not kept (a recording before
        // format 13): the sites are those of the round's end.
        Some((pid, stack_id, size)) => {
            let label = labels(profile, &[(pid, stack_id, u32::MAX)], names);
            format!(
                "peak: {} live, reached in round {} by {} from {}; at that round's end ({:.1}s) \
                 held by:\n",
                bytes(peak.live_bytes),
                peak.round,
                bytes(size as i64),
                label.first().map_or("?", |l| l.trim_start_matches("? <- ")),
                peak.elapsed_ms as f64 / 1000.0,
            )
        }
        None => format!(
            "peak: {} live in {} blocks at {:.1}s (round {}){}, held by:\n",
            bytes(peak.live_bytes),
            peak.live_blocks,
            peak.elapsed_ms as f64 / 1000.0,
            peak.round,
            estimated(profile)
        ),
    };
    let rows: Vec<_> = peak.sites.iter().take(top).collect();
    let ids: Vec<SiteId> = rows.iter().map(|r| r.0).collect();
    for ((_, blocks, b), label) in rows.iter().zip(labels(profile, &ids, names)) {
        let _ = writeln!(s, "  {:>10} in {:>7} blocks  {label}", bytes(*b), blocks);
    }
    s
}

/// Everything about sites, as printed at the end of a stacks-mode trace.
pub fn sites(profile: &Profile, top: usize, rule: Temporary, n: Names) -> String {
    format!(
        "\n{}{}{}{}{}{}{}",
        shallow_stacks(profile).unwrap_or_default(),
        wrappers_note(profile).unwrap_or_default(),
        top_by_bytes(profile, top, &n),
        top_by_calls(profile, top, &n),
        leaks(profile, top, &n),
        temporary(profile, top, rule, &n),
        peak(profile, top, &n)
    )
}

/// Why a stack ends short of main or a thread's start.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Cut {
    /// The stack maps had no room for the frames past the caller.
    MapFull,
    /// The unwind table had no room for this module's rows (`--unwind-table-size`).
    NoRoom(String),
    /// An ended process's stack folded with others' past the folded stacks' bound.
    Folded,
    /// The walk stopped at its depth with frames left.
    Depth,
    /// In this module neither frame pointers nor unwind rows led further.
    NoUnwind(String),
    /// In this module, walked before the process's unwind tables were loaded (by frame
    /// pointer only): `lost.unwind_late` counts such walks.
    Late(String),
}

impl Cut {
    fn of(frames: &[Frame]) -> Option<Cut> {
        // Whole when it reaches a bottom anywhere: a walk may go on past `main` into libc's
        // start frames, which a stripped libc names only by address.
        let bottom = |f: &Frame| crate::view::names::is_stack_bottom(&f.function);
        if frames.iter().any(bottom) {
            return None;
        }
        let last = frames.last()?;
        Some(if last.is_more_lost() {
            Cut::MapFull
        } else if last.is_no_room() {
            let module = frames.iter().rev().nth(1).map(|f| f.module.to_string());
            Cut::NoRoom(module.unwrap_or_default())
        } else if last.is_folded_other() {
            Cut::Folded
        } else if frames.len() >= heaptrace_common::STACK_FRAMES {
            Cut::Depth
        } else {
            Cut::NoUnwind(last.module.to_string())
        })
    }

    /// Where or why, for a short title (the live view's).
    pub fn brief(&self) -> String {
        match self {
            Cut::MapFull => "the stack maps were full".into(),
            Cut::NoRoom(module) => format!("in {module}, no room for its unwind rows"),
            Cut::Folded => "folded with other ended processes' stacks".into(),
            Cut::Depth => format!("at {} frames", heaptrace_common::STACK_FRAMES),
            Cut::NoUnwind(module) => format!("in {module}"),
            Cut::Late(module) => format!("in {module}, before its unwind tables"),
        }
    }

    /// The cause and what to do about it, for the summary.
    fn explained(&self) -> String {
        match self {
            Cut::MapFull => "because the stack maps had no room for their frames past the caller \
                 (see lost: stack; raise --stack-map-size)"
                .into(),
            Cut::NoRoom(module) => format!(
                "in {module}, whose unwind rows found no room in the unwind table (see lost: \
                 unwind_table; raise --unwind-table-size)"
            ),
            Cut::Folded => format!(
                "because their processes had ended and were folded into one, whose distinct \
                 stacks past {} share one (--keep-exited)",
                crate::profile::exited::FOLDED_STACKS
            ),
            Cut::Depth => format!(
                "at the walk's depth of {} frames (see lost: stack_depth)",
                heaptrace_common::STACK_FRAMES
            ),
            Cut::NoUnwind(module) => format!(
                "in {module}, which has neither frame pointers nor unwind rows there (see \
                 lost: unwind_*, and --unwind-table-size)"
            ),
            Cut::Late(module) => format!(
                "in {module}, walked before their process's unwind tables were loaded (see \
                 lost: unwind_late)"
            ),
        }
    }
}

/// Most allocations' stacks end early: what share, and the main cause (with the module, when
/// it is one without frame pointers or unwind rows).
#[derive(Clone, Debug, PartialEq)]
pub struct Shallow {
    pub percent: f64,
    pub cause: Cut,
    pub cause_percent: f64,
}

/// Says so when most allocations' stacks end early, and why most of them do: "the answer is
/// cut" is worth a line. None when most stacks are whole or there are none.
pub fn shallow(profile: &Profile) -> Option<Shallow> {
    let (mut calls, mut cut) = (0u64, 0u64);
    let mut by_cause: std::collections::BTreeMap<Cut, u64> = Default::default();
    for (id, t) in &profile.sites {
        if id.1 < 0 {
            continue; // a lost stack: counted under `lost` already
        }
        let frames = profile.frames(id);
        if frames.is_empty() {
            continue;
        }
        calls += t.calls;
        if let Some(c) = Cut::of(&frames) {
            cut += t.calls;
            *by_cause.entry(c).or_default() += t.calls;
        }
    }
    if calls == 0 || cut * 2 <= calls {
        return None;
    }
    let (cause, n) = by_cause.into_iter().max_by_key(|(c, n)| (*n, c.clone()))?;
    // The frames cannot tell a module without rows from one whose rows were not loaded yet
    // when the walk went through it; the kernel counted the walks made without tables.
    let late = profile.losses[heaptrace_common::Loss::UnwindLate as usize];
    let cause = match cause {
        Cut::NoUnwind(module) if late * 2 >= n => Cut::Late(module),
        c => c,
    };
    Some(Shallow {
        percent: 100.0 * cut as f64 / calls as f64,
        cause,
        cause_percent: 100.0 * n as f64 / calls as f64,
    })
}

/// The summary's line for [`shallow`].
pub fn shallow_stacks(profile: &Profile) -> Option<String> {
    let s = shallow(profile)?;
    Some(format!(
        "stacks: {:.0}% of allocations' stacks end before main or a thread's start; most \
         ({:.0}%) {}\n",
        s.percent,
        s.cause_percent,
        s.cause.explained()
    ))
}

/// How the calls timed were picked, for the latency views' titles.
pub fn latency_note(profile: &Profile) -> String {
    match profile.latency_sampled() {
        Some(n) => format!("; 1 call in {n} timed, at random"),
        None => String::new(),
    }
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
            "\ntime per call, entry to return (power-of-two buckets{}):\n  {:<16} {:>10} {:>10} {:>10} {:>10}",
            latency_note(profile),
            "function",
            "timed",
            "p50",
            "p99",
            "max <"
        );
        for r in rows {
            let _ = writeln!(s, "{r}");
        }
    }
    s
}

mod label;
pub use label::{labels, site_label, site_label_with, wrappers_note};

#[cfg(test)]
mod tests;
