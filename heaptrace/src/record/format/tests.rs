use super::*;

fn roundtrip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(kind: Kind, v: &T) {
    let mut buf = Vec::new();
    write_frame(&mut buf, kind, v).unwrap();
    let Next::Frame(f) = FrameReader::new(&buf[..], 12).next_frame().unwrap() else {
        panic!("no frame")
    };
    assert_eq!(f.kind, kind);
    assert_eq!(&decode::<T>(&f).unwrap(), v);
}

#[test]
fn frames_round_trip_plain_and_deflated() {
    roundtrip(Kind::String, &(7u32, "malloc".to_string()));
    roundtrip(
        Kind::Stack,
        &StackRec {
            pid: 1,
            stack_id: 3,
            ips: vec![1, 2, 3],
            locations: vec![Some((0, 10)), None, Some((1, 30))],
            frames: vec![],
        },
    );
}

/// A round of an earlier version is a version 14 round without the fields added since, each
/// an empty list or a zero at the end: the pymalloc arenas (14), the peaks' compositions (13),
/// the newer losses (12), the unwinding losses (10), the peaks (9), the ends and folds (5), the
/// restarts (4). Each reads back whole, its losses of before 10 in their place.
#[test]
fn rounds_of_earlier_versions_read_without_the_later_fields() {
    use heaptrace_common::Loss;
    let mut round = crate::drain::round::Round {
        index: 7,
        restarted: vec![42],
        ended: vec![43, 44],
        folded: vec![43],
        ..Default::default()
    };
    round.losses[Loss::Stack as usize] = 5;
    round.losses[Loss::UnwindNoRule as usize] = 9;
    round.mem.insert(1, crate::targets::procfs::Mem::default());
    let frame = |payload: Vec<u8>| RawFrame {
        kind: Kind::Round,
        offset: 0,
        stored_len: 0,
        payload,
    };
    round.losses[Loss::UnwindLate as usize] = 4;
    let held = crate::drain::round::PeakHeld {
        bytes: 300,
        blocks: 3,
        sites: vec![(4, 0, 3, 300)],
    };
    round.peak_held.insert(1, held);
    let reserved = crate::reserve::Reserved {
        heap: 1,
        arenas: 2,
        mmapped: 3,
        pymalloc: 4 << 20,
    };
    round.reserved.insert(1, reserved);
    let v14 = postcard::to_allocvec(&round).unwrap();
    assert_eq!(decode_round(&frame(v14), 14).unwrap(), round);
    // Version 13: without the pymalloc arenas (an empty map, one byte, after the rest).
    round.reserved.get_mut(&1).unwrap().pymalloc = 0;
    let before14 = |r: &crate::drain::round::Round| {
        let mut v = postcard::to_allocvec(r).unwrap();
        assert_eq!(v.split_off(v.len() - 1), [0], "the pymalloc arenas, last");
        v
    };
    let v13 = before14(&round);
    assert_eq!(decode_round(&frame(v13), 13).unwrap(), round);
    // Version 12: without the peaks' compositions (an empty map, one byte).
    round.peak_held.clear();
    let mut v12 = before14(&round);
    assert_eq!(
        v12.split_off(v12.len() - 1),
        [0],
        "the peaks' compositions, last"
    );
    assert_eq!(decode_round(&frame(v12), 12).unwrap(), round);
    // Version 10 and 11: without the list of newer losses either (one here, a zero, cut off).
    round.losses[Loss::UnwindLate as usize] = 0;
    let v11 = |r: &crate::drain::round::Round| {
        let mut v = before14(r);
        assert_eq!(
            v.split_off(v.len() - 3),
            [1, 0, 0],
            "the newer losses, last"
        );
        v
    };
    assert_eq!(decode_round(&frame(v11(&round)), 11).unwrap(), round);
    assert_eq!(decode_round(&frame(v11(&round)), 10).unwrap(), round);
    // Version 9: without the three later losses (written as zeros here to cut them off).
    round.losses[Loss::UnwindNoRule as usize] = 0;
    let mut v9 = v11(&round);
    assert_eq!(
        v9.split_off(v9.len() - 3),
        [0, 0, 0],
        "the later losses, last"
    );
    let back = decode_round(&frame(v9.clone()), 9).unwrap();
    assert_eq!(back, round);
    assert_eq!(
        back.losses[Loss::Stack as usize],
        5,
        "an old loss in its place"
    );
    // Version 5 to 8: no peaks either (an empty map, one byte).
    let mut v5 = v9;
    assert_eq!(v5.split_off(v5.len() - 1), [0]);
    assert_eq!(decode_round(&frame(v5), 5).unwrap(), round);
    round.ended.clear();
    round.folded.clear();
    let mut v4 = v11(&round);
    assert_eq!(
        v4.split_off(v4.len() - 6),
        [0; 6],
        "empty lists, peaks, later losses"
    );
    assert_eq!(decode_round(&frame(v4.clone()), 4).unwrap(), round);
    round.restarted.clear();
    let mut v3 = v11(&round);
    assert_eq!(v3.split_off(v3.len() - 7), [0; 7]);
    assert_eq!(decode_round(&frame(v3), 3).unwrap(), round);
}

#[test]
fn preamble_rejects_what_it_does_not_know() {
    let mut ok = Vec::new();
    write_preamble(&mut ok).unwrap();
    assert!(read_preamble(&mut &ok[..]).is_ok());
    assert!(matches!(
        read_preamble(&mut &b""[..]),
        Err(FormatError::Empty)
    ));
    assert!(matches!(
        read_preamble(&mut &b"ELF\x7fxxxxxxxx"[..]),
        Err(FormatError::BadMagic)
    ));
    let mut future = ok.clone();
    future[8] = 99;
    assert!(matches!(
        read_preamble(&mut &future[..]),
        Err(FormatError::FutureVersion(99))
    ));
    let mut old = ok.clone();
    old[8] = 1;
    assert!(matches!(
        read_preamble(&mut &old[..]),
        Err(FormatError::OldVersion(1))
    ));
}

#[test]
fn damaged_frames_are_detected() {
    let mut buf = Vec::new();
    write_frame(&mut buf, Kind::String, &(1u32, "x".to_string())).unwrap();
    // Cut short: truncated, not an error.
    assert!(matches!(
        FrameReader::new(&buf[..buf.len() - 1], 0)
            .next_frame()
            .unwrap(),
        Next::Truncated
    ));
    // A length past the end of the file, with the whole payload there: wrong, not cut.
    let mut long = buf.clone();
    long[1..5].copy_from_slice(&(buf.len() as u32).to_le_bytes());
    let err = FrameReader::new(&long[..], 0).next_frame().err().unwrap();
    assert!(err.to_string().contains("runs past the end"), "{err}");
    // A flipped payload bit: checksum mismatch.
    let mut bad = buf.clone();
    *bad.last_mut().unwrap() ^= 1;
    let err = FrameReader::new(&bad[..], 0).next_frame().err().unwrap();
    assert!(err.to_string().contains("checksum"), "{err}");
    // A hostile length: refused before any allocation.
    let mut huge = buf.clone();
    huge[1..5].copy_from_slice(&u32::MAX.to_le_bytes());
    let err = FrameReader::new(&huge[..], 0).next_frame().err().unwrap();
    assert!(err.to_string().contains("exceeds"), "{err}");
    // An unknown kind.
    let mut kind = buf;
    kind[0] = 200;
    let err = FrameReader::new(&kind[..], 0).next_frame().err().unwrap();
    assert!(err.to_string().contains("unknown record kind"), "{err}");
}

/// A count larger than the payload left is refused as it is read, not trusted: postcard gives
/// serde no size hint then, so no vector is sized by it.
#[test]
fn counts_beyond_the_payload_are_refused() {
    let mut raw = vec![0, 0];
    // ips: 2^62 of them, then 3 bytes.
    raw.extend([
        0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x3f, 1, 2, 3,
    ]);
    let frame = RawFrame {
        kind: Kind::Stack,
        offset: 0,
        stored_len: 0,
        payload: raw,
    };
    let err = decode::<StackRec>(&frame).err().unwrap();
    assert!(
        err.to_string().contains("undecodable Stack record"),
        "{err}"
    );
}

#[test]
fn recordings_before_format_7_keep_their_time_rule() {
    let old = Header {
        temporary_ms: 250,
        ..Default::default()
    };
    assert_eq!(old.temporary(), Temporary::WithinMs(250));
    assert_eq!(old.temporary().to_string(), "freed within 250 ms");
    let new = Header {
        temporary_allocs: 4,
        ..Default::default()
    };
    assert_eq!(new.temporary(), Temporary::Allocs(4));
    assert_eq!(
        new.temporary().to_string(),
        "freed with fewer than 4 allocations of its thread in between"
    );
    assert_eq!(
        Temporary::default().to_string(),
        "freed before its thread's next allocation or free (heaptrack's rule)"
    );
}

/// Formats 7 to 11 counted the thread's allocations in between only; format 12 its frees too.
#[test]
fn headers_before_12_counted_allocations_only_in_between() {
    let frame = |payload: Vec<u8>| RawFrame {
        kind: Kind::Header,
        offset: 0,
        stored_len: 0,
        payload,
    };
    let h = Header::new(
        &RunInfo {
            temporary: Temporary::Events(2),
            ..RunInfo::default()
        },
        vec![],
    );
    let v12 = postcard::to_allocvec(&h).unwrap();
    assert_eq!(
        decode_header(&frame(v12.clone()), 12).unwrap().temporary(),
        Temporary::Events(2)
    );
    let mut v11 = v12;
    assert_eq!(v11.pop(), Some(1), "temporary_counts_frees, last");
    assert_eq!(
        decode_header(&frame(v11), 11).unwrap().temporary(),
        Temporary::Allocs(2)
    );
}

/// A header of format 10 ends before `collector`: it reads as the kernel's probes', and a
/// format 11 header keeps what it says.
#[test]
fn headers_before_11_were_counted_by_the_probes() {
    use crate::run_info::Collector;
    let frame = |payload: Vec<u8>| RawFrame {
        kind: Kind::Header,
        offset: 0,
        stored_len: 0,
        payload,
    };
    let h = Header {
        collector: Collector::InProcess.name().into(),
        ..Default::default()
    };
    let mut v11 = postcard::to_allocvec(&h).unwrap();
    assert_eq!(v11.pop(), Some(0), "temporary_counts_frees, last");
    let back = decode_header(&frame(v11), 11).unwrap();
    assert_eq!(back.run_info().collector, Collector::InProcess);
    let old = Header::default();
    let mut v10 = postcard::to_allocvec(&old).unwrap();
    assert_eq!(v10.pop(), Some(0), "temporary_counts_frees, last");
    assert_eq!(v10.pop(), Some(0), "the empty collector, before it");
    let back = decode_header(&frame(v10), 10).unwrap();
    assert_eq!(back.run_info().collector, Collector::Kernel);
}
