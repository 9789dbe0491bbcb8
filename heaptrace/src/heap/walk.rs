//! The walk: every arena from `main_arena` along `next`, each arena's heaps chunk by chunk,
//! then its bins, the tcaches and the mmapped chunks. Every value read is checked (sizes,
//! flags, addresses inside the heap walked) and every loop is bounded by the bytes or chunks
//! it walks, so a corrupt or changing heap ends in a counted "unreadable" part, not a hang.
use std::collections::{BTreeMap, HashMap, HashSet};

use super::layout::{self, IS_MMAPPED, Layout, MINSIZE, NON_MAIN_ARENA, PREV_INUSE};
use super::locate::Located;
use super::memory::{Memory, Region};
use super::walk_free::{bins, fastbins, tcaches};

/// What a free chunk is waiting in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FreeKind {
    Tcache,
    Fastbin,
    Unsorted,
    Small,
    Large,
    /// Free by its neighbour's flag, yet in no bin: seen in a heap that changed, or corrupt.
    Unbinned,
}

/// Blocks and their bytes (chunk sizes, or usable sizes where said).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Tally {
    pub blocks: u64,
    pub bytes: u64,
}

impl Tally {
    pub fn add(&mut self, bytes: u64) {
        self.blocks += 1;
        self.bytes += bytes;
    }
}

/// One stretch of chunks: the main arena's brk heap, or one 64 MiB heap of a thread arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Span {
    pub start: u64,
    pub end: u64,
}

/// One arena, walked.
#[derive(Debug, Default)]
pub struct ArenaWalk {
    pub address: u64,
    pub main: bool,
    pub spans: Vec<Span>,
    pub system_mem: u64,
    pub top: u64,
    /// In-use chunks by chunk size.
    pub in_use: BTreeMap<u64, u64>,
    pub free: BTreeMap<FreeKind, Tally>,
    /// Whole pages inside free binned chunks and the top: what `malloc_trim` can return.
    pub trimmable: u64,
    /// Bytes of heap the walk could not read or trust.
    pub unreadable: u64,
    /// Chunks counted in the walk (bounds the list walks).
    pub(super) chunks: u64,
    /// Chunk starts, a bit per 16 bytes of heap (to check list entries).
    starts: Starts,
    /// Free chunks found by their neighbour's flag, not yet found in a bin.
    pub(super) loose: HashMap<u64, u64>,
    /// tcache_perthread_struct candidates: (chunk address, first of its heap).
    pub(super) tcache_candidates: Vec<(u64, bool)>,
    /// Where asked (`walk_blocks`): the in-use chunks (address, size) by their neighbour's
    /// flag, and those the lists then showed free or malloc's own (removed at the end).
    kept: Option<Vec<(u64, u64)>>,
    not_blocks: HashSet<u64>,
}

/// A sparse bitmap of chunk starts: 64 words (64 KiB of heap) per page, made where a chunk
/// is, so a hostile size that jumps far costs nothing.
#[derive(Debug, Default)]
struct Starts(HashMap<u64, Box<[u64; 64]>>);

impl Starts {
    fn set(&mut self, addr: u64) {
        let bit = addr / 16;
        let page = self
            .0
            .entry(bit / 4096)
            .or_insert_with(|| Box::new([0; 64]));
        page[(bit % 4096 / 64) as usize] |= 1 << (bit % 64);
    }

    fn get(&self, addr: u64) -> bool {
        let bit = addr / 16;
        addr.is_multiple_of(16)
            && self
                .0
                .get(&(bit / 4096))
                .is_some_and(|p| p[(bit % 4096 / 64) as usize] & (1 << (bit % 64)) != 0)
    }
}

/// One thread's tcache.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TcacheWalk {
    pub address: u64,
    pub blocks: u64,
    pub bytes: u64,
}

/// What `mp_` says, to check the walk against.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct MpFigures {
    pub n_mmaps: u64,
    pub mmapped_mem: u64,
    pub tcache_count: u64,
}

/// A block in use: the address `malloc` returned and its usable size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub ptr: u64,
    pub size: u64,
}

#[derive(Debug, Default)]
pub struct Walk {
    /// Every block in use, where asked for (`walk_blocks`); empty otherwise.
    pub blocks: Vec<Block>,
    pub arenas: Vec<ArenaWalk>,
    pub tcaches: Vec<TcacheWalk>,
    /// Chunk size -> count.
    pub mmapped: BTreeMap<u64, u64>,
    pub internal: Tally,
    pub mp: MpFigures,
    pub warnings: Vec<String>,
}

/// How many times a running process's arena is walked again when it changed under us.
const ATTEMPTS: u32 = 4;
const MAX_ARENAS: usize = 4096;
const PAGE: u64 = 4096;

pub fn walk(
    mem: &dyn Memory,
    at: &Located,
    regions: &[Region],
    running: bool,
) -> Result<Walk, String> {
    walk_with(mem, at, regions, running, false)
}

/// The walk, and each block in use (`Walk::blocks`): what `heaptrace -p` takes into its live
/// figures. The plain census keeps no list (10 million blocks would be 160 MB).
pub fn walk_blocks(
    mem: &dyn Memory,
    at: &Located,
    regions: &[Region],
    running: bool,
) -> Result<Walk, String> {
    walk_with(mem, at, regions, running, true)
}

fn walk_with(
    mem: &dyn Memory,
    at: &Located,
    regions: &[Region],
    running: bool,
    keep: bool,
) -> Result<Walk, String> {
    let l = at.layout;
    let mut w = Walk::default();
    let mp = read_vec(mem, at.mp, l.mp_size).ok_or("cannot read mp_")?;
    let (tcache_bins, tcache_count) = (word(&mp, l.mp_tcache_bins), word(&mp, l.mp_tcache_count));
    if tcache_bins > l.tcache_bins || tcache_count > u16::MAX as u64 {
        return Err("mp_ does not look like glibc's malloc parameters; refusing to guess".into());
    }
    w.mp = MpFigures {
        n_mmaps: word(&mp, l.mp_n_mmaps) & 0xffff_ffff,
        mmapped_mem: word(&mp, l.mp_mmapped_mem),
        tcache_count,
    };
    let sbrk_base = word(&mp, l.mp_sbrk_base);
    let mut arena = at.main_arena;
    for _ in 0..MAX_ARENAS {
        let main = arena == at.main_arena;
        let mut done = None;
        for attempt in 0..ATTEMPTS {
            mem.refresh();
            let a = walk_arena(mem, l, arena, main, sbrk_base, keep)?;
            let clean = a.unreadable == 0;
            done = Some(a);
            if clean || !running {
                break;
            }
            if attempt + 1 < ATTEMPTS {
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        }
        let a = done.expect("walked at least once");
        if a.unreadable > 0 {
            w.warnings.push(format!(
                "arena {:#x}: {} bytes could not be walked{}",
                arena,
                a.unreadable,
                if running {
                    " (the process changed it; --stop for an exact walk)"
                } else {
                    " (corrupt heap)"
                }
            ));
        }
        let next = mem
            .u64_at(arena.wrapping_add(l.next))
            .ok_or("cannot read an arena's next")?;
        w.arenas.push(a);
        if next == at.main_arena {
            break;
        }
        if next == 0 || w.arenas.iter().any(|a| a.address == next) {
            w.warnings.push(format!(
                "the arena list does not lead back to main_arena at {next:#x}"
            ));
            break;
        }
        arena = next;
    }
    tcaches(mem, l, &mut w, tcache_bins, tcache_count);
    for a in &mut w.arenas {
        if !a.loose.is_empty() {
            let t = a.free.entry(FreeKind::Unbinned).or_default();
            for size in a.loose.values() {
                t.add(*size);
            }
            w.warnings.push(format!(
                "arena {:#x}: {} free chunks in no bin",
                a.address,
                a.loose.len()
            ));
        }
    }
    mmapped(mem, regions, &mut w, keep);
    if keep {
        kept_blocks(&mut w);
    }
    Ok(w)
}

/// The arenas' blocks in use: the chunks in use by their neighbour's flag, less those the
/// lists showed free (tcache, fastbins) and the tcache structs; usable size = chunk - 8.
fn kept_blocks(w: &mut Walk) {
    let mut blocks = std::mem::take(&mut w.blocks);
    for a in &mut w.arenas {
        let not = std::mem::take(&mut a.not_blocks);
        for (chunk, size) in a.kept.take().unwrap_or_default() {
            if !not.contains(&chunk) {
                blocks.push(Block {
                    ptr: chunk + 16,
                    size: size - 8,
                });
            }
        }
    }
    w.blocks = blocks;
}

/// How many arenas' mutexes are held now (a thread inside malloc or free).
pub fn locked_arenas(mem: &dyn Memory, at: &Located) -> usize {
    let mut locked = 0;
    let mut arena = at.main_arena;
    for _ in 0..MAX_ARENAS {
        let mut m = [0u8; 4];
        if mem.read(arena.wrapping_add(at.layout.mutex), &mut m) && m != [0; 4] {
            locked += 1;
        }
        match mem.u64_at(arena.wrapping_add(at.layout.next)) {
            Some(next) if next != at.main_arena && next != 0 => arena = next,
            _ => break,
        }
    }
    locked
}

pub(super) fn read_vec(mem: &dyn Memory, addr: u64, len: u64) -> Option<Vec<u8>> {
    let mut v = vec![0u8; len as usize];
    mem.read(addr, &mut v).then_some(v)
}

pub(super) fn word(b: &[u8], at: u64) -> u64 {
    let at = at as usize;
    b.get(at..at + 8)
        .map_or(0, |s| u64::from_le_bytes(s.try_into().unwrap()))
}

/// The page-aligned bytes strictly inside [from, to).
pub(super) fn whole_pages(from: u64, to: u64) -> u64 {
    let a = from.div_ceil(PAGE) * PAGE;
    let b = to / PAGE * PAGE;
    b.saturating_sub(a)
}

fn walk_arena(
    mem: &dyn Memory,
    l: &Layout,
    address: u64,
    main: bool,
    sbrk_base: u64,
    keep: bool,
) -> Result<ArenaWalk, String> {
    let state = read_vec(mem, address, l.arena_size)
        .ok_or_else(|| format!("cannot read the arena at {address:#x}"))?;
    let mut a = ArenaWalk {
        address,
        main,
        system_mem: word(&state, l.system_mem),
        kept: keep.then(Vec::new),
        ..Default::default()
    };
    let top = word(&state, l.top);
    if address >= USER_END || top >= USER_END {
        return Err(format!(
            "arena {address:#x}: its top {top:#x} is not a user-space address"
        ));
    }
    // Before the first malloc, top is the unsorted bin's head (or, before malloc was ever
    // initialized, the whole arena is still zero): no heap yet.
    if top == 0 || top == address.wrapping_add(l.bins - 16) {
        return Ok(a);
    }
    let top_word = mem
        .u64_at(top.wrapping_add(8))
        .ok_or_else(|| format!("cannot read arena {address:#x}'s top chunk"))?;
    a.top = layout::chunk_size(top_word);
    let top_end = top
        .checked_add(a.top)
        .ok_or("top chunk out of the address space")?;
    a.trimmable += whole_pages(top.saturating_add(MINSIZE), top_end);
    if main {
        if sbrk_base == 0 || sbrk_base > top {
            a.unreadable += a.system_mem;
            return Ok(a);
        }
        a.spans.push(Span {
            start: sbrk_base.saturating_add(15) & !15,
            end: top_end,
        });
    } else {
        let mut heap = top & !(l.heap_max - 1);
        for _ in 0..(MAX_HEAPS) {
            let info = read_vec(mem, heap, l.heap_info_size)
                .ok_or_else(|| format!("cannot read the heap at {heap:#x}"))?;
            if word(&info, l.heap_ar_ptr) != address {
                a.unreadable += a
                    .system_mem
                    .saturating_sub(a.spans.iter().map(|s| s.end - s.start).sum());
                break;
            }
            let size = word(&info, l.heap_size).min(l.heap_max);
            let first = address >= heap && address < heap.saturating_add(size);
            let start = if first {
                // The arena follows heap_info, its first chunk the arena (chunk2mem aligned).
                address.saturating_add(l.arena_size + 16).div_ceil(16) * 16 - 16
            } else {
                heap + l.heap_info_size
            };
            a.spans.push(Span {
                start,
                end: heap.saturating_add(size),
            });
            let prev = word(&info, l.heap_prev);
            if first || prev == 0 {
                break;
            }
            heap = prev;
        }
        a.spans.reverse();
    }
    for i in 0..a.spans.len() {
        walk_span(mem, l, &mut a, i, top)?;
    }
    fastbins(mem, l, &mut a, &state);
    bins(mem, l, &mut a, &state);
    Ok(a)
}

const MAX_HEAPS: usize = 1 << 16;
/// x86-64 user space ends below 2^47 (2^56 with 5-level paging, which glibc heaps do not
/// reach unasked): a pointer past it is not one the walk follows.
const USER_END: u64 = 1 << 56;

/// Walks span `i` chunk by chunk, up to the top chunk or its fence posts.
fn walk_span(
    mem: &dyn Memory,
    l: &Layout,
    a: &mut ArenaWalk,
    i: usize,
    top: u64,
) -> Result<(), String> {
    let Span { start, end } = a.spans[i];
    let arena_flag = if a.main { 0 } else { NON_MAIN_ARENA };
    let mut addr = start;
    let mut header = mem.u64_at(addr.wrapping_add(8));
    let mut first = true;
    let fail = |a: &mut ArenaWalk, at: u64| a.unreadable += end.saturating_sub(at);
    while addr < end {
        if addr == top {
            break;
        }
        let Some(word) = header else {
            fail(a, addr);
            break;
        };
        let size = layout::chunk_size(word);
        if size == 16 {
            break; // fence posts end a heap that is not the last
        }
        let next = addr.saturating_add(size);
        let sane = size >= MINSIZE
            && size.is_multiple_of(16)
            && next <= end
            && word & IS_MMAPPED == 0
            && (word & NON_MAIN_ARENA == 0 || arena_flag != 0);
        if !sane {
            fail(a, addr);
            break;
        }
        let next_word = if next < end {
            mem.u64_at(next.wrapping_add(8))
        } else {
            None
        };
        let Some(nw) = next_word else {
            fail(a, addr);
            break;
        };
        a.starts.set(addr);
        a.chunks += 1;
        // Free chunks lose the arena flag (glibc rewrites their head); chunks in use keep it.
        if nw & PREV_INUSE != 0 && word & NON_MAIN_ARENA != arena_flag {
            fail(a, addr);
            break;
        }
        if nw & PREV_INUSE != 0 {
            *a.in_use.entry(size).or_default() += 1;
            if let Some(k) = a.kept.as_mut() {
                k.push((addr, size));
            }
            if size == l.tcache_size + 16 {
                a.tcache_candidates.push((addr, first));
            }
        } else {
            a.loose.insert(addr, size);
        }
        first = false;
        addr = next;
        header = next_word;
    }
    Ok(())
}

impl ArenaWalk {
    /// Whether a chunk the walk counted starts at `addr`.
    pub(super) fn is_start(&self, addr: u64) -> bool {
        self.starts.get(addr)
    }

    /// Moves an in-use chunk (by its neighbour's flag) to free `kind`, if the walk counted it.
    pub(super) fn take_in_use(&mut self, addr: u64, size: u64, kind: FreeKind) -> bool {
        if !self.is_start(addr) || !self.forget_in_use(size) {
            return false;
        }
        self.not_block(addr);
        self.free.entry(kind).or_default().add(size);
        true
    }

    /// A chunk the walk found in use that is not the program's (free in a list, or a tcache).
    pub(super) fn not_block(&mut self, addr: u64) {
        if self.kept.is_some() {
            self.not_blocks.insert(addr);
        }
    }

    /// Takes one chunk of `size` off the in-use counts, if there is one.
    pub(super) fn forget_in_use(&mut self, size: u64) -> bool {
        let Some(n) = self.in_use.get_mut(&size) else {
            return false;
        };
        *n -= 1;
        if *n == 0 {
            self.in_use.remove(&size);
        }
        true
    }
}

/// Pages of an anonymous region looked at for its first mmapped chunk: a library's `.bss`
/// (zeroed memory past its file, such as one dlopened after the chunks were mapped, just
/// below them) is merged with them into one region by the kernel.
const LEAD_PAGES: u64 = 64;

/// The size of the mmapped chunk at `addr` (its mapping's start: `prev_size` 0), if one is.
fn mmapped_at(mem: &dyn Memory, r: &Region, addr: u64) -> Option<u64> {
    let (prev, word) = (mem.u64_at(addr)?, mem.u64_at(addr.wrapping_add(8))?);
    let size = layout::chunk_size(word);
    // memalign'ed chunks sit `prev` bytes into their mapping; prev_size says so.
    let ok = prev == 0
        && word & 7 == IS_MMAPPED
        && size >= PAGE
        && size.is_multiple_of(PAGE)
        && size <= r.end - addr;
    ok.then_some(size)
}

/// Where the region's first mmapped chunk starts: its start, or one of its first
/// `LEAD_PAGES` pages; its end if none does.
fn first_mmapped(mem: &dyn Memory, r: &Region) -> u64 {
    (0..LEAD_PAGES)
        .map(|i| r.start + i * PAGE)
        .take_while(|a| a.saturating_add(16) <= r.end)
        .find(|a| mmapped_at(mem, r, *a).is_some())
        .unwrap_or(r.end)
}

/// Chunks with their own mapping: anonymous writable regions outside the arenas whose first
/// chunk header says mmapped (the kernel merges neighbouring ones into one region).
fn mmapped(mem: &dyn Memory, regions: &[Region], w: &mut Walk, keep: bool) {
    let in_arena = |r: &Region| {
        w.arenas
            .iter()
            .any(|a| a.spans.iter().any(|s| s.start < r.end && r.start < s.end))
    };
    let mut found = BTreeMap::new();
    for r in regions
        .iter()
        .filter(|r| r.writable && r.file.is_none() && r.special.is_none())
    {
        if in_arena(r) {
            continue;
        }
        let mut addr = first_mmapped(mem, r);
        while addr.saturating_add(16) <= r.end {
            let Some(size) = mmapped_at(mem, r, addr) else {
                // An aligned block starts inside its mapping: not walked (docs/heap-census.md).
                break;
            };
            *found.entry(size).or_insert(0u64) += 1;
            if keep {
                w.blocks.push(Block {
                    ptr: addr + 16,
                    size: size - 16,
                });
            }
            addr += size;
        }
    }
    let n: u64 = found.values().sum();
    if n != w.mp.n_mmaps {
        w.warnings.push(format!(
            "found {n} mmapped chunks, mp_ counts {}",
            w.mp.n_mmaps
        ));
    }
    w.mmapped = found;
}

#[cfg(test)]
mod tests;
