//! The user stack at a return probe: walked by the program, stored under an id from its hash.
//!
//! Not `bpf_get_stackid`: the kernel's frame-pointer walk stops only where reading a frame
//! fails, and every chain ends in a null frame pointer (`_start` clears rbp), which it reads:
//! a page fault, caught by the exception table, on every walk. That fault cost about 0.6 us a
//! walk here, more than the rest of a shallow stack's walk (BENCHMARKS.md, *The stack walk*).
//! This walk stops before reading a null, misaligned or not higher frame pointer: frames lie
//! ever higher on the stack, so a lower one is data in the frame pointer register (code built
//! without frame pointers), which the kernel's walk followed into junk frames.
//!
//! Ids and hashes: `heaptrace_common::stack`.
use aya_ebpf::{
    EbpfContext,
    bindings::pt_regs,
    helpers::{bpf_get_smp_processor_id, generated},
};
use heaptrace_common::{
    Loss, NO_ROOM_FRAME, STACK_FRAMES, StoredStack, fills,
    stack::{HASH_START, cache_choice, cache_index, cache_word, hash_finish, hash_step, ids},
    unwind::{
        RULE_FRAME_POINTER, RULE_NO_ROOM, RULE_PENDING, SIGNAL_RBP, SIGNAL_RIP, SIGNAL_RSP, kind,
    },
};

use crate::maps::{
    BPF_NOEXIST, CHUNK_WORDS, FILLS, FIRST_CHUNK_WORDS, FRAMES, STACK_CACHE, STACK_CHUNK,
    STACK_GEN, STACK_OWNERS, STACK_SCRATCH, WALK, WalkState, add, lose, lose_index, slot_cpus,
    stack_cache_shift,
};

const EEXIST: i32 = 17;
const EBUSY: i32 = 16;

const CHUNK_BYTES: u64 = 8 * CHUNK_WORDS as u64;
const FIRST_CHUNK_BYTES: u64 = 8 * FIRST_CHUNK_WORDS as u64;

/// Walks the user stack of process `tgid` into this CPU's scratch: the return address the
/// probe returns to, then each frame's, then a zero (unless 127 were taken). The stack's hash
/// is set; the ips past the zero are what an earlier walk left.
///
/// A frame in a module with an unwind table (code without frame pointers, `unwind.rs`) is
/// unwound by its row: CFA = rsp + N or rbp + N, the return address at CFA - 8, rbp restored
/// where the row saves it. Any other frame by its frame pointer: the return address at
/// rbp + 8, the caller's rbp at rbp, its rsp rbp + 16. The two interleave: each step leaves
/// the caller's rsp and rbp for the next. The walk stops at a frame no higher than the last
/// (frames lie ever higher on a thread's stack), a null or misaligned frame pointer, an
/// outermost frame (`_start`), a row with no rule, or a read that faults.
///
/// A frame a `bpf_loop` call (`step`): the verifier checks its body once, where a loop in the
/// program made it follow every frame's searches (700k instructions, 5.5 s). The walk's
/// state is in a per-CPU map (`WALK`), not on the stack: values it does not track, so the
/// callback's states converge at once.
#[inline(always)]
pub fn walk(ctx: &impl EbpfContext, tgid: u32) -> Option<(&'static mut StoredStack, u64)> {
    let s = STACK_SCRATCH.get_ptr_mut(0)?;
    let c = STACK_CHUNK.get_ptr_mut(0)?;
    let w = WALK.get_ptr_mut(0)?;
    let (modules, late) = crate::unwind::modules(tgid);
    if late != 0 {
        // Walked before the process's tables went in: by frame pointer only, maybe cut.
        lose(Loss::UnwindLate);
    }
    // SAFETY: map value pointers; the program runs to its end on this CPU.
    let (sc, ch, st) = unsafe { (&mut *s, &mut *c, &mut *w) };
    // On a kernel with full preemption another task's walk on this CPU can read its stack into
    // the chunk while this one is preempted. The chunk's last word counts the reads into it
    // (atomic adds: no count lost to a preempted update); a walk that finds more reads at its
    // end than its own is not kept (nor, now and then, one that only began while another ran).
    // SAFETY: an aligned read of a map value.
    let first = unsafe { core::ptr::read_volatile(&ch[CHUNK_WORDS]) };
    // A uprobe's context, entry or return, is the user register file.
    let regs = ctx.as_ptr().cast::<pt_regs>();
    // SAFETY: the context's register file, valid for the program's run.
    let (ip, sp, fp) = unsafe { ((*regs).rip, (*regs).rsp, (*regs).rbp) };
    sc.ips[0] = ip;
    // Field by field, the zeros volatile: built whole, LLVM zeroed `no_room` and `last` with
    // a call to a byte loop (~50 ns a walk). `last` is none while its `end` is 0.
    (st.pc, st.sp, st.fp) = (ip, sp, fp);
    st.hash = hash_step(HASH_START, ip);
    (st.n, st.base, st.cut) = (1, 1, Loss::StackDepth as u64);
    // SAFETY: aligned stores into this CPU's walk state.
    unsafe {
        core::ptr::write_volatile(&mut st.reads, 0);
        core::ptr::write_volatile(&mut st.len, 0);
        core::ptr::write_volatile(&mut st.no_room, 0);
        core::ptr::write_volatile(&mut st.last.end, 0);
    }
    let mut frames = Frames {
        modules,
        chunk: ch,
        scratch: sc,
        state: st,
    };
    // A process with no entry yet finds each frame's file by its mapping, in a loop of its
    // own (`unwind::rule_by_mapping`). Where that is off (all but `--all`), the verifier
    // sees the first test fail and goes through that loop not at all.
    if crate::vma::on() && modules.count == crate::unwind::BY_VMA {
        loop_by_mapping(&mut frames);
    } else {
        // SAFETY: the callback is a static function of this object; the context lives on
        // this stack for the call.
        unsafe {
            generated::bpf_loop(
                STACK_FRAMES as u32 - 1,
                step as *mut core::ffi::c_void,
                (&raw mut frames).cast(),
                0,
            )
        };
    }
    // SAFETY: map value pointers, as above.
    let (sc, ch, st) = unsafe { (&mut *s, &mut *c, &mut *w) };
    if st.cut != 0 {
        lose_index(st.cut as u32);
    }
    if st.no_room & 2 != 0 {
        lose(Loss::UnwindLate);
    }
    let n = st.n;
    if st.cut == Loss::UnwindTable as u64
        && let Some(slot) = sc.ips.get_mut(n as usize)
    {
        // The cut is said in the stack itself, for user space to name it.
        *slot = NO_ROOM_FRAME;
        st.hash = hash_step(st.hash, NO_ROOM_FRAME);
        st.n = n + 1;
    }
    // SAFETY: as above.
    if unsafe { core::ptr::read_volatile(&ch[CHUNK_WORDS]) } != first.wrapping_add(st.reads) {
        return None;
    }
    // A Python process's frames go after the native ones.
    (st.n, st.hash) = crate::python::append(tgid, sc, st.n, st.hash);
    let n = st.n;
    // The end of the stack for its readers (`StoredStack::frames`), where a deeper one walked
    // before left its frames: one store, where zeroing the rest made the verifier follow every
    // depth through every slot (start-up 0.4 s slower).
    if let Some(slot) = sc.ips.get_mut(n as usize) {
        *slot = 0;
    }
    let hash = hash_finish(st.hash, n);
    sc.hash = hash;
    Some((sc, hash))
}

/// What `step` reaches through its context: pointers to map values, the same at every step.
struct Frames<'a> {
    modules: crate::unwind::Entry,
    chunk: &'a mut [u64; CHUNK_WORDS + 1],
    scratch: &'a mut StoredStack,
    state: &'a mut WalkState,
}

/// One frame of the walk (a `bpf_loop` callback): 0 to go on, 1 to stop.
#[inline(never)]
extern "C" fn step(_index: u64, ctx: *mut core::ffi::c_void) -> i64 {
    // SAFETY: `walk`'s `Frames`, alive for the loop.
    let f = unsafe { &mut *ctx.cast::<Frames<'_>>() };
    stop_at(f, unwind_one::<false>)
}

/// The walk by mapping, in a function of its own: with both callbacks in one `bpf_loop` call,
/// LLVM loaded `step_by_mapping`'s address on a path that called `step`, and the kernel,
/// which had never verified that callback there, failed to load the program ("No program
/// to jit").
#[inline(never)]
fn loop_by_mapping(frames: &mut Frames<'_>) {
    // SAFETY: as in `walk`.
    unsafe {
        generated::bpf_loop(
            STACK_FRAMES as u32 - 1,
            step_by_mapping as *mut core::ffi::c_void,
            (frames as *mut Frames<'_>).cast(),
            0,
        )
    };
}

/// `step` for a process with no entry yet (`unwind::rule_by_mapping`).
#[inline(never)]
extern "C" fn step_by_mapping(_index: u64, ctx: *mut core::ffi::c_void) -> i64 {
    // SAFETY: `walk`'s `Frames`, alive for the loop.
    let f = unsafe { &mut *ctx.cast::<Frames<'_>>() };
    stop_at(f, unwind_one::<true>)
}

#[inline(always)]
fn stop_at(f: &mut Frames<'_>, one: fn(&mut Frames<'_>) -> Result<(), u64>) -> i64 {
    match one(f) {
        Ok(()) => 0,
        Err(cut) => {
            f.state.cut = cut;
            1
        }
    }
}

/// Unwinds the frame at `state.pc` into the next; Err: why the walk stops (a `Loss` index, or
/// 0 where the stack simply ends). `BY_MAPPING`: the process has no entry yet.
#[inline(always)]
fn unwind_one<const BY_MAPPING: bool>(f: &mut Frames<'_>) -> Result<(), u64> {
    let st = &mut *f.state;
    let n = st.n;
    if n >= STACK_FRAMES as u64 {
        return Err(Loss::StackDepth as u64);
    }
    let (pc, sp, fp) = (st.pc, st.sp, st.fp);
    // pc is a return address: the call before it is in the frame's function.
    let rule = match BY_MAPPING {
        true => crate::unwind::rule_by_mapping(pc.wrapping_sub(1), &mut st.last)?,
        false => crate::unwind::rule(&f.modules, pc.wrapping_sub(1))?,
    };
    let mut chunk = Chunk {
        c: &mut *f.chunk,
        base: &mut st.base,
        len: &mut st.len,
        reads: &mut st.reads,
    };
    let (ret, cfa, fp) = if rule.kind == kind::SIGNAL {
        // The interrupted frame: its registers as the kernel saved them. Its sp may be
        // anywhere (a handler on an alternate stack): the walk's depth bounds it. Its pc is
        // the instruction it stopped at, kept one past it as a return address is: the next
        // row's lookup and the symbolizer take the byte before.
        let rip = chunk.word(sp.wrapping_add(SIGNAL_RIP)).ok_or(0u64)?;
        let ret = rip.wrapping_add(1);
        let next_sp = chunk.word(sp.wrapping_add(SIGNAL_RSP)).ok_or(0u64)?;
        let next_fp = chunk.word(sp.wrapping_add(SIGNAL_RBP)).ok_or(0u64)?;
        if next_sp == sp {
            return Err(0);
        }
        (ret, next_sp, next_fp)
    } else if rule.kind & RULE_FRAME_POINTER == 0 {
        let reg = match rule.rule() {
            kind::RSP => sp,
            kind::RBP => fp,
            kind::END => return Err(0),
            // No rule where rbp is 0: the outermost frame by the ABI's mark. ld.so's
            // `_dl_start_user`, which runs the libraries' constructors, has no FDE and
            // clears rbp first; its stacks are whole, not cut.
            _ if fp == 0 => return Err(0),
            _ => return Err(Loss::UnwindNoRule as u64),
        };
        let cfa = reg.wrapping_add(rule.cfa_words() * 8);
        if cfa <= sp {
            return Err(0);
        }
        let ret = chunk.word(cfa - 8).ok_or(0u64)?;
        let fp = if rule.rbp != 0 {
            chunk
                .word(cfa.wrapping_sub(u64::from(rule.rbp) * 8))
                .ok_or(0u64)?
        } else {
            fp
        };
        (ret, cfa, fp)
    } else {
        if rule.kind & RULE_NO_ROOM != 0 {
            // No rows and no frame pointers: following rbp would read junk frames.
            return Err(Loss::UnwindTable as u64);
        }
        if rule.kind & RULE_PENDING != 0 {
            st.no_room |= 2;
        }
        if fp < sp {
            return Err(0);
        }
        // One after the other: LLVM read the second's value where the first failed, a
        // register the verifier saw uninitialized.
        let next = chunk.word(fp).ok_or(0u64)?;
        let ret = chunk.word(fp + 8).ok_or(0u64)?;
        (ret, fp + 16, next)
    };
    if ret == 0 {
        return Err(0);
    }
    if let Some(slot) = f.scratch.ips.get_mut(n as usize) {
        *slot = ret;
    }
    st.hash = hash_step(st.hash, ret);
    st.n = n + 1;
    st.pc = ret;
    st.sp = cfa;
    st.fp = fp;
    Ok(())
}

/// The user stack as a walk reads it: from the aligned part of a page that holds the word
/// asked for, its eighth at a walk's first read, its half at the next (`CHUNK_WORDS`). A
/// read never reaches into a page the frame does not, so it faults no more often than reading
/// the word alone (a fault costs ~0.6 us here, see above), and the stack's deeper frames often
/// come with it.
struct Chunk<'a> {
    c: &'a mut [u64; CHUNK_WORDS + 1],
    /// Where the chunk was read from; none yet (1: any word is past it).
    base: &'a mut u64,
    /// Its bytes (0: none yet).
    len: &'a mut u64,
    /// Reads into the chunk by this walk.
    reads: &'a mut u64,
}

impl Chunk<'_> {
    /// The aligned word at `addr`; None where it is misaligned or not readable.
    #[inline(always)]
    fn word(&mut self, addr: u64) -> Option<u64> {
        if addr & 7 != 0 {
            return None;
        }
        // Aligned words from an aligned base: any off below len holds a whole word; a word
        // below the base wraps to past it.
        let mut off = addr.wrapping_sub(*self.base);
        if off >= *self.len {
            let len = if *self.reads == 0 {
                FIRST_CHUNK_BYTES
            } else {
                CHUNK_BYTES
            };
            // Masked from addr, the verifier sees it bounded as in the other branch.
            off = addr & (len - 1) & (CHUNK_BYTES - 1);
            let from = addr - off;
            add(&mut self.c[CHUNK_WORDS], 1);
            *self.reads += 1;
            // SAFETY: bpf_probe_read_user validates the user address; `len` is at most the
            // chunk's size.
            let r = unsafe {
                generated::bpf_probe_read_user(
                    self.c.as_mut_ptr().cast(),
                    len as u32,
                    from as *const core::ffi::c_void,
                )
            };
            if r != 0 {
                (*self.base, *self.len) = (1, 0);
                return None;
            }
            (*self.base, *self.len) = (from, len);
        }
        self.c[..CHUNK_WORDS].get((off >> 3) as usize).copied()
    }
}

/// The stack's id, stored now if it was not. Err: an errno, STACK_OWNERS or FRAMES full
/// (E2BIG, ENOMEM) or both of its ids held by other stacks (EEXIST).
#[inline(always)]
pub fn store(ctx: &impl EbpfContext, tgid: u32) -> Result<u32, i32> {
    // The hash as the walk computed it, not read back from the scratch: see `intact`.
    let Some((s, hash)) = walk(ctx, tgid) else {
        return Err(-EBUSY); // another walk ran in the middle of this one
    };
    let [first, second] = ids(hash);
    // The generation before STACK_OWNERS is looked in: see `heaptrace_common::stack::cache_word`.
    let generation = STACK_GEN.get_ptr(0).map_or(0, |g| {
        // SAFETY: map value pointer; user space writes it whole.
        unsafe { core::ptr::read_volatile(g) }
    });
    let word = cached(hash);
    if let Some(w) = &word {
        // SAFETY: an aligned read of a map value.
        match cache_choice(unsafe { core::ptr::read_volatile(*w) }, hash, generation) {
            Some(0) => return Ok(first),
            Some(_) => return Ok(second),
            None => {}
        }
    }
    let (choice, id, new) = find_or_store(s, hash, [first, second])?;
    if new {
        // Counted for the reads between rounds (`drain::relief`): a round on a starved host
        // can store more new stacks than FRAMES holds.
        if let Some(n) = FILLS.get_ptr_mut(fills::FRAMES) {
            // SAFETY: map value pointer, valid for the program's run.
            add(unsafe { &mut *n }, 1);
        }
    }
    if let Some(w) = word {
        // SAFETY: as above; one aligned store, so a program preempted by another on this
        // CPU leaves the one word or the other, whole.
        unsafe { core::ptr::write_volatile(w, cache_word(hash, generation, choice)) };
    }
    Ok(id)
}

/// This stack's word in this CPU's row of the stack cache (None where the tables are off).
#[inline(always)]
fn cached(hash: u64) -> Option<*mut u64> {
    // SAFETY: no preconditions (the verifier inlines it).
    let cpu = unsafe { bpf_get_smp_processor_id() };
    if cpu >= slot_cpus() {
        return None;
    }
    STACK_CACHE.get_ptr_mut(cache_index(cpu, hash, stack_cache_shift()))
}

/// The stack's id, which of its two it is, and whether it was stored now. An id is the stack's
/// while STACK_OWNERS holds its hash there; its frames wait in FRAMES until user space reads
/// them (every round, and deletes them then).
#[inline(always)]
fn find_or_store(s: &StoredStack, hash: u64, ids: [u32; 2]) -> Result<(u32, u32, bool), i32> {
    for (choice, id) in [(0, ids[0]), (1, ids[1])] {
        // SAFETY: a read of the value; a concurrent delete (user space freeing the stack of a
        // process gone) leaves the element readable until the program ends.
        match unsafe { STACK_OWNERS.get(&id) } {
            Some(held) if *held == hash => return Ok((choice, id, false)),
            Some(_) => continue,
            None => {}
        }
        match STACK_OWNERS.insert(&id, &hash, BPF_NOEXIST) {
            Ok(()) => return store_frames(s, hash, id).map(|()| (choice, id, true)),
            // Another CPU took the id first: for this stack, or another.
            Err(e) if e == -EEXIST => {
                // SAFETY: as above.
                if unsafe { STACK_OWNERS.get(&id) }.is_some_and(|held| *held == hash) {
                    return Ok((choice, id, false));
                }
            }
            Err(e) => return Err(e),
        }
    }
    Err(-EEXIST)
}

/// Stores the frames of the stack that has just taken `id`, for user space to read; where
/// they cannot be (FRAMES full, or the scratch torn) the id is given back.
#[inline(always)]
fn store_frames(s: &StoredStack, hash: u64, id: u32) -> Result<(), i32> {
    // BPF_ANY: frames a freed id's stack left unread are this one's now.
    let r = match FRAMES.insert(&id, s, 0) {
        Ok(()) if intact(s, hash) => return Ok(()),
        Ok(()) => {
            // What was stored may be part another stack's: not kept.
            let _ = FRAMES.remove(&id);
            -EBUSY
        }
        Err(e) => e,
    };
    let _ = STACK_OWNERS.remove(&id);
    Err(r)
}

/// Whether the scratch still holds the stack that hashed to `hash`. A uprobe's program runs
/// with migration disabled but, on a kernel with full preemption, can be preempted; another
/// task's walk on this CPU then overwrites the scratch. Checked after the stack was stored: a
/// copy taken between two such writes would hold parts of two stacks under one's hash.
#[inline(always)]
fn intact(s: &StoredStack, hash: u64) -> bool {
    let mut h = HASH_START;
    let mut n = 0u64;
    for &ip in s.ips.iter() {
        if ip == 0 {
            break;
        }
        h = hash_step(h, ip);
        n += 1;
    }
    hash_finish(h, n) == hash && s.hash == hash
}
