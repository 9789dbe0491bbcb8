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
mod tests;
