//! Reading a whole per-CPU hash map with BPF_MAP_LOOKUP_BATCH (kernel >= 5.6): a few system
//! calls for the map instead of two per entry (next key, then lookup), which is what aya 0.14's
//! iterators do. With 10,000 sites that was most of the daemon's CPU time.
use std::os::fd::{AsRawFd as _, BorrowedFd};

use aya::Pod;
use aya_obj::generated::{bpf_attr, bpf_cmd::BPF_MAP_LOOKUP_BATCH};

use crate::bpfsys::bpf;

/// Entries asked for per call. A call fails with ENOSPC only if one hash bucket holds more
/// entries than this, which a hash map's spread makes practically impossible.
const CHUNK: usize = 4096;

/// One read of a per-CPU hash map: keys, and for each key its value on every possible CPU.
pub struct PerCpuEntries<K, V> {
    keys: Vec<K>,
    values: Vec<V>,
    cpus: usize,
}

impl<K: Pod, V: Pod> PerCpuEntries<K, V> {
    pub fn iter(&self) -> impl Iterator<Item = (&K, &[V])> {
        self.keys.iter().zip(self.values.chunks_exact(self.cpus))
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

fn zeroed<T: Pod>() -> T {
    // SAFETY: Pod types are plain data, valid for any bit pattern, zeroes included.
    unsafe { std::mem::zeroed() }
}

/// Reads every entry of the per-CPU hash map `fd` (keys `K`, values `V`) on `cpus` possible
/// CPUs. The kernel copies each bucket whole, so an entry is seen once even while the probes
/// add and remove others; an entry added during the read may be missed, and is read next time.
pub fn per_cpu_hash<K: Pod, V: Pod>(
    fd: BorrowedFd<'_>,
    cpus: usize,
) -> std::io::Result<PerCpuEntries<K, V>> {
    // The kernel lays a key's per-CPU values out 8-byte aligned; every value type heaptrace
    // shares with the kernel is a multiple of 8 bytes, so a [V] slice matches that layout.
    assert!(
        std::mem::size_of::<V>().is_multiple_of(8),
        "per-CPU value size must be a multiple of 8"
    );
    let cpus = cpus.max(1);
    let mut keys: Vec<K> = Vec::new();
    let mut values: Vec<V> = Vec::new();
    // The batch position: a bucket index for hash maps (a u32), opaque to user space.
    let mut token_in = [0u64; 1];
    let mut token_out = [0u64; 1];
    let mut first = true;
    let mut chunk = CHUNK;
    loop {
        let have = keys.len();
        keys.resize_with(have + chunk, zeroed);
        values.resize_with((have + chunk) * cpus, zeroed);
        // SAFETY: bpf_attr is plain data; all zeroes is its "unset" value.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: writing the batch member of a zeroed union; the buffers hold `chunk` more
        // entries past `have`, and outlive the call.
        unsafe {
            let b = &mut attr.batch;
            b.in_batch = if first { 0 } else { token_in.as_ptr() as u64 };
            b.out_batch = token_out.as_mut_ptr() as u64;
            b.keys = keys.as_mut_ptr().add(have) as u64;
            b.values = values.as_mut_ptr().add(have * cpus) as u64;
            b.count = chunk as u32;
            b.map_fd = fd.as_raw_fd() as u32;
        }
        let result = bpf(BPF_MAP_LOOKUP_BATCH as u32, &mut attr);
        // SAFETY: the kernel wrote back how many entries it copied.
        let got = unsafe { attr.batch.count } as usize;
        keys.truncate(have + got);
        values.truncate((have + got) * cpus);
        match result {
            Ok(_) => {
                token_in = token_out;
                first = false;
                chunk = CHUNK;
            }
            // The end of the map.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break,
            // One bucket holds more than `chunk` entries: ask for more at once.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && got == 0 => chunk *= 2,
            Err(e) => return Err(e),
        }
    }
    Ok(PerCpuEntries { keys, values, cpus })
}
