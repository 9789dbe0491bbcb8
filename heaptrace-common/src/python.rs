//! Python frames in stored stacks, as both sides see them: user space finds a process's
//! CPython and writes where its threads and frames are ([`PyProc`], `PY_PROCS`); the stack
//! walk then appends, after the native frames, [`PY_MARK`] and two words per Python frame
//! ([`frame_word`], [`identity_word`]), innermost first. User space names them from the code
//! objects and splices them in at the native frames of `_PyEval_EvalFrameDefault`.

/// Not an address (user addresses are below 2^47): the native frames end here, Python
/// frames follow.
pub const PY_MARK: u64 = u64::MAX - 2;

/// Python frames a walk appends at most (each takes two words of the stack).
pub const PY_FRAMES_MAX: u32 = 40;

/// How a thread state leads to its innermost frame (`PyProc::frame_path`).
pub const PATH_CFRAME: u32 = 0;
pub const PATH_DIRECT: u32 = 1;

/// One process's interpreter, for the walk (`PY_PROCS`, by tgid). Offsets from the version's
/// table (`symbolize/python/offsets.rs` in heaptrace) and the code type's own members.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyProc {
    /// `_PyRuntime`'s address.
    pub runtime: u64,
    /// The pid namespace's device and inode (`bpf_get_ns_current_pid_tgid`): a thread's
    /// `native_thread_id` is its id there. Both 0 for the initial namespace, where that id
    /// is the global one.
    pub ns_dev: u64,
    pub ns_ino: u64,
    pub interpreters_head: u32,
    pub threads_head: u32,
    pub interpreter_next: u32,
    pub thread_next: u32,
    pub native_thread_id: u32,
    /// [`PATH_CFRAME`]: `*(*(tstate + cframe) + current_frame)`; [`PATH_DIRECT`]:
    /// `*(tstate + current_frame)`.
    pub frame_path: u32,
    pub cframe: u32,
    pub current_frame: u32,
    pub code: u32,
    pub previous: u32,
    pub instruction: u32,
    pub owner: u32,
    /// 3.11's `is_entry`, or `u32::MAX`.
    pub is_entry: u32,
    /// Where a code object's instructions start (`tp_basicsize`), and its
    /// `co_firstlineno`'s and `co_qualname`'s offsets.
    pub code_start: u32,
    pub first_line: u32,
    pub qualname: u32,
    /// Where `_PyRuntime` keeps the pthread key of each thread's own state (its gilstate
    /// `Py_tss_t`: an `int` set to 1 once made, then the key): the in-process walk asks
    /// `pthread_getspecific` for its thread's state. The kernel walk finds it by thread id.
    pub tss_key: u32,
    /// Where a compact ASCII `str`'s text starts (48 in 3.11, 40 from 3.12): the first 8
    /// bytes of a `co_qualname` go into its frames' identity ([`name_words`]).
    pub str_data: u32,
    pub _pad: u32,
}

const _: () = assert!(core::mem::size_of::<PyProc>() == 24 + 4 * 20);

/// `_PyFrameOwner::FRAME_OWNED_BY_CSTACK`: a shim frame between two C-level evaluations.
pub const OWNED_BY_CSTACK: u8 = 3;

const TAG: u64 = 1 << 63;
const ENTRY: u64 = 1 << 62;
const UNIT_BITS: u32 = 18;
const UNIT_MAX: u64 = (1 << UNIT_BITS) - 1;
const CODE_MASK: u64 = (1 << 44) - 1;

/// A frame's first word: its code object (8-byte aligned, below 2^47), its instruction
/// (code units from the start, saturated at 2^18 - 1) and whether it is its evaluation's
/// first.
#[inline(always)]
pub fn frame_word(code: u64, unit: u64, entry: bool) -> u64 {
    let unit = if unit > UNIT_MAX { UNIT_MAX } else { unit };
    TAG | if entry { ENTRY } else { 0 } | ((code >> 3) & CODE_MASK) << UNIT_BITS | unit
}

/// What a frame's identity keeps of its `co_qualname`'s text: the string's length (its word at
/// offset 16) and, where its state (the 32-bit word at 32) says compact ASCII, its first 8
/// bytes (at [`PyProc::str_data`]). A name's object freed and its address taken by another
/// name's (a function defined and dropped, the next one defined) then tells them apart; its
/// address alone did not.
#[inline(always)]
pub fn name_words(length: u64, state: u32, text: u64) -> u64 {
    let ascii = state & (3 << 5) == 3 << 5;
    length.rotate_left(40) ^ if ascii { text } else { 0 }
}

/// A frame's second word: what the code object was when walked (`co_firstlineno`, and its
/// `co_qualname`'s address and [`name_words`] mixed), for user space to tell a code object
/// from a later one at the same address.
#[inline(always)]
pub fn identity_word(first_line: u32, qualname: u64, name: u64) -> u64 {
    let mut h = (qualname >> 3) ^ name.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^= h >> 31;
    TAG | u64::from(first_line & 0x7fff_ffff) << 32 | h & 0xffff_ffff
}

/// A frame read back: (code object, instruction unit, entry, identity).
pub fn read_frame(word: u64, identity: u64) -> Option<(u64, u32, bool, u64)> {
    if word & TAG == 0 || identity & TAG == 0 {
        return None;
    }
    let code = ((word >> UNIT_BITS) & CODE_MASK) << 3;
    Some((
        code,
        (word & UNIT_MAX) as u32,
        word & ENTRY != 0,
        identity & !TAG,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let code = 0x7f12_3456_7890u64 & !7;
        let w = frame_word(code, 1234, true);
        let name = name_words(2, 0x64, u64::from_le_bytes(*b"f3\0\0\0\0\0\0"));
        let id = identity_word(42, 0x7f00_0000_1238, name);
        let (c, u, e, i) = read_frame(w, id).unwrap();
        assert_eq!((c, u, e), (code, 1234, true));
        assert_eq!(i, id & !TAG);
        // Another name at the same address, of the same length, is another identity.
        let other = name_words(2, 0x64, u64::from_le_bytes(*b"f5\0\0\0\0\0\0"));
        assert_ne!(identity_word(42, 0x7f00_0000_1238, other), id);
        // Not ASCII: the length alone.
        assert_eq!(name_words(2, 0x28, 1), name_words(2, 0x28, 2));
        assert_ne!(w, 0);
        assert_ne!(w, PY_MARK);
        assert_eq!(
            read_frame(frame_word(code, 1 << 30, false), id).unwrap().1,
            (1 << 18) - 1
        );
        assert_eq!(read_frame(0x1234, id), None);
    }
}
