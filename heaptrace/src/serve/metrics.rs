//! `/metrics`: the snapshot as Prometheus series (prometheus-client's encoder). Labels are
//! bounded: a process's pid, command and cgroup, never sites or stacks; past
//! `--serve-max-processes` the processes that allocated the least are summed into one series.
use prometheus_client::{
    encoding::{EncodeLabelSet, text},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use std::sync::atomic::AtomicU64;

use super::Snapshot;
use crate::{
    drain::round::Totals,
    profile::{ProcProfile, exited::FOLDED, incarnation::Pid},
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProcLabels {
    pid: String,
    command: String,
    cgroup: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LossLabels {
    kind: String,
}

/// One process's series (or the sum of those folded).
#[derive(Default)]
struct ProcRow {
    totals: Totals,
    rss_bytes: u64,
    held_bytes: u64,
    peak_bytes: Option<u64>,
}

impl ProcRow {
    fn of(p: &ProcProfile) -> ProcRow {
        ProcRow {
            totals: p.totals,
            rss_bytes: p.mem.map_or(0, |m| m.rss_kb * 1024),
            held_bytes: p.reserved.map_or(0, |r| r.total()),
            peak_bytes: p.peak.map(|k| k.bytes),
        }
    }

    fn add(&mut self, p: &ProcProfile) {
        let r = ProcRow::of(p);
        self.totals.plus(&r.totals);
        self.rss_bytes += r.rss_bytes;
        self.held_bytes += r.held_bytes;
        // A sum of peaks taken at different times is no one's peak.
        self.peak_bytes = None;
    }
}

/// The processes given series: the live ones, those that allocated the most bytes first;
/// past `max`, the rest summed. Returns the rows and how many processes were folded.
fn rows(s: &Snapshot, max: usize) -> (Vec<(ProcLabels, ProcRow)>, usize) {
    let mut live: Vec<(u32, &ProcProfile)> = s
        .profile
        .procs
        .iter()
        .filter(|(k, p)| **k != FOLDED && !p.exited && !crate::profile::grouped::is_group(**k))
        .map(|(k, p)| (*k, p))
        .collect();
    live.sort_by_key(|(k, p)| (std::cmp::Reverse(p.totals.bytes_allocated()), *k));
    let folded = live.len().saturating_sub(max);
    let mut out: Vec<(ProcLabels, ProcRow)> = live
        .iter()
        .take(max)
        .map(|(k, p)| {
            let labels = ProcLabels {
                pid: Pid(*k).real().to_string(),
                command: p.comm.clone(),
                cgroup: p.cgroup.clone(),
            };
            (labels, ProcRow::of(p))
        })
        .collect();
    if folded > 0 {
        let mut other = ProcRow::default();
        for (_, p) in &live[max..] {
            other.add(p);
        }
        let labels = ProcLabels {
            pid: "other".into(),
            command: format!("[{folded} other processes]"),
            cgroup: String::new(),
        };
        out.push((labels, other));
    }
    (out, folded)
}

fn gauge_family() -> Family<ProcLabels, Gauge> {
    Family::default()
}

fn counter_family() -> Family<ProcLabels, Counter> {
    Family::default()
}

/// The per-process series.
fn processes(reg: &mut Registry, s: &Snapshot, max: usize) -> usize {
    let live_bytes = gauge_family();
    let live_blocks = gauge_family();
    let peak = gauge_family();
    let rss = gauge_family();
    let held = gauge_family();
    let allocations = counter_family();
    let frees = counter_family();
    let allocated = counter_family();
    let failures = counter_family();
    let (rows, folded) = rows(s, max);
    for (l, r) in &rows {
        let t = &r.totals;
        live_bytes.get_or_create(l).set(t.live_bytes);
        live_blocks.get_or_create(l).set(t.live_blocks);
        if let Some(b) = r.peak_bytes {
            peak.get_or_create(l).set(b as i64);
        }
        rss.get_or_create(l).set(r.rss_bytes as i64);
        held.get_or_create(l).set(r.held_bytes as i64);
        allocations.get_or_create(l).inc_by(t.allocations());
        frees.get_or_create(l).inc_by(t.frees());
        allocated.get_or_create(l).inc_by(t.bytes_allocated());
        failures
            .get_or_create(l)
            .inc_by(t.funcs.iter().map(|f| f.failed).sum());
    }
    let procs: [(&str, &str, Family<ProcLabels, Gauge>); 5] = [
        (
            "process_live_bytes",
            "Bytes in blocks allocated and not freed",
            live_bytes,
        ),
        (
            "process_live_blocks",
            "Blocks allocated and not freed",
            live_blocks,
        ),
        (
            "process_peak_live_bytes",
            "The highest live bytes, taken by the kernel at the allocation that reached it",
            peak,
        ),
        ("process_resident_bytes", "Resident memory (VmRSS)", rss),
        (
            "process_allocator_held_bytes",
            "Bytes the allocators hold from the kernel (heap, arenas, mmapped blocks, pymalloc arenas)",
            held,
        ),
    ];
    for (name, help, f) in procs {
        reg.register(name, help, f);
    }
    let counters: [(&str, &str, Family<ProcLabels, Counter>); 4] = [
        (
            "process_allocations",
            "Blocks handed out by the malloc family",
            allocations,
        ),
        (
            "process_frees",
            "Blocks given back (free, realloc to 0)",
            frees,
        ),
        (
            "process_allocated_bytes",
            "Bytes requested by successful allocations",
            allocated,
        ),
        (
            "process_allocation_failures",
            "Allocating calls that returned NULL",
            failures,
        ),
    ];
    for (name, help, f) in counters {
        reg.register(name, help, f);
    }
    folded
}

/// heaptrace's own series.
fn own(reg: &mut Registry, s: &Snapshot, folded: usize) {
    let gauge = |v: i64| {
        let g: Gauge = Gauge::default();
        g.set(v);
        g
    };
    let counter = |v: u64| {
        let c: Counter = Counter::default();
        c.inc_by(v);
        c
    };
    let p = &s.profile;
    reg.register("rounds", "Rounds taken", counter(s.rounds));
    let losses: Family<LossLabels, Counter> = Family::default();
    for l in heaptrace_common::Loss::ALL {
        let kind = LossLabels {
            kind: l.name().into(),
        };
        losses.get_or_create(&kind).inc_by(p.losses[l as usize]);
    }
    reg.register(
        "losses",
        "Events not counted, by kind (docs/limits.md names the flag for each)",
        losses,
    );
    let cpu: Counter<f64, AtomicU64> = Counter::default();
    // Read at the scrape, not each round: the server runs in heaptrace's own process.
    cpu.inc_by(crate::targets::procfs::self_cpu_seconds().unwrap_or(0.0));
    reg.register("cpu_seconds", "heaptrace's own CPU time", cpu);
    reg.register(
        "resident_bytes",
        "heaptrace's own resident memory",
        gauge(crate::targets::procfs::own_rss_kb().map_or(0, |(now, _)| now) as i64 * 1024),
    );
    let round: Gauge<f64, AtomicU64> = Gauge::default();
    round.set(s.round_seconds);
    reg.register(
        "round_duration_seconds",
        "How long the last round took",
        round,
    );
    reg.register(
        "rounds_late",
        "Rounds that started more than half an interval after they were due",
        counter(s.rounds_late),
    );
    let gap: Gauge<f64, AtomicU64> = Gauge::default();
    gap.set(s.round_gap_max_seconds);
    reg.register(
        "round_gap_max_seconds",
        "The longest time between two rounds' starts",
        gap,
    );
    reg.register(
        "trace_ended",
        "1 once the trace has ended: the figures are final",
        gauge(i64::from(s.ended)),
    );
    let traced = p.procs.values().filter(|pp| !pp.exited).count();
    reg.register(
        "traced_processes",
        "Processes traced and running",
        gauge(traced as i64),
    );
    reg.register(
        "serve_folded_processes",
        "Processes summed into the pid=\"other\" series (--serve-max-processes)",
        gauge(folded as i64),
    );
}

/// The exposition: OpenMetrics when `openmetrics`, else Prometheus's classic text format.
pub fn render(s: &Snapshot, max_processes: usize, openmetrics: bool) -> String {
    let mut reg = Registry::with_prefix("heaptrace");
    let folded = processes(&mut reg, s, max_processes);
    own(&mut reg, s, folded);
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = text::encode(&mut out, &reg);
    if openmetrics { out } else { classic(&out) }
}

/// OpenMetrics text as Prometheus's text format 0.0.4: a counter's HELP and TYPE name its
/// `_total` series, and there is no `# EOF` or `# UNIT`.
fn classic(om: &str) -> String {
    let counters: std::collections::HashSet<&str> = om
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(om.len());
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some((p, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let total = if counters.contains(name) {
                    "_total"
                } else {
                    ""
                };
                out.push_str(&format!("{p}{name}{total} {tail}\n"));
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
