//! Finding the malloc family in an ELF file: symbol addresses, file offsets, aliases.
use std::collections::BTreeMap;

use heaptrace_common::Func;
use object::{Object as _, ObjectSegment as _, ObjectSymbol as _, SymbolKind};

use crate::{
    error::{Error, Result},
    targets::target_file::TargetFile,
};

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

/// The malloc-family functions `file` defines, one site per distinct address.
pub fn alloc_sites(file: &TargetFile) -> Result<Vec<FuncSite>> {
    let names: Vec<(Func, String)> = Func::ALL
        .iter()
        .map(|f| (*f, f.name().to_string()))
        .collect();
    named_sites(file, &names)
}

/// The functions of `names` ((counted as, symbol)) that `file` defines, one site per
/// distinct address.
pub fn named_sites(target: &TargetFile, names: &[(Func, String)]) -> Result<Vec<FuncSite>> {
    let image = ElfImage::read(target)?;
    let elf_err = |reason: String| Error::Elf {
        path: target.shown().into(),
        reason,
    };
    let file = object::File::parse(&image).map_err(|e| elf_err(e.to_string()))?;

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

/// The parts of an ELF file that its symbols are read from (its headers and its symbol,
/// string, note and version tables), read from the held descriptor into memory: not its code
/// or debug info, which may be a hundred megabytes, and not mapped, since a file the traced
/// process can truncate would fault heaptrace in the middle of a parse.
pub struct ElfImage {
    len: u64,
    /// (file offset, bytes), by offset.
    chunks: Vec<(u64, Vec<u8>)>,
}

/// The most bytes of tables read of one file: a binary with a symbol table of this size
/// would have millions of symbols.
const TABLES_MAX: u64 = 256 << 20;
/// The first bytes read: the ELF header and, as linkers place them, the program headers.
const HEAD: u64 = 4096;

impl ElfImage {
    pub fn read(target: &TargetFile) -> Result<ElfImage> {
        use object::read::elf::{FileHeader as _, SectionHeader as _};
        let elf_err = |reason: String| Error::Elf {
            path: target.shown().into(),
            reason,
        };
        let mut image = ElfImage {
            len: target.size(),
            chunks: Vec::new(),
        };
        image.add(target, 0, HEAD.min(target.size()))?;
        let header = object::elf::FileHeader64::<object::Endianness>::parse(&image)
            .map_err(|e| elf_err(e.to_string()))?;
        let endian = header.endian().map_err(|e| elf_err(e.to_string()))?;
        let (phoff, phsize) = (
            header.e_phoff(endian),
            u64::from(header.e_phnum(endian)) * u64::from(header.e_phentsize(endian)),
        );
        let (shoff, shentsize) = (header.e_shoff(endian), header.e_shentsize(endian));
        image.add(target, phoff, phsize)?;
        // The first section header says how many there are when e_shnum cannot (>= 0xff00).
        image.add(target, shoff, u64::from(shentsize))?;
        let header = object::elf::FileHeader64::<object::Endianness>::parse(&image)
            .map_err(|e| elf_err(e.to_string()))?;
        let shnum = header
            .shnum(endian, &image)
            .map_err(|e| elf_err(e.to_string()))?;
        image.add(target, shoff, shnum as u64 * u64::from(shentsize))?;
        let header = object::elf::FileHeader64::<object::Endianness>::parse(&image)
            .map_err(|e| elf_err(e.to_string()))?;
        let wanted: Vec<(u64, u64)> = header
            .section_headers(endian, &image)
            .map_err(|e| elf_err(e.to_string()))?
            .iter()
            .filter(|s| TABLES.contains(&s.sh_type(endian)))
            .map(|s| (s.sh_offset(endian), s.sh_size(endian)))
            .collect();
        for (offset, size) in wanted {
            image.add(target, offset, size)?;
        }
        Ok(image)
    }

    /// Reads `size` bytes at `offset` (from an 8-byte boundary: tables are read in place).
    fn add(&mut self, target: &TargetFile, offset: u64, size: u64) -> Result<()> {
        let start = offset & !7;
        let end = offset.saturating_add(size).min(self.len);
        if end <= start || self.covers(start, end - start) {
            return Ok(());
        }
        let held: u64 = self.chunks.iter().map(|(_, b)| b.len() as u64).sum();
        if held + (end - start) > TABLES_MAX {
            return Err(Error::Elf {
                path: target.shown().into(),
                reason: format!("its tables exceed {TABLES_MAX} bytes"),
            });
        }
        let bytes = target
            .read_at(start, (end - start) as usize)
            .map_err(|source| Error::Read {
                path: target.shown().into(),
                source,
            })?;
        let at = self.chunks.partition_point(|(s, _)| *s <= start);
        self.chunks.insert(at, (start, bytes));
        Ok(())
    }

    fn covers(&self, offset: u64, size: u64) -> bool {
        self.chunk(offset, size).is_some()
    }

    /// The bytes of one chunk from `offset`, when it holds `size` of them.
    fn chunk(&self, offset: u64, size: u64) -> Option<&[u8]> {
        let last = self.chunks.partition_point(|(s, _)| *s <= offset);
        self.chunks[..last].iter().rev().find_map(|(s, bytes)| {
            let rel = (offset - s) as usize;
            (rel as u64)
                .checked_add(size)
                .filter(|end| *end <= bytes.len() as u64)
                .map(|_| &bytes[rel..])
        })
    }
}

/// The sections read: symbols and their names, notes (the build id), versions, hashes.
const TABLES: [u32; 10] = [
    object::elf::SHT_SYMTAB,
    object::elf::SHT_DYNSYM,
    object::elf::SHT_STRTAB,
    object::elf::SHT_SYMTAB_SHNDX,
    object::elf::SHT_NOTE,
    object::elf::SHT_DYNAMIC,
    object::elf::SHT_GNU_VERSYM,
    object::elf::SHT_GNU_VERDEF,
    object::elf::SHT_GNU_VERNEED,
    object::elf::SHT_GNU_HASH,
];

impl<'a> object::ReadRef<'a> for &'a ElfImage {
    fn len(self) -> std::result::Result<u64, ()> {
        Ok(self.len)
    }

    fn read_bytes_at(self, offset: u64, size: u64) -> std::result::Result<&'a [u8], ()> {
        let bytes = self.chunk(offset, size).ok_or(())?;
        Ok(&bytes[..size as usize])
    }

    fn read_bytes_at_until(
        self,
        range: std::ops::Range<u64>,
        delimiter: u8,
    ) -> std::result::Result<&'a [u8], ()> {
        let bytes = self.chunk(range.start, 0).ok_or(())?;
        let limit = (range.end.saturating_sub(range.start) as usize).min(bytes.len());
        let bytes = &bytes[..limit];
        let end = bytes.iter().position(|b| *b == delimiter).ok_or(())?;
        Ok(&bytes[..end])
    }
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
pub fn code(file: &TargetFile, site: &FuncSite, max: usize) -> Result<Vec<u8>> {
    code_at(file, site.file_offset, site.size, max)
}

/// As [`code`], for the function at `file_offset` whose symbol gives `size` (or 0).
pub(crate) fn code_at(
    file: &TargetFile,
    file_offset: u64,
    size: u64,
    max: usize,
) -> Result<Vec<u8>> {
    let want = match size {
        0 => max,
        n => max.min(n as usize),
    };
    file.read_at(file_offset, want)
        .map_err(|source| Error::Read {
            path: file.shown().into(),
            source,
        })
}

/// The build id of `file`, if it has one.
pub fn build_id(file: &TargetFile) -> Option<Vec<u8>> {
    use object::Object as _;
    let image = ElfImage::read(file).ok()?;
    let elf = object::File::parse(&image).ok()?;
    elf.build_id().ok().flatten().map(<[u8]>::to_vec)
}

/// Whether `path` can serve as the process's allocator: it defines both malloc and free.
pub fn defines_malloc(sites: &[FuncSite]) -> bool {
    let has = |f: Func| sites.iter().any(|s| s.func == f || s.aliases.contains(&f));
    has(Func::Malloc) && has(Func::Free)
}

/// The file offsets of the data symbols of `names` that `target` defines (its dynamic
/// symbols: what a stripped build still exports), as (name, file offset). A symbol in no
/// file-backed segment (`.bss`) is left out.
pub fn data_symbols(target: &TargetFile, names: &[&str]) -> Result<Vec<(String, u64)>> {
    dynamic_symbols(target, names, SymbolKind::Data)
}

/// The file offset of function `name`, where `target`'s dynamic symbols define it: a
/// function's first byte, an instruction boundary.
pub fn function_symbol(target: &TargetFile, name: &str) -> Result<Option<u64>> {
    let found = dynamic_symbols(target, &[name], SymbolKind::Text)?;
    Ok(found.first().map(|(_, off)| *off))
}

fn dynamic_symbols(
    target: &TargetFile,
    names: &[&str],
    kind: SymbolKind,
) -> Result<Vec<(String, u64)>> {
    let image = ElfImage::read(target)?;
    let file = object::File::parse(&image).map_err(|e| Error::Elf {
        path: target.shown().into(),
        reason: e.to_string(),
    })?;
    let mut found = Vec::new();
    for sym in file.dynamic_symbols() {
        if sym.is_undefined() || sym.kind() != kind {
            continue;
        }
        let Ok(name) = sym.name() else { continue };
        if names.contains(&name)
            && !found.iter().any(|(n, _)| n == name)
            && let Some(off) = file_offset(&file, sym.address())
        {
            found.push((name.to_string(), off));
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host_libc() -> TargetFile {
        let path = crate::targets::allocator::host_libc_path().expect("host libc");
        TargetFile::host(&path).unwrap()
    }

    fn host(path: &str) -> TargetFile {
        TargetFile::host(std::path::Path::new(path)).unwrap()
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
        let file = std::fs::read(libc.shown()).unwrap();
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
        let me = TargetFile::host(&std::env::current_exe().unwrap()).unwrap();
        assert!(!defines_malloc(&alloc_sites(&me).unwrap()));
        // Read from its tables alone, as a mapped whole file reads.
        let whole = std::fs::read(me.shown()).unwrap();
        let whole = object::File::parse(&*whole).unwrap();
        let image = ElfImage::read(&me).unwrap();
        let image = object::File::parse(&image).unwrap();
        let mut a = Vec::new();
        for_each_function(&whole, |n, addr, size| a.push((n.to_string(), addr, size)));
        let mut b = Vec::new();
        for_each_function(&image, |n, addr, size| b.push((n.to_string(), addr, size)));
        assert!(a.len() > 1000, "{}", a.len());
        assert_eq!(a, b);
        use object::Object as _;
        assert_eq!(whole.build_id().unwrap(), image.build_id().unwrap());
    }

    #[test]
    fn not_an_elf_is_an_error() {
        let err = alloc_sites(&host("/etc/hostname")).unwrap_err();
        assert!(err.to_string().contains("cannot parse ELF"), "{err}");
        // Mapped files: an empty one and a missing one are errors too, not faults.
        let empty = std::env::temp_dir().join(format!("heaptrace-empty-{}", std::process::id()));
        std::fs::write(&empty, b"").unwrap();
        let file = TargetFile::host(&empty).unwrap();
        std::fs::remove_file(&empty).unwrap();
        let err = alloc_sites(&file).unwrap_err();
        assert!(err.to_string().contains("ELF"), "{err}");
        assert_eq!(build_id(&file), None);
        // Truncated after the header: an error, not a fault.
        let libc = std::fs::read(host_libc().shown()).unwrap();
        std::fs::write(&empty, &libc[..200]).unwrap();
        let file = TargetFile::host(&empty).unwrap();
        std::fs::remove_file(&empty).unwrap();
        assert!(alloc_sites(&file).is_err());
    }
}
