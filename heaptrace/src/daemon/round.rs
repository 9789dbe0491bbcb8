//! One round: the kernel's maps read, the previous read subtracted, the processes described,
//! the new stacks named, the difference folded into the Profile, recorded and printed.
use super::*;

/// When rounds started, against the interval: a round is late when it starts more than half an
/// interval after it was due (a round that took long, or a daemon kept from its timer).
#[derive(Default)]
pub struct RoundGaps {
    last: Option<Instant>,
    pub late: u64,
    /// The longest time between two rounds' starts, in seconds.
    pub max_gap: f64,
}

impl RoundGaps {
    pub fn tick(&mut self, interval: Duration) {
        let now = Instant::now();
        if let Some(last) = self.last.replace(now) {
            let gap = now.duration_since(last);
            self.max_gap = self.max_gap.max(gap.as_secs_f64());
            if gap > interval + interval / 2 {
                self.late += 1;
            }
        }
    }
}

impl Daemon {
    pub fn round(&mut self) -> Result<()> {
        let began = Instant::now();
        // Execs reported so far are applied before the read, so that it starts their new
        // counts from zero (the read counts only each process's current image).
        self.process_events();
        let gone = self.gone();
        self.drain_mem();
        let snap = self.maps.snapshot()?;
        // Started over at an exec whose event is not read yet: the read says so by its epoch.
        let mut restarted: HashSet<u32> = snap.restarted_since(&self.prev).into_iter().collect();
        restarted.extend(self.execed_uncounted(&snap, &gone));
        self.start_over(restarted);
        // The earlier images of the processes that exec'ed go from the maps (the snapshot
        // counted their current images only), and their stacks are freed below unless others
        // hold them: a shell's forks that exec leave theirs (a pyenv shim's ~35 bash a run).
        let dropped = if self.stale.is_empty() {
            Default::default()
        } else {
            let stale = std::mem::take(&mut self.stale);
            self.maps.restarted(&stale)?
        };
        let mut round = snap.since(&self.prev);
        self.reincarnate(&snap);
        round.reservations = self.reserves.take();
        round.restarted = std::mem::take(&mut self.restarted).into_iter().collect();
        round.index = self.profile.rounds.last().map_or(0, |r| r.index) + 1;
        round.elapsed_ms = self.start.elapsed().as_millis() as u64;
        // Before the filter: a stack counted by any process is not idle.
        let (stored, rebound) = self.maps.take_stored();
        for id in rebound {
            for pid in self.idle.taken(id) {
                self.same.forget_id(pid, id);
            }
        }
        self.idle.note(&stored, &round);
        self.describe_processes(&mut round, &snap);
        let lost = self.reserves.lost - self.reserves_lost;
        round.losses[heaptrace_common::Loss::MemEvents as usize] += lost;
        self.reserves_lost = self.reserves.lost;
        // Since the start, the first provider's and the scan's skips included.
        self.profile.unsafe_files = crate::targets::target_file::skipped();
        self.profile.region_lost = self.maps.region_lost();
        if let Some(filter) = &self.filter {
            filter.apply(&mut round, &mut self.matched);
        }
        // After the filter: the stacks of processes left out are never symbolized (in --all,
        // those of every other program on the host, and their debug info would stay loaded).
        self.new_stacks(&mut round)?;
        self.keep_up()?;
        // Its caches grow with every program the host runs: bounded here, between rounds.
        self.symbolizer.trim();
        self.same.round(&mut round);
        self.incarnations.rekey(&mut round);
        // Those not ended already; the Profile ends them as it applies the round, so that its
        // timeline row and peak leave their blocks out.
        let ending: HashSet<u32> = gone
            .iter()
            .copied()
            .filter(|p| {
                let key = self.incarnations.key(*p);
                self.profile.procs.get(&key).is_none_or(|pp| !pp.exited)
            })
            .collect();
        round.ended = ending.iter().map(|p| self.incarnations.key(*p)).collect();
        self.profile.apply(&round);
        self.keep_up()?;
        // Before the processes gone are forgotten: a victim's blocks are still in the map.
        self.oom_killed()?;
        // Sites first seen from now on were counted after this round's read: the stacks
        // freed before it are no one's now.
        self.freed.clear();
        let theirs = snap.stacks_only_of(&gone, dropped);
        (round.ended, round.folded) = self.forget_exited(ending)?;
        self.forget_gone(&gone);
        self.keep_up()?;
        if !theirs.is_empty() {
            self.idle.dropped(theirs.iter().copied());
            self.freed = self.maps.free_stacks(theirs.into_iter().collect());
        }
        self.free_idle_stacks(&snap, round.index);
        for (id, frames) in std::mem::take(&mut self.folded_stacks) {
            let stack = crate::drain::round::NewStack {
                frames,
                ..Default::default()
            };
            round
                .stacks
                .insert((crate::profile::exited::FOLDED, id), stack);
        }
        self.emit(&round);
        self.prev = snap;
        self.round_seconds = began.elapsed().as_secs_f64();
        log::debug!(
            "round {} done in {:.3} s: {} new stacks, {} stacks held",
            round.index,
            self.round_seconds,
            round.stacks.len(),
            self.idle.held()
        );
        self.publish(None, None);
        Ok(())
    }

    /// What must not wait for the end of a long round (one of seconds on a busy host): the
    /// site and size maps' past keys retired if they are filling, the unwind tables of new
    /// processes written before they allocate much, the memory events drained before their
    /// ring fills.
    fn keep_up(&mut self) -> Result<()> {
        self.early_maps();
        self.maps.relieve()?;
        Ok(())
    }

    /// Processes of the last read missing from this one, alive, whose epoch the kernel moved
    /// on: they exec'ed (their counters went) and have not counted since. Started over now:
    /// once the read no longer holds them, a later read's epoch has nothing to differ from,
    /// and a launched command held at its exec for a round kept its earlier image's figures
    /// when the exec event came late.
    fn execed_uncounted(&self, snap: &Snapshot, gone: &HashSet<u32>) -> Vec<u32> {
        self.prev
            .procs
            .iter()
            .filter(|(p, _)| !snap.procs.contains_key(p) && !gone.contains(p))
            .filter(|(p, read)| self.maps.epoch(**p) != read.epoch && procfs::alive(**p))
            .map(|(p, _)| *p)
            .collect()
    }

    /// Frees the ids of stacks that live processes no longer use (`drain::idle`): the
    /// kernel's stack map then holds a working set, not every stack of a process's life.
    fn free_idle_stacks(&mut self, snap: &Snapshot, now: u64) {
        let reserved = self.reserves.stack_ids();
        let picked = self.idle.pick(snap, now, |id| reserved.contains(&id));
        if picked.is_empty() {
            return;
        }
        let freed = self.maps.free_idle_stacks(picked.keys().copied().collect());
        self.idle.freed_idle(picked, &freed, now);
        self.freed.extend(freed);
    }

    /// The processes found gone. Decided before the snapshot, so that it holds their final
    /// counts (a process found gone after it could still have counted something in between).
    /// Those seen starting since the last read count too: one that lived within a round ends
    /// in it, rather than a round later, its blocks live meanwhile.
    pub(super) fn gone(&self) -> HashSet<u32> {
        if self.pid.is_some() && self.followed.is_none() {
            return HashSet::new();
        }
        // Each pid looked at once: a read of /proc, and most are in both.
        let mut known: HashSet<u32> = self.prev.procs.keys().copied().collect();
        known.extend(self.procwatch.iter().flat_map(|w| w.seen.keys()));
        known.extend(self.followed.iter().flat_map(|f| f.pids.iter()));
        // Read but never counting (taken in at the start, or by a memory syscall): their
        // unwind entries go too.
        known.extend(self.modules.pids());
        // A tree's root ends the trace, as a single process does (its final round).
        if let Some(root) = self.pid {
            known.remove(&root);
        }
        known.retain(|p| !procfs::alive(*p));
        known
    }

    /// A pid whose process is gone, back in the kernel's maps: another process has it.
    pub(super) fn reincarnate(&mut self, snap: &Snapshot) {
        let back: Vec<u32> = snap
            .procs
            .keys()
            .chain(self.restarted.iter())
            .copied()
            .filter(|p| {
                let key = self.incarnations.key(*p);
                self.profile.procs.get(&key).is_some_and(|pp| pp.exited)
            })
            .collect();
        for p in back {
            self.incarnations.next(p);
        }
    }

    /// Each process's name, cgroup, memory and what its allocator holds, as /proc shows them
    /// at the end of the round; processes gone already are named as they were seen starting.
    pub(super) fn describe_processes(&mut self, round: &mut Round, snap: &Snapshot) {
        let pids: Vec<u32> = match self.pid {
            Some(p) if self.followed.is_none() => vec![p],
            _ => snap.procs.keys().copied().collect(),
        };
        if let Some(w) = &self.procwatch {
            for (p, pr) in round.procs.iter_mut() {
                if let Some((comm, cgroup)) = w.seen.get(p) {
                    pr.comm.clone_from(comm);
                    pr.cgroup.clone_from(cgroup);
                }
            }
        }
        for p in pids {
            if !procfs::alive(p) {
                continue;
            }
            let Some(m) = procfs::mem(p) else { continue };
            round.mem.insert(p, m);
            if self.memring.is_some()
                && let Some((start, brk)) = procfs::heap(p)
            {
                if !self.reserves.knows(p) {
                    self.reserves.seed_brk(p, brk);
                }
                let mut r = self.reserves.reserved(p);
                r.heap = brk - start;
                round.reserved.insert(p, r);
            }
            // The kernel names a process at its first allocation, which may be before its
            // exec (a shell's fork): the current name wins while it lives.
            if let Some(pr) = round.procs.get_mut(&p) {
                if let Some(comm) = procfs::comm(p) {
                    pr.comm = comm;
                }
                // A process ending right now keeps the cgroup it was seen starting in.
                if let Some(cgroup) = procfs::cgroup(p) {
                    pr.cgroup = cgroup;
                }
            }
        }
    }

    /// Every one gone, also those that never allocated: no name of theirs is needed again.
    pub(super) fn forget_gone(&mut self, gone: &HashSet<u32>) {
        if let Some(f) = self.followed.as_mut() {
            f.forget(gone);
            // The links of forks followed late (the held ones are closed at their end): only
            // in a followed tree.
            if let Some(p) = &self.probes {
                for g in gone {
                    crate::targets::launch::Forks::gone(p.forks.as_ref(), *g);
                }
            }
        }
        if self.pid.is_none() {
            self.modules.sweep();
        }
        let Some(w) = self.procwatch.as_mut() else {
            return;
        };
        w.seen.retain(|p, _| !gone.contains(p));
        let unjudged = w.judge_cgroups();
        if unjudged > 0 && !self.unjudged_said {
            self.unjudged_said = true;
            crate::say!(
                "heaptrace: warning: {unjudged} cgroups had no room in the kernel's \
                 verdicts: their processes are traced in full and left out in user space"
            );
        }
    }

    /// The round to the recording, and its line to stderr when no live view is up.
    pub(super) fn emit(&mut self, round: &Round) {
        if let Some(r) = &mut self.recorder
            && let Err(e) = r.round(round)
        {
            // A full disk ends the recording, not the trace; what was written stays readable.
            crate::say!("heaptrace: warning: recording stopped: {e}");
            self.recorder = None;
        }
        if !self.quiet
            && self.live.is_none()
            && let Some(row) = self.profile.rounds.last()
        {
            crate::say!("heaptrace: {}", summary::round_line(row, &self.profile));
        }
    }

    /// Folds the memory syscalls reported so far into the reservation tracker.
    pub(super) fn drain_mem(&mut self) {
        let Some(r) = self.memring.as_mut() else {
            return;
        };
        let mut first_seen = Vec::new();
        for ev in r.drain() {
            self.reserves.event(&ev);
            // A process's first memory syscall is in its first allocations, its libraries
            // mapped: read its mappings now, while it surely lives (a command of a few
            // milliseconds may be gone at the next round, its stacks then unnamed). An exec
            // makes them the new image's to read.
            if ev.kind == heaptrace_common::mem::EXEC {
                self.modules.forget(ev.tgid);
            } else if !self.modules.knows(ev.tgid) {
                first_seen.push(ev.tgid);
            }
        }
        first_seen.dedup();
        for pid in first_seen {
            if !self.modules.knows(pid) {
                self.modules.refresh(pid);
            }
        }
    }

    /// Symbolizes the stacks first seen this round, while their processes are (maybe) alive.
    pub(super) fn new_stacks(&mut self, round: &mut crate::drain::round::Round) -> Result<()> {
        self.early_maps();
        let new: Vec<(u32, i32)> = round
            .sites
            .keys()
            .map(|(pid, id, _)| (*pid, *id))
            .chain(round.reservations.keys().map(|(pid, _, id, _)| (*pid, *id)))
            .filter(|(pid, id)| *id >= 0 && !self.same.knows(*pid, *id))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        self.read_python_first(&new);
        let mut refreshed = HashSet::new();
        let mut kept_up = Instant::now();
        for (pid, id) in new {
            // Naming a round's new stacks can take seconds on a starved host (beside two
            // `rustc`, tens of thousands of them); the maps fill meanwhile.
            if kept_up.elapsed() >= RELIEF_EVERY {
                self.keep_up()?;
                kept_up = Instant::now();
            }
            if refreshed.insert(pid) && procfs::alive(pid) {
                self.modules.refresh(pid);
            }
            let stack = self.read_stack(pid, id);
            // Not when shown as a stack seen before: its counts go there.
            if let (to, true) = self.same.add(pid, id, &stack.frames) {
                round.stacks.insert((pid, to), stack);
            }
        }
        // After the stacks are named: a process gone before this round's read may have
        // stacks in the next one.
        self.modules.prune_early(procfs::alive);
        Ok(())
    }

    /// Names the Python frames of the new stacks before any native frame is: a code object
    /// lives only as long as its process (or less), while symbolizing a library's DWARF the
    /// first time can take seconds. The names wait in the code cache for `read_stack`.
    fn read_python_first(&mut self, new: &[(u32, i32)]) {
        let Some(py) = &mut self.modules.python else {
            return;
        };
        // Only stacks of processes whose walk appends Python frames: the others are not
        // read twice.
        for (pid, id) in new {
            if !py.walks(*pid) {
                continue;
            }
            let Some((ips, _)) = self.maps.stack(*id) else {
                continue;
            };
            if let Some(at) = ips
                .iter()
                .position(|ip| *ip == heaptrace_common::python::PY_MARK)
            {
                py.frames(*pid, &ips[at + 1..]);
            }
        }
    }

    /// A stack as stored in the kernel, cut to what is shown, and named.
    pub(super) fn read_stack(&mut self, pid: u32, id: i32) -> crate::drain::round::NewStack {
        // A stack that cannot be read has no frames, and says nothing of lost ones.
        let now = self.maps.stack(id);
        let read = match self.freed.get(&id) {
            None => Some(now.unwrap_or((Vec::new(), true))),
            Some(held) => {
                crate::drain::freed_stack(held.clone(), now, |ip| !self.modules.not_code(pid, ip))
            }
        };
        let Some((mut ips, whole)) = read else {
            return crate::drain::round::NewStack {
                frames: [Frame::taken()].into(),
                ..Default::default()
            };
        };
        // A Python process's walk appends its Python frames after a mark.
        let python = match ips
            .iter()
            .position(|ip| *ip == heaptrace_common::python::PY_MARK)
        {
            Some(at) => {
                let words = ips.split_off(at);
                match &mut self.modules.python {
                    Some(py) => py.frames(pid, &words[1..]),
                    None => Vec::new(),
                }
            }
            None => Vec::new(),
        };
        ips.truncate(self.stack_depth);
        // The first frame is the return address the probe saw; past a function built
        // without frame pointers, the walk read on through data. The kernel's mark of a cut
        // for want of table room is kept, for the views to name.
        if let Some(i) = ips.iter().skip(1).position(|ip| {
            *ip != heaptrace_common::NO_ROOM_FRAME && self.modules.not_code(pid, *ip)
        }) {
            ips.truncate(i + 1);
        }
        if !whole && ips.len() < self.stack_depth {
            ips.push(crate::symbolize::MORE_FRAMES_LOST);
        }
        let locations = Symbolizer::locations(&self.modules, pid, &ips);
        let frames = self.symbolizer.frames(&ips, &locations);
        let frames = crate::symbolize::python::splice::splice(frames, python).into();
        crate::drain::round::NewStack {
            ips,
            locations,
            frames,
        }
    }
}
