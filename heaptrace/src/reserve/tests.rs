use heaptrace_common::{MemEvent, NO_SITE, mem};

use super::*;

const MIB: u64 = 1 << 20;
const PID: u32 = 100;
const RW: u64 = 3;
const PRIVATE_ANON: u64 = 0x22;

fn sys(kind: u32, tid: u32, func: u32, args: [u64; 4], ret: u64) -> MemEvent {
    MemEvent {
        kind,
        tgid: PID,
        tid,
        func,
        args,
        ret,
    }
}

fn end(tid: u32, func: u32, stack_id: i32) -> MemEvent {
    sys(
        mem::CALL_END,
        tid,
        func,
        [stack_id as i64 as u64, 0, 0, 0],
        0,
    )
}

/// glibc's new_heap: 128 MiB inaccessible, head and tail unmapped to keep an aligned 64 MiB.
fn arena_events(tid: u32, base: u64) -> Vec<MemEvent> {
    let aligned = (base + 64 * MIB - 1) & !(64 * MIB - 1);
    vec![
        sys(
            mem::MMAP,
            tid,
            0,
            [0, 128 * MIB, PROT_NONE, PRIVATE_ANON | MAP_NORESERVE],
            base,
        ),
        sys(mem::MUNMAP, tid, 0, [base, aligned - base, 0, 0], 0),
        sys(
            mem::MUNMAP,
            tid,
            0,
            [
                aligned + 64 * MIB,
                base + 128 * MIB - aligned - 64 * MIB,
                0,
                0,
            ],
            0,
        ),
    ]
}

#[test]
fn a_new_arena_is_one_64_mib_reservation_of_the_calling_site() {
    let mut t = Tracker::default();
    for (i, tid) in [11u32, 12, 13].into_iter().enumerate() {
        for e in arena_events(tid, 0x7f00_0123_4000 + i as u64 * 256 * MIB) {
            t.event(&e);
        }
        t.event(&end(tid, 0, 5));
    }
    let fresh = t.take();
    assert_eq!(
        fresh.get(&(PID, Kind::Arena, 5, 0)),
        Some(&ResTotals {
            calls: 3,
            bytes: 3 * 64 * MIB
        })
    );
    assert_eq!(
        fresh.len(),
        1,
        "trimming its own mapping is no release: {fresh:?}"
    );
    assert_eq!(t.reserved(PID).arenas, 3 * 64 * MIB);
    assert!(t.take().is_empty(), "taken once");
}

#[test]
fn a_large_block_is_reserved_by_its_site_and_released_to_it_by_free() {
    let mut t = Tracker::default();
    let addr = 0x7f00_0000_0000;
    t.event(&sys(
        mem::MMAP,
        7,
        0,
        [0, 200 << 10, RW, PRIVATE_ANON],
        addr,
    ));
    t.event(&end(7, 0, 9));
    assert_eq!(t.reserved(PID).mmapped, 200 << 10);
    // free() is not an in-flight call: its munmap comes unnamed.
    t.event(&sys(
        mem::MUNMAP,
        7,
        mem::NO_FUNC,
        [addr, 200 << 10, 0, 0],
        0,
    ));
    let fresh = t.take();
    assert_eq!(fresh[&(PID, Kind::Mmap, 9, 0)].bytes, 200 << 10);
    assert_eq!(
        fresh[&(PID, Kind::Munmap { of: Area::Mmap }, 9, 0)],
        ResTotals {
            calls: 1,
            bytes: 200 << 10
        }
    );
    assert_eq!(t.reserved(PID), Reserved::default());
}

#[test]
fn brk_growth_counts_from_a_known_break_and_a_trim_is_released_unnamed() {
    let mut t = Tracker::default();
    // Before the break is known, growth cannot be measured.
    t.event(&sys(mem::BRK, 3, 1, [0x60_0000, 0, 0, 0], 0x60_0000));
    t.event(&end(3, 1, 4));
    assert!(t.take().is_empty());
    t.event(&sys(mem::BRK, 3, 0, [0x62_1000, 0, 0, 0], 0x62_1000));
    t.event(&end(3, 0, 4));
    t.event(&sys(
        mem::BRK,
        3,
        mem::NO_FUNC,
        [0x61_0000, 0, 0, 0],
        0x61_0000,
    ));
    let fresh = t.take();
    assert_eq!(fresh[&(PID, Kind::Brk, 4, 0)].bytes, 0x2_1000);
    assert_eq!(
        fresh[&(PID, Kind::Munmap { of: Area::Brk }, NO_SITE, mem::NO_FUNC)].bytes,
        0x1_1000
    );
}

#[test]
fn a_seeded_break_measures_the_first_growth() {
    let mut t = Tracker::default();
    t.seed_brk(PID, 0x60_0000);
    assert!(t.knows(PID));
    t.event(&sys(mem::BRK, 3, 0, [0x62_1000, 0, 0, 0], 0x62_1000));
    t.event(&end(3, 0, 4));
    assert_eq!(t.take()[&(PID, Kind::Brk, 4, 0)].bytes, 0x2_1000);
}

/// After an exec the break is the new image's, far from the old one's (each image's heap is
/// placed at random): the first growth is measured from the new image's first break, and what
/// the earlier image reserved and mapped is gone.
#[test]
fn an_exec_starts_the_break_and_the_mappings_over() {
    let mut t = Tracker::default();
    t.seed_brk(PID, 0x5555_0000_0000);
    t.event(&sys(mem::BRK, 3, 0, [0, 0, 0, 0], 0x5555_0002_1000));
    t.event(&sys(
        mem::MMAP,
        3,
        0,
        [0, 4 * MIB, RW, PRIVATE_ANON],
        0x7f00_0000_0000,
    ));
    t.event(&end(3, 0, 4));
    t.event(&sys(mem::EXEC, PID, mem::NO_FUNC, [0; 4], 0));
    assert!(!t.knows(PID));
    assert_eq!(t.reserved(PID).mmapped, 0);
    // The new image's first brk (ld.so's brk(NULL), outside any allocator call), then malloc's.
    t.event(&sys(
        mem::BRK,
        PID,
        mem::NO_FUNC,
        [0, 0, 0, 0],
        0x5611_0000_0000,
    ));
    t.event(&sys(mem::BRK, 3, 0, [0, 0, 0, 0], 0x5611_0002_1000));
    t.event(&end(3, 0, 7));
    let fresh = t.take();
    assert_eq!(
        fresh.len(),
        1,
        "the earlier image's reservations: {fresh:?}"
    );
    assert_eq!(fresh[&(PID, Kind::Brk, 7, 0)].bytes, 0x2_1000);
}

#[test]
fn a_call_whose_end_was_not_seen_is_applied_unnamed_at_the_threads_next_syscall() {
    let mut t = Tracker::default();
    t.event(&sys(
        mem::MMAP,
        5,
        2,
        [0, 1 << 20, RW, PRIVATE_ANON],
        0x1000_0000,
    ));
    assert!(t.take().is_empty(), "waits for its site");
    t.event(&sys(
        mem::MUNMAP,
        5,
        mem::NO_FUNC,
        [0x5000_0000, 4096, 0, 0],
        0,
    ));
    let fresh = t.take();
    assert_eq!(fresh[&(PID, Kind::Mmap, NO_SITE, 2)].bytes, 1 << 20);
    assert_eq!(
        fresh.len(),
        1,
        "the unrelated munmap released nothing of ours"
    );
}

#[test]
fn decommitting_part_of_an_arena_keeps_it_reserved() {
    let mut t = Tracker::default();
    for e in arena_events(11, 0x7f00_0000_0000) {
        t.event(&e);
    }
    t.event(&end(11, 0, 5));
    t.take();
    let a = 0x7f00_0000_0000 + 64 * MIB; // aligned start (base is aligned: no head)
    let r = t.reserved(PID).arenas;
    // shrink_heap: mmap(MAP_FIXED, PROT_NONE) over the arena's tail, from free().
    t.event(&sys(
        mem::MMAP,
        11,
        mem::NO_FUNC,
        [a + MIB, MIB, PROT_NONE, PRIVATE_ANON | MAP_FIXED],
        a + MIB,
    ));
    assert!(t.take().is_empty());
    assert_eq!(t.reserved(PID).arenas, r);
}

#[test]
fn a_program_moving_a_block_keeps_its_owner() {
    let mut t = Tracker::default();
    t.event(&sys(
        mem::MMAP,
        7,
        0,
        [0, 1 << 20, RW, PRIVATE_ANON],
        0x1000_0000,
    ));
    t.event(&end(7, 0, 9));
    t.take();
    t.event(&sys(
        mem::MREMAP,
        7,
        mem::NO_FUNC,
        [0x1000_0000, 1 << 20, 2 << 20, 1],
        0x2000_0000,
    ));
    assert!(t.take().is_empty());
    assert_eq!(t.reserved(PID).mmapped, 2 << 20);
    t.forget(PID);
    assert_eq!(t.reserved(PID), Reserved::default());
}

#[test]
fn unmapping_the_middle_of_a_region_splits_it() {
    let mut r = regions::Regions::default();
    let region = |serial| regions::Region {
        end: 0x4000,
        kind: Area::Mmap,
        stack_id: 1,
        func: 0,
        serial,
    };
    assert!(r.insert(0x1000, region(1)));
    let out = r.unmap(0x2000, 0x3000, 2);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].1, 0x1000);
    assert_eq!(r.get_at(0x1fff).map(|x| x.end), Some(0x2000));
    assert_eq!(r.get_at(0x2000), None);
    assert_eq!(r.get_at(0x3000).map(|x| x.end), Some(0x4000));
    assert!(r.covers(0x1000, 0x2000));
    assert!(!r.covers(0x1000, 0x3001));
    assert!(
        r.unmap(0x3000, 0x3800, 1).is_empty(),
        "its own call: a trim"
    );
}

#[test]
fn calls_of_two_threads_keep_their_regions_whichever_ends_first() {
    let mut t = Tracker::default();
    let base = 0x7f00_0000_0000; // aligned: A keeps [base, base + 64 MiB), trims the rest
    for e in arena_events(11, base) {
        t.event(&e);
    }
    // B's new arena lands in the 64 MiB A just trimmed off, and B's call ends first.
    for e in arena_events(12, base + ARENA_SIZE) {
        t.event(&e);
    }
    t.event(&end(12, 0, 6));
    t.event(&end(11, 0, 5));
    let fresh = t.take();
    assert_eq!(fresh[&(PID, Kind::Arena, 5, 0)].bytes, ARENA_SIZE);
    assert_eq!(fresh[&(PID, Kind::Arena, 6, 0)].bytes, ARENA_SIZE);
    assert_eq!(t.reserved(PID).arenas, 2 * ARENA_SIZE);
}

const ARENA_SIZE: u64 = 64 * MIB;

/// The begin event of a munmap (`mem::BEGIN`) that trims what `arena_events` trims.
fn begun(ev: &MemEvent) -> MemEvent {
    MemEvent {
        kind: ev.kind | mem::BEGIN,
        ret: 0,
        ..*ev
    }
}

#[test]
fn a_range_one_thread_unmaps_and_another_maps_before_the_first_is_reported_stays_the_seconds() {
    // A (tid 11) maps 128 MiB at an unaligned base and trims the head. B's new arena gets the
    // head's addresses: the kernel freed them before A's munmap returned, so B's mmap can be
    // reported before A's munmap is. A's munmap began before B's mmap could get the range.
    let mut t = Tracker::default();
    // A keeps [0x7f00_0400_0000, +64 MiB) and trims the 48 MiB below it. B's 128 MiB ends
    // where A's arena begins: B keeps [0x7f00_0000_0000, +64 MiB), inside A's head.
    let a = arena_events(11, 0x7f00_0100_0000);
    let b = arena_events(12, 0x7eff_fc00_0000);
    t.event(&a[0]); // A's mmap
    t.event(&begun(&a[1])); // A's head munmap begins
    t.event(&b[0]); // B's mmap, over A's head
    t.event(&a[1]); // A's head munmap returns
    t.event(&begun(&a[2]));
    t.event(&a[2]);
    for e in &b[1..] {
        t.event(&begun(e));
        t.event(e);
    }
    t.event(&end(11, 0, 5));
    t.event(&end(12, 0, 6));
    let fresh = t.take();
    assert_eq!(
        fresh[&(PID, Kind::Arena, 5, 0)].bytes,
        ARENA_SIZE,
        "{fresh:?}"
    );
    assert_eq!(
        fresh[&(PID, Kind::Arena, 6, 0)].bytes,
        ARENA_SIZE,
        "{fresh:?}"
    );
    assert!(
        !fresh.keys().any(|k| matches!(k.1, Kind::Munmap { .. })),
        "nothing was given back: {fresh:?}"
    );
    assert_eq!(t.reserved(PID).arenas, 2 * ARENA_SIZE);
}

#[test]
fn a_munmap_that_fails_gives_nothing_back() {
    let mut t = Tracker::default();
    let addr = 0x7f00_0000_0000;
    t.event(&sys(mem::MMAP, 11, 0, [0, 2 * MIB, RW, PRIVATE_ANON], addr));
    t.event(&end(11, 0, 5));
    let unmap = sys(mem::MUNMAP, 11, mem::NO_FUNC, [addr, 2 * MIB, 0, 0], 0);
    t.event(&begun(&unmap));
    assert_eq!(t.reserved(PID).mmapped, 0, "taken out as it began");
    t.event(&MemEvent {
        kind: mem::MUNMAP | mem::FAILED,
        ret: -22i64 as u64,
        ..unmap
    });
    assert_eq!(t.reserved(PID).mmapped, 2 * MIB, "put back");
    let fresh = t.take();
    assert!(
        !fresh.keys().any(|k| matches!(k.1, Kind::Munmap { .. })),
        "{fresh:?}"
    );
}

/// A pymalloc arena (its mmap reported with `mem::PYMALLOC` and its own end, the stack taken
/// at the syscall): a reservation of kind Pymalloc at that stack, in the process's pymalloc
/// bytes until CPython unmaps it outside any call, which gives it back to the same site.
#[test]
fn a_pymalloc_arena_is_reserved_at_its_stack_and_given_back_there() {
    let mut t = Tracker::default();
    let base = 0x7f00_0040_0000;
    for (i, stack) in [(0, 7), (1, 7), (2, 8)] {
        let at = base + i * MIB;
        let args = [0, mem::PYMALLOC_ARENA, RW, PRIVATE_ANON];
        t.event(&sys(mem::MMAP, 11, mem::PYMALLOC, args, at));
        t.event(&end(11, mem::PYMALLOC, stack));
    }
    assert_eq!(t.reserved(PID).pymalloc, 3 * MIB);
    assert_eq!(t.reserved(PID).mmapped, 0);
    let fresh = t.take();
    let made = |stack| fresh[&(PID, Kind::Pymalloc, stack, mem::PYMALLOC)];
    assert_eq!(
        made(7),
        ResTotals {
            calls: 2,
            bytes: 2 * MIB
        }
    );
    assert_eq!(
        made(8),
        ResTotals {
            calls: 1,
            bytes: MIB
        }
    );
    t.event(&sys(
        mem::MUNMAP | mem::BEGIN,
        11,
        mem::NO_FUNC,
        [base, MIB, 0, 0],
        0,
    ));
    t.event(&sys(mem::MUNMAP, 11, mem::NO_FUNC, [base, MIB, 0, 0], 0));
    let back = t.take();
    let of = Kind::Munmap { of: Area::Pymalloc };
    assert_eq!(
        back[&(PID, of, 7, mem::PYMALLOC)],
        ResTotals {
            calls: 1,
            bytes: MIB
        }
    );
    assert_eq!(t.reserved(PID).pymalloc, 2 * MIB);
}

/// A pymalloc arena mapped on a thread whose last allocator call never reported its end is a
/// reservation of its own: the open call is closed first, not merged into it.
#[test]
fn a_pymalloc_arena_never_joins_a_call_left_open() {
    let mut t = Tracker::default();
    let big = 0x7f00_1000_0000;
    t.event(&sys(mem::MMAP, 11, 0, [0, 2 * MIB, RW, PRIVATE_ANON], big));
    let arena = 0x7f00_2000_0000;
    let args = [0, mem::PYMALLOC_ARENA, RW, PRIVATE_ANON];
    t.event(&sys(mem::MMAP, 11, mem::PYMALLOC, args, arena));
    t.event(&end(11, mem::PYMALLOC, 9));
    let fresh = t.take();
    assert_eq!(
        fresh.get(&(PID, Kind::Pymalloc, 9, mem::PYMALLOC)),
        Some(&ResTotals {
            calls: 1,
            bytes: MIB
        }),
        "{fresh:?}"
    );
    assert_eq!(t.reserved(PID).pymalloc, MIB);
}
