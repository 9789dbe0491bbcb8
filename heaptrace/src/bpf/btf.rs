//! Where `group_leader` and `comm` sit in the running kernel's `struct task_struct`, and the
//! ids of the kernel functions the programs call (kfuncs, `kfunc.rs`).
//!
//! The eBPF side judges a process by its main thread's name, the `comm` of its group leader
//! (a worker thread renaming itself does not rename the process), and aya cannot relocate
//! field offsets in Rust programs (no CO-RE), so user space reads them from the running
//! kernel's BTF and passes them to the programs as globals.
//!
//! Format: <https://docs.kernel.org/bpf/btf.html>. The programs read kernel memory at these
//! offsets, so a wrong one silently misjudges every process: anything unexpected is an error.
//!
//! Parsed here, not by aya-obj 0.3.0: its `Btf` finds a type id by name and kind, but keeps
//! lookups by id, names and struct members crate-private, and it panics on a name offset past
//! the strings.
use heaptrace_common::unwind::vma;

use crate::error::Error;

const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

/// The kinds of BTF types (`BTF_KIND_*`).
mod kind {
    pub const INT: u32 = 1;
    pub const PTR: u32 = 2;
    pub const ARRAY: u32 = 3;
    pub const STRUCT: u32 = 4;
    pub const UNION: u32 = 5;
    pub const ENUM: u32 = 6;
    pub const FWD: u32 = 7;
    pub const TYPEDEF: u32 = 8;
    pub const VOLATILE: u32 = 9;
    pub const CONST: u32 = 10;
    pub const RESTRICT: u32 = 11;
    pub const FUNC: u32 = 12;
    pub const FUNC_PROTO: u32 = 13;
    pub const VAR: u32 = 14;
    pub const DATASEC: u32 = 15;
    pub const FLOAT: u32 = 16;
    pub const DECL_TAG: u32 = 17;
    pub const TYPE_TAG: u32 = 18;
    pub const ENUM64: u32 = 19;
}
use kind::*;

/// Kinds that name or qualify another type without changing its layout.
const MODIFIERS: [u32; 5] = [TYPEDEF, VOLATILE, CONST, RESTRICT, TYPE_TAG];
/// Anonymous structs nest a level or two; more means a corrupt file (or a cycle).
const MAX_NESTING: u32 = 32;

/// `Default` (zeros) only stands in where the programs never read them (no `--comm`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TaskOffsets {
    pub group_leader: u32,
    pub comm: u32,
}

/// An `Error::Btf`: what could not be found ("offsets" when the file itself is at fault), why.
macro_rules! fail {
    ($what:expr, $($why:tt)+) => {
        Error::Btf(format!("{} ({})", $what, format_args!($($why)+)))
    };
}

/// The running kernel's, from /sys/kernel/btf/vmlinux.
pub fn task_offsets() -> Result<TaskOffsets, Error> {
    let data = std::fs::read(VMLINUX).map_err(|source| Error::Read {
        path: VMLINUX.into(),
        source,
    })?;
    parse_task_offsets(&data)
}

pub fn parse_task_offsets(data: &[u8]) -> Result<TaskOffsets, Error> {
    let btf = Btf::parse(data)?;
    let task = (1..)
        .zip(&btf.types)
        .find_map(|(id, t)| (t.kind == STRUCT && btf.is_named(id, "task_struct")).then_some(id))
        .ok_or_else(|| fail!("offsets", "no complete struct task_struct"))?;

    let (group_leader, ptr) = btf.member(task, "group_leader")?;
    if ptr.kind != PTR {
        return Err(fail!("group_leader", "kind {}, not a pointer", ptr.kind));
    }
    // The programs follow it and read `comm` of what it points at.
    let (id, target) = btf.resolve(ptr.size_or_type)?;
    if !matches!(target.kind, STRUCT | FWD) || !btf.is_named(id, "task_struct") {
        return Err(fail!("group_leader", "not a pointer to struct task_struct"));
    }

    let (comm, array) = btf.member(task, "comm")?;
    if array.kind != ARRAY {
        return Err(fail!("comm", "kind {}, not an array", array.kind));
    }
    let nelems = u32_at(array.rest, 8)?;
    if nelems != 16 {
        return Err(fail!("comm", "an array of {nelems} elements, not 16"));
    }
    let (_, elem) = btf.resolve(u32_at(array.rest, 0)?)?;
    if elem.kind != INT || elem.size_or_type != 1 {
        return Err(fail!("comm", "not an array of char"));
    }
    Ok(TaskOffsets { group_leader, comm })
}

/// Where `pid` and `tgid` sit in `task_struct`: the fork program reads a new task's.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct IdOffsets {
    pub pid: u32,
    pub tgid: u32,
}

/// The running kernel's, from /sys/kernel/btf/vmlinux.
pub fn id_offsets() -> Result<IdOffsets, Error> {
    let data = std::fs::read(VMLINUX).map_err(|source| Error::Read {
        path: VMLINUX.into(),
        source,
    })?;
    parse_id_offsets(&data)
}

pub fn parse_id_offsets(data: &[u8]) -> Result<IdOffsets, Error> {
    let btf = Btf::parse(data)?;
    let task = (1..)
        .zip(&btf.types)
        .find_map(|(id, t)| (t.kind == STRUCT && btf.is_named(id, "task_struct")).then_some(id))
        .ok_or_else(|| fail!("offsets", "no complete struct task_struct"))?;
    // pid_t: a 4-byte int under a typedef or two.
    let int32 = |name: &str| -> Result<u32, Error> {
        let (at, ty) = btf.member(task, name)?;
        if ty.kind != INT || ty.size_or_type != 4 {
            return Err(fail!(name, "not a 4-byte integer"));
        }
        Ok(at)
    };
    Ok(IdOffsets {
        pid: int32("pid")?,
        tgid: int32("tgid")?,
    })
}

/// Where a walk reads a mapping's bounds and its file's identity (`heaptrace_common::unwind::
/// vma`), in the running kernel.
pub fn vma_offsets() -> Result<[u32; vma::COUNT], Error> {
    let data = std::fs::read(VMLINUX).map_err(|source| Error::Read {
        path: VMLINUX.into(),
        source,
    })?;
    parse_vma_offsets(&data)
}

pub fn parse_vma_offsets(data: &[u8]) -> Result<[u32; vma::COUNT], Error> {
    let btf = Btf::parse(data)?;
    let named = |name: &str| {
        (1..)
            .zip(&btf.types)
            .find_map(|(id, t)| (t.kind == STRUCT && btf.is_named(id, name)).then_some(id))
            .ok_or_else(|| fail!("offsets", "no complete struct {name}"))
    };
    let (area, file, inode, sb) = (
        named("vm_area_struct")?,
        named("file")?,
        named("inode")?,
        named("super_block")?,
    );
    let at = |id: u32, name: &str| btf.member(id, name).map(|(at, _)| at);
    // 6.11 on: seconds and nanoseconds apart; before, a timespec64 (seconds, then a long).
    let (mtime_sec, mtime_nsec) = match at(inode, "i_mtime_sec") {
        Ok(sec) => (sec, at(inode, "i_mtime_nsec")?),
        Err(_) => {
            let t = at(inode, "i_mtime")?;
            (t, t + 8)
        }
    };
    let mut o = [0u32; vma::COUNT];
    o[vma::VM_START] = at(area, "vm_start")?;
    o[vma::VM_END] = at(area, "vm_end")?;
    o[vma::VM_PGOFF] = at(area, "vm_pgoff")?;
    o[vma::VM_FILE] = at(area, "vm_file")?;
    o[vma::F_INODE] = at(file, "f_inode")?;
    o[vma::I_INO] = at(inode, "i_ino")?;
    o[vma::I_SB] = at(inode, "i_sb")?;
    o[vma::I_SIZE] = at(inode, "i_size")?;
    o[vma::I_MTIME_SEC] = mtime_sec;
    o[vma::I_MTIME_NSEC] = mtime_nsec;
    o[vma::S_DEV] = at(sb, "s_dev")?;
    Ok(o)
}

/// What the running kernel's `oom/mark_victim` tracepoint passes first:
/// `heaptrace_common::OOM_TASK` or `OOM_PID`.
pub fn oom_victim() -> Result<u32, Error> {
    let data = std::fs::read(VMLINUX).map_err(|source| Error::Read {
        path: VMLINUX.into(),
        source,
    })?;
    parse_oom_victim(&data)
}

/// From the raw tracepoint's prototype, `btf_trace_mark_victim`: a pointer to a function of
/// the context and the tracepoint's arguments.
pub fn parse_oom_victim(data: &[u8]) -> Result<u32, Error> {
    const NAME: &str = "btf_trace_mark_victim";
    let btf = Btf::parse(data)?;
    let id = (1..)
        .zip(&btf.types)
        .find_map(|(id, t)| (t.kind == TYPEDEF && btf.is_named(id, NAME)).then_some(id))
        .ok_or_else(|| fail!(NAME, "no such tracepoint"))?;
    let (_, ptr) = btf.resolve(id)?;
    let (_, proto) = btf.resolve(ptr.size_or_type)?;
    if ptr.kind != PTR || proto.kind != FUNC_PROTO {
        return Err(fail!(NAME, "not a pointer to a function"));
    }
    // Parameter 0 is the context; 1 the first argument.
    let first = proto.rest.chunks_exact(8).nth(1);
    let first = first.ok_or_else(|| fail!(NAME, "no argument"))?;
    match btf.resolve(u32_at(first, 4)?)?.1 {
        t if t.kind == PTR => Ok(heaptrace_common::OOM_TASK),
        t if t.kind == INT && t.size_or_type == 4 => Ok(heaptrace_common::OOM_PID),
        _ => Err(fail!(
            NAME,
            "its first argument is neither a task nor a pid"
        )),
    }
}

/// The BTF ids of the running kernel's functions `names`, each None where it has no such
/// function.
pub fn func_ids<const N: usize>(names: [&str; N]) -> Result<[Option<u32>; N], Error> {
    let data = std::fs::read(VMLINUX).map_err(|source| Error::Read {
        path: VMLINUX.into(),
        source,
    })?;
    parse_func_ids(&data, names)
}

pub fn parse_func_ids<const N: usize>(
    data: &[u8],
    names: [&str; N],
) -> Result<[Option<u32>; N], Error> {
    let btf = Btf::parse(data)?;
    let mut ids = [None; N];
    for (id, t) in (1..).zip(&btf.types) {
        if t.kind != FUNC {
            continue;
        }
        let name = btf.name(t.name_off)?;
        if let Some(i) = names.iter().position(|n| n.as_bytes() == name) {
            ids[i].get_or_insert(id);
        }
    }
    Ok(ids)
}

fn truncated() -> Error {
    fail!("offsets", "the BTF is truncated")
}

fn u32_at(b: &[u8], off: usize) -> Result<u32, Error> {
    let word = off.checked_add(4).and_then(|end| b.get(off..end));
    let word = word.ok_or_else(truncated)?;
    Ok(u32::from_le_bytes([word[0], word[1], word[2], word[3]]))
}

struct Type<'a> {
    name_off: u32,
    kind: u32,
    kind_flag: bool,
    size_or_type: u32,
    /// The kind-specific data after the common 12 bytes.
    rest: &'a [u8],
}

struct Btf<'a> {
    /// Type id N is `types[N - 1]`; 0 is void.
    types: Vec<Type<'a>>,
    strings: &'a [u8],
}

impl<'a> Btf<'a> {
    fn parse(data: &'a [u8]) -> Result<Self, Error> {
        match data.get(..2).map(|m| u16::from_le_bytes([m[0], m[1]])) {
            Some(0xEB9F) => {}
            Some(0x9FEB) => return Err(fail!("offsets", "big-endian BTF is not supported")),
            Some(m) => return Err(fail!("offsets", "bad magic {m:#06x}: not BTF")),
            None => return Err(truncated()),
        }
        if data.get(2) != Some(&1) {
            return Err(fail!("offsets", "unknown BTF version"));
        }
        let hdr_len = u32_at(data, 4)? as usize;
        if hdr_len < 24 {
            return Err(fail!("offsets", "a header of {hdr_len} bytes, under 24"));
        }
        let section = |at: usize| -> Result<&'a [u8], Error> {
            let (off, len) = (u32_at(data, at)? as usize, u32_at(data, at + 4)? as usize);
            let start = hdr_len.checked_add(off);
            let sec = start.and_then(|s| data.get(s..s.checked_add(len)?));
            sec.ok_or_else(truncated)
        };
        let (type_sec, strings) = (section(8)?, section(16)?);

        let mut types = Vec::new();
        let mut pos = 0;
        while pos < type_sec.len() {
            let info = u32_at(type_sec, pos + 4)?;
            let (kind, vlen) = ((info >> 24) & 0x1f, (info & 0xffff) as usize);
            let len = match kind {
                INT | VAR | DECL_TAG => 4,
                ARRAY => 12,
                STRUCT | UNION | DATASEC | ENUM64 => 12 * vlen,
                ENUM | FUNC_PROTO => 8 * vlen,
                PTR | FWD | TYPEDEF | VOLATILE | CONST | RESTRICT | FUNC | FLOAT | TYPE_TAG => 0,
                _ => return Err(fail!("offsets", "unknown BTF kind {kind}")),
            };
            types.push(Type {
                name_off: u32_at(type_sec, pos)?,
                kind,
                kind_flag: info >> 31 == 1,
                size_or_type: u32_at(type_sec, pos + 8)?,
                rest: type_sec
                    .get(pos + 12..pos + 12 + len)
                    .ok_or_else(truncated)?,
            });
            pos += 12 + len;
        }
        Ok(Btf { types, strings })
    }

    fn get(&self, id: u32) -> Result<&Type<'a>, Error> {
        let t = id.checked_sub(1).and_then(|i| self.types.get(i as usize));
        t.ok_or_else(|| fail!("offsets", "a reference to missing type {id}"))
    }

    fn is_named(&self, id: u32, name: &str) -> bool {
        self.get(id).and_then(|t| self.name(t.name_off)).ok() == Some(name.as_bytes())
    }

    fn name(&self, off: u32) -> Result<&'a [u8], Error> {
        let tail = self.strings.get(off as usize..).unwrap_or_default();
        let len = tail.iter().position(|&b| b == 0);
        len.map(|len| &tail[..len])
            .ok_or_else(|| fail!("offsets", "a name past the strings"))
    }

    /// The type under any typedefs and qualifiers, and its id.
    fn resolve(&self, mut id: u32) -> Result<(u32, &Type<'a>), Error> {
        for _ in 0..=self.types.len() {
            let t = self.get(id)?;
            if !MODIFIERS.contains(&t.kind) {
                return Ok((id, t));
            }
            id = t.size_or_type;
        }
        Err(fail!("offsets", "a cycle of typedefs"))
    }

    /// The byte offset of member `name` of struct `id`, and its type under any modifiers.
    fn member(&self, id: u32, name: &str) -> Result<(u32, &Type<'a>), Error> {
        let found = self.find_member(id, name, 0)?;
        let (bits, ty) = found.ok_or_else(|| fail!(name, "no such member"))?;
        if bits % 8 != 0 {
            return Err(fail!(name, "at bit {bits}, not on a byte boundary"));
        }
        let bytes = u32::try_from(bits / 8).map_err(|_| fail!(name, "at bit {bits}, too far"))?;
        Ok((bytes, self.resolve(ty)?.1))
    }

    /// The bit offset and type of member `name` of struct or union `id`, looking inside its
    /// anonymous structs and unions (randstruct wraps task_struct's members in some).
    fn find_member(&self, id: u32, name: &str, depth: u32) -> Result<Option<(u64, u32)>, Error> {
        let t = self.get(id)?;
        for m in t.rest.chunks_exact(12) {
            let (name_off, ty, off) = (u32_at(m, 0)?, u32_at(m, 4)?, u32_at(m, 8)?);
            // With kind_flag, the top byte is a bitfield's size.
            let (bitfield, bits) = match t.kind_flag {
                true => (off >> 24, u64::from(off & 0xff_ffff)),
                false => (0, u64::from(off)),
            };
            if name_off == 0 {
                let (inner, it) = self.resolve(ty)?;
                if !matches!(it.kind, STRUCT | UNION) {
                    continue;
                }
                if depth >= MAX_NESTING {
                    return Err(fail!(name, "anonymous members nested too deep"));
                }
                if let Some((b, ty)) = self.find_member(inner, name, depth + 1)? {
                    return Ok(Some((bits + b, ty)));
                }
            } else if self.name(name_off)? == name.as_bytes() {
                if bitfield != 0 {
                    return Err(fail!(name, "a bitfield of {bitfield} bits"));
                }
                return Ok(Some((bits, ty)));
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests;
