//! Recordings damaged or made up: every one is read as the writer wrote it, refused as
//! corrupt, or read as cut short, and none reads more than was written.
use super::*;
use crate::record::format::Kind;

/// A recording of `n` rounds as the writer writes it: the first round with a stack (its
/// strings and module before it), then the leaks and the end.
fn recording(tag: &str, n: u64) -> Vec<u8> {
    let dir = tempdir(tag);
    let path = dir.join("r.bin");
    let mut w = Recorder::create_at(&path, &Header::default()).unwrap();
    for i in 1..=n {
        w.round(&sample_round(i, i == 1)).unwrap();
    }
    w.finish(Some(&BTreeMap::new()), &EndRec::default())
        .unwrap();
    let data = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    data
}

/// The frames of `data`: (offset, kind, length with the head).
fn frames(data: &[u8]) -> Vec<(usize, Kind, usize)> {
    let mut out = Vec::new();
    let mut at = 12;
    while at < data.len() {
        let len = u32::from_le_bytes(data[at + 1..at + 5].try_into().unwrap()) as usize;
        out.push((at, Kind::from_u8(data[at]).unwrap(), 9 + len));
        at += 9 + len;
    }
    out
}

/// Where `data` is corrupt, and why; it must be.
fn corrupt_at(data: &[u8]) -> (u64, String) {
    match Recording::read(data) {
        Err(FormatError::Corrupt { offset, reason }) => (offset, reason),
        Err(e) => panic!("not corruption: {e}"),
        Ok(rec) => panic!("read, {} rounds", rec.round_count),
    }
}

/// A recording written frame by frame: the header, then these.
enum Rec {
    Round(u64),
    Leaks,
    End,
}

fn by_hand(recs: &[Rec]) -> Vec<u8> {
    use crate::record::format::{write_frame, write_preamble};
    let mut data = Vec::new();
    write_preamble(&mut data).unwrap();
    write_frame(&mut data, Kind::Header, &Header::default()).unwrap();
    for r in recs {
        match r {
            Rec::Round(i) => write_frame(&mut data, Kind::Round, &sample_round(*i, false)),
            Rec::Leaks => write_frame(&mut data, Kind::Leaks, &Vec::<(SiteId, Leak)>::new()),
            Rec::End => write_frame(&mut data, Kind::End, &EndRec::default()),
        }
        .unwrap();
    }
    data
}

/// Every round frame written twice (a faulty copy, or a made-up file) read as valid, with
/// every count doubled: the copy of the first round is refused where it stands.
#[test]
fn a_round_written_twice_is_corruption() {
    let data = recording("twice", 3);
    let mut twice = data[..12].to_vec();
    let mut copy_at = None;
    for (at, kind, len) in frames(&data) {
        twice.extend(&data[at..at + len]);
        if kind == Kind::Round {
            copy_at.get_or_insert(twice.len());
            twice.extend(&data[at..at + len]);
        }
    }
    let (offset, reason) = corrupt_at(&twice);
    assert_eq!(offset, copy_at.unwrap() as u64);
    assert!(reason.contains("round 1 where round 2 was due"), "{reason}");
}

/// Rounds are numbered from 1 without a gap or a repeat, as the writer numbers them (a report
/// picks its window later, by time).
#[test]
fn rounds_follow_one_another_from_1() {
    use Rec::*;
    let rec = Recording::read(&by_hand(&[Round(1), Round(2), Round(3), Leaks, End])[..]).unwrap();
    assert_eq!((rec.round_count, rec.rounds.len()), (3, 3));
    for (recs, why) in [
        (&[Round(1), Round(1)][..], "round 1 where round 2 was due"),
        (
            &[Round(1), Round(2), Round(2)],
            "round 2 where round 3 was due",
        ),
        (&[Round(2)], "round 2 where round 1 was due"),
        (&[Round(0)], "round 0 where round 1 was due"),
        (&[Round(1), Round(3)], "round 3 where round 2 was due"),
        (&[Round(2), Round(1)], "round 2 where round 1 was due"),
    ] {
        let (_, reason) = corrupt_at(&by_hand(recs));
        assert!(reason.contains(why), "{reason}");
    }
}

/// The writer ends with the leaks and then the end record: only the end follows the leaks,
/// and nothing follows the end.
#[test]
fn only_the_end_follows_the_leaks_and_nothing_the_end() {
    use Rec::*;
    for recs in [
        &[Round(1), Leaks, End][..],
        &[Round(1), End],
        &[Round(1), Leaks],
    ] {
        assert_eq!(Recording::read(&by_hand(recs)[..]).unwrap().round_count, 1);
    }
    for (recs, why) in [
        (
            &[Round(1), Leaks, Leaks, End][..],
            "a Leaks record after the leaks",
        ),
        (
            &[Round(1), Leaks, Round(2), End],
            "a Round record after the leaks",
        ),
        (&[Round(1), End, Round(2)], "a record after the end record"),
        (&[Round(1), End, End], "a record after the end record"),
        (&[Round(1), End, Leaks], "a record after the end record"),
    ] {
        let (_, reason) = corrupt_at(&by_hand(recs));
        assert!(reason.contains(why), "{reason}");
    }
}

/// A round followed by `zeros` zero bytes, deflated: postcard reads the round and leaves the
/// rest, so only the bound on inflating refuses it.
fn inflating(zeros: usize) -> Vec<u8> {
    use crate::record::format::{write_frame, write_preamble};
    let mut raw = postcard::to_stdvec(&sample_round(1, false)).unwrap();
    raw.resize(raw.len() + zeros, 0);
    let mut data = Vec::new();
    write_preamble(&mut data).unwrap();
    write_frame(&mut data, Kind::Header, &Header::default()).unwrap();
    write_frame(&mut data, Kind::Round, &OldLayout(raw)).unwrap();
    data
}

/// A frame may inflate to 64 times the file read so far: a few kilobytes that inflate to
/// megabytes are refused as they inflate, before they are held (the memory is measured by
/// hand: a test cannot see it).
#[test]
fn a_frame_that_inflates_beyond_the_file_is_refused() {
    let fits = inflating(4 << 10);
    assert!(
        fits.len() * 64 > (4 << 10) + 1000,
        "{} bytes of file",
        fits.len()
    );
    assert_eq!(Recording::read(&fits[..]).unwrap().round_count, 1);
    let bomb = inflating(16 << 20);
    assert!(bomb.len() * 64 < 16 << 20, "{} bytes of file", bomb.len());
    let round_at = frames(&bomb)[1].0;
    let (offset, reason) = corrupt_at(&bomb);
    assert_eq!(offset, round_at as u64);
    assert!(reason.contains("inflates beyond the limit"), "{reason}");
}

/// One flipped bit in a middle frame's length claims more than the file holds; but the file
/// holds that frame whole, and more frames after it: the length is wrong, the file not cut.
#[test]
fn a_length_past_the_end_of_a_whole_frame_is_corruption() {
    let data = recording("length", 5);
    let all = frames(&data);
    let rounds: Vec<_> = all.iter().filter(|f| f.1 == Kind::Round).collect();
    let at = rounds[2].0;
    let mut bad = data.clone();
    // Bit 20 of the length: a megabyte more than the file.
    bad[at + 3] ^= 0x10;
    let (offset, reason) = corrupt_at(&bad);
    assert_eq!(offset, at as u64);
    assert!(reason.contains("runs past the end"), "{reason}");
    // Any bit of any frame's length: its checksum no longer matches, or the length runs past
    // the end of a whole frame, or over the limit.
    for (at, _, _) in &all {
        for bit in 0..32 {
            let mut bad = data.clone();
            bad[at + 1 + bit / 8] ^= 1 << (bit % 8);
            let (offset, reason) = corrupt_at(&bad);
            assert_eq!(
                offset, *at as u64,
                "bit {bit} of the length at {at}: {reason}"
            );
        }
    }
}

/// A file that ends inside its last frame (the writer killed mid-write) reads as cut short,
/// with every round before it.
#[test]
fn a_file_cut_inside_its_last_frame_reads_the_rounds_before() {
    let data = recording("cut", 5);
    let all = frames(&data);
    let &(at, _, len) = all.iter().rfind(|f| f.1 == Kind::Round).unwrap();
    for cut in at + 1..at + len {
        let rec = Recording::read(&data[..cut]).unwrap();
        assert!(rec.truncated, "cut at {cut}");
        assert_eq!(rec.round_count, 4, "cut at {cut}");
    }
}

/// The reader's deterministic fuzz: every single-bit flip of a small recording is refused
/// (but in the preamble's reserved bytes, which change nothing), and every cut reads up to
/// its last whole frame. None panics, and none reads more rounds than were written.
#[test]
fn every_bit_flip_is_refused_and_every_cut_reads_short() {
    let data = recording("fuzz", 3);
    let whole = Recording::read(&data[..]).unwrap();
    assert_eq!(whole.round_count, 3);
    for bit in 0..data.len() * 8 {
        let mut bad = data.clone();
        bad[bit / 8] ^= 1 << (bit % 8);
        if let Ok(rec) = Recording::read(&bad[..]) {
            // The version turned into an earlier one, whose rounds end some fields earlier:
            // read with the padding after the whole round, they are the same rounds (checked
            // below), as the fields added since are zeros and empty lists here.
            let flipped = u16::from_le_bytes([bad[8], bad[9]]);
            let as_earlier = bit / 8 == 8 && flipped < crate::record::format::VERSION;
            assert!(
                (10..12).contains(&(bit / 8)) || as_earlier,
                "bit {bit} flipped, read"
            );
            assert_eq!(rec.rounds, whole.rounds);
        }
    }
    let header_end = frames(&data)[1].0;
    let mut last = 0;
    for cut in 0..data.len() {
        match Recording::read(&data[..cut]) {
            Ok(rec) => {
                assert!((last..=3).contains(&rec.round_count), "cut at {cut}");
                assert!(rec.end.is_none());
                last = rec.round_count;
            }
            Err(e) => assert!(cut < header_end, "cut at {cut}: {e}"),
        }
    }
    assert_eq!(last, 3);
}
