use super::*;
use crate::heap::locate::FoundBy;

/// Memory made of one buffer at `base`.
struct Fake {
    base: u64,
    bytes: Vec<u8>,
}

impl Memory for Fake {
    fn read(&self, addr: u64, buf: &mut [u8]) -> bool {
        let Some(at) = addr.checked_sub(self.base) else {
            return false;
        };
        let at = at as usize;
        match at
            .checked_add(buf.len())
            .and_then(|e| self.bytes.get(at..e))
        {
            Some(s) => {
                buf.copy_from_slice(s);
                true
            }
            None => false,
        }
    }
}

const BASE: u64 = 0x10_0000;
const ARENA: u64 = BASE;
const MP: u64 = BASE + 0x1000;
const HEAP: u64 = BASE + 0x2000;
const HEAP_LEN: u64 = 0x8000;

fn put(f: &mut Fake, addr: u64, v: u64) {
    let at = (addr - f.base) as usize;
    f.bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// A main arena with `sizes` in use, then a top chunk; empty bins.
fn heap(sizes: &[u64]) -> (Fake, Located) {
    let l = layout::for_version((2, 36)).unwrap();
    let mut f = Fake {
        base: BASE,
        bytes: vec![0; (0x2000 + HEAP_LEN) as usize],
    };
    put(&mut f, ARENA + l.next, ARENA);
    for i in 1..l.nbins {
        let head = ARENA + l.bins + (i - 1) * 16 - 16;
        put(&mut f, head + 16, head);
        put(&mut f, head + 24, head);
    }
    put(&mut f, MP + l.mp_sbrk_base, HEAP);
    put(&mut f, MP + l.mp_tcache_bins, 64);
    put(&mut f, MP + l.mp_tcache_count, 7);
    // A tcache_perthread_struct first, holding the next chunk (32 bytes) for size 32.
    put(&mut f, HEAP + 8, 0x290 | PREV_INUSE);
    put(&mut f, HEAP + 16, 1);
    put(&mut f, HEAP + 16 + l.tcache_entries, HEAP + 0x290 + 16);
    put(&mut f, HEAP + 0x290 + 8, 32 | PREV_INUSE);
    let mut addr = HEAP + 0x290 + 32;
    for s in sizes {
        put(&mut f, addr + 8, s | PREV_INUSE);
        addr += s;
    }
    put(&mut f, ARENA + l.top, addr);
    put(&mut f, addr + 8, (HEAP + HEAP_LEN - addr) | PREV_INUSE);
    let at = Located {
        layout: l,
        main_arena: ARENA,
        mp: MP,
        found_by: FoundBy::CodePatterns,
    };
    (f, at)
}

/// A process that never called malloc: glibc never initialized its arena, every word is
/// still zero. An empty census, not an error (it was "cannot read the top chunk").
#[test]
fn an_arena_malloc_never_initialized_is_an_empty_heap() {
    let (mut f, at) = heap(&[]);
    f.bytes[..0x1000].fill(0);
    let w = walk(&f, &at, &[], false).unwrap();
    assert!(w.arenas.iter().all(|a| a.in_use.is_empty() && a.top == 0));
}

#[test]
fn a_synthetic_heap_is_counted_exactly() {
    let (f, at) = heap(&[48, 48, 208, 1024]);
    let w = walk(&f, &at, &[], false).unwrap();
    let a = &w.arenas[0];
    assert_eq!(a.in_use, BTreeMap::from([(48, 2), (208, 1), (1024, 1)]));
    assert_eq!(a.top, HEAP_LEN - 0x290 - 32 - 48 * 2 - 208 - 1024);
    assert_eq!(
        a.free[&FreeKind::Tcache],
        Tally {
            blocks: 1,
            bytes: 32
        }
    );
    assert_eq!((w.tcaches.len(), w.internal.blocks), (1, 1));
    assert_eq!(a.unreadable, 0);
    assert!(w.blocks.is_empty(), "a plain walk keeps no list");
}

/// The blocks a walk lists are the program's: not the tcache struct, not the chunk in
/// its tcache; their addresses are malloc's and their sizes usable sizes.
#[test]
fn a_walk_lists_each_block_in_use_with_its_usable_size() {
    let (f, at) = heap(&[48, 48, 208, 1024]);
    let w = walk_blocks(&f, &at, &[], false).unwrap();
    let first = HEAP + 0x290 + 32;
    let want: Vec<Block> = [(0, 40), (48, 40), (96, 200), (304, 1016)]
        .iter()
        .map(|&(off, size)| Block {
            ptr: first + off + 16,
            size,
        })
        .collect();
    assert_eq!(w.blocks, want);
}

/// Random words in chunk headers, bin and tcache pointers: the walk ends, without a
/// panic, every time.
#[test]
fn scribbled_heaps_never_panic_or_hang() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let sizes: Vec<u64> = (0..60).map(|i| 32 + 16 * (i % 20)).collect();
    for _ in 0..3000 {
        let (mut f, at) = heap(&sizes);
        for _ in 0..1 + next() % 6 {
            let addr = match next() % 3 {
                // a header, or a user word, in the heap
                0 | 1 => HEAP + (next() % (HEAP_LEN / 8)) * 8,
                // the arena: fastbins, top, bins, next
                _ => ARENA + (next() % (2200 / 8)) * 8,
            };
            let v = match next() % 4 {
                0 => next(),
                1 => HEAP + next() % HEAP_LEN,
                2 => ((next() % 64) * 16) | (next() % 8),
                _ => ARENA + (next() % 2200),
            };
            put(&mut f, addr, v);
        }
        let _ = walk(&f, &at, &[], false);
    }
}
