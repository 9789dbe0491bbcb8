//! Finding the malloc family in an ELF file: symbol addresses, file offsets, aliases.
use std::{collections::BTreeMap, fs, path::Path};

use heaptrace_common::Func;
use object::{Object as _, ObjectSegment as _, ObjectSymbol as _, SymbolKind};

use crate::error::{Error, Result};

/// One function to probe: where it is in the file, and which other names share its address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FuncSite {
    pub func: Func,
    /// The function's name: the family's own, or the custom one it stands in for (see
    /// `--allocator-symbols`).
    pub symbol: String,
    pub vaddr: u64,
    /// Offset in the file, what a uprobe attaches to.
    pub file_offset: u64,
    /// The symbol's size in bytes (0 if the symbol does not say).
    pub size: u64,
    /// Other family members defined at the same address (probed once, counted as `func`).
    pub aliases: Vec<Func>,
}

/// The malloc-family functions `path` defines, one site per distinct address.
pub fn alloc_sites(path: &Path) -> Result<Vec<FuncSite>> {
    let names: Vec<(Func, String)> = Func::ALL
        .iter()
        .map(|f| (*f, f.name().to_string()))
        .collect();
    named_sites(path, &names)
}

/// The functions of `names` ((counted as, symbol)) that `path` defines, one site per
/// distinct address.
pub fn named_sites(path: &Path, names: &[(Func, String)]) -> Result<Vec<FuncSite>> {
    let data = map(path)?;
    let elf_err = |reason: String| Error::Elf {
        path: path.into(),
        reason,
    };
    let file = object::File::parse(&*data).map_err(|e| elf_err(e.to_string()))?;

    let mut by_func: BTreeMap<Func, (u64, u64)> = BTreeMap::new();
    for_each_function(&file, |name, addr, size| {
        if let Some((func, _)) = names
            .iter()
            .find(|(_, want)| crate::targets::custom_symbols::matches(name, want))
        {
            by_func.entry(*func).or_insert((addr, size));
        }
    });

    let mut by_addr: BTreeMap<u64, (u64, Vec<Func>)> = BTreeMap::new();
    for (func, (addr, size)) in by_func {
        let e = by_addr.entry(addr).or_default();
        e.0 = e.0.max(size);
        e.1.push(func);
    }
    let mut sites = Vec::new();
    for (vaddr, (size, mut funcs)) in by_addr {
        funcs.sort();
        let func = funcs.remove(0);
        let file_offset = file_offset(&file, vaddr)
            .ok_or_else(|| elf_err(format!("{} at {vaddr:#x} is in no segment", func.name())))?;
        let symbol = names
            .iter()
            .find(|(f, _)| *f == func)
            .map_or_else(|| func.name().to_string(), |(_, s)| s.clone());
        sites.push(FuncSite {
            func,
            symbol,
            vaddr,
            file_offset,
            size,
            aliases: funcs,
        });
    }
    sites.sort_by_key(|s| s.func);
    Ok(sites)
}

/// Read lazily: only the headers and symbol tables, not a whole (maybe huge debug) binary.
fn open(path: &Path) -> Result<fs::File> {
    fs::File::open(path).map_err(|source| Error::Read {
        path: path.into(),
        source,
    })
}

/// The file mapped to memory, to read its symbols in place. A read through `object`'s
/// `ReadCache` allocated a buffer for every name, and under --all every allocation of
/// heaptrace's traps into its own probes.
pub(crate) fn map(path: &Path) -> Result<memmap2::Mmap> {
    let file = open(path)?;
    // SAFETY: the map is only read, and only while the caller parses it. A file truncated
    // meanwhile would fault, as blazesym's own maps of the same files would; installers
    // replace programs and libraries by renaming new files over them, and the kernel
    // refuses writes to a running executable.
    unsafe { memmap2::Mmap::map(&file) }.map_err(|source| Error::Read {
        path: path.into(),
        source,
    })
}

/// Every function symbol `file` defines, as (name without version, address, size). Dynamic
/// symbols are what the dynamic linker binds; a static binary only has .symtab.
pub(crate) fn for_each_function<'a, R: object::ReadRef<'a>>(
    file: &object::File<'a, R>,
    mut f: impl FnMut(&str, u64, u64),
) {
    for sym in file.dynamic_symbols().chain(file.symbols()) {
        if sym.is_undefined() || sym.kind() != SymbolKind::Text || sym.address() == 0 {
            continue;
        }
        let Ok(name) = sym.name() else { continue };
        // Versioned names ("malloc@@GLIBC_2.2.5") only appear in .symtab.
        f(
            name.split('@').next().unwrap_or(name),
            sym.address(),
            sym.size(),
        );
    }
}

pub(crate) fn file_offset<'a, R: object::ReadRef<'a>>(
    file: &object::File<'a, R>,
    vaddr: u64,
) -> Option<u64> {
    file.segments().find_map(|seg| {
        let (off, size) = seg.file_range();
        (vaddr >= seg.address() && vaddr < seg.address() + size)
            .then(|| vaddr - seg.address() + off)
    })
}

/// The first bytes of a function's code as the file has them: `max` at most, and no more than
/// the symbol's size when it gives one (the bytes after a function belong to another).
pub fn code(path: &Path, site: &FuncSite, max: usize) -> Result<Vec<u8>> {
    code_at(path, site.file_offset, site.size, max)
}

/// As [`code`], for the function at `file_offset` whose symbol gives `size` (or 0).
pub(crate) fn code_at(path: &Path, file_offset: u64, size: u64, max: usize) -> Result<Vec<u8>> {
    use std::io::{Read as _, Seek as _, SeekFrom};
    let read_err = |source| Error::Read {
        path: path.into(),
        source,
    };
    let want = match size {
        0 => max,
        n => max.min(n as usize),
    };
    let mut f = fs::File::open(path).map_err(read_err)?;
    f.seek(SeekFrom::Start(file_offset)).map_err(read_err)?;
    let mut buf = Vec::with_capacity(want);
    f.take(want as u64)
        .read_to_end(&mut buf)
        .map_err(read_err)?;
    Ok(buf)
}

/// Whether `path` can serve as the process's allocator: it defines both malloc and free.
pub fn defines_malloc(sites: &[FuncSite]) -> bool {
    let has = |f: Func| sites.iter().any(|s| s.func == f || s.aliases.contains(&f));
    has(Func::Malloc) && has(Func::Free)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host_libc() -> std::path::PathBuf {
        crate::targets::allocator::host_libc_path().expect("host libc")
    }

    #[test]
    fn host_libc_defines_the_family_with_aligned_alloc_memalign_aliased() {
        let sites = alloc_sites(&host_libc()).unwrap();
        assert!(defines_malloc(&sites));
        let names: Vec<_> = sites.iter().map(|s| s.func.name()).collect();
        for f in [
            "malloc",
            "calloc",
            "realloc",
            "free",
            "posix_memalign",
            "valloc",
            "pvalloc",
        ] {
            assert!(names.contains(&f), "{f} missing from {names:?}");
        }
        let aa = sites.iter().find(|s| s.func == Func::AlignedAlloc).unwrap();
        assert_eq!(aa.aliases, vec![Func::Memalign], "glibc 2.36: one address");
        assert!(!names.contains(&"memalign"));
        // Addresses are distinct after dedup.
        let mut addrs: Vec<_> = sites.iter().map(|s| s.vaddr).collect();
        addrs.dedup();
        assert_eq!(addrs.len(), sites.len());
    }

    #[test]
    fn code_is_read_at_the_file_offset_within_the_symbol() {
        let libc = host_libc();
        let sites = alloc_sites(&libc).unwrap();
        let file = fs::read(&libc).unwrap();
        for s in &sites {
            assert!(s.size > 0, "{:?} has no size", s.func);
            let code = code(&libc, s, 64).unwrap();
            assert_eq!(code.len() as u64, s.size.min(64));
            let at = s.file_offset as usize;
            assert_eq!(code, file[at..at + code.len()]);
        }
    }

    #[test]
    fn a_file_without_malloc_has_no_sites() {
        // The test binary itself is a Rust program that imports malloc but does not define it.
        let me = std::env::current_exe().unwrap();
        assert!(!defines_malloc(&alloc_sites(&me).unwrap()));
    }

    #[test]
    fn not_an_elf_is_an_error() {
        let err = alloc_sites(Path::new("/etc/hostname")).unwrap_err();
        assert!(err.to_string().contains("cannot parse ELF"), "{err}");
        // Mapped files: an empty one and a missing one are errors too, not faults.
        let empty = std::env::temp_dir().join(format!("heaptrace-empty-{}", std::process::id()));
        fs::write(&empty, b"").unwrap();
        let err = alloc_sites(&empty).unwrap_err();
        let id = crate::record::writer::build_id(&empty);
        fs::remove_file(&empty).unwrap();
        assert!(err.to_string().contains("ELF"), "{err}");
        assert_eq!(id, None);
        assert!(alloc_sites(Path::new("/nonexistent/libc.so.6")).is_err());
    }
}
