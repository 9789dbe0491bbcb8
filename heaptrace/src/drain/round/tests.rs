use heaptrace_common::SiteCounters;

use super::*;

fn counters(calls: u64, bytes: u64, live_blocks: i64, live_bytes: i64) -> ProcCounters {
    let mut c = ProcCounters::ZERO;
    c.funcs[Func::Malloc as usize].calls = calls;
    c.funcs[Func::Malloc as usize].bytes = bytes;
    c.live_blocks = live_blocks as u64;
    c.live_bytes = live_bytes as u64;
    c
}

#[test]
fn per_cpu_live_figures_sum_across_negative_cpus() {
    // Two blocks of 100 allocated on CPU 0, one freed on CPU 1.
    let cpu0 = counters(2, 200, 2, 200);
    let cpu1 = counters(0, 0, -1, -100);
    let t = Totals::from_per_cpu([&cpu0, &cpu1]);
    assert_eq!(t.func(Func::Malloc).calls, 2);
    assert_eq!((t.live_blocks, t.live_bytes), (1, 100));
}

#[test]
fn a_sites_live_figures_leave_out_the_blocks_the_live_map_refused() {
    // Three blocks of 100 on CPU 0, one refused by the live map; one freed on CPU 1.
    let mut cpu0 = SiteCounters::ZERO;
    (cpu0.calls, cpu0.bytes) = (3, 300);
    (cpu0.untracked, cpu0.untracked_bytes) = (1, 100);
    let mut cpu1 = SiteCounters::ZERO;
    (cpu1.frees, cpu1.freed_bytes) = (1, 100);
    let t = SiteTotals::from_per_cpu([&cpu0, &cpu1]);
    assert_eq!((t.calls, t.frees), (3, 1));
    assert_eq!((t.live_blocks, t.live_bytes), (1, 100));
}

/// Only a process read in both whose image moved on started over; one new or gone, or
/// read twice of the same image, did not.
#[test]
fn restarted_since_compares_the_images_read() {
    let mk = |procs: &[(u32, u32)]| {
        let mut s = Snapshot::default();
        for (pid, epoch) in procs {
            let p = ProcSnapshot {
                epoch: *epoch,
                ..Default::default()
            };
            s.procs.insert(*pid, p);
        }
        s
    };
    let prev = mk(&[(1, 1), (2, 1), (3, 2)]);
    let now = mk(&[(1, 1), (2, 2), (4, 1)]);
    assert_eq!(now.restarted_since(&prev), [2]);
    assert!(prev.restarted_since(&prev).is_empty());
}

#[test]
fn deltas_between_snapshots_add_back_to_the_last_snapshot() {
    let mk = |calls, bytes, lb, lbytes, size_count| {
        let mut s = Snapshot::default();
        s.procs.insert(
            7,
            ProcSnapshot {
                comm: "fx".into(),
                totals: Totals::from_per_cpu([&counters(calls, bytes, lb, lbytes)]),
                ..Default::default()
            },
        );
        s.sizes.insert((7, 0, 100, 3), size_count);
        s.losses[0] = size_count / 2;
        s
    };
    let s0 = Snapshot::default();
    let s1 = mk(3, 300, 3, 300, 3);
    let s2 = mk(10, 1000, 1, 100, 10);
    let r1 = s1.since(&s0);
    let r2 = s2.since(&s1);
    assert_eq!(r1.procs[&7].delta.func(Func::Malloc).calls, 3);
    assert_eq!(r2.procs[&7].delta.func(Func::Malloc).calls, 7);
    assert_eq!(r2.procs[&7].delta.live_blocks, -2);
    assert_eq!(r2.sizes[&(7, 0, 100, 3)], 7);
    assert_eq!(r2.losses[0], 4);
    let mut sum = Totals::default();
    sum.plus(&r1.procs[&7].delta);
    sum.plus(&r2.procs[&7].delta);
    assert_eq!(sum, s2.procs[&7].totals);
    // A round in which nothing moved carries no process.
    assert!(s2.since(&s2).procs.is_empty());
}

#[test]
fn sites_get_their_sizes_from_the_exact_histogram() {
    let mut s = Snapshot::default();
    let (site, other): (SiteId, SiteId) = ((9, 4, 0), (9, 5, 2));
    s.sites.insert(site, SiteTotals::default());
    s.sites.insert(other, SiteTotals::default());
    s.sizes.insert((9, 0, 100, 4), 3); // site: 64-127 B
    s.sizes.insert((9, 0, 120, 4), 2); // site: the same bucket
    s.sizes.insert((9, 0, 5000, 4), 1); // site: 4-8 KiB
    s.sizes.insert((9, 2, 100, 4), 7); // realloc at that stack: another site, not there
    s.sizes.insert((9, 2, 64, 5), 4); // other
    s.sizes.insert((9, 0, 64, heaptrace_common::NOT_SAMPLED), 9); // sampled out: no site
    // Other processes' sizes, before and after: each goes to its own process's site.
    s.sites.insert((3, 4, 0), SiteTotals::default());
    s.sites.insert((12, 4, 0), SiteTotals::default());
    s.sizes.insert((3, 0, 100, 4), 11);
    s.sizes.insert((12, 0, 5000, 4), 13);
    s.sizes.insert((12, 0, 100, 5), 17); // no such site
    s.fold_site_sizes();
    let b = heaptrace_common::log2_bucket;
    let sizes = &s.sites[&site].sizes;
    assert_eq!((sizes[b(100)], sizes[b(5000)]), (5, 1));
    assert_eq!(sizes.sum(), 6);
    assert_eq!(s.sites[&other].sizes[b(64)], 4);
    assert_eq!(s.sites[&other].sizes.sum(), 4);
    assert_eq!(
        s.sites[&(3, 4, 0)].sizes.iter().collect::<Vec<_>>(),
        [(b(100), 11)]
    );
    assert_eq!(
        s.sites[&(12, 4, 0)].sizes.iter().collect::<Vec<_>>(),
        [(b(5000), 13)]
    );
    assert_eq!(s.sites.len(), 4);
}

proptest::proptest! {
    #[test]
    fn map_delta_gives_each_changed_entry_its_difference(
        cur in proptest::collection::btree_map(0u8..40, 0u64..4, 0..30),
        base in proptest::collection::btree_map(0u8..40, 0u64..4, 0..30),
    ) {
        let d = map_delta(&cur, &base, |a, b| a.wrapping_sub(*b));
        let want: BTreeMap<u8, u64> = cur
            .iter()
            .map(|(k, v)| (*k, v.wrapping_sub(base.get(k).copied().unwrap_or(0))))
            .filter(|(_, d)| *d != 0)
            .collect();
        proptest::prop_assert_eq!(d, want);
    }
}

#[test]
fn site_deltas_follow_the_same_arithmetic() {
    let mut c = SiteCounters::ZERO;
    c.calls = 5;
    c.bytes = 500;
    let mut freed = SiteCounters::ZERO;
    freed.frees = 2;
    freed.freed_bytes = 200;
    freed.lifetimes[3] = 2;
    let id: SiteId = (9, 4, 0);
    let mut s1 = Snapshot::default();
    s1.sites.insert(id, SiteTotals::from_per_cpu([&c]));
    s1.latency[0][5] = 3;
    let mut s2 = s1.clone();
    s2.sites.insert(id, SiteTotals::from_per_cpu([&c, &freed]));
    s2.latency[0][5] = 10;
    let r = s2.since(&s1);
    let d = &r.sites[&id];
    assert_eq!(
        (d.calls, d.frees, d.live_blocks, d.live_bytes),
        (0, 2, -2, -200)
    );
    assert_eq!(d.lifetimes[3], 2);
    assert_eq!(r.latency[0][5], 7);
    let mut total = s1.since(&Snapshot::default()).sites[&id].clone();
    total.plus(d);
    assert_eq!(total, s2.sites[&id]);
}

#[test]
fn allocations_and_frees_follow_realloc_semantics() {
    let mut t = Totals::default();
    t.funcs[Func::Malloc as usize] = FnTotals {
        calls: 10,
        bytes: 1000,
        failed: 1,
    };
    t.funcs[Func::Realloc as usize] = FnTotals {
        calls: 5,
        bytes: 50,
        failed: 1,
    };
    t.realloc_frees = 2;
    t.funcs[Func::Free as usize].calls = 4;
    assert_eq!(t.allocations(), 9 + 2);
    assert_eq!(t.frees(), 4 + 2);
    assert_eq!(t.bytes_allocated(), 1050);
}

#[test]
fn stacks_only_of_leaves_those_another_process_holds() {
    let mut s = Snapshot::default();
    for key in [
        (1, 5, 0),
        (1, 6, 0),
        (1, 6, 2),
        (1, -12, 0),
        (2, 6, 0),
        (3, 7, 0),
        (3, 8, 0),
    ] {
        s.sites.insert(key, SiteTotals::default());
    }
    let pids = |p: &[u32]| p.iter().copied().collect();
    let none = Default::default;
    assert_eq!(s.stacks_only_of(&pids(&[1]), none()), [5]);
    assert_eq!(s.stacks_only_of(&pids(&[1, 2]), none()), [5, 6]);
    assert_eq!(s.stacks_only_of(&pids(&[3]), none()), [7, 8]);
    assert!(s.stacks_only_of(&pids(&[4]), none()).is_empty());
    // Stacks of sites dropped at an exec: freed unless a site here holds them.
    let dropped = [6, 9].into_iter().collect();
    assert_eq!(s.stacks_only_of(&pids(&[]), dropped), [9]);
    let dropped = [6, 9].into_iter().collect();
    assert_eq!(s.stacks_only_of(&pids(&[2]), dropped), [9]);
}

#[test]
fn the_peaks_composition_keeps_blocks_of_zero_bytes() {
    let mut snap = Snapshot::default();
    let site = |blocks, bytes| SiteTotals {
        live_blocks: blocks,
        live_bytes: bytes,
        ..SiteTotals::default()
    };
    snap.sites.insert((7, 1, 0), site(3, 300));
    snap.sites.insert((7, 2, 0), site(4, 0)); // malloc(0), held
    snap.sites.insert((7, 3, 0), site(0, 0)); // all freed
    snap.peaks.insert(
        7,
        KernelPeak {
            bytes: 300,
            ..KernelPeak::default()
        },
    );
    snap.compose_peaks(&crate::drain::FastMap::from_iter([(7, (1, true, 7))]));
    let held = &snap.peak_held[&7];
    assert_eq!(held.sites, [(1, 0, 3, 300), (2, 0, 4, 0)]);
    let blocks: i64 = held.sites.iter().map(|s| s.2).sum();
    assert_eq!(blocks as u64, held.blocks);
}
