//! Reading a recording back, validating every reference, into the Profile the views read.
use std::{
    collections::{BTreeMap, HashMap},
    fs::File,
    io::{BufReader, Read},
    path::Path,
};

use super::format::{
    EndRec, FormatError, FrameReader, FrameRec, Header, Kind, ModuleRec, Next, RawFrame, StackRec,
    decode, decode_header, decode_round, read_preamble,
};
use crate::{
    drain::round::Leak,
    drain::round::{Round, SiteId},
    profile::Profile,
    symbolize::Frame,
};

#[derive(Debug, Default)]
pub struct Recording {
    pub header: Header,
    /// Shared: every frame that names a string holds the one copy.
    pub strings: Vec<std::sync::Arc<str>>,
    pub modules: Vec<ModuleRec>,
    /// The file name of each module, as frames show it.
    module_names: Vec<std::sync::Arc<str>>,
    /// By (process, stack id): a process's stacks are a range (a fold takes them).
    pub stacks: BTreeMap<(u32, i32), StackRec>,
    /// The rounds, when read whole ([`Recording::read`]; [`Recording::read_with`] hands each
    /// one over and keeps none).
    pub rounds: Vec<Round>,
    /// How many rounds were read, and the last one's time.
    pub round_count: u64,
    pub last_elapsed_ms: Option<u64>,
    pub leaks: Option<Vec<(SiteId, Leak)>>,
    pub end: Option<EndRec>,
    /// The file ended inside a record (the writer was killed): everything before it was read.
    pub truncated: bool,
}

impl Recording {
    pub fn open(path: &Path) -> Result<Recording, FormatError> {
        Recording::read(BufReader::new(File::open(path)?))
    }

    pub fn read(r: impl Read) -> Result<Recording, FormatError> {
        Recording::read_rounds(r, true, |_, _| {})
    }

    /// Reads a recording, handing each round to `each` as it comes (with the recording read
    /// so far: every stack a round names comes before it) and keeping none: a long recording
    /// is replayed in the memory of one round.
    pub fn read_with(
        r: impl Read,
        each: impl FnMut(&Recording, &Round),
    ) -> Result<Recording, FormatError> {
        Recording::read_rounds(r, false, each)
    }

    fn read_rounds(
        mut r: impl Read,
        keep: bool,
        mut each: impl FnMut(&Recording, &Round),
    ) -> Result<Recording, FormatError> {
        let version = read_preamble(&mut r)?;
        let mut frames = FrameReader::new(r, 12);
        let mut rec = Recording::default();
        let mut first = true;
        loop {
            let frame = match frames.next_frame()? {
                Next::Frame(f) => f,
                Next::End => break,
                Next::Truncated => {
                    rec.truncated = true;
                    break;
                }
            };
            if let Some(round) = rec.take(&frame, version, first)? {
                each(&rec, &round);
                if keep {
                    rec.rounds.push(round);
                }
            }
            first = false;
        }
        if first {
            return Err(FormatError::Corrupt {
                offset: 12,
                reason: "no header record".into(),
            });
        }
        Ok(rec)
    }

    /// Takes one frame in, in the order the writer writes them: the header first; strings and
    /// modules numbered from 0 and stacks, each before what names it; rounds numbered from 1
    /// without a gap or a repeat (a round read twice would count twice); then the leaks, and
    /// the end last. A round is handed back.
    fn take(
        &mut self,
        frame: &RawFrame,
        version: u16,
        first: bool,
    ) -> Result<Option<Round>, FormatError> {
        let corrupt = |reason: String| FormatError::Corrupt {
            offset: frame.offset,
            reason,
        };
        if first != (frame.kind == Kind::Header) {
            let why = if first {
                "the first record is not the header"
            } else {
                "a second header"
            };
            return Err(corrupt(why.into()));
        }
        if self.end.is_some() {
            return Err(corrupt("a record after the end record".into()));
        }
        if self.leaks.is_some() && frame.kind != Kind::End {
            return Err(corrupt(format!(
                "a {:?} record after the leaks",
                frame.kind
            )));
        }
        match frame.kind {
            Kind::Header => self.header = decode_header(frame, version)?,
            Kind::String => {
                let (id, s): (u32, String) = decode(frame)?;
                if id as usize != self.strings.len() {
                    return Err(corrupt(format!("string id {id} out of sequence")));
                }
                self.strings.push(s.into());
            }
            Kind::Module => {
                let m: ModuleRec = decode(frame)?;
                if m.id as usize != self.modules.len() {
                    return Err(corrupt(format!("module id {} out of sequence", m.id)));
                }
                self.module_names.push(module_name(&m.path).into());
                self.modules.push(m);
            }
            Kind::Stack => {
                let s: StackRec = decode(frame)?;
                self.check_stack(&s).map_err(corrupt)?;
                self.stacks.insert((s.pid, s.stack_id), s);
            }
            Kind::Round => {
                let round = decode_round(frame, version)?;
                let due = self.round_count + 1;
                if round.index != due {
                    return Err(corrupt(format!(
                        "round {} where round {due} was due",
                        round.index
                    )));
                }
                self.round_count = due;
                self.last_elapsed_ms = Some(round.elapsed_ms);
                return Ok(Some(round));
            }
            Kind::Leaks => self.leaks = Some(decode(frame)?),
            Kind::End => self.end = Some(decode(frame)?),
        }
        Ok(None)
    }

    /// Every index a stack holds must point at a record already read.
    fn check_stack(&self, s: &StackRec) -> Result<(), String> {
        let module_ok = |m: u32| (m as usize) < self.modules.len();
        let string_ok = |id: u32| (id as usize) < self.strings.len();
        if s.locations.len() != s.ips.len() {
            return Err("stack locations do not match its addresses".into());
        }
        if s.locations.iter().flatten().any(|(m, _)| !module_ok(*m)) {
            return Err("stack refers to an unknown module".into());
        }
        for f in &s.frames {
            if !string_ok(f.function)
                || f.file.is_some_and(|x| !string_ok(x))
                || f.module.is_some_and(|m| !module_ok(m))
            {
                return Err("frame refers to an unknown string or module".into());
            }
        }
        Ok(())
    }

    /// The stacks for which `want` holds, with their frames. A frame is made once and shared
    /// by every stack that holds it, as in a live trace (see `symbolize`).
    pub fn stacks_frames(&self, want: impl Fn(&(u32, i32)) -> bool) -> crate::profile::Stacks {
        let mut made: HashMap<&FrameRec, Frame> = HashMap::new();
        self.stacks
            .iter()
            .filter(|(key, _)| want(key))
            .map(|(key, s)| {
                let frames = s
                    .frames
                    .iter()
                    .map(|f| made.entry(f).or_insert_with(|| self.frame(f)).clone())
                    .collect();
                (*key, frames)
            })
            .collect()
    }

    /// The stacks of process `key` read so far, with their frames.
    pub fn stacks_of(
        &self,
        key: u32,
    ) -> impl Iterator<Item = ((u32, i32), std::sync::Arc<[Frame]>)> + '_ {
        self.stacks
            .range((key, i32::MIN)..=(key, i32::MAX))
            .map(|(k, s)| (*k, s.frames.iter().map(|f| self.frame(f)).collect()))
    }

    fn frame(&self, f: &FrameRec) -> Frame {
        crate::symbolize::FrameInfo {
            function: self.strings[f.function as usize].clone(),
            file: f.file.map(|x| self.strings[x as usize].clone()),
            line: f.line,
            module: f
                .module
                .map(|m| self.module_names[m as usize].clone())
                .unwrap_or_else(|| "[unknown]".into()),
            offset: f.offset,
            inlined: f.inlined,
        }
        .into()
    }

    /// Replays the rounds through the same aggregation as a live trace.
    pub fn profile(&self) -> Profile {
        let mut replay = super::replay::Replay::new(self);
        for r in &self.rounds {
            replay.round(self, r, true);
        }
        let mut p = replay.finish(self, |_| true);
        if let Some(l) = &self.leaks {
            p.set_leaks(l.iter().copied().collect::<BTreeMap<_, _>>());
        }
        p
    }
}

fn module_name(path: &str) -> String {
    path.rsplit('/').next().unwrap_or(path).to_string()
}

#[cfg(test)]
mod tests;
