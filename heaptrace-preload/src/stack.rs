//! An allocation's stack: walked within the thread's stack, by unwind table where the region
//! has one for the frame's module (`unwind`), else by frame pointer; then stored once in the
//! stack table (an index of hashes, each to a dense id whose record holds the return
//! addresses), shared by every thread.
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use heaptrace_common::{
    Loss, STACK_FRAMES,
    inproc::{self, BUSY, EMPTY, IndexEntry, LOST_STACK, PROBES, StackHead, ThreadHead},
    inproc::{CACHED_FP, CACHED_FP_NO_ROOM},
    unwind::{Row, SIGNAL_RBP, SIGNAL_RIP, SIGNAL_RSP, kind},
};

use crate::{count::lose, region::Region, unwind::Tables};

/// The thread's stack as the walk may read it: aligned words from the entry point's frame
/// (the lowest address known to be in use) up to the stack's top. Frames are never read
/// through an address outside it, whatever a row or a frame pointer says.
struct Stack {
    lo: u64,
    hi: u64,
}

impl Stack {
    #[inline(always)]
    fn word(&self, addr: u64) -> Option<u64> {
        if !addr.is_multiple_of(8) || addr < self.lo || addr > self.hi.checked_sub(8)? {
            return None;
        }
        // SAFETY: within [lo, hi - 8]: the thread's mapped stack, at or above the current
        // frame.
        Some(unsafe { core::ptr::read_volatile(addr as *const u64) })
    }
}

/// Why a walk ended.
#[derive(Clone, Copy, PartialEq, Eq)]
enum End {
    /// The stack's end, or a frame that cannot be followed (not counted, as in the kernel).
    Whole,
    /// `ips` is full and there was a frame more.
    Depth,
    /// A row with no rule (`Loss::UnwindNoRule`).
    NoRule,
}

/// A walk's outcome: frames taken, why it ended, and whether it went through a module whose
/// table did not fit (`Loss::UnwindTable`).
struct Walked {
    n: usize,
    end: End,
    no_room: bool,
}

/// Return addresses from the frame of the library's entry point `fp`, innermost first: the
/// first is the allocation's caller. Each frame is unwound as the kernel path's walk does
/// (`heaptrace-ebpf`'s `stacks.rs`): by its module's row where the region has a table for
/// it, else by frame pointer; only upwards and within the thread's stack. A walk during
/// which the daemon rewrote the modules is walked again, and after a few such, by frame
/// pointer only.
fn walk(r: &Region, t: *mut ThreadHead, fp: usize, ips: &mut [u64]) -> Walked {
    let whole = |n| Walked {
        n,
        end: End::Whole,
        no_room: false,
    };
    // SAFETY: the thread's own slot.
    let (lo, hi) = unsafe { ((*t).stack_lo, (*t).stack_hi) };
    let fp = fp as u64;
    if ips.is_empty() {
        return whole(0);
    }
    if fp < lo || fp.saturating_add(16) > hi {
        // On another stack (a signal's, a coroutine's): the entry point's own frame, which
        // is the current one, and nothing further.
        // SAFETY: the return address in the entry point's frame, built with frame pointers.
        let ret = unsafe { *((fp + 8) as *const u64) };
        ips[0] = ret;
        return whole(usize::from(ret != 0));
    }
    let stack = Stack { lo: fp, hi };
    // The entry point's frame: the caller's rbp, then the return address into it.
    let (Some(caller_fp), Some(ret)) = (stack.word(fp), stack.word(fp + 8)) else {
        return whole(0);
    };
    if ret == 0 {
        return whole(0);
    }
    ips[0] = ret;
    let regs = Regs {
        pc: ret,
        sp: fp + 16,
        fp: caller_fp,
    };
    for _ in 0..3 * usize::from(r.layout.unwind_rows > 0) {
        let Some((tables, generation)) = Tables::begin(r, t) else {
            core::hint::spin_loop(); // the daemon is writing the modules
            continue;
        };
        let w = unwind(&stack, Some(&tables), regs, ips);
        if tables.unchanged(generation) {
            return w;
        }
    }
    unwind(&stack, None, regs, ips)
}

/// A frame's registers: its return address, its caller's rsp and rbp at that return.
#[derive(Clone, Copy)]
struct Regs {
    pc: u64,
    sp: u64,
    fp: u64,
}

/// The frames above the first (`ips[0]`, whose registers are `regs`).
fn unwind(stack: &Stack, tables: Option<&Tables>, mut regs: Regs, ips: &mut [u64]) -> Walked {
    let mut w = Walked {
        n: 1,
        end: End::Whole,
        no_room: false,
    };
    loop {
        let Some(next) = step(stack, tables, regs, &mut w) else {
            return w;
        };
        if next.pc == 0 {
            return w;
        }
        if w.n == ips.len() {
            w.end = End::Depth;
            return w;
        }
        ips[w.n] = next.pc;
        w.n += 1;
        regs = next;
    }
}

/// The caller's frame of the frame `regs`; None where the walk ends (`w.end` says why).
#[inline(always)]
fn step(stack: &Stack, tables: Option<&Tables>, regs: Regs, w: &mut Walked) -> Option<Regs> {
    let Regs { pc, sp, fp } = regs;
    let row = tables.map_or(
        Row {
            kind: CACHED_FP,
            ..Row::default()
        },
        |t| t.rule(pc),
    );
    if row.kind == CACHED_FP || row.kind == CACHED_FP_NO_ROOM {
        w.no_room |= row.kind == CACHED_FP_NO_ROOM;
        if fp < sp {
            return None;
        }
        let next = stack.word(fp)?;
        let ret = stack.word(fp.checked_add(8)?)?;
        return Some(Regs {
            pc: ret,
            sp: fp + 16,
            fp: next,
        });
    }
    let reg = match row.rule() {
        kind::RSP => sp,
        kind::RBP => fp,
        kind::END => return None,
        kind::SIGNAL => {
            // The interrupted frame, as the kernel saved it (see heaptrace-common); its pc
            // kept one past the instruction, as a return address is.
            let rip = stack.word(sp.checked_add(SIGNAL_RIP)?)?;
            let next = Regs {
                pc: rip.wrapping_add(1),
                sp: stack.word(sp.checked_add(SIGNAL_RSP)?)?,
                fp: stack.word(sp.checked_add(SIGNAL_RBP)?)?,
            };
            return (next.sp != sp).then_some(next);
        }
        _ => {
            w.end = End::NoRule;
            return None;
        }
    };
    let cfa = reg.wrapping_add(row.cfa_words() * 8);
    if cfa <= sp {
        return None;
    }
    let ret = stack.word(cfa - 8)?;
    let fp = match row.rbp {
        0 => fp,
        k => stack.word(cfa.wrapping_sub(u64::from(k) * 8))?,
    };
    Some(Regs {
        pc: ret,
        sp: cfa,
        fp,
    })
}

fn index(r: &Region, i: usize) -> *mut IndexEntry {
    r.at::<IndexEntry>(r.layout.index + i * core::mem::size_of::<IndexEntry>())
}

fn record(r: &Region, id: u32) -> *mut StackHead {
    r.at::<StackHead>(r.layout.stacks + id as usize * r.layout.stack_stride)
}

fn frames<'a>(h: *mut StackHead, len: usize) -> &'a mut [u64] {
    // SAFETY: the record's frames follow its head, `depth` of them (len <= depth).
    unsafe { core::slice::from_raw_parts_mut(h.add(1) as *mut u64, len) }
}

/// The stack id of an allocation by `func` made from the frame `fp`: its stored stack's, or
/// `LOST_STACK` when the table has no room for it.
pub fn site(r: &Region, t: *mut ThreadHead, func: u32, fp: usize) -> i32 {
    let mut ips = [0u64; STACK_FRAMES];
    let depth = (r.fixed.depth as usize).min(STACK_FRAMES);
    let w = walk(r, t, fp, &mut ips[..depth]);
    match w.end {
        End::Depth => lose(r, Loss::StackDepth),
        End::NoRule => lose(r, Loss::UnwindNoRule),
        End::Whole => {}
    }
    if w.no_room {
        lose(r, Loss::UnwindTable);
    }
    // Only a stack cut by depth says frames are missing, as the kernel's stacks do.
    let (mut n, cut) = (w.n, w.end == End::Depth);
    if !cut {
        // A Python thread's frames go after the native ones, as the kernel walk puts them.
        n = crate::python::append(r, t, &mut ips[..depth], n);
    }
    let ips = &ips[..n];
    let key = inproc::stack_key(func, ips);
    let slots = r.fixed.site_index as usize;
    for p in 0..PROBES as usize {
        let e = index(r, (key as usize + p) & (slots - 1));
        // SAFETY: the key word of an index entry.
        let k = unsafe { AtomicU64::from_ptr(&raw mut (*e).key) };
        let mut seen = k.load(Ordering::Acquire);
        if seen == EMPTY {
            match k.compare_exchange(EMPTY, BUSY, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return store(r, e, k, key, func, ips, cut),
                Err(now) => seen = now,
            }
        }
        if seen == key {
            // SAFETY: the id was written before the key was published.
            let id = unsafe { (*e).id };
            if id >= r.fixed.sites {
                continue; // written by the program, not by a store here
            }
            let h = record(r, id);
            // SAFETY: a record published with its key.
            let same =
                unsafe { (*h).func == func && (*h).len as usize == n } && frames(h, n) == ips;
            if same {
                return id as i32;
            }
        }
    }
    lose(r, Loss::Stack);
    LOST_STACK
}

/// Stores a new stack under the index entry `e` (claimed): its record first, then the key.
fn store(
    r: &Region,
    e: *mut IndexEntry,
    k: &AtomicU64,
    key: u64,
    func: u32,
    ips: &[u64],
    cut: bool,
) -> i32 {
    // SAFETY: a u32 of the header.
    let used = unsafe { AtomicU32::from_ptr(&raw mut (*r.header_ptr()).sites_used) };
    let sites = r.fixed.sites;
    // Checked first so that the count never wraps; past the capacity it only says "full".
    let id = if used.load(Ordering::Acquire) < sites {
        used.fetch_add(1, Ordering::AcqRel)
    } else {
        sites
    };
    if id >= sites {
        k.store(EMPTY, Ordering::Release);
        lose(r, Loss::Stack);
        return LOST_STACK;
    }
    let h = record(r, id);
    // SAFETY: record `id` is this thread's to write: no one else got the id.
    unsafe {
        (*h).func = func;
        (*h).len = ips.len() as u32;
        (*h).whole = u32::from(!cut);
        (*e).id = id;
    }
    frames(h, ips.len()).copy_from_slice(ips);
    k.store(key, Ordering::Release);
    id as i32
}
