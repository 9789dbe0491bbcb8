//! `/debug/pprof/heap` and `/debug/pprof/allocs`: the running processes' sites as a Go heap
//! profile (alloc_objects, alloc_space since each process was first traced; inuse_objects,
//! inuse_space now), built with the recording export's encoder (`view::export::pprof`).
use std::collections::{BTreeMap, HashMap};

use prost::Message as _;

use super::{Snapshot, query::Query};
use crate::{
    drain::round::{SiteId, SiteTotals},
    profile::{Profile, exited::FOLDED, incarnation::Pid},
    symbolize::Frame,
    view::{
        export::pprof::{ModuleInfo, PProfile, Pprof},
        names::Names,
    },
};

/// Which endpoint: the same four sample types, each with Go's default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// inuse_space by default.
    Heap,
    /// alloc_space by default.
    Allocs,
}

/// The sites of the running processes `q` admits, by id.
pub fn sites(p: &Profile, q: &Query) -> BTreeMap<SiteId, SiteTotals> {
    let admitted: std::collections::HashSet<u32> = p
        .procs
        .iter()
        .filter(|(k, pp)| {
            **k != FOLDED && !pp.exited && q.admits(Pid(**k).real(), &pp.comm, &pp.cgroup)
        })
        .map(|(k, _)| *k)
        .collect();
    p.sites
        .iter()
        .filter(|(id, _)| admitted.contains(&id.0))
        .map(|(id, t)| (*id, t.clone()))
        .collect()
}

/// The four values of a site, less `base`'s (a delta profile) when given.
fn values(t: &SiteTotals, base: Option<&SiteTotals>) -> [i64; 4] {
    let now = [
        t.calls as i64,
        t.bytes as i64,
        t.live_blocks.max(0),
        t.live_bytes.max(0),
    ];
    match base {
        None => now,
        Some(b) => {
            let before = values(b, None);
            std::array::from_fn(|i| now[i] - before[i])
        }
    }
}

/// The profile of the snapshot's running processes that `q` admits. With `base` (the
/// snapshot's sites some seconds before, as `sites` gave them), each value is the change
/// since, as Go's `?seconds=N` delta profiles are.
pub fn build(
    s: &Snapshot,
    q: &Query,
    kind: Kind,
    base: Option<&BTreeMap<SiteId, SiteTotals>>,
) -> PProfile {
    let p = &s.profile;
    let mut samples: Vec<(Vec<Frame>, [i64; 4])> = Vec::new();
    for (id, t) in sites(p, q) {
        let v = values(&t, base.and_then(|b| b.get(&id)));
        if v.iter().all(|x| *x == 0) {
            continue;
        }
        samples.push((p.frames(&id), v));
    }
    let mut b = Pprof::new(p, &modules(p, &samples));
    for (frames, v) in &samples {
        b.sample(frames, &Names::FULL, *v);
    }
    let duration_ms = match (base, q.seconds) {
        (Some(_), Some(secs)) => secs as i64 * 1000,
        _ => s.elapsed_ms as i64,
    };
    let mut out = b.finish((s.start_unix_ms + s.elapsed_ms) as i64, duration_ms);
    if kind == Kind::Allocs {
        // Go's allocs profile is the heap profile shown by alloc_space.
        let id = out.sample_type[1].r#type;
        out.default_sample_type = id;
    }
    out
}

/// The profile, encoded and gzipped as Go serves it.
pub fn encode(profile: &PProfile) -> Vec<u8> {
    use std::io::Write as _;
    let bytes = profile.encode_to_vec();
    let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    // Writing into a Vec cannot fail.
    let _ = z.write_all(&bytes);
    z.finish().unwrap_or_default()
}

/// The modules the samples' frames are in, as mappings: the main binary first (the module of
/// the `main` most samples pass through; else the one named as a process's command), then
/// the others by name.
fn modules(p: &Profile, samples: &[(Vec<Frame>, [i64; 4])]) -> Vec<ModuleInfo> {
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for (frames, _) in samples {
        for f in frames {
            let n = seen.entry(&f.module).or_default();
            if &*f.function == "main" {
                *n += 1;
            }
        }
    }
    let by_main = seen
        .iter()
        .filter(|(_, n)| **n > 0)
        .max_by_key(|(m, n)| (**n, std::cmp::Reverse(**m)))
        .map(|(m, _)| *m);
    let comms: HashMap<&str, ()> = p.procs.values().map(|pp| (pp.comm.as_str(), ())).collect();
    let main = by_main.or_else(|| {
        seen.keys()
            .find(|m| comms.keys().any(|c| !c.is_empty() && m.starts_with(c)))
            .copied()
    });
    let mut names: Vec<&str> = seen.keys().copied().collect();
    names.sort_by_key(|m| (Some(*m) != main, *m));
    names
        .into_iter()
        .map(|m| ModuleInfo {
            path: m.to_string(),
            build_id: String::new(),
            key: m.to_string(),
        })
        .collect()
}

#[cfg(test)]
mod tests;
