//! Finding glibc's `main_arena` and `mp_` in a target: from symbols when libc's debug file
//! is installed (libc6-dbg, `/usr/lib/debug/.build-id/`), else from code patterns in the
//! exported functions that use them. Both are static, so neither is in the dynamic symbols.
use std::path::{Path, PathBuf};

use iced_x86::{Decoder, DecoderOptions, Mnemonic, OpKind};
use object::{Object as _, ObjectSegment as _, ObjectSymbol as _};

use super::layout::{self, Layout};

/// How the addresses were found.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FoundBy {
    /// Named in a symbol table (this file).
    Symbols(PathBuf),
    /// Decoded from `malloc_trim` (main_arena) and `mallopt` (mp_).
    CodePatterns,
}

/// Where glibc's malloc state is in the target's address space.
#[derive(Clone, Debug)]
pub struct Located {
    pub layout: &'static Layout,
    pub main_arena: u64,
    pub mp: u64,
    pub found_by: FoundBy,
}

/// The largest libc file read (Debian's is 2 MB).
const MAX_LIBC: u64 = 256 << 20;

/// A regular file's bytes, at most `max`; never blocks on a FIFO or a device.
pub fn read_regular(path: &Path, max: u64) -> Result<Vec<u8>, String> {
    use std::{io::Read as _, os::unix::fs::OpenOptionsExt as _};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() || meta.len() > max {
        return Err(format!("{} is not a library file", path.display()));
    }
    let mut data = Vec::with_capacity(meta.len() as usize);
    file.take(max)
        .read_to_end(&mut data)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Ok(data)
}

/// Finds main_arena and mp_ for the libc file read from `open_path`, mapped at `base` (the
/// address of its first byte, file offset 0) in the target.
pub fn locate(open_path: &Path, base: u64, symbols: bool) -> Result<Located, String> {
    let data = read_regular(open_path, MAX_LIBC)?;
    locate_in(&data, open_path, base, symbols)
}

/// The same for a traced process's libc, read from the descriptor opened safely for it
/// (`targets::target_file`: through its map_files, regular, the inode it maps).
pub fn locate_file(
    file: &crate::targets::target_file::TargetFile,
    base: u64,
    symbols: bool,
) -> Result<Located, String> {
    if file.size() > MAX_LIBC {
        return Err(format!("{} is not a library file", file.shown().display()));
    }
    let data = file
        .read_at(0, file.size() as usize)
        .map_err(|e| format!("cannot read {}: {e}", file.shown().display()))?;
    locate_in(&data, file.shown(), base, symbols)
}

fn locate_in(data: &[u8], open_path: &Path, base: u64, symbols: bool) -> Result<Located, String> {
    let version = layout::version_in(data)
        .ok_or_else(|| format!("{} has no glibc version banner", open_path.display()))?;
    let layout = layout::for_version(version).ok_or_else(|| {
        format!(
            "glibc {}.{}: its malloc layout is not one heaptrace knows ({}); refusing to guess",
            version.0,
            version.1,
            layout::known()
        )
    })?;
    let file = object::File::parse(data).map_err(|e| format!("libc: {e}"))?;
    // Shared objects link at 0: the load bias is where the segment at file offset 0 went.
    let first = file
        .segments()
        .find(|s| s.file_range().0 == 0)
        .ok_or("libc has no segment at file offset 0")?;
    let bias = base.wrapping_sub(first.address());
    let found = if symbols { by_symbols(&file) } else { None };
    let (main_arena, mp, found_by) = match found {
        Some((a, m, path)) => (a, m, FoundBy::Symbols(path)),
        None => {
            let a = main_arena_from_code(&file)?;
            let m = mp_from_code(&file, a, layout)?;
            (a, m, FoundBy::CodePatterns)
        }
    };
    Ok(Located {
        layout,
        main_arena: main_arena.wrapping_add(bias),
        mp: mp.wrapping_add(bias),
        found_by,
    })
}

/// main_arena and mp_ from libc's own symbol table, or its build-id debug file's.
fn by_symbols(file: &object::File) -> Option<(u64, u64, PathBuf)> {
    let find = |f: &object::File| {
        let mut a = None;
        let mut m = None;
        for s in f.symbols() {
            match s.name() {
                Ok("main_arena") => a = Some(s.address()),
                Ok("mp_") => m = Some(s.address()),
                _ => {}
            }
        }
        Some((a?, m?))
    };
    let id = file.build_id().ok().flatten()?;
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    if hex.len() < 3 {
        return None;
    }
    let debug = PathBuf::from(format!(
        "/usr/lib/debug/.build-id/{}/{}.debug",
        &hex[..2],
        &hex[2..]
    ));
    if let Some((a, m)) = find(file) {
        return Some((a, m, PathBuf::from("libc.so.6")));
    }
    let data = read_regular(&debug, 1 << 30).ok()?;
    let dfile = object::File::parse(&*data).ok()?;
    // A debug file for another build would give wrong addresses: the ids must agree.
    if dfile.build_id().ok().flatten() != Some(id) {
        return None;
    }
    find(&dfile).map(|(a, m)| (a, m, debug))
}

/// The code of the exported function `name`: (its address, its first bytes).
fn function<'a>(file: &'a object::File, name: &str, max: u64) -> Option<(u64, &'a [u8])> {
    let sym = file
        .dynamic_symbols()
        .find(|s| s.name().is_ok_and(|n| n == name) && s.is_definition())?;
    let len = match sym.size() {
        0 => max,
        n => n.min(max),
    };
    for seg in file.segments() {
        if sym.address() >= seg.address() && sym.address() < seg.address() + seg.size() {
            let data = seg.data().ok()?;
            let at = (sym.address() - seg.address()) as usize;
            let end = (at + len as usize).min(data.len());
            return Some((sym.address(), data.get(at..end)?));
        }
    }
    None
}

/// The target of the first RIP-relative `lea` of `malloc_trim`: `&main_arena`, where its
/// loop over the arenas starts.
fn main_arena_from_code(file: &object::File) -> Result<u64, String> {
    let (addr, code) = function(file, "malloc_trim", 256).ok_or("libc exports no malloc_trim")?;
    let mut dec = Decoder::with_ip(64, code, addr, DecoderOptions::NONE);
    for insn in dec.iter().take(64) {
        if insn.mnemonic() == Mnemonic::Lea && insn.is_ip_rel_memory_operand() {
            return Ok(insn.ip_rel_memory_address());
        }
    }
    Err("no code pattern for main_arena in malloc_trim".into())
}

/// The lowest RIP-relative address `mallopt` stores to, main_arena aside: `&mp_`, whose
/// first field (`trim_threshold`) M_TRIM_THRESHOLD sets.
fn mp_from_code(file: &object::File, main_arena: u64, layout: &Layout) -> Result<u64, String> {
    let (addr, code) = function(file, "mallopt", 1024).ok_or("libc exports no mallopt")?;
    let mut dec = Decoder::with_ip(64, code, addr, DecoderOptions::NONE);
    let arena = main_arena..main_arena + layout.arena_size;
    dec.iter()
        .take(400)
        .filter(|i| {
            i.mnemonic() == Mnemonic::Mov
                && i.op_count() == 2
                && i.op0_kind() == OpKind::Memory
                && i.is_ip_rel_memory_operand()
        })
        .map(|i| i.ip_rel_memory_address())
        .filter(|a| !arena.contains(a))
        .min()
        .ok_or_else(|| "no code pattern for mp_ in mallopt".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On Debian 12's glibc both ways agree (the symbols come with libc6-dbg, installed on
    /// the test hosts).
    #[test]
    fn code_patterns_agree_with_the_symbols() {
        let path = Path::new("/lib/x86_64-linux-gnu/libc.so.6");
        let Ok(data) = read_regular(path, MAX_LIBC) else {
            return;
        };
        let Some(layout) = layout::version_in(&data).and_then(layout::for_version) else {
            return; // another glibc: nothing to compare
        };
        let file = object::File::parse(&*data).unwrap();
        let a = main_arena_from_code(&file).unwrap();
        let m = mp_from_code(&file, a, layout).unwrap();
        if let Some((sa, sm, _)) = by_symbols(&file) {
            assert_eq!((a, m), (sa, sm));
        }
        let id = file.build_id().ok().flatten().unwrap_or_default();
        if id.starts_with(&[0x93, 0xac, 0x61, 0xec]) {
            assert_eq!((a, m), (0x1d3c60, 0x1d3340), "2.36-9+deb12u14's addresses");
        }
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = std::env::temp_dir().join(format!("ht-fifo-{}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        let c = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(read_regular(&dir, 100).is_err());
        let _ = std::fs::remove_file(&dir);
    }
}
