//! The `--json` document: one object written at exit. Its schema is in docs/formats.md;
//! keys are only ever added, never renamed.
use heaptrace_common::{Func, Loss};
use serde_json::{Map, Value, json};

mod folded;
mod memory;
mod node;
mod processes;
use folded::{folded, stacks_cap};
use memory::memory;
pub(crate) use memory::{memory_by_process, reservations};
pub use node::Node;
use processes::processes;

use crate::{
    drain::round::{SiteId, Totals},
    probe::{Attached, Counting},
    profile::Profile,
    profile::histogram::percentiles,
    profile::wrappers::Wrappers,
    run_info::{RunInfo, Temporary},
};

/// What the document says about the run: its description, and what only a live trace knows
/// (a report of a recording leaves those out).
pub struct Run<'a> {
    pub info: &'a RunInfo,
    pub exit_code: Option<i32>,
    /// The signal that killed the target (a live trace knows; a recording says only the code).
    pub signal: Option<i32>,
    pub probes: &'a [Attached],
    /// Each memory syscall wrapper probed (`provider.syscall_probes`).
    pub syscall_probes: Option<Vec<Value>>,
    /// heaptrace's own RSS and peak RSS, in KiB.
    pub own_rss_kb: Option<(u64, u64)>,
    /// `--probe-stats`: each program's runs, run time and verified instructions.
    pub programs: Option<Value>,
    /// How the programs added to their counters.
    pub counting: Option<Counting>,
    /// A launched command let go of by its tracer: (ms into the trace, its signals a second).
    pub released: Option<(u64, u32)>,
    /// `--json-max-processes`: the cap the Profile was folded to (`Profile::keep_processes`).
    pub max_processes: Option<usize>,
}

impl<'a> Run<'a> {
    /// A run known only from its description (a recording).
    pub fn described(info: &'a RunInfo, exit_code: Option<i32>) -> Run<'a> {
        Run {
            info,
            exit_code,
            signal: None,
            probes: &[],
            syscall_probes: None,
            own_rss_kb: None,
            programs: None,
            counting: None,
            released: None,
            max_processes: None,
        }
    }

    /// The document's `heaptrace` object.
    fn heaptrace(&self) -> Value {
        let mut h = json!({
            "version": env!("CARGO_PKG_VERSION"),
            "format": 1,
            "collector": self.info.collector.name(),
        });
        if let Some((rss, peak)) = self.own_rss_kb {
            h["rss_kb"] = rss.into();
            h["peak_rss_kb"] = peak.into();
        }
        if let Some(p) = &self.programs {
            h["programs"] = p.clone();
        }
        if let Some(c) = self.counting {
            h["counters"] = json!(c);
        }
        h
    }

    /// The document's `provider` object.
    fn provider(&self) -> Value {
        let mut p = json!({ "path": self.info.provider, "probes": self.probes });
        if let Some(s) = &self.syscall_probes {
            p["syscall_probes"] = s.clone().into();
        }
        p
    }
}

/// A site's identity and frames, the common part of every per-stack entry.
/// `site` names the function of the frame `site_frame` (an index into `frames`), the first
/// past the allocator's own frames and its wrappers' (`profile::wrappers`).
pub(crate) fn site(profile: &Profile, w: &Wrappers, id: &SiteId) -> Map<String, Value> {
    let mut m = Map::new();
    pid_fields(&mut m, id.0);
    let function = match id.1 {
        heaptrace_common::BEFORE_ATTACH => Value::Null, // allocated before attach: not known
        _ => Func::from_u32(id.2).map(|f| f.name()).unwrap_or("?").into(),
    };
    m.insert("function".into(), function);
    m.insert("stack_id".into(), id.1.into());
    let frames = profile.frames(id);
    let at = w.site(&frames);
    if let Some(f) = at.frame(&frames).filter(|_| id.1 >= 0) {
        m.insert("site".into(), f.function.to_string().into());
        m.insert("site_frame".into(), at.0.into());
    }
    m.insert(
        "frames".into(),
        serde_json::to_value(frames).unwrap_or(Value::Null),
    );
    m
}

/// `v`, an object, with the process `key`'s fields (`pid_fields`).
pub(crate) fn with_pid(mut v: Value, key: u32) -> Value {
    if let Value::Object(m) = &mut v {
        pid_fields(m, key);
    }
    v
}

/// A process key (`incarnation`) as its pid, and, for the second or later process of the
/// trace with that pid, `instance`: which one it is (2, 3, ...).
pub(crate) fn pid_fields(m: &mut Map<String, Value>, key: u32) {
    if key == crate::profile::exited::FOLDED {
        // The processes folded into one (`--keep-exited`): no pid of its own.
        m.insert("pid".into(), 0.into());
        m.insert("folded".into(), true.into());
        return;
    }
    if crate::profile::grouped::is_group(key) {
        // The processes of one command as one (`--group-by command`): `comm` says how many.
        m.insert("pid".into(), 0.into());
        m.insert(
            "group".into(),
            (key - crate::profile::grouped::GROUPS).into(),
        );
        return;
    }
    let pid = crate::profile::incarnation::Pid(key);
    m.insert("pid".into(), pid.real().into());
    if pid.earlier() > 0 {
        m.insert("instance".into(), (pid.earlier() + 1).into());
    }
}

fn with(mut m: Map<String, Value>, extra: Value) -> Value {
    if let Value::Object(e) = extra {
        m.extend(e);
    }
    Value::Object(m)
}

fn percentiles_json(p: Option<crate::profile::histogram::Percentiles>) -> Value {
    match p {
        Some(p) => json!({ "count": p.count, "p50_ns": p.p50, "p99_ns": p.p99, "max_ns": p.max }),
        None => Value::Null,
    }
}

pub(crate) fn stacks(profile: &Profile) -> Node<'_> {
    Node::list(move || {
        let w = profile.wrappers();
        profile
            .top_sites(stacks_cap(profile), |t| t.bytes as i64)
            .into_iter()
            .map(move |(id, t)| stack(profile, &w, &id, &t))
    })
}

fn stack(
    profile: &Profile,
    w: &Wrappers,
    id: &SiteId,
    t: &crate::drain::round::SiteTotals,
) -> Value {
    let sizes: Vec<Value> = t
        .sizes
        .iter()
        .map(|(b, n)| json!({ "from": heaptrace_common::log2_bucket_floor(b), "count": n }))
        .collect();
    with(
        site(profile, w, id),
        json!({
            "estimated": profile.sample_bytes > 0,
            "samples": profile.samples.get(id).map_or(t.calls, |s| s.calls),
            "calls": t.calls,
            "bytes": t.bytes,
            "frees": t.frees,
            "freed_bytes": t.freed_bytes,
            "live_blocks": t.live_blocks,
            "live_bytes": t.live_bytes,
            "temporary": { "blocks": t.temp_blocks, "bytes": t.temp_bytes },
            "sizes": sizes,
            "lifetime": percentiles_json(percentiles(&t.lifetimes.dense(), 1024)),
        }),
    )
}

pub(crate) fn temporary(profile: &Profile, rule: Temporary) -> Node<'_> {
    let blocks: u64 = profile.sites.values().map(|t| t.temp_blocks).sum();
    let bytes: u64 = profile.sites.values().map(|t| t.temp_bytes).sum();
    let by = Node::list(move || {
        let w = profile.wrappers();
        profile
            .top_sites(stacks_cap(profile), |t| t.temp_blocks as i64)
            .into_iter()
            .map(move |(id, t)| {
                with(
                    site(profile, &w, &id),
                    json!({ "blocks": t.temp_blocks, "bytes": t.temp_bytes, "calls": t.calls }),
                )
            })
    });
    let rule = rule.json().into_iter().map(|(k, v)| (k, Node::from(v)));
    Node::object(rule.chain([
        ("estimated", json!(profile.sample_bytes > 0).into()),
        ("blocks", json!(blocks).into()),
        ("bytes", json!(bytes).into()),
        ("by_stack", by),
    ]))
}

pub(crate) fn peak(profile: &Profile) -> Node<'_> {
    let Some(p) = &profile.peak else {
        return Value::Null.into();
    };
    let cap = stacks_cap(profile);
    let by = Node::list(move || {
        let w = profile.wrappers();
        p.sites.iter().take(cap).map(move |(id, blocks, bytes)| {
            with(
                site(profile, &w, id),
                json!({ "live_blocks": blocks, "live_bytes": bytes }),
            )
        })
    });
    let untracked = crate::view::lower_bound::untracked(profile, None);
    Node::object([
        (
            "estimated",
            Node::from(json!(profile.sample_bytes > 0 || untracked > 0)),
        ),
        ("lower_bound", json!(untracked > 0).into()),
        ("live_bytes", json!(p.live_bytes).into()),
        ("live_blocks", json!(p.live_blocks).into()),
        ("round", json!(p.round).into()),
        ("elapsed_ms", json!(p.elapsed_ms).into()),
        ("exact", json!(p.exact).into()),
        // Where `by_stack` and `live_blocks` were taken: at the peak, or at its round's end.
        (
            "by_stack_at",
            json!(if p.held { "peak" } else { "round_end" }).into(),
        ),
        (
            "reached_by",
            match p.reached_by {
                Some((pid, stack_id, size)) => {
                    let mut m = site(profile, &profile.wrappers(), &(pid, stack_id, u32::MAX));
                    m.remove("function");
                    m.insert("size".into(), size.into());
                    Value::Object(m).into()
                }
                None => Value::Null.into(),
            },
        ),
        ("by_stack", by),
        ("by_stack_left_out", peak_left_out(&p.sites, cap).into()),
    ])
}

/// What a peak's `by_stack` of `cap` entries leaves out: how many sites, and their blocks
/// and bytes (with the list, the peak's own where it was kept).
pub(super) fn peak_left_out(sites: &[(SiteId, i64, i64)], cap: usize) -> Value {
    let rest = sites.iter().skip(cap);
    let (blocks, bytes) = rest.fold((0i64, 0i64), |(b, y), s| {
        (b.saturating_add(s.1), y.saturating_add(s.2))
    });
    json!({
        "stacks": sites.len().saturating_sub(cap),
        "live_blocks": blocks,
        "live_bytes": bytes,
    })
}

pub(crate) fn latency(profile: &Profile) -> Value {
    let mut m = Map::new();
    for f in Func::ALL {
        if let Some(p) = percentiles(&profile.latency[f as usize], 1) {
            m.insert(f.name().into(), percentiles_json(Some(p)));
        }
    }
    Value::Object(m)
}

/// With sampling (`sample_bytes` > 0), frees of blocks that were not sampled miss the live
/// map like untracked ones, and their sizes are unknown: free's bytes and the untracked count
/// are null, and `not_in_live_map` counts both kinds. Calls mode keeps no live map: free's
/// bytes and untracked count and realloc's released bytes are null.
fn functions(t: &Totals, aliases: &[(Func, Func)], profile: &Profile) -> Value {
    let sample_bytes = profile.sample_bytes;
    let mut m = Map::new();
    for f in Func::ALL {
        if aliases.iter().any(|(a, _)| *a == f) {
            continue;
        }
        let c = t.func(f);
        let v = match f {
            Func::Free if profile.calls => json!({
                "calls": c.calls,
                "bytes": Value::Null,
                "untracked": Value::Null,
            }),
            Func::Free if sample_bytes > 0 => json!({
                "calls": c.calls,
                "bytes": Value::Null,
                "untracked": Value::Null,
                "not_in_live_map": t.untracked_frees,
            }),
            Func::Free => json!({
                "calls": c.calls,
                "bytes": c.bytes,
                "untracked": t.untracked_frees,
            }),
            Func::Realloc => json!({
                "calls": c.calls,
                "bytes": c.bytes,
                "failed": c.failed,
                "moved": t.realloc_moves,
                "in_place": t.realloc_in_place,
                "freed": t.realloc_frees,
                "released_bytes": if profile.calls {
                    Value::Null
                } else {
                    t.realloc_released_bytes.into()
                },
            }),
            _ => json!({ "calls": c.calls, "bytes": c.bytes, "failed": c.failed }),
        };
        m.insert(f.name().into(), v);
    }
    Value::Object(m)
}

pub(crate) fn sizes(profile: &Profile, pid: Option<u32>) -> Node<'_> {
    Node::list(move || {
        profile
            .sizes_by_func(pid)
            .into_iter()
            .filter_map(|((f, size), count)| {
                Some(json!({ "function": Func::from_u32(f)?.name(), "size": size, "count": count }))
            })
    })
}

pub(crate) fn leaks(profile: &Profile, pid: Option<u32>) -> Node<'_> {
    let Some(total) = profile.leak_totals(pid) else {
        return Value::Null.into();
    };
    let mut by = Map::new();
    for (i, l) in profile.leaks_by_func(pid).iter().enumerate() {
        if l.blocks > 0 {
            by.insert(
                Func::ALL[i].name().into(),
                json!({ "blocks": l.blocks, "bytes": l.bytes }),
            );
        }
    }
    let by_stack = Node::list(move || {
        let w = profile.wrappers();
        profile
            .top_leaks(usize::MAX)
            .into_iter()
            .filter(move |(id, _)| {
                pid.is_none_or(|p| p == id.0) && id.1 != heaptrace_common::NO_SITE
            })
            .take(match pid {
                // Each process's list repeats the document's: a fiftieth of the cap each.
                Some(_) => (stacks_cap(profile) / 50).max(1),
                None => stacks_cap(profile),
            })
            .map(move |(id, l)| {
                with(
                    site(profile, &w, &id),
                    json!({ "blocks": l.blocks, "bytes": l.bytes }),
                )
            })
    });
    Node::object([
        ("estimated", Node::from(json!(profile.sample_bytes > 0))),
        ("blocks", json!(total.blocks).into()),
        ("bytes", json!(total.bytes).into()),
        ("by_function", Value::Object(by).into()),
        ("by_stack", by_stack),
    ])
}

fn totals_summary(t: &Totals) -> Value {
    json!({
        "allocations": t.allocations(),
        "frees": t.frees(),
        "bytes_allocated": t.bytes_allocated(),
    })
}

pub fn document<'a>(profile: &'a Profile, run: &Run<'_>) -> Node<'a> {
    let info = run.info;
    let totals = profile.totals();
    let region = profile.region_lost;
    let lost = lost(profile);
    let incomplete = incomplete(profile, &lost);
    let processes = processes(profile, info.aliases.to_vec());
    let alias_names: Map<String, Value> = info
        .aliases
        .iter()
        .map(|(a, of)| (a.name().to_string(), Value::from(of.name())))
        .collect();
    let leaks = if profile.calls {
        Value::Null.into()
    } else {
        leaks(profile, None)
    };
    let plain = json!({
        "heaptrace": run.heaptrace(),
        "target": {
            "mode": info.target.name(),
            "comm": info.comm,
            "cgroup": info.cgroup,
            "pids": info.pids,
            "command": info.command,
            "exit_code": run.exit_code,
            "signal": run.signal.map(crate::exit_status::signal_name),
            "released": run.released.map(|(after_ms, per_second)| json!({
                "after_ms": after_ms,
                "signals_per_second": per_second,
            })),
        },
        "interval_ms": info.interval_ms,
        "mode": info.mode.name(),
        "sample_bytes": profile.sample_bytes,
        "latency_every": profile.latency_every.max(1),
        "rounds": profile.round_count(),
        "max_round_gap_ms": profile.max_round_gap_ms,
        "provider": run.provider(),
        "aliases": alias_names,
        "functions": functions(&totals, &info.aliases, profile),
        "totals": totals_summary(&totals),
        "live": live_all(profile, &totals),
        "lost": lost,
        "complete": incomplete.is_empty(),
        "incomplete": incomplete,
        "raw_thread_calls": region.raw_thread_calls,
        "latency": latency(profile),
        "folded": folded(profile, run.max_processes),
    });
    let Value::Object(plain) = plain else {
        unreachable!("json! of an object")
    };
    let mut m: Vec<(String, Node<'a>)> = plain.into_iter().map(|(k, v)| (k, v.into())).collect();
    m.extend([
        ("sizes".to_string(), sizes(profile, None)),
        ("leaks".into(), leaks),
        ("processes".into(), processes),
        (
            "timeline".into(),
            Node::list(move || {
                profile
                    .rounds
                    .iter()
                    .map(|r| serde_json::to_value(r).unwrap_or(Value::Null))
            }),
        ),
        ("stacks".into(), stacks(profile)),
        (
            "wrappers".into(),
            crate::profile::wrappers::summary(
                &profile.wrappers(),
                profile.stacks.values().map(|s| &s[..]),
            )
            .into(),
        ),
        ("temporary".into(), temporary(profile, info.temporary)),
        ("peak".into(), peak(profile)),
        ("reservations".into(), reservations(profile)),
    ]);
    Node::object(m)
}

/// Why the counts are known incomplete: the trace's reasons, and `lost` when anything was.
/// `lost`: of the processes shown; the kernel's stack loss for every process traced beside
/// them; what the in-process region lost.
fn lost(profile: &Profile) -> Map<String, Value> {
    let mut lost = Map::new();
    let shown = profile.losses_of(None);
    for l in Loss::ALL {
        lost.insert(l.name().into(), shown[l as usize].into());
    }
    lost.insert(
        "stack_all_processes".into(),
        profile.losses[Loss::Stack as usize].into(),
    );
    lost.insert("unsafe_files".into(), profile.unsafe_files.into());
    let region = profile.region_lost;
    lost.insert(
        "region_overwritten".into(),
        region.region_overwritten.into(),
    );
    lost.insert("nested_calls".into(), region.nested_calls.into());
    lost
}

fn incomplete(
    profile: &Profile,
    lost: &Map<String, Value>,
) -> Vec<crate::profile::complete::Incomplete> {
    let mut why = profile.incomplete.clone();
    let any_lost = lost
        .iter()
        .any(|(k, v)| k != "stack_all_processes" && v.as_u64().is_some_and(|n| n > 0));
    if any_lost {
        why.insert(0, crate::profile::complete::Incomplete::Lost);
    }
    why
}

/// All processes' live figures, and the part of them held by processes that ended (system-wide
/// mode): not freed at their end, gone with them.
fn live_all(profile: &Profile, t: &Totals) -> Value {
    let mut v = live(profile, t);
    before_attach(profile, &mut v);
    if let Value::Object(m) = &mut v {
        let (blocks, bytes) = profile.ended_live();
        m.insert(
            "of_ended_processes".into(),
            json!({ "blocks": blocks, "bytes": bytes }),
        );
    }
    v
}

/// The live blocks and bytes; null in calls mode, which keeps no live map.
fn live(profile: &Profile, t: &Totals) -> Value {
    if profile.calls {
        return Value::Null;
    }
    let untracked = crate::view::lower_bound::untracked(profile, None);
    json!({
        "blocks": t.live_blocks,
        "bytes": t.live_bytes,
        "estimated": profile.sample_bytes > 0 || untracked > 0,
        "lower_bound": untracked > 0,
    })
}

/// `-p`: the blocks live at attach (a census of the heap), part of the live figures.
fn before_attach(profile: &Profile, v: &mut Value) {
    if let (Some(b), Value::Object(m)) = (profile.before_attach, v) {
        m.insert(
            "before_attach".into(),
            json!({
                "blocks": b.blocks,
                "bytes": b.bytes,
                "lost_blocks": b.lost_blocks,
                "lost_bytes": b.lost_bytes,
            }),
        );
    }
}

#[cfg(test)]
mod tests;
