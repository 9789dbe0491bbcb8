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
fn probes_places_free_on_a_push_and_keeps_uretprobe_functions_at_the_entry() {
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
    // The memory syscalls' wrappers: probed on the instruction after their syscall.
    for wrapper in ["mmap", "munmap", "mremap", "brk"] {
        let p = &probes[wrapper];
        let at = (p.file_offset + p.entry) as usize;
        assert_eq!(file[at - 2..at], [0x0f, 0x05], "{wrapper}: {p:?}");
    }
    for (func, p) in &probes {
        if p.uretprobe {
            assert_eq!(
                p.entry, 0,
                "{func} has a uretprobe but its probe moved: {p:?}"
            );
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

/// tests/fixtures/pushfree.c: its free pushes before its NULL check, so its probe goes after one
/// push; a free entered 8 bytes above a stale in-flight malloc is counted only if the program
/// adds the cookie's 8 back to the stack pointer it sees.
#[test]
fn a_probe_after_pushes_recovers_the_entry_stack_pointer() {
    if !bpf_or_skip("a_probe_after_pushes_recovers_the_entry_stack_pointer") {
        return;
    }
    let _g = shared();
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
