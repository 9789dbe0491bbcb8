//! The memory syscalls' wrappers (mmap, munmap, mremap, brk) of an allocator's file, and where
//! in each the probe goes: just after its `syscall` instruction (`placement::after_syscall`).
use super::placement;
use crate::{
    error::{Error, Result},
    targets::{elf, target_file::TargetFile},
};

/// Where the memory syscalls' wrappers of `path` are probed (see `placement::after_syscall`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyscallSite {
    pub name: &'static str,
    pub nr: u32,
    /// The wrapper's offset in the file.
    pub file_offset: u64,
    /// The probe's place in the wrapper: just after its `syscall`.
    pub placement: placement::Placement,
}

impl SyscallSite {
    /// The probe's offset in the file.
    pub fn probe_offset(&self) -> u64 {
        self.file_offset + self.placement.offset
    }

    /// Whether the syscall gives a range back (munmap, mremap): its wrapper is also probed at
    /// its entry, so that the release is known before the kernel can hand the range to
    /// another thread (see `heaptrace_common::mem::BEGIN`).
    pub fn releases(&self) -> bool {
        heaptrace_common::mem::releases(self.nr)
    }
}

/// The wrappers of the memory syscalls heaptrace follows, all of them, or None when `target`
/// does not define one of them or one is not shaped as `placement::after_syscall` requires.
pub fn find(target: &TargetFile) -> Result<Option<Vec<SyscallSite>>> {
    use heaptrace_common::mem;
    const WRAPPERS: [(&str, u32); 4] = [
        ("mmap", mem::MMAP),
        ("munmap", mem::MUNMAP),
        ("mremap", mem::MREMAP),
        ("brk", mem::BRK),
    ];
    let image = elf::ElfImage::read(target)?;
    let file = object::File::parse(&image).map_err(|e| Error::Elf {
        path: target.shown().into(),
        reason: e.to_string(),
    })?;
    let mut found: [Option<(u64, u64)>; 4] = [None; 4];
    elf::for_each_function(&file, |name, addr, size| {
        if let Some(i) = WRAPPERS.iter().position(|(n, _)| *n == name) {
            found[i].get_or_insert((addr, size));
        }
    });
    let mut out = Vec::new();
    for ((name, nr), sym) in WRAPPERS.iter().zip(found) {
        let Some((vaddr, size)) = sym else {
            return Ok(None);
        };
        let Some(start) = elf::file_offset(&file, vaddr) else {
            return Ok(None);
        };
        // A wrapper is short: its syscall comes within its first few instructions.
        let code = elf::code_at(target, start, size, 256)?;
        let Some(placement) = placement::after_syscall(&code, *nr) else {
            return Ok(None);
        };
        out.push(SyscallSite {
            name,
            nr: *nr,
            file_offset: start,
            placement,
        });
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_libc_has_its_memory_syscalls_probed_after_the_syscall() {
        let libc = crate::targets::allocator::host_libc_path().expect("host libc");
        let libc = TargetFile::host(&libc).unwrap();
        let sites = find(&libc).unwrap().expect("glibc's wrappers");
        assert_eq!(sites.len(), 4);
        for s in &sites {
            // The syscall instruction lies between the wrapper's start and the probe.
            let len = s.placement.offset as usize;
            let before = elf::code_at(&libc, s.file_offset, len as u64, len).unwrap();
            assert!(before.windows(2).any(|w| w == [0x0f, 0x05]), "{s:?}");
        }
    }
}
