//! The memory behind malloc: what allocators reserve from the kernel (brk heap, arenas, mmapped
//! chunks) and which allocation sites made them do it.
//!
//! The kernel side reports every mmap, munmap, mremap and brk of a traced process, marked with
//! the allocator call in flight on its thread, and, when such a call returns, that call's site
//! (see heaptrace-ebpf's `mem.rs`). Here the syscalls of one call are paired with its site and
//! netted: glibc makes a thread's arena by mapping 128 MiB and unmapping the unaligned head and
//! tail within the same malloc call, which is one 64 MiB reservation by that malloc's caller.
//!
//! Mappings made before heaptrace attached are not known, except the brk heap, whose size is
//! read from /proc each round.
mod regions;
pub mod resident;
pub mod ring;

use std::collections::{BTreeMap, HashMap, hash_map::Entry};

use heaptrace_common::{MemEvent, NO_SITE, mem};
use serde::{Deserialize, Serialize};

use regions::{Region, Regions, given_back};

/// What a reservation entry records. A release ("munmap") is attributed to the site that made
/// the memory it returns, so that per site, reserved minus released is what it still holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Kind {
    /// A glibc arena heap: an inaccessible (PROT_NONE, MAP_NORESERVE) region made usable piece
    /// by piece.
    Arena,
    /// Any other mapping made inside an allocator call: a large block's own mmap.
    Mmap,
    /// Growth of the brk heap (the main arena).
    Brk,
    /// Memory given back: unmapped, or the brk heap shrunk (`of` Brk, no site).
    Munmap { of: Area },
    /// A pymalloc arena (1 MiB), mapped by CPython's object allocator outside malloc: its site
    /// is the stack at the mmap, Python frames included (recording format 14).
    Pymalloc,
}

/// Where reserved memory lies: the three kinds an allocator holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Area {
    Arena,
    Mmap,
    Brk,
    Pymalloc,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Arena => "arena",
            Kind::Mmap => "mmap",
            Kind::Brk => "brk",
            Kind::Munmap { .. } => "munmap",
            Kind::Pymalloc => "pymalloc",
        }
    }

    /// For a release: what was released.
    pub fn of(self) -> Option<&'static str> {
        match self {
            Kind::Munmap { of } => Some(Kind::from(of).name()),
            _ => None,
        }
    }
}

impl From<Area> for Kind {
    fn from(r: Area) -> Kind {
        match r {
            Area::Arena => Kind::Arena,
            Area::Mmap => Kind::Mmap,
            Area::Brk => Kind::Brk,
            Area::Pymalloc => Kind::Pymalloc,
        }
    }
}

/// (process, kind, the site's stack id, the site's function index).
pub type ResKey = (u32, Kind, i32, u32);

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResTotals {
    /// Allocator calls (or syscalls, for releases) and the bytes they reserved or released.
    pub calls: u64,
    pub bytes: u64,
}

impl ResTotals {
    pub fn plus(&mut self, o: &ResTotals) {
        self.calls += o.calls;
        self.bytes += o.bytes;
    }
}

/// What a process's allocator holds from the kernel, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reserved {
    /// The brk heap ([heap] in /proc/PID/maps).
    pub heap: u64,
    /// Arena heaps made while traced.
    pub arenas: u64,
    /// Large blocks' own mappings made while traced.
    pub mmapped: u64,
    /// pymalloc's arenas made while traced (a Python process, stacks mode). Not in the
    /// postcard of format 13 and earlier rounds: recordings carry it beside (`RoundWire`).
    #[serde(skip)]
    pub pymalloc: u64,
}

impl Reserved {
    pub fn total(&self) -> u64 {
        self.heap + self.arenas + self.mmapped + self.pymalloc
    }
}

const PROT_NONE: u64 = 0;
const MAP_FIXED: u64 = 0x10;
const MAP_NORESERVE: u64 = 0x4000;

#[derive(Default)]
struct ProcState {
    regions: Regions,
    /// The last break seen, once known.
    brk: Option<u64>,
    /// The allocator call in flight on each thread that made memory syscalls.
    pending: HashMap<u32, Call>,
    /// What the munmap or mremap running on each thread took out of the regions when it
    /// began (`mem::BEGIN`): given back if it succeeds, put back if it fails.
    unmapping: HashMap<u32, Vec<(u64, Region)>>,
}

impl ProcState {
    /// What the thread's munmap or mremap of [start, start + len) took, when it began; taken
    /// now if its beginning was not seen.
    fn taken(&mut self, tid: u32, start: u64, len: u64) -> Vec<(u64, Region)> {
        match self.unmapping.remove(&tid) {
            Some(t) => t,
            None => self.regions.take(start, start.saturating_add(len)),
        }
    }
}

/// What one allocator call did to the mappings, until its end names its site.
struct Call {
    /// Tags the regions it made (`Tracker::serial`).
    serial: u64,
    func: u32,
    /// The address span it mapped: its regions lie there.
    span: (u64, u64),
    /// Brk heap growth.
    grown: u64,
    /// Memory of earlier calls it gave back.
    released: Vec<(Region, u64)>,
}

/// Folds memory events into per-process reserved regions and per-site reservations.
#[derive(Default)]
pub struct Tracker {
    procs: HashMap<u32, ProcState>,
    /// Reservations and releases since the last `take`.
    fresh: BTreeMap<ResKey, ResTotals>,
    /// Calls applied so far: tells the regions of the current call apart.
    serial: u64,
    /// Regions not kept (a process with too many): counted as lost memory events.
    pub lost: u64,
}

impl Tracker {
    pub fn event(&mut self, ev: &MemEvent) {
        let pid = ev.tgid;
        if ev.kind & mem::BEGIN != 0 {
            // munmap or mremap is about to free [addr, addr + len): out of the regions now,
            // before another thread's mmap of the same addresses can be reported.
            let [addr, len, ..] = ev.args;
            let st = self.procs.entry(pid).or_default();
            let taken = st.regions.take(addr, addr.saturating_add(len));
            st.unmapping.insert(ev.tid, taken);
            return;
        }
        if ev.kind & mem::FAILED != 0 {
            if let Some(st) = self.procs.get_mut(&pid)
                && let Some(taken) = st.unmapping.remove(&ev.tid)
            {
                for (start, r) in taken {
                    if !st.regions.insert(start, r) {
                        self.lost += 1;
                    }
                }
            }
            return;
        }
        if ev.kind == mem::CALL_END {
            self.finish(pid, ev.tid, ev.args[0] as i64 as i32);
            return;
        }
        if ev.kind == mem::EXEC {
            // The earlier image's mappings went with it, and what it reserved is not the new
            // command's (the daemon drops its figures too).
            self.procs.remove(&pid);
            self.fresh.retain(|k, _| k.0 != pid);
            return;
        }
        if ev.func == mem::PYMALLOC {
            // An arena is a call of its own: any call the thread left open is over.
            self.finish(pid, ev.tid, NO_SITE);
        }
        if ev.func != mem::NO_FUNC {
            self.inside(pid, ev);
            return;
        }
        // A syscall outside any allocator call: the thread's last call is over, whether or not
        // its end was seen.
        self.finish(pid, ev.tid, NO_SITE);
        self.outside(pid, ev);
    }

    /// A syscall inside an allocator call, applied at once: deferred to the call's end, it
    /// could be applied after a later syscall of another thread on the same addresses (a range
    /// one thread's new arena trimmed off, which another's mapped next).
    fn inside(&mut self, pid: u32, ev: &MemEvent) {
        let st = self.procs.entry(pid).or_default();
        let call = match st.pending.entry(ev.tid) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                self.serial += 1;
                e.insert(Call {
                    serial: self.serial,
                    func: ev.func,
                    span: (u64::MAX, 0),
                    grown: 0,
                    released: Vec::new(),
                })
            }
        };
        let serial = call.serial;
        let mut inserted = true;
        match ev.kind {
            mem::MMAP => {
                let [_, len, prot, flags] = ev.args;
                let (start, end) = (ev.ret, ev.ret.saturating_add(len));
                // glibc decommitting part of an arena: still reserved.
                if flags & MAP_FIXED == 0 || !st.regions.covers(start, end) {
                    call.released.extend(st.regions.unmap(start, end, serial));
                    let kind = if ev.func == mem::PYMALLOC {
                        Area::Pymalloc
                    } else if prot == PROT_NONE && flags & MAP_NORESERVE != 0 {
                        Area::Arena
                    } else {
                        Area::Mmap
                    };
                    call.span = (call.span.0.min(start), call.span.1.max(end));
                    inserted = st
                        .regions
                        .insert(start, Region::made(end, kind, ev.func, serial));
                }
            }
            mem::MUNMAP => {
                let [addr, len, ..] = ev.args;
                let taken = st.taken(ev.tid, addr, len);
                // `call` again: `st.taken` needed all of `st`.
                let call = st.pending.get_mut(&ev.tid).expect("just inserted");
                call.released.extend(given_back(&taken, serial));
            }
            mem::MREMAP => {
                let [old, old_len, new_len, _] = ev.args;
                let taken = st.taken(ev.tid, old, old_len);
                let kind = first(&taken).map_or(Area::Mmap, |r| r.kind);
                let call = st.pending.get_mut(&ev.tid).expect("just inserted");
                call.released.extend(given_back(&taken, serial));
                let end = ev.ret.saturating_add(new_len);
                call.span = (call.span.0.min(ev.ret), call.span.1.max(end));
                inserted = st
                    .regions
                    .insert(ev.ret, Region::made(end, kind, ev.func, serial));
            }
            mem::BRK => {
                if let Some(prev) = st.brk {
                    if ev.ret > prev {
                        call.grown += ev.ret - prev;
                    } else if ev.ret < prev {
                        call.released.push(heap_release(prev - ev.ret));
                    }
                }
                st.brk = Some(ev.ret);
            }
            _ => {}
        }
        if !inserted {
            self.lost += 1;
        }
    }

    /// The end of a thread's allocator call: its regions get its site, and what it made and
    /// still holds is one reservation per kind.
    fn finish(&mut self, pid: u32, tid: u32, stack_id: i32) {
        let Some(st) = self.procs.get_mut(&pid) else {
            return;
        };
        let Some(call) = st.pending.remove(&tid) else {
            return;
        };
        let mut made: BTreeMap<Area, u64> = BTreeMap::new();
        for (start, r) in st
            .regions
            .of_serial_mut(call.serial, call.span.0, call.span.1)
        {
            r.stack_id = stack_id;
            *made.entry(r.kind).or_default() += r.end - start;
        }
        if call.grown > 0 {
            made.insert(Area::Brk, call.grown);
        }
        for (kind, bytes) in made {
            if bytes > 0 {
                let t = self
                    .fresh
                    .entry((pid, kind.into(), stack_id, call.func))
                    .or_default();
                t.calls += 1;
                t.bytes += bytes;
            }
        }
        self.released(pid, call.released);
    }

    /// A syscall made outside any allocator call: only what it does to the allocator's memory
    /// matters (free's munmap of a large block, its trim of the brk heap).
    fn outside(&mut self, pid: u32, ev: &MemEvent) {
        let st = self.procs.entry(pid).or_default();
        let mut released = Vec::new();
        match ev.kind {
            mem::MMAP => {
                let [_, len, _, flags] = ev.args;
                if flags & MAP_FIXED != 0 {
                    let (start, end) = (ev.ret, ev.ret.saturating_add(len));
                    if !st.regions.covers(start, end) {
                        released.extend(st.regions.unmap(start, end, 0));
                    }
                }
            }
            mem::MUNMAP => {
                let [addr, len, ..] = ev.args;
                released.extend(given_back(&st.taken(ev.tid, addr, len), 0));
            }
            mem::MREMAP => {
                // The program moved a block the allocator made: same owner, new place.
                let [old, old_len, new_len, _] = ev.args;
                if let Some(r) = first(&st.taken(ev.tid, old, old_len)) {
                    let moved = Region {
                        end: ev.ret.saturating_add(new_len),
                        ..r
                    };
                    if !st.regions.insert(ev.ret, moved) {
                        self.lost += 1;
                    }
                }
            }
            mem::BRK => {
                if let Some(prev) = st.brk
                    && ev.ret < prev
                {
                    released.push(heap_release(prev - ev.ret));
                }
                st.brk = Some(ev.ret);
            }
            _ => {}
        }
        self.released(pid, released);
    }

    fn released(&mut self, pid: u32, released: Vec<(Region, u64)>) {
        for (r, bytes) in released {
            if bytes == 0 {
                continue;
            }
            let t = self
                .fresh
                .entry((pid, Kind::Munmap { of: r.kind }, r.stack_id, r.func))
                .or_default();
            t.calls += 1;
            t.bytes += bytes;
        }
    }

    /// Tells the tracker where a process's break is, when first seeing it: brk growth is only
    /// measured from a known break.
    pub fn seed_brk(&mut self, pid: u32, brk: u64) {
        let st = self.procs.entry(pid).or_default();
        if st.brk.is_none() {
            st.brk = Some(brk);
        }
    }

    pub fn knows(&self, pid: u32) -> bool {
        self.procs.get(&pid).is_some_and(|s| s.brk.is_some())
    }

    /// Reservations and releases since the previous call.
    pub fn take(&mut self) -> BTreeMap<ResKey, ResTotals> {
        std::mem::take(&mut self.fresh)
    }

    /// The arena and mmapped bytes a process holds (the heap is read from /proc).
    pub fn reserved(&self, pid: u32) -> Reserved {
        let mut out = Reserved::default();
        if let Some(st) = self.procs.get(&pid) {
            for (start, r) in st.regions.iter() {
                match r.kind {
                    Area::Arena => out.arenas += r.end - start,
                    Area::Mmap => out.mmapped += r.end - start,
                    Area::Pymalloc => out.pymalloc += r.end - start,
                    Area::Brk => {}
                }
            }
        }
        out
    }

    /// The stack ids that name a region still reserved (its release is counted there).
    pub fn stack_ids(&self) -> std::collections::HashSet<i32> {
        let regions = self.procs.values().flat_map(|st| st.regions.iter());
        regions.map(|(_, r)| r.stack_id).collect()
    }

    /// A process is gone: its mappings went with it.
    pub fn forget(&mut self, pid: u32) {
        self.procs.remove(&pid);
    }
}

/// The region a taken range began in (its lowest piece).
fn first(taken: &[(u64, Region)]) -> Option<Region> {
    taken.iter().min_by_key(|(s, _)| *s).map(|(_, r)| *r)
}

/// The brk heap shrinking: no site made "that" part of it, so it is released unnamed.
fn heap_release(bytes: u64) -> (Region, u64) {
    (
        Region {
            end: 0,
            kind: Area::Brk,
            stack_id: NO_SITE,
            func: mem::NO_FUNC,
            serial: 0,
        },
        bytes,
    )
}

#[cfg(test)]
mod tests;
