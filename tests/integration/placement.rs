//! Probe placement: where `heaptrace probes` says each probe goes, and that a probe placed after
//! pushes still tells nested calls apart (the push count travels as the attach cookie).
use std::process::Command;

use serde_json::Value;

use crate::{counts::launch, support::*};

fn is_push(code: &[u8]) -> bool {
    matches!(code, [0x50..=0x57, ..] | [0x41, 0x50..=0x57, ..])
}

/// Needs no BPF: `heaptrace probes` attaches nothing.
#[test]
fn probes_places_free_on_a_push_and_uretprobe_functions_where_rsp_is_untouched() {
    let (path, probes) = planned_probes(None);
    let file = std::fs::read(&path).unwrap();
    let free = &probes["free"];
    assert!(!free.uretprobe);
    assert!(free.entry > 0, "free not placed past its entry: {free:?}");
    let at = (free.file_offset + free.entry) as usize;
    assert!(
        is_push(&file[at..]),
        "free+{} is {:02x?}",
        free.entry,
        &file[at..at + 2]
    );
    assert!(free.instruction.starts_with("push"), "{free:?}");
    assert_eq!(probes["malloc"].entry, 0);
    // The memory syscalls' wrappers: probed after their syscall, on the first instruction the
    // kernel emulates (glibc 2.36: the `ja`, `jae` or `jb` past a single-stepped `cmp`).
    for wrapper in ["mmap", "munmap", "mremap", "brk"] {
        let p = &probes[wrapper];
        let at = (p.file_offset + p.entry) as usize;
        let start = p.file_offset as usize;
        let syscall = file[start..at].windows(2).rposition(|w| w == [0x0f, 0x05]);
        assert!(syscall.is_some(), "{wrapper}: no syscall before {p:?}");
        assert!(
            matches!(file[at], 0x70..=0x7f) || file[at - 2..at] == [0x0f, 0x05],
            "{wrapper}: {p:?}"
        );
    }
    // A probe with a uretprobe moves only past instructions that leave rsp (where the return
    // address is) alone, and only onto one the kernel emulates: glibc 2.36's posix_memalign
    // and valloc begin with `cmpb $0x0,...(%rip)` (7 bytes), then a push.
    for (func, p) in &probes {
        if p.uretprobe && p.entry > 0 {
            let at = (p.file_offset + p.entry) as usize;
            let start = p.file_offset as usize;
            assert!(
                is_push(&file[at..]) || matches!(file[at], 0x70..=0x7f | 0xe9 | 0xeb),
                "{func} has a uretprobe on an instruction not emulated: {p:?}"
            );
            assert!(
                !file[start..at].iter().any(|b| (0x50..=0x57).contains(b)),
                "{func}: a push before its uretprobe? {:02x?}",
                &file[start..at]
            );
        }
    }
    for func in ["posix_memalign", "valloc", "pvalloc"] {
        let p = &probes[func];
        let start = p.file_offset as usize;
        if file[start..start + 2] == [0x80, 0x3d] {
            assert_eq!(p.entry, 7, "{func} not placed past its cmpb: {p:?}");
            assert!(p.instruction.starts_with("push"), "{p:?}");
        }
    }
    // A process using the host's libc gets the same plan.
    let mut spin = spawn_with_libc(&mut Command::new(fixture("spin", "", &[])));
    let (pid_path, pid_probes) = planned_probes(Some(spin.id()));
    spin.kill().unwrap();
    spin.wait().unwrap();
    assert_eq!(pid_path, path);
    assert_eq!(pid_probes["free"].entry, free.entry);
}

/// Needs no BPF. Calls mode: malloc has no return probe (it is counted at its entry), and
/// every other allocating function keeps one: the window that tells calls nested inside it
/// apart. Stacks mode keeps malloc's.
#[test]
fn calls_mode_plans_malloc_without_a_uretprobe() {
    let (_, probes) = planned_probes_with(None, &["--mode", "calls"]);
    assert!(!probes["malloc"].uretprobe, "{:?}", probes["malloc"]);
    for (func, p) in &probes {
        if func != "malloc" && func != "free" {
            assert!(
                p.uretprobe,
                "{func} lost its uretprobe in calls mode: {p:?}"
            );
        }
    }
    // No reservations in calls mode: no wrapper probes.
    assert!(!probes.contains_key("mmap"), "{probes:?}");
    let (_, stacks) = planned_probes(None);
    assert!(stacks["malloc"].uretprobe);
}

fn pushfree(flags: &[&str]) -> Value {
    let bin = fixture("pushfree", "", &["-static", "-nostdlib"]);
    let doc = launch(
        &format!("pushfree{}", flags.concat()),
        flags,
        &bin,
        &[],
        &[],
    );
    assert_eq!(doc["provider"]["path"], bin.display().to_string());
    let f = &doc["functions"];
    assert_eq!(
        (f["malloc"]["calls"].as_u64(), f["malloc"]["bytes"].as_u64()),
        (Some(1001), Some(48048))
    );
    assert_eq!(
        (f["free"]["calls"].as_u64(), f["free"]["bytes"].as_u64()),
        (Some(1001), Some(48048)),
        "{f}"
    );
    assert_eq!(f["free"]["untracked"], 0);
    assert_eq!(doc["live"]["blocks"], 0);
    doc
}

bpf_test!(
    shared,
    /// tests/fixtures/pushfree.c: its free pushes before its NULL check, so its probe goes after
    /// one push; a free entered 8 bytes above a stale in-flight malloc is counted only if the
    /// program adds the cookie's 8 back to the stack pointer it sees.
    fn a_probe_after_pushes_recovers_the_entry_stack_pointer() {
        let free = |doc: &Value| {
            let probes = doc["provider"]["probes"].as_array().unwrap();
            let p = probes.iter().find(|p| p["func"] == "free").unwrap();
            (
                p["placement"]["offset"].as_u64(),
                p["placement"]["pushes"].as_u64(),
            )
        };
        assert_eq!(free(&pushfree(&[])), (Some(6), Some(1)));
        assert_eq!(free(&pushfree(&["--probe-at-entry"])), (Some(0), Some(0)));
        // The cookie reaches the program through perf-event uprobes (the fallback) too.
        assert_eq!(free(&pushfree(&["--perf-uprobes"])), (Some(6), Some(1)));
    }
);

bpf_test!(
    shared,
    /// glibc 2.36's posix_memalign, aligned_alloc and valloc begin with a `cmpb` the kernel
    /// single-steps; their probes, entry and return in one trap, go past it onto a push or `je`.
    /// Pairs of each count exactly, and their one site starts at main's call: the uretprobe
    /// planted there found the return address at [rsp], and the block reached the live map and
    /// left it at its free.
    fn aligned_pairs_count_exactly_with_their_probes_past_a_leading_cmpb() {
        const N: u64 = 5000;
        let bin = fixture("pairs", "", &[]);
        for func in ["posix_memalign", "aligned_alloc", "valloc"] {
            let doc = launch(
                &format!("aligned-{func}"),
                &[],
                &bin,
                &[N.to_string(), func.to_string()],
                &[],
            );
            let probe = doc["provider"]["probes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["func"] == func)
                .unwrap_or_else(|| panic!("no {func} probe: {}", doc["provider"]));
            assert_eq!(probe["uretprobe"], true, "{probe}");
            assert_eq!(probe["placement"]["pushes"], 0, "{probe}");
            let f = &doc["functions"][func];
            assert_eq!(
                (
                    f["calls"].as_u64(),
                    f["bytes"].as_u64(),
                    f["failed"].as_u64()
                ),
                (Some(N), Some(64 * N), Some(0)),
                "{func}: {f}"
            );
            let sites: Vec<&Value> = doc["stacks"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|s| s["function"] == func)
                .collect();
            assert_eq!(sites.len(), 1, "{func}: {sites:?}");
            let s = sites[0];
            assert_eq!(s["frames"][0]["function"], "main", "{s}");
            assert_eq!(
                (
                    s["calls"].as_u64(),
                    s["frees"].as_u64(),
                    s["live_blocks"].as_u64()
                ),
                (Some(N), Some(N), Some(0)),
                "{s}"
            );
        }
    }
);
