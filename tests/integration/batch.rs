//! Batched deletes (`heaptrace::bpf::batch`) on a hash map of the loaded programs: the kernel
//! stops a batch at the first key it does not find, and the caller is told which those were.
use std::os::fd::AsFd as _;

use aya::maps::HashMap;
use heaptrace::{bpf::batch, probe};
use heaptrace_common::{SizeKey, maps};

use crate::support::bpf_test;

bpf_test!(
    /// Stack ids 0..10,000, the odd ones held: a delete of all of them, across batches of
    /// 4,096, reports exactly the even ones absent and leaves none of the odd ones.
    fn batch_deletes_report_the_keys_that_were_not_there() {
        let opts = probe::LoadOptions {
            stack_map_size: 16384,
            ..Default::default()
        };
        let mut ebpf = probe::load(&opts).unwrap().ebpf;
        let fd = match ebpf.map(maps::STACK_OWNERS) {
            Some(aya::maps::Map::HashMap(data)) => data.fd().as_fd().try_clone_to_owned().unwrap(),
            _ => panic!("STACK_OWNERS is a hash map"),
        };
        let mut owners: HashMap<_, u32, u64> =
            HashMap::try_from(ebpf.map_mut(maps::STACK_OWNERS).unwrap()).unwrap();
        for id in (1..10_000u32).step_by(2) {
            owners.insert(id, u64::from(id) * 3, 0).unwrap();
        }
        let keys: Vec<u32> = (0..10_000).collect();
        let mut absent = Vec::new();
        batch::delete_each(fd.as_fd(), &keys, |i| absent.push(keys[i])).unwrap();
        let evens: Vec<u32> = (0..10_000).step_by(2).collect();
        assert_eq!(absent, evens);
        assert_eq!(owners.keys().count(), 0, "every held id deleted");
        // Nothing there at all: each key reported, none twice.
        let mut again = 0;
        batch::delete_each(fd.as_fd(), &keys[..100], |_| again += 1).unwrap();
        assert_eq!(again, 100);
    }
);

bpf_test!(
    /// 5,000 sizes in the per-CPU size map, read whole twice (the second time into the
    /// buffers the first left), and read again from inside a read's visit: every read sees
    /// every entry once, with its values on every CPU.
    fn batch_reads_see_every_entry_again_and_within_a_read() {
        // The defaults: stacks mode, whose size map is keyed by stack.
        let mut ebpf = probe::load(&probe::LoadOptions::default()).unwrap().ebpf;
        let fd = match ebpf.map(maps::SIZES) {
            Some(aya::maps::Map::PerCpuHashMap(data)) => {
                data.fd().as_fd().try_clone_to_owned().unwrap()
            }
            _ => panic!("SIZES is a per-CPU hash map"),
        };
        let cpus = aya::util::nr_cpus().unwrap();
        let mut sizes: aya::maps::PerCpuHashMap<_, SizeKey, u64> =
            aya::maps::PerCpuHashMap::try_from(ebpf.map_mut(maps::SIZES).unwrap()).unwrap();
        let key = |i: u64| SizeKey {
            tgid: 77,
            func: 0,
            round: 0,
            size: i,
            stack_id: 1,
            epoch: 1,
        };
        for i in 0..5_000u64 {
            let values = aya::maps::PerCpuValues::try_from(vec![i; cpus]).unwrap();
            sizes.insert(key(i), values, 0).unwrap();
        }
        let read = || {
            let mut seen = std::collections::BTreeMap::new();
            batch::per_cpu_hash::<SizeKey, u64>(fd.as_fd(), cpus, |k, v| {
                assert!(v.iter().all(|x| *x == k.size), "{k:?} {v:?}");
                assert!(seen.insert(k.size, v.len()).is_none(), "{k:?} twice");
            })
            .unwrap();
            seen
        };
        let whole: std::collections::BTreeMap<u64, usize> = (0..5_000).map(|i| (i, cpus)).collect();
        assert_eq!(read(), whole);
        assert_eq!(read(), whole);
        let mut outer = 0;
        batch::per_cpu_hash::<SizeKey, u64>(fd.as_fd(), cpus, |_, _| {
            if outer == 0 {
                assert_eq!(read(), whole);
            }
            outer += 1;
        })
        .unwrap();
        assert_eq!(outer, 5_000);
    }
);
