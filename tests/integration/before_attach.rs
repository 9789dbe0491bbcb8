//! `-p` takes the blocks live at attach into its live figures (a census of the heap, the
//! process stopped): tests/fixtures/beforeattach.c holds 64 blocks of known usable sizes
//! when attached, then frees half of them and allocates 10 more. Their frees are of known
//! blocks, with their sizes; the rest are leaks of the "allocated before attach" site.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    process::{Command, Stdio},
};

use serde_json::Value;

use crate::support::*;

const BEFORE_ATTACH: i64 = i32::MIN as i64 + 2;
/// The fixture's new blocks: 10 x malloc(64), kept.
const NEW: (u64, u64) = (10, 640);

/// "WORD A B" from the fixture's output.
fn pair(line: &str, word: &str) -> (u64, u64) {
    let w: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(w.first(), Some(&word), "{line}");
    (w[1].parse().unwrap(), w[2].parse().unwrap())
}

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

/// Runs the fixture under `-p` in `mode`: its JSON document, the blocks and usable bytes it
/// held at attach, and those of them it freed.
fn attach_after(tag: &str, mode: &str) -> (Value, (u64, u64), (u64, u64)) {
    let bin = fixture("beforeattach", "", &[]);
    let (mut target, mut out, mut line) = piped(&mut Command::new(bin));
    let before = pair(&line, "before");
    line.clear();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    let json = json_path(tag);
    let mut ht = heaptrace();
    ht.args(["--no-tui", "-q", "--census", "--mode", mode, "--json"])
        .arg(&json)
        .args(["-p", &target.id().to_string()]);
    let tracer = start_attached(&mut ht);
    target.stdin.take().unwrap().write_all(b"x").unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    let freed = pair(&line, "freed");
    assert!(target.wait().unwrap().success());
    let (code, stderr) = tracer.wait();
    assert_eq!(code, 0, "{stderr}");
    (read_json(&json), before, freed)
}

fn check(doc: &Value, before: (u64, u64), freed: (u64, u64)) {
    let live = &doc["live"];
    assert_eq!(n(&live["before_attach"]["blocks"]), before.0, "{live}");
    assert_eq!(n(&live["before_attach"]["bytes"]), before.1, "{live}");
    assert_eq!(n(&live["before_attach"]["lost_blocks"]), 0, "{live}");
    let free = &doc["functions"]["free"];
    assert_eq!(n(&free["untracked"]), 0, "{free}");
    assert_eq!(n(&free["calls"]), freed.0, "{free}");
    assert_eq!(
        n(&free["bytes"]),
        freed.1,
        "the old blocks' usable sizes: {free}"
    );
    // Old blocks by usable size, new ones by request.
    let left = (before.0 - freed.0, before.1 - freed.1);
    assert_eq!(n(&live["blocks"]), left.0 + NEW.0, "{live}");
    assert_eq!(n(&live["bytes"]), left.1 + NEW.1, "{live}");
    let leaks = &doc["leaks"];
    assert_eq!(n(&leaks["blocks"]), left.0 + NEW.0, "{leaks}");
    assert_eq!(n(&leaks["bytes"]), left.1 + NEW.1, "{leaks}");
    let old: Vec<&Value> = leaks["by_stack"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["stack_id"].as_i64() == Some(BEFORE_ATTACH))
        .collect();
    assert_eq!(old.len(), 1, "{leaks}");
    assert_eq!((n(&old[0]["blocks"]), n(&old[0]["bytes"])), left, "{leaks}");
    assert_eq!(old[0]["function"], Value::Null);
    assert_eq!(
        old[0]["frames"][0]["function"], "[allocated before attach]",
        "{leaks}"
    );
}

bpf_test!(
    shared,
    fn attaching_counts_the_blocks_live_before_in_stacks_mode() {
        let (doc, before, freed) = attach_after("before-attach-stacks", "stacks");
        assert_eq!(before.0, 64);
        check(&doc, before, freed);
        // The peak starts from the heap held at attach.
        let peak = n(&doc["peak"]["live_bytes"]);
        assert!(peak >= before.1, "{}", doc["peak"]);
    }
);

bpf_test!(
    shared,
    fn attaching_counts_the_blocks_live_before_in_counts_mode() {
        let (doc, before, freed) = attach_after("before-attach-counts", "counts");
        check(&doc, before, freed);
    }
);

bpf_test!(
    shared,
    fn without_census_the_blocks_before_attach_are_left_out() {
        let bin = fixture("beforeattach", "", &[]);
        let mut target = Command::new(bin)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(target.stdout.take().unwrap());
        let mut line = String::new();
        while line != "ready\n" {
            line.clear();
            out.read_line(&mut line).unwrap();
        }
        let json = json_path("before-attach-none");
        let mut ht = heaptrace();
        ht.args(["--no-tui", "-q", "--json"])
            .arg(&json)
            .args(["-p", &target.id().to_string()]);
        let tracer = start_attached(&mut ht);
        target.stdin.take().unwrap().write_all(b"x").unwrap();
        assert!(target.wait().unwrap().success());
        let (code, stderr) = tracer.wait();
        assert_eq!(code, 0, "{stderr}");
        let doc = read_json(&json);
        assert!(
            doc["live"].get("before_attach").is_none(),
            "{}",
            doc["live"]
        );
        assert_eq!(n(&doc["functions"]["free"]["untracked"]), 32);
    }
);

bpf_test!(
    shared,
    /// glibc's memory behind malloc made before the attach: 400,000 blocks of 100 bytes on
    /// the brk heap (112-byte chunks, each header written) and the 3.2 MB array holding
    /// them (a mapping of its own), all touched. Resident, by smaps at the end, is those.
    fn resident_memory_counts_what_glibc_mapped_before_the_attach() {
        const COUNT: u64 = 400_000;
        let bin = fixture("beforeattach", "", &[]);
        let mut target = Command::new(bin)
            .arg(COUNT.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(target.stdout.take().unwrap());
        let mut line = String::new();
        while line != "ready\n" {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0, "fixture ended");
        }
        let json = json_path("before-attach-resident");
        let mut ht = heaptrace();
        ht.args(["--no-tui", "-q", "--mode", "counts", "--json"])
            .arg(&json)
            .args(["-p", &target.id().to_string()]);
        let tracer = start_attached(&mut ht);
        tracer.signal(libc::SIGINT);
        let (code, stderr) = tracer.wait();
        drop(target.stdin.take());
        assert!(target.wait().unwrap().success());
        assert_eq!(code, 0, "{stderr}");
        let doc = read_json(&json);
        let r = &doc["processes"][0]["memory"]["resident"];
        let (heap, anon) = (n(&r["heap_bytes"]), n(&r["anonymous_bytes"]));
        let chunks = COUNT * 112;
        assert!(
            (chunks..chunks + (1 << 20)).contains(&heap),
            "heap {heap} B resident, {chunks} B of chunks"
        );
        let array = COUNT * 8;
        assert!(
            (array..array + (1 << 20)).contains(&anon),
            "anonymous {anon} B resident, the array {array} B"
        );
    }
);
