//! Where a trace's counters come from: the kernel's maps (`KernelMaps`), or the region the
//! preloaded library of `--in-process` counts into (`in_process::Region`). The daemon reads
//! either through this one interface, and folds what it reads into the same rounds.
use std::collections::{BTreeMap, BTreeSet, HashSet};

use crate::{
    drain::{
        Freed, KernelMaps,
        round::{Leak, SiteId, Snapshot},
    },
    error::Result,
};

pub trait Source {
    /// Every counter, read once (cumulative).
    fn snapshot(&mut self) -> Result<Snapshot>;
    /// Between rounds: retires what the maps hold of past rounds if they are filling, so that
    /// a long round loses nothing (`drain::relief`); whether it did.
    fn relieve(&mut self) -> Result<bool> {
        Ok(false)
    }
    /// A stored stack's return addresses, innermost first, and whether it is whole.
    fn stack(&self, id: i32) -> Option<(Vec<u64>, bool)>;
    /// Blocks still live, by site; `pids` narrows them.
    fn live_blocks(&self, pids: Option<&HashSet<u32>>) -> Result<BTreeMap<SiteId, Leak>>;
    /// Forgets processes that ended; returns their leaks.
    fn forget(&mut self, pids: &HashSet<u32>) -> Result<BTreeMap<SiteId, Leak>>;
    /// Drops what earlier images of processes that exec'ed left; returns stacks only they held.
    fn restarted(&mut self, pids: &HashSet<u32>) -> Result<BTreeSet<i32>>;
    /// Frees stored stacks for others to take; returns what each held.
    fn free_stacks(&mut self, ids: Vec<i32>) -> Freed;
    /// Frees the ids of stacks idle while their processes live (`drain::idle`); returns what
    /// each held. A source whose stacks have no ids to run out of frees none.
    fn free_idle_stacks(&mut self, _ids: Vec<i32>) -> Freed {
        Freed::default()
    }
    /// The ids stored since the last call, and those of them freed while idle and now
    /// another stack's (`KernelMaps::take_stored`).
    fn take_stored(&mut self) -> (Vec<i32>, Vec<i32>) {
        Default::default()
    }
    /// The image the counters of `tgid` are of.
    fn epoch(&self, tgid: u32) -> u32;
    fn has_restarted(&self, tgid: u32) -> bool;
    /// Frees in-flight records of threads gone; returns how many.
    fn purge_inflight(&mut self, thread_alive: &dyn Fn(u32, u32) -> bool) -> Result<usize>;
    /// Nothing is counted from here on (the probes' own detach does it for the kernel).
    fn stop(&mut self) {}
    /// What the in-process region lost beyond the loss counters.
    fn region_lost(&self) -> crate::profile::complete::RegionLost {
        Default::default()
    }
    /// Why this source's counts are known incomplete, besides the losses (at the end).
    fn incomplete(&self) -> Vec<crate::profile::complete::Incomplete> {
        Vec::new()
    }
    /// The launched command exec'ed and is held before its new image runs: whether its
    /// counts were started over here (the kernel's start over at the exec by themselves).
    fn exec_held(&mut self) -> Result<bool> {
        Ok(false)
    }
}

impl Source for KernelMaps {
    fn snapshot(&mut self) -> Result<Snapshot> {
        KernelMaps::snapshot(self)
    }
    fn relieve(&mut self) -> Result<bool> {
        KernelMaps::relieve(self)
    }
    fn stack(&self, id: i32) -> Option<(Vec<u64>, bool)> {
        KernelMaps::stack(self, id)
    }
    fn live_blocks(&self, pids: Option<&HashSet<u32>>) -> Result<BTreeMap<SiteId, Leak>> {
        KernelMaps::live_blocks(self, pids)
    }
    fn forget(&mut self, pids: &HashSet<u32>) -> Result<BTreeMap<SiteId, Leak>> {
        KernelMaps::forget(self, pids)
    }
    fn restarted(&mut self, pids: &HashSet<u32>) -> Result<BTreeSet<i32>> {
        KernelMaps::restarted(self, pids)
    }
    fn free_stacks(&mut self, ids: Vec<i32>) -> Freed {
        KernelMaps::free_stacks(self, ids)
    }
    fn free_idle_stacks(&mut self, ids: Vec<i32>) -> Freed {
        KernelMaps::free_idle_stacks(self, ids)
    }
    fn take_stored(&mut self) -> (Vec<i32>, Vec<i32>) {
        KernelMaps::take_stored(self)
    }
    fn epoch(&self, tgid: u32) -> u32 {
        KernelMaps::epoch(self, tgid)
    }
    fn has_restarted(&self, tgid: u32) -> bool {
        KernelMaps::has_restarted(self, tgid)
    }
    fn purge_inflight(&mut self, thread_alive: &dyn Fn(u32, u32) -> bool) -> Result<usize> {
        KernelMaps::purge_inflight(self, thread_alive)
    }
}
