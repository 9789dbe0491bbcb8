//! Loading the programs: how much of the return program the verifier goes through, and
//! that every mode and floor (each its own set of paths) loads and runs.
use crate::{counts::launch, support::*};

bpf_test!(
    shared,
    /// Loading the programs is most of heaptrace's start-up: the verifier follows each path of the
    /// return program, the largest (the stack walk, the slots and maps with two places to look). On
    /// this machine's kernel (6.18) it goes through ~316,000 instructions in stacks mode, the
    /// native walk and the Python frames' walk. Changes that kept a map pointer from one of two
    /// maps live past a branch had each doubled a part of it (0.08-0.4 s more start-up at every
    /// launch and attach). Not a timing: the count is the kernel's, the same every load.
    fn the_verifier_goes_through_the_return_program_within_bounds() {
        let bin = fixture("pairs", "", &[]);
        let doc = launch(
            "verified",
            &["--mode", "stacks", "--probe-stats"],
            &bin,
            &["100".to_string()],
            &[],
        );
        let verified = |name: &str| program(&doc, name)["verified_insns"].as_u64().unwrap();
        let ret = verified("alloc_return");
        assert!((10_000..=350_000).contains(&ret), "alloc_return: {ret}");
        for name in ["malloc_entry", "free_entry"] {
            let n = verified(name);
            assert!((50..=10_000).contains(&n), "{name}: {n}");
        }
        // The memory syscalls' program walks the stack at a pymalloc arena's mmap (~41,000).
        let mem = verified("mem_syscall");
        assert!((10_000..=100_000).contains(&mem), "mem_syscall: {mem}");
    }
);

bpf_test!(
    shared,
    /// Each mode and each floor is its own set of paths through the same programs, and the
    /// kernel loads each apart: a build whose bare floor loaded a callback's address on a path
    /// that called another one failed to load there ("No program to jit") while every mode
    /// loaded.
    fn every_mode_and_floor_loads_and_runs() {
        let bin = fixture("pairs", "", &[]);
        let runs: [&[&str]; 8] = [
            &["--mode", "calls"],
            &["--mode", "counts"],
            &["--mode", "sizes"],
            &["--mode", "stacks"],
            &["--floor", "bare-entry"],
            &["--floor", "bare-traps"],
            &["--floor", "bare"],
            &["--floor", "bare-read"],
        ];
        for flags in runs {
            let out = heaptrace()
                .args(["--no-tui", "-q"])
                .args(flags)
                .arg("--")
                .arg(&bin)
                .arg("100")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{flags:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
);
