//! Turning stacks of return addresses into named frames with blazesym, outside the hot path:
//! new stacks only, in batches per module, cached per (module, file offset).
//!
//! A profile holds thousands of stacks of up to 32 frames, most of them the same few hundred
//! frames: a frame is a shared handle (one reference count to copy, a pointer to hold) and
//! the strings of distinct frames are interned here.
pub mod modules;
pub mod python;
use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

// Every frame of every new stack is looked up by its location: foldhash, not SipHash.
use blazesym::symbolize::{
    Input, Symbolized, Symbolizer as Blaze,
    source::{Elf, Source},
};
use foldhash::{HashMap, HashMapExt as _, HashSet, HashSetExt as _};
use serde::Serialize;

use crate::{
    symbolize::modules::{Location, Modules},
    targets::target_file::{FileId, TargetFile},
};

/// One frame of a symbolized stack, innermost first: a shared handle to its [`FrameInfo`], read
/// through `Deref`. A profile's stacks repeat the same frames many times over; each repeat costs
/// a pointer.
#[derive(Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct Frame(Arc<FrameInfo>);

impl std::ops::Deref for Frame {
    type Target = FrameInfo;

    fn deref(&self) -> &FrameInfo {
        &self.0
    }
}

impl From<FrameInfo> for Frame {
    fn from(f: FrameInfo) -> Frame {
        Frame(Arc::new(f))
    }
}

impl std::fmt::Debug for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// What a frame says. Never blank: a frame that cannot be named shows its module and offset.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct FrameInfo {
    pub function: Arc<str>,
    pub file: Option<Arc<str>>,
    pub line: Option<u32>,
    pub module: Arc<str>,
    pub offset: u64,
    /// A function inlined into the next frame (same address).
    pub inlined: bool,
}

/// The text of [`Frame::folded_other`].
const FOLDED_OTHER_FUNCTION: &str = "[other stacks of exited processes]";

/// Frames for tests: `FrameInfo::named("f")` is `f` in module "m" at offset 0, then each
/// builder sets one more field.
#[cfg(test)]
impl FrameInfo {
    pub fn named(function: &str) -> FrameInfo {
        FrameInfo {
            function: function.into(),
            file: None,
            line: None,
            module: "m".into(),
            offset: 0,
            inlined: false,
        }
    }

    pub fn at(self, file: &str, line: u32) -> FrameInfo {
        FrameInfo {
            file: Some(file.into()),
            line: Some(line),
            ..self
        }
    }

    pub fn in_module(self, module: &str, offset: u64) -> FrameInfo {
        FrameInfo {
            module: module.into(),
            offset,
            ..self
        }
    }

    pub fn inlined(self, inlined: bool) -> FrameInfo {
        FrameInfo { inlined, ..self }
    }
}

impl Frame {
    /// A frame standing for blocks allocated while stacks were not collected.
    pub fn not_collected() -> Frame {
        Frame::placeholder("[no stack: not collected in this mode]", "[none]", 0)
    }

    fn unknown(addr: u64) -> Frame {
        Frame::placeholder(&format!("[unknown] {addr:#x}"), "[unknown]", addr)
    }

    /// A frame standing for blocks live before heaptrace attached: no stack, no function.
    pub fn before_attach() -> Frame {
        Frame::placeholder("[allocated before attach]", "[none]", 0)
    }

    /// A frame standing for an allocation left out by byte sampling.
    pub fn not_sampled() -> Frame {
        Frame::placeholder("[no stack: not sampled]", "[none]", 0)
    }

    /// The last frame of a stack whose frames past the caller were lost (the stack maps were
    /// full, or both buckets taken): it stands for [`MORE_FRAMES_LOST`].
    pub fn more_lost() -> Frame {
        Frame::placeholder(MORE_LOST_FUNCTION, "[lost]", 0)
    }

    /// Whether this is [`Frame::more_lost`]: the stack it ends is its caller alone. By its
    /// text only: a recording keeps no module for a frame that is not code.
    pub fn is_more_lost(&self) -> bool {
        // Recordings made before the text named the flag hold the shorter one.
        [
            MORE_LOST_FUNCTION,
            "[more frames lost: no room in the stack maps]",
        ]
        .contains(&&*self.function)
    }

    /// The last frame of a stack the kernel cut at a file whose unwind rows found no room:
    /// it stands for [`heaptrace_common::NO_ROOM_FRAME`].
    pub fn no_room() -> Frame {
        Frame::placeholder(NO_ROOM_FUNCTION, "[lost]", 0)
    }

    /// Whether this is [`Frame::no_room`].
    pub fn is_no_room(&self) -> bool {
        &*self.function == NO_ROOM_FUNCTION
    }

    /// A frame standing for an allocation whose stack was lost, and its caller with it (the
    /// kernel's errno for the whole stack says why, `stacks::store`): named by its cause.
    pub fn lost(errno: i32) -> Frame {
        let why = match errno.unsigned_abs() as i32 {
            // STACK_OWNERS or FRAMES full, or both of its ids held by other stacks.
            libc::E2BIG | libc::ENOMEM | libc::EEXIST => {
                "no room in the stack maps, even for its caller; raise --stack-map-size".into()
            }
            libc::EBUSY => "its walk was cut by another on its CPU, no room for its caller".into(),
            n => format!("errno {n}"),
        };
        Frame::placeholder(&format!("[stack lost: {why}]"), "[lost]", 0)
    }

    /// A site first seen just after its stack id was freed, when another stack has taken the
    /// id since: it was counted under one of the two, which is not known.
    pub fn taken() -> Frame {
        Frame::placeholder("[stack lost: its id was freed and taken]", "[lost]", 0)
    }

    /// The folded stack of the ended processes' stacks past the folded ones' bound, or never
    /// named (`profile::exited`).
    pub fn folded_other() -> Frame {
        Frame::placeholder(FOLDED_OTHER_FUNCTION, "[folded]", 0)
    }

    /// Whether this is [`Frame::folded_other`] (by its text, as recordings keep it).
    pub fn is_folded_other(&self) -> bool {
        &*self.function == FOLDED_OTHER_FUNCTION
    }

    fn placeholder(function: &str, module: &str, offset: u64) -> Frame {
        FrameInfo {
            function: function.into(),
            file: None,
            line: None,
            module: module.into(),
            offset,
            inlined: false,
        }
        .into()
    }
}

const MORE_LOST_FUNCTION: &str =
    "[more frames lost: no room in the stack maps; raise --stack-map-size]";

const NO_ROOM_FUNCTION: &str =
    "[more frames lost: no room for this file's unwind rows; raise --unwind-table-size]";

/// Not an address: the end of a stack whose frames past the caller were lost. Kept among a
/// stack's return addresses (and in recordings) so that it symbolizes as [`Frame::more_lost`].
pub const MORE_FRAMES_LOST: u64 = u64::MAX;

/// Files blazesym may keep parsed (symbol tables, DWARF) at once, with their private copies.
/// Under `--all` every program the host runs brings its own, and on a host that builds
/// software each build brings new ones: past the bound the symbolizer starts over.
const MAX_FILES: usize = 64;
/// Named locations cached, as many files' code: the same bound for them.
const MAX_LOCATIONS: usize = 1 << 18;

pub struct Symbolizer {
    blaze: Blaze,
    cache: HashMap<Location, Vec<Frame>>,
    strings: HashSet<Arc<str>>,
    /// What blazesym maps of each file (`TargetFile::mappable`): a path, and the private
    /// copy it names, held as long as blazesym may map it. None: it could not be read.
    sources: HashMap<FileId, Option<(PathBuf, Option<std::fs::File>)>>,
}

impl Default for Symbolizer {
    fn default() -> Self {
        Symbolizer {
            blaze: Blaze::builder()
                .enable_code_info(true)
                .enable_inlined_fns(true)
                .enable_demangling(true)
                .build(),
            cache: HashMap::new(),
            strings: HashSet::new(),
            sources: HashMap::new(),
        }
    }
}

fn module_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

/// The one shared copy of `s`.
fn intern(strings: &mut HashSet<Arc<str>>, s: &str) -> Arc<str> {
    if let Some(a) = strings.get(s) {
        return a.clone();
    }
    let a: Arc<str> = s.into();
    strings.insert(a.clone());
    a
}

impl Symbolizer {
    /// Where each return address is: (module, file offset) of the call instruction itself
    /// (a return address points just after the call).
    pub fn locations(modules: &Modules, pid: u32, ips: &[u64]) -> Vec<Option<Location>> {
        ips.iter()
            .map(|ip| modules.resolve(pid, ip.saturating_sub(1)))
            .collect()
    }

    /// Symbolizes a stack of return addresses of process `pid`, innermost first.
    pub fn stack(&mut self, modules: &Modules, pid: u32, ips: &[u64]) -> Vec<Frame> {
        let locs = Self::locations(modules, pid, ips);
        self.frames(ips, &locs)
    }

    /// Symbolizes resolved locations (live, or read back from a recording).
    pub fn frames(&mut self, ips: &[u64], locs: &[Option<Location>]) -> Vec<Frame> {
        self.fill(locs.iter().flatten());
        let mut out = Vec::with_capacity(ips.len());
        for (ip, loc) in ips.iter().zip(locs) {
            match loc.as_ref().and_then(|l| self.cache.get(l)) {
                Some(frames) => out.extend(frames.iter().cloned()),
                None if *ip == MORE_FRAMES_LOST => out.push(Frame::more_lost()),
                None if *ip == heaptrace_common::NO_ROOM_FRAME => out.push(Frame::no_room()),
                None => out.push(Frame::unknown(*ip)),
            }
        }
        out
    }

    /// Starts over when past [`MAX_FILES`] or [`MAX_LOCATIONS`]: the frames named so far
    /// are the Profile's and stay; a file still in use is parsed again when next needed.
    /// True if it did.
    pub fn trim(&mut self) -> bool {
        self.trim_at(MAX_FILES, MAX_LOCATIONS)
    }

    fn trim_at(&mut self, files: usize, locations: usize) -> bool {
        if self.sources.len() <= files && self.cache.len() <= locations {
            return false;
        }
        // blazesym's own cache goes too: it is keyed by path, and a private copy's path
        // (/proc/self/fd/N) names another file once its descriptor is closed and reused.
        *self = Symbolizer::default();
        true
    }

    /// The path blazesym reads `file` through: never its path in the process, which may lead
    /// elsewhere by now (or nowhere, or to a FIFO).
    fn source(&mut self, file: &TargetFile) -> Option<PathBuf> {
        let entry = self.sources.entry(file.id()).or_insert_with(|| {
            file.mappable()
                .inspect_err(|e| log::debug!("{} not named: {e}", file.shown().display()))
                .ok()
        });
        entry.as_ref().map(|(path, _)| path.clone())
    }

    /// Symbolizes the locations not cached yet, one blazesym call per module.
    fn fill<'a>(&mut self, locs: impl Iterator<Item = &'a Location>) {
        type Module = (Arc<Path>, Option<Arc<TargetFile>>);
        let mut by_module: HashMap<Module, Vec<u64>> = HashMap::new();
        for l in locs {
            if !self.cache.contains_key(l) {
                let key = (l.path.clone(), l.file.clone());
                by_module.entry(key).or_default().push(l.offset);
            }
        }
        for ((path, file), mut offsets) in by_module {
            offsets.sort_unstable();
            offsets.dedup();
            let module = intern(&mut self.strings, &module_name(&path));
            // A file not opened is not named: its frames show module and offset.
            let results = match file.as_deref().and_then(|f| self.source(f)) {
                Some(src) => self
                    .blaze
                    .symbolize(&Source::Elf(Elf::new(src)), Input::FileOffset(&offsets))
                    .unwrap_or_default(),
                None => Vec::new(),
            };
            for (i, off) in offsets.iter().enumerate() {
                let strings = &mut self.strings;
                let mut frame =
                    |name: &str, code: Option<&blazesym::symbolize::CodeInfo>, inlined| {
                        FrameInfo {
                            function: intern(strings, name),
                            file: code.map(|c| intern(strings, &c.file.to_string_lossy())),
                            line: code.and_then(|c| c.line),
                            module: module.clone(),
                            offset: *off,
                            inlined,
                        }
                        .into()
                    };
                let frames = match results.get(i) {
                    Some(Symbolized::Sym(sym)) => {
                        let mut frames: Vec<Frame> = sym
                            .inlined
                            .iter()
                            .rev()
                            .map(|f| frame(&f.name, f.code_info.as_ref(), true))
                            .collect();
                        frames.push(frame(&sym.name, sym.code_info.as_deref(), false));
                        frames
                    }
                    _ => vec![frame(&format!("{module}+{off:#x}"), None, false)],
                };
                self.cache.insert(
                    Location {
                        path: path.clone(),
                        offset: *off,
                        file: file.clone(),
                    },
                    frames,
                );
            }
        }
    }
}

/// A stack of frames with these function names (module `m`), for tests.
#[cfg(test)]
pub fn test_frames(names: &[&str]) -> std::sync::Arc<[Frame]> {
    names
        .iter()
        .map(|n| {
            Frame::from(FrameInfo {
                function: (*n).into(),
                file: None,
                line: None,
                module: "m".into(),
                offset: 0,
                inlined: false,
            })
        })
        .collect::<Vec<_>>()
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_named_alike_hash_apart_and_equal_ones_alike() {
        use std::hash::BuildHasher;
        let h = foldhash::fast::FixedState::with_seed(1);
        // Same offset and lengths: a hash of the numbers and lengths alone made a test of
        // 65,536 such frames take minutes, and a traced process chooses its names.
        let hashes: HashSet<u64> = (0..1000)
            .map(|i| h.hash_one(FrameInfo::named(&format!("fn_{i:04}"))))
            .collect();
        assert_eq!(hashes.len(), 1000);
        let long = "a".repeat(300);
        let same = || FrameInfo::named(&format!("{long}x")).at("f.c", 3);
        assert_eq!(h.hash_one(same()), h.hash_one(same()));
    }

    #[inline(never)]
    fn marker_function_for_symbolization() -> u64 {
        std::hint::black_box(42)
    }

    #[test]
    fn names_a_function_of_this_test_binary_with_file_and_line() {
        let me = std::process::id();
        let mut modules = Modules::default();
        modules.refresh(me);
        let mut s = Symbolizer::default();
        // +1: stack() looks up ip - 1, as for return addresses.
        let addr = marker_function_for_symbolization as *const () as u64 + 1;
        let frames = s.stack(&modules, me, &[addr]);
        let last = frames.last().unwrap();
        assert!(
            last.function.contains("marker_function_for_symbolization"),
            "{frames:?}"
        );
        assert!(
            last.file.as_deref() == Some("mod.rs") && last.line.is_some(),
            "{frames:?}"
        );
        assert!(!last.inlined);
    }

    #[test]
    fn past_its_bounds_it_starts_over_and_still_names_frames() {
        let me = std::process::id();
        let mut modules = Modules::default();
        modules.refresh(me);
        let mut s = Symbolizer::default();
        let addr = marker_function_for_symbolization as *const () as u64 + 1;
        let before = s.stack(&modules, me, &[addr]);
        assert!(!s.trim(), "one file, a few locations: under the bounds");
        assert_eq!((s.sources.len(), s.cache.len()), (1, 1));
        assert!(s.trim_at(0, 1), "past the files' bound");
        assert_eq!((s.sources.len(), s.cache.len()), (0, 0));
        assert_eq!(s.stack(&modules, me, &[addr]), before);
        assert!(s.trim_at(1, 0), "past the locations' bound");
        assert!(s.cache.is_empty());
    }

    #[test]
    fn unknown_addresses_are_never_blank() {
        let mut s = Symbolizer::default();
        let frames = s.stack(&Modules::default(), 1, &[0xdead]);
        assert_eq!(&*frames[0].function, "[unknown] 0xdead");
        assert_eq!(&*frames[0].module, "[unknown]");
    }
}
