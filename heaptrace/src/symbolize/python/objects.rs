//! CPython objects read from the traced process: the code object's fields (their offsets
//! from `PyCode_Type`'s own member table, not hard-coded), its strings and its line table.
//! Every byte is the process's: each read is bounded and checked, and an object whose type
//! is not what it should be is not read.
use crate::heap::memory::Memory;

/// `PyTypeObject`'s fields read here: stable from 3.8 to 3.13.
const TP_NAME: u64 = 24;
const TP_BASICSIZE: u64 = 32;
const TP_MEMBERS: u64 = 240;
/// `PyObject.ob_type`, `PyVarObject.ob_size`.
const OB_TYPE: u64 = 8;
const OB_SIZE: u64 = 16;
/// `PyBytesObject.ob_sval`.
const BYTES_DATA: u64 = 32;
/// `PyMemberDef`: name, type, offset, flags, doc.
const MEMBER_SIZE: u64 = 40;
const MEMBER_OFFSET: u64 = 16;
/// Members read at most from a type (the code type has 14).
const MEMBERS_MAX: u64 = 64;
/// A name or file name longer than this is cut; a line table longer than this is not read.
pub const STRING_MAX: u64 = 1024;
pub const TABLE_MAX: u64 = 1 << 20;

/// Where a code object's fields are, for one interpreter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodeLayout {
    pub code_type: u64,
    /// `co_code_adaptive`: where the instructions start (`tp_basicsize`).
    pub instructions: u64,
    pub filename: u64,
    pub qualname: u64,
    pub first_line: u64,
    pub linetable: u64,
    pub strings: StringLayout,
}

/// `PyASCIIObject` and `PyCompactUnicodeObject`'s sizes: where a compact string's
/// characters start. 3.12 dropped `wstr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StringLayout {
    pub ascii_data: u64,
    pub compact_data: u64,
}

impl StringLayout {
    pub fn for_version(v: (u8, u8)) -> StringLayout {
        match v {
            (3, 11) => StringLayout {
                ascii_data: 48,
                compact_data: 72,
            },
            _ => StringLayout {
                ascii_data: 40,
                compact_data: 56,
            },
        }
    }
}

/// Whether the object at `addr` looks alive: its reference count (the split count of 3.12+
/// included, immortal objects' too) between 1 and 2^32 - 1. Freed, pymalloc's free list
/// writes a pointer or 0 there: a code object freed and not yet reused, and what it points
/// to, are not read as live.
fn alive(mem: &dyn Memory, addr: u64) -> bool {
    mem.u64_at(addr)
        .is_some_and(|n| (1..=u64::from(u32::MAX)).contains(&n))
}

fn u32_at(mem: &dyn Memory, addr: u64) -> Option<u32> {
    let mut b = [0u8; 4];
    mem.read(addr, &mut b).then(|| u32::from_le_bytes(b))
}

/// A NUL-terminated C string of at most `max` bytes.
fn c_string(mem: &dyn Memory, addr: u64, max: usize) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let mut chunk = [0u8; 32];
    while out.len() < max {
        let at = addr.checked_add(out.len() as u64)?;
        // A string near the end of a page: read the rest byte by byte.
        let n = if mem.read(at, &mut chunk) {
            chunk.len()
        } else if mem.read(at, &mut chunk[..1]) {
            1
        } else {
            return None;
        };
        if let Some(end) = chunk[..n].iter().position(|b| *b == 0) {
            out.extend_from_slice(&chunk[..end]);
            return Some(out);
        }
        out.extend_from_slice(&chunk[..n]);
    }
    None
}

impl CodeLayout {
    /// From `PyCode_Type` at `code_type`: its name must be "code", its members name the
    /// fields read.
    pub fn read(mem: &dyn Memory, code_type: u64, version: (u8, u8)) -> Option<CodeLayout> {
        let name = c_string(mem, mem.u64_at(code_type + TP_NAME)?, 16)?;
        if name != b"code" {
            return None;
        }
        let instructions = mem.u64_at(code_type + TP_BASICSIZE)?;
        let members = mem.u64_at(code_type + TP_MEMBERS)?;
        let (mut filename, mut qualname, mut first_line, mut linetable) = (None, None, None, None);
        for i in 0..MEMBERS_MAX {
            let m = members.checked_add(i * MEMBER_SIZE)?;
            let name_at = mem.u64_at(m)?;
            if name_at == 0 {
                break;
            }
            let offset = mem.u64_at(m + MEMBER_OFFSET)?;
            let slot = match c_string(mem, name_at, 32)?.as_slice() {
                b"co_filename" => &mut filename,
                b"co_qualname" => &mut qualname,
                b"co_firstlineno" => &mut first_line,
                b"co_linetable" => &mut linetable,
                _ => continue,
            };
            *slot = Some(offset);
        }
        let layout = CodeLayout {
            code_type,
            instructions,
            filename: filename?,
            qualname: qualname?,
            first_line: first_line?,
            linetable: linetable?,
            strings: StringLayout::for_version(version),
        };
        // Every field inside the object's fixed part.
        let fields = [
            layout.filename,
            layout.qualname,
            layout.first_line,
            layout.linetable,
        ];
        (instructions <= 4096 && fields.iter().all(|f| f + 8 <= instructions)).then_some(layout)
    }
}

/// A code object as read: what names its frames.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Code {
    /// Where its `co_qualname` was: with `first_line`, what tells it from a later code object
    /// at the same address (`heaptrace_common::python::identity_word`).
    pub qualname_at: u64,
    /// Its length and first text, as the walks read them (`heaptrace_common::python::
    /// name_words`).
    pub name_words: u64,
    pub qualname: String,
    pub filename: String,
    pub first_line: i32,
    pub linetable: Vec<u8>,
}

impl Code {
    /// The code object at `addr`, if it is one.
    pub fn read(mem: &dyn Memory, layout: &CodeLayout, addr: u64) -> Option<Code> {
        if !alive(mem, addr) || mem.u64_at(addr.checked_add(OB_TYPE)?)? != layout.code_type {
            return None;
        }
        let field = |off: u64| mem.u64_at(addr + off).filter(|at| alive(mem, *at));
        let qualname_at = field(layout.qualname)?;
        let qualname = string(mem, &layout.strings, qualname_at)?;
        let name_words = heaptrace_common::python::name_words(
            mem.u64_at(qualname_at.checked_add(OB_SIZE)?)?,
            u32_at(mem, qualname_at + 32)?,
            mem.u64_at(qualname_at + layout.strings.ascii_data)
                .unwrap_or(0),
        );
        let filename = string(mem, &layout.strings, field(layout.filename)?)?;
        let first_line = u32_at(mem, addr + layout.first_line)? as i32;
        let linetable = bytes(mem, field(layout.linetable)?, TABLE_MAX)?;
        Some(Code {
            qualname_at,
            name_words,
            qualname,
            filename,
            first_line,
            linetable,
        })
    }

    /// The line of the instruction `unit` code units from the start of the instructions.
    pub fn line(&self, unit: u32) -> Option<i32> {
        super::linetable::line_of(&self.linetable, self.first_line, unit)
    }
}

/// A `str` object's text: compact strings only (what the compiler makes of names and file
/// names); cut at `STRING_MAX` characters.
pub fn string(mem: &dyn Memory, strings: &StringLayout, addr: u64) -> Option<String> {
    let length = mem.u64_at(addr.checked_add(OB_SIZE)?)?;
    let state = u32_at(mem, addr + 32)?;
    let (kind, compact, ascii) = ((state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1);
    if compact == 0 || !matches!(kind, 1 | 2 | 4) || length > 1 << 30 {
        return None;
    }
    let data = addr
        + if ascii == 1 {
            strings.ascii_data
        } else {
            strings.compact_data
        };
    let n = length.min(STRING_MAX);
    let mut raw = vec![0u8; (n * u64::from(kind)) as usize];
    if !mem.read(data, &mut raw) {
        return None;
    }
    let chars = raw.chunks(kind as usize).map(|c| {
        let mut v = [0u8; 4];
        v[..c.len()].copy_from_slice(c);
        char::from_u32(u32::from_le_bytes(v)).unwrap_or(char::REPLACEMENT_CHARACTER)
    });
    Some(chars.collect())
}

/// A `bytes` object's contents, if at most `max` long.
fn bytes(mem: &dyn Memory, addr: u64, max: u64) -> Option<Vec<u8>> {
    let size = mem.u64_at(addr.checked_add(OB_SIZE)?)?;
    if size > max {
        return None;
    }
    let mut out = vec![0u8; size as usize];
    mem.read(addr + BYTES_DATA, &mut out).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes at addresses: a code object at 0x1000, strings at 0x2000 and 0x3000, a line
    /// table at 0x4000 (3.12 layout).
    struct Fake(std::collections::BTreeMap<u64, Vec<u8>>);

    impl Memory for Fake {
        fn read(&self, addr: u64, buf: &mut [u8]) -> bool {
            let Some((base, bytes)) = self.0.range(..=addr).next_back() else {
                return false;
            };
            let at = (addr - base) as usize;
            let Some(src) = bytes.get(at..at + buf.len()) else {
                return false;
            };
            buf.copy_from_slice(src);
            true
        }
    }

    fn object(refcnt: u64, ty: u64, size: u64, rest: &[u8]) -> Vec<u8> {
        let mut v = [refcnt, ty, size].map(u64::to_le_bytes).concat();
        v.extend_from_slice(rest);
        v
    }

    fn ascii(refcnt: u64, text: &str) -> Vec<u8> {
        // hash, then state: kind 1, compact, ascii
        let mut rest = [u64::MAX.to_le_bytes(), 0x64u64.to_le_bytes()].concat();
        rest.extend_from_slice(text.as_bytes());
        rest.resize(rest.len() + 8, 0);
        object(refcnt, 0x77, text.len() as u64, &rest)
    }

    const LAYOUT: CodeLayout = CodeLayout {
        code_type: 0x55,
        instructions: 192,
        filename: 112,
        qualname: 128,
        first_line: 68,
        linetable: 136,
        strings: StringLayout {
            ascii_data: 40,
            compact_data: 56,
        },
    };

    fn memory(code_refcnt: u64, name_refcnt: u64) -> Fake {
        let mut code = vec![0u8; 200];
        code[..8].copy_from_slice(&code_refcnt.to_le_bytes());
        code[8..16].copy_from_slice(&0x55u64.to_le_bytes());
        code[68..72].copy_from_slice(&7u32.to_le_bytes());
        code[112..120].copy_from_slice(&0x3000u64.to_le_bytes());
        code[128..136].copy_from_slice(&0x2000u64.to_le_bytes());
        code[136..144].copy_from_slice(&0x4000u64.to_le_bytes());
        let table = object(1, 0x66, 0, &[0u8; 16]);
        Fake(
            [
                (0x1000, code),
                (0x2000, ascii(name_refcnt, "f3")),
                (0x3000, ascii(1, "gen3.py")),
                (0x4000, table),
            ]
            .into_iter()
            .collect(),
        )
    }

    #[test]
    fn a_live_code_object_is_read_and_a_freed_one_is_not() {
        let c = Code::read(&memory(1, 2), &LAYOUT, 0x1000).unwrap();
        assert_eq!(
            (c.qualname.as_str(), c.filename.as_str()),
            ("f3", "gen3.py")
        );
        assert_eq!(c.first_line, 7);
        let text = u64::from_le_bytes(*b"f3\0\0\0\0\0\0");
        assert_eq!(
            c.name_words,
            heaptrace_common::python::name_words(2, 0x64, text)
        );
        // Immortal (3.12's split count) is alive.
        assert!(Code::read(&memory(0xffff_ffff, 2), &LAYOUT, 0x1000).is_some());
        // Freed: pymalloc's free list wrote 0 or a pointer over the count.
        assert!(Code::read(&memory(0, 2), &LAYOUT, 0x1000).is_none());
        assert!(Code::read(&memory(0x7f12_3456_7000, 2), &LAYOUT, 0x1000).is_none());
        // Its name freed: not read either.
        assert!(Code::read(&memory(1, 0x5555_0000_1000), &LAYOUT, 0x1000).is_none());
    }
}
