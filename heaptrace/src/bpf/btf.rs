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
mod tests {
    use super::*;

    /// Or'd into a kind: sets the type's kind_flag.
    const KFLAG: u32 = 0x80;

    #[derive(Default)]
    struct Builder {
        /// Each type's words; type id N is `types[N - 1]`.
        types: Vec<Vec<u32>>,
        strings: Vec<u8>,
    }

    fn le(words: &[u32]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    impl Builder {
        fn name(&mut self, s: &str) -> u32 {
            if self.strings.is_empty() {
                self.strings.push(0); // offset 0 is the empty name
            }
            if s.is_empty() {
                return 0;
            }
            self.strings.extend(s.bytes().chain([0]));
            (self.strings.len() - s.len() - 1) as u32
        }

        /// Appends a type; returns its id.
        fn ty(&mut self, name: &str, kind: u32, vlen: u32, size_or_type: u32, rest: &[u32]) -> u32 {
            let words = [self.name(name), kind << 24 | vlen, size_or_type];
            self.types.push(words.iter().chain(rest).copied().collect());
            self.types.len() as u32
        }

        fn blob(&self) -> Vec<u8> {
            let types = le(&self.types.concat());
            let (t, s) = (types.len() as u32, self.strings.len() as u32);
            // Magic 0xEB9F, version 1, flags 0; then hdr_len and the sections, strings last.
            let mut blob = le(&[0x1_eb9f, 24, 0, t, t, s]);
            blob.extend(types);
            blob.extend(&self.strings);
            blob
        }
    }

    /// A task_struct with `group_leader` at byte 8 (in an anonymous union) and `comm` at 24,
    /// after types of the other kinds the parser has to step over.
    fn task(struct_name: &str, comm_len: u32, leader_is_ptr: bool) -> Vec<u8> {
        let mut b = Builder::default();
        let int = b.ty("int", INT, 0, 4, &[0x0100_0020]);
        let char = b.ty("char", INT, 0, 1, &[0x0100_0008]);
        let [a, z, x, y] = ["A", "Z", "x", "y"].map(|n| b.name(n));
        b.ty("letters", ENUM, 2, 4, &[a, 0, z, 25]);
        b.ty("", FUNC_PROTO, 2, int, &[x, int, y, char]);
        let var = b.ty("jiffies", VAR, 0, int, &[1]);
        let proto = b.ty("", FUNC_PROTO, 0, 0, &[]);
        b.ty("bpf_preempt_disable", FUNC, 0, proto, &[]);
        b.ty(".data", DATASEC, 1, 4, &[var, 0, 4]);
        b.ty("task_struct", FWD, 0, 0, &[]);
        let ptr = b.ty("", PTR, 0, 0, &[]); // to task_struct, once that has an id
        let const_ptr = b.ty("", CONST, 0, ptr, &[]);
        let leader = b.ty("task_ptr", TYPEDEF, 0, const_ptr, &[]);
        let leader = if leader_is_ptr { leader } else { int };
        let comm = b.ty("", ARRAY, 0, 0, &[char, int, comm_len]);
        let [cookie, gl, state, flags, cm] =
            ["cookie", "group_leader", "state", "flags", "comm"].map(|n| b.name(n));
        let union = b.ty("", UNION, 2, 8, &[cookie, int, 0, gl, leader, 0]);
        // kind_flag: `flags` is a 3-bit bitfield at bit 32.
        let members = [
            state, int, 0, flags, int, 0x300_0020, 0, union, 64, cm, comm, 192,
        ];
        let task = b.ty(struct_name, STRUCT | KFLAG, 4, 40, &members);
        b.types[ptr as usize - 1][2] = task;
        b.blob()
    }

    fn assert_err(data: &[u8], wanted: &str) {
        match parse_task_offsets(data) {
            Err(Error::Btf(e)) => assert!(e.contains(wanted), "{e:?} lacks {wanted:?}"),
            other => panic!("{other:?}, wanted an error about {wanted:?}"),
        }
    }

    #[test]
    fn finds_members_inside_anonymous_unions() {
        let found = parse_task_offsets(&task("task_struct", 16, true)).unwrap();
        assert_eq!((found.group_leader, found.comm), (8, 24));
    }

    #[test]
    fn finds_functions_by_name() {
        let blob = task("task_struct", 16, true);
        let ids = parse_func_ids(&blob, ["bpf_preempt_enable", "bpf_preempt_disable", "int"]);
        // The function is the 7th type (after int, char, the enum, a prototype, the variable
        // and its own prototype); `int` is no function, and enable is missing.
        assert_eq!(ids.unwrap(), [None, Some(7), None]);
    }

    #[test]
    fn rejects_bad_magic_and_big_endian() {
        let mut blob = task("task_struct", 16, true);
        blob.swap(0, 1);
        assert_err(&blob, "big-endian");
        blob[0] = 0;
        assert_err(&blob, "bad magic");
    }

    #[test]
    fn every_truncation_is_an_error() {
        let blob = task("task_struct", 16, true);
        for len in 0..blob.len() {
            assert!(parse_task_offsets(&blob[..len]).is_err(), "{len} bytes");
        }
    }

    #[test]
    fn rejects_wrong_member_types() {
        assert_err(
            &task("task_struct", 8, true),
            "comm (an array of 8 elements",
        );
        assert_err(
            &task("task_struct", 16, false),
            "group_leader (kind 1, not a pointer",
        );
    }

    #[test]
    fn rejects_a_missing_task_struct() {
        assert_err(
            &task("task_struct2", 16, true),
            "no complete struct task_struct",
        );
    }

    #[test]
    fn running_kernel() {
        if !std::path::Path::new(VMLINUX).exists() {
            assert!(std::env::var_os("CI").is_none(), "CI must have {VMLINUX}");
            println!("SKIPPED no {VMLINUX}");
            return;
        }
        let found = task_offsets().unwrap();
        println!("{found:?}");
        let [a, b] = func_ids(["schedule", "no_such_function_here"]).unwrap();
        assert!(a.is_some() && b.is_none(), "{a:?} {b:?}");
        let TaskOffsets { group_leader, comm } = found;
        assert!(group_leader != 0 && comm != 0 && group_leader != comm);
        assert!(!(group_leader..group_leader + 8).contains(&comm));
    }
}
