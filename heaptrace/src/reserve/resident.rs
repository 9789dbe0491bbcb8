//! What of the memory behind malloc is resident, from /proc/PID/smaps: the Rss of the brk heap
//! and of the private anonymous mappings, where every allocator heaptrace meets keeps its
//! arenas and mapped blocks (glibc, jemalloc, tcmalloc, mimalloc), whenever it made them,
//! before the attach too. Read once per process at the end of a trace, not every round: the
//! kernel walks every page table to make the file.
//!
//! An estimate, said so wherever shown: the anonymous mappings are the allocator's and any the
//! program made itself (a JIT's, a Go runtime's, its own mmap'd buffers). Left out: threads'
//! stacks (a writable mapping right above a guard of at most [`GUARD_MAX`] bytes), `[stack]`,
//! the part of an executable's or library's .bss past its file (a mapping starting where a
//! file's ends), shared mappings (a database's buffers) and file mappings.
use std::io::Read as _;

use serde::Serialize;

/// At most this much of a smaps file is read (about 80,000 mappings); past it, the figures are
/// lower bounds and say so.
pub const MAX_SMAPS: u64 = 32 << 20;
/// A PROT_NONE mapping of at most this size right below a writable one is a thread's guard.
pub const GUARD_MAX: u64 = 64 << 10;

/// Resident bytes of one process's heap-like mappings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Resident {
    /// Rss of `[heap]`.
    pub heap_bytes: u64,
    /// Rss of the private anonymous writable mappings left in (see the module's doc).
    pub anonymous_bytes: u64,
    /// Rss of the threads' stacks left out.
    pub stacks_bytes: u64,
    /// The file was longer than [`MAX_SMAPS`]: the figures are lower bounds.
    pub truncated: bool,
}

impl Resident {
    pub fn total(&self) -> u64 {
        self.heap_bytes + self.anonymous_bytes
    }
}

/// Reads `pid`'s smaps; None when it cannot be read (ended, not permitted).
pub fn read(pid: u32) -> Option<Resident> {
    let f =
        std::fs::File::open(format!("{}/smaps", crate::targets::procfs::space_dir(pid))).ok()?;
    let mut text = Vec::new();
    f.take(MAX_SMAPS + 1).read_to_end(&mut text).ok()?;
    let truncated = text.len() as u64 > MAX_SMAPS;
    let mut r = parse(&String::from_utf8_lossy(&text));
    r.truncated = truncated;
    Some(r)
}

/// What one mapping is, as far as the sums go.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Heap,
    Anonymous,
    Stack,
    Other,
}

/// One mapping's header line: (start, end, perms, whether a file or a special name follows).
struct Header<'a> {
    start: u64,
    end: u64,
    perms: &'a str,
    name: &'a str,
}

fn header(line: &str) -> Option<Header<'_>> {
    let mut f = line.splitn(6, ' ');
    let (a, b) = f.next()?.split_once('-')?;
    let perms = f.next()?;
    let (_offset, _dev, _inode) = (f.next()?, f.next()?, f.next()?);
    let start = u64::from_str_radix(a, 16).ok()?;
    let end = u64::from_str_radix(b, 16).ok()?;
    (perms.len() == 4 && start <= end).then(|| Header {
        start,
        end,
        perms,
        name: f.next().unwrap_or("").trim(),
    })
}

/// The sums of a smaps text. Malformed lines are skipped; a mapping whose Rss line is missing
/// counts nothing.
pub fn parse(text: &str) -> Resident {
    let mut r = Resident::default();
    // The previous mapping: its end, whether it was a file's, whether a small PROT_NONE one.
    let mut prev: Option<(u64, bool, bool)> = None;
    let mut kind = Kind::Other;
    for line in text.lines() {
        if let Some(h) = header(line) {
            // Named by prctl(PR_SET_VMA_ANON_NAME) still anonymous: glibc 2.39's
            // `[anon: glibc: malloc arena]`.
            let anon = h.name.is_empty() || h.name.starts_with("[anon:");
            let anon_rw = anon && h.perms.starts_with("rw") && h.perms.ends_with('p');
            kind = match prev {
                _ if h.name == "[heap]" => Kind::Heap,
                _ if !anon_rw => Kind::Other,
                Some((end, true, _)) if end == h.start => Kind::Other, // a file's .bss
                Some((end, _, true)) if end == h.start => Kind::Stack,
                _ => Kind::Anonymous,
            };
            let file = h.name.starts_with('/');
            let guard = h.perms.starts_with("---") && h.name.is_empty();
            prev = Some((h.end, file, guard && h.end - h.start <= GUARD_MAX));
            continue;
        }
        let Some(kb) = line.strip_prefix("Rss:") else {
            continue;
        };
        let Some(kb) = kb
            .trim()
            .strip_suffix("kB")
            .and_then(|v| v.trim().parse::<u64>().ok())
        else {
            continue;
        };
        let bytes = kb.saturating_mul(1024);
        let sum = match kind {
            Kind::Heap => &mut r.heap_bytes,
            Kind::Anonymous => &mut r.anonymous_bytes,
            Kind::Stack => &mut r.stacks_bytes,
            Kind::Other => continue,
        };
        *sum = sum.saturating_add(bytes);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55d0000-55e0000 r-xp 00000000 08:01 12 /usr/bin/prog
Rss:                  64 kB
55e0000-55f0000 rw-p 00010000 08:01 12 /usr/bin/prog
Rss:                   8 kB
55f0000-5600000 rw-p 00000000 00:00 0
Rss:                   4 kB
5600000-5700000 rw-p 00000000 00:00 0 [heap]
Rss:                 100 kB
7000000-7001000 ---p 00000000 00:00 0
Rss:                   0 kB
7001000-7801000 rw-p 00000000 00:00 0
Rss:                  16 kB
8000000-8100000 rw-p 00000000 00:00 0
Rss:                1000 kB
Pss:                1000 kB
8100000-c000000 ---p 00000000 00:00 0
Rss:                   0 kB
c000000-c100000 rw-p 00000000 00:00 0
Rss:                 200 kB
10000000-20000000 rw-s 00000000 00:01 77 /dev/zero (deleted)
Rss:                5000 kB
21000000-21001000 rwxp 00000000 00:00 0
Rss:                   3 kB
22000000-22100000 rw-p 00000000 00:00 0 [anon: glibc: malloc arena]
Rss:                  40 kB
garbage line
7ffff000-7ffff800 rw-p 00000000 00:00 0 [stack]
Rss:                  12 kB
";

    #[test]
    fn sums_the_heap_and_anonymous_mappings_less_stacks_and_bss() {
        let r = parse(SMAPS);
        assert_eq!(r.heap_bytes, 100 << 10);
        // The arena (1000 kB), the mapping above a large PROT_NONE reserve (200 kB: not a
        // guard), the rwx one (3 kB), the named one (40 kB); not the .bss (4 kB), the shared
        // one, the [stack].
        assert_eq!(r.anonymous_bytes, (1000 + 200 + 3 + 40) << 10);
        assert_eq!(r.stacks_bytes, 16 << 10);
        assert_eq!(r.total(), (100 + 1243) << 10);
    }

    #[test]
    fn hostile_text_counts_nothing_and_never_panics() {
        for text in [
            "",
            "zz-yy rw-p 0 0 0\nRss: 5 kB\n",
            "10-5 rw-p 0 0 0\nRss: 5 kB\n",
            "5-10 rw-p 0 0 0\nRss: 99999999999999999999 kB\n",
            "5-10 rw-p 0 0 0\nRss: kB\nRss:\n",
        ] {
            assert_eq!(parse(text).total(), 0, "{text}");
        }
        let r = parse("5-10 rw-p 0 0 0\nRss: 18446744073709551615 kB\nRss: 1 kB\n");
        assert_eq!(r.anonymous_bytes, u64::MAX);
    }

    #[test]
    fn reads_its_own_anonymous_memory() {
        // 64 MiB touched: glibc maps a block this large on its own.
        let v = vec![1u8; 64 << 20];
        let r = read(std::process::id()).unwrap();
        assert!(r.anonymous_bytes >= 64 << 20, "{r:?}");
        assert!(!r.truncated);
        drop(v);
    }
}
