use super::*;

fn free_at(code: &[u8]) -> Placement {
    choose(code, Func::Free, false, reads(Func::Free))
}

/// glibc 2.36-9+deb12u14's free: test %rdi,%rdi; je; push %rbp; lea; push %rbx; sub.
const GLIBC_FREE: &[u8] = &[
    0x48, 0x85, 0xff, 0x0f, 0x84, 0xbf, 0x00, 0x00, 0x00, 0x55, 0x48, 0x8d, 0x77, 0xf0, 0x53, 0x48,
    0x83, 0xec, 0x18,
];

/// glibc 2.36-9+deb12u14's mmap (the first 28 bytes): mov %ecx,%r10d; test $0xfff,%r9d;
/// jne; mov $9,%eax; syscall; cmp $-4096,%rax; ja; ret.
const GLIBC_MMAP: &[u8] = &[
    0x41, 0x89, 0xca, 0x41, 0xf7, 0xc1, 0xff, 0x0f, 0x00, 0x00, 0x75, 0x14, 0xb8, 0x09, 0x00, 0x00,
    0x00, 0x0f, 0x05, 0x48, 0x3d, 0x00, 0xf0, 0xff, 0xff, 0x77, 0x25, 0xc3,
];

/// Its munmap: mov $11,%eax; syscall; cmp $-4095,%rax; jae; ret.
const GLIBC_MUNMAP: &[u8] = &[
    0xb8, 0x0b, 0x00, 0x00, 0x00, 0x0f, 0x05, 0x48, 0x3d, 0x01, 0xf0, 0xff, 0xff, 0x73, 0x01, 0xc3,
];

/// Its brk: mov $12,%eax; syscall; mov 0xd51e2(%rip),%rdx; mov %rax,(%rdx); cmp %rdi,%rax;
/// jb; xor %eax,%eax; ret.
const GLIBC_BRK: &[u8] = &[
    0xb8, 0x0c, 0x00, 0x00, 0x00, 0x0f, 0x05, 0x48, 0x8b, 0x15, 0xe2, 0x51, 0x0d, 0x00, 0x48, 0x89,
    0x02, 0x48, 0x39, 0xf8, 0x72, 0x0a, 0x31, 0xc0, 0xc3,
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
    0x80, 0x3d, 0x01, 0x02, 0x14, 0x00, 0x00, 0x41, 0x54, 0x49, 0x89, 0xd4, 0x55, 0x48, 0x89, 0xfd,
    0x53, 0x48, 0x89, 0xf3, 0x74, 0x5a,
];

/// glibc's aligned_alloc (= memalign): cmpb $0x0,0x140e71(%rip); je +0x10; jmp _mid_memalign;
/// xchg %ax,%ax; sub $0x18,%rsp.
const GLIBC_ALIGNED_ALLOC: &[u8] = &[
    0x80, 0x3d, 0x71, 0x0e, 0x14, 0x00, 0x00, 0x74, 0x07, 0xe9, 0x32, 0xf6, 0xff, 0xff, 0x66, 0x90,
    0x48, 0x83, 0xec, 0x18,
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
    let libc = crate::targets::target_file::TargetFile::host(&libc).unwrap();
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
