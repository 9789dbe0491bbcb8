//! Where in a function to put its entry uprobe.
//!
//! A uprobe is an int3. On the trap the kernel either *emulates* the replaced instruction
//! (push of a register, nop, jmp/call rel, jcc: one trap) or copies it to an out-of-line slot
//! and *single-steps* it (a second trap; BENCHMARKS.md has what it costs here). glibc's `free`
//! starts with `test %rdi,%rdi; je` (single-stepped) and reaches `push %rbp` at +9 on every
//! non-NULL call, where a probe takes one trap. This module decodes a function's first bytes and picks the first
//! instruction the kernel emulates that every call we must observe runs through, provided that
//! nothing executed before it changes what the program reads (the argument registers, rsp
//! beyond counted pushes). Anything it does not understand keeps the probe at the entry.
//!
//! The rules mirror arch/x86/kernel/uprobes.c (`branch_setup_xol_ops`, `push_setup_xol_ops`).
//!
//! What it cannot see: a jump from elsewhere into the bytes between the entry and the probe
//! point would bypass the probe (or, onto the probe point itself, reach it with another push
//! count). Compilers do not jump into another function's prologue; no direct jump or call in
//! glibc 2.36 or jemalloc 5.3 targets free+1 up to its probe point.
use heaptrace_common::Func;
use iced_x86::{
    Decoder, DecoderOptions, FlowControl, Formatter as _, GasFormatter, Instruction,
    InstructionInfoFactory, OpAccess, Register,
};

/// Bytes of a function decoded: a prologue's first instructions.
pub const WINDOW: usize = 64;

/// Where an entry probe goes and why.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Placement {
    /// From the function's start; always the start of an instruction this module decoded.
    pub offset: u64,
    /// Pushes executed before `offset` on the path the probe sees: the program adds 8 per push
    /// to the stack pointer it sees to get the one at function entry.
    pub pushes: u32,
    /// The instruction at `offset` (GNU syntax), `(bad)` if it did not decode.
    pub instruction: String,
    pub why: String,
}

/// The registers the entry program of `func` reads (heaptrace-ebpf's `*_entry`, System V
/// argument order). Instructions run before the probe point must not write them.
pub fn reads(func: Func) -> &'static [Register] {
    match func {
        Func::Malloc | Func::Valloc | Func::Pvalloc | Func::Free => &[Register::RDI],
        Func::Calloc | Func::Realloc => &[Register::RDI, Register::RSI],
        Func::PosixMemalign => &[Register::RDI, Register::RDX],
        Func::AlignedAlloc | Func::Memalign => &[Register::RSI],
    }
}

/// At the entry, whatever is there.
pub fn entry(code: &[u8], why: impl Into<String>) -> Placement {
    let first = decode_all(code).into_iter().next();
    let mut why = why.into();
    if first.is_some_and(|i| !i.is_invalid() && is_nop5(&code[..i.len()])) {
        why.push_str(NOP5);
    }
    Placement {
        offset: 0,
        pushes: 0,
        instruction: first.map_or_else(|| "(bad)".to_string(), |i| gas(&i)),
        why,
    }
}

/// Chooses the entry probe's place in a function whose first bytes are `code`.
///
/// `uretprobe`: the function also has a return probe. The kernel plants it by overwriting the
/// return address at [rsp] when its trap is hit, so it may sit past the entry only while no
/// instruction has moved rsp, and an entry probe at the same address shares its trap: both go
/// on the first emulated instruction before anything writes rsp (or the arguments). glibc's
/// posix_memalign, aligned_alloc, valloc and pvalloc begin with a `cmpb` the kernel
/// single-steps, a second trap (BENCHMARKS.md, *Probe placement*).
///
/// `free` may skip a leading `test %rdi,%rdi; je` NULL check: free(NULL) is not counted, so a
/// probe that only fires on the non-NULL path loses nothing.
pub fn choose(code: &[u8], func: Func, uretprobe: bool, reads: &[Register]) -> Placement {
    let insns = decode_all(code);
    // A function with a uretprobe skips no NULL check: every call must plant it.
    let (spot, stopped) = walk(&insns, code, func == Func::Free && !uretprobe, reads);
    // Past a push the return address is no longer at [rsp] (the walk passes none without a
    // NULL check to skip, but this is what the uretprobe rests on).
    let Some(spot) = spot.filter(|s| !uretprobe || s.pushes == 0) else {
        let why = if uretprobe {
            format!("entry: its uretprobe needs the return address at [rsp]; {stopped}")
        } else {
            format!("entry: {stopped}")
        };
        return entry(code, why);
    };
    let insn = &insns[spot.index];
    let mut why = if insn.ip() == 0 {
        "entry: the kernel emulates it".to_string()
    } else {
        let regs: Vec<String> = reads.iter().map(|r| format!("%{}", name(*r))).collect();
        format!(
            "the first instruction the kernel emulates; none before it writes {} or %rsp",
            regs.join(", ")
        )
    };
    if uretprobe {
        why.push_str("; its uretprobe shares this trap (the return address is at [rsp])");
    }
    if let Some(target) = spot.null_target {
        // The NULL path must not reach the probe (it would see a different push count).
        if target <= insn.ip() {
            return entry(
                code,
                format!(
                    "entry: the NULL check's branch to +{target} may reach +{}",
                    insn.ip()
                ),
            );
        }
        why.push_str("; past the NULL check (free(NULL) does not trap)");
    }
    if spot.pushes > 0 {
        why.push_str(&format!("; {} push(es) before it", spot.pushes));
    }
    if is_nop5(&code[insn.ip() as usize..insn.next_ip() as usize]) {
        why.push_str(NOP5);
    }
    Placement {
        offset: insn.ip(),
        pushes: spot.pushes,
        instruction: gas(insn),
        why,
    }
}

fn name(r: Register) -> String {
    format!("{r:?}").to_lowercase()
}

/// A candidate probe point.
#[derive(Clone, Copy, Debug)]
struct Spot {
    index: usize,
    pushes: u32,
    /// Where the skipped NULL check branches to, if the spot is past one.
    null_target: Option<u64>,
}

/// Walks the decoded instructions from the entry. Returns the spot found (None: stay at the
/// entry) and, when the walk stopped early, why.
fn walk(
    insns: &[Instruction],
    code: &[u8],
    skip_null_check: bool,
    reads: &[Register],
) -> (Option<Spot>, String) {
    let mut info = InstructionInfoFactory::new();
    let mut pushes = 0u32;
    // The first emulated instruction; taken unless a NULL check with a better spot follows.
    let mut first: Option<Spot> = None;
    let mut null_target: Option<u64> = None;
    for (i, insn) in insns.iter().enumerate() {
        if insn.is_invalid() {
            return (first, format!("undecodable bytes at +{}", insn.ip()));
        }
        let at = format!("+{} `{}`", insn.ip(), gas(insn));
        let raw = &code[insn.ip() as usize..insn.next_ip() as usize];
        let here = Spot {
            index: i,
            pushes,
            null_target,
        };
        if let Some(kind) = emulated(raw) {
            // Nothing past it is cheaper: the kernel turns a probe there into a call.
            if !skip_null_check || null_target.is_some() || is_nop5(raw) {
                return (Some(here), String::new());
            }
            first.get_or_insert(here);
            match kind {
                _ if is_null_check(insns, i) => null_target = Some(insn.near_branch_target()),
                // Neither changes a register the program reads; rsp is counted.
                Emulated::Push => pushes += 1,
                Emulated::Nop => {}
                Emulated::Branch => return (first, format!("branch {at} comes first")),
            }
            continue;
        }
        if insn.flow_control() != FlowControl::Next {
            return (first, format!("branch {at} comes first"));
        }
        let written = info.info(insn).used_registers().iter().find(|u| {
            let r = u.register().full_register();
            writes(u.access()) && (r == Register::RSP || reads.contains(&r))
        });
        if let Some(u) = written {
            let r = name(u.register().full_register());
            return (first, format!("{at} writes %{r} first"));
        }
    }
    (
        first,
        format!("no emulated instruction in the first {} bytes", code.len()),
    )
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Emulated {
    Push,
    Nop,
    Branch,
}

/// Whether the kernel emulates this instruction instead of single-stepping it, by its bytes,
/// as arch/x86/kernel/uprobes.c decides (a narrower set is safe: it only costs speed).
fn emulated(raw: &[u8]) -> Option<Emulated> {
    // push %reg: 50+r, or 41 50+r for r8-r15, nothing else.
    match raw {
        [0x50..=0x57] | [0x41, 0x50..=0x57] => return Some(Emulated::Push),
        [0x90] | [0x66, 0x90] => return Some(Emulated::Nop),
        _ => {}
    }
    // Legacy prefixes the kernel accepts on nops and branches (no 0x66 on branches); a
    // segment or lock prefix makes it refuse the probe altogether.
    let opcode = raw.iter().position(|b| !matches!(b, 0x66 | 0x67 | 0xf2))?;
    let prefixes = &raw[..opcode];
    match &raw[opcode..] {
        [0x0f, 0x1f, ..] => Some(Emulated::Nop),
        _ if prefixes.contains(&0x66) => None,
        [0xeb, _] | [0xe9, _, _, _, _] | [0xe8, _, _, _, _] => Some(Emulated::Branch),
        [0x70..=0x7f, _] | [0x0f, 0x80..=0x8f, _, _, _, _] => Some(Emulated::Branch),
        _ => None,
    }
}

/// A 5-byte nop, such as `gcc -pg -mfentry -mnop-mcount` puts at every function's entry. Linux
/// 6.18 and later rewrite a uprobe on one into a call to a trampoline after its first hit: the
/// probe then costs a syscall, not a trap (BENCHMARKS.md: about half).
fn is_nop5(raw: &[u8]) -> bool {
    raw.len() == 5 && emulated(raw) == Some(Emulated::Nop)
}

/// What a 5-byte nop at the probe point adds to the reason.
const NOP5: &str = "; a 5-byte nop: Linux 6.18+ turns the probe into a call (no trap)";

/// Instruction `i` is `je` right after `test %rdi,%rdi`. The walk stops at any earlier write to
/// rdi, so the test is of the pointer the caller passed.
fn is_null_check(insns: &[Instruction], i: usize) -> bool {
    use iced_x86::Code;
    let je = matches!(insns[i].code(), Code::Je_rel8_64 | Code::Je_rel32_64);
    let test = i.checked_sub(1).map(|p| &insns[p]).is_some_and(|t| {
        t.code() == Code::Test_rm64_r64
            && t.op0_register() == Register::RDI
            && t.op1_register() == Register::RDI
    });
    je && test
}

fn writes(a: OpAccess) -> bool {
    matches!(
        a,
        OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite
    )
}

/// Where a memory syscall's wrapper (libc's mmap, munmap, mremap, brk) is probed: after its
/// `syscall`, where the kernel's result is in rax and the arguments are still in their
/// registers (a syscall preserves them). On the first instruction past the syscall the kernel
/// emulates, if nothing before it writes rax, rsp or an argument heaptrace reads for that
/// syscall (glibc's `cmp $-4096,%rax` is single-stepped, its `ja` next is not); else on the
/// instruction right after the syscall. Only for a wrapper as glibc writes it: exactly one
/// `syscall`, right after a `mov $nr, %eax` of the expected number, with every instruction from
/// the start up to the probe decoded, and no branch in the function to the syscall or past it
/// up to the probe (a path that does not set the number, or makes no syscall, or skips the
/// probe, would be wrong). None otherwise: the caller then traces the syscall another way.
pub fn after_syscall(code: &[u8], nr: u32) -> Option<Placement> {
    let insns = decode_all(code);
    let (next, found) = the_syscall(&insns, nr)?;
    let syscall = found.offset - 2;
    let found = on_emulated_after(&insns, code, next, found, syscall_reads(nr));
    let jumps_in = insns.iter().any(|i| {
        matches!(
            i.flow_control(),
            FlowControl::ConditionalBranch | FlowControl::UnconditionalBranch | FlowControl::Call
        ) && (syscall..=found.offset).contains(&i.near_branch_target())
    });
    (!jumps_in).then_some(found)
}

/// The registers the program reads at a memory syscall's return that user space uses: the
/// result, and the arguments `heaptrace::reserve` looks at.
fn syscall_reads(nr: u32) -> &'static [Register] {
    use heaptrace_common::mem;
    match nr {
        mem::BRK => &[Register::RAX],
        mem::MUNMAP => &[Register::RAX, Register::RDI, Register::RSI],
        mem::MREMAP => &[Register::RAX, Register::RDI, Register::RSI, Register::RDX],
        _ => &[
            Register::RAX,
            Register::RDI,
            Register::RSI,
            Register::RDX,
            Register::R10,
        ],
    }
}

/// From the instruction right after the syscall (`insns[next]`, placed as `after`), on to the
/// first one the kernel emulates, through instructions that only go on to the next and write
/// neither rsp nor `reads`; `after` itself where the walk stops first.
fn on_emulated_after(
    insns: &[Instruction],
    code: &[u8],
    next: usize,
    after: Placement,
    reads: &[Register],
) -> Placement {
    let mut info = InstructionInfoFactory::new();
    for insn in &insns[next..] {
        if insn.is_invalid() {
            break;
        }
        let raw = &code[insn.ip() as usize..insn.next_ip() as usize];
        if emulated(raw).is_some() {
            if insn.ip() == after.offset {
                break;
            }
            return Placement {
                offset: insn.ip(),
                pushes: 0,
                instruction: gas(insn),
                why: format!(
                    "{}; on the first instruction past it the kernel emulates (none before it \
                     writes one of them)",
                    after.why
                ),
            };
        }
        let written = info.info(insn).used_registers().iter().any(|u| {
            let r = u.register().full_register();
            writes(u.access()) && (r == Register::RSP || reads.contains(&r))
        });
        if insn.flow_control() != FlowControl::Next || written {
            break;
        }
    }
    after
}

/// The one `syscall` of a wrapper, right after `mov $nr, %eax`: the index of the instruction
/// after it, and a probe there.
fn the_syscall(insns: &[Instruction], nr: u32) -> Option<(usize, Placement)> {
    let mut found = None;
    for (i, insn) in insns.iter().enumerate() {
        if insn.is_invalid() {
            return None;
        }
        if insn.code() != iced_x86::Code::Syscall {
            continue;
        }
        let sets_nr = i > 0 && {
            let mov = &insns[i - 1];
            mov.code() == iced_x86::Code::Mov_r32_imm32
                && mov.op0_register() == Register::EAX
                && mov.immediate32() == nr
        };
        let next = insns.get(i + 1).filter(|n| !n.is_invalid());
        match (&found, sets_nr, next) {
            (None, true, Some(next)) => {
                let at = Placement {
                    offset: next.ip(),
                    pushes: 0,
                    instruction: gas(next),
                    why: format!(
                        "after its syscall (`{}; syscall`): the result is in %rax, the \
                         arguments still in their registers",
                        gas(&insns[i - 1])
                    ),
                };
                found = Some((i + 1, at));
            }
            _ => return None,
        }
    }
    found
}

/// Decodes `code` up to its end; a final instruction cut off by the end is dropped, an
/// undecodable one is kept (invalid) so the walk stops there.
fn decode_all(code: &[u8]) -> Vec<Instruction> {
    let mut decoder = Decoder::with_ip(64, code, 0, DecoderOptions::NONE);
    let mut out = Vec::new();
    while decoder.can_decode() {
        let insn = decoder.decode();
        if insn.is_invalid() {
            if decoder.last_error() != iced_x86::DecoderError::NoMoreBytes {
                out.push(insn);
            }
            break;
        }
        out.push(insn);
    }
    out
}

fn gas(insn: &Instruction) -> String {
    if insn.is_invalid() {
        return "(bad)".into();
    }
    // Like objdump: hex immediates, rip-relative operands as such. Code is decoded at address 0,
    // so a branch target reads as an offset in the function.
    let mut f = GasFormatter::new();
    let o = f.options_mut();
    o.set_space_after_operand_separator(false);
    o.set_rip_relative_addresses(true);
    o.set_small_hex_numbers_in_decimal(false);
    o.set_branch_leading_zeros(false);
    o.set_uppercase_hex(false);
    let mut s = String::new();
    f.format(insn, &mut s);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_at(code: &[u8]) -> Placement {
        choose(code, Func::Free, false, reads(Func::Free))
    }

    /// glibc 2.36-9+deb12u14's free: test %rdi,%rdi; je; push %rbp; lea; push %rbx; sub.
    const GLIBC_FREE: &[u8] = &[
        0x48, 0x85, 0xff, 0x0f, 0x84, 0xbf, 0x00, 0x00, 0x00, 0x55, 0x48, 0x8d, 0x77, 0xf0, 0x53,
        0x48, 0x83, 0xec, 0x18,
    ];

    /// glibc 2.36-9+deb12u14's mmap (the first 28 bytes): mov %ecx,%r10d; test $0xfff,%r9d;
    /// jne; mov $9,%eax; syscall; cmp $-4096,%rax; ja; ret.
    const GLIBC_MMAP: &[u8] = &[
        0x41, 0x89, 0xca, 0x41, 0xf7, 0xc1, 0xff, 0x0f, 0x00, 0x00, 0x75, 0x14, 0xb8, 0x09, 0x00,
        0x00, 0x00, 0x0f, 0x05, 0x48, 0x3d, 0x00, 0xf0, 0xff, 0xff, 0x77, 0x25, 0xc3,
    ];

    /// Its munmap: mov $11,%eax; syscall; cmp $-4095,%rax; jae; ret.
    const GLIBC_MUNMAP: &[u8] = &[
        0xb8, 0x0b, 0x00, 0x00, 0x00, 0x0f, 0x05, 0x48, 0x3d, 0x01, 0xf0, 0xff, 0xff, 0x73, 0x01,
        0xc3,
    ];

    /// Its brk: mov $12,%eax; syscall; mov 0xd51e2(%rip),%rdx; mov %rax,(%rdx); cmp %rdi,%rax;
    /// jb; xor %eax,%eax; ret.
    const GLIBC_BRK: &[u8] = &[
        0xb8, 0x0c, 0x00, 0x00, 0x00, 0x0f, 0x05, 0x48, 0x8b, 0x15, 0xe2, 0x51, 0x0d, 0x00, 0x48,
        0x89, 0x02, 0x48, 0x39, 0xf8, 0x72, 0x0a, 0x31, 0xc0, 0xc3,
    ];

    #[test]
    fn syscall_wrappers_are_probed_on_the_first_emulated_instruction_after_their_syscall() {
        let at = |code, nr| after_syscall(code, nr).map(|p| (p.offset, p.instruction));
        // Past the single-stepped `cmp`, which only sets flags.
        assert_eq!(at(GLIBC_MMAP, 9), Some((25, "ja 0x40".to_string())));
        assert_eq!(at(GLIBC_MUNMAP, 11), Some((13, "jae 0x10".to_string())));
        let why = after_syscall(GLIBC_MUNMAP, 11).unwrap().why;
        assert!(why.contains("`mov $0xb,%eax; syscall`"), "{why}");
        assert!(why.contains("first instruction past it"), "{why}");
        // brk's result alone is read: the writes to %rdx and to memory are passed.
        assert_eq!(at(GLIBC_BRK, 12), Some((20, "jb 0x20".to_string())));
        // munmap's arguments are read: a write to %rdi keeps the probe right after the syscall.
        let mut code = GLIBC_MUNMAP[..7].to_vec();
        code.extend([0x48, 0x89, 0xc7, 0x73, 0x01, 0xc3]); // mov %rax,%rdi; jae; ret
        assert_eq!(at(&code, 11), Some((7, "mov %rax,%rdi".to_string())));
        // So does a non-emulated branch (`ret`) before any emulated instruction.
        let mut code = GLIBC_MUNMAP[..7].to_vec();
        code.extend([0xc3, 0x90]);
        assert_eq!(at(&code, 11), Some((7, "ret".to_string())));
    }

    #[test]
    fn a_wrapper_not_like_glibcs_is_not_probed() {
        // Another syscall number than the one expected.
        assert_eq!(after_syscall(GLIBC_MUNMAP, 9), None);
        // Two syscalls.
        assert_eq!(
            after_syscall(&[GLIBC_MUNMAP, GLIBC_MUNMAP].concat(), 11),
            None
        );
        // Cut right after the syscall: no instruction to put the probe on.
        assert_eq!(after_syscall(&GLIBC_MUNMAP[..7], 11), None);
        // The number set elsewhere than just before the syscall.
        assert_eq!(after_syscall(&[0x0f, 0x05, 0xc3], 11), None);
        // munmap followed by `jmp target` (rel8, from the end of the 16 bytes).
        let jumping_to = |target: i64| {
            let mut code = GLIBC_MUNMAP.to_vec();
            let rel = target - (code.len() as i64 + 2);
            code.extend([0xeb, rel as i8 as u8]);
            code
        };
        // A branch to the probe point, or to the instruction between it and the syscall: that
        // path made no syscall.
        assert_eq!(after_syscall(&jumping_to(13), 11), None);
        assert_eq!(after_syscall(&jumping_to(7), 11), None);
        // A branch to the syscall, past the number's mov.
        assert_eq!(after_syscall(&jumping_to(5), 11), None);
        // A branch elsewhere is fine.
        let elsewhere = after_syscall(&jumping_to(0), 11);
        assert_eq!(elsewhere.map(|p| p.offset), Some(13));
        // An undecodable byte before the syscall: the walk may be out of step.
        assert_eq!(
            after_syscall(&[&[0x06][..], GLIBC_MUNMAP].concat(), 11),
            None
        );
    }

    #[test]
    fn glibc_free_is_probed_at_its_push_past_the_null_check() {
        let p = free_at(GLIBC_FREE);
        assert_eq!((p.offset, p.pushes), (9, 0), "{p:?}");
        assert_eq!(p.instruction, "push %rbp");
        assert!(p.why.contains("NULL check"), "{}", p.why);
    }

    #[test]
    fn functions_with_a_uretprobe_share_its_trap_on_an_emulated_entry() {
        // glibc's malloc: push %r12; push %rbp; push %rbx; mov %rdi,%rbx; sub $0x10,%rsp.
        let malloc = [
            0x41, 0x54, 0x55, 0x53, 0x48, 0x89, 0xfb, 0x48, 0x83, 0xec, 0x10,
        ];
        let p = choose(&malloc, Func::Malloc, true, reads(Func::Malloc));
        assert_eq!((p.offset, p.pushes), (0, 0));
        assert_eq!(p.instruction, "push %r12");
        assert!(p.why.contains("uretprobe shares this trap"), "{}", p.why);
        // Without one, the entry push is already emulated.
        let p = choose(&malloc, Func::Malloc, false, reads(Func::Malloc));
        assert_eq!(p.offset, 0);
        assert!(p.why.contains("emulates"), "{}", p.why);
        // Behind endbr64 (a CET build), which is single-stepped, the push still has the return
        // address at [rsp].
        let p = choose(
            &[&[0xf3, 0x0f, 0x1e, 0xfa][..], &malloc].concat(),
            Func::Malloc,
            true,
            reads(Func::Malloc),
        );
        assert_eq!((p.offset, p.pushes), (4, 0), "{p:?}");
    }

    /// glibc's posix_memalign: cmpb $0x0,0x140201(%rip); push %r12; mov %rdx,%r12; push %rbp ...
    const GLIBC_POSIX_MEMALIGN: &[u8] = &[
        0x80, 0x3d, 0x01, 0x02, 0x14, 0x00, 0x00, 0x41, 0x54, 0x49, 0x89, 0xd4, 0x55, 0x48, 0x89,
        0xfd, 0x53, 0x48, 0x89, 0xf3, 0x74, 0x5a,
    ];

    /// glibc's aligned_alloc (= memalign): cmpb $0x0,0x140e71(%rip); je +0x10; jmp _mid_memalign;
    /// xchg %ax,%ax; sub $0x18,%rsp.
    const GLIBC_ALIGNED_ALLOC: &[u8] = &[
        0x80, 0x3d, 0x71, 0x0e, 0x14, 0x00, 0x00, 0x74, 0x07, 0xe9, 0x32, 0xf6, 0xff, 0xff, 0x66,
        0x90, 0x48, 0x83, 0xec, 0x18,
    ];

    #[test]
    fn a_uretprobe_goes_past_a_leading_cmpb_while_rsp_is_untouched() {
        let f = Func::PosixMemalign;
        let p = choose(GLIBC_POSIX_MEMALIGN, f, true, reads(f));
        assert_eq!((p.offset, p.pushes), (7, 0), "{p:?}");
        assert_eq!(p.instruction, "push %r12");
        assert!(p.why.contains("uretprobe shares this trap"), "{}", p.why);
        let f = Func::AlignedAlloc;
        let p = choose(GLIBC_ALIGNED_ALLOC, f, true, reads(f));
        assert_eq!((p.offset, p.pushes), (7, 0), "{p:?}");
        assert_eq!(p.instruction, "je 0x10");
    }

    #[test]
    fn a_uretprobe_stays_at_the_entry_once_rsp_moves_or_an_argument_is_written() {
        // sub $0x18,%rsp; push %rbx: past the sub, [rsp] is no longer the return address.
        let code = [0x48, 0x83, 0xec, 0x18, 0x53];
        let p = choose(&code, Func::Malloc, true, reads(Func::Malloc));
        assert_eq!(p.offset, 0, "{p:?}");
        assert!(
            p.why.contains("return address at [rsp]") && p.why.contains("writes %rsp"),
            "{}",
            p.why
        );
        // mov %rsi,%rdi; push %rbx: the program would read another size.
        let p = choose(
            &[0x48, 0x89, 0xf7, 0x53],
            Func::Malloc,
            true,
            reads(Func::Malloc),
        );
        assert_eq!(p.offset, 0, "{p:?}");
    }

    #[test]
    fn a_uretprobe_skips_no_null_check() {
        // test %rdi,%rdi; je +2; push %rbp: as free's would be skipped; here the je is the place,
        // which every call runs through.
        let code = [0x48, 0x85, 0xff, 0x74, 0x02, 0x55];
        let p = choose(&code, Func::Realloc, true, reads(Func::Realloc));
        assert_eq!((p.offset, p.pushes), (3, 0), "{p:?}");
        assert_eq!(p.instruction, "je 0x7");
    }

    #[test]
    fn endbr64_before_the_null_check_is_walked_past() {
        let mut code = vec![0xf3, 0x0f, 0x1e, 0xfa];
        code.extend_from_slice(GLIBC_FREE);
        let p = free_at(&code);
        assert_eq!((p.offset, p.pushes), (13, 0), "{p:?}");
        assert_eq!(p.instruction, "push %rbp");
    }

    #[test]
    fn pushes_before_the_null_check_are_counted() {
        // push %rbx; test %rdi,%rdi; je +2; push %rbp; pop %rbp; pop %rbx; ret
        let code = [0x53, 0x48, 0x85, 0xff, 0x74, 0x02, 0x55, 0x5d, 0x5b, 0xc3];
        let p = free_at(&code);
        assert_eq!((p.offset, p.pushes), (6, 1), "{p:?}");
        assert_eq!(p.instruction, "push %rbp");
        // Without a NULL check, the first push is the place.
        let p = free_at(&[0x53, 0x48, 0x89, 0xfb, 0x55]);
        assert_eq!((p.offset, p.pushes), (0, 0), "{p:?}");
    }

    #[test]
    fn a_write_to_the_argument_before_any_push_keeps_the_entry() {
        // mov %rsi,%rdi; push %rbp
        let p = free_at(&[0x48, 0x89, 0xf7, 0x55]);
        assert_eq!(p.offset, 0);
        assert_eq!(p.instruction, "mov %rsi,%rdi");
        assert!(p.why.contains("writes %rdi"), "{}", p.why);
        // The same write through a 32-bit register, and a write to rsp.
        assert_eq!(free_at(&[0x31, 0xff, 0x55]).offset, 0);
        assert_eq!(free_at(&[0x48, 0x83, 0xec, 0x08, 0x55]).offset, 0);
        // A register the program does not read may be written.
        assert_eq!(free_at(&[0x48, 0x89, 0xf8, 0x55]).offset, 3);
    }

    #[test]
    fn other_branches_and_garbage_keep_the_entry() {
        // test %rdi,%rdi; ret  (a non-emulated branch before any emulated instruction)
        let p = free_at(&[0x48, 0x85, 0xff, 0xc3, 0x55]);
        assert_eq!(p.offset, 0);
        assert!(p.why.contains("branch"), "{}", p.why);
        // Bytes invalid in 64-bit mode.
        let p = free_at(&[0x06, 0x07, 0x55]);
        assert_eq!((p.offset, p.instruction.as_str()), (0, "(bad)"));
        // A prologue cut off by the window: nothing emulated, nothing half-decoded.
        let p = free_at(&GLIBC_FREE[..5]);
        assert_eq!(p.offset, 0);
        assert_eq!(free_at(&[]).offset, 0);
    }

    /// `gcc -pg -mfentry -mnop-mcount`'s entry: nopl 0x0(%rax,%rax,1) (objdump's spelling).
    const NOP5_BYTES: [u8; 5] = [0x0f, 0x1f, 0x44, 0x00, 0x00];

    #[test]
    fn a_five_byte_nop_is_taken_before_anything_past_it() {
        // Before glibc's free: the NULL check and its push are not walked to.
        let p = free_at(&[&NOP5_BYTES[..], GLIBC_FREE].concat());
        assert_eq!((p.offset, p.pushes), (0, 0), "{p:?}");
        assert_eq!(p.instruction, "nopl (%rax,%rax)");
        assert!(p.why.contains("5-byte nop"), "{}", p.why);
        // After a push: taken over the push, which is counted.
        let p = free_at(&[&[0x55][..], &NOP5_BYTES, &[0x53]].concat());
        assert_eq!((p.offset, p.pushes), (1, 1), "{p:?}");
        assert!(p.why.contains("5-byte nop"), "{}", p.why);
        // At the entry of a function with a uretprobe, which shares it.
        let p = choose(&NOP5_BYTES, Func::Malloc, true, reads(Func::Malloc));
        assert_eq!(p.offset, 0);
        assert!(
            p.why.contains("uretprobe") && p.why.contains("5-byte nop"),
            "{}",
            p.why
        );
        // Other nops are emulated but not turned into calls.
        let p = free_at(&[0x90, 0x55]);
        assert!(!p.why.contains("5-byte nop"), "{}", p.why);
        let p = choose(&[0x41, 0x54], Func::Malloc, true, reads(Func::Malloc));
        assert!(!p.why.contains("5-byte nop"), "{}", p.why);
    }

    #[test]
    fn a_null_path_that_reaches_the_probe_keeps_the_entry() {
        // test %rdi,%rdi; je +0 (to the push itself); push %rbp
        let p = free_at(&[0x48, 0x85, 0xff, 0x74, 0x00, 0x55]);
        assert_eq!(p.offset, 0, "{p:?}");
        assert!(p.why.contains("NULL check"), "{}", p.why);
    }

    #[test]
    fn a_branch_that_is_no_null_check_is_probed_on_not_past() {
        // test %rdi,%rdi; jne ...; push %rbp: the jne is emulated and every call runs through it.
        let p = free_at(&[0x48, 0x85, 0xff, 0x75, 0x10, 0x55]);
        assert_eq!((p.offset, p.instruction.as_str()), (3, "jne 0x15"));
        // A segment-prefixed nop is refused by the kernel: never chosen.
        assert_eq!(
            emulated(&[0x66, 0x2e, 0x0f, 0x1f, 0x84, 0, 0, 0, 0, 0]),
            None
        );
        assert_eq!(
            emulated(&[0x0f, 0x1f, 0x44, 0x00, 0x00]),
            Some(Emulated::Nop)
        );
        assert_eq!(emulated(&[0x66, 0xe9, 0, 0]), None);
        assert_eq!(emulated(&[0x48, 0x55]), None);
    }

    #[test]
    fn the_host_libc_places_its_probes_on_instruction_boundaries_with_the_return_address_at_rsp() {
        let libc = crate::targets::allocator::host_libc_path().unwrap();
        for site in crate::targets::elf::alloc_sites(&libc).unwrap() {
            let code = crate::targets::elf::code(&libc, &site, WINDOW).unwrap();
            let uret = site.func != Func::Free;
            let p = choose(&code, site.func, uret, reads(site.func));
            if uret {
                assert_eq!(p.pushes, 0, "{:?}: {p:?}", site.func);
            }
            let boundaries: Vec<u64> = decode_all(&code).iter().map(|i| i.ip()).collect();
            assert!(boundaries.contains(&p.offset), "{:?}: {p:?}", site.func);
        }
    }
}
