//! The unwind area of an in-process region (`heaptrace_common::inproc::UnwindHead`, then its
//! rows), as a [`Store`]: the preloaded library's walker reads it in the target while the
//! daemon writes it. The one process's entry is written under the area's seqlock.
use std::{
    os::fd::{AsRawFd as _, BorrowedFd},
    ptr::NonNull,
    sync::atomic::{AtomicU64, Ordering, fence},
};

use heaptrace_common::{
    inproc::{Layout, UnwindHead},
    unwind::{ProcModules, Row},
};

use super::loaded::Store;
use crate::error::{Error, Result};

pub struct RegionStore {
    base: NonNull<u8>,
    len: usize,
    /// The head's and the rows' offsets in the mapping.
    rows_at: usize,
    rows: u32,
    /// The process the region counts: entries of others are not its to hold.
    pid: u32,
}

// SAFETY: a shared mapping written by this one owner; the target only reads the area.
unsafe impl Send for RegionStore {}

impl RegionStore {
    /// Maps the unwind area of the region `fd` laid out as `layout`, for process `pid`;
    /// None where the layout has no area.
    pub fn map(fd: BorrowedFd<'_>, layout: &Layout, pid: u32) -> Result<Option<RegionStore>> {
        if layout.unwind_rows == 0 {
            return Ok(None);
        }
        let len = layout.bytes - layout.unwind;
        // SAFETY: a new shared mapping of the region's file, within its size, at a page offset.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                layout.unwind as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(Error::Io(std::io::Error::new(
                e.kind(),
                format!("mapping the unwind area: {e}"),
            )));
        }
        Ok(Some(RegionStore {
            base: NonNull::new(p.cast()).expect("mmap returned null"),
            len,
            rows_at: layout.rows - layout.unwind,
            rows: layout.unwind_rows as u32,
            pid,
        }))
    }

    fn head(&self) -> *mut UnwindHead {
        self.base.as_ptr().cast()
    }

    fn generation(&self) -> &AtomicU64 {
        // SAFETY: the head's first word, aligned, in the mapping as long as self.
        unsafe { AtomicU64::from_ptr(&raw mut (*self.head()).generation) }
    }

    /// Writes the entry under the seqlock: odd while it changes.
    fn publish(&mut self, entry: &ProcModules) {
        let g = self.generation();
        let before = g.load(Ordering::Relaxed);
        g.store(before | 1, Ordering::Relaxed);
        // The odd word is seen before any byte of the entry changes.
        fence(Ordering::Release);
        // SAFETY: the head's modules, in the mapping; volatile: another process reads them.
        unsafe { std::ptr::write_volatile(&raw mut (*self.head()).modules, *entry) };
        // Wrapping: the target can write the word (it only spoils its own walks).
        g.store((before | 1).wrapping_add(1), Ordering::Release);
    }
}

impl Store for RegionStore {
    fn capacity(&self) -> u32 {
        self.rows
    }

    fn write_rows(&mut self, first: u32, rows: &[Row]) -> bool {
        let end = first as usize + rows.len();
        assert!(end <= self.rows as usize, "rows past the unwind area");
        // SAFETY: rows [first, end) of the area, which no published entry points at (the
        // table's space hands out free ranges only).
        unsafe {
            let at = self.base.as_ptr().add(self.rows_at).cast::<Row>();
            std::ptr::copy_nonoverlapping(rows.as_ptr(), at.add(first as usize), rows.len());
        }
        // Published (by the entry's generation, a release store) after these.
        true
    }

    fn set_entry(&mut self, pid: u32, entry: &ProcModules) {
        if pid == self.pid {
            self.publish(entry);
        }
    }

    fn remove_entry(&mut self, pid: u32) {
        if pid == self.pid {
            self.publish(&ProcModules::default());
        }
    }
}

impl Drop for RegionStore {
    fn drop(&mut self) {
        // SAFETY: the mapping made by `map`, no longer used.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use heaptrace_common::unwind::Module;

    use super::*;

    #[test]
    fn entries_are_published_under_an_even_generation_rows_in_place() {
        let layout = Layout::of(1, 16, 32, 64, 64, 0, 8)
            .unwrap()
            .with_unwind(100, 1)
            .unwrap();
        // SAFETY: a name.
        let fd = unsafe { libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a new descriptor, ours.
        let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.set_len(layout.bytes as u64).unwrap();
        use std::os::fd::AsFd as _;
        let mut s = RegionStore::map(file.as_fd(), &layout, 7).unwrap().unwrap();
        assert_eq!(s.capacity(), 100);
        let row = Row {
            pc: 0x1234,
            cfa: 2,
            kind: 1,
            rbp: 0,
        };
        s.write_rows(98, &[row, row]);
        let mut entry = ProcModules {
            count: 1,
            ..ProcModules::default()
        };
        entry.modules[0] = Module {
            start: 0x1000,
            end: 0x2000,
            rows: 2,
            first: 98,
            ..Module::default()
        };
        s.set_entry(8, &entry); // not the region's process
        assert_eq!(s.generation().load(Ordering::Relaxed), 0);
        s.set_entry(7, &entry);
        assert_eq!(s.generation().load(Ordering::Relaxed), 2);
        // What the target sees, through the file.
        use std::os::unix::fs::FileExt as _;
        let mut buf = vec![0u8; 8];
        file.read_exact_at(&mut buf, (layout.rows + 98 * 8) as u64)
            .unwrap();
        assert_eq!(buf, [0x34, 0x12, 0, 0, 2, 0, 1, 0]);
        let count_at = layout.unwind + 16;
        file.read_exact_at(&mut buf[..4], count_at as u64).unwrap();
        assert_eq!(buf[..4], [1, 0, 0, 0]);
        s.remove_entry(7);
        assert_eq!(s.generation().load(Ordering::Relaxed), 4);
        file.read_exact_at(&mut buf[..4], count_at as u64).unwrap();
        assert_eq!(buf[..4], [0, 0, 0, 0]);
        // The target can write the word: its highest value wraps, never panics.
        s.generation().store(u64::MAX, Ordering::Relaxed);
        s.set_entry(7, &entry);
        assert_eq!(s.generation().load(Ordering::Relaxed), 0);
    }
}
