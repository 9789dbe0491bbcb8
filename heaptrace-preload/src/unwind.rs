//! The region's unwind tables as the walker reads them (`heaptrace_common::inproc::UnwindHead`
//! and its rows, written by the daemon from each file's `.eh_frame`): the module that holds a
//! frame's address, then its row, each by binary search. Read under the area's seqlock: the
//! daemon may rewrite the modules meanwhile, so everything read here is bounds-checked before
//! use, and a walk keeps its stack only if the generation did not move (`Tables::unchanged`).
//! What a search found is kept in the thread's cache (`UnwindCache`), by return address: a
//! binary search over libc's 28k rows is a chain of dependent loads, ~0.1 us.
use core::sync::atomic::{AtomicU64, Ordering, fence};

use heaptrace_common::{
    inproc::{
        CACHED_FP, CACHED_FP_NO_ROOM, ThreadHead, UNWIND_CACHE, UnwindCache, UnwindEntry,
        UnwindHead,
    },
    unwind::{MAX_MODULES, MODULE_NO_ROOM, Module, Row, kind},
};

use crate::region::Region;

pub struct Tables {
    head: *mut UnwindHead,
    /// The walking thread's cache, valid for this generation.
    cache: *mut UnwindCache,
    rows: *const Row,
    /// Rows in the area, from the layout this process computed (not from shared memory).
    capacity: u64,
    /// Modules in the entry as read at `begin`.
    count: usize,
}

impl Tables {
    /// The region's tables and their generation, for a walk of the thread of slot `t`, if it
    /// has an area and no rewrite is under way; None: walk by frame pointer.
    #[inline(always)]
    pub fn begin(r: &Region, t: *mut ThreadHead) -> Option<(Tables, u64)> {
        if r.layout.unwind_rows == 0 {
            return None;
        }
        let head = r.at::<UnwindHead>(r.layout.unwind);
        // SAFETY: the head's first word, aligned, in the mapping.
        let g = unsafe { AtomicU64::from_ptr(&raw mut (*head).generation) }.load(Ordering::Acquire);
        if g & 1 != 0 {
            return None;
        }
        // SAFETY: a word of the head; a torn or stale count is caught by the generation.
        let count = unsafe { core::ptr::read_volatile(&raw const (*head).modules.count) };
        let slot = (t as usize - r.base as usize - r.layout.threads) / r.layout.thread_stride;
        let cache =
            r.at::<UnwindCache>(r.layout.caches + slot * core::mem::size_of::<UnwindCache>());
        // SAFETY: the thread's own cache, which no one else writes.
        unsafe {
            if (*cache).generation != g {
                (*cache).entries = [UnwindEntry::default(); UNWIND_CACHE];
                (*cache).generation = g;
            }
        }
        let t = Tables {
            head,
            cache,
            rows: r.at::<Row>(r.layout.rows),
            capacity: r.layout.unwind_rows as u64,
            count: (count as usize).min(MAX_MODULES),
        };
        Some((t, g))
    }

    /// How the frame whose return address is `pc` is unwound: its row (kind NONE where none
    /// holds it), or `CACHED_FP`/`CACHED_FP_NO_ROOM` for a frame-pointer step.
    #[inline(always)]
    pub fn rule(&self, pc: u64) -> Row {
        let i = (pc.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58) as usize % UNWIND_CACHE;
        // SAFETY: the thread's own cache (see `begin`), i < UNWIND_CACHE.
        let e = unsafe { &mut (*self.cache).entries[i] };
        if e.pc == pc {
            return e.row;
        }
        let row = self.find(pc.wrapping_sub(1));
        *e = UnwindEntry { pc, row };
        row
    }

    /// The search `rule` caches, for an address in the call before a return address.
    fn find(&self, at: u64) -> Row {
        let fp = |k| Row {
            kind: k,
            ..Row::default()
        };
        match self.module(at) {
            Some(m) if m.rows != 0 => self.row(&m, at).unwrap_or(fp(kind::NONE)),
            Some(m) if m.flags & MODULE_NO_ROOM != 0 => fp(CACHED_FP_NO_ROOM),
            _ => fp(CACHED_FP),
        }
    }

    /// Whether the entry stayed at generation `g` while it was read: what the walk found
    /// holds.
    #[inline(always)]
    pub fn unchanged(&self, g: u64) -> bool {
        fence(Ordering::Acquire);
        // SAFETY: as in `begin`.
        unsafe { AtomicU64::from_ptr(&raw mut (*self.head).generation) }.load(Ordering::Relaxed)
            == g
    }

    #[inline(always)]
    fn module_at(&self, i: usize) -> Module {
        // SAFETY: i < MAX_MODULES, within the head's array; any bytes are a Module.
        unsafe { core::ptr::read_volatile(&raw const (*self.head).modules.modules[i]) }
    }

    /// The module that holds `pc`.
    #[inline(always)]
    fn module(&self, pc: u64) -> Option<Module> {
        // The first entry whose start is above pc, then the one before it.
        let (mut lo, mut hi) = (0, self.count);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if self.module_at(mid).start <= pc {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let m = self.module_at(lo.checked_sub(1)?);
        (m.start <= pc && pc < m.end).then_some(m)
    }

    /// The row of module `m`'s table that holds `pc`; None where no row does, or where the
    /// module's rows are not within the area (an entry read torn).
    #[inline(always)]
    fn row(&self, m: &Module, pc: u64) -> Option<Row> {
        let rel = u32::try_from(pc.wrapping_sub(m.bias)).ok()?;
        let (first, n) = (u64::from(m.first), u64::from(m.rows));
        if n == 0 || first + n > self.capacity {
            return None;
        }
        // SAFETY: i < n: rows [first, first + n) lie within the area (checked above);
        // volatile, through no reference: shared memory the daemon writes.
        let at = |i: u64| unsafe { core::ptr::read_volatile(self.rows.add((first + i) as usize)) };
        // The last row whose pc is at or below rel.
        let (mut lo, mut hi) = (0, n);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if at(mid).pc <= rel {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let r = at(lo.checked_sub(1)?);
        Some(r)
    }
}
