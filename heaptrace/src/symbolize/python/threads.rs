//! A thread's Python frames read from user space, as the kernel's walk will read them:
//! `_PyRuntime` -> interpreters -> their thread states (the one whose `native_thread_id` is
//! the thread's) -> its innermost frame -> each caller's. Bounded at every step; a loop or a
//! pointer into nothing ends the walk.
use super::{
    objects::CodeLayout,
    offsets::{FramePath, OWNED_BY_CSTACK, Offsets},
    runtime::Runtime,
};
use crate::heap::memory::Memory;

/// Interpreters, threads and frames followed at most.
const INTERPRETERS_MAX: usize = 8;
const THREADS_MAX: usize = 1024;
pub const FRAMES_MAX: usize = 128;

/// One Python frame: its code object and the instruction under way (in 2-byte code units
/// from the start of the code's instructions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyFrame {
    pub code: u64,
    pub unit: u32,
    /// The first Python frame of a C-level evaluation (`_PyEval_EvalFrameDefault` call):
    /// where the native stack's next evaluation frame takes over.
    pub entry: bool,
}

/// The thread state of the thread whose id in its pid namespace is `tid`.
pub fn thread_state(mem: &dyn Memory, rt: &Runtime, off: &Offsets, tid: u32) -> Option<u64> {
    let mut interp = mem.u64_at(rt.runtime + off.interpreters_head)?;
    for _ in 0..INTERPRETERS_MAX {
        if interp == 0 {
            return None;
        }
        let mut t = mem.u64_at(interp + off.threads_head)?;
        for _ in 0..THREADS_MAX {
            if t == 0 {
                break;
            }
            let mut id = [0u8; 4];
            if mem.read(t + off.native_thread_id, &mut id) && u32::from_le_bytes(id) == tid {
                return Some(t);
            }
            t = mem.u64_at(t + off.thread_next)?;
        }
        interp = mem.u64_at(interp + off.interpreter_next)?;
    }
    None
}

/// The Python frames of thread state `tstate`, innermost first.
pub fn frames(mem: &dyn Memory, off: &Offsets, code: &CodeLayout, tstate: u64) -> Vec<PyFrame> {
    let mut out = Vec::new();
    let mut frame = match off.frame {
        FramePath::ThroughCFrame {
            cframe,
            current_frame,
        } => mem
            .u64_at(tstate + cframe)
            .filter(|c| *c != 0)
            .and_then(|c| mem.u64_at(c + current_frame)),
        FramePath::Direct { current_frame } => mem.u64_at(tstate + current_frame),
    }
    .unwrap_or(0);
    for _ in 0..FRAMES_MAX * 2 {
        if frame == 0 || out.len() == FRAMES_MAX {
            break;
        }
        let byte = |at: u64| {
            let mut b = [0u8; 1];
            mem.read(frame + at, &mut b).then_some(b[0])
        };
        let (Some(owner), Some(co), Some(ip)) = (
            byte(off.owner),
            mem.u64_at(frame + off.code),
            mem.u64_at(frame + off.instruction),
        ) else {
            break;
        };
        if owner != OWNED_BY_CSTACK {
            let start = co + code.instructions;
            // Before the first instruction (a frame just pushed): its first.
            let unit = ip
                .checked_sub(start)
                .map_or(0, |d| (d / 2).min(u64::from(u32::MAX)));
            let entry = off.is_entry.and_then(byte).is_some_and(|e| e != 0);
            out.push(PyFrame {
                code: co,
                unit: unit as u32,
                entry,
            });
        } else if let Some(last) = out.last_mut() {
            // 3.12+: the shim below a C-level evaluation's first frame.
            last.entry = true;
        }
        frame = mem.u64_at(frame + off.previous).unwrap_or(0);
    }
    out
}
