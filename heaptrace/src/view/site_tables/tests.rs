use super::*;
use crate::drain::round::SiteTotals;

fn frame(function: &str, file: Option<&str>, line: Option<u32>) -> Frame {
    crate::symbolize::FrameInfo {
        file: file.map(Into::into),
        line,
        ..crate::symbolize::FrameInfo::named(function)
    }
    .into()
}

#[test]
fn latency_says_how_many_calls_were_timed() {
    let mut p = Profile::default();
    p.latency[Func::Malloc as usize][7] = 3;
    let every = latency(&p);
    assert!(every.contains("(power-of-two buckets):"), "{every}");
    assert!(every.contains("malloc"), "{every}");
    let p = p.with_latency_every(16);
    let sampled = latency(&p);
    assert!(
        sampled.contains("1 call in 16 timed, at random"),
        "{sampled}"
    );
    assert_eq!(latency_note(&Profile::default().with_latency_every(1)), "");
}

#[test]
fn labels_sites_innermost_first() {
    let mut p = Profile::default();
    p.stacks.insert(
        (1, 5),
        vec![
            frame("alloc_a", Some("/src/fx.c"), Some(12)),
            frame("main", None, None),
        ]
        .into(),
    );
    assert_eq!(
        site_label(&p, &(1, 5, 0), 4),
        "malloc <- alloc_a (fx.c:12) <- main"
    );
    assert_eq!(
        site_label(&p, &(1, -14, 1), 4),
        "calloc <- [stack lost: errno 14]"
    );
}

/// Two sites whose first four frames are the same show as many more as tell them apart.
#[test]
fn sites_that_would_read_the_same_show_more_frames() {
    let mut p = Profile::default();
    let stack = |last: &str| -> Vec<Frame> {
        ["a", "b", "c", "d", last, "main"]
            .iter()
            .map(|f| frame(f, None, None))
            .collect()
    };
    p.stacks.insert((1, 5), stack("x").into());
    p.stacks.insert((1, 6), stack("y").into());
    p.stacks.insert((1, 7), vec![frame("e", None, None)].into());
    let ids = [(1, 5, 0), (1, 6, 0), (1, 7, 0)];
    assert_eq!(
        labels(&p, &ids, &Names::default()),
        [
            "malloc <- a <- b <- c <- d <- x",
            "malloc <- a <- b <- c <- d <- y",
            "malloc <- e"
        ]
    );
}

/// Most calls' stacks stop in a module without frame pointers or unwind rows: the sites
/// view says so, and where; whole stacks (to main or a thread's start) say nothing.
#[test]
fn stacks_that_end_early_are_said_with_their_module() {
    let mut p = Profile::default();
    p.stacks.insert(
        (1, 5),
        vec![
            in_module("_PyObject_Malloc", "python3.11"),
            in_module("main", "python3.11"),
        ]
        .into(),
    );
    p.stacks.insert(
        (1, 6),
        vec![in_module("PyList_Append", "python3.11")].into(),
    );
    let site = |calls| SiteTotals {
        calls,
        bytes: calls,
        ..Default::default()
    };
    p.sites.insert((1, 5, 0), site(10));
    assert_eq!(shallow_stacks(&p), None, "whole stacks");
    p.sites.insert((1, 6, 0), site(30));
    let said = shallow_stacks(&p).unwrap();
    assert!(
        said.starts_with("stacks: 75% of allocations' stacks end before main")
            && said.contains("most (75%) in python3.11"),
        "{said}"
    );
    assert!(sites(&p, 5, Temporary::Allocs(1), Names::SHORT).contains(&said));
}

fn in_module(name: &str, module: &str) -> Frame {
    let mut f = crate::symbolize::FrameInfo::named(name);
    f.module = module.into();
    f.into()
}

/// A profile of two sites, 10 calls through `whole` and 30 through `cut`.
fn two_sites(whole: Vec<Frame>, cut: Vec<Frame>) -> Profile {
    let mut p = Profile::default();
    p.stacks.insert((1, 5), whole.into());
    p.stacks.insert((1, 6), cut.into());
    let site = |calls| SiteTotals {
        calls,
        bytes: calls,
        ..Default::default()
    };
    p.sites.insert((1, 5, 0), site(10));
    p.sites.insert((1, 6, 0), site(30));
    p
}

/// A walk that goes past main into libc's start frames, which a stripped libc names by
/// address only, is whole: no warning.
#[test]
fn stacks_through_main_into_unnamed_libc_frames_are_whole() {
    let through_main = vec![
        in_module("malloc", "libc.so.6"),
        in_module("main", "postgres"),
        in_module("[unknown] 0x27249", "libc.so.6"),
    ];
    let p = two_sites(through_main.clone(), through_main);
    assert_eq!(shallow(&p), None);
}

/// Stacks cut because the stack maps were full name that cause and the flag, not a module
/// without unwind rows.
#[test]
fn stacks_cut_by_a_full_stack_map_say_so() {
    let whole = vec![
        in_module("malloc", "libc.so.6"),
        in_module("main", "cc1plus"),
    ];
    let cut = vec![
        in_module("xmalloc", "cc1plus"),
        crate::symbolize::Frame::more_lost(),
    ];
    let said = shallow_stacks(&two_sites(whole, cut)).unwrap();
    assert!(
        said.contains("most (75%) because the stack maps had no room")
            && said.contains("--stack-map-size")
            && !said.contains("unwind rows"),
        "{said}"
    );
}

/// Stacks the kernel cut at a file whose rows found no room in the unwind table name that
/// file and the flag, not "neither frame pointers nor unwind rows".
#[test]
fn stacks_cut_for_want_of_unwind_table_room_say_so() {
    let whole = vec![in_module("malloc", "libc.so.6"), in_module("main", "rustc")];
    let cut = vec![
        in_module("__rust_alloc", "librustc_driver.so"),
        crate::symbolize::Frame::no_room(),
    ];
    let said = shallow_stacks(&two_sites(whole, cut)).unwrap();
    assert!(
        said.contains("most (75%) in librustc_driver.so, whose unwind rows found no room")
            && said.contains("--unwind-table-size")
            && !said.contains("neither frame pointers"),
        "{said}"
    );
}

/// Stacks of ended processes folded past the folded stacks' bound name the fold, not a
/// module "without unwind rows" called `[folded]`.
#[test]
fn stacks_folded_past_the_bound_say_so() {
    let whole = vec![in_module("malloc", "libc.so.6"), in_module("main", "prog")];
    let folded = vec![crate::symbolize::Frame::folded_other()];
    let said = shallow_stacks(&two_sites(whole, folded)).unwrap();
    assert!(
        said.contains("most (75%) because their processes had ended and were folded")
            && !said.contains("unwind rows"),
        "{said}"
    );
}

/// A stripped executable's stack that reaches libc's start frames, named from libc's debug
/// file, is whole.
#[test]
fn stacks_through_libcs_start_frames_are_whole() {
    let stripped = vec![
        in_module("malloc", "libc.so.6"),
        in_module("cc1plus+0x5743", "cc1plus"),
        in_module("__libc_start_call_main", "libc.so.6"),
        in_module("__libc_start_main_impl", "libc.so.6"),
        in_module("cc1plus+0x5870", "cc1plus"),
    ];
    assert_eq!(shallow(&two_sites(stripped.clone(), stripped)), None);
}

/// Stacks cut because they were walked before their process's unwind tables were loaded
/// (the kernel counted those walks) name that cause, not a module without rows.
#[test]
fn stacks_walked_before_their_tables_say_so() {
    let whole = vec![in_module("malloc", "libc.so.6"), in_module("main", "nginx")];
    let cut = vec![in_module("ngx_memalign", "nginx")];
    let mut p = two_sites(whole.clone(), cut.clone());
    let said = shallow_stacks(&p).unwrap();
    assert!(
        said.contains("neither frame pointers nor unwind rows"),
        "{said}"
    );
    p.losses[heaptrace_common::Loss::UnwindLate as usize] = 30;
    let said = shallow_stacks(&p).unwrap();
    assert!(
        said.contains("most (75%) in nginx, walked before their process's unwind tables")
            && said.contains("lost: unwind_late")
            && !said.contains("neither"),
        "{said}"
    );
    assert_eq!(
        shallow(&p).unwrap().cause.brief(),
        "in nginx, before its unwind tables"
    );
}

/// Stacks cut at the walk's depth say so.
#[test]
fn stacks_cut_at_the_depth_say_so() {
    let whole = vec![in_module("malloc", "libc.so.6"), in_module("main", "prog")];
    let deep = vec![in_module("recurse", "prog"); heaptrace_common::STACK_FRAMES];
    let said = shallow_stacks(&two_sites(whole, deep)).unwrap();
    assert!(said.contains("most (75%) at the walk's depth"), "{said}");
}

#[test]
fn sites_view_lists_sites_by_bytes_and_leaks() {
    let mut p = Profile::default();
    p.stacks
        .insert((1, 5), vec![frame("big", None, None)].into());
    p.stacks
        .insert((1, 6), vec![frame("small", None, None)].into());
    let site = |calls, bytes| SiteTotals {
        calls,
        bytes,
        ..Default::default()
    };
    p.sites.insert((1, 5, 0), site(1, 1000));
    p.sites.insert((1, 6, 0), site(10, 10));
    let mut leaks = std::collections::BTreeMap::new();
    leaks.insert(
        (1, 6, 0),
        crate::drain::round::Leak {
            blocks: 2,
            bytes: 2,
        },
    );
    p.leaks = Some(leaks);
    let text = sites(&p, 5, Temporary::Allocs(1), Names::SHORT);
    let by_bytes = text.split("top sites by calls").next().unwrap();
    assert!(
        by_bytes.find("big").unwrap() < by_bytes.find("small").unwrap(),
        "{text}"
    );
    let by_calls = text.split("top sites by calls").nth(1).unwrap();
    assert!(
        by_calls.find("small").unwrap() < by_calls.find("big").unwrap(),
        "{text}"
    );
    assert!(text.contains("not freed at the end"), "{text}");
    assert!(nanos(1500).contains("1.5 us"));
}

/// Stacks whose frames read the same to the end (no file:line: calls from one function at
/// different places) show the address where they part; the same frames, the stack id. No two
/// lines of a list alike.
#[test]
fn sites_that_read_the_same_to_the_end_show_an_address_or_the_stack() {
    use crate::symbolize::FrameInfo;
    let mut p = Profile::default();
    let stack = |at: u64| -> Vec<Frame> {
        vec![
            FrameInfo::named("dictCreate")
                .in_module("redis", 0x10)
                .into(),
            FrameInfo::named("createClient")
                .in_module("redis", at)
                .into(),
            FrameInfo::named("main").in_module("redis", 0x90).into(),
        ]
    };
    p.stacks.insert((1, 5), stack(0x40).into());
    p.stacks.insert((1, 6), stack(0x48).into());
    p.stacks.insert((1, 7), stack(0x48).into());
    let ids = [(1, 5, 0), (1, 6, 0), (1, 7, 0)];
    let l = labels(&p, &ids, &Names::default());
    assert_eq!(
        l,
        [
            "malloc <- dictCreate <- createClient (redis+0x40) <- main",
            "malloc <- dictCreate <- createClient (redis+0x48) <- main (stack 6)",
            "malloc <- dictCreate <- createClient (redis+0x48) <- main (stack 7)",
        ]
    );
}

/// A site is named past the wrappers: the allocating function says which it went through,
/// then the site's frame and DEPTH frames; the stack keeps every frame.
#[test]
fn sites_are_labelled_past_their_wrappers() {
    use crate::{profile::wrappers::WrapperRule, symbolize::FrameInfo};
    let mut p = Profile::default().with_wrapper_rule(WrapperRule::new(
        &[crate::profile::wrappers::parse_hide("^my_alloc$").unwrap()],
        false,
        "/lib/libc.so.6",
    ));
    let frames: Vec<Frame> = ["my_alloc", "a", "b", "c", "d", "e"]
        .iter()
        .map(|f| FrameInfo::named(f).into())
        .collect();
    p.stacks.insert((1, 5), frames.into());
    assert_eq!(
        labels(&p, &[(1, 5, 0)], &Names::default()),
        ["malloc via my_alloc <- a <- b <- c <- d"]
    );
    assert_eq!(p.frames(&(1, 5, 0)).len(), 6);
    // The allocation that reached the peak has no function: the wrapper reads as a frame.
    assert_eq!(site_label(&p, &(1, 5, u32::MAX), 1), "? <- my_alloc <- a");
    let note = wrappers_note(&p).unwrap();
    assert!(note.contains("my_alloc (--hide)"), "{note}");
}
