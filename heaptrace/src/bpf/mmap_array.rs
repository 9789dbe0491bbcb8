//! A kernel array map created mappable (BPF_F_MMAPABLE), mapped into user space: the slot
//! arrays the programs claim with compare-and-swap (`liveslots`, the in-flight slots), which
//! user space reads and frees in place, with atomics, while the programs run.
use std::{
    marker::PhantomData,
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd},
    ptr::NonNull,
    sync::atomic::AtomicU64,
};

use aya::Ebpf;

use crate::error::{Error, Result};

pub struct MappedArray<T> {
    base: NonNull<T>,
    len: usize,
    bytes: usize,
    map: &'static str,
    _of: PhantomData<T>,
}

// SAFETY: shared memory that the kernel also writes; every access goes through atomics or
// volatile reads, whichever thread makes it.
unsafe impl<T> Send for MappedArray<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for MappedArray<T> {}

impl<T: Copy> MappedArray<T> {
    /// Maps the loaded object's array `map`, whose elements are `T`s.
    pub fn map(ebpf: &Ebpf, map: &'static str) -> Result<MappedArray<T>> {
        let err = |reason: String| Error::Map { map, reason };
        let Some(aya::maps::Map::Array(data)) = ebpf.map(map) else {
            return Err(err("not an array in the object".into()));
        };
        let len = data.info().map_err(|e| err(e.to_string()))?.max_entries() as usize;
        Self::map_fd(data.fd().as_fd(), len, map)
    }

    /// Maps the array map `fd` of `len` elements (created mappable), named `map` in errors.
    pub fn map_fd(fd: BorrowedFd<'_>, len: usize, map: &'static str) -> Result<MappedArray<T>> {
        let err = |reason: String| Error::Map { map, reason };
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let bytes = (len * size_of::<T>()).div_ceil(page) * page;
        // SAFETY: a shared mapping of the map's fd, no larger than the array rounded up to a
        // page; it stays valid after the fd is closed, until munmap.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(err(std::io::Error::last_os_error().to_string()));
        }
        Ok(MappedArray {
            base: NonNull::new(p.cast()).ok_or_else(|| err("mapped at null".into()))?,
            len,
            bytes,
            map,
            _of: PhantomData,
        })
    }

    /// Elements in ordinary memory, as a stand-in for the kernel's array in tests; never
    /// unmapped (the caller keeps `elems` alive and leaks the value or drops it first).
    #[cfg(test)]
    pub fn over(elems: &mut [T]) -> std::mem::ManuallyDrop<MappedArray<T>> {
        std::mem::ManuallyDrop::new(MappedArray {
            base: NonNull::new(elems.as_mut_ptr()).unwrap(),
            len: elems.len(),
            bytes: 0,
            map: "test",
            _of: PhantomData,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Element `i`, read whole; the kernel may be writing it (the caller checks what it read).
    pub fn read(&self, i: usize) -> T {
        assert!(i < self.len, "{}: element {i} of {}", self.map, self.len);
        // SAFETY: i < len; a volatile read of plain integers.
        unsafe { self.base.as_ptr().add(i).read_volatile() }
    }

    /// Writes element `i` whole, for a slot no program writes while user space holds it busy.
    pub fn write(&self, i: usize, v: T) {
        assert!(i < self.len, "{}: element {i} of {}", self.map, self.len);
        // SAFETY: i < len; a volatile write of plain integers.
        unsafe { self.base.as_ptr().add(i).write_volatile(v) }
    }

    /// The u64 at the start of element `i` (a slot's state or owner), for atomic access.
    pub fn first_word(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.len, "{}: element {i} of {}", self.map, self.len);
        const { assert!(size_of::<T>() >= 8 && align_of::<T>() >= 8) };
        // SAFETY: i < len; an element begins 8-aligned with a u64 (asserted above).
        unsafe { AtomicU64::from_ptr(self.base.as_ptr().add(i).cast()) }
    }
}

impl<T: Copy> MappedArray<T> {
    /// Element `i` as words, for atomic access to its fields; for elements of whole u64s.
    pub fn first_words(&self, i: usize) -> &[AtomicU64] {
        assert!(i < self.len, "{}: element {i} of {}", self.map, self.len);
        const { assert!(size_of::<T>().is_multiple_of(8) && align_of::<T>() >= 8) };
        // SAFETY: i < len; an element is 8-aligned whole u64s (asserted above).
        unsafe {
            std::slice::from_raw_parts(
                self.base.as_ptr().add(i).cast::<AtomicU64>(),
                size_of::<T>() / 8,
            )
        }
    }
}

impl<T> Drop for MappedArray<T> {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.bytes) };
    }
}
