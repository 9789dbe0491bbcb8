//! The free lists of a walk: each arena's fastbins (their links safe-linked since glibc 2.32),
//! its unsorted, small and large bins, and each thread's tcache. Every link followed is checked
//! against the chunk-start map of the heaps walked, and every list is bounded.
use std::collections::HashSet;

use super::layout::{self, Layout};
use super::memory::Memory;
use super::walk::*;

fn reveal(l: &Layout, field: u64, stored: u64) -> u64 {
    if l.safe_linking {
        (field >> 12) ^ stored
    } else {
        stored
    }
}

/// Fastbin chunks keep their neighbour's in-use flag: the walk counted them in use.
pub(super) fn fastbins(mem: &dyn Memory, l: &Layout, a: &mut ArenaWalk, state: &[u8]) {
    for i in 0..l.nfastbins {
        let size = (i + 2) * 16;
        let mut p = word(state, l.fastbins + i * 8);
        let mut n = 0u64;
        while p != 0 && n <= a.chunks {
            let ok = mem
                .u64_at(p.wrapping_add(8))
                .is_some_and(|w| layout::chunk_size(w) == size)
                && a.take_in_use(p, size, FreeKind::Fastbin);
            if !ok {
                a.unreadable += size;
                break;
            }
            n += 1;
            match mem.u64_at(p.wrapping_add(16)) {
                Some(s) => p = reveal(l, p.wrapping_add(16), s),
                None => break,
            }
        }
    }
}

/// The unsorted, small and large bins: doubly linked, unmangled, each ending at its head.
pub(super) fn bins(mem: &dyn Memory, l: &Layout, a: &mut ArenaWalk, state: &[u8]) {
    for i in 1..l.nbins - 1 {
        let fd_at = l.bins + (i - 1) * 16;
        let head = a.address.wrapping_add(fd_at - 16);
        let kind = match i {
            1 => FreeKind::Unsorted,
            2..64 => FreeKind::Small,
            _ => FreeKind::Large,
        };
        let mut p = word(state, fd_at);
        let mut n = 0u64;
        while p != head && n <= a.chunks {
            let Some(size) = a.loose.remove(&p) else {
                a.unreadable += 16; // an entry the walk did not find free: stop this bin
                break;
            };
            a.free.entry(kind).or_default().add(size);
            // glibc's malloc_trim keeps the chunk's header and links (malloc_chunk's 48 bytes).
            a.trimmable += whole_pages(p.saturating_add(48), p.saturating_add(size));
            n += 1;
            match mem.u64_at(p.wrapping_add(16)) {
                Some(next) => p = next,
                None => break,
            }
        }
    }
}

/// A 640-byte `tcache_perthread_struct` from its chunk's user data, if it looks like one:
/// counts within `count`, an entry exactly where a count is not zero.
fn tcache_struct(
    mem: &dyn Memory,
    l: &Layout,
    chunk: u64,
    bins: u64,
    count: u64,
) -> Option<Vec<(u64, u64)>> {
    let b = read_vec(mem, chunk.wrapping_add(16), l.tcache_size)?;
    let mut lists = Vec::new();
    for i in 0..l.tcache_bins {
        let c = u16::from_le_bytes([b[i as usize * 2], b[i as usize * 2 + 1]]) as u64;
        let e = word(&b, l.tcache_entries + i * 8);
        if c > count || (c == 0) != (e == 0) || (i >= bins && c != 0) {
            return None;
        }
        lists.push((c, e));
    }
    Some(lists)
}

/// Each thread's tcache: its struct (the first chunk of a heap, or one holding chunks), and
/// the chunks on its lists, which the walk counted in use (tcache keeps their flags too).
pub(super) fn tcaches(mem: &dyn Memory, l: &Layout, w: &mut Walk, bins: u64, count: u64) {
    let candidates: Vec<(u64, bool)> = w
        .arenas
        .iter()
        .flat_map(|a| a.tcache_candidates.clone())
        .collect();
    let mut seen = HashSet::new();
    for (chunk, first_of_heap) in candidates {
        let Some(lists) = tcache_struct(mem, l, chunk, bins, count) else {
            continue;
        };
        if !first_of_heap && lists.iter().all(|(c, _)| *c == 0) {
            continue; // a zeroed block of the same size; an empty tcache elsewhere is missed
        }
        let struct_size = l.tcache_size + 16;
        if let Some(a) = w.arenas.iter_mut().find(|a| a.is_start(chunk)) {
            a.forget_in_use(struct_size);
            a.not_block(chunk);
        }
        w.internal.add(struct_size);
        let mut t = TcacheWalk {
            address: chunk + 16,
            blocks: 0,
            bytes: 0,
        };
        for (i, (c, mut e)) in lists.into_iter().enumerate() {
            let size = 32 + 16 * i as u64;
            for _ in 0..c {
                let p = e.wrapping_sub(16);
                let fresh = seen.insert(p);
                let owner = w.arenas.iter_mut().find(|a| a.is_start(p));
                let ok = fresh
                    && mem
                        .u64_at(p.wrapping_add(8))
                        .is_some_and(|w| layout::chunk_size(w) == size)
                    && owner.is_some_and(|a| a.take_in_use(p, size, FreeKind::Tcache));
                if !ok {
                    w.warnings.push(format!(
                        "tcache at {:#x}: a bad entry for {size}-byte chunks",
                        chunk + 16
                    ));
                    break;
                }
                t.blocks += 1;
                t.bytes += size;
                match mem.u64_at(e) {
                    Some(s) => e = reveal(l, e, s),
                    None => break,
                }
            }
        }
        w.tcaches.push(t);
    }
}
