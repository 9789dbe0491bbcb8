//! Following forks, user space's half (the kernel's: heaptrace-ebpf's forks.rs). The kernel
//! adds each process a followed one forks to its FOLLOWED map before the child first runs, and
//! reports it on the process-event ring; this keeps the set heaptrace waits for, seeds its
//! roots, and removes the processes gone (a pid reused by another process would be traced).
use std::collections::BTreeSet;

use aya::{
    maps::{HashMap, MapData},
    programs::RawTracePoint,
};
use heaptrace_common::maps;

use crate::{
    error::{Error, Result},
    probe::Probes,
    targets::procfs,
};

pub struct Followed {
    map: HashMap<MapData, u32, u32>,
    /// The processes followed and not yet found gone.
    pub pids: BTreeSet<u32>,
}

/// Attaches the fork program alone (`--all` with unwinding on): it gives each fork of a process
/// with an unwind entry a copy of it, so the fork's first calls walk whole.
pub fn inherit_tables(probes: &mut Probes) -> Result<()> {
    attach_fork(probes)
}

/// Attaches the fork program alone (`-p PID` without `--follow-forks`): it reports the
/// process's forks, whose inherited breakpoints user space takes out.
pub fn report_forks(probes: &mut Probes) -> Result<()> {
    attach_fork(probes)
}

fn attach_fork(probes: &mut Probes) -> Result<()> {
    let (prog, tp) = ("on_fork", "sched_process_fork");
    let p: &mut RawTracePoint = crate::probe::program(&mut probes.ebpf, prog)?;
    p.load().map_err(|e| Error::Load(format!("{prog}: {e}")))?;
    p.attach(tp)
        .map_err(|e| Error::Load(format!("{prog} on {tp}: {e}")))?;
    Ok(())
}

impl Followed {
    /// Attaches the fork program and follows `root`, and with `existing` the processes it has
    /// forked already. Call before counting is on: each follows from its first counted call.
    pub fn start(probes: &mut Probes, root: u32, existing: bool) -> Result<Followed> {
        attach_fork(probes)?;
        let map = probes
            .ebpf
            .take_map(maps::FOLLOWED)
            .ok_or_else(|| Error::Load(format!("map {} missing", maps::FOLLOWED)))?;
        let map = HashMap::try_from(map).map_err(|e| Error::Map {
            map: maps::FOLLOWED,
            reason: e.to_string(),
        })?;
        let mut f = Followed {
            map,
            pids: BTreeSet::new(),
        };
        f.add(root, root)?;
        if existing {
            // Twice: a process forked by one not yet in the map while /proc was read is
            // found by the second read (a fork after its parent is in the map, by the kernel).
            for _ in 0..2 {
                for child in procfs::descendants(root) {
                    f.add(child, root)?;
                }
            }
        }
        Ok(f)
    }

    fn add(&mut self, pid: u32, parent: u32) -> Result<()> {
        if self.pids.insert(pid) {
            self.map.insert(pid, parent, 0).map_err(|e| Error::Map {
                map: maps::FOLLOWED,
                reason: e.to_string(),
            })?;
        }
        Ok(())
    }

    /// A fork the kernel reported (it is in its map already).
    pub fn forked(&mut self, pid: u32) {
        self.pids.insert(pid);
    }

    /// Processes found gone: no longer followed, their pids free for others.
    pub fn forget<'a>(&mut self, gone: impl IntoIterator<Item = &'a u32>) {
        for p in gone {
            if self.pids.remove(p) {
                let _ = self.map.remove(p);
            }
        }
    }

    /// The followed processes other than `root` that still run.
    /// The kernel's map is read too: a fork's event may not have come through yet.
    pub fn others_alive(&mut self, root: u32) -> bool {
        let in_kernel: Vec<u32> = self.map.keys().filter_map(|k| k.ok()).collect();
        self.pids.extend(in_kernel);
        self.pids.iter().any(|p| *p != root && procfs::alive(*p))
    }

    /// The followed processes found gone now.
    pub fn gone(&self) -> Vec<u32> {
        self.pids
            .iter()
            .copied()
            .filter(|p| !procfs::alive(*p))
            .collect()
    }
}
