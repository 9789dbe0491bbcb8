//! glibc's malloc structures by version: the offsets a walk reads. Only layouts checked
//! against a glibc's debug symbols (`gdb ptype /o`) are here; any other version is refused,
//! never guessed.

/// The structures of one glibc version (x86-64).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub version: (u32, u32),
    /// `struct malloc_state`: its size and fields.
    pub arena_size: u64,
    /// The arena's lock (an int), held by a thread inside malloc.
    pub mutex: u64,
    pub fastbins: u64,
    pub nfastbins: u64,
    pub top: u64,
    /// `bins[254]`: the fd/bk pair of bin i (1: unsorted) at `bins + (i - 1) * 16`.
    pub bins: u64,
    pub nbins: u64,
    pub next: u64,
    pub system_mem: u64,
    /// `struct _heap_info`: size, `ar_ptr`, `prev`, `size`.
    pub heap_info_size: u64,
    pub heap_ar_ptr: u64,
    pub heap_prev: u64,
    pub heap_size: u64,
    pub heap_max: u64,
    /// `struct tcache_perthread_struct`: `counts[bins]` (u16), `entries[bins]`.
    pub tcache_bins: u64,
    pub tcache_entries: u64,
    pub tcache_size: u64,
    /// `struct malloc_par mp_`: its size and fields.
    pub mp_size: u64,
    pub mp_n_mmaps: u64,
    pub mp_mmapped_mem: u64,
    pub mp_sbrk_base: u64,
    pub mp_tcache_bins: u64,
    pub mp_tcache_count: u64,
    /// tcache `next` and fastbin `fd` are stored as `(field address >> 12) ^ pointer`.
    pub safe_linking: bool,
}

/// glibc 2.36, checked with libc6-dbg 2.36-9+deb12u14 (docs/heap-census.md).
const GLIBC_2_36: Layout = Layout {
    version: (2, 36),
    arena_size: 2200,
    mutex: 0,
    fastbins: 16,
    nfastbins: 10,
    top: 96,
    bins: 112,
    nbins: 128,
    next: 2160,
    system_mem: 2184,
    heap_info_size: 48,
    heap_ar_ptr: 0,
    heap_prev: 8,
    heap_size: 16,
    heap_max: 64 << 20,
    tcache_bins: 64,
    tcache_entries: 128,
    tcache_size: 640,
    mp_size: 136,
    mp_n_mmaps: 60,
    mp_mmapped_mem: 80,
    mp_sbrk_base: 96,
    mp_tcache_bins: 104,
    mp_tcache_count: 120,
    safe_linking: true,
};

const KNOWN: &[Layout] = &[GLIBC_2_36];

/// The layout of glibc `version`, if it is one heaptrace knows.
pub fn for_version(version: (u32, u32)) -> Option<&'static Layout> {
    KNOWN.iter().find(|l| l.version == version)
}

/// The versions heaptrace knows, for the refusal's message.
pub fn known() -> String {
    KNOWN
        .iter()
        .map(|l| format!("{}.{}", l.version.0, l.version.1))
        .collect::<Vec<_>>()
        .join(", ")
}

/// glibc's version from its banner in libc.so.6 ("... release version 2.36."), which
/// `gnu_get_libc_version` and `ldd --version` print too.
pub fn version_in(libc: &[u8]) -> Option<(u32, u32)> {
    const MARK: &[u8] = b"release version ";
    let at = libc.windows(MARK.len()).position(|w| w == MARK)? + MARK.len();
    let rest = libc.get(at..at + 16.min(libc.len() - at))?;
    let text: String = rest
        .iter()
        .take_while(|b| b.is_ascii_digit() || **b == b'.')
        .map(|b| *b as char)
        .collect();
    let mut parts = text.split('.').filter(|s| !s.is_empty());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// Chunk sizes: flags in the low bits.
pub const PREV_INUSE: u64 = 1;
pub const IS_MMAPPED: u64 = 2;
pub const NON_MAIN_ARENA: u64 = 4;
pub const MINSIZE: u64 = 32;

pub fn chunk_size(word: u64) -> u64 {
    word & !7
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_version_banner() {
        let text =
            b"xx GNU C Library (Debian GLIBC 2.36-9+deb12u14) stable release version 2.36.\n";
        assert_eq!(version_in(text), Some((2, 36)));
        assert_eq!(version_in(b"release version 2."), None);
        assert_eq!(version_in(b"nothing"), None);
        assert!(for_version((2, 36)).is_some());
        assert!(for_version((2, 35)).is_none());
    }

    #[test]
    fn the_host_libc_is_read() {
        // Debian 12's glibc on the test hosts; elsewhere the banner still parses.
        let data = std::fs::read("/lib/x86_64-linux-gnu/libc.so.6").unwrap_or_default();
        if !data.is_empty() {
            assert!(version_in(&data).is_some());
        }
    }
}
