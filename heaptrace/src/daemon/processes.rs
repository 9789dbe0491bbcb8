//! Processes that start, exec and end while traced: a launched command's events, execs
//! reported by the kernel, and what ended processes leave behind (their leaks, their map
//! space, their place among the ones kept whole).
use super::*;

impl Daemon {
    /// Processes that ended before the round just applied (and not before an earlier one),
    /// so their final counts are in it: keep their leaks and free their map space. Returns the
    /// processes marked ended, and those then folded, for the recording.
    pub(super) fn forget_exited(&mut self, gone: HashSet<u32>) -> Result<(Vec<u32>, Vec<u32>)> {
        if gone.is_empty() {
            return Ok(Default::default());
        }
        let left = self.maps.forget(&gone)?;
        let leaks = self.matching(self.same.leaks(left));
        let mut leaks = self.incarnations.rekey_sites(leaks);
        self.exited_leaks.append(&mut leaks);
        let (mut ended, mut folded) = (Vec::new(), Vec::new());
        for p in &gone {
            self.drop_finalize_hold(*p, true);
            self.reserves.forget(*p);
            self.same.forget(*p);
            // Its stacks were named in the round just applied; no more will come.
            self.modules.forget(*p);
            // A process that gets the pid next is judged anew.
            self.matched.remove(p);
            let key = self.incarnations.key(*p);
            if self.profile.end(key) {
                // An OOM victim's heap is the evidence: kept whole, never folded.
                if !self.profile.procs.get(&key).is_some_and(|pp| pp.oom_killed) {
                    let sites = self.profile.sites_of(key);
                    self.exited_kept.push(key, sites);
                }
                ended.push(key);
            }
        }
        // The maps are read meanwhile if they fill: one compiler's fold took seconds of a
        // round beside a Rust build.
        let mut kept_up = Instant::now();
        let mut failed = None;
        while let Some(key) = self.exited_kept.next_to_fold(self.keep_exited) {
            let maps = &mut self.maps;
            let mut tick = || {
                if kept_up.elapsed() >= RELIEF_EVERY {
                    if let Err(e) = maps.relieve() {
                        failed.get_or_insert(e);
                    }
                    kept_up = Instant::now();
                }
            };
            tick();
            let made = self
                .profile
                .fold_pacing(key, &mut self.exited_leaks, &mut tick);
            self.folded_stacks.extend(made);
            folded.push(key);
        }
        if let Some(e) = failed {
            return Err(e);
        }
        Ok((ended, folded))
    }

    /// Leaks (by pid) of the processes `--comm`/`--cgroup` keep: the kernel's live map holds
    /// every process's blocks.
    pub fn matching<V>(&self, leaks: BTreeMap<SiteId, V>) -> BTreeMap<SiteId, V> {
        if self.filter.is_none() {
            return leaks;
        }
        leaks
            .into_iter()
            .filter(|(k, _)| self.matched.get(&k.0).copied().unwrap_or(false))
            .collect()
    }

    /// A followed fork's new image: its unwind tables go in before it runs, as the command's
    /// do, and its Python's finalization is held as theirs is.
    fn fork_started(&mut self, pid: u32) {
        self.modules.refresh(pid);
        self.drop_finalize_hold(pid, false);
        self.hold_finalize(pid);
    }

    /// A seized tree's new image, held at its start (`targets::seized`): its tables go in,
    /// then it goes on. None: the tree's tracer is gone.
    pub(super) fn tree_event(&mut self, ev: Option<launch::Event>) -> Result<()> {
        match ev {
            Some(launch::Event::ForkStarted(pid)) => self.fork_started(pid),
            Some(launch::Event::Finalizing(pid)) => {
                // Its code objects not freed yet: a round names its stacks first.
                self.modules.refresh(pid);
                self.round()?;
            }
            Some(_) => {}
            None => {
                self.tree = None;
                return Ok(());
            }
        }
        if let Some(t) = &self.tree {
            let _ = t.ack.send(());
        }
        Ok(())
    }

    /// Handles an event of a launched command; true once it is gone. At its exit, while it is
    /// held with its mappings intact, a round is drained so its new stacks get names.
    pub(super) fn child_event(&mut self, ev: Option<launch::Event>) -> Result<bool> {
        match ev {
            Some(launch::Event::Exiting) => {
                if let Some(pid) = self.pid {
                    self.modules.refresh(pid);
                }
                self.round()?;
                if let Some(c) = &self.child {
                    let _ = c.ack.send(());
                }
                Ok(false)
            }
            Some(launch::Event::Finalizing(pid)) => {
                self.modules.refresh(pid);
                self.round()?;
                if let Some(c) = &self.child {
                    let _ = c.ack.send(());
                }
                Ok(false)
            }
            Some(launch::Event::Exec) => {
                if let Some(pid) = self.pid {
                    self.drop_finalize_hold(pid, false);
                }
                // Its executable may be its allocator: probed before it runs.
                if let (Some(w), Some(p), Some(pid)) =
                    (self.procwatch.as_mut(), self.probes.as_mut(), self.pid)
                {
                    w.look_at(p, pid);
                }
                // In process: the region started over before the new image's library takes it,
                // and the new image's modules and interpreter read at its start (`Started`), as
                // the probes' exec event has them read: the same python exec'ed again is
                // another interpreter, whose walk the region's header no longer holds.
                if self.maps.exec_held()?
                    && let Some(pid) = self.pid
                {
                    self.modules.forget(pid);
                    self.start_over(HashSet::from([pid]));
                }
                if let Some(c) = &self.child {
                    let _ = c.ack.send(());
                }
                Ok(false)
            }
            Some(launch::Event::ForkStarted(pid)) => {
                self.fork_started(pid);
                if let Some(c) = &self.child {
                    let _ = c.ack.send(());
                }
                Ok(false)
            }
            Some(launch::Event::Started) => {
                // Its startup libraries are mapped: their unwind tables go in before they run.
                if let Some(pid) = self.pid {
                    self.modules.refresh(pid);
                    self.hold_finalize(pid);
                }
                if let Some(c) = &self.child {
                    let _ = c.ack.send(());
                }
                Ok(false)
            }
            Some(launch::Event::Released { per_second }) => {
                let after_ms = self.start.elapsed().as_millis() as u64;
                self.released = Some(Released {
                    after_ms,
                    per_second,
                });
                if let Some(pid) = self.pid {
                    let says = format!(
                        "pid {pid} takes {per_second} signals a second: let go of (ptrace), \
                         its exit and later execs no longer held"
                    );
                    if !self.quiet && self.live.is_none() {
                        crate::say!("heaptrace: {says}");
                    }
                    self.notice = Some(says);
                }
                Ok(false)
            }
            Some(launch::Event::Exited(status)) => {
                self.exit = status;
                Ok(true)
            }
            None => Ok(true),
        }
    }

    /// A launched command's end, once the loop stopped. Quitting the live view interrupts it
    /// as Ctrl-C would without the view, and kills it if it is still there two seconds later;
    /// a second signal to heaptrace kills it at once (the first was passed on to it). A
    /// launched command never runs on untraced.
    pub async fn child_exit(&mut self, end: &End) -> Result<ExitStatus> {
        let Some(pid) = self.pid else {
            return Ok(ExitStatus::Code(1));
        };
        let mut signals: &[i32] = match end {
            End::Quit => &[libc::SIGINT, libc::SIGKILL],
            End::Signal(_) => &[libc::SIGKILL],
            End::TargetExited => &[],
        };
        let mut gone = self.exit.is_some();
        while !gone {
            let last = signals.is_empty();
            if let Some((&sig, rest)) = signals.split_first() {
                // SAFETY: signalling our own child, which its tracer has not reaped.
                unsafe { libc::kill(pid as i32, sig) };
                signals = rest;
            }
            let deadline = tokio::time::sleep(Duration::from_secs(2));
            tokio::pin!(deadline);
            while !gone {
                tokio::select! {
                    ev = child_event(self.child.as_mut()) => gone = self.child_event(ev)?,
                    _ = &mut deadline => break,
                }
            }
            if last {
                break;
            }
        }
        Ok(self.exit.unwrap_or(ExitStatus::Code(1)))
    }

    /// Reads the process events: attaches the allocators of new processes, and starts the
    /// processes that exec'ed over as their new command.
    pub(super) fn process_events(&mut self) {
        let Some(w) = self.procwatch.as_mut() else {
            return;
        };
        let mut got: Vec<_> = self.exec_first.take().into_iter().collect();
        if let Some(rx) = self.execs.as_mut() {
            while let Ok(e) = rx.try_recv() {
                got.push(e);
            }
        }
        let execs = w.drain(got, self.probes.as_mut());
        if let Some(f) = self.followed.as_mut() {
            for p in w.forked.drain(..) {
                f.forked(p);
            }
        }
        self.oom_pending.append(&mut w.oom_killed);
        self.restart(execs);
    }

    /// The mappings the exec watch read right after new processes' execs: the stacks read
    /// next may be theirs (a process of a millisecond, gone by now).
    pub(super) fn early_maps(&mut self) {
        self.take_early_maps(true);
    }

    /// `early_maps` where the exec watch has read some since: between rounds, as soon as it
    /// says so (`ProcWatch::early_ready`), so that a new process's unwind tables go in within
    /// milliseconds of its exec rather than at the next round (its allocations meanwhile walk
    /// without them: `lost.unwind_late`).
    pub(super) fn early_maps_if_any(&mut self) {
        self.take_early_maps(false);
    }

    fn take_early_maps(&mut self, always: bool) {
        let Some(w) = self.procwatch.as_ref() else {
            return;
        };
        let early = match w.early.lock() {
            Ok(mut m) => std::mem::take(&mut *m),
            Err(_) => return,
        };
        if early.is_empty() && !always {
            return;
        }
        // The exec markers among the memory events first: they drop what was read of the
        // image before.
        self.drain_mem();
        for (pid, read) in early {
            self.modules.keep_early(pid, &read);
        }
    }

    /// Processes that exec'ed: the kernel reset their counters at the exec, so their figures
    /// are now those of the new command alone. What the image before the exec did (a shell's
    /// fork between fork and exec; with one process traced, the wrapper script that exec'ed
    /// the program) is dropped from every figure: it belonged to neither the parent nor the
    /// new command.
    pub(super) fn restart(&mut self, execs: Vec<u32>) {
        // The kernel moves a process's epoch on only when it had counters: only those have
        // anything to drop. One read already may hold the new image's counters (this event
        // comes through the exec watch, later than the counters at times): then the epoch it
        // read is the current one, and nothing is dropped (that dropped a launched command's
        // reservations, and counted its work twice in the timeline).
        let pids: HashSet<u32> = execs
            .into_iter()
            .filter(|p| match self.prev.procs.get(p) {
                Some(read) => read.epoch != self.maps.epoch(*p),
                None => {
                    self.profile
                        .procs
                        .get(&self.incarnations.key(*p))
                        .is_some_and(|pp| !pp.exited)
                        || self.maps.has_restarted(*p)
                }
            })
            .collect();
        self.start_over(pids);
    }

    /// Drops what processes `pids` counted before their exec, everywhere: the previous read's
    /// entries now, the Profile's as the next round is applied, the kernel maps' after the next
    /// read.
    pub(super) fn start_over(&mut self, pids: HashSet<u32>) {
        if pids.is_empty() {
            return;
        }
        if self.pid.is_some() {
            for p in &pids {
                // Its name now; else the name the kernel gave at the exec (a short command
                // may be gone by now). Not that name first: when the read finds the exec before
                // its event comes, the watch still has the name before it.
                let comm = procfs::comm(*p)
                    .filter(|c| !c.is_empty())
                    .or_else(|| {
                        self.procwatch
                            .as_ref()
                            .and_then(|w| w.seen.get(p).map(|(c, _)| c.clone()))
                    })
                    .unwrap_or_default();
                let says = format!("pid {p} exec'ed {comm}: its counts start over");
                if !self.quiet && self.live.is_none() {
                    crate::say!("heaptrace: {says}");
                }
                self.notice = Some(says);
            }
        }
        for p in &pids {
            self.prev.procs.remove(p);
            // Dropped from the profile as the next round is added, and so from a recording's.
            self.restarted.insert(*p);
            // Its new image's stacks are named by its new mappings, even at the same addresses.
            self.same.forget(*p);
            // Its memory tracker state is not dropped here: this event and the memory events
            // come on two rings, and the new image's may be read already. The kernel marks
            // the exec among the memory events (`mem::EXEC`).
            // Judged again under its new name.
            self.matched.remove(p);
        }
        for p in &pids {
            // By range: exec events come many a second on a busy host.
            crate::drain::round::take_range(
                &mut self.prev.sizes,
                crate::drain::round::size_keys(*p),
            );
            crate::drain::round::take_range(
                &mut self.prev.sites,
                crate::drain::round::site_ids(*p),
            );
        }
        self.stale.extend(pids);
    }
}
