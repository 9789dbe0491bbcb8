use super::*;
use crate::{
    drain::round::{FnTotals, Totals},
    profile::ProcProfile,
};

#[test]
fn document_has_the_documented_keys_and_merges_aliases() {
    let mut p = Profile::default();
    let mut t = Totals::default();
    t.funcs[Func::Malloc as usize] = FnTotals {
        calls: 4,
        bytes: 400,
        failed: 1,
    };
    t.funcs[Func::Free as usize].calls = 2;
    t.funcs[Func::Free as usize].bytes = 200;
    t.untracked_frees = 1;
    t.live_blocks = 1;
    t.live_bytes = 100;
    p.procs.insert(
        42,
        ProcProfile {
            comm: "fx".into(),
            totals: t,
            ..Default::default()
        },
    );
    p.sizes.insert((42, Func::Malloc as u32, 100, 5), 3);
    let info = RunInfo {
        mode: crate::run_info::Mode::Stacks,
        target: crate::run_info::TargetKind::Command,
        pids: vec![42],
        command: vec!["./fx".into()],
        interval_ms: 1000,
        provider: "/lib/libc.so.6".into(),
        aliases: vec![(Func::Memalign, Func::AlignedAlloc)],
        temporary: Temporary::Allocs(2),
        ..RunInfo::default()
    };
    let node = document(&p, &Run::described(&info, Some(0)));
    // The lists that grow with the stacks are made while the document is written.
    let Node::Object(parts) = &node else {
        panic!("the document is an object")
    };
    for key in ["stacks", "processes", "sizes", "reservations", "timeline"] {
        assert!(matches!(parts[key], Node::List(_)), "{key}");
    }
    let doc = node.to_value();
    let f = &doc["functions"];
    assert_eq!(f["malloc"]["calls"], 4);
    assert_eq!(f["malloc"]["failed"], 1);
    assert_eq!(f["free"]["untracked"], 1);
    assert!(f.get("memalign").is_none());
    assert!(f.get("aligned_alloc").is_some());
    assert_eq!(doc["aliases"]["memalign"], "aligned_alloc");
    assert_eq!(doc["sizes"][0]["function"], "malloc");
    assert_eq!(doc["sizes"][0]["count"], 3);
    assert_eq!(doc["live"]["bytes"], 100);
    assert_eq!(doc["totals"]["allocations"], 3);
    assert_eq!(doc["processes"][0]["pid"], 42);
    assert_eq!(doc["lost"]["live_map"], 0);
    assert!(doc["leaks"].is_null());
    assert_eq!(doc["mode"], "stacks");
    assert_eq!(doc["target"]["mode"], "command");
    assert!(doc["target"]["comm"].is_null() && doc["target"]["cgroup"].is_null());
    assert_eq!(doc["stacks"], json!([]));
    assert_eq!(doc["temporary"]["allocations_between_below"], 2);
    assert!(doc["temporary"].get("threshold_ms").is_none());
}

#[test]
fn stacks_carry_frames_and_counters() {
    let mut p = Profile::default();
    p.stacks.insert(
        (7, 3),
        vec![
            crate::symbolize::FrameInfo::named("alloc_a")
                .at("fx.c", 9)
                .in_module("fx", 0x1139)
                .into(),
        ]
        .into(),
    );
    let mut t = crate::drain::round::SiteTotals {
        calls: 2,
        bytes: 200,
        temp_blocks: 1,
        temp_bytes: 100,
        ..Default::default()
    };
    t.sizes.set(heaptrace_common::log2_bucket(100), 2);
    t.lifetimes.set(1, 1);
    p.sites.insert((7, 3, 0), t);
    let mut leaked = std::collections::BTreeMap::new();
    leaked.insert(
        (7, 3, 0),
        crate::drain::round::Leak {
            blocks: 1,
            bytes: 100,
        },
    );
    p.leaks = Some(leaked);
    let doc = stacks(&p).to_value();
    assert_eq!(doc[0]["frames"][0]["function"], "alloc_a");
    assert_eq!(doc[0]["frames"][0]["line"], 9);
    assert_eq!(doc[0]["calls"], 2);
    assert_eq!(doc[0]["sizes"][0]["from"], 64);
    assert_eq!(doc[0]["lifetime"]["count"], 1);
    assert_eq!(
        temporary(&p, Temporary::WithinMs(5)).to_value()["by_stack"][0]["blocks"],
        1
    );
    assert_eq!(
        leaks(&p, Some(7)).to_value()["by_stack"][0]["frames"][0]["function"],
        "alloc_a"
    );
    assert_eq!(leaks(&p, Some(8)).to_value()["by_stack"], json!([]));
}

/// Past `--json-max-stacks`, the lists by stack hold the largest and `folded` sums the rest.
#[test]
fn lists_by_stack_stop_at_the_cap_and_say_what_they_left_out() {
    let mut p = Profile::default();
    p.procs.insert(7, ProcProfile::default());
    let mut leaks = std::collections::BTreeMap::new();
    for (stack, bytes) in [(1, 100), (2, 300), (3, 200)] {
        let t = crate::drain::round::SiteTotals {
            calls: 1,
            bytes,
            temp_blocks: 1,
            ..Default::default()
        };
        p.sites.insert((7, stack, 0), t);
        let leak = crate::drain::round::Leak { blocks: 1, bytes };
        leaks.insert((7, stack, 0), leak);
    }
    p.set_leaks(leaks);
    p.folded.document_stacks = Some(1);
    let doc = document(&p, &Run::described(&RunInfo::default(), Some(0))).to_value();
    assert_eq!(doc["stacks"].as_array().unwrap().len(), 1);
    assert_eq!(doc["stacks"][0]["bytes"], 300);
    assert_eq!(doc["temporary"]["by_stack"].as_array().unwrap().len(), 1);
    assert_eq!(doc["leaks"]["by_stack"].as_array().unwrap().len(), 1);
    assert_eq!(doc["leaks"]["bytes"], 600, "totals are never cut");
    let out = &doc["folded"]["stacks_left_out"];
    assert_eq!(out["stacks"], 2);
    assert_eq!(out["calls"], 2);
    assert_eq!(out["bytes"], 300);
    assert_eq!(out["temporary"], 2);
    assert_eq!(out["leaks"], 2);
    assert_eq!(doc["folded"]["json_max_stacks"], 1);
}
