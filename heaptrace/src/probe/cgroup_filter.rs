//! `--all --cgroup X` in the kernel. Only user space knows a cgroup's path: it judges each
//! cgroup as it judges processes (`cgroup path contains X`, `daemon::Filter`) and writes
//! the verdict under the cgroup's id, where the programs look a thread's up at its first call
//! (`heaptrace_common::filter`). A cgroup not judged yet leaves its threads traced (and judged
//! again at their next call) until it is: every cgroup of the hierarchy at the start, then each
//! exec's as it is reported, then the whole hierarchy again in a round after cgroups were made
//! or removed (the root's `cgroup.stat` says so; a walk reads every cgroup's directory, ~10 ms
//! for 500 here) and at least every [`WALK_AT_LEAST`].
use std::{
    collections::HashSet,
    time::{Duration, Instant},
};

use aya::maps::{HashMap, MapData};
use heaptrace_common::{
    filter::{EXCLUDED_CGROUP, TRACED},
    maps,
};

use crate::{
    error::{Error, Result},
    targets::cgroups::CgroupNames,
};

/// The hierarchy is walked again this often even when its root says no cgroup came or went.
pub const WALK_AT_LEAST: Duration = Duration::from_secs(30);

pub struct CgroupVerdicts {
    map: HashMap<MapData, u64, u32>,
    pattern: String,
    judged: HashSet<u64>,
    /// The root's `cgroup.stat` at the last walk, and when that was.
    walked: Option<(Option<String>, Instant)>,
    /// Cgroups the map had no room for, at the last walk and since: their threads stay traced
    /// (user space drops them).
    pub unjudged: u64,
    /// A hybrid host: whether a cgroup of the v1 memory hierarchy matches, at the last walk.
    /// Processes in the unified root are then traced (user space judges them by their v1
    /// paths, `procfs::cgroup_path`); else the root is judged as any cgroup.
    v1_match: Option<bool>,
}

impl CgroupVerdicts {
    pub fn take(ebpf: &mut aya::Ebpf, pattern: String) -> Result<CgroupVerdicts> {
        let map = ebpf
            .take_map(maps::CGROUP_VERDICTS)
            .ok_or_else(|| Error::Load(format!("map {} missing", maps::CGROUP_VERDICTS)))?;
        let map = HashMap::try_from(map).map_err(|e| Error::Map {
            map: maps::CGROUP_VERDICTS,
            reason: e.to_string(),
        })?;
        Ok(CgroupVerdicts {
            map,
            pattern,
            judged: HashSet::new(),
            walked: None,
            unjudged: 0,
            v1_match: None,
        })
    }

    /// Judges cgroup `id`, at `path`, unless it was.
    pub fn judge(&mut self, id: u64, path: &str) {
        if self.judged.contains(&id) {
            return;
        }
        let v1 = path == "/" && self.v1_match == Some(true);
        let verdict = if path.contains(self.pattern.as_str()) || v1 {
            TRACED
        } else {
            EXCLUDED_CGROUP
        };
        match self.map.insert(id, verdict, 0) {
            Ok(()) => {
                self.judged.insert(id);
            }
            Err(_) => self.unjudged += 1,
        }
    }

    /// Once a round: walks the hierarchy again if cgroups were made or removed since the last
    /// walk, or it is [`WALK_AT_LEAST`] old.
    pub fn judge_new(&mut self, names: &mut CgroupNames) {
        let stat = names.root_stat();
        let due = self.walked.as_ref().is_none_or(|(was, at)| {
            *was != stat || stat.is_none() || at.elapsed() >= WALK_AT_LEAST
        });
        if due {
            self.judge_all(names);
        }
    }

    /// Walks the hierarchy now: judges the cgroups made since the last walk and forgets the
    /// ones removed (ids are not reused; the map keeps room for new ones).
    pub fn judge_all(&mut self, names: &mut CgroupNames) {
        // Before the walk: a cgroup made during it changes the stat again.
        self.walked = Some((names.root_stat(), Instant::now()));
        names.rescan();
        self.unjudged = 0;
        let v1_match = crate::targets::cgroups::v1_memory_matches(&self.pattern);
        if v1_match != self.v1_match {
            // The unified root is judged again.
            self.v1_match = v1_match;
            if let Some((root, _)) = names.known().find(|(_, p)| *p == "/") {
                self.judged.remove(&root);
            }
        }
        let now: Vec<(u64, String)> = names.known().map(|(id, p)| (id, p.to_owned())).collect();
        let live: HashSet<u64> = now.iter().map(|(id, _)| *id).collect();
        let gone: Vec<u64> = self.judged.difference(&live).copied().collect();
        for id in gone {
            let _ = self.map.remove(&id);
            self.judged.remove(&id);
        }
        for (id, path) in now {
            self.judge(id, &path);
        }
    }
}
