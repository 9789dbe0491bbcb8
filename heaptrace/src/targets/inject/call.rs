//! Functions called in the target, on a thread held stopped (`stop::Held`).
//!
//! The call returns to a trampoline written in unused bytes at the end of a code mapping
//! (past its segment's end, where nothing runs): it makes a `tgkill` system call, at whose
//! signal (or entry, when the call is traced: `notice`) heaptrace reads the result and gives
//! the thread's registers back. If heaptrace is gone by then, the trampoline goes on by
//! itself: it restores the extended state and every register from the frame the call left on
//! the thread's stack and jumps back to where the thread was. The target keeps running either
//! way; nothing of the call is left but the trampoline's bytes, in code nothing runs.
use std::{cell::Cell, io};

use super::{notice, stop::Held, sys};

/// Below the stack pointer the interrupted code may keep data (the x86-64 red zone).
const RED_ZONE: u64 = 128;
/// The registers popped by the trampoline, in its order, then rflags and rsp.
const SAVED_WORDS: usize = 17;
/// The extended state's place in the frame, from its start (64-byte aligned for XRSTOR).
const XSTATE_AT: u64 = 192;
/// Where the trampoline's `syscall` leaves the instruction pointer.
const SYSCALL_END: u64 = 25;
/// Where the signal number is in the trampoline (the immediate of `mov edx`).
const SIGNAL_AT: u64 = 14;

/// The trampoline's code, to send thread `tid` of `pid` signal 0, then (on its own) give it
/// back its nice value `nice`; the last 8 bytes are the address to jump back to.
fn code(pid: u32, tid: u32, nice: i32, back_to: u64) -> Vec<u8> {
    let mut c = vec![0x49, 0x89, 0xc0]; // mov r8, rax: the result, for heaptrace
    c.push(0xbf); // mov edi, pid
    c.extend_from_slice(&pid.to_le_bytes());
    c.push(0xbe); // mov esi, tid
    c.extend_from_slice(&tid.to_le_bytes());
    c.extend_from_slice(&[0xba, 0, 0, 0, 0]); // mov edx, signal (`SIGNAL_AT`)
    c.extend_from_slice(&[
        0xb8, 0xea, 0x00, 0x00, 0x00, // mov eax, SYS_tgkill
        0x0f, 0x05, // syscall: heaptrace stops the thread at its entry or at the signal
        0x31, 0xff, // xor edi, edi: PRIO_PROCESS (esi is still tid)
        0xba, // mov edx, nice
    ]);
    c.extend_from_slice(&nice.to_le_bytes());
    c.extend_from_slice(&[
        0xb8, 0x8d, 0x00, 0x00, 0x00, // mov eax, SYS_setpriority
        0x0f, 0x05, // syscall
        0x83, 0xc8, 0xff, // or eax, -1
        0x83, 0xca, 0xff, // or edx, -1
        0x48, 0x0f, 0xae, 0xac, 0x24, 0xc0, 0x00, 0x00, 0x00, // xrstor64 [rsp + 192]
        0x41, 0x5f, 0x41, 0x5e, 0x41, 0x5d, 0x41, 0x5c, // pop r15, r14, r13, r12
        0x5d, 0x5b, // pop rbp, rbx
        0x41, 0x5b, 0x41, 0x5a, 0x41, 0x59, 0x41, 0x58, // pop r11, r10, r9, r8
        0x58, 0x59, 0x5a, 0x5e, 0x5f, // pop rax, rcx, rdx, rsi, rdi
        0x9d, // popfq
        0x5c, // pop rsp
        0xff, 0x25, 0x00, 0x00, 0x00, 0x00, // jmp [rip]
    ]);
    c.extend_from_slice(&back_to.to_le_bytes());
    c
}

/// The saved registers in the trampoline's pop order.
fn saved_words(r: &libc::user_regs_struct) -> [u64; SAVED_WORDS] {
    [
        r.r15, r.r14, r.r13, r.r12, r.rbp, r.rbx, r.r11, r.r10, r.r9, r.r8, r.rax, r.rcx, r.rdx,
        r.rsi, r.rdi, r.eflags, r.rsp,
    ]
}

/// The trampoline, written into the target; the bytes it replaced put back by `remove`.
pub struct Trampoline {
    pub at: u64,
    was: Vec<u8>,
    /// The signal its code sends now (0: none).
    signal: Cell<i32>,
    /// The held thread's nice value, which its code gives back.
    nice: i32,
    /// The ptrace stops of the calls made through it.
    stops: Cell<u32>,
}

/// Room the trampoline takes.
pub const ROOM: usize = 96;

impl Trampoline {
    /// Writes it at `at` (unused code bytes, found by the caller), to jump back to where
    /// `held` was stopped.
    pub fn install(pid: u32, at: u64, held: &Held) -> io::Result<Trampoline> {
        let nice = sys::nice(held.tid)?;
        let was = sys::read_mem(pid, at, ROOM)?;
        let code = code(pid, held.tid, nice, held.resumable().rip);
        debug_assert!(code.len() <= ROOM);
        sys::write_mem(pid, at, &code)?;
        Ok(Trampoline {
            at,
            was,
            signal: Cell::new(0),
            nice,
            stops: Cell::new(0),
        })
    }

    /// Makes its code send `signal` (0: none), if it does not already.
    fn send(&self, pid: u32, signal: i32) -> io::Result<()> {
        if self.signal.get() != signal {
            sys::write_mem(pid, self.at + SIGNAL_AT, &signal.to_le_bytes())?;
            self.signal.set(signal);
        }
        Ok(())
    }

    pub fn stops(&self) -> u32 {
        self.stops.get()
    }

    pub fn remove(self, pid: u32) -> io::Result<()> {
        sys::write_mem(pid, self.at, &self.was)
    }
}

/// A call's argument: a number, or bytes put on the thread's stack, passed by address.
pub enum Arg<'a> {
    Num(u64),
    Bytes(&'a [u8]),
}

/// Calls `func` with `args` (at most six) on the held thread; its return value. The thread
/// is back as it was stopped when this returns, Ok or not (unless the call crashed the
/// process, which a fault in it delivered to the target would: a fault is not delivered).
pub fn call(pid: u32, held: &Held, tramp: &Trampoline, func: u64, args: &[Arg]) -> io::Result<u64> {
    let back = held.resumable();
    let sp = back.rsp;
    // The frame, from the top: the red zone left alone, the byte arguments, the extended
    // state, the saved registers, the return address.
    let mut top = sp - RED_ZONE;
    let mut values = [0u64; 6];
    let mut blobs: Vec<(u64, &[u8])> = Vec::new();
    for (v, a) in values.iter_mut().zip(args) {
        *v = match a {
            Arg::Num(n) => *n,
            Arg::Bytes(b) => {
                top = (top - b.len() as u64) & !15;
                blobs.push((top, b));
                top
            }
        };
    }
    let xstate_at = (top - held.xstate.len() as u64) & !63;
    let frame = xstate_at - XSTATE_AT;
    let mut saved: Vec<u8> = saved_words(&back)
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    saved.resize(XSTATE_AT as usize, 0);
    saved.extend_from_slice(&held.xstate);
    let signal = notice::signal(pid, held.tid)?;
    tramp.send(pid, signal.unwrap_or(0))?;
    sys::write_mem(pid, frame - 8, &tramp.at.to_le_bytes())?;
    sys::write_mem(pid, frame, &saved)?;
    for (at, b) in blobs {
        sys::write_mem(pid, at, b)?;
    }
    let mut regs = back;
    regs.rip = func;
    regs.rsp = frame - 8;
    regs.rax = 0;
    regs.orig_rax = u64::MAX;
    [regs.rdi, regs.rsi, regs.rdx, regs.rcx, regs.r8, regs.r9] = values;
    sys::set_regs(held.tid, &regs)?;
    // Boosted for the call (`sys::BOOST`), its nice given back at its end by heaptrace or,
    // with heaptrace gone, by the trampoline.
    let boosted = tramp.nice > sys::BOOST && sys::set_nice(held.tid, sys::BOOST).is_ok();
    let result = run(held.tid, tramp, signal);
    if boosted {
        let _ = sys::set_nice(held.tid, tramp.nice);
    }
    // Given back whatever happened: a thread left with the call's registers would crash.
    let restored =
        sys::set_regs(held.tid, &back).and_then(|_| sys::set_xstate(held.tid, &held.xstate));
    let value = result?;
    restored?;
    Ok(value)
}

/// Runs the thread until it reaches the trampoline's system call (traced) or its `signal`
/// (untraced); the call's result.
fn run(tid: u32, tramp: &Trampoline, signal: Option<i32>) -> io::Result<u64> {
    let done_at = tramp.at + SYSCALL_END;
    let mut sig = 0;
    loop {
        match signal {
            Some(_) => sys::resume(tid, sig)?,
            None => sys::resume_to_syscall(tid, sig)?,
        }
        sig = 0;
        let stop = sys::wait(tid)?;
        tramp.stops.set(tramp.stops.get() + 1);
        match stop {
            sys::Stop::Syscall => {
                let r = sys::regs(tid)?;
                if r.rip == done_at && r.orig_rax == libc::SYS_tgkill as u64 {
                    return Ok(r.r8);
                }
            }
            sys::Stop::Event => {}
            // Ours, dropped (the next resume delivers nothing); the same signal sent from
            // elsewhere meanwhile is one the process ignores.
            sys::Stop::Signal(s) if Some(s) == signal => {
                let r = sys::regs(tid)?;
                if r.rip == done_at {
                    return Ok(r.r8);
                }
                sig = s;
            }
            sys::Stop::Signal(s)
                if [libc::SIGSEGV, libc::SIGBUS, libc::SIGILL, libc::SIGFPE].contains(&s) =>
            {
                let r = sys::regs(tid)?;
                return Err(io::Error::other(format!(
                    "the call faulted (signal {s}) at {:#x}",
                    r.rip
                )));
            }
            // The target's own signal: delivered, its handler runs on top of the call.
            sys::Stop::Signal(s) => sig = s,
            sys::Stop::Ended => return Err(io::Error::other("the process ended")),
        }
    }
}

#[cfg(test)]
mod tests {
    use iced_x86::{Decoder, DecoderOptions, Mnemonic, Register};

    #[test]
    fn trampoline_decodes_as_written() {
        let mut c = super::code(0x01020304, 0x05060708, -3, 0x1122334455667788);
        c[super::SIGNAL_AT as usize..][..4].copy_from_slice(&libc::SIGURG.to_le_bytes());
        let mut d = Decoder::with_ip(64, &c, 0, DecoderOptions::NONE);
        let ins: Vec<_> = std::iter::from_fn(|| d.can_decode().then(|| d.decode())).collect();
        // tgkill(pid, tid, signal), the call's result kept in r8.
        assert_eq!(ins[0].op0_register(), Register::R8);
        assert_eq!(ins[0].op1_register(), Register::RAX);
        let imm = |i: usize, r: Register| {
            assert_eq!(ins[i].op0_register(), r);
            ins[i].immediate32()
        };
        assert_eq!(imm(1, Register::EDI), 0x01020304);
        assert_eq!(imm(2, Register::ESI), 0x05060708);
        assert_eq!(imm(3, Register::EDX), libc::SIGURG as u32);
        assert_eq!(imm(4, Register::EAX), libc::SYS_tgkill as u32);
        assert_eq!(ins[5].mnemonic(), Mnemonic::Syscall);
        assert_eq!(ins[6].ip(), super::SYSCALL_END);
        // setpriority(PRIO_PROCESS, tid, nice): edi zeroed, esi kept from tgkill.
        assert_eq!(ins[6].mnemonic(), Mnemonic::Xor);
        assert_eq!(ins[6].op0_register(), Register::EDI);
        assert_eq!(imm(7, Register::EDX), -3i32 as u32);
        assert_eq!(imm(8, Register::EAX), libc::SYS_setpriority as u32);
        assert_eq!(ins[9].mnemonic(), Mnemonic::Syscall);
        // XRSTOR's mask, edx:eax, all ones.
        assert!(
            ins[10..12]
                .iter()
                .all(|i| i.mnemonic() == Mnemonic::Or && i.immediate8to32() == -1)
        );
        assert_eq!(ins[12].mnemonic(), Mnemonic::Xrstor64);
        assert_eq!(ins[12].memory_base(), Register::RSP);
        assert_eq!(ins[12].memory_displacement64(), super::XSTATE_AT);
        let pops: Vec<Register> = ins
            .iter()
            .filter(|i| i.mnemonic() == Mnemonic::Pop)
            .map(|i| i.op0_register())
            .collect();
        use Register::*;
        assert_eq!(
            pops,
            [
                R15, R14, R13, R12, RBP, RBX, R11, R10, R9, R8, RAX, RCX, RDX, RSI, RDI, RSP
            ]
        );
        // popfq between rdi and rsp, as `saved_words` orders rflags before rsp.
        let popf = ins.iter().position(|i| i.mnemonic() == Mnemonic::Popfq);
        let last_pop = ins.iter().rposition(|i| i.mnemonic() == Mnemonic::Pop);
        assert_eq!(popf.map(|p| p + 1), last_pop);
        let jmp = ins.iter().find(|i| i.mnemonic() == Mnemonic::Jmp).unwrap();
        assert!(jmp.is_ip_rel_memory_operand());
        assert_eq!(jmp.ip_rel_memory_address(), c.len() as u64 - 8);
        assert!(c.len() <= super::ROOM);
        assert_eq!(c[c.len() - 8..], 0x1122334455667788u64.to_le_bytes());
    }
}
