//! The live slots (`heaptrace_common::live`) in the kernel's own array: what the programs
//! write there, user space reads through its mapping and empties for the processes gone.
use aya::maps::Array;
use heaptrace::{drain::live_slots::LiveSlots, probe};
use heaptrace_common::{
    LiveBlock, LiveKey,
    live::{LiveSlot, index, state},
    maps,
};

use crate::support::bpf_test;

fn slot(tgid: u32, ptr: u64, size: u64) -> LiveSlot {
    let key = LiveKey {
        tgid,
        epoch: 1,
        ptr,
    };
    LiveSlot {
        state: state(&key),
        key,
        block: LiveBlock {
            size,
            ts_ns: 1,
            tid: tgid,
            func: 0,
            stack_id: 7,
            seq: 0,
        },
    }
}

bpf_test!(
    /// `--live-map-size 1024` gives 64 slots. Blocks put in their slots as the programs put them
    /// are read back whole through the mapping, and emptying one process's leaves the other's.
    fn live_slots_are_read_and_emptied_through_the_kernels_array() {
        let opts = probe::LoadOptions {
            live_map_size: 1024,
            ..Default::default()
        };
        let mut ebpf = probe::load(&opts).unwrap().ebpf;
        let slots = LiveSlots::map(&ebpf).unwrap();
        assert_eq!(slots.len(), 64);
        let mask = slots.len() as u32 - 1;
        // Blocks of two processes, each in its own slot (keys whose slots collide are skipped,
        // as the programs would put them in the hash map).
        let mut put = Vec::new();
        {
            let mut array: Array<_, LiveSlot> =
                Array::try_from(ebpf.map_mut(maps::LIVE_SLOTS).unwrap()).unwrap();
            let mut used = std::collections::HashSet::new();
            for i in 0..40u64 {
                let s = slot(100 + (i % 2) as u32, 0x5555_0000_0000 + 32 * i, 16 + i);
                let at = index(&s.key, mask);
                if used.insert(at) {
                    array.set(at, s, 0).unwrap();
                    put.push(s);
                }
            }
        }
        assert!(put.len() > 20, "{} slots used", put.len());
        let of = |tgid: u32| -> Vec<(LiveKey, LiveBlock)> {
            let mut v: Vec<_> = put
                .iter()
                .filter(|s| s.key.tgid == tgid)
                .map(|s| (s.key, s.block))
                .collect();
            v.sort_by_key(|(k, _)| k.ptr);
            v
        };
        let read = |tgid: u32| -> Vec<(LiveKey, LiveBlock)> {
            let mut v: Vec<_> = slots
                .held_where(|k| k.tgid == tgid)
                .into_iter()
                .map(|h| (h.key, h.block))
                .collect();
            v.sort_by_key(|(k, _)| k.ptr);
            v
        };
        assert_eq!(read(100), of(100));
        assert_eq!(read(101), of(101));
        slots.empty(&slots.held_where(|k| k.tgid == 100));
        assert!(read(100).is_empty());
        assert_eq!(read(101), of(101), "the other process's blocks stay");
    }
);
