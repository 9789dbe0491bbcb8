//! The kernel's side of the tables: the rows' chunks, each process's entry (and its word in
//! the process's slot), and each loaded file's rows by its identity (`FILE_ROWS`, for the
//! walks of processes that have no entry yet: heaptrace-ebpf's `vma.rs`).
use aya::maps::{HashMap as BpfHashMap, MapData};
use heaptrace_common::{
    maps,
    proc_state::unwind_word,
    unwind::{FileRows, FileRowsKey, ProcModules, Row},
};

use super::{super::chunks::Chunks, Store};
use crate::{
    bpf::proc_states::ProcStates,
    error::{Error, Result},
};

/// The kernel's maps, which the return program reads.
pub(super) struct Kernel {
    rows: Chunks,
    procs: BpfHashMap<MapData, u32, ProcModules>,
    /// Each entry's word in its process's slot, where it has one (`proc_state`).
    states: ProcStates,
    files: Option<BpfHashMap<MapData, FileRowsKey, FileRows>>,
}

fn hash_map<K: aya::Pod, V: aya::Pod>(
    ebpf: &mut aya::Ebpf,
    name: &'static str,
) -> Result<BpfHashMap<MapData, K, V>> {
    let map = ebpf.take_map(name).ok_or_else(|| Error::Map {
        map: name,
        reason: "missing from the object".into(),
    })?;
    BpfHashMap::try_from(map).map_err(|e| Error::Map {
        map: name,
        reason: e.to_string(),
    })
}

impl Kernel {
    /// The loaded object's maps, the rows' chunks to hold up to `rows` rows.
    pub(super) fn take(ebpf: &mut aya::Ebpf, rows: u32) -> Result<Kernel> {
        Ok(Kernel {
            rows: Chunks::take(ebpf, rows)?,
            procs: hash_map(ebpf, maps::UNWIND_PROCS)?,
            states: ProcStates::map(ebpf)?,
            // Without it, walks before an entry go by frame pointer (counted late).
            files: hash_map(ebpf, maps::FILE_ROWS).ok(),
        })
    }
}

impl Store for Kernel {
    fn capacity(&self) -> u32 {
        self.rows.capacity()
    }

    fn write_rows(&mut self, first: u32, rows: &[Row]) -> bool {
        self.rows.write(first, rows)
    }

    fn set_entry(&mut self, pid: u32, entry: &ProcModules) {
        if let Err(e) = self.procs.insert(pid, entry, 0) {
            log::debug!("unwind tables of {pid}: {e}");
            return;
        }
        // After the map: a walk that reads the word finds the entry in the map.
        self.states
            .set_unwind(pid, unwind_word(pid, entry.version, entry.count));
    }

    fn remove_entry(&mut self, pid: u32) {
        self.states.set_unwind(pid, 0);
        let _ = self.procs.remove(&pid);
    }

    fn entries(&self) -> Vec<u32> {
        self.procs.keys().filter_map(|k| k.ok()).collect()
    }

    fn set_file(&mut self, key: FileRowsKey, rows: Option<FileRows>) {
        let Some(files) = self.files.as_mut() else {
            return;
        };
        let done = match rows {
            // Full (`FILE_ROWS_ENTRIES`): that file's walks before an entry stay late.
            Some(r) => files.insert(key, r, 0),
            // Never there: a file whose segments did not qualify.
            None => files.remove(&key).or(Ok(())),
        };
        if let Err(e) = done {
            log::debug!("FILE_ROWS {key:?}: {e}");
        }
    }
}
