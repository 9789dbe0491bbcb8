use heaptrace_common::Func;

use super::*;
use crate::{
    drain::round::{NewStack, ProcRound, SiteTotals, Totals},
    record::{Recorder, format::EndRec},
    symbolize::modules::Location,
};

fn sample_round(index: u64, with_stack: bool) -> Round {
    let mut delta = Totals::default();
    delta.funcs[Func::Malloc as usize].calls = 10 * index;
    delta.funcs[Func::Malloc as usize].bytes = 1000 * index;
    let mut r = Round {
        index,
        elapsed_ms: 1000 * index,
        ..Default::default()
    };
    r.procs.insert(
        42,
        ProcRound {
            comm: "fx".into(),
            delta,
            cgroup: String::new(),
        },
    );
    r.sizes.insert((42, 0, 100, 7), 10 * index);
    r.sites.insert(
        (42, 7, 0),
        SiteTotals {
            calls: 10 * index,
            bytes: 1000 * index,
            ..Default::default()
        },
    );
    if with_stack {
        let exe = std::env::current_exe().unwrap();
        r.stacks.insert(
            (42, 7),
            NewStack {
                ips: vec![0x1000, 0x2000],
                locations: vec![
                    Some(Location {
                        path: exe.clone().into(),
                        offset: 0x10,
                        file: crate::targets::target_file::TargetFile::host(&exe)
                            .ok()
                            .map(Into::into),
                    }),
                    None,
                ],
                frames: vec![
                    crate::symbolize::FrameInfo {
                        function: "alloc_a".into(),
                        file: Some("fx.c".into()),
                        line: Some(9),
                        module: exe.file_name().unwrap().to_string_lossy().into(),
                        offset: 0x10,
                        inlined: false,
                    }
                    .into(),
                    crate::symbolize::FrameInfo {
                        function: "[unknown] 0x2000".into(),
                        file: None,
                        line: None,
                        module: "[unknown]".into(),
                        offset: 0x2000,
                        inlined: false,
                    }
                    .into(),
                    // A Python frame: no file mapped, marked by its module's name.
                    crate::symbolize::FrameInfo::named("fill")
                        .at("/src/arenas.py", 12)
                        .in_module(crate::unwind::python::PYTHON_MODULE, 0)
                        .into(),
                ]
                .into(),
            },
        );
    }
    r
}

fn sample_file(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("t.bin");
    let header = Header {
        heaptrace_version: "test".into(),
        interval_ms: 1000,
        mode: crate::run_info::Mode::Stacks,
        ..Default::default()
    };
    let mut w = Recorder::create_at(&path, &header).unwrap();
    w.round(&sample_round(1, true)).unwrap();
    w.round(&sample_round(2, false)).unwrap();
    let mut leaks = BTreeMap::new();
    leaks.insert(
        (42, 7, 0),
        Leak {
            blocks: 3,
            bytes: 300,
        },
    );
    w.finish(
        Some(&leaks),
        &EndRec {
            elapsed_ms: 2000,
            exit_code: Some(0),
            reason: "exited".into(),
        },
    )
    .unwrap();
    path
}

fn tempdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("heaptrace-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_recording_replays_into_the_same_profile() {
    let dir = tempdir("rt");
    let rec = Recording::open(&sample_file(&dir)).unwrap();
    assert!(!rec.truncated);
    assert_eq!(rec.header.mode, crate::run_info::Mode::Stacks);
    assert_eq!(rec.rounds.len(), 2);
    let p = rec.profile();
    let mut live = Profile::default();
    live.apply(&sample_round(1, true));
    live.apply(&sample_round(2, false));
    assert_eq!(p.totals(), live.totals());
    assert_eq!(p.sites, live.sites);
    assert_eq!(p.sizes, live.sizes);
    assert_eq!(p.frames(&(42, 7, 0)), live.frames(&(42, 7, 0)));
    assert_eq!(
        p.leak_totals(None),
        Some(Leak {
            blocks: 3,
            bytes: 300
        })
    );
    assert_eq!(rec.end.as_ref().unwrap().exit_code, Some(0));
    let s = &rec.stacks[&(42, 7)];
    assert_eq!(s.locations[0].map(|(_, off)| off), Some(0x10));
    assert!(
        rec.modules[0].build_id.is_some(),
        "the test binary has a build id"
    );
}

/// A file of format `version` with `header` (that version's layout) and one round, read.
fn read_version(version: u16, header: &impl serde::Serialize) -> Recording {
    use crate::record::format::{Kind, write_frame, write_preamble_version};
    let mut data = Vec::new();
    write_preamble_version(&mut data, version).unwrap();
    write_frame(&mut data, Kind::Header, header).unwrap();
    write_frame(&mut data, Kind::Round, &sample_round(1, false)).unwrap();
    Recording::read(&data[..]).unwrap()
}

/// A file of the current format with `header` and nothing else, written and opened.
fn round_trip(tag: &str, header: &Header) -> Recording {
    let path = tempdir(tag).join("h.bin");
    Recorder::create_at(&path, header).unwrap();
    Recording::open(&path).unwrap()
}

/// `h` in the layout of an older format, which ended `dropped` fields earlier: its payload
/// without those fields (zero in `h`, one byte each), written byte by byte.
struct OldLayout(Vec<u8>);

impl serde::Serialize for OldLayout {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple;
        let mut t = s.serialize_tuple(self.0.len())?;
        for b in &self.0 {
            t.serialize_element(b)?;
        }
        t.end()
    }
}

fn old_layout(h: &Header, dropped: usize) -> OldLayout {
    let mut bytes = postcard::to_stdvec(h).unwrap();
    let keep = bytes.len() - dropped;
    assert!(
        bytes[keep..].iter().all(|b| *b == 0),
        "dropped fields are zero"
    );
    bytes.truncate(keep);
    OldLayout(bytes)
}

/// A format 5 header ends before `latency_every`: it reads as every call timed, and the
/// current format keeps the rate.
#[test]
fn format_5_recordings_read_with_every_call_timed() {
    let old = Header {
        heaptrace_version: "0.1.0".into(),
        interval_ms: 250,
        mode: crate::run_info::Mode::Sizes,
        sample_bytes: 512,
        ..Default::default()
    };
    let rec = read_version(5, &old_layout(&old, 4));
    assert_eq!(rec.header.interval_ms, 250);
    assert_eq!(rec.header.sample_bytes, 512);
    assert_eq!(rec.header.latency_every, 0);
    assert_eq!(rec.profile().latency_sampled(), None);
    assert_eq!(rec.rounds.len(), 1);
    let header = Header {
        latency_every: 16,
        ..Default::default()
    };
    let rec = round_trip("v5", &header);
    assert_eq!(rec.header.latency_every, 16);
    assert_eq!(rec.profile().latency_sampled(), Some(16));
}

/// A format 6 header ends before `temporary_allocs`: its temporaries were counted by time
/// and are shown by that rule; the current format keeps the allocation count.
#[test]
fn format_6_recordings_keep_their_time_rule_for_temporaries() {
    use crate::run_info::Temporary;
    let old = Header {
        heaptrace_version: "0.1.0".into(),
        mode: crate::run_info::Mode::Stacks,
        temporary_ms: 250,
        latency_every: 16,
        ..Default::default()
    };
    let rec = read_version(6, &old_layout(&old, 3));
    assert_eq!(rec.header.latency_every, 16);
    assert_eq!(rec.header.temporary_allocs, 0);
    assert_eq!(rec.header.temporary(), Temporary::WithinMs(250));
    let header = Header {
        temporary_allocs: 3,
        ..Default::default()
    };
    let rec = round_trip("v6", &header);
    assert_eq!(rec.header.temporary(), Temporary::Allocs(3));
}

/// A format 7 header ends before `comm` and `cgroup`: it reads as a trace of every
/// process; the current format keeps what `--comm` and `--cgroup` narrowed it to.
#[test]
fn format_7_recordings_read_as_not_narrowed() {
    let old = Header {
        heaptrace_version: "0.1.0".into(),
        target_mode: crate::run_info::TargetKind::All,
        latency_every: 16,
        temporary_allocs: 2,
        ..Default::default()
    };
    let rec = read_version(7, &old_layout(&old, 2));
    assert_eq!(rec.header.temporary_allocs, 2);
    assert_eq!((rec.header.comm, rec.header.cgroup), (None, None));
    let header = Header {
        target_mode: crate::run_info::TargetKind::All,
        comm: Some("nginx".into()),
        cgroup: Some("/system.slice".into()),
        ..Default::default()
    };
    let rec = round_trip("v7", &header);
    assert_eq!(rec.header.comm.as_deref(), Some("nginx"));
    assert_eq!(rec.header.cgroup.as_deref(), Some("/system.slice"));
}

#[test]
fn format_2_recordings_still_read_as_unsampled() {
    let old = Header {
        heaptrace_version: "0.1.0".into(),
        interval_ms: 500,
        mode: crate::run_info::Mode::Stacks,
        ..Default::default()
    };
    let rec = read_version(2, &old_layout(&old, 5));
    assert_eq!(rec.header.interval_ms, 500);
    assert_eq!(rec.header.sample_bytes, 0);
    assert_eq!(rec.profile().sample_bytes, 0);
    assert_eq!(rec.rounds.len(), 1);
    // And the current version keeps the rate.
    let header = Header {
        sample_bytes: 4096,
        ..Default::default()
    };
    let rec = round_trip("v2", &header);
    assert_eq!(rec.header.sample_bytes, 4096);
    assert_eq!(rec.profile().sample_bytes, 4096);
    assert!(!rec.profile().calls);
}

/// A calls-mode recording replays as calls mode: the views then show no live figures.
#[test]
fn a_calls_mode_recording_replays_as_calls_mode() {
    let dir = tempdir("calls");
    let path = dir.join("c.bin");
    let header = Header {
        mode: crate::run_info::Mode::Calls,
        ..Default::default()
    };
    Recorder::create_at(&path, &header).unwrap();
    let rec = Recording::open(&path).unwrap();
    assert!(rec.profile().calls);
}

#[test]
fn every_truncation_reads_up_to_its_last_complete_record() {
    let dir = tempdir("trunc");
    let data = std::fs::read(sample_file(&dir)).unwrap();
    // Preamble (12) + the header frame's head (9) + its payload: before that, no header.
    let header_end = 21 + u32::from_le_bytes(data[13..17].try_into().unwrap()) as usize;
    let mut last_rounds = 0;
    for cut in 0..data.len() {
        match Recording::read(&data[..cut]) {
            Ok(rec) => {
                assert!(
                    rec.rounds.len() >= last_rounds,
                    "rounds went backwards at {cut}"
                );
                last_rounds = rec.rounds.len();
                assert!(rec.truncated || rec.end.is_none() || cut == data.len());
            }
            Err(e) => assert!(cut < header_end, "cut at {cut} of {}: {e}", data.len()),
        }
    }
    assert_eq!(Recording::read(&data[..]).unwrap().rounds.len(), 2);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(400))]

    /// The reader's fuzz target: a valid recording with random bytes overwritten, inserted
    /// or removed, or a random prefix of it, never panics, hangs or allocates without bound.
    #[test]
    fn mutated_recordings_never_panic(
        edits in proptest::collection::vec((0usize..4096, proptest::prelude::any::<u8>(), 0u8..3), 1..12),
        cut in proptest::option::of(0usize..4096),
    ) {
        static SAMPLE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        let mut data = SAMPLE
            .get_or_init(|| std::fs::read(sample_file(&tempdir("fuzz"))).unwrap())
            .clone();
        for (at, byte, op) in edits {
            let at = at % (data.len() + 1);
            match op {
                0 if at < data.len() => data[at] = byte,
                1 => data.insert(at, byte),
                _ if at < data.len() => { data.remove(at); }
                _ => {}
            }
        }
        if let Some(c) = cut {
            data.truncate(c % (data.len() + 1));
        }
        let _ = Recording::read(&data[..]);
    }
}

#[test]
fn flipped_bytes_give_an_error_not_a_panic() {
    let dir = tempdir("flip");
    let data = std::fs::read(sample_file(&dir)).unwrap();
    for i in 0..data.len() {
        let mut bad = data.clone();
        bad[i] ^= 0x5a;
        // Either rejected, or (in padding-like bytes) read: never a panic or a hang.
        let _ = Recording::read(&bad[..]);
    }
}

mod hostile;
