use super::*;
use crate::symbolize::FrameInfo;

/// A frame of `function` in the program "prog", returning to `offset`.
fn at(function: &str, offset: u64) -> Frame {
    FrameInfo::named(function).in_module("prog", offset).into()
}

/// A stack, innermost first, each frame at its own offset unless given.
fn stack(functions: &[(&str, u64)]) -> Vec<Frame> {
    functions.iter().map(|(f, o)| at(f, *o)).collect()
}

fn rule() -> WrapperRule {
    WrapperRule {
        allocator_module: "libc.so.6".into(),
        ..Default::default()
    }
}

/// `xmalloc`, calling malloc from one place, called from six functions.
fn through_xmalloc() -> Vec<Vec<Frame>> {
    (0..6)
        .map(|i| {
            let caller = format!("caller_{i}");
            stack(&[("xmalloc", 0x10), (&caller, 0x100 + i), ("main", 0x500)])
        })
        .collect()
}

#[test]
fn a_function_with_many_callers_only_above_malloc_is_a_wrapper() {
    let stacks = through_xmalloc();
    let detected = detected_in(rule(), &stacks);
    assert_eq!(detected.into_iter().collect::<Vec<_>>(), ["xmalloc"]);
    let w = Wrappers::with_rule(Arc::new(rule()), stacks.iter().map(|s| &s[..]));
    assert_eq!(w.site(&stacks[3]), SiteFrame(1));
    assert_eq!(
        *w.site(&stacks[3]).frame(&stacks[3]).unwrap().function,
        *"caller_3"
    );
    assert_eq!(w.site(&stacks[3]).wrappers(&stacks[3]).len(), 1);
}

#[test]
fn main_calling_malloc_from_several_places_is_not_a_wrapper() {
    // Five places in main, one caller of main: neither many callers nor few call sites.
    let stacks: Vec<Vec<Frame>> = (0..5)
        .map(|i| stack(&[("main", 0x10 + i), ("__libc_start_call_main", 0x20)]))
        .collect();
    assert!(detected_in(rule(), &stacks).is_empty());
    // Nor a helper called from one function at many places.
    let stacks: Vec<Vec<Frame>> = (0..6)
        .map(|i| stack(&[("helper", 0x10), ("only_caller", 0x100 + i)]))
        .collect();
    assert!(detected_in(rule(), &stacks).is_empty());
}

#[test]
fn a_function_that_also_calls_other_allocating_code_is_not_a_wrapper() {
    let mut stacks = through_xmalloc();
    // xmalloc also calls log_line, which allocates: it does more than wrap malloc.
    stacks.push(stack(&[
        ("log_line", 0x30),
        ("xmalloc", 0x18),
        ("caller_0", 0x100),
    ]));
    assert!(!detected_in(rule(), &stacks).contains("xmalloc"));
}

#[test]
fn a_function_calling_malloc_from_many_places_is_not_a_wrapper() {
    // Six callers, but malloc called from six places in it: a function of its own.
    let stacks: Vec<Vec<Frame>> = (0..6)
        .map(|i| {
            let caller = format!("caller_{i}");
            stack(&[("parse", 0x10 + i), (&caller, 0x100)])
        })
        .collect();
    assert!(detected_in(rule(), &stacks).is_empty());
}

#[test]
fn a_constructor_calling_a_wrapper_stays_a_site() {
    // dictCreate calls a zmalloc of no known name (a call of its own, not inlined), from
    // many callers: the wrapper is detected, dictCreate is the site.
    let mut stacks = Vec::new();
    for i in 0..6 {
        let caller = format!("caller_{i}");
        stacks.push(stack(&[
            ("my_malloc", 0x10),
            ("dictCreate", 0x40),
            (&caller, 0x100),
        ]));
        stacks.push(stack(&[("my_malloc", 0x10), (&caller, 0x200)]));
    }
    let detected = detected_in(rule(), &stacks);
    assert_eq!(detected.into_iter().collect::<Vec<_>>(), ["my_malloc"]);
}

#[test]
fn a_wrapper_inlined_into_another_makes_both_wrappers() {
    // Redis's shape under names of no known service: ztrymalloc_usable inlined into zmalloc,
    // zcalloc, zrealloc and zmalloc_usable; zmalloc called from many functions.
    let outer = ["my_malloc", "my_calloc", "my_realloc", "my_malloc_usable"];
    let mut stacks = Vec::new();
    for (n, o) in outer.iter().enumerate() {
        for i in 0..5 {
            let caller = format!("caller_{i}");
            let mut s = stack(&[
                ("my_trymalloc_usable", 0x10 + n as u64),
                (o, 0x10 + n as u64),
            ]);
            s[0] = FrameInfo::named("my_trymalloc_usable")
                .in_module("prog", 0x10 + n as u64)
                .inlined(true)
                .into();
            s.push(at(&caller, 0x100));
            stacks.push(s);
        }
    }
    let detected = detected_in(rule(), &stacks);
    assert_eq!(
        detected.into_iter().collect::<Vec<_>>(),
        [
            "my_calloc",
            "my_malloc",
            "my_malloc_usable",
            "my_realloc",
            "my_trymalloc_usable"
        ]
    );
}

#[test]
fn hide_names_wrappers_detection_would_not() {
    // Two callers only: not detected; --hide names it.
    let stacks: Vec<Vec<Frame>> = (0..2)
        .map(|i| {
            let caller = format!("caller_{i}");
            stack(&[("my_alloc", 0x10), (&caller, 0x100)])
        })
        .collect();
    let w = Wrappers::with_rule(Arc::new(rule()), stacks.iter().map(|s| &s[..]));
    assert_eq!(w.site(&stacks[0]), SiteFrame(0));
    let hidden = WrapperRule {
        hide: vec![parse_hide("^my_").unwrap()],
        ..rule()
    };
    let w = Wrappers::with_rule(Arc::new(hidden.clone()), stacks.iter().map(|s| &s[..]));
    assert_eq!(w.site(&stacks[1]), SiteFrame(1));
    let over = w.passed_over(stacks.iter().map(|s| &s[..]));
    assert_eq!(over.get("my_alloc"), Some(&Skipped::Hidden));
    let line = note(&over, &hidden).unwrap();
    assert!(
        line.starts_with("sites named past allocator wrappers: my_alloc (--hide)"),
        "{line}"
    );
    assert!(parse_hide("(").is_err());
}

#[test]
fn detection_can_be_turned_off() {
    let stacks = through_xmalloc();
    let off = WrapperRule {
        no_detection: true,
        ..rule()
    };
    assert!(detected_in(off.clone(), &stacks).is_empty());
    let w = Wrappers::with_rule(Arc::new(off), stacks.iter().map(|s| &s[..]));
    assert_eq!(w.site(&stacks[0]), SiteFrame(0));
}

#[test]
fn the_allocators_own_and_known_wrappers_are_passed_over() {
    let s: Vec<Frame> = vec![
        FrameInfo::named("strdup").in_module("libc.so.6", 1).into(),
        FrameInfo::named("operator new(unsigned long)")
            .in_module("libstdc++.so.6", 2)
            .into(),
        at("make", 3),
    ];
    let w = Wrappers::with_rule(Arc::new(rule()), std::iter::once(&s[..]));
    assert_eq!(w.site(&s), SiteFrame(2));
    let over = w.passed_over(std::iter::once(&s[..]));
    // The allocator's own frames are not wrappers to report.
    assert_eq!(over.len(), 1);
    assert_eq!(over.values().next(), Some(&Skipped::Known));
    // Every frame passed over: the innermost names the site.
    let only = vec![FrameInfo::named("strdup").in_module("libc.so.6", 1).into()];
    assert_eq!(w.site(&only), SiteFrame(0));
}

/// A frame no symbol names, in "prog" at `offset`.
fn unnamed(offset: u64) -> Frame {
    FrameInfo::named(&format!("prog+{offset:#x}"))
        .in_module("prog", offset)
        .into()
}

fn site_name(w: &Wrappers, s: &[Frame]) -> String {
    w.site(s).frame(s).unwrap().function.to_string()
}

#[test]
fn a_services_known_wrapper_is_stripped_and_its_callers_stay_sites() {
    // Redis: zmalloc known; dictCreate calls it from one place and six functions call
    // dictCreate. Known names are detection's first pass: dictCreate calls a wrapper, so it
    // names a site and is never detected.
    let mut stacks = Vec::new();
    for i in 0..6 {
        let caller = format!("caller_{i}");
        stacks.push(stack(&[
            ("zmalloc", 0x10),
            ("dictCreate", 0x40),
            (&caller, 0x100),
        ]));
    }
    let w = Wrappers::with_rule(Arc::new(rule()), stacks.iter().map(|s| &s[..]));
    assert!(w.detected().is_empty(), "{:?}", w.detected());
    for s in &stacks {
        assert_eq!(site_name(&w, s), "dictCreate");
    }
    let over = w.passed_over(stacks.iter().map(|s| &s[..]));
    assert_eq!(over.get("zmalloc"), Some(&Skipped::Known));
    let json = summary(&w, stacks.iter().map(|s| &s[..]));
    assert_eq!(json["known"], serde_json::json!(["zmalloc"]));
}

#[test]
fn a_known_wrapper_with_one_caller_is_stripped() {
    // nginx: ngx_alloc called from one function only, which detection would never take.
    let s = stack(&[
        ("ngx_alloc", 0x10),
        ("ngx_event_accept", 0x40),
        ("main", 0x90),
    ]);
    let w = Wrappers::with_rule(Arc::new(rule()), std::iter::once(&s[..]));
    assert_eq!(site_name(&w, &s), "ngx_event_accept");
    // A compiler's clone of a known wrapper is one too.
    let s = stack(&[("ngx_palloc_small.isra.0", 0x10), ("ngx_array_push", 0x40)]);
    assert_eq!(site_name(&w, &s), "ngx_array_push");
}

#[test]
fn frames_a_known_wrapper_calls_or_jumps_to_are_its_own() {
    // PostgreSQL: palloc calls AllocSetAlloc through a pointer; without a symbol table that
    // frame has no name. It is palloc's own, not a site.
    let pg = vec![
        unnamed(0x5c785f),
        at("palloc", 0x5cd7a0),
        at("ExprEvalPushStep", 0x100),
        at("main", 0x500),
    ];
    // nginx: ngx_palloc ends in a jump to its static ngx_palloc_large, which calls
    // ngx_alloc: the unnamed frame above ngx_alloc is the wrapper's, its caller the site.
    let ngx = vec![
        at("ngx_alloc", 0x4cd00),
        unnamed(0x278c4),
        at("ngx_create_temp_buf", 0x200),
        at("main", 0x500),
    ];
    // An unnamed frame that is the site of its own stays one when no known wrapper is
    // beside it, or when the wrapper below it does not call the allocator itself (palloc
    // calls AllocSetAlloc): a static function of PostgreSQL's calling palloc.
    let plain = vec![unnamed(0x300), at("caller", 0x310), at("main", 0x500)];
    let pg_static = vec![
        unnamed(0x5c785f),
        at("palloc", 0x5cd7a0),
        unnamed(0x5952eb),
        at("RelationCacheInitializePhase3", 0x100),
    ];
    let all = [pg.clone(), ngx.clone(), plain.clone(), pg_static.clone()];
    let w = Wrappers::with_rule(Arc::new(rule()), all.iter().map(|s| &s[..]));
    assert_eq!(site_name(&w, &pg), "ExprEvalPushStep");
    assert_eq!(site_name(&w, &ngx), "ngx_create_temp_buf");
    assert_eq!(w.site(&plain), SiteFrame(0));
    assert_eq!(w.site(&pg_static), SiteFrame(2));
}

#[test]
fn a_user_function_named_like_nothing_known_is_untouched() {
    let s = stack(&[
        ("my_zmalloc_helper", 0x10),
        ("palloc_table", 0x20),
        ("main", 0x30),
    ]);
    let w = Wrappers::with_rule(Arc::new(rule()), std::iter::once(&s[..]));
    assert_eq!(w.site(&s), SiteFrame(0));
    assert!(w.passed_over(std::iter::once(&s[..])).is_empty());
}

#[test]
fn no_wrapper_detection_turns_the_known_services_off_too() {
    let s = stack(&[("zmalloc", 0x10), ("dictCreate", 0x40)]);
    let off = WrapperRule {
        no_detection: true,
        ..rule()
    };
    let w = Wrappers::with_rule(Arc::new(off), std::iter::once(&s[..]));
    assert_eq!(site_name(&w, &s), "zmalloc");
}
