use super::*;
use crate::serve::tests_support::add_process;

fn strings(p: &PProfile, i: i64) -> &str {
    &p.string_table[i as usize]
}

#[test]
fn running_processes_give_go_heap_samples() {
    let mut s = Snapshot::default();
    add_process(&mut s, 42, "oracle", "/a.slice", 100, 64, 30);
    add_process(&mut s, 43, "other", "/b.slice", 5, 8, 0);
    let p = build(&s, &Query::default(), Kind::Heap, None);
    let types: Vec<&str> = p
        .sample_type
        .iter()
        .map(|t| strings(&p, t.r#type))
        .collect();
    assert_eq!(
        types,
        [
            "alloc_objects",
            "alloc_space",
            "inuse_objects",
            "inuse_space"
        ]
    );
    assert_eq!(strings(&p, p.default_sample_type), "inuse_space");
    assert_eq!(p.sample.len(), 2);
    assert_eq!(p.sample[0].value, [100, 6400, 70, 4480]);
    // Symbolized: the leaf's function, file and line; the main binary's mapping first.
    let loc = &p.location[p.sample[0].location_id[0] as usize - 1];
    let f = &p.function[loc.line[0].function_id as usize - 1];
    assert_eq!(strings(&p, f.name), "leaf_oracle");
    assert_eq!(strings(&p, f.filename), "/src/a.c");
    assert_eq!(loc.line[0].line, 7);
    assert_eq!(strings(&p, p.mapping[0].filename), "prog");
    let allocs = build(&s, &Query::default(), Kind::Allocs, None);
    assert_eq!(strings(&allocs, allocs.default_sample_type), "alloc_space");
}

#[test]
fn queries_narrow_to_processes() {
    let mut s = Snapshot::default();
    add_process(&mut s, 42, "oracle", "/a.slice", 100, 64, 30);
    add_process(&mut s, 43, "other", "/b.slice", 5, 8, 0);
    for q in ["pid=42", "comm=orac", "cgroup=a.sl"] {
        let q = Query::parse(Some(q)).unwrap();
        let p = build(&s, &q, Kind::Heap, None);
        assert_eq!(p.sample.len(), 1, "{q:?}");
        assert_eq!(p.sample[0].value[0], 100);
    }
    let none = build(&s, &Query::parse(Some("pid=1")).unwrap(), Kind::Heap, None);
    assert!(none.sample.is_empty());
}

#[test]
fn a_delta_profile_is_the_change_since_its_base() {
    let mut s = Snapshot::default();
    add_process(&mut s, 42, "oracle", "", 100, 64, 30);
    let base = sites(&s.profile, &Query::default());
    add_process(&mut s, 42, "oracle", "", 150, 64, 30);
    let q = Query::parse(Some("seconds=5")).unwrap();
    let p = build(&s, &q, Kind::Allocs, Some(&base));
    assert_eq!(p.sample[0].value, [50, 3200, 50, 3200]);
    assert_eq!(p.duration_nanos, 5_000_000_000);
}

#[test]
fn the_encoding_is_gzip() {
    let p = build(&Snapshot::default(), &Query::default(), Kind::Heap, None);
    let z = encode(&p);
    assert_eq!(&z[..2], &[0x1f, 0x8b]);
}
