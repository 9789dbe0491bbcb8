//! The `--json` document: one object written at exit. Its schema is documented in README.md;
//! keys are only ever added, never renamed.
use heaptrace_common::{Func, Loss};
use serde_json::{Map, Value, json};

use crate::{aggregate::Profile, model::Totals, probe::Attached};

/// What the document says about the run itself.
pub struct RunInfo<'a> {
    pub mode: &'static str,
    pub pids: &'a [u32],
    pub command: &'a [String],
    pub exit_code: Option<i32>,
    pub interval_ms: u64,
    pub provider: &'a str,
    pub probes: &'a [Attached],
    /// (alias, probed as).
    pub aliases: &'a [(Func, Func)],
}

fn functions(t: &Totals, aliases: &[(Func, Func)]) -> Value {
    let mut m = Map::new();
    for f in Func::ALL {
        if aliases.iter().any(|(a, _)| *a == f) {
            continue;
        }
        let c = t.func(f);
        let v = match f {
            Func::Free => json!({
                "calls": c.calls,
                "bytes": c.bytes,
                "untracked": t.untracked_frees,
            }),
            Func::Realloc => json!({
                "calls": c.calls,
                "bytes": c.bytes,
                "failed": c.failed,
                "moved": t.realloc_moves,
                "in_place": t.realloc_in_place,
                "freed": t.realloc_frees,
                "released_bytes": t.realloc_released_bytes,
            }),
            _ => json!({ "calls": c.calls, "bytes": c.bytes, "failed": c.failed }),
        };
        m.insert(f.name().into(), v);
    }
    Value::Object(m)
}

fn sizes(profile: &Profile, pid: Option<u32>) -> Value {
    profile
        .sizes_by_func(pid)
        .into_iter()
        .filter_map(|((f, size), count)| {
            Some(json!({ "function": Func::from_u32(f)?.name(), "size": size, "count": count }))
        })
        .collect()
}

fn leaks(profile: &Profile, pid: Option<u32>) -> Value {
    let Some(total) = profile.leak_totals(pid) else {
        return Value::Null;
    };
    let mut by = Map::new();
    for (i, l) in profile.leaks_by_func(pid).iter().enumerate() {
        if l.blocks > 0 {
            by.insert(
                Func::ALL[i].name().into(),
                json!({ "blocks": l.blocks, "bytes": l.bytes }),
            );
        }
    }
    json!({ "blocks": total.blocks, "bytes": total.bytes, "by_function": by })
}

fn totals_summary(t: &Totals) -> Value {
    json!({
        "allocations": t.allocations(),
        "frees": t.frees(),
        "bytes_allocated": t.bytes_allocated(),
    })
}

pub fn document(profile: &Profile, info: &RunInfo<'_>) -> Value {
    let totals = profile.totals();
    let mut lost = Map::new();
    for l in Loss::ALL {
        lost.insert(l.name().into(), profile.losses[l as usize].into());
    }
    let processes: Vec<Value> = profile
        .procs
        .iter()
        .map(|(pid, p)| {
            json!({
                "pid": pid,
                "comm": p.comm,
                "functions": functions(&p.totals, info.aliases),
                "totals": totals_summary(&p.totals),
                "sizes": sizes(profile, Some(*pid)),
                "live": { "blocks": p.totals.live_blocks, "bytes": p.totals.live_bytes },
                "leaks": leaks(profile, Some(*pid)),
                "rss_kb": p.mem.map(|m| m.rss_kb),
                "virt_kb": p.mem.map(|m| m.virt_kb),
                "peak_rss_kb": p.peak_rss_kb,
            })
        })
        .collect();
    let aliases: Map<String, Value> = info
        .aliases
        .iter()
        .map(|(a, of)| (a.name().to_string(), Value::from(of.name())))
        .collect();
    json!({
        "heaptrace": { "version": env!("CARGO_PKG_VERSION"), "format": 1 },
        "target": {
            "mode": info.mode,
            "pids": info.pids,
            "command": info.command,
            "exit_code": info.exit_code,
        },
        "interval_ms": info.interval_ms,
        "rounds": profile.rounds.len(),
        "provider": { "path": info.provider, "probes": info.probes },
        "aliases": aliases,
        "functions": functions(&totals, info.aliases),
        "totals": totals_summary(&totals),
        "sizes": sizes(profile, None),
        "live": { "blocks": totals.live_blocks, "bytes": totals.live_bytes },
        "leaks": leaks(profile, None),
        "lost": lost,
        "processes": processes,
        "timeline": profile.rounds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        aggregate::ProcProfile,
        model::{FnTotals, Totals},
    };

    #[test]
    fn document_has_the_documented_keys_and_merges_aliases() {
        let mut p = Profile::default();
        let mut t = Totals::default();
        t.funcs[Func::Malloc as usize] = FnTotals {
            calls: 4,
            bytes: 400,
            failed: 1,
        };
        t.funcs[Func::Free as usize].calls = 2;
        t.funcs[Func::Free as usize].bytes = 200;
        t.untracked_frees = 1;
        t.live_blocks = 1;
        t.live_bytes = 100;
        p.procs.insert(
            42,
            ProcProfile {
                comm: "fx".into(),
                totals: t,
                ..Default::default()
            },
        );
        p.sizes.insert((42, Func::Malloc as u32, 100), 3);
        let info = RunInfo {
            mode: "command",
            pids: &[42],
            command: &["./fx".into()],
            exit_code: Some(0),
            interval_ms: 1000,
            provider: "/lib/libc.so.6",
            probes: &[],
            aliases: &[(Func::Memalign, Func::AlignedAlloc)],
        };
        let doc = document(&p, &info);
        let f = &doc["functions"];
        assert_eq!(f["malloc"]["calls"], 4);
        assert_eq!(f["malloc"]["failed"], 1);
        assert_eq!(f["free"]["untracked"], 1);
        assert!(f.get("memalign").is_none());
        assert!(f.get("aligned_alloc").is_some());
        assert_eq!(doc["aliases"]["memalign"], "aligned_alloc");
        assert_eq!(doc["sizes"][0]["function"], "malloc");
        assert_eq!(doc["sizes"][0]["count"], 3);
        assert_eq!(doc["live"]["bytes"], 100);
        assert_eq!(doc["totals"]["allocations"], 3);
        assert_eq!(doc["processes"][0]["pid"], 42);
        assert_eq!(doc["lost"]["live_map"], 0);
        assert!(doc["leaks"].is_null());
    }
}
