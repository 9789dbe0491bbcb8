//! The live view's state: which screen, which rows, in which order, what is selected, paused,
//! filtered or reset. Pure: no terminal and no clock. The event loop feeds it keys and the
//! snapshots the daemon publishes; `ui.rs` draws it. Every figure comes from the daemon's
//! Profile (through `Profile::since` and `Profile::only`), the one every other view reads.
use std::{
    collections::{BTreeMap, VecDeque},
    sync::Arc,
};

use heaptrace_common::{Func, log2_bucket, log2_bucket_floor};
use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use serde_json::{Value, json};

use crate::{
    drain::round::Leak,
    drain::round::{SiteId, SiteTotals, Totals},
    probe::Attached,
    profile::histogram::{Percentiles, percentiles},
    profile::{Profile, TimelineRow},
    run_info::{RunInfo, TargetKind},
    symbolize::Frame,
    view::json as doc,
    view::summary::shown_funcs,
};

/// What the view knows about the run from the start.
#[derive(Clone, Debug, Default)]
pub struct Info {
    /// "pid 1234 (prog)", "all processes", "./prog arg (pid 1234)".
    pub target: String,
    pub run: RunInfo,
    pub attached: Vec<Attached>,
    /// Where a launched command's output goes while the view is up.
    pub output: Option<String>,
}

impl Info {
    pub fn probe_count(&self) -> usize {
        self.attached
            .iter()
            .map(|a| if a.uretprobe { 2 } else { 1 })
            .sum()
    }
}

/// What the daemon publishes after each round.
#[derive(Clone, Debug, Default)]
pub struct Published {
    pub profile: Profile,
    pub elapsed_ms: u64,
    /// heaptrace's own CPU use over the last round, in percent of one CPU.
    pub cpu_percent: Option<f64>,
    /// Set once tracing is over (the target exited): why, and the leaks are final.
    pub ended: Option<String>,
    pub exit_code: Option<i32>,
    /// The last thing worth saying that is no figure (the traced process exec'ed).
    pub notice: Option<String>,
}

impl Published {
    pub fn round(&self) -> u64 {
        self.profile.rounds.last().map_or(0, |r| r.index)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Screen {
    Timeline,
    Sites,
    Sizes,
    Functions,
    Processes,
}

impl Screen {
    pub const ALL: [Screen; 5] = [
        Screen::Timeline,
        Screen::Sites,
        Screen::Sizes,
        Screen::Functions,
        Screen::Processes,
    ];

    pub fn title(self) -> &'static str {
        match self {
            Screen::Timeline => "Timeline",
            Screen::Sites => "Sites",
            Screen::Sizes => "Sizes",
            Screen::Functions => "Functions",
            Screen::Processes => "Processes",
        }
    }

    fn index(self) -> usize {
        Screen::ALL.iter().position(|s| *s == self).unwrap_or(0)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SiteSort {
    Bytes,
    Calls,
    Live,
    Temporary,
    Leaks,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcSort {
    Busiest,
    Allocated,
    Live,
    Rss,
    Pid,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FuncSort {
    Family,
    Calls,
    Bytes,
    P99,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SizeSort {
    Count,
    Bytes,
    Size,
}

impl SiteSort {
    pub fn name(self) -> &'static str {
        match self {
            SiteSort::Bytes => "bytes",
            SiteSort::Calls => "calls",
            SiteSort::Live => "live",
            SiteSort::Temporary => "temporary",
            SiteSort::Leaks => "leaks",
        }
    }
    fn next(self) -> SiteSort {
        match self {
            SiteSort::Bytes => SiteSort::Calls,
            SiteSort::Calls => SiteSort::Live,
            SiteSort::Live => SiteSort::Temporary,
            SiteSort::Temporary => SiteSort::Leaks,
            SiteSort::Leaks => SiteSort::Bytes,
        }
    }
}

impl ProcSort {
    pub fn name(self) -> &'static str {
        match self {
            ProcSort::Busiest => "calls",
            ProcSort::Allocated => "bytes",
            ProcSort::Live => "live",
            ProcSort::Rss => "rss",
            ProcSort::Pid => "pid",
        }
    }
    fn next(self) -> ProcSort {
        match self {
            ProcSort::Busiest => ProcSort::Allocated,
            ProcSort::Allocated => ProcSort::Live,
            ProcSort::Live => ProcSort::Rss,
            ProcSort::Rss => ProcSort::Pid,
            ProcSort::Pid => ProcSort::Busiest,
        }
    }
}

impl FuncSort {
    pub fn name(self) -> &'static str {
        match self {
            FuncSort::Family => "family",
            FuncSort::Calls => "calls",
            FuncSort::Bytes => "bytes",
            FuncSort::P99 => "p99",
        }
    }
    fn next(self) -> FuncSort {
        match self {
            FuncSort::Family => FuncSort::Calls,
            FuncSort::Calls => FuncSort::Bytes,
            FuncSort::Bytes => FuncSort::P99,
            FuncSort::P99 => FuncSort::Family,
        }
    }
}

impl SizeSort {
    pub fn name(self) -> &'static str {
        match self {
            SizeSort::Count => "count",
            SizeSort::Bytes => "bytes",
            SizeSort::Size => "size",
        }
    }
    fn next(self) -> SizeSort {
        match self {
            SizeSort::Count => SizeSort::Bytes,
            SizeSort::Bytes => SizeSort::Size,
            SizeSort::Size => SizeSort::Count,
        }
    }
}

/// What the event loop must do after a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    None,
    Quit,
    /// Write what is on screen as JSON (see `App::export`).
    Write,
}

/// One row of the sites screen.
#[derive(Clone, Debug, PartialEq)]
pub struct SiteRow {
    pub id: SiteId,
    pub totals: SiteTotals,
    /// Blocks of this site still live at the end; None while tracing goes on.
    pub leak: Option<Leak>,
    /// The site's stack (shared with the Profile, not copied) and the frame it is named by:
    /// the innermost one outside the allocator (see `meaningful_frame`).
    pub frames: Arc<[Frame]>,
    pub named: usize,
}

impl SiteRow {
    pub fn frame(&self) -> &Frame {
        &self.frames[self.named]
    }

    pub fn func(&self) -> &'static str {
        Func::from_u32(self.id.2).map(|f| f.name()).unwrap_or("?")
    }
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

/// How many rounds of each process the view keeps for its timeline when focused on it.
pub const PROC_HISTORY: usize = 600;

pub struct App {
    pub info: Info,
    /// The newest snapshot.
    latest: Arc<Published>,
    /// The snapshot on screen: the newest unless paused.
    shown: Arc<Published>,
    /// The snapshot at the last reset (`r`): figures are shown since it.
    baseline: Option<Arc<Published>>,
    /// The process every screen is focused on (chosen on the processes screen).
    focus: Option<u32>,
    /// `shown` since the baseline, all processes (None: `shown` itself, no copy).
    all: Option<Profile>,
    /// `all` narrowed to the focused process (None: `all` itself).
    view: Option<Profile>,
    pub screen: Screen,
    pub paused: bool,
    pub help: bool,
    /// The site whose stack is open (Enter on the sites screen), and its scroll.
    pub detail: Option<SiteId>,
    pub detail_scroll: usize,
    /// Narrows the sites (by a frame's function or module, or the allocating function) and the
    /// processes (by command or pid); the other screens show every row.
    pub filter: String,
    pub editing_filter: bool,
    pub site_sort: SiteSort,
    pub proc_sort: ProcSort,
    pub func_sort: FuncSort,
    pub size_sort: SizeSort,
    /// Selected row per screen.
    selected: [usize; 5],
    /// The selected site and process, kept across refreshes that reorder the rows.
    selected_site: Option<SiteId>,
    selected_pid: Option<u32>,
    /// A message for the status line (what `w` wrote, what a key did).
    pub status: String,
    /// Per process: its rounds, from the snapshots seen (the Profile's timeline sums them all).
    history: BTreeMap<u32, VecDeque<TimelineRow>>,
    last_totals: BTreeMap<u32, Totals>,
}

/// Frames of allocation wrappers that are never the interesting caller.
fn is_wrapper(f: &Frame) -> bool {
    const WRAPPERS: [&str; 7] = [
        "operator new",
        "__rust_alloc",
        "__rust_realloc",
        "__rdl_alloc",
        "__rdl_realloc",
        "__rg_alloc",
        "alloc::alloc::",
    ];
    WRAPPERS.iter().any(|w| f.function.starts_with(w))
}

/// The frame a site is named by: the innermost one that is neither in the allocator's own
/// module (libc.so.6 calls malloc from strdup, fopen, ...) nor an allocation wrapper (C++
/// `operator new`, Rust's `__rust_alloc`), or the innermost one if every frame is.
pub fn meaningful_frame(frames: &[Frame], allocator_module: &str) -> usize {
    frames
        .iter()
        .position(|f| *f.module != *allocator_module && !is_wrapper(f))
        .unwrap_or(0)
}

/// A long C++ name for one line: template arguments and parameter lists become `<…>` and
/// `(…)`. Names with operators made of those brackets are left alone.
pub fn short_symbol(name: &str) -> String {
    if ["operator<", "operator>", "operator()", "operator-"]
        .iter()
        .any(|o| name.contains(o))
    {
        return name.to_string();
    }
    let mut out = String::with_capacity(name.len());
    let mut depth = 0usize;
    for c in name.chars() {
        match c {
            '<' | '(' => {
                if depth == 0 {
                    out.push(c);
                    out.push('…');
                }
                depth += 1;
            }
            '>' | ')' if depth > 0 => {
                depth -= 1;
                if depth == 0 {
                    out.push(c);
                }
            }
            _ if depth == 0 => out.push(c),
            _ => {}
        }
    }
    out
}

fn matches(hay: &str, needle_lower: &str) -> bool {
    hay.to_lowercase().contains(needle_lower)
}

impl App {
    pub fn new(info: Info, first: Arc<Published>) -> App {
        let mut app = App {
            info,
            latest: first.clone(),
            shown: first,
            baseline: None,
            focus: None,
            all: None,
            view: None,
            screen: Screen::Sites,
            paused: false,
            help: false,
            detail: None,
            detail_scroll: 0,
            filter: String::new(),
            editing_filter: false,
            site_sort: SiteSort::Bytes,
            proc_sort: ProcSort::Busiest,
            func_sort: FuncSort::Family,
            size_sort: SizeSort::Count,
            selected: [0; 5],
            selected_site: None,
            selected_pid: None,
            status: String::new(),
            history: BTreeMap::new(),
            last_totals: BTreeMap::new(),
        };
        if !app.info.run.mode.has_stacks() {
            app.screen = Screen::Timeline;
        }
        app.record_history();
        app.recompute();
        app
    }

    /// Screens this run has: processes only when tracing all of them.
    pub fn screens(&self) -> Vec<Screen> {
        Screen::ALL
            .into_iter()
            .filter(|s| *s != Screen::Processes || self.info.run.target == TargetKind::All)
            .collect()
    }

    /// The Profile on screen: since the baseline, narrowed to the focused process.
    pub fn view(&self) -> &Profile {
        self.view.as_ref().unwrap_or_else(|| self.all())
    }

    /// `shown` since the baseline, all processes.
    fn all(&self) -> &Profile {
        self.all.as_ref().unwrap_or(&self.shown.profile)
    }

    pub fn shown(&self) -> &Published {
        &self.shown
    }

    pub fn latest_round(&self) -> u64 {
        self.latest.round()
    }

    pub fn focus(&self) -> Option<u32> {
        self.focus
    }

    /// The round the figures are counted from (the reset), if any.
    pub fn baseline_round(&self) -> Option<u64> {
        self.baseline.as_ref().map(|b| b.round())
    }

    /// A new snapshot from the daemon. While paused it is kept but not shown.
    pub fn update(&mut self, p: Arc<Published>) {
        self.latest = p;
        self.record_history();
        if !self.paused || self.latest.ended.is_some() && self.shown.ended.is_none() {
            // The end is shown even when paused: the leaks and the exit are final.
            self.shown = self.latest.clone();
            self.recompute();
        }
    }

    fn record_history(&mut self) {
        let p = &self.latest;
        let Some(row) = p.profile.rounds.last() else {
            return;
        };
        for (pid, pp) in &p.profile.procs {
            let prev = self.last_totals.get(pid).copied().unwrap_or_default();
            if self
                .history
                .get(pid)
                .and_then(|h| h.back())
                .is_some_and(|r| r.index >= row.index)
            {
                continue; // already recorded: the same round published again at the end
            }
            let d = pp.totals.minus(&prev);
            let h = self.history.entry(*pid).or_default();
            // The view may have missed a publication: the row covers every round since.
            let rounds = h.back().map_or(1, |b| row.index - b.index);
            h.push_back(TimelineRow {
                index: row.index,
                rounds,
                elapsed_ms: row.elapsed_ms,
                allocations: d.allocations(),
                frees: d.frees(),
                bytes_allocated: d.bytes_allocated(),
                live_blocks: pp.totals.live_blocks,
                live_bytes: pp.totals.live_bytes,
                rss_kb: pp.mem.map_or(0, |m| m.rss_kb),
                virt_kb: pp.mem.map_or(0, |m| m.virt_kb),
                reserved_bytes: pp.reserved.map_or(0, |r| r.total()),
            });
            if h.len() > PROC_HISTORY {
                h.pop_front();
            }
            self.last_totals.insert(*pid, pp.totals);
        }
    }

    fn recompute(&mut self) {
        // Copies only when the figures differ from the snapshot's: heaptrace's own allocations
        // are traced too with --all.
        self.all = self
            .baseline
            .as_ref()
            .map(|b| self.shown.profile.since(&b.profile));
        self.view = self.focus.map(|pid| self.all().only(pid));
        self.reselect();
    }

    /// Keeps the selected site and process selected when new figures reorder the rows.
    fn reselect(&mut self) {
        // The sites are listed once here: thousands of them, each named and sorted.
        let sites = self.site_rows();
        if let Some(id) = self.selected_site
            && let Some(i) = sites.iter().position(|r| r.id == id)
        {
            self.selected[Screen::Sites.index()] = i;
        }
        if let Some(pid) = self.selected_pid
            && let Some(i) = self.proc_rows().iter().position(|r| r.pid == pid)
        {
            self.selected[Screen::Processes.index()] = i + 1;
        }
        for s in Screen::ALL {
            let n = match s {
                Screen::Sites => sites.len(),
                _ => self.row_count(s),
            };
            let sel = &mut self.selected[s.index()];
            *sel = (*sel).min(n.saturating_sub(1));
        }
    }

    pub fn selected(&self, s: Screen) -> usize {
        self.selected[s.index()]
    }

    fn row_count(&self, s: Screen) -> usize {
        match s {
            Screen::Timeline => 0,
            Screen::Sites => self.site_rows().len(),
            Screen::Sizes => self.size_rows().len(),
            Screen::Functions => self.func_rows().len(),
            // The first row is "all processes".
            Screen::Processes => self.proc_rows().len() + 1,
        }
    }

    /// The timeline on screen: the Profile's, or the focused process's own rounds.
    pub fn timeline(&self) -> Vec<TimelineRow> {
        match self.focus {
            None => self.view().rounds.clone(),
            Some(pid) => {
                let from = self.baseline_round().unwrap_or(0);
                let to = self.shown.round();
                self.history
                    .get(&pid)
                    .map(|h| {
                        h.iter()
                            .filter(|r| r.index > from && r.index <= to)
                            .cloned()
                            .collect()
                    })
                    .unwrap_or_default()
            }
        }
    }

    /// The totals on screen (all processes, or the focused one), since the baseline.
    pub fn totals(&self) -> Totals {
        self.view().totals()
    }

    /// The totals of all processes (the first row of the processes screen), since the baseline.
    pub fn all_totals(&self) -> Totals {
        self.all().totals()
    }

    /// The processes screen's sort, as its title says it: calls mode sorts by rate where the
    /// others sort by live bytes.
    pub fn proc_sort_name(&self) -> &'static str {
        if self.view().calls && self.proc_sort == ProcSort::Live {
            "allocs/s"
        } else {
            self.proc_sort.name()
        }
    }

    /// Allocations per second of all processes in the last round.
    pub fn all_rate(&self) -> u64 {
        let rounds = &self.all().rounds;
        let prev = rounds.len().checked_sub(2).and_then(|i| rounds.get(i));
        rounds.last().map_or(0, |last| {
            per_second(last.allocations, last, prev, self.info.run.interval_ms)
        })
    }

    /// Memory of the processes on screen, in KiB: (RSS, VIRT) summed over the live ones.
    pub fn memory(&self) -> Option<(u64, u64)> {
        let mems: Vec<_> = self.view().procs.values().filter_map(|p| p.mem).collect();
        (!mems.is_empty()).then(|| {
            (
                mems.iter().map(|m| m.rss_kb).sum(),
                mems.iter().map(|m| m.virt_kb).sum(),
            )
        })
    }

    /// Losses so far, of the processes on screen (see `summary::losses`).
    pub fn losses(&self) -> Vec<String> {
        crate::view::summary::losses(self.view(), None)
    }

    pub fn site_frames(&self, id: &SiteId) -> Vec<Frame> {
        self.view().frames(id)
    }

    pub fn site_rows(&self) -> Vec<SiteRow> {
        let needle = self.filter.to_lowercase();
        let module = self.info.run.allocator_module();
        let view = self.view();
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
                    totals: *t,
                    leak: leaks.map(|l| l.get(id).copied().unwrap_or_default()),
                    named: meaningful_frame(&frames, module),
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
                rate: self.history.get(pid).map_or(0, |h| {
                    let prev = h.len().checked_sub(2).and_then(|i| h.get(i));
                    h.back().map_or(0, |last| {
                        per_second(last.allocations, last, prev, self.info.run.interval_ms)
                    })
                }),
            })
            .collect();
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

    pub fn sort_name(&self) -> Option<&'static str> {
        match self.screen {
            Screen::Timeline => None,
            Screen::Sites => Some(self.site_sort.name()),
            Screen::Sizes => Some(self.size_sort.name()),
            Screen::Functions => Some(self.func_sort.name()),
            Screen::Processes => Some(self.proc_sort.name()),
        }
    }

    /// The site under the cursor on the sites screen.
    pub fn current_site(&self) -> Option<SiteRow> {
        self.site_rows()
            .into_iter()
            .nth(self.selected(Screen::Sites))
    }

    fn move_selection(&mut self, delta: isize) {
        if self.detail.is_some() {
            self.detail_scroll = self.detail_scroll.saturating_add_signed(delta);
            return;
        }
        let n = self.row_count(self.screen);
        let i = self.screen.index();
        let new = self.selected[i]
            .saturating_add_signed(delta)
            .min(n.saturating_sub(1));
        self.selected[i] = new;
        match self.screen {
            Screen::Sites => self.selected_site = self.site_rows().get(new).map(|r| r.id),
            Screen::Processes => {
                self.selected_pid = new
                    .checked_sub(1)
                    .and_then(|j| self.proc_rows().get(j).map(|r| r.pid))
            }
            _ => {}
        }
    }

    fn switch_screen(&mut self, forward: bool) {
        let screens = self.screens();
        let i = screens.iter().position(|s| *s == self.screen).unwrap_or(0);
        let n = screens.len();
        let j = if forward {
            (i + 1) % n
        } else {
            (i + n - 1) % n
        };
        self.screen = screens[j];
        self.detail = None;
    }

    /// Sets the focus on one process (None: all), as Enter on the processes screen does.
    pub fn set_focus(&mut self, pid: Option<u32>) {
        self.focus = pid;
        self.selected[Screen::Sites.index()] = 0;
        self.selected_site = None;
        self.detail = None;
        self.recompute();
        self.status = match pid {
            Some(p) => format!("every screen shows pid {p} only"),
            None => "every screen shows all processes".into(),
        };
    }

    pub fn toggle_pause(&mut self) {
        self.paused = !self.paused;
        if self.paused {
            self.status = format!(
                "paused at round {}: the kernel keeps counting",
                self.shown.round()
            );
        } else {
            self.shown = self.latest.clone();
            self.recompute();
            self.status = format!("resumed at round {}", self.shown.round());
        }
    }

    /// From now on the figures count from what is on screen now.
    pub fn reset_baseline(&mut self) {
        self.baseline = Some(self.shown.clone());
        self.recompute();
        self.status = format!("figures since round {}", self.shown.round());
    }

    pub fn clear_baseline(&mut self) {
        self.baseline = None;
        self.recompute();
        self.status = "figures since the start".into();
    }

    pub fn on_key(&mut self, key: KeyEvent) -> Action {
        if key.kind == KeyEventKind::Release {
            return Action::None;
        }
        if key.modifiers.contains(KeyModifiers::CONTROL) && key.code == KeyCode::Char('c') {
            return Action::Quit;
        }
        if self.editing_filter {
            match key.code {
                KeyCode::Enter => self.editing_filter = false,
                KeyCode::Esc => {
                    self.editing_filter = false;
                    self.filter.clear();
                    self.recompute();
                }
                KeyCode::Backspace => {
                    self.filter.pop();
                    self.recompute();
                }
                KeyCode::Char(c) => {
                    self.filter.push(c);
                    for s in Screen::ALL {
                        self.selected[s.index()] = 0;
                    }
                    self.recompute();
                }
                _ => {}
            }
            return Action::None;
        }
        if self.help {
            self.help = false;
            return match key.code {
                KeyCode::Char('q') => Action::Quit,
                _ => Action::None,
            };
        }
        match key.code {
            KeyCode::Char('q') => return Action::Quit,
            KeyCode::Esc => {
                if self.detail.is_some() {
                    self.detail = None;
                } else if !self.filter.is_empty() {
                    self.filter.clear();
                    self.recompute();
                } else {
                    return Action::Quit;
                }
            }
            KeyCode::Char('?') | KeyCode::F(1) => self.help = true,
            KeyCode::Tab => self.switch_screen(true),
            KeyCode::BackTab => self.switch_screen(false),
            KeyCode::Char(c @ '1'..='5') => {
                let screens = self.screens();
                if let Some(s) = screens.get(c as usize - '1' as usize) {
                    self.screen = *s;
                    self.detail = None;
                }
            }
            KeyCode::Down | KeyCode::Char('j') => self.move_selection(1),
            KeyCode::Up | KeyCode::Char('k') => self.move_selection(-1),
            KeyCode::PageDown => self.move_selection(10),
            KeyCode::PageUp => self.move_selection(-10),
            KeyCode::Home | KeyCode::Char('g') => self.move_selection(isize::MIN / 2),
            KeyCode::End | KeyCode::Char('G') => self.move_selection(isize::MAX / 2),
            KeyCode::Enter | KeyCode::Right => self.enter(),
            KeyCode::Left | KeyCode::Backspace => self.detail = None,
            KeyCode::Char('s') => self.cycle_sort(),
            KeyCode::Char('/') => {
                self.editing_filter = true;
                self.filter.clear();
                self.recompute();
            }
            KeyCode::Char('p') | KeyCode::Char(' ') => self.toggle_pause(),
            KeyCode::Char('r') => self.reset_baseline(),
            KeyCode::Char('R') => self.clear_baseline(),
            KeyCode::Char('w') => return Action::Write,
            _ => {}
        }
        Action::None
    }

    fn enter(&mut self) {
        match self.screen {
            Screen::Sites => {
                if self.detail.is_some() {
                    self.detail = None;
                } else if let Some(r) = self.current_site() {
                    self.selected_site = Some(r.id);
                    self.detail = Some(r.id);
                    self.detail_scroll = 0;
                }
            }
            Screen::Processes => {
                let sel = self.selected(Screen::Processes);
                let pid = sel
                    .checked_sub(1)
                    .and_then(|i| self.proc_rows().get(i).map(|r| r.pid));
                if pid.is_some() && pid == self.focus {
                    self.set_focus(None);
                } else {
                    self.set_focus(pid);
                }
            }
            _ => {}
        }
    }

    fn cycle_sort(&mut self) {
        match self.screen {
            Screen::Timeline => return,
            Screen::Sites => self.site_sort = self.site_sort.next(),
            Screen::Sizes => self.size_sort = self.size_sort.next(),
            Screen::Functions => self.func_sort = self.func_sort.next(),
            Screen::Processes => self.proc_sort = self.proc_sort.next(),
        }
        self.selected[self.screen.index()] = 0;
        self.selected_site = None;
        self.selected_pid = None;
        self.reselect();
        self.status = format!("sorted by {}", self.sort_name().unwrap_or("-"));
    }

    /// What is on screen as JSON: the view's settings, the current screen's rows (all of them,
    /// filtered and sorted as shown), and the whole `--json` document of the figures on screen
    /// (since the reset, for the focused process).
    pub fn export(&self) -> doc::Node<'_> {
        let frames_json = |id: &SiteId| serde_json::to_value(self.view().frames(id)).ok();
        let rows: Vec<Value> = match (self.screen, self.detail) {
            (Screen::Sites, Some(id)) => vec![doc::with_pid(
                json!({
                    "stack_id": id.1,
                    "function": Func::from_u32(id.2).map(|f| f.name()),
                    "frames": frames_json(&id),
                    "site": self.view().sites.get(&id),
                }),
                id.0,
            )],
            (Screen::Sites, None) => self
                .site_rows()
                .iter()
                .map(|r| {
                    doc::with_pid(json!({
                        "stack_id": r.id.1, "function": r.func(),
                        "frame": r.frame(),
                        "calls": r.totals.calls, "bytes": r.totals.bytes,
                        "live_blocks": r.totals.live_blocks, "live_bytes": r.totals.live_bytes,
                        "temporary": { "blocks": r.totals.temp_blocks, "bytes": r.totals.temp_bytes },
                        "leaked": r.leak,
                    }), r.id.0)
                })
                .collect(),
            (Screen::Functions, _) => self
                .func_rows()
                .iter()
                .map(|r| {
                    json!({
                        "function": r.name, "calls": r.calls, "bytes": r.bytes, "failed": r.failed,
                        "latency": r.latency.map(|p| json!({
                            "count": p.count, "p50_ns": p.p50, "p99_ns": p.p99, "max_ns": p.max,
                            "timed_one_in": self.view().latency_every.max(1) })),
                    })
                })
                .collect(),
            (Screen::Sizes, _) => self
                .size_rows()
                .iter()
                .map(|r| json!({ "function": r.func, "size": r.size, "count": r.count }))
                .collect(),
            (Screen::Processes, _) => self
                .proc_rows()
                .iter()
                .map(|r| {
                    doc::with_pid(json!({
                        "comm": r.comm,
                        "allocations": r.totals.allocations(), "frees": r.totals.frees(),
                        "bytes_allocated": r.totals.bytes_allocated(),
                        "live_blocks": r.totals.live_blocks, "live_bytes": r.totals.live_bytes,
                        "rss_kb": r.rss_kb, "virt_kb": r.virt_kb,
                        "reserved_bytes": r.reserved,
                    }), r.pid)
                })
                .collect(),
            (Screen::Timeline, _) => self
                .timeline()
                .iter()
                .map(|r| serde_json::to_value(r).unwrap_or(Value::Null))
                .collect(),
        };
        let run = doc::Run {
            probes: &self.info.attached,
            ..doc::Run::described(&self.info.run, self.shown.exit_code)
        };
        let view = json!({
            "screen": self.screen.title().to_lowercase(),
            "sort": self.sort_name(),
            "filter": self.filter,
            "focus_pid": self.focus,
            "paused": self.paused,
            "since_round": self.baseline_round(),
            "round": self.shown.round(),
            "elapsed_ms": self.shown.elapsed_ms,
            "ended": self.shown.ended,
        });
        doc::Node::object([
            ("view", view.into()),
            ("rows", Value::Array(rows).into()),
            ("document", doc::document(self.view(), &run)),
        ])
    }
}

#[cfg(test)]
pub(crate) mod tests;
