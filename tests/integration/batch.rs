//! Batched deletes (`heaptrace::bpf::batch`) on a hash map of the loaded programs: the kernel
//! stops a batch at the first key it does not find, and the caller is told which those were.
use std::os::fd::AsFd as _;

use aya::maps::HashMap;
use heaptrace::{bpf::batch, probe};
use heaptrace_common::maps;

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
