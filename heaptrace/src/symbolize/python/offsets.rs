//! Where CPython keeps its threads and frames, per minor version: the few fields a walk from
//! `_PyRuntime` to each thread's frames reads. Taken from the pyenv builds' DWARF
//! (`gdb -ex 'p &((PyThreadState*)0)->native_thread_id'`, 3.11.7, 3.12.1, 3.13.0) and checked
//! on each by `tests/integration/python_code.rs`, Debian's stripped 3.11 included.

/// Offsets of one CPython minor version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Offsets {
    /// `_PyRuntimeState.interpreters.head`.
    pub interpreters_head: u64,
    /// `PyInterpreterState.threads.head`, `.next` (the next interpreter).
    pub threads_head: u64,
    pub interpreter_next: u64,
    /// `PyThreadState.next`, `.native_thread_id` (the thread's id in its pid namespace).
    pub thread_next: u64,
    pub native_thread_id: u64,
    /// How a thread state leads to its innermost frame: `cframe->current_frame` (3.11,
    /// 3.12), or `current_frame` itself (3.13).
    pub frame: FramePath,
    /// `_PyInterpreterFrame`: the code object (`f_code`, 3.13's `f_executable`), the caller's
    /// frame, and the instruction (`prev_instr`: the last begun, 3.11 and 3.12; 3.13's
    /// `instr_ptr`).
    pub code: u64,
    pub previous: u64,
    pub instruction: u64,
    /// 3.13's `instr_ptr` is the instruction under way; `prev_instr` too (the call's).
    /// `owner`: a frame owned by the C stack (3.12+, `FRAME_OWNED_BY_CSTACK`) is a shim
    /// between two C-level evaluations, not Python code.
    pub owner: u64,
    /// 3.11's `is_entry`: the first Python frame of a C-level evaluation.
    pub is_entry: Option<u64>,
    /// The code object's instructions (`co_code_adaptive`), `co_firstlineno` and
    /// `co_qualname`: what the walk reads before the code type's own members can be read
    /// (a shared libpython's are relocated only after the kernel's first allocations);
    /// checked against them then (`objects::CodeLayout`).
    pub code_start: u64,
    pub first_line: u64,
    pub qualname: u64,
    /// `_PyRuntimeState`'s gilstate `autoTSSkey` (3.11's `gilstate.autoTSSkey`): the key
    /// under which each thread keeps its own thread state.
    pub tss_key: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FramePath {
    /// `*(*(tstate + cframe) + current_frame)`.
    ThroughCFrame { cframe: u64, current_frame: u64 },
    /// `*(tstate + current_frame)`.
    Direct { current_frame: u64 },
}

/// `_PyFrameOwner::FRAME_OWNED_BY_CSTACK`.
pub const OWNED_BY_CSTACK: u8 = 3;

impl Offsets {
    pub fn for_version(v: (u8, u8)) -> Option<Offsets> {
        Some(match v {
            (3, 11) => Offsets {
                interpreters_head: 40,
                threads_head: 16,
                interpreter_next: 0,
                thread_next: 8,
                native_thread_id: 160,
                frame: FramePath::ThroughCFrame {
                    cframe: 56,
                    current_frame: 8,
                },
                code: 32,
                previous: 48,
                instruction: 56,
                owner: 69,
                is_entry: Some(68),
                code_start: 184,
                first_line: 72,
                qualname: 128,
                tss_key: 592,
            },
            (3, 12) => Offsets {
                interpreters_head: 40,
                threads_head: 72,
                interpreter_next: 0,
                thread_next: 8,
                native_thread_id: 144,
                frame: FramePath::ThroughCFrame {
                    cframe: 56,
                    current_frame: 0,
                },
                code: 0,
                previous: 8,
                instruction: 56,
                owner: 70,
                is_entry: None,
                code_start: 192,
                first_line: 68,
                qualname: 128,
                tss_key: 1544,
            },
            (3, 13) => Offsets {
                interpreters_head: 632,
                threads_head: 7344,
                interpreter_next: 7264,
                thread_next: 8,
                native_thread_id: 160,
                frame: FramePath::Direct { current_frame: 72 },
                code: 0,
                previous: 8,
                instruction: 56,
                owner: 70,
                is_entry: None,
                code_start: 200,
                first_line: 68,
                qualname: 128,
                tss_key: 2160,
            },
            _ => return None,
        })
    }
}

impl Offsets {
    /// Whether the code object's fields here are those the code type itself names.
    pub fn agrees(&self, layout: &super::objects::CodeLayout) -> bool {
        (self.code_start, self.first_line, self.qualname)
            == (layout.instructions, layout.first_line, layout.qualname)
    }
}
