use super::*;
use crate::record::format::ModuleRec;

fn fr(name: &str, inlined: bool) -> Frame {
    crate::symbolize::FrameInfo::named(name)
        .inlined(inlined)
        .into()
}

#[test]
fn inlined_frames_group_with_the_address_they_belong_to() {
    let frames = [fr("inner", true), fr("outer", false), fr("main", false)];
    let groups = per_address(&frames);
    assert_eq!(groups.len(), 2);
    assert_eq!(groups[0].len(), 2);
    assert_eq!(&*groups[1][0].function, "main");
}

#[test]
fn a_sampled_profile_gives_pprof_its_period() {
    let rec = Recording::default();
    let mut p = Profile::sampled(65536);
    p.sites.insert(
        (1, 3, 0),
        crate::drain::round::SiteTotals {
            calls: 640,
            bytes: 655360,
            ..Default::default()
        },
    );
    let out = pprof(&rec, &p, &Names::default());
    let name = |i: i64| out.string_table[i as usize].as_str();
    let period_type = out.period_type.clone().expect("a period type");
    assert_eq!(
        (name(period_type.r#type), name(period_type.unit)),
        ("space", "bytes")
    );
    assert_eq!(out.period, 65536);
    assert!(name(out.comment[0]).contains("1 per 65536 bytes"));
    // The values are the Profile's estimates, not scaled again.
    assert_eq!(out.sample[0].value[..2], [640, 655360]);
    let exact = pprof(&rec, &Profile::default(), &Names::default());
    assert_eq!((exact.period_type, exact.period), (None, 0));
}

#[test]
fn the_traced_executable_is_pprofs_main_mapping() {
    let module = |id: u32, path: &str| ModuleRec {
        id,
        path: path.into(),
        build_id: None,
    };
    // A python3 run: libpython got the first id, the executable is python3.11.
    let mut rec = Recording::default();
    rec.header.command = vec!["python3".into(), "-c".into(), "pass".into()];
    rec.modules = vec![
        module(0, "/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0"),
        module(1, "/usr/lib/x86_64-linux-gnu/libc.so.6"),
        module(2, "/usr/bin/python3.11"),
    ];
    let out = pprof(&rec, &Profile::default(), &Names::default());
    let file = |i: usize| out.string_table[out.mapping[i].filename as usize].as_str();
    assert_eq!(file(0), "/usr/bin/python3.11");
    assert_eq!(out.mapping.len(), 3);
    // The module holding `main` wins over the command's name.
    rec.strings = vec!["main".into()];
    rec.stacks.insert(
        (1, 1),
        crate::record::format::StackRec {
            pid: 1,
            stack_id: 1,
            ips: vec![1],
            locations: vec![None],
            frames: vec![crate::record::format::FrameRec {
                function: 0,
                file: None,
                line: None,
                module: Some(1),
                offset: 0,
                inlined: false,
            }],
        },
    );
    let out = pprof(&rec, &Profile::default(), &Names::default());
    let file = |i: usize| out.string_table[out.mapping[i].filename as usize].as_str();
    assert_eq!(file(0), "/usr/lib/x86_64-linux-gnu/libc.so.6");
}
