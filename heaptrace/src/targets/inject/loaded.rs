//! This build's library as loaded in the process (by this attach's dlopen, or left by an
//! earlier one, loaded for good and inert, and found again rather than loaded once more: a
//! dlopen of another memfd at the same /proc/self/fd path would be taken for it by name by
//! the loader anyway), and the addresses of its functions there, from its own symbols.
use object::{Object as _, ObjectSymbol as _};

use super::sys;

/// How much of the file's start must match: its headers and dynamic symbols.
const COMPARED: usize = 4096;

/// The functions redirected, in the order `heaptrace_attach` takes their addresses (the
/// library's `got::NAMES`).
const REDIRECTED: [&str; 10] = [
    "malloc",
    "calloc",
    "realloc",
    "reallocarray",
    "free",
    "posix_memalign",
    "aligned_alloc",
    "memalign",
    "valloc",
    "pvalloc",
];

pub struct Symbols {
    pub attach: u64,
    pub detach: u64,
    /// The library's own malloc family, as its GOT entries are to lead to: its exported
    /// names, whose address taken inside it would be libc's.
    pub ours: [u64; 10],
}

impl Symbols {
    pub fn ours_bytes(&self) -> Vec<u8> {
        self.ours.iter().flat_map(|a| a.to_le_bytes()).collect()
    }
}

/// How many heaptrace libraries `pid` has loaded (of any build), at most 64.
pub fn instances(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            cols.get(5) == Some(&"/memfd:heaptrace-preload")
                && cols
                    .get(2)
                    .is_some_and(|o| o.trim_start_matches('0').is_empty())
        })
        .count()
        .min(64)
}

/// The library's functions in `pid`, if this build's library is loaded there.
pub fn find(pid: u32, library: &[u8]) -> Option<Symbols> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let head = library.get(..COMPARED)?;
    let base = maps
        .lines()
        .filter_map(|l| {
            let mut cols = l.split_whitespace();
            let range = cols.next()?;
            let offset = cols.nth(1)?;
            let path = cols.nth(2)?;
            (path == "/memfd:heaptrace-preload" && u64::from_str_radix(offset, 16).ok()? == 0)
                .then(|| u64::from_str_radix(range.split('-').next()?, 16).ok())
                .flatten()
        })
        .find(|base| sys::read_mem(pid, *base, COMPARED).is_ok_and(|b| b == head))?;
    let elf = object::File::parse(library).ok()?;
    let at = |name: &str| {
        elf.dynamic_symbols()
            .find(|s| s.name() == Ok(name) && !s.is_undefined())
            .map(|s| base + s.address())
    };
    let mut ours = [0u64; 10];
    for (slot, name) in ours.iter_mut().zip(REDIRECTED) {
        *slot = at(name)?;
    }
    Some(Symbols {
        attach: at("heaptrace_attach")?,
        detach: at("heaptrace_detach")?,
        ours,
    })
}
