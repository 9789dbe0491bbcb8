//! The three tables of the summary (slowdown, added time per call, heaptrace's own cost),
//! from the medians of a batch's runs.
use super::*;

pub(super) fn count(v: Option<u64>) -> String {
    let Some(v) = v else { return "-".into() };
    let s = v.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

pub(super) fn bytes(v: Option<u64>) -> String {
    match v {
        None => "-".into(),
        Some(b) if b < 10 * 1024 => format!("{b} B"),
        Some(b) if b < 10 * 1024 * 1024 => format!("{:.0} KiB", b as f64 / 1024.0),
        Some(b) => format!("{:.1} MiB", b as f64 / 1048576.0),
    }
}

pub(super) fn ratio(r: f64) -> String {
    if r >= 9.95 {
        format!("{r:.0}x")
    } else {
        format!("{r:.1}x")
    }
}

pub(super) fn describe(meta: &Value) -> String {
    let notes = meta["notes"]
        .as_array()
        .filter(|n| !n.is_empty())
        .map(|n| {
            let n: Vec<&str> = n.iter().filter_map(Value::as_str).collect();
            format!("; disturbed: {}", n.join(", "))
        })
        .unwrap_or_default();
    format!(
        "{} CPUs, kernel {}, {}, heaptrace {}, {}; load average {} at the start, {} at the end{notes}",
        meta["cpus"],
        meta["kernel"].as_str().unwrap_or("?"),
        meta["glibc"].as_str().unwrap_or("?"),
        meta["commit"].as_str().unwrap_or("?"),
        meta["heaptrack"].as_str().unwrap_or("no heaptrack"),
        meta["loadavg_start"].as_str().unwrap_or("?"),
        meta["loadavg_end"].as_str().unwrap_or("?"),
    )
}

/// Medians per (workload, P, kind) and the three tables of BENCHMARKS.md.
pub fn summary(runs: &[Run], meta: &Value) -> String {
    let m = Medians::new(runs);
    let mut t = String::new();
    let _ = writeln!(
        t,
        "`{}`, scale {}, {} rep(s); {}; {:.0} s in all, {:.0} s of it waiting for the lock.\n",
        meta["command"].as_str().unwrap_or("cargo xtask bench"),
        meta["scale"],
        meta["reps"],
        describe(meta),
        meta["duration_s"].as_f64().unwrap_or(0.0),
        meta["waited_s"].as_f64().unwrap_or(0.0)
    );
    slowdown_table(&mut t, &m);
    added_time_table(&mut t, &m);
    own_cost_table(&mut t, &m);
    t
}

/// A batch: its workload's place in `WORKLOADS`, and P.
pub(super) type Key = (usize, u32);

/// The runs grouped by batch and kind, for their medians.
pub(super) struct Medians<'a> {
    pub(super) by: BTreeMap<(Key, Kind), Vec<&'a Run>>,
    /// Every batch, in table order, with its workload's name.
    pub(super) batches: Vec<(Key, String)>,
    /// The traced kinds that ran, in table order.
    pub(super) kinds: Vec<Kind>,
}

impl<'a> Medians<'a> {
    fn new(runs: &'a [Run]) -> Medians<'a> {
        let order = |w: &str| WORKLOADS.iter().position(|x| *x == w).unwrap_or(usize::MAX);
        let mut by: BTreeMap<(Key, Kind), Vec<&Run>> = BTreeMap::new();
        for r in runs {
            by.entry(((order(&r.workload), r.threads), r.kind()))
                .or_default()
                .push(r);
        }
        let mut batches: Vec<(Key, String)> = runs
            .iter()
            .map(|r| ((order(&r.workload), r.threads), r.workload.clone()))
            .collect();
        batches.sort();
        batches.dedup();
        let mut kinds: Vec<Kind> = runs.iter().filter_map(|r| r.kind).collect();
        kinds.sort();
        kinds.dedup();
        Medians { by, batches, kinds }
    }

    /// The median of `f` over a batch's runs of `kind`.
    fn med(&self, k: Key, kind: Kind, f: &dyn Fn(&Run) -> Option<f64>) -> Option<f64> {
        let v: Vec<f64> = self
            .by
            .get(&(k, kind))?
            .iter()
            .filter_map(|r| f(r))
            .collect();
        median(&v)
    }

    /// Calls per batch: the median over heaptrace's counted runs (the others make the same
    /// calls: the workloads are deterministic).
    fn calls(&self, k: Key) -> Option<f64> {
        let v: Vec<f64> = self
            .kinds
            .iter()
            .filter(|kd| kd.counted())
            .filter_map(|kd| self.by.get(&(k, *kd)))
            .flatten()
            .filter_map(|r| r.calls.map(|c| c as f64))
            .collect();
        median(&v)
    }

    /// A table's header: the `first` columns (and their `rule`), then one per kind.
    fn header(&self, t: &mut String, first: &str, rule: &str) {
        let _ = write!(t, "{first}");
        for k in &self.kinds {
            let _ = write!(t, " {} |", k.name());
        }
        let _ = write!(t, "\n{rule}");
        for _ in &self.kinds {
            let _ = write!(t, "---|");
        }
        t.push('\n');
    }
}

/// 1. Slowdown: each kind's elapsed time over the natives', per batch and its mean per P.
pub(super) fn slowdown_table(t: &mut String, m: &Medians) {
    let _ = writeln!(
        t,
        "Slowdown: the workload's own elapsed time (median) over the median of the native runs \
         interleaved in the same batch.\n"
    );
    m.header(
        t,
        "| workload | P | calls | native elapsed (cpu) |",
        "|---|---|---|---|",
    );
    let mut sums: BTreeMap<(u32, Kind), (f64, usize)> = BTreeMap::new();
    for (k, w) in &m.batches {
        let native = m.med(*k, Kind::Native, &|r| Some(r.elapsed));
        let _ = write!(
            t,
            "| {w} | {} | {} | {} ({}) |",
            k.1,
            count(m.calls(*k).map(|c| c as u64)),
            native.map_or("-".into(), |n| format!("{n:.3} s")),
            m.med(*k, Kind::Native, &|r| Some(r.cpu))
                .map_or("-".into(), |n| format!("{n:.3} s")),
        );
        for kind in &m.kinds {
            match (m.med(*k, *kind, &|r| Some(r.elapsed)), native) {
                (Some(e), Some(n)) if n > 0.0 => {
                    let _ = write!(t, " {} |", ratio(e / n));
                    let s = sums.entry((k.1, *kind)).or_default();
                    s.0 += e / n;
                    s.1 += 1;
                }
                _ => t.push_str(" - |"),
            }
        }
        t.push('\n');
    }
    let mut ps: Vec<u32> = m.batches.iter().map(|(k, _)| k.1).collect();
    ps.sort();
    ps.dedup();
    for p in ps {
        let _ = write!(t, "| **mean** | {p} | | |");
        for kind in &m.kinds {
            match sums.get(&(p, *kind)) {
                Some((s, n)) if *n > 0 => {
                    let _ = write!(t, " **{}** |", ratio(s / *n as f64));
                }
                _ => t.push_str(" - |"),
            }
        }
        t.push('\n');
    }
}

/// 2. Added time per call, from the elapsed time and from the CPU time.
pub(super) fn added_time_table(t: &mut String, m: &Medians) {
    let _ = writeln!(
        t,
        "\nAdded time per malloc-family call, ns: (median elapsed - native median) / calls, and \
         in parentheses the same from the workload's CPU time (all its threads, kernel time in \
         the probes included).\n"
    );
    m.header(t, "| workload | P |", "|---|---|");
    for (k, w) in &m.batches {
        let _ = write!(t, "| {w} | {} |", k.1);
        let n_el = m.med(*k, Kind::Native, &|r| Some(r.elapsed));
        let n_cpu = m.med(*k, Kind::Native, &|r| Some(r.cpu));
        for kind in &m.kinds {
            let el = m.med(*k, *kind, &|r| Some(r.elapsed));
            let cpu = m.med(*k, *kind, &|r| Some(r.cpu));
            match (el, cpu, n_el, n_cpu, m.calls(*k)) {
                (Some(e), Some(c), Some(ne), Some(nc), Some(n)) if n > 0.0 => {
                    let _ = write!(
                        t,
                        " {:.0} ({:.0}) |",
                        (e - ne) / n * 1e9,
                        (c - nc) / n * 1e9
                    );
                }
                _ => t.push_str(" - |"),
            }
        }
        t.push('\n');
    }
}

/// 3. The daemon's own cost and the files, heaptrack's beside.
pub(super) fn own_cost_table(t: &mut String, m: &Medians) {
    let _ = writeln!(
        t,
        "\nheaptrace's own cost (medians): CPU seconds (user+system) and peak RSS (VmHWM, \
         polled every 10 ms) of the heaptrace process, launched in stacks mode, attached, and \
         recording; \"fixed\" is a stacks launch's wall time minus the workload's elapsed time \
         (start-up, attach, detach, final read, summary, exit). Then the recording: its rounds, \
         distinct stacks, allocations whose stack was lost, and size; and heaptrack's \
         compressed file for the same work, with the CPU time of heaptrack's helper processes \
         (the whole command's minus the workload's).\n"
    );
    let _ = writeln!(
        t,
        "| workload | P | stacks: CPU | RSS | fixed | attach: CPU | RSS | record: CPU | RSS | \
         rounds | stacks | lost stacks | recording | heaptrack file | heaptrack CPU |"
    );
    let _ = writeln!(
        t,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    let secs = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.2} s"));
    let mib = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.0} MiB", v / 1024.0));
    let int = |v: Option<f64>| count(v.map(|v| v as u64));
    for (k, w) in &m.batches {
        let med = |kind: Kind, f: &dyn Fn(&Run) -> Option<f64>| m.med(*k, kind, f);
        let rss = |r: &Run| r.daemon_rss_kb.map(|v| v as f64);
        let _ = writeln!(
            t,
            "| {w} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            k.1,
            secs(med(Kind::Stacks, &|r| r.daemon_cpu)),
            mib(med(Kind::Stacks, &rss)),
            secs(med(Kind::Stacks, &|r| Some(r.wall - r.elapsed))),
            secs(med(Kind::Attach, &|r| r.daemon_cpu)),
            mib(med(Kind::Attach, &rss)),
            secs(med(Kind::Record, &|r| r.daemon_cpu)),
            mib(med(Kind::Record, &rss)),
            int(med(Kind::Record, &|r| r.rounds.map(|v| v as f64))),
            int(med(Kind::Record, &|r| r.stacks.map(|v| v as f64))),
            int(med(Kind::Record, &|r| r.lost_stack.map(|v| v as f64))),
            bytes(med(Kind::Record, &|r| r.file_bytes.map(|v| v as f64)).map(|v| v as u64)),
            bytes(med(Kind::Heaptrack, &|r| r.file_bytes.map(|v| v as f64)).map(|v| v as u64)),
            secs(med(Kind::Heaptrack, &|r| r.daemon_cpu)),
        );
    }
}
