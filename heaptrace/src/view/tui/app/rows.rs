//! The rows of each screen, computed from the Profile on screen.
use super::*;

/// One row of the sites screen.
#[derive(Clone, Debug, PartialEq)]
pub struct SiteRow {
    pub id: SiteId,
    pub totals: SiteTotals,
    /// Blocks of this site still live at the end; None while tracing goes on.
    pub leak: Option<Leak>,
    /// The site's stack (shared with the Profile, not copied) and the frame it is named by:
    /// the innermost one past the allocator and its wrappers (`profile::wrappers`).
    pub frames: Arc<[Frame]>,
    pub named: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct FuncRow {
    pub func: Func,
    /// With the aliases counted under it: "aligned_alloc/memalign".
    pub name: String,
    pub calls: u64,
    /// None for free when sampling: frees of blocks not sampled have no known size.
    pub bytes: Option<u64>,
    /// None for free, which cannot fail.
    pub failed: Option<u64>,
    pub latency: Option<Percentiles>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcRow {
    pub pid: u32,
    pub comm: String,
    pub totals: Totals,
    pub rss_kb: Option<u64>,
    pub virt_kb: Option<u64>,
    pub peak_rss_kb: u64,
    /// Bytes its allocator holds from the kernel (heap, arenas, mmapped blocks).
    pub reserved: Option<u64>,
    /// Its allocations per second in the last round seen.
    pub rate: u64,
    /// It ended while traced: its live figure is what it had not freed then.
    pub exited: bool,
    /// The OOM killer killed it.
    pub oom_killed: bool,
}

/// The processes of each command run more than once as one row (`GROUPS + n`), named
/// `cc1 (36 processes)`, its figures their sums; a command run once keeps its row.
fn by_command(rows: Vec<ProcRow>) -> Vec<ProcRow> {
    let mut groups: std::collections::BTreeMap<String, Vec<ProcRow>> = Default::default();
    for r in rows {
        groups.entry(r.comm.clone()).or_default().push(r);
    }
    let mut out = Vec::new();
    for (n, (comm, mut g)) in groups.into_iter().enumerate() {
        if g.len() == 1 {
            out.append(&mut g);
            continue;
        }
        let sum = |f: fn(&ProcRow) -> Option<u64>| g.iter().filter_map(f).reduce(|a, b| a + b);
        let mut totals = Totals::default();
        for r in &g {
            totals.plus(&r.totals);
        }
        out.push(ProcRow {
            pid: crate::profile::grouped::GROUPS + n as u32,
            comm: format!("{comm} ({} processes)", g.len()),
            totals,
            rss_kb: sum(|r| r.rss_kb),
            virt_kb: sum(|r| r.virt_kb),
            peak_rss_kb: g.iter().map(|r| r.peak_rss_kb).max().unwrap_or(0),
            reserved: sum(|r| r.reserved),
            rate: g.iter().map(|r| r.rate).sum(),
            exited: g.iter().all(|r| r.exited),
            oom_killed: g.iter().any(|r| r.oom_killed),
        });
    }
    out
}

/// `n` events of round `last` per second: the round ran from `prev`'s end (or one interval).
pub fn per_second(n: u64, last: &TimelineRow, prev: Option<&TimelineRow>, interval_ms: u64) -> u64 {
    let since = prev.map_or(last.elapsed_ms.saturating_sub(interval_ms), |p| {
        p.elapsed_ms
    });
    n * 1000 / last.elapsed_ms.saturating_sub(since).max(1)
}

/// One exact request size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SizeRow {
    pub func: &'static str,
    pub size: u64,
    pub count: u64,
}

/// Requests whose size falls in one power-of-two class, all functions together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizeClass {
    /// The class holds sizes from `from` to `2 * from - 1` (0 holds only 0).
    pub from: u64,
    pub count: u64,
    pub bytes: u64,
}

impl SiteRow {
    pub fn frame(&self) -> &Frame {
        &self.frames[self.named]
    }

    pub fn func(&self) -> &'static str {
        Func::from_u32(self.id.2).map(|f| f.name()).unwrap_or("?")
    }
}

impl App {
    pub fn site_rows(&self) -> Vec<SiteRow> {
        let needle = self.filter.to_lowercase();
        let view = self.view();
        let wrappers = view.wrappers();
        let leaks = view.leaks.as_ref();
        let mut rows: Vec<SiteRow> = view
            .sites
            .iter()
            .filter_map(|(id, t)| {
                // The stack as stored; a lost one gets its one frame.
                let frames: Arc<[Frame]> = match view.stacks.get(&(id.0, id.1)) {
                    Some(f) if id.1 >= 0 => f.clone(),
                    _ => view.frames(id).into(),
                };
                let func = Func::from_u32(id.2).map(|f| f.name()).unwrap_or("?");
                if !needle.is_empty()
                    && !matches(func, &needle)
                    && !frames
                        .iter()
                        .any(|f| matches(&f.function, &needle) || matches(&f.module, &needle))
                {
                    return None;
                }
                Some(SiteRow {
                    id: *id,
                    totals: t.clone(),
                    leak: leaks.map(|l| l.get(id).copied().unwrap_or_default()),
                    named: wrappers.site(&frames).0,
                    frames,
                })
            })
            .collect();
        let key = |r: &SiteRow| -> i64 {
            match self.site_sort {
                SiteSort::Bytes => r.totals.bytes as i64,
                SiteSort::Calls => r.totals.calls as i64,
                SiteSort::Live => r.totals.live_bytes,
                SiteSort::Temporary => r.totals.temp_bytes as i64,
                SiteSort::Leaks => r.leak.map_or(0, |l| l.bytes as i64),
            }
        };
        // A row is some 600 bytes: the keys are sorted, and each row moved once.
        rows.sort_by_cached_key(|r| {
            (
                std::cmp::Reverse(key(r)),
                std::cmp::Reverse(r.totals.bytes),
                r.id,
            )
        });
        rows
    }

    pub fn func_rows(&self) -> Vec<FuncRow> {
        let t = self.view().totals();
        let hidden: Vec<Func> = self.info.run.aliases.iter().map(|(a, _)| *a).collect();
        let mut rows: Vec<FuncRow> = shown_funcs(&hidden)
            .map(|f| {
                let mut name = f.name().to_string();
                for (a, of) in &self.info.run.aliases {
                    if *of == f {
                        name.push('/');
                        name.push_str(a.name());
                    }
                }
                let c = t.func(f);
                FuncRow {
                    func: f,
                    name,
                    calls: c.calls,
                    // Without a complete live map, free's bytes are not known.
                    bytes: (f != Func::Free
                        || (self.view().sample_bytes == 0 && !self.view().calls))
                        .then_some(c.bytes),
                    failed: (f != Func::Free).then_some(c.failed),
                    latency: percentiles(&self.view().latency[f as usize], 1),
                }
            })
            .collect();
        match self.func_sort {
            FuncSort::Family => {}
            FuncSort::Calls => rows.sort_by_key(|r| std::cmp::Reverse(r.calls)),
            FuncSort::Bytes => rows.sort_by_key(|r| std::cmp::Reverse(r.bytes)),
            FuncSort::P99 => {
                rows.sort_by_key(|r| std::cmp::Reverse(r.latency.map_or(0, |p| p.p99)))
            }
        }
        rows
    }

    /// Processes, always all of them (the focus is chosen here), since the baseline.
    pub fn proc_rows(&self) -> Vec<ProcRow> {
        let needle = self.filter.to_lowercase();
        let mut rows: Vec<ProcRow> = self
            .all()
            .procs
            .iter()
            .filter(|(pid, p)| {
                needle.is_empty() || matches(&p.comm, &needle) || pid.to_string().contains(&needle)
            })
            .map(|(pid, p)| ProcRow {
                pid: *pid,
                comm: p.comm.clone(),
                totals: p.totals,
                rss_kb: p.mem.map(|m| m.rss_kb),
                virt_kb: p.mem.map(|m| m.virt_kb),
                peak_rss_kb: p.peak_rss_kb,
                reserved: p.reserved.map(|r| r.total()),
                exited: p.exited,
                oom_killed: p.oom_killed,
                rate: self.history.get(pid).map_or(0, |h| {
                    let prev = h.len().checked_sub(2).and_then(|i| h.get(i));
                    h.back().map_or(0, |last| {
                        per_second(last.allocations, last, prev, self.info.run.interval_ms)
                    })
                }),
            })
            .collect();
        if self.by_command {
            rows = by_command(rows);
        }
        match self.proc_sort {
            ProcSort::Busiest => rows.sort_by_key(|r| {
                (
                    std::cmp::Reverse(r.totals.allocations() + r.totals.frees()),
                    r.pid,
                )
            }),
            ProcSort::Allocated => {
                rows.sort_by_key(|r| (std::cmp::Reverse(r.totals.bytes_allocated()), r.pid))
            }
            // Calls mode keeps no live map: its rate stands in that column.
            ProcSort::Live if self.view().calls => {
                rows.sort_by_key(|r| (std::cmp::Reverse(r.rate), r.pid))
            }
            // What ended processes hold is not live any more: after the running ones.
            ProcSort::Live => {
                rows.sort_by_key(|r| (r.exited, std::cmp::Reverse(r.totals.live_bytes), r.pid))
            }
            ProcSort::Rss => rows.sort_by_key(|r| (std::cmp::Reverse(r.rss_kb), r.pid)),
            ProcSort::Pid => rows.sort_by_key(|r| r.pid),
        }
        rows
    }

    /// Exact request sizes (all functions but free), in the chosen order.
    pub fn size_rows(&self) -> Vec<SizeRow> {
        let mut rows: Vec<SizeRow> = self
            .view()
            .sizes_by_func(None)
            .into_iter()
            .filter_map(|((f, size), count)| {
                Some(SizeRow {
                    func: Func::from_u32(f)?.name(),
                    size,
                    count,
                })
            })
            .collect();
        match self.size_sort {
            SizeSort::Count => rows.sort_by_key(|r| (std::cmp::Reverse(r.count), r.size)),
            SizeSort::Bytes => rows.sort_by_key(|r| (std::cmp::Reverse(r.count * r.size), r.size)),
            SizeSort::Size => rows.sort_by_key(|r| (r.size, r.func)),
        }
        rows
    }

    /// The exact sizes grouped in power-of-two classes, smallest first, empty ones left out.
    pub fn size_classes(&self) -> Vec<SizeClass> {
        let mut by: BTreeMap<usize, SizeClass> = BTreeMap::new();
        for r in self.size_rows() {
            let b = log2_bucket(r.size);
            let c = by.entry(b).or_insert(SizeClass {
                from: log2_bucket_floor(b),
                count: 0,
                bytes: 0,
            });
            c.count += r.count;
            c.bytes += r.count * r.size;
        }
        by.into_values().collect()
    }

    /// The site under the cursor on the sites screen.
    pub fn current_site(&self) -> Option<SiteRow> {
        self.site_rows()
            .into_iter()
            .nth(self.selected(Screen::Sites))
    }
}
