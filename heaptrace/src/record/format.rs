//! The trace file: a magic, a format version, then framed records.
//!
//! ```text
//! file   := MAGIC(8) VERSION(u16 LE) RESERVED(u16) frame*
//! frame  := KIND(u8) LEN(u32 LE) CRC32(u32 LE, of KIND and PAYLOAD) PAYLOAD(LEN)
//! ```
//! Payloads are postcard-encoded; round payloads are deflated (their counters are mostly zero).
//! A reader accepts only versions it knows and stops at a frame the file ends inside, so a file
//! cut short (kill -9, full disk) reads up to its last complete frame; a length that cannot be
//! right is corruption, not a cut (see [`FrameReader::next_frame`]).
use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize, de::DeserializeOwned};

use heaptrace_common::Func;

use crate::run_info::{Collector, Mode, RunInfo, TargetKind, Temporary};

pub const MAGIC: [u8; 8] = *b"HEAPTRC\0";
/// What each version added:
/// - 14: rounds end with each process's pymalloc arena bytes (`Reserved::pymalloc`), and
///   their reservations may be of kind `Pymalloc`; earlier rounds read with none.
/// - 13: rounds end with what the processes' peaks were made of (`PeakHeld`: blocks, and
///   sites in stacks mode), where it changed; earlier rounds read with none.
/// - 12: the header's `temporary_counts_frees` (a free in between makes a block not temporary,
///   heaptrack's rule), version 7 to 11 headers read with false (allocations only); rounds
///   end with the losses added since 10, a list (`Loss::UnwindLate` on), earlier rounds read
///   with none.
/// - 8: the header's `comm` and `cgroup` (`--all --comm`/`--cgroup`: the processes the trace
///   was narrowed to); version 3 to 7 headers read with neither (every process).
/// - 7: the header's `temporary_allocs` (`--temporary-allocs`: temporaries by the freeing
///   thread's allocations in between, no longer by time); version 3 to 6 headers read with 0
///   (their `temporary_ms` rule).
/// - 9: rounds end with the processes' peaks the kernel took (`KernelPeak`); earlier rounds
///   read with none.
/// - 6: the header's `latency_every` (`--latency-every`); version 3 to 5 headers read with 0
///   (every call timed).
/// - 5: rounds end with the processes that ended and those folded into one (`profile::exited`); version
///   4 and earlier rounds read with none.
/// - 4: rounds end with the processes that exec'ed (their earlier figures dropped, as live);
///   version 2 and 3 rounds read with none.
/// - 3: the header's `sample_bytes` (`--sample-bytes`); version 2 files still read (their
///   header without it, as unsampled).
/// - 2: rounds carry the allocators' reservations (the memory behind malloc) and one more loss
///   counter. Version 1 files (written before any release) are not read.
pub const VERSION: u16 = 14;
/// The oldest version this reader reads.
pub const OLDEST: u16 = 2;
/// No frame is larger: a hostile length cannot make the reader allocate more.
pub const MAX_FRAME: u32 = 64 << 20;
/// Nor may a deflated payload inflate beyond this.
pub const MAX_INFLATED: u64 = 256 << 20;
/// And the deflated payloads together inflate to at most this many times the bytes of the file
/// read so far, so that what a made-up file has the reader hold grows with its size. Written
/// frames inflate some 15 to 30 times at most (thousands of sites, their histograms mostly
/// empty), whole files a few times.
pub const INFLATE_RATIO: u64 = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Header = 1,
    String = 2,
    Module = 3,
    Stack = 4,
    Round = 5,
    Leaks = 6,
    End = 7,
}

impl Kind {
    pub fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Header,
            2 => Kind::String,
            3 => Kind::Module,
            4 => Kind::Stack,
            5 => Kind::Round,
            6 => Kind::Leaks,
            7 => Kind::End,
            _ => return None,
        })
    }

    fn deflated(self) -> bool {
        matches!(self, Kind::Round | Kind::Stack | Kind::Leaks)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("not a heaptrace recording (bad magic)")]
    BadMagic,
    #[error("recording format version {0} is newer than this heaptrace understands ({VERSION})")]
    FutureVersion(u16),
    #[error(
        "recording format version {0} is older than this heaptrace reads ({OLDEST} to {VERSION})"
    )]
    OldVersion(u16),
    #[error("empty file")]
    Empty,
    #[error("corrupt recording at byte {offset}: {reason}")]
    Corrupt { offset: u64, reason: String },
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// What the recording says about the run, written first.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub heaptrace_version: String,
    pub host: String,
    pub kernel: String,
    pub start_unix_ms: u64,
    pub interval_ms: u64,
    #[serde(with = "by_name")]
    pub mode: Mode,
    #[serde(with = "by_name")]
    pub target_mode: TargetKind,
    pub pids: Vec<u32>,
    pub command: Vec<String>,
    pub provider: String,
    pub temporary_ms: u64,
    /// Command lines of the traced processes known at the start, by pid.
    pub cmdlines: Vec<(u32, String)>,
    /// Family members probed as another at the same address: (alias, probed as), by name.
    pub aliases: Vec<(String, String)>,
    /// `--sample-bytes` (format 3): 0 when every allocation was sampled.
    pub sample_bytes: u64,
    /// `--latency-every` (format 6): one call in this many was timed; 0 (earlier formats) or
    /// 1 when every call was.
    pub latency_every: u32,
    /// `--temporary-allocs` (format 7): a block freed by its own thread with fewer than this
    /// many of its allocations in between is temporary; 0 (earlier formats): one freed within
    /// `temporary_ms` of its allocation was.
    pub temporary_allocs: u32,
    /// `--comm` (format 8): a system-wide trace kept only processes whose name contains this.
    pub comm: Option<String>,
    /// `--cgroup` (format 8): ... and whose cgroup path contains this.
    pub cgroup: Option<String>,
    /// What collected the figures (format 11), by name: empty (earlier formats) is the
    /// kernel's probes.
    pub collector: String,
    /// Whether `temporary_allocs` counts the thread's frees in between too (format 12).
    pub temporary_counts_frees: bool,
}

impl Header {
    /// Family members probed as another at the same address: (alias, probed as).
    pub fn aliases(&self) -> Vec<(Func, Func)> {
        let by_name = |name: &str| Func::ALL.into_iter().find(|f| f.name() == name);
        self.aliases
            .iter()
            .filter_map(|(a, of)| Some((by_name(a)?, by_name(of)?)))
            .collect()
    }

    /// The run as the recording describes it.
    pub fn run_info(&self) -> RunInfo {
        RunInfo {
            mode: self.mode,
            target: self.target_mode,
            pids: self.pids.clone(),
            command: self.command.clone(),
            comm: self.comm.clone(),
            cgroup: self.cgroup.clone(),
            interval_ms: self.interval_ms,
            provider: self.provider.clone(),
            aliases: self.aliases(),
            temporary: self.temporary(),
            sample_bytes: self.sample_bytes,
            latency_every: self.latency_every,
            collector: Collector::from_name(&self.collector).unwrap_or_default(),
        }
    }

    /// The header of a recording of `run`, started now on this host.
    pub fn new(run: &RunInfo, cmdlines: Vec<(u32, String)>) -> Header {
        let first_line = |path: &str| {
            std::fs::read_to_string(path)
                .map(|s| s.trim().to_string())
                .unwrap_or_default()
        };
        Header {
            heaptrace_version: env!("CARGO_PKG_VERSION").into(),
            host: first_line("/proc/sys/kernel/hostname"),
            kernel: first_line("/proc/sys/kernel/osrelease"),
            start_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            interval_ms: run.interval_ms,
            mode: run.mode,
            target_mode: run.target,
            pids: run.pids.clone(),
            command: run.command.clone(),
            provider: run.provider.clone(),
            temporary_ms: match run.temporary {
                Temporary::WithinMs(ms) => ms,
                Temporary::Allocs(_) | Temporary::Events(_) => 0,
            },
            cmdlines,
            aliases: run
                .aliases
                .iter()
                .map(|(a, of)| (a.name().to_string(), of.name().to_string()))
                .collect(),
            sample_bytes: run.sample_bytes,
            latency_every: run.latency_every,
            temporary_allocs: match run.temporary {
                Temporary::Allocs(n) | Temporary::Events(n) => n,
                Temporary::WithinMs(_) => 0,
            },
            comm: run.comm.clone(),
            cgroup: run.cgroup.clone(),
            collector: run.collector.name().into(),
            temporary_counts_frees: matches!(run.temporary, Temporary::Events(_)),
        }
    }

    /// The rule this recording's temporaries were counted by: formats before 7 counted a
    /// block freed within a time of its allocation.
    pub fn temporary(&self) -> Temporary {
        match self.temporary_allocs {
            0 => Temporary::WithinMs(self.temporary_ms),
            n if self.temporary_counts_frees => Temporary::Events(n),
            n => Temporary::Allocs(n),
        }
    }
}

/// The mode and the target kind are written by name, as every format has written them
/// (postcard would write an enum's index); a name this build does not know is corruption.
mod by_name {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    use crate::run_info::{Mode, TargetKind};

    pub trait Named: Sized + Copy {
        fn name(self) -> &'static str;
        fn from_name(name: &str) -> Option<Self>;
    }

    impl Named for Mode {
        fn name(self) -> &'static str {
            Mode::name(self)
        }
        fn from_name(name: &str) -> Option<Self> {
            Mode::from_name(name)
        }
    }

    impl Named for TargetKind {
        fn name(self) -> &'static str {
            TargetKind::name(self)
        }
        fn from_name(name: &str) -> Option<Self> {
            TargetKind::from_name(name)
        }
    }

    pub fn serialize<T: Named, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(v.name())
    }

    pub fn deserialize<'de, T: Named, D: Deserializer<'de>>(d: D) -> Result<T, D::Error> {
        let name = String::deserialize(d)?;
        T::from_name(&name).ok_or_else(|| D::Error::custom(format!("unknown name {name:?}")))
    }
}

/// A module (executable or library) that frames point into.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleRec {
    pub id: u32,
    pub path: String,
    pub build_id: Option<Vec<u8>>,
}

/// A frame with its strings replaced by string-table ids.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FrameRec {
    pub function: u32,
    pub file: Option<u32>,
    pub line: Option<u32>,
    /// Module id, or None for an address outside every known mapping.
    pub module: Option<u32>,
    pub offset: u64,
    pub inlined: bool,
}

/// A stack of one process, written once when first seen.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StackRec {
    pub pid: u32,
    pub stack_id: i32,
    pub ips: Vec<u64>,
    /// Per ip: (module id, file offset), what `report --resymbolize` needs.
    pub locations: Vec<Option<(u32, u64)>>,
    pub frames: Vec<FrameRec>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndRec {
    pub elapsed_ms: u64,
    pub exit_code: Option<i32>,
    pub reason: String,
}

pub fn write_preamble(w: &mut impl Write) -> io::Result<()> {
    write_preamble_version(w, VERSION)
}

/// The preamble of a given version (tests write older versions' files with it).
pub fn write_preamble_version(w: &mut impl Write, version: u16) -> io::Result<()> {
    w.write_all(&MAGIC)?;
    w.write_all(&version.to_le_bytes())?;
    w.write_all(&[0, 0])
}

/// Checks the preamble; returns the file's format version.
pub fn read_preamble(r: &mut impl Read) -> Result<u16, FormatError> {
    let mut buf = [0u8; 12];
    let got = read_full(r, &mut buf)?;
    if got == 0 {
        return Err(FormatError::Empty);
    }
    if got < 8 || buf[..8] != MAGIC {
        return Err(FormatError::BadMagic);
    }
    if got < 12 {
        return Err(FormatError::Corrupt {
            offset: got as u64,
            reason: "truncated in the file header".into(),
        });
    }
    let version = u16::from_le_bytes([buf[8], buf[9]]);
    if version > VERSION {
        return Err(FormatError::FutureVersion(version));
    }
    if version == 0 {
        return Err(FormatError::Corrupt {
            offset: 8,
            reason: "format version 0".into(),
        });
    }
    if version < OLDEST {
        return Err(FormatError::OldVersion(version));
    }
    Ok(version)
}

fn checksum(kind: u8, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&[kind]);
    h.update(payload);
    h.finalize()
}

pub fn write_frame<T: Serialize>(w: &mut impl Write, kind: Kind, value: &T) -> io::Result<()> {
    let raw = postcard::to_stdvec(value).map_err(io::Error::other)?;
    let payload = if kind.deflated() {
        let mut z = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::fast());
        z.write_all(&raw)?;
        z.finish()?
    } else {
        raw
    };
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|l| *l <= MAX_FRAME)
        .ok_or_else(|| io::Error::other("record frame too large"))?;
    let mut head = [0u8; 9];
    head[0] = kind as u8;
    head[1..5].copy_from_slice(&len.to_le_bytes());
    head[5..9].copy_from_slice(&checksum(kind as u8, &payload).to_le_bytes());
    w.write_all(&head)?;
    w.write_all(&payload)
}

/// One frame as read: its kind and its (inflated) payload.
pub struct RawFrame {
    pub kind: Kind,
    pub offset: u64,
    /// The payload's length in the file (before inflating).
    pub stored_len: u64,
    pub payload: Vec<u8>,
}

/// The outcome of reading one frame.
pub enum Next {
    Frame(RawFrame),
    /// Clean end of file.
    End,
    /// The file ends inside a frame: written up to a crash or a full disk.
    Truncated,
}

/// The frames of a file, read one after another from `offset` on.
pub struct FrameReader<R> {
    r: R,
    offset: u64,
    /// What the deflated frames read so far inflated to.
    inflated: u64,
}

impl<R: Read> FrameReader<R> {
    /// Frames read from `r`, whose first byte is the file's byte `offset`.
    pub fn new(r: R, offset: u64) -> FrameReader<R> {
        FrameReader {
            r,
            offset,
            inflated: 0,
        }
    }

    /// The next frame. The file may end inside a frame only as a cut leaves it: a head cut
    /// short, or a payload of which the file holds a part. When the file holds the whole
    /// payload and more, but the length claims still more (a flipped bit), the length is
    /// wrong: a prefix of what follows the head matches the checksum.
    pub fn next_frame(&mut self) -> Result<Next, FormatError> {
        let offset = self.offset;
        let mut head = [0u8; 9];
        let got = read_full(&mut self.r, &mut head)?;
        if got == 0 {
            return Ok(Next::End);
        }
        if got < head.len() {
            return Ok(Next::Truncated);
        }
        let corrupt = |reason: String| FormatError::Corrupt { offset, reason };
        let kind = Kind::from_u8(head[0])
            .ok_or_else(|| corrupt(format!("unknown record kind {}", head[0])))?;
        let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]);
        if len > MAX_FRAME {
            return Err(corrupt(format!("record length {len} exceeds {MAX_FRAME}")));
        }
        let crc = u32::from_le_bytes([head[5], head[6], head[7], head[8]]);
        // Grows with what the file holds, not with what the length claims.
        let mut payload = Vec::new();
        (&mut self.r)
            .take(u64::from(len))
            .read_to_end(&mut payload)?;
        if payload.len() < len as usize {
            return match whole_payload(head[0], crc, &payload) {
                Some(end) => Err(corrupt(format!(
                    "record length {len} runs past the end of the file, but its payload \
                     ends after {end} bytes"
                ))),
                None => Ok(Next::Truncated),
            };
        }
        if checksum(head[0], &payload) != crc {
            return Err(corrupt("checksum mismatch".into()));
        }
        self.offset += FRAME_HEAD + u64::from(len);
        if kind.deflated() {
            payload = self.inflate(&payload).map_err(corrupt)?;
        }
        Ok(Next::Frame(RawFrame {
            kind,
            offset,
            stored_len: u64::from(len),
            payload,
        }))
    }

    /// A deflated payload inflated, within what the file read so far allows: refused once it
    /// inflates beyond, before it is held whole.
    fn inflate(&mut self, stored: &[u8]) -> Result<Vec<u8>, String> {
        let allowed = (INFLATE_RATIO.saturating_mul(self.offset))
            .saturating_sub(self.inflated)
            .min(MAX_INFLATED);
        let mut out = Vec::new();
        flate2::read::DeflateDecoder::new(stored)
            .take(allowed + 1)
            .read_to_end(&mut out)
            .map_err(|e| format!("bad compressed data: {e}"))?;
        if out.len() as u64 > allowed {
            return Err(format!(
                "record inflates beyond the limit ({allowed} bytes: {INFLATE_RATIO} times \
                 the file so far, at most {MAX_INFLATED})"
            ));
        }
        self.inflated += out.len() as u64;
        Ok(out)
    }
}

/// Reads until `buf` is full or the file ends; returns how much was read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..])? {
            0 => break,
            n => got += n,
        }
    }
    Ok(got)
}

/// Where the payload of a frame ends in `rest`, the bytes after its head up to the end of the
/// file, when its checksum says it is whole: a prefix matching it, followed by the end of the
/// file or by a byte that starts a record. None when `rest` is a cut part of it.
fn whole_payload(kind: u8, crc: u32, rest: &[u8]) -> Option<usize> {
    let mut h = crc32fast::Hasher::new();
    h.update(&[kind]);
    for end in 0..=rest.len() {
        let next_starts = rest.get(end).is_none_or(|b| Kind::from_u8(*b).is_some());
        if next_starts && h.clone().finalize() == crc {
            return Some(end);
        }
        if let Some(b) = rest.get(end) {
            h.update(std::slice::from_ref(b));
        }
    }
    None
}

/// A round of a file of `version`. Rounds of earlier versions end before the fields added
/// since (`restarted` in 4, `ended` and `folded` in 5, `peaks` in 9, the unwinding losses in
/// 10): postcard writes no field names, and an empty list or a zero is one zero byte.
pub fn decode_round(
    frame: &RawFrame,
    version: u16,
) -> Result<crate::drain::round::Round, FormatError> {
    // The pymalloc arenas added in 14, the peaks' compositions added in 13 (an empty map), the losses added in 12 (an empty
    // list), in 10 (3 varints), the peaks added in 9 (an empty map), the lists added in 5
    // and 4.
    let later_losses = crate::drain::round::LATER_LOSSES;
    let missing = match version {
        14.. => 0,
        13 => 1,
        12 => 2,
        10 | 11 => 3,
        9 => later_losses + 3,
        5..=8 => later_losses + 4,
        4 => later_losses + 6,
        _ => later_losses + 7,
    };
    decode_padded(frame, missing)
}

/// The header of a file of `version`. Those of 2 end before `sample_bytes`, 3 to 5 before
/// `latency_every`, 6 before `temporary_allocs`, 7 before `comm`, 8 to 10 before `collector`:
/// a zero byte is a varint 0, an empty string or None.
pub fn decode_header(frame: &RawFrame, version: u16) -> Result<Header, FormatError> {
    // Fields are only ever added at the end; a missing one decodes from a zero byte.
    let missing = match version {
        12.. => 0,
        11 => 1,
        8..=10 => 2,
        7 => 4,
        6 => 5,
        3..=5 => 6,
        _ => 7,
    };
    decode_padded(frame, missing)
}

/// A payload written before its last fields were added: each missing field is one zero byte
/// (an empty list, a varint 0).
fn decode_padded<T: DeserializeOwned>(frame: &RawFrame, missing: usize) -> Result<T, FormatError> {
    if missing == 0 {
        return decode(frame);
    }
    let mut payload = frame.payload.clone();
    payload.extend(std::iter::repeat_n(0, missing));
    decode(&RawFrame {
        kind: frame.kind,
        offset: frame.offset,
        stored_len: frame.stored_len,
        payload,
    })
}

pub fn decode<T: DeserializeOwned>(frame: &RawFrame) -> Result<T, FormatError> {
    postcard::from_bytes(&frame.payload).map_err(|e| FormatError::Corrupt {
        offset: frame.offset,
        reason: format!("undecodable {:?} record: {e}", frame.kind),
    })
}

/// Bytes a frame takes in the file (head + payload as stored).
pub const FRAME_HEAD: u64 = 9;

#[cfg(test)]
mod tests;
