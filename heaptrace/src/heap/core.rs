//! A core file as the target's memory: its PT_LOAD segments, and the files its NT_FILE note
//! names for them. Core files are hostile input: every count and offset is checked against
//! the file's size before use.
use std::path::{Path, PathBuf};

use super::memory::{Memory, Region};

/// A core file, mapped.
pub struct Core {
    data: memmap2::Mmap,
    /// (vaddr, file offset, bytes in the file), sorted by vaddr.
    segments: Vec<(u64, u64, u64)>,
    pub regions: Vec<Region>,
}

const PT_LOAD: u32 = 1;
const PT_NOTE: u32 = 4;
const NT_FILE: u32 = 0x4649_4c45;
/// More mappings than the kernel's default vm.max_map_count allows is not a real core.
const MAX_MAPPINGS: u64 = 1 << 20;

fn u16_at(d: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(
        d.get(at..at.checked_add(2)?)?.try_into().ok()?,
    ))
}
fn u32_at(d: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        d.get(at..at.checked_add(4)?)?.try_into().ok()?,
    ))
}
fn u64_at(d: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(
        d.get(at..at.checked_add(8)?)?.try_into().ok()?,
    ))
}

impl Core {
    pub fn open(path: &Path) -> Result<Core, String> {
        let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
        let meta = file.metadata().map_err(|e| e.to_string())?;
        if !meta.is_file() {
            return Err("not a regular file".into());
        }
        // SAFETY: read-only private mapping; a file changed under us gives wrong bytes, which
        // every reader here treats as hostile anyway.
        let data = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| e.to_string())?;
        let (segments, files) = parse(&data)?;
        let regions = segments
            .iter()
            .map(|s| {
                let named = files.iter().find(|f| f.0 <= s.vaddr && s.vaddr < f.1);
                Region {
                    start: s.vaddr,
                    end: s.vaddr.saturating_add(s.memsz),
                    writable: s.flags & 2 != 0,
                    file: named.map(|f| f.3.clone()),
                    offset: named.map_or(0, |f| f.2 + (s.vaddr - f.0)),
                    special: None,
                }
            })
            .collect();
        let mut segs: Vec<(u64, u64, u64)> = segments
            .iter()
            .map(|s| (s.vaddr, s.offset, s.filesz))
            .collect();
        segs.sort();
        Ok(Core {
            data,
            segments: segs,
            regions,
        })
    }
}

struct Segment {
    vaddr: u64,
    offset: u64,
    filesz: u64,
    memsz: u64,
    flags: u32,
}

/// (start, end, offset in the file, path) of each file mapping the note names.
type FileMapping = (u64, u64, u64, PathBuf);

fn parse(d: &[u8]) -> Result<(Vec<Segment>, Vec<FileMapping>), String> {
    if d.get(..4) != Some(b"\x7fELF") {
        return Err("not an ELF file".into());
    }
    if d.get(4) != Some(&2) || d.get(5) != Some(&1) {
        return Err("not a 64-bit little-endian ELF file".into());
    }
    let bad = || "truncated ELF header".to_string();
    if u16_at(d, 16).ok_or_else(bad)? != 4 {
        return Err("not a core file (ELF type is not ET_CORE)".into());
    }
    if u16_at(d, 18).ok_or_else(bad)? != 62 {
        return Err("not an x86-64 core file".into());
    }
    let phoff = u64_at(d, 32).ok_or_else(bad)? as usize;
    let phentsize = u16_at(d, 54).ok_or_else(bad)? as usize;
    let phnum = u16_at(d, 56).ok_or_else(bad)? as usize;
    if phentsize < 56 {
        return Err("bad program header size".into());
    }
    let mut segments = Vec::new();
    let mut files = Vec::new();
    for i in 0..phnum {
        let at = phoff
            .checked_add(i * phentsize)
            .ok_or("program headers out of the file")?;
        let h = d
            .get(at..at + 56)
            .ok_or("program headers out of the file")?;
        let (ty, flags) = (u32_at(h, 0).unwrap(), u32_at(h, 4).unwrap());
        let (offset, vaddr) = (u64_at(h, 8).unwrap(), u64_at(h, 16).unwrap());
        let (filesz, memsz) = (u64_at(h, 32).unwrap(), u64_at(h, 40).unwrap());
        let in_file = offset
            .checked_add(filesz)
            .is_some_and(|e| e <= d.len() as u64);
        match ty {
            PT_LOAD => segments.push(Segment {
                vaddr,
                offset,
                // A truncated core keeps what it has; the rest reads as unreadable.
                filesz: if in_file {
                    filesz
                } else {
                    (d.len() as u64).saturating_sub(offset)
                },
                memsz,
                flags,
            }),
            PT_NOTE if in_file => {
                let notes = &d[offset as usize..(offset + filesz) as usize];
                files.extend(file_note(notes).unwrap_or_default());
            }
            _ => {}
        }
    }
    if segments.is_empty() {
        return Err("the core file has no memory (no PT_LOAD segment)".into());
    }
    Ok((segments, files))
}

/// The NT_FILE note's mappings, if the notes hold one that parses.
fn file_note(notes: &[u8]) -> Option<Vec<FileMapping>> {
    let mut at = 0usize;
    while at + 12 <= notes.len() {
        let namesz = u32_at(notes, at)? as usize;
        let descsz = u32_at(notes, at + 4)? as usize;
        let ty = u32_at(notes, at + 8)?;
        let desc = at + 12 + namesz.checked_add(3)? / 4 * 4;
        let end = desc.checked_add(descsz)?;
        if end > notes.len() {
            return None;
        }
        if ty == NT_FILE {
            return parse_nt_file(&notes[desc..end]);
        }
        at = end.checked_add(3)? / 4 * 4;
    }
    None
}

fn parse_nt_file(d: &[u8]) -> Option<Vec<FileMapping>> {
    use std::os::unix::ffi::OsStrExt as _;
    let count = u64_at(d, 0)?;
    let page = u64_at(d, 8)?;
    if count > MAX_MAPPINGS || count.checked_mul(24)? > d.len() as u64 {
        return None;
    }
    let names_at = 16 + count as usize * 24;
    let mut names = d.get(names_at..)?.split(|b| *b == 0);
    let mut out = Vec::with_capacity(count as usize);
    for i in 0..count as usize {
        let e = 16 + i * 24;
        let name = names.next()?;
        let path = PathBuf::from(std::ffi::OsStr::from_bytes(name));
        out.push((
            u64_at(d, e)?,
            u64_at(d, e + 8)?,
            u64_at(d, e + 16)?.checked_mul(page)?,
            path,
        ));
    }
    Some(out)
}

impl Memory for Core {
    fn read(&self, mut addr: u64, buf: &mut [u8]) -> bool {
        let mut done = 0usize;
        while done < buf.len() {
            let i = self.segments.partition_point(|s| s.0 <= addr);
            let Some(&(vaddr, offset, filesz)) = i.checked_sub(1).map(|i| &self.segments[i]) else {
                return false;
            };
            let into = addr - vaddr;
            if into >= filesz {
                return false;
            }
            let n = ((filesz - into) as usize).min(buf.len() - done);
            let from = (offset + into) as usize;
            buf[done..done + n].copy_from_slice(&self.data[from..from + n]);
            done += n;
            addr += n as u64;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_bytes_never_panic() {
        let mut seed = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..2000 {
            let len = (next() % 600) as usize;
            let mut d: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            if d.len() > 20 && next() % 2 == 0 {
                d[..4].copy_from_slice(b"\x7fELF");
                d[4] = 2;
                d[5] = 1;
                d[16] = 4;
                d[18] = 62;
            }
            let _ = parse(&d);
            let _ = file_note(&d);
            let _ = parse_nt_file(&d);
        }
    }

    #[test]
    fn parses_an_nt_file_note() {
        let mut d = Vec::new();
        for v in [2u64, 4096, 0x1000, 0x3000, 0, 0x5000, 0x6000, 3] {
            d.extend(v.to_le_bytes());
        }
        d.extend(b"/a\0/lib/c.so\0");
        let m = parse_nt_file(&d).unwrap();
        assert_eq!(m[1], (0x5000, 0x6000, 3 * 4096, PathBuf::from("/lib/c.so")));
        d[0] = 200; // more entries than bytes
        assert!(parse_nt_file(&d).is_none());
    }
}
