//! The kernel's unwind rows: an index space of up to `--unwind-table-size` rows, held in
//! chunks of `CHUNK_ROWS` (array maps in `UNWIND_CHUNKS`, an array of maps) that are created
//! when rows are first written into them. A host tracing a few small programs holds a chunk
//! or two; one building with rustc (2.6 M rows for its two libraries) holds what it needs,
//! and nothing is allocated for rows never written.
use std::os::fd::{AsFd as _, AsRawFd as _, FromRawFd as _, OwnedFd};

use aya::maps::MapData;
use aya_obj::generated::{
    bpf_attr,
    bpf_cmd::{BPF_MAP_CREATE, BPF_MAP_UPDATE_ELEM},
    bpf_map_type::BPF_MAP_TYPE_ARRAY,
};
use heaptrace_common::{
    maps,
    unwind::{CHUNK_ROWS, CHUNK_SHIFT, MAX_CHUNKS, Row},
};

use crate::{
    bpf::{mmap_array::MappedArray, sys::bpf},
    error::{Error, Result},
};

const BPF_F_MMAPABLE: u32 = 1 << 10;

pub struct Chunks {
    /// The array of maps the programs read.
    outer: MapData,
    /// The chunks created so far, in index order, each mapped for writing.
    mapped: Vec<(OwnedFd, MappedArray<Row>)>,
    /// Rows the index space holds.
    rows: u32,
}

impl Chunks {
    /// Takes the loaded object's array of chunks; `rows` is the most it will hold.
    pub fn take(ebpf: &mut aya::Ebpf, rows: u32) -> Result<Chunks> {
        let err = |reason: &str| Error::Map {
            map: maps::UNWIND_CHUNKS,
            reason: reason.into(),
        };
        let outer = match ebpf.take_map(maps::UNWIND_CHUNKS) {
            Some(aya::maps::Map::ArrayOfMaps(data)) => data,
            Some(_) => return Err(err("not an array of maps")),
            None => return Err(err("missing from the object")),
        };
        Ok(Chunks {
            outer,
            mapped: Vec::new(),
            rows: rows.min(MAX_CHUNKS * CHUNK_ROWS),
        })
    }

    pub fn capacity(&self) -> u32 {
        self.rows
    }

    /// Writes `rows` from index `first` on, creating the chunks they reach; false where a
    /// chunk could not be created (the kernel's memory, or the array's bound).
    pub fn write(&mut self, first: u32, rows: &[Row]) -> bool {
        let end = u64::from(first) + rows.len() as u64;
        if end > u64::from(self.rows) {
            return false;
        }
        let need = end.div_ceil(u64::from(CHUNK_ROWS)) as usize;
        while self.mapped.len() < need {
            match self.create(self.mapped.len() as u32) {
                Ok(c) => self.mapped.push(c),
                Err(e) => {
                    log::warn!("unwind rows: no new chunk: {e}");
                    return false;
                }
            }
        }
        for (i, r) in rows.iter().enumerate() {
            let at = first + i as u32;
            let (chunk, slot) = (at >> CHUNK_SHIFT, at & (CHUNK_ROWS - 1));
            self.mapped[chunk as usize].1.write(slot as usize, *r);
        }
        true
    }

    /// Creates chunk `index` (mappable, as the map's template) and puts it in the array.
    fn create(&self, index: u32) -> std::io::Result<(OwnedFd, MappedArray<Row>)> {
        // SAFETY: bpf_attr is plain data; all zeroes is its "unset" value.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: writing the map-create member of a zeroed union.
        unsafe {
            let a = &mut attr.__bindgen_anon_1;
            a.map_type = BPF_MAP_TYPE_ARRAY as u32;
            a.key_size = size_of::<u32>() as u32;
            a.value_size = size_of::<Row>() as u32;
            a.max_entries = CHUNK_ROWS;
            a.map_flags = BPF_F_MMAPABLE;
            for (d, s) in a.map_name.iter_mut().zip(b"ht_unwind_rows") {
                *d = *s as core::ffi::c_char;
            }
        }
        let fd = bpf(BPF_MAP_CREATE as u32, &mut attr)?;
        // SAFETY: the kernel just returned this descriptor, owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let mapped = MappedArray::map_fd(fd.as_fd(), CHUNK_ROWS as usize, maps::UNWIND_CHUNKS)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        let value = fd.as_raw_fd() as u32;
        // SAFETY: as above.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: writing the element member of a zeroed union; key and value outlive the
        // call.
        unsafe {
            let a = &mut attr.__bindgen_anon_2;
            a.map_fd = self.outer.fd().as_fd().as_raw_fd() as u32;
            a.key = &raw const index as u64;
            a.__bindgen_anon_1.value = &raw const value as u64;
        }
        bpf(BPF_MAP_UPDATE_ELEM as u32, &mut attr)?;
        Ok((fd, mapped))
    }
}
