//! Where the target's memory is read from: a running process (`process_vm_readv`) or a core
//! file (`core`). Every byte read is the target's, hence hostile: callers validate it.
use std::cell::RefCell;

/// One mapping of the target's address space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Region {
    pub start: u64,
    pub end: u64,
    pub writable: bool,
    /// The mapped file, if any (`None`: anonymous memory).
    pub file: Option<std::path::PathBuf>,
    /// Offset in that file.
    pub offset: u64,
    /// The kernel's name for a special mapping (`[heap]`, `[stack]`), if any.
    pub special: Option<String>,
}

/// Reads of the target's memory.
pub trait Memory {
    /// Fills `buf` from `addr`; false if any byte of it cannot be read.
    fn read(&self, addr: u64, buf: &mut [u8]) -> bool;

    fn u64_at(&self, addr: u64) -> Option<u64> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b).then(|| u64::from_le_bytes(b))
    }

    /// Forgets what was read before (a running process may have changed it).
    fn refresh(&self) {}
}

/// The memory of a running process, read with `process_vm_readv` through a window cache: a
/// walk reads chunk headers one after another, one system call per window, not per header.
pub struct Live {
    pid: u32,
    window: RefCell<Window>,
}

const WINDOW: u64 = 256 << 10;

#[derive(Default)]
struct Window {
    start: u64,
    /// The bytes read from `start` (fewer than a window where the mapping ends).
    bytes: Vec<u8>,
}

impl Live {
    pub fn new(pid: u32) -> Live {
        Live {
            pid,
            window: RefCell::new(Window::default()),
        }
    }

    /// One `process_vm_readv`; the count of bytes it read (it stops at an unmapped page).
    fn read_raw(&self, addr: u64, buf: &mut [u8]) -> usize {
        let local = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let remote = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: buf.len(),
        };
        // SAFETY: `local` describes `buf`, which we own mutably; the remote side is only read
        // by the kernel, which checks it.
        let n = unsafe { libc::process_vm_readv(self.pid as i32, &local, 1, &remote, 1, 0) };
        n.max(0) as usize
    }
}

impl Memory for Live {
    fn read(&self, addr: u64, buf: &mut [u8]) -> bool {
        let len = buf.len() as u64;
        if len > WINDOW / 2 {
            return self.read_raw(addr, buf) == buf.len();
        }
        let mut w = self.window.borrow_mut();
        let inside = |w: &Window| {
            addr >= w.start
                && addr
                    .checked_add(len)
                    .is_some_and(|e| e <= w.start + w.bytes.len() as u64)
        };
        if !inside(&w) {
            w.start = addr & !0xfff;
            w.bytes.resize(WINDOW as usize, 0);
            let start = w.start;
            let n = self.read_raw(start, &mut w.bytes);
            w.bytes.truncate(n);
            if !inside(&w) {
                return false;
            }
        }
        let at = (addr - w.start) as usize;
        buf.copy_from_slice(&w.bytes[at..at + buf.len()]);
        true
    }

    fn refresh(&self) {
        let mut w = self.window.borrow_mut();
        w.bytes.clear();
    }
}

/// A process's mappings from /proc/PID/maps.
pub fn live_regions(pid: u32) -> std::io::Result<Vec<Region>> {
    let maps = crate::targets::procfs::maps(pid)?;
    Ok(maps.lines().filter_map(parse_maps_line).collect())
}

fn parse_maps_line(line: &str) -> Option<Region> {
    let mut f = line.splitn(6, ' ');
    let (a, b) = f.next()?.split_once('-')?;
    let perms = f.next()?;
    let offset = u64::from_str_radix(f.next()?, 16).ok()?;
    let _dev = f.next()?;
    let inode: u64 = f.next()?.parse().ok()?;
    let name = f.next().unwrap_or("").trim_start();
    let (file, special) = match name {
        "" => (None, None),
        n if n.starts_with('[') => (None, Some(n.to_string())),
        n if inode != 0 && n.starts_with('/') => (Some(n.into()), None),
        _ => (None, None), // a deleted file, a memfd: nothing heaptrace reads as a library
    };
    Some(Region {
        start: u64::from_str_radix(a, 16).ok()?,
        end: u64::from_str_radix(b, 16).ok()?,
        writable: perms.as_bytes().get(1) == Some(&b'w'),
        file,
        offset,
        special,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_its_own_memory_through_the_window() {
        let data: Vec<u64> = (0..100_000u64).collect();
        let live = Live::new(std::process::id());
        let base = data.as_ptr() as u64;
        assert_eq!(live.u64_at(base + 8 * 77_777), Some(77_777));
        assert_eq!(live.u64_at(base + 8 * 5), Some(5));
        let mut big = vec![0u8; 400 << 10];
        assert!(live.read(base, &mut big));
        assert_eq!(big[8], 1);
        assert_eq!(live.u64_at(8), None);
    }

    #[test]
    fn parses_maps_lines() {
        let r = parse_maps_line(
            "7f00-7f10 r--p 00001000 08:01 1234   /usr/lib/x86_64-linux-gnu/libc.so.6",
        )
        .unwrap();
        assert_eq!(
            (r.start, r.end, r.offset, r.writable),
            (0x7f00, 0x7f10, 0x1000, false)
        );
        assert!(r.file.is_some());
        let r = parse_maps_line("5000-6000 rw-p 00000000 00:00 0   [heap]").unwrap();
        assert_eq!(r.special.as_deref(), Some("[heap]"));
        assert!(r.writable && r.file.is_none());
        assert!(parse_maps_line("garbage").is_none());
    }
}
