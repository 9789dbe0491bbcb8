//! What a call counts, as the kernel path counts it (`heaptrace-ebpf`'s `main.rs`): calls,
//! bytes and failures per function, realloc's outcomes, the live blocks and heap, exact sizes,
//! and in stacks mode each site's allocations, releases and temporaries.
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use heaptrace_common::{
    FUNC_COUNT, Func, Loss, NO_SITE, ProcCounters,
    inproc::{
        BUSY, FIRST_KEY, LOST_STACK, LiveEntry, PEAK_BATCH, PROBES, SHARED_OWNER, SiteEntry,
        SizeEntry, ThreadHead,
    },
    mode,
};

use crate::{live, region::Region, stack, thread};

/// Adds to a counter only its thread writes: a plain load and store (the daemon reads it
/// whole, as an aligned word).
#[inline(always)]
fn plain_add(p: *mut u64, v: u64) {
    // SAFETY: an aligned word of the region.
    let a = unsafe { AtomicU64::from_ptr(p) };
    a.store(a.load(Ordering::Relaxed).wrapping_add(v), Ordering::Relaxed);
}

/// Counts a loss; shared by every thread, so atomic (and rare).
pub fn lose(r: &Region, what: Loss) {
    // SAFETY: a word of the header.
    let l = unsafe { AtomicU64::from_ptr(&raw mut (*r.header_ptr()).losses[what as usize]) };
    l.fetch_add(1, Ordering::Relaxed);
}

/// A call being counted: its thread's slot is marked busy until the call is done, so that a
/// call made meanwhile on the thread goes straight through (nested).
pub struct Call {
    r: &'static Region,
    t: *mut ThreadHead,
    /// `t` is the shared slot (`Layout::shared`): every add is atomic, and nothing of a
    /// thread's own (nesting, timing, temporaries) is kept.
    shared: bool,
    fp: usize,
    /// When a timed call began (`clock`); 0: not timed.
    ts: u64,
    /// When it returned, once taken (its block's birth).
    done: u64,
}

/// CLOCK_MONOTONIC in ns (the vDSO's: no syscall).
fn now() -> u64 {
    // SAFETY: a plain struct for clock_gettime to fill.
    let mut ts: libc::timespec = unsafe { core::mem::zeroed() };
    // SAFETY: fills `ts`.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64)
        .max(1)
}

impl Call {
    /// None when this call is not to be counted (see the crate's doc).
    #[inline(always)]
    pub fn begin(fp: usize) -> Option<Call> {
        let r = crate::region::get()?;
        if !r.counting() {
            return None;
        }
        let t = match thread::current(r) {
            Ok(t) => t,
            Err(thread::NoSlot::Full) => {
                lose(r, Loss::InFlight);
                return None;
            }
            Err(thread::NoSlot::Own) => return None,
        };
        if thread::foreign(t, fp) {
            return Some(Call::shared(r, fp));
        }
        // SAFETY: the thread's own slot.
        let busy = unsafe { AtomicU32::from_ptr(&raw mut (*t).busy) };
        if busy.load(Ordering::Relaxed) != 0 {
            // A signal handler's call inside one being counted: the real allocator never
            // calls back into this library. Said, not counted (see `Header::nested_calls`).
            // SAFETY: a word of the header.
            let n = unsafe { AtomicU64::from_ptr(&raw mut (*r.header_ptr()).nested_calls) };
            n.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        busy.store(1, Ordering::Relaxed);
        // Not reordered past the real call by the compiler: a signal handler sees it set.
        core::sync::atomic::compiler_fence(Ordering::SeqCst);
        Some(Call {
            r,
            t,
            shared: false,
            fp,
            ts: 0,
            done: 0,
        })
    }

    /// A call of a thread with no slot of its own, in the shared slot.
    #[cold]
    fn shared(r: &'static Region, fp: usize) -> Call {
        // SAFETY: words of the header and of the shared slot, in the mapping.
        unsafe {
            let n = AtomicU64::from_ptr(&raw mut (*r.header_ptr()).raw_thread_calls);
            n.fetch_add(1, Ordering::Relaxed);
            let t = r.at::<ThreadHead>(r.layout.shared());
            AtomicU32::from_ptr(&raw mut (*t).owner).store(SHARED_OWNER, Ordering::Relaxed);
            Call {
                r,
                t,
                shared: true,
                fp,
                ts: 0,
                done: 0,
            }
        }
    }

    /// Adds to a counter of the call's slot: atomic in the shared one.
    #[inline(always)]
    fn add(&self, p: *mut u64, v: u64) {
        if self.shared {
            // SAFETY: an aligned word of the region.
            unsafe { AtomicU64::from_ptr(p) }.fetch_add(v, Ordering::Relaxed);
        } else {
            plain_add(p, v);
        }
    }

    /// An allocating call: timed, one in `latency_every` at random (gaps drawn uniformly
    /// from 1 to 2N - 1, mean N, as the kernel path draws them), in sizes and stacks modes.
    #[inline(always)]
    pub fn begin_alloc(fp: usize) -> Option<Call> {
        let mut call = Call::begin(fp)?;
        if call.due() {
            call.ts = now();
        }
        Some(call)
    }

    fn due(&self) -> bool {
        let h = &self.r.fixed;
        let every = h.latency_every;
        if every == 0 || h.mode < mode::SIZES || self.shared {
            return false;
        }
        if every == 1 {
            return true;
        }
        // SAFETY: the thread's own slot.
        let t = unsafe { &mut *self.t };
        if t.countdown > 1 {
            t.countdown -= 1;
            return false;
        }
        let mut x = if t.rng == 0 { t.owner | 1 } else { t.rng };
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        t.rng = x;
        t.countdown = 1 + x % (2 * every - 1);
        true
    }

    /// A timed call returned: its latency, in its function's histogram.
    fn timed(&mut self, func: usize) {
        if self.ts == 0 {
            return;
        }
        self.done = now();
        let b = heaptrace_common::log2_bucket(self.done.wrapping_sub(self.ts));
        let at = self.r.layout.latency_at + (func * heaptrace_common::LOG2_BUCKETS + b) * 8;
        // SAFETY: within the thread's slot.
        self.add(unsafe { (self.t as *mut u8).add(at) } as *mut u64, 1);
    }

    fn counters(&self) -> *mut ProcCounters {
        // SAFETY: the thread's own slot.
        unsafe { &raw mut (*self.t).counters }
    }

    fn mode(&self) -> u32 {
        self.r.fixed.mode
    }

    fn func(&self, f: Func) -> usize {
        let as_ = self.r.fixed.count_as[f as usize] as usize;
        if as_ < FUNC_COUNT { as_ } else { f as usize }
    }

    /// Takes a block out of the live table (before the real call can hand it out again).
    pub fn take(&self, ptr: u64) -> Option<LiveEntry> {
        if ptr == 0 {
            return None;
        }
        live::take(self.r, ptr)
    }

    pub fn allocated(mut self, f: Func, size: u64, ptr: u64) {
        let pc = self.counters();
        let func = self.func(f);
        self.timed(func);
        // SAFETY: the thread's own counters.
        unsafe {
            self.add(&raw mut (*pc).funcs[func].calls, 1);
            if ptr == 0 {
                self.add(&raw mut (*pc).funcs[func].failed, 1);
                return;
            }
            self.add(&raw mut (*pc).funcs[func].bytes, size);
        }
        self.track(func as u32, size, ptr);
    }

    pub fn reallocated(mut self, old: u64, size: u64, ret: u64, held: Option<LiveEntry>) {
        let pc = self.counters();
        let f = self.func(Func::Realloc);
        self.timed(f);
        // SAFETY: the thread's own counters.
        unsafe {
            self.add(&raw mut (*pc).funcs[f].calls, 1);
            if ret == 0 {
                if old != 0 && size == 0 {
                    self.add(&raw mut (*pc).realloc_frees, 1);
                    self.released(held, true);
                } else {
                    self.add(&raw mut (*pc).funcs[f].failed, 1);
                    // The block stays the program's: back in the table as it was, or, with no
                    // room, out of the live figures as a block the table refused (its free
                    // will be untracked).
                    if let Some(b) = held
                        && !live::insert(self.r, b)
                    {
                        self.refused(b);
                    }
                }
                return;
            }
            self.add(&raw mut (*pc).funcs[f].bytes, size);
            if old != 0 {
                let outcome = if ret == old {
                    &raw mut (*pc).realloc_in_place
                } else {
                    &raw mut (*pc).realloc_moves
                };
                self.add(outcome, 1);
                self.released(held, true);
            }
        }
        self.track(f as u32, size, ret);
    }

    pub fn freed(self, held: Option<LiveEntry>) {
        let pc = self.counters();
        // SAFETY: the thread's own counters.
        unsafe { self.add(&raw mut (*pc).funcs[Func::Free as usize].calls, 1) };
        self.released(held, false);
        // A free moves the thread's count on as an allocation does (heaptrack's rule: a block
        // freed after another free of its thread is not temporary).
        self.next_seq();
    }

    /// The thread's count of allocations and frees before this one, moved on by one.
    fn next_seq(&self) -> u32 {
        // SAFETY: the thread's own slot.
        unsafe {
            let seq = AtomicU64::from_ptr(&raw mut (*self.t).seq);
            if self.shared {
                seq.fetch_add(1, Ordering::Relaxed) as u32
            } else {
                let s = seq.load(Ordering::Relaxed);
                seq.store(s.wrapping_add(1), Ordering::Relaxed);
                s as u32
            }
        }
    }

    /// A block given back: out of the live figures and its site's, or an untracked free.
    fn released(&self, held: Option<LiveEntry>, by_realloc: bool) {
        let pc = self.counters();
        let Some(b) = held else {
            // SAFETY: the thread's own counters.
            unsafe { self.add(&raw mut (*pc).untracked_frees, 1) };
            return;
        };
        // SAFETY: the thread's own counters.
        unsafe {
            self.add(&raw mut (*pc).live_blocks, u64::MAX);
            self.add(&raw mut (*pc).live_bytes, b.size.wrapping_neg());
            let bytes = if by_realloc {
                &raw mut (*pc).realloc_released_bytes
            } else {
                &raw mut (*pc).funcs[Func::Free as usize].bytes
            };
            self.add(bytes, b.size);
        }
        self.peak_released();
        self.peak_add(b.size.wrapping_neg());
        if b.stack_id != NO_SITE {
            self.site_released(b);
        }
    }

    /// A tracked block the live table has no room for any more: counted lost, and out of the
    /// live figures and its site's, as `track` leaves a block it could not insert.
    fn refused(&self, b: LiveEntry) {
        lose(self.r, Loss::LiveMap);
        let pc = self.counters();
        // SAFETY: the thread's own counters.
        unsafe {
            self.add(&raw mut (*pc).live_blocks, u64::MAX);
            self.add(&raw mut (*pc).live_bytes, b.size.wrapping_neg());
        }
        self.peak_released();
        self.peak_add(b.size.wrapping_neg());
        if let Some(s) = self.site(b.stack_id, b.func) {
            self.fold_peak(s);
            // SAFETY: the thread's own site entry.
            unsafe {
                self.add(&raw mut (*s).untracked, 1);
                self.add(&raw mut (*s).untracked_bytes, b.size);
            }
        }
    }

    fn site_released(&self, b: LiveEntry) {
        let Some(s) = self.site(b.stack_id, b.func) else {
            return;
        };
        self.fold_peak(s);
        // SAFETY: the thread's own site entry.
        unsafe {
            self.add(&raw mut (*s).frees, 1);
            self.add(&raw mut (*s).freed_bytes, b.size);
            let (tid, seq) = ((*self.t).owner, (*self.t).seq as u32);
            let between = seq.wrapping_sub(b.seq).wrapping_sub(1);
            let own = b.tid == tid && tid != SHARED_OWNER;
            if own && between < self.r.fixed.temporary_allocs {
                self.add(&raw mut (*s).temp_blocks, 1);
                self.add(&raw mut (*s).temp_bytes, b.size);
            }
        }
        if b.ts_ns != 0
            && let Some(i) = self.site_index(b.stack_id, b.func)
        {
            // A timed block's lifetime, in units of 1024 ns, in its site's shared histogram.
            let lifetime = now().wrapping_sub(b.ts_ns) >> 10;
            let bucket = heaptrace_common::log2_bucket(lifetime);
            let at = self.r.layout.lifetimes + (i * heaptrace_common::LOG2_BUCKETS + bucket) * 8;
            // SAFETY: a word of the shared lifetimes area.
            let n = unsafe { AtomicU64::from_ptr(self.r.at::<u64>(at)) };
            n.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A site's index among each thread's site entries (and the lifetimes): its stack id, or
    /// past the stored ones, the lost stack of its function.
    fn site_index(&self, stack_id: i32, func: u32) -> Option<usize> {
        let sites = self.r.fixed.sites as usize;
        match stack_id {
            LOST_STACK => Some(sites + func as usize % FUNC_COUNT),
            id if id >= 0 && (id as usize) < sites => Some(id as usize),
            _ => None,
        }
    }

    /// This thread's entry of a site, by stack id (or the lost one of its function).
    fn site(&self, stack_id: i32, func: u32) -> Option<*mut SiteEntry> {
        let i = self.site_index(stack_id, func)?;
        let at = self.r.layout.sites_at + i * core::mem::size_of::<SiteEntry>();
        // SAFETY: within the thread's slot.
        Some(unsafe { (self.t as *mut u8).add(at) } as *mut SiteEntry)
    }

    /// A block handed out: its stack (stacks mode), size, site and live-table entry.
    fn track(&self, func: u32, size: u64, ptr: u64) {
        let mode = self.mode();
        let stack_id = if mode >= mode::STACKS {
            stack::site(self.r, self.t, func, self.fp)
        } else {
            NO_SITE
        };
        let seq = self.next_seq();
        if mode >= mode::STACKS
            && let Some(s) = self.site(stack_id, func)
        {
            self.fold_peak(s);
            // SAFETY: the thread's own site entry.
            unsafe {
                self.add(&raw mut (*s).calls, 1);
                self.add(&raw mut (*s).bytes, size);
            }
        }
        if mode >= mode::SIZES {
            self.count_size(func, size, stack_id);
        }
        let block = LiveEntry {
            key: ptr,
            size,
            stack_id,
            func,
            // SAFETY: the thread's own slot.
            tid: unsafe { (*self.t).owner },
            seq,
            ts_ns: self.done,
        };
        if !live::insert(self.r, block) {
            lose(self.r, Loss::LiveMap);
            if let Some(s) = self.site(stack_id, func) {
                self.fold_peak(s);
                // SAFETY: the thread's own site entry.
                unsafe {
                    self.add(&raw mut (*s).untracked, 1);
                    self.add(&raw mut (*s).untracked_bytes, size);
                }
            }
            return;
        }
        let pc = self.counters();
        // SAFETY: the thread's own counters.
        unsafe {
            self.add(&raw mut (*pc).live_blocks, 1);
            self.add(&raw mut (*pc).live_bytes, size);
        }
        self.peak_grew(size, stack_id);
    }

    /// The exact size count of (function, size, stack) in this thread's table, or where
    /// that has no room within `PROBES`, in the shared one.
    fn count_size(&self, func: u32, size: u64, stack_id: i32) {
        let key = size.saturating_add(FIRST_KEY);
        let tag = (u64::from(func) << 32) | u64::from(stack_id as u32);
        let (slots, at) = (self.r.fixed.sizes, self.r.layout.sizes_at);
        // SAFETY: the thread's own table, within its slot.
        let mine = unsafe { (self.t as *mut u8).add(at) } as *mut SizeEntry;
        if self.count_in(mine, slots, self.shared, key, tag) {
            return;
        }
        let shared = self.r.at::<SizeEntry>(self.r.layout.shared_sizes_at);
        if !self.count_in(shared, self.r.fixed.shared_sizes, true, key, tag) {
            lose(self.r, Loss::SizeHistogram);
        }
    }

    /// Counts `key`/`tag` in the size table at `table` of `slots` entries (0: none); false if
    /// it has no room within `PROBES`. A table shared between threads (`atomic`) is claimed
    /// entry by entry: a thread that loses a claim goes on, and a second entry of the same
    /// key is summed by the daemon.
    fn count_in(
        &self,
        table: *mut SizeEntry,
        slots: u32,
        atomic: bool,
        key: u64,
        tag: u64,
    ) -> bool {
        if slots == 0 {
            return false;
        }
        let size = key - FIRST_KEY;
        let first = heaptrace_common::inproc::size_slot(size, tag, slots);
        let add = |n: *mut u64| {
            if atomic {
                // SAFETY: a count word of an entry of the table.
                unsafe { AtomicU64::from_ptr(n) }.fetch_add(1, Ordering::Relaxed);
            } else {
                plain_add(n, 1);
            }
        };
        for p in 0..PROBES as usize {
            let i = (first + p) & (slots as usize - 1);
            // SAFETY: within the table, which only this thread writes, or written with atomics.
            let e = unsafe { table.add(i) };
            // SAFETY: as above.
            let k = unsafe { AtomicU64::from_ptr(&raw mut (*e).key) };
            match k.load(Ordering::Acquire) {
                0 => {
                    if atomic
                        && k.compare_exchange(0, BUSY, Ordering::AcqRel, Ordering::Relaxed)
                            .is_err()
                    {
                        continue;
                    }
                    // SAFETY: as above; the key is published after its tag.
                    unsafe { (*e).tag = tag };
                    k.store(key, Ordering::Release);
                    // SAFETY: as above.
                    add(unsafe { &raw mut (*e).count });
                    return true;
                }
                // SAFETY: as above.
                seen if seen == key && unsafe { (*e).tag } == tag => {
                    // SAFETY: as above.
                    add(unsafe { &raw mut (*e).count });
                    return true;
                }
                _ => {}
            }
        }
        false
    }

    /// The process's live heap, shared: its highest and the allocation that reached it.
    /// The thread's change is added once it reaches `PEAK_BATCH` (see there).
    fn peak_grew(&self, size: u64, stack_id: i32) {
        let Some(now) = self.peak_add(size) else {
            return;
        };
        let h = self.r.header_ptr();
        // SAFETY: words of the header.
        let max = unsafe { AtomicU64::from_ptr(&raw mut (*h).peak_max) };
        let mut was = max.load(Ordering::Relaxed);
        while now > was {
            match max.compare_exchange_weak(was, now, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => {
                    // SAFETY: as above; which allocation reached it is told as well as the
                    // last writer knows.
                    unsafe {
                        AtomicU64::from_ptr(&raw mut (*h).peak_size).store(size, Ordering::Relaxed);
                        AtomicU64::from_ptr(&raw mut (*h).peak_stack as *mut u64)
                            .store(stack_id as i64 as u64, Ordering::Relaxed);
                        AtomicU64::from_ptr(&raw mut (*h).peak_pending).store(1, Ordering::Release);
                    }
                    return;
                }
                Err(seen) => was = seen,
            }
        }
    }

    /// A release: the first since a new high moves the peak's number on, before any site
    /// counts it, so that the sites' entries keep their figures of the high (`fold_peak`).
    fn peak_released(&self) {
        let h = self.r.header_ptr();
        // SAFETY: a word of the header.
        let pending = unsafe { AtomicU64::from_ptr(&raw mut (*h).peak_pending) };
        if pending.load(Ordering::Relaxed) != 0
            && pending
                .compare_exchange(1, 0, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            // SAFETY: as above.
            unsafe { AtomicU64::from_ptr(&raw mut (*h).peak_seq) }.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Site entry `s`'s figures at the peak, kept before its first change since the peak's
    /// number moved on (`SiteEntry::fold_peak`).
    fn fold_peak(&self, s: *mut SiteEntry) {
        // SAFETY: a word of the header.
        let seq = unsafe { AtomicU64::from_ptr(&raw mut (*self.r.header_ptr()).peak_seq) }
            .load(Ordering::Acquire);
        // SAFETY: the thread's own site entry (the shared slot's: as its other counters,
        // written by the threads that share it).
        unsafe { (*s).fold_peak(seq) };
    }

    /// Adds `delta` (wrapping) to the thread's change of the live heap; once that reaches
    /// `PEAK_BATCH` either way, adds it to the shared live heap and returns the new total.
    fn peak_add(&self, delta: u64) -> Option<u64> {
        if self.shared {
            // SAFETY: a word of the header.
            let live = unsafe { AtomicU64::from_ptr(&raw mut (*self.r.header_ptr()).peak_live) };
            return Some(live.fetch_add(delta, Ordering::Relaxed).wrapping_add(delta));
        }
        // SAFETY: the thread's own slot.
        let mine = unsafe { &mut (*self.t).live_delta };
        *mine = mine.wrapping_add(delta);
        if (*mine as i64).unsigned_abs() < PEAK_BATCH {
            return None;
        }
        let batch = core::mem::take(mine);
        // SAFETY: a word of the header.
        let live = unsafe { AtomicU64::from_ptr(&raw mut (*self.r.header_ptr()).peak_live) };
        Some(live.fetch_add(batch, Ordering::Relaxed).wrapping_add(batch))
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        if self.shared {
            return;
        }
        core::sync::atomic::compiler_fence(Ordering::SeqCst);
        // SAFETY: the thread's own slot.
        unsafe { AtomicU32::from_ptr(&raw mut (*self.t).busy).store(0, Ordering::Relaxed) };
    }
}
