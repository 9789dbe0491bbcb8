//! Reading a whole hash map with BPF_MAP_LOOKUP_BATCH (kernel >= 5.6), and deleting many keys
//! with BPF_MAP_DELETE_BATCH: a few system calls for the map instead of two per entry (next
//! key, then lookup) or one per key, which is what aya 0.14's iterators and `remove` do. With
//! 10,000 sites that was most of the daemon's CPU time; with processes coming and going, the
//! walks and deletes of their entries were.
use std::{
    cell::Cell,
    os::fd::{AsRawFd as _, BorrowedFd},
};

use aya::Pod;
use aya_obj::generated::{
    bpf_attr,
    bpf_cmd::{BPF_MAP_DELETE_BATCH, BPF_MAP_LOOKUP_BATCH, BPF_MAP_UPDATE_BATCH},
};

use crate::bpf::sys::bpf;

/// Entries asked for per call. A call fails with ENOSPC only if one hash bucket holds more
/// entries than this, which a hash map's spread makes practically impossible.
const CHUNK: usize = 4096;

/// Bytes of keys and values a batch read asks for at once (at least one entry).
const CHUNK_BYTES: usize = 1 << 20;

thread_local! {
    /// `per_cpu_hash`'s buffers (8-byte words: keys, values), kept between reads: made anew
    /// for each, megabytes were zeroed and faulted in again every round.
    static BUFFERS: Cell<(Vec<u64>, Vec<u64>)> = const { Cell::new((Vec::new(), Vec::new())) };
}

/// Reads every entry of the per-CPU hash map `fd` (keys `K`, values `V`) on `cpus` possible
/// CPUs, handing each key and its per-CPU values to `visit`. The kernel copies each bucket
/// whole, so an entry is seen once even while the probes add and remove others; an entry added
/// during the read may be missed, and is read next time.
///
/// Entries are read a chunk at a time (about [`CHUNK_BYTES`]) into buffers reused from read to
/// read: a map of 10,000 sites holds 4 MB of per-CPU values on 2 CPUs, which a read of the
/// whole map would copy at once.
pub fn per_cpu_hash<K: Pod, V: Pod>(
    fd: BorrowedFd<'_>,
    cpus: usize,
    visit: impl FnMut(&K, &[V]),
) -> std::io::Result<()> {
    // Taken, not borrowed: a `visit` that reads another map gets buffers of its own.
    let (mut keys, mut values) = BUFFERS.take();
    let result = read_chunks(fd, cpus, visit, &mut keys, &mut values);
    BUFFERS.set((keys, values));
    result
}

fn read_chunks<K: Pod, V: Pod>(
    fd: BorrowedFd<'_>,
    cpus: usize,
    mut visit: impl FnMut(&K, &[V]),
    key_words: &mut Vec<u64>,
    value_words: &mut Vec<u64>,
) -> std::io::Result<()> {
    // The kernel lays a key's per-CPU values out 8-byte aligned; every value type heaptrace
    // shares with the kernel is a multiple of 8 bytes, so a [V] slice matches that layout.
    assert!(
        std::mem::size_of::<V>().is_multiple_of(8),
        "per-CPU value size must be a multiple of 8"
    );
    assert!(std::mem::align_of::<K>() <= 8 && std::mem::align_of::<V>() <= 8);
    let cpus = cpus.max(1);
    let entry = std::mem::size_of::<K>() + std::mem::size_of::<V>() * cpus;
    // The batch position: a bucket index for hash maps (a u32), opaque to user space.
    let mut token_in = [0u64; 1];
    let mut token_out = [0u64; 1];
    let mut first = true;
    let mut chunk = (CHUNK_BYTES / entry.max(1)).clamp(1, CHUNK);
    loop {
        grow(key_words, chunk * std::mem::size_of::<K>());
        grow(value_words, chunk * cpus * std::mem::size_of::<V>());
        // SAFETY: bpf_attr is plain data; all zeroes is its "unset" value.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: writing the batch member of a zeroed union; the buffers hold `chunk`
        // entries, and outlive the call.
        unsafe {
            let b = &mut attr.batch;
            b.in_batch = if first { 0 } else { token_in.as_ptr() as u64 };
            b.out_batch = token_out.as_mut_ptr() as u64;
            b.keys = key_words.as_mut_ptr() as u64;
            b.values = value_words.as_mut_ptr() as u64;
            b.count = chunk as u32;
            b.map_fd = fd.as_raw_fd() as u32;
        }
        let result = bpf(BPF_MAP_LOOKUP_BATCH as u32, &mut attr);
        // SAFETY: the kernel wrote back how many entries it copied.
        let got = (unsafe { attr.batch.count } as usize).min(chunk);
        // SAFETY: the buffers are 8-byte aligned (no K or V needs more) and hold `chunk`
        // keys and `chunk * cpus` values, initialized words; K and V are plain data, valid
        // for any bytes, and the kernel wrote the first `got` entries of this batch.
        let (keys, values) = unsafe {
            (
                std::slice::from_raw_parts(key_words.as_ptr().cast::<K>(), got),
                std::slice::from_raw_parts(value_words.as_ptr().cast::<V>(), got * cpus),
            )
        };
        for (k, v) in keys.iter().zip(values.chunks_exact(cpus)) {
            visit(k, v);
        }
        match result {
            Ok(_) => {
                token_in = token_out;
                first = false;
            }
            // The end of the map (its last entries came with it).
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break,
            // One bucket holds more than `chunk` entries: ask for more at once.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && got == 0 => chunk *= 2,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `words` holding at least `bytes` (zeroed when it grows, so every word is initialized).
fn grow(words: &mut Vec<u64>, bytes: usize) {
    let n = bytes.div_ceil(8);
    if words.len() < n {
        words.resize(n, 0);
    }
}

/// Deletes `keys` from the hash map `fd` with BPF_MAP_DELETE_BATCH: a system call for many
/// keys instead of one each. A key gone already is skipped (the kernel stops at it).
pub fn delete<K: Pod>(fd: BorrowedFd<'_>, keys: &[K]) -> std::io::Result<()> {
    delete_each(fd, keys, |_| {})
}

/// `delete`, telling `absent` the index of each key that was not in the map: the kernel
/// deletes a batch's keys in order and stops at the first it does not find, so every key
/// before it went.
pub fn delete_each<K: Pod>(
    fd: BorrowedFd<'_>,
    keys: &[K],
    mut absent: impl FnMut(usize),
) -> std::io::Result<()> {
    let mut at = 0;
    while at < keys.len() {
        let n = (keys.len() - at).min(CHUNK);
        // SAFETY: bpf_attr is plain data; all zeroes is its "unset" value.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: writing the batch member of a zeroed union; `keys[at..at + n]` outlives
        // the call, and the kernel only reads it.
        unsafe {
            let b = &mut attr.batch;
            b.keys = keys[at..].as_ptr() as u64;
            b.count = n as u32;
            b.map_fd = fd.as_raw_fd() as u32;
        }
        let result = bpf(BPF_MAP_DELETE_BATCH as u32, &mut attr);
        // SAFETY: the kernel wrote back how many keys it deleted.
        let done = (unsafe { attr.batch.count } as usize).min(n);
        match result {
            Ok(_) => at += n,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                if done < n {
                    absent(at + done);
                }
                at += done + 1;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes `keys` and their values into the hash map `fd` with BPF_MAP_UPDATE_BATCH (`per_key`
/// values a key: 1, or the possible CPUs of a per-CPU map). Returns how many went in: all, or
/// those before the map was full (E2BIG).
pub fn update<K: Pod, V: Pod>(
    fd: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
    per_key: usize,
) -> std::io::Result<usize> {
    assert_eq!(
        keys.len() * per_key,
        values.len(),
        "a value per key (and CPU)"
    );
    let mut at = 0;
    while at < keys.len() {
        let n = (keys.len() - at).min(CHUNK);
        // SAFETY: bpf_attr is plain data; all zeroes is its "unset" value.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: writing the batch member of a zeroed union; the slices outlive the call and
        // the kernel only reads them.
        unsafe {
            let b = &mut attr.batch;
            b.keys = keys[at..].as_ptr() as u64;
            b.values = values[at * per_key..].as_ptr() as u64;
            b.count = n as u32;
            b.map_fd = fd.as_raw_fd() as u32;
        }
        let result = bpf(BPF_MAP_UPDATE_BATCH as u32, &mut attr);
        // SAFETY: the kernel wrote back how many entries it wrote.
        let done = (unsafe { attr.batch.count } as usize).min(n);
        match result {
            Ok(_) => at += n,
            Err(e) if e.raw_os_error() == Some(libc::E2BIG) => return Ok(at + done),
            Err(e) => return Err(e),
        }
    }
    Ok(at)
}
