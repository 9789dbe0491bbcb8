//! Writing a recording while tracing: each string, module and stack once, then the round.
use std::{
    collections::{BTreeMap, HashMap},
    fs::File,
    io::{self, BufWriter, Write},
    path::{Path, PathBuf},
};

use super::format::{
    EndRec, FrameRec, Header, Kind, ModuleRec, StackRec, write_frame, write_preamble,
};
use crate::{
    drain::round::Leak,
    drain::round::{Round, SiteId},
    output::NewFile,
    symbolize::Frame,
    symbolize::modules::Location,
};

pub struct Recorder {
    w: BufWriter<File>,
    strings: HashMap<String, u32>,
    modules: HashMap<PathBuf, u32>,
    bytes: u64,
}

/// The build id of the file at `path` on this host (a recording's module, when it is read
/// back): opened without blocking, regular files only.
pub fn build_id(path: &Path) -> Option<Vec<u8>> {
    let file = crate::targets::target_file::TargetFile::host(path).ok()?;
    crate::targets::elf::build_id(&file)
}

impl Recorder {
    /// Writes the preamble and the header under `out`'s temporary name, then moves it to its
    /// final name and goes on there: the final name never shows a file without a header, and
    /// a recording cut short (a full disk, a signal, even SIGKILL) is already where it was
    /// asked for, readable up to its last complete round.
    /// A recording at `path` for tests, replacing what is there.
    #[cfg(test)]
    pub fn create_at(path: &std::path::Path, header: &Header) -> io::Result<Recorder> {
        Recorder::create(NewFile::create(path, true)?, header)
    }

    pub fn create(out: NewFile, header: &Header) -> io::Result<Recorder> {
        let mut w = BufWriter::new(out.file());
        write_preamble(&mut w)?;
        write_frame(&mut w, Kind::Header, header)?;
        w.flush()?;
        drop(w);
        Ok(Recorder {
            w: BufWriter::new(out.persist()?),
            strings: HashMap::new(),
            modules: HashMap::new(),
            bytes: 0,
        })
    }

    fn frame<T: serde::Serialize>(&mut self, kind: Kind, v: &T) -> io::Result<()> {
        write_frame(&mut self.w, kind, v)
    }

    fn string(&mut self, s: &str) -> io::Result<u32> {
        if let Some(id) = self.strings.get(s) {
            return Ok(*id);
        }
        let id = self.strings.len() as u32;
        self.frame(Kind::String, &(id, s))?;
        self.strings.insert(s.to_string(), id);
        Ok(id)
    }

    fn module(&mut self, l: &Location) -> io::Result<u32> {
        let path = &*l.path;
        if let Some(id) = self.modules.get(path) {
            return Ok(*id);
        }
        let id = self.modules.len() as u32;
        let rec = ModuleRec {
            id,
            path: path.display().to_string(),
            // Of the file the process mapped, not of what its path leads to here.
            build_id: l.file.as_deref().and_then(crate::targets::elf::build_id),
        };
        self.frame(Kind::Module, &rec)?;
        self.modules.insert(path.to_path_buf(), id);
        Ok(id)
    }

    /// A frame's module that is no file (`[python]`), by its name alone: a report shows it as
    /// recorded. None for `[unknown]` and for file names no location had.
    fn named_module(&mut self, name: &str) -> io::Result<Option<u32>> {
        if !name.starts_with('[') || name == "[unknown]" {
            return Ok(None);
        }
        if let Some(id) = self.modules.get(Path::new(name)) {
            return Ok(Some(*id));
        }
        let id = self.modules.len() as u32;
        let rec = ModuleRec {
            id,
            path: name.to_string(),
            build_id: None,
        };
        self.frame(Kind::Module, &rec)?;
        self.modules.insert(PathBuf::from(name), id);
        Ok(Some(id))
    }

    fn stack(
        &mut self,
        pid: u32,
        stack_id: i32,
        ips: &[u64],
        locations: &[Option<Location>],
        frames: &[Frame],
    ) -> io::Result<()> {
        let mut locs = Vec::with_capacity(locations.len());
        for l in locations {
            locs.push(match l {
                Some(l) => Some((self.module(l)?, l.offset)),
                None => None,
            });
        }
        let mut recs = Vec::with_capacity(frames.len());
        for f in frames {
            let module = match locations.iter().flatten().find(|l| {
                l.path.file_name().map(|n| n.to_string_lossy()) == Some((*f.module).into())
            }) {
                Some(l) => Some(self.module(l)?),
                None => self.named_module(&f.module)?,
            };
            recs.push(FrameRec {
                function: self.string(&f.function)?,
                file: match &f.file {
                    Some(file) => Some(self.string(file)?),
                    None => None,
                },
                line: f.line,
                module,
                offset: f.offset,
                inlined: f.inlined,
            });
        }
        let rec = StackRec {
            pid,
            stack_id,
            ips: ips.to_vec(),
            locations: locs,
            frames: recs,
        };
        self.frame(Kind::Stack, &rec)
    }

    /// Writes a round and the stacks it saw first, then flushes: a recording cut short keeps
    /// every round written before.
    pub fn round(&mut self, round: &Round) -> io::Result<()> {
        for ((pid, id), s) in &round.stacks {
            self.stack(*pid, *id, &s.ips, &s.locations, &s.frames)?;
        }
        self.frame(Kind::Round, round)?;
        self.w.flush()
    }

    /// Writes the leaks and the end record; returns the file's size.
    pub fn finish(
        mut self,
        leaks: Option<&BTreeMap<SiteId, Leak>>,
        end: &EndRec,
    ) -> io::Result<u64> {
        if let Some(leaks) = leaks {
            let v: Vec<(SiteId, Leak)> = leaks.iter().map(|(k, l)| (*k, *l)).collect();
            self.frame(Kind::Leaks, &v)?;
        }
        self.frame(Kind::End, end)?;
        self.w.flush()?;
        let f = self.w.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        self.bytes = f.metadata()?.len();
        Ok(self.bytes)
    }
}
