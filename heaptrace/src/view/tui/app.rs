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
    /// Every probe attached, the memory syscalls' included: the number stderr said.
    pub probe_count: usize,
    /// Where a launched command's output goes while the view is up.
    pub output: Option<String>,
}

impl Info {
    pub fn probe_count(&self) -> usize {
        self.probe_count
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
    /// The processes screen shows a row per command (`c`): the processes of one as one.
    pub by_command: bool,
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

/// The frame a site is named by (`profile::wrappers`): the innermost one that is neither in
/// the allocator's own module nor an allocation wrapper, or the innermost one if every frame
/// is.
pub fn meaningful_frame(view: &Profile, frames: &[Frame]) -> usize {
    view.wrappers().site(frames).0
}

pub use crate::view::names::short_symbol;

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
            by_command: false,
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

    /// Screens this run has: processes once more than one is traced (--all, or a traced
    /// process's children under --follow-forks).
    pub fn screens(&self) -> Vec<Screen> {
        Screen::ALL
            .into_iter()
            .filter(|s| *s != Screen::Processes || self.many_processes())
            .collect()
    }

    /// Whether rows need to say whose they are: tracing all processes, or more than one seen
    /// (kept once seen, so screens and columns do not come and go as children end).
    pub fn many_processes(&self) -> bool {
        self.info.run.target == TargetKind::All || self.history.len() > 1
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
                rss_processes: pp.mem.is_some() as u64,
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

    /// Memory of the processes on screen, in KiB: (RSS, VIRT, how many) summed over the live
    /// ones.
    pub fn memory(&self) -> Option<(u64, u64, usize)> {
        let mems: Vec<_> = self.view().procs.values().filter_map(|p| p.mem).collect();
        (!mems.is_empty()).then(|| {
            (
                mems.iter().map(|m| m.rss_kb).sum(),
                mems.iter().map(|m| m.virt_kb).sum(),
                mems.len(),
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

    pub fn sort_name(&self) -> Option<&'static str> {
        match self.screen {
            Screen::Timeline => None,
            Screen::Sites => Some(self.site_sort.name()),
            Screen::Sizes => Some(self.size_sort.name()),
            Screen::Functions => Some(self.func_sort.name()),
            Screen::Processes => Some(self.proc_sort.name()),
        }
    }
}

mod export;
mod keys;
mod rows;

pub use rows::{FuncRow, ProcRow, SiteRow, SizeClass, SizeRow, per_second};

#[cfg(test)]
pub(crate) mod tests;
