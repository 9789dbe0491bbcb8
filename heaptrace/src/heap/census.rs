//! The census: the walk's figures summed up. Byte figures of blocks are usable sizes (what
//! `malloc_usable_size` returns: chunk size - 8 in an arena, - 16 mmapped); free, top and
//! internal figures are chunk sizes, the memory they hold.
use std::collections::BTreeMap;

use super::locate::FoundBy;
use super::walk::{FreeKind, MpFigures, Span, Tally, TcacheWalk, Walk};

#[derive(Debug, serde::Serialize)]
pub struct Census {
    pub source: Source,
    pub glibc: String,
    pub found_by: FoundBy,
    /// Whether the process was stopped for the walk (always true of a core).
    pub exact: bool,
    /// Blocks the program holds, arenas and mmapped: usable bytes.
    pub in_use: Tally,
    pub in_use_chunk_bytes: u64,
    pub free: FreeTotals,
    /// The arenas' top chunks.
    pub top: Tally,
    pub mmapped: Tally,
    pub mmapped_chunk_bytes: u64,
    /// malloc's own blocks: the tcache_perthread_structs.
    pub internal: Tally,
    /// In-use blocks by usable size.
    pub sizes: Vec<SizeCount>,
    pub arenas: Vec<ArenaCensus>,
    pub tcaches: Vec<TcacheWalk>,
    /// Free bytes in the arenas (top aside) over those plus in-use chunk bytes.
    pub fragmentation: f64,
    /// Whole pages in free chunks and tops: at most what malloc_trim(0) returns (some may
    /// be returned already).
    pub trimmable_bytes: u64,
    pub unreadable_bytes: u64,
    /// What mp_ says, as a cross-check.
    pub mp: MpFigures,
    pub warnings: Vec<String>,
}

#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    Pid(u32),
    Core(std::path::PathBuf),
}

#[derive(Debug, Default, serde::Serialize)]
pub struct FreeTotals {
    pub blocks: u64,
    pub bytes: u64,
    pub by_kind: BTreeMap<FreeKind, Tally>,
}

#[derive(Debug, serde::Serialize)]
pub struct SizeCount {
    pub size: u64,
    pub count: u64,
}

#[derive(Debug, serde::Serialize)]
pub struct ArenaCensus {
    pub address: u64,
    pub main: bool,
    pub heaps: Vec<Span>,
    pub system_mem: u64,
    pub top_bytes: u64,
    pub in_use: Tally,
    pub free: Tally,
    pub unreadable_bytes: u64,
}

pub struct About {
    pub source: Source,
    pub glibc: (u32, u32),
    pub found_by: FoundBy,
    pub exact: bool,
}

pub fn census(w: Walk, about: About) -> Census {
    let mut sizes: BTreeMap<u64, u64> = BTreeMap::new();
    let mut c = Census {
        source: about.source,
        glibc: format!("{}.{}", about.glibc.0, about.glibc.1),
        found_by: about.found_by,
        exact: about.exact,
        in_use: Tally::default(),
        in_use_chunk_bytes: 0,
        free: FreeTotals::default(),
        top: Tally::default(),
        mmapped: Tally::default(),
        mmapped_chunk_bytes: 0,
        internal: w.internal,
        sizes: Vec::new(),
        arenas: Vec::new(),
        tcaches: w.tcaches,
        fragmentation: 0.0,
        trimmable_bytes: 0,
        unreadable_bytes: 0,
        mp: w.mp,
        warnings: w.warnings,
    };
    for a in &w.arenas {
        let mut in_use = Tally::default();
        for (&chunk, &n) in &a.in_use {
            *sizes.entry(chunk - 8).or_default() += n;
            in_use.blocks += n;
            in_use.bytes += n * (chunk - 8);
            c.in_use_chunk_bytes += n * chunk;
        }
        let mut free = Tally::default();
        for (kind, t) in &a.free {
            let k = c.free.by_kind.entry(*kind).or_default();
            k.blocks += t.blocks;
            k.bytes += t.bytes;
            free.blocks += t.blocks;
            free.bytes += t.bytes;
        }
        if a.top > 0 {
            c.top.add(a.top);
        }
        c.in_use.blocks += in_use.blocks;
        c.in_use.bytes += in_use.bytes;
        c.trimmable_bytes += a.trimmable;
        c.unreadable_bytes += a.unreadable;
        c.arenas.push(ArenaCensus {
            address: a.address,
            main: a.main,
            heaps: a.spans.clone(),
            system_mem: a.system_mem,
            top_bytes: a.top,
            in_use,
            free,
            unreadable_bytes: a.unreadable,
        });
    }
    for (&chunk, &n) in &w.mmapped {
        *sizes.entry(chunk - 16).or_default() += n;
        c.mmapped.blocks += n;
        c.mmapped.bytes += n * (chunk - 16);
        c.mmapped_chunk_bytes += n * chunk;
    }
    c.in_use.blocks += c.mmapped.blocks;
    c.in_use.bytes += c.mmapped.bytes;
    c.free.blocks = c.free.by_kind.values().map(|t| t.blocks).sum();
    c.free.bytes = c.free.by_kind.values().map(|t| t.bytes).sum();
    let arena_in_use = c.in_use_chunk_bytes;
    if c.free.bytes + arena_in_use > 0 {
        c.fragmentation = c.free.bytes as f64 / (c.free.bytes + arena_in_use) as f64;
    }
    c.sizes = sizes
        .into_iter()
        .map(|(size, count)| SizeCount { size, count })
        .collect();
    c
}
