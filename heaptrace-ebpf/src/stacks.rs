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
    helpers::{bpf_get_smp_processor_id, generated},
    programs::RetProbeContext,
};
use heaptrace_common::{
    STACK_FRAMES, StoredStack,
    stack::{HASH_START, cache_choice, cache_index, cache_word, hash_finish, hash_step, ids},
};

use crate::maps::{
    BPF_NOEXIST, CHUNK_WORDS, FRAMES, STACK_CACHE, STACK_CHUNK, STACK_GEN, STACK_SCRATCH, add,
    slot_cpus, stack_cache_shift,
};

const EEXIST: i32 = 17;
const EBUSY: i32 = 16;

const CHUNK_BYTES: u64 = 8 * CHUNK_WORDS as u64;

/// Walks the user stack into this CPU's scratch: the return address the probe returns to, then
/// each frame's, then a zero (unless 127 were taken). The stack's hash is set; the ips past the
/// zero are what an earlier walk left.
///
/// Frames are read 512 bytes at a time, from the aligned eighth of a page that holds the frame
/// (from 8 bytes higher for a frame that ends in the next eighth): a read never reaches into a
/// page the frame does not, so it faults no more often than reading the frame alone (a fault
/// costs ~0.6 us here, see above) and the stack's deeper frames often come with it.
///
/// Nothing of the depth leaves this function: to the verifier, a depth known at each of the
/// loop's exits made as many states of the rest of the program, and the return program went
/// over its million instructions.
#[inline(always)]
pub fn walk(ctx: &RetProbeContext) -> Option<(&'static mut StoredStack, u64)> {
    let s = STACK_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: map value pointer; the program runs to its end on this CPU.
    let s = unsafe { &mut *s };
    let c = STACK_CHUNK.get_ptr_mut(0)?;
    // SAFETY: as above.
    let c = unsafe { &mut *c };
    // On a kernel with full preemption another task's walk on this CPU can read its stack into
    // the chunk while this one is preempted. The chunk's last word counts the reads into it
    // (atomic adds: no count lost to a preempted update); a walk that finds more reads at its
    // end than its own is not kept (nor, now and then, one that only began while another ran).
    // SAFETY: an aligned read of a map value.
    let first = unsafe { core::ptr::read_volatile(&c[CHUNK_WORDS]) };
    let mut reads = 0u64;
    // SAFETY: the context's register file, valid for the program's run.
    let (ip, mut fp) = unsafe { ((*ctx.regs).rip, (*ctx.regs).rbp) };
    s.ips[0] = ip;
    let mut h = hash_step(HASH_START, ip);
    let mut n = 1;
    // Where the chunk was read from; none yet (fp - base is then past any frame).
    let mut base = fp | 1;
    while n < STACK_FRAMES {
        if fp == 0 || fp & 7 != 0 {
            break;
        }
        let mut off = fp.wrapping_sub(base);
        if off > CHUNK_BYTES - 16 {
            // Computed from fp alone, the verifier sees it bounded as in the other branch.
            off = (fp & (CHUNK_BYTES - 1)).min(CHUNK_BYTES - 16);
            let from = fp - off;
            add(&mut c[CHUNK_WORDS], 1);
            reads += 1;
            // SAFETY: bpf_probe_read_user validates the user address; the size is the
            // chunk's. A fault ends the walk.
            let r = unsafe {
                generated::bpf_probe_read_user(
                    c.as_mut_ptr().cast(),
                    CHUNK_BYTES as u32,
                    from as *const core::ffi::c_void,
                )
            };
            if r != 0 {
                break;
            }
            base = from;
        }
        let i = (off >> 3) as usize;
        let (Some(&next), Some(&ret)) = (c[..CHUNK_WORDS].get(i), c[..CHUNK_WORDS].get(i + 1))
        else {
            break;
        };
        if ret == 0 {
            break;
        }
        if let Some(slot) = s.ips.get_mut(n) {
            *slot = ret;
        }
        h = hash_step(h, ret);
        n += 1;
        if next <= fp {
            break;
        }
        fp = next;
    }
    // SAFETY: as above.
    if unsafe { core::ptr::read_volatile(&c[CHUNK_WORDS]) } != first.wrapping_add(reads) {
        return None;
    }
    // The end of the stack for its readers (`StoredStack::frames`), where a deeper one walked
    // before left its frames: one store, where zeroing the rest made the verifier follow every
    // depth through every slot (start-up 0.4 s slower).
    if let Some(slot) = s.ips.get_mut(n) {
        *slot = 0;
    }
    let hash = hash_finish(h, n as u64);
    s.hash = hash;
    Some((s, hash))
}

/// The stack's id in FRAMES, stored now if it was not. Err: an errno, FRAMES full (E2BIG,
/// ENOMEM) or both of its ids held by other stacks (EEXIST).
#[inline(always)]
pub fn store(ctx: &RetProbeContext) -> Result<u32, i32> {
    // The hash as the walk computed it, not read back from the scratch: see `intact`.
    let Some((s, hash)) = walk(ctx) else {
        return Err(-EBUSY); // another walk ran in the middle of this one
    };
    let [first, second] = ids(hash);
    // The generation before FRAMES is looked in: see `heaptrace_common::stack::cache_word`.
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
    let (choice, id) = find_or_store(s, hash, [first, second])?;
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

/// The stack's id in FRAMES and which of its two it is, stored now if it was not.
#[inline(always)]
fn find_or_store(s: &StoredStack, hash: u64, ids: [u32; 2]) -> Result<(u32, u32), i32> {
    for (choice, id) in [(0, ids[0]), (1, ids[1])] {
        // SAFETY: a read of the value's hash; a concurrent delete (user space freeing the
        // stack of a process gone) leaves the element readable until the program ends.
        match unsafe { FRAMES.get(&id) } {
            Some(held) if held.hash == hash => return Ok((choice, id)),
            Some(_) => continue,
            None => {}
        }
        match FRAMES.insert(&id, s, BPF_NOEXIST) {
            Ok(()) if intact(s, hash) => return Ok((choice, id)),
            Ok(()) => {
                // What was stored may be part another stack's: not kept.
                let _ = FRAMES.remove(&id);
                return Err(-EBUSY);
            }
            // Another CPU stored a stack there first: this one, or another.
            Err(e) if e == -EEXIST => {
                // SAFETY: as above.
                if unsafe { FRAMES.get(&id) }.is_some_and(|held| held.hash == hash) {
                    return Ok((choice, id));
                }
            }
            Err(e) => return Err(e),
        }
    }
    Err(-EEXIST)
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
