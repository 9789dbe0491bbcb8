//! The slot tables in the kernel (`heaptrace_common::procs`, `heaptrace_common::keyed`): a
//! process traced alone counts in its slots on every CPU, its process counters, sites and sizes,
//! none of it in the hash maps, and its slots are emptied and freed when it is forgotten.
use std::{
    collections::{BTreeMap, HashSet},
    io::Write as _,
    process::Command,
    time::{Duration, Instant},
};

use heaptrace::{
    drain::KernelMaps,
    drain::keyed_slots::KeyedSlots,
    drain::proc_slots::ProcSlots,
    drain::round::{SiteTotals, Totals},
    probe::{self, Probes, Scope},
    targets::allocator,
};
use heaptrace_common::{Func, SiteCounters, SiteKey, SizeKey, maps};

use crate::{
    expect::{Expected, Fixture},
    support::{bpf_test, fixture, ready},
};

bpf_test!(
    shared,
    fn a_process_traced_alone_counts_in_its_slots() {
        let fx = Fixture::main_thread(500, 3);
        let want = Expected::of(&fx);
        let mut target = ready({
            let mut cmd = Command::new(fixture("allocs", "", &[]));
            cmd.args(["0", "500", "3", "wait", "hold"]);
            cmd
        });
        let pid = target.id();
        let opts = probe::LoadOptions {
            watch_tgid: pid,
            ..Default::default()
        };
        let mut probes = Probes::new(probe::load(&opts).unwrap(), true, false, false).unwrap();
        let provider = allocator::for_pid(pid).unwrap();
        probes
            .attach(&provider, Scope::Process(pid), false)
            .unwrap();
        probes.enable().unwrap();
        let slots = ProcSlots::map(&probes.ebpf).unwrap();
        let site_slots: KeyedSlots<SiteKey, SiteCounters> =
            KeyedSlots::map(&probes.ebpf, maps::SITE_SLOTS).unwrap();
        let size_slots: KeyedSlots<SizeKey, u64> =
            KeyedSlots::map(&probes.ebpf, maps::SIZE_SLOTS).unwrap();
        let mut maps = KernelMaps::take(&mut probes.ebpf).unwrap();

        let mut stdin = target.stdin.take().unwrap();
        stdin.write_all(b"g").unwrap();
        // `ready` took stdout, and with it the fixture's "done": wait for its last call instead.
        let deadline = Instant::now() + Duration::from_secs(20);
        // Waited for in the process slots, not with snapshots: a snapshot moves the round on,
        // and the next one retires the keys of the round before from their slots.
        loop {
            let owned = slots.owned();
            let frees =
                Totals::from_per_cpu(owned.iter().filter(|(t, _)| *t == pid).map(|(_, c)| c)).funcs
                    [Func::Free as usize]
                    .calls;
            if frees >= want.free_calls || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let snap = maps.snapshot().unwrap();
        let owned = slots.owned();
        let in_slots =
            Totals::from_per_cpu(owned.iter().filter(|(t, _)| *t == pid).map(|(_, c)| c));
        // Every count the process made is in its slots: the process map holds none of it.
        assert_eq!(snap.procs[&pid].totals, in_slots);
        for f in Func::ALL {
            let got = &in_slots.funcs[f as usize];
            // Aliases (memalign is aligned_alloc here) are counted under one name.
            let w = want
                .funcs
                .get(f.name())
                .map_or((0, 0, 0), |w| (w.calls, w.bytes, w.failed));
            if f != Func::Free {
                assert_eq!((got.calls, got.bytes, got.failed), w, "{f:?}");
            }
        }
        assert_eq!(in_slots.funcs[Func::Free as usize].calls, want.free_calls);
        assert_eq!(in_slots.live_blocks, want.live_blocks as i64);

        // Its sites and sizes too, but for a key whose slot another of its keys took first (a
        // slot is picked by the key's hash, and the stack ids change with every run's addresses:
        // one run in about fifty had two of the dozen sizes share a slot, and sites have a quarter
        // of the room). Such a key counts in the
        // map, and in no slot of a row where the other holds it.
        let mut by_site: BTreeMap<_, Vec<SiteCounters>> = BTreeMap::new();
        for (k, c) in site_slots.held() {
            by_site
                .entry((k.tgid, k.stack_id, u32::from(k.func)))
                .or_default()
                .push(c);
        }
        let sites: BTreeMap<_, _> = by_site
            .iter()
            .map(|(k, c)| (*k, SiteTotals::from_per_cpu(c)))
            .collect();
        // Less the size classes the snapshot folds into its sites from the sizes.
        let mut all_sites = snap.sites.clone();
        for s in all_sites.values_mut() {
            s.sizes = Default::default();
        }
        all_in_slots_but_a_collision(&all_sites, &sites, |all, slots| all.calls >= slots.calls);
        let mut sizes = BTreeMap::new();
        for (k, n) in size_slots.held() {
            *sizes
                .entry((k.tgid, u32::from(k.func), k.size, k.stack_id))
                .or_insert(0u64) += n;
        }
        all_in_slots_but_a_collision(&snap.sizes, &sizes, |all, slots| all >= slots);

        // Its "done" went to a closed pipe (SIGPIPE): the process is gone either way.
        drop(stdin);
        target.wait().unwrap();
        maps.forget(&HashSet::from([pid])).unwrap();
        assert!(slots.owned().is_empty(), "{:?}", slots.owned());
        assert!(site_slots.held().is_empty());
        assert!(size_slots.held().is_empty());
        assert!(!maps.snapshot().unwrap().procs.contains_key(&pid));
    }
);

/// Every key of `all` (a dozen here) is in the slots with all its counts, but for at most four
/// (two collisions: each key of a pair may win the slot in one CPU's row and not the other's);
/// a key in the slots is one of `all`, with no more than its total.
fn all_in_slots_but_a_collision<K: Ord + std::fmt::Debug, T: PartialEq + std::fmt::Debug>(
    all: &BTreeMap<K, T>,
    in_slots: &BTreeMap<K, T>,
    within: impl Fn(&T, &T) -> bool,
) {
    assert!(all.len() >= 8, "{all:?}");
    for (k, v) in in_slots {
        let total = all.get(k).unwrap_or_else(|| panic!("{k:?} in a slot only"));
        assert!(within(total, v), "{k:?}: {v:?} in slots, {total:?} in all");
    }
    let whole = all
        .iter()
        .filter(|(k, v)| in_slots.get(k) == Some(v))
        .count();
    assert!(whole + 4 >= all.len(), "{in_slots:?}\nagainst\n{all:?}");
}
