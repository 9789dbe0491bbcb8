//! What the injection needs of the target's libc and loader, from /proc/PID/maps and the
//! files mapped: the functions it calls (glibc 2.34 and later define dlopen in
//! libc.so.6), the code ranges a call must not start from, and unused bytes at the end of a
//! code mapping for the trampoline.
use object::{Object as _, ObjectSegment as _};

use super::stop::Unsafe;
use crate::targets::{
    allocator::{is_dynamic_loader, is_libc},
    elf::{ElfImage, file_offset, for_each_function},
    maps::{self, MapsEntry},
    procfs,
    target_file::TargetFile,
};

/// The functions called in the target, by address.
#[derive(Debug, Default)]
pub struct Funcs {
    pub memfd_create: u64,
    pub dlopen: u64,
    pub dlerror: u64,
    pub close: u64,
}

pub struct Found {
    pub funcs: Funcs,
    pub avoid: Unsafe,
    /// Unused code bytes for the trampoline.
    pub scratch: u64,
}

/// Where file offset `off` of the file of `entries` is mapped.
fn address(entries: &[&MapsEntry], off: u64) -> Option<u64> {
    entries
        .iter()
        .find(|e| off >= e.offset && off < e.offset + (e.end - e.start))
        .map(|e| e.start + off - e.offset)
}

/// Unused bytes past the end of the file's executable segment, within its code mapping.
fn slack<'a, R: object::ReadRef<'a>>(
    file: &object::File<'a, R>,
    code: &[&MapsEntry],
) -> Option<u64> {
    file.segments().find_map(|seg| {
        let object::SegmentFlags::Elf { p_flags } = seg.flags() else {
            return None;
        };
        if p_flags & object::elf::PF_X == 0 {
            return None;
        }
        let (off, size) = seg.file_range();
        let end = off + size;
        code.iter().find_map(|e| {
            let mapped_end = e.offset + (e.end - e.start);
            let at = (e.start + end.checked_sub(e.offset)? + 15) & !15;
            (end > e.offset && end <= mapped_end && at + super::call::ROOM as u64 <= e.end)
                .then_some(at)
        })
    })
}

/// libc's functions, the code to avoid and the scratch room; Err(reason) for a process
/// without them (a static program, a libc before 2.34).
pub fn find(pid: u32) -> Result<Found, String> {
    let dir = procfs::space_dir(pid);
    let text = procfs::maps(pid).map_err(|e| format!("cannot read its maps: {e}"))?;
    let all = maps::parse(&text);
    let of = |f: fn(&std::path::Path) -> bool| -> Vec<&MapsEntry> {
        all.iter().filter(|e| f(&e.path)).collect()
    };
    let (libc, loader) = (of(is_libc), of(is_dynamic_loader));
    if loader.is_empty() {
        return Err(
            "it has no dynamic loader mapped (a static program): nothing can load \
                    a library into it"
                .into(),
        );
    }
    let first = libc.first().ok_or("it maps no libc.so")?;
    let file = TargetFile::mapped(&dir, first).map_err(|e| format!("cannot open its libc: {e}"))?;
    let image = ElfImage::read(&file).map_err(|e| e.to_string())?;
    let elf = object::File::parse(&image).map_err(|e| e.to_string())?;
    let mut funcs = Funcs::default();
    for_each_function(&elf, |name, vaddr, _| {
        let slot = match name {
            "memfd_create" => &mut funcs.memfd_create,
            "dlopen" => &mut funcs.dlopen,
            "dlerror" => &mut funcs.dlerror,
            "close" => &mut funcs.close,
            _ => return,
        };
        if *slot == 0
            && let Some(at) = file_offset(&elf, vaddr).and_then(|o| address(&libc, o))
        {
            *slot = at;
        }
    });
    if funcs.dlopen == 0 {
        return Err("its libc defines no dlopen (glibc before 2.34, or not glibc)".into());
    }
    if funcs.memfd_create == 0 || funcs.close == 0 || funcs.dlerror == 0 {
        return Err("its libc lacks memfd_create, close or dlerror".into());
    }
    let code = |v: &[&MapsEntry]| -> Vec<(u64, u64)> {
        v.iter()
            .filter(|e| e.exec)
            .map(|e| (e.start, e.end))
            .collect()
    };
    let avoid = Unsafe {
        loader: code(&loader),
        libc: code(&libc),
    };
    let libc_code: Vec<&MapsEntry> = libc.iter().copied().filter(|e| e.exec).collect();
    let scratch = slack(&elf, &libc_code).ok_or("no unused code bytes at the end of its libc")?;
    Ok(Found {
        funcs,
        avoid,
        scratch,
    })
}
