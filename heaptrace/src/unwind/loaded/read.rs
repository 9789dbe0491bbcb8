//! Reading a file's table: apart from placing it, so that the exec watch's loader thread can
//! read and build a large one (cc1plus: 517k rows, ~40 ms) without holding the tables' lock,
//! which the daemon and the reader thread take.
use std::{
    os::unix::fs::MetadataExt as _,
    path::PathBuf,
    time::{Duration, Instant},
};

use super::{CodeMapping, FileEntry, FileKey, MAX_FILE_BYTES, Placement, Stamp, Tables};
use crate::unwind::table::{self, FileTable, TableError};

/// A file a caller holds open already, by its identity (`dev`: major << 32 | minor, as in
/// /proc/PID/maps) and a path that reaches that very file (`/proc/self/fd/N`). Read through
/// it rather than the process's `map_files`, which a process gone no longer has.
#[derive(Clone, Debug)]
pub struct Opened {
    pub dev: u64,
    pub inode: u64,
    pub path: PathBuf,
}

/// A file's table as read and built, not placed yet (`Tables::admit`).
pub struct Built {
    key: FileKey,
    path: String,
    stamp: Option<Stamp>,
    table: Result<FileTable, TableError>,
    took: Duration,
}

impl Built {
    /// Reads the file at `path` (`key`'s).
    pub(super) fn at(key: FileKey, path: String) -> Built {
        let start = Instant::now();
        let Some((file, stamp)) = open_bounded(&path) else {
            return Built {
                key,
                path,
                stamp: None,
                table: Err(TableError::Elf("not readable".into())),
                took: start.elapsed(),
            };
        };
        // Only the headers and the unwind sections are read, not the whole file.
        let cache = object::ReadCache::new(file);
        let table = table::build(&cache);
        Built {
            key,
            path,
            stamp: Some(stamp),
            table,
            took: start.elapsed(),
        }
    }
}

/// A file of a process's mappings whose table is to be read.
pub struct ToRead {
    key: FileKey,
    path: String,
}

impl ToRead {
    /// The file of mapping `m` of process `pid`: through `opened` where it holds the file,
    /// else through `/proc/PID/map_files`, the very file the process maps whatever its path
    /// says now (a container's, one replaced since).
    pub(super) fn of(pid: u32, m: &CodeMapping, opened: &[Opened]) -> ToRead {
        let path = match opened
            .iter()
            .find(|o| o.dev == m.file.dev && o.inode == m.file.inode)
        {
            Some(o) => o.path.to_string_lossy().into_owned(),
            None => format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end),
        };
        ToRead { key: m.file, path }
    }

    /// The file's stamp now; None where it cannot be read.
    pub(super) fn stamp(&self) -> Option<Stamp> {
        std::fs::metadata(&self.path)
            .ok()
            .map(|meta| Stamp::of(&meta))
    }

    pub fn read(self) -> Built {
        Built::at(self.key, self.path)
    }
}

impl Tables {
    /// The files of `pid`'s code mappings (`maps`) with no table yet, to read and build away
    /// from `self`: for a caller that holds the tables' lock only to ask this and to `admit`
    /// what it built.
    /// None before the loader has mapped the libraries (`loader_done`).
    pub fn to_read(&self, pid: u32, maps: &str, opened: &[Opened]) -> Vec<ToRead> {
        if !super::loader_done(maps) {
            return Vec::new();
        }
        let mut seen = std::collections::HashSet::new();
        super::code_mappings(maps)
            .into_iter()
            .filter(|m| !self.files.contains_key(&m.file) && seen.insert(m.file))
            .map(|m| ToRead::of(pid, &m, opened))
            .collect()
    }

    /// Places a table read away from the lock, unless another read of the file was placed
    /// meanwhile. Its processes' entries go in at their next `sync`.
    pub fn admit(&mut self, built: Built) {
        if self.files.contains_key(&built.key) {
            return;
        }
        let key = built.key;
        let entry = self.entry_of(built);
        self.files.insert(key, entry);
        self.publish(key);
        // Idle until a process's entry points at it: given back first if no process does.
        self.idle.push_back(key);
        self.trim_idle();
    }

    /// Places the table `built` holds: its `FileEntry`.
    pub(super) fn entry_of(&mut self, built: Built) -> FileEntry {
        let Built {
            path,
            stamp,
            table,
            took,
            ..
        } = built;
        let unusable = FileEntry {
            placement: Placement::Unusable,
            segments: Vec::new(),
            users: 0,
            stamp,
        };
        if stamp.is_none() {
            self.stats.unusable += 1;
            return unusable;
        }
        self.stats.read += 1;
        self.stats.build += took;
        let t = match table {
            Ok(t) => t,
            Err(e) => {
                log::debug!("no unwind table for {path}: {e}");
                self.stats.unusable += 1;
                return unusable;
            }
        };
        let placement = if t.frame_pointers() {
            self.stats.frame_pointers += 1;
            Placement::FramePointers
        } else {
            self.place(&t.rows)
        };
        log::debug!(
            "unwind table of {path}: {} rows, {:?}, {placement:?}, {took:?}",
            t.rows.len(),
            t.stats,
        );
        FileEntry {
            placement,
            segments: t.segments,
            users: 0,
            stamp,
        }
    }
}

/// The file at `path`, if it is a regular file no larger than [`MAX_FILE_BYTES`].
pub(super) fn open_bounded(path: &str) -> Option<(std::fs::File, Stamp)> {
    let f = std::fs::File::open(path).ok()?;
    let meta = f.metadata().ok()?;
    (meta.is_file() && meta.size() <= MAX_FILE_BYTES).then(|| (f, Stamp::of(&meta)))
}
