//! uprobe_multi links (kernel >= 6.6): one bpf link puts a program on many offsets of a file,
//! each with its own cookie, and closing it unregisters them all behind a single grace period.
//! A perf-event uprobe instead waits for its own grace periods, under a global mutex, when it
//! is closed: about 0.1 s per probe here.
//!
//! The kernel only accepts programs loaded for this attach type (expected_attach_type
//! BPF_TRACE_UPROBE_MULTI), which aya 0.14 cannot ask for. So this module loads a second copy
//! of the programs itself: it parses the same object with aya-obj, points its map references
//! at the maps aya created (so both copies share every map and global), and loads the result.
use std::{
    collections::{HashMap, HashSet},
    ffi::CString,
    os::fd::{AsFd as _, AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
    path::Path,
};

use aya::{Ebpf, maps::Map};
use aya_obj::generated::{
    BPF_F_UPROBE_MULTI_RETURN,
    bpf_attach_type::BPF_TRACE_UPROBE_MULTI,
    bpf_attr,
    bpf_cmd::{BPF_LINK_CREATE, BPF_PROG_LOAD},
    bpf_prog_type::BPF_PROG_TYPE_KPROBE,
};
use thiserror::Error;

use crate::bpf::sys::bpf;

#[derive(Debug, Error)]
pub enum MultiError {
    #[error("parsing the eBPF object: {0}")]
    Parse(String),
    #[error("the object has CO-RE relocations, which this loader does not apply")]
    CoRe,
    #[error("map {0} of the object was not created by aya")]
    MissingMap(String),
    #[error("relocating: {0}")]
    Relocate(String),
    #[error("program {0} missing from the object")]
    MissingProgram(String),
    #[error("loading {name}: {source}")]
    Load {
        name: String,
        source: std::io::Error,
    },
    #[error("creating the link: {0}")]
    Link(std::io::Error),
    #[error("path {0} has a NUL byte")]
    Path(String),
}

/// Programs loaded for uprobe_multi links, by name.
pub struct MultiPrograms {
    progs: HashMap<String, OwnedFd>,
}

/// The fd of a map of one of the kinds heaptrace's object defines.
fn map_fd(map: &Map) -> Option<RawFd> {
    let data = match map {
        Map::Array(d)
        | Map::HashMap(d)
        | Map::PerCpuArray(d)
        | Map::PerCpuHashMap(d)
        | Map::RingBuf(d)
        | Map::StackTraceMap(d)
        | Map::LruHashMap(d)
        | Map::PerCpuLruHashMap(d)
        | Map::ArrayOfMaps(d) => d,
        _ => return None,
    };
    Some(data.fd().as_fd().as_raw_fd())
}

impl MultiPrograms {
    /// Loads `names` from `object` again, for uprobe_multi, sharing `ebpf`'s maps. Call before
    /// any map is taken out of `ebpf`.
    pub fn load(object: &[u8], ebpf: &Ebpf, names: &[&str]) -> Result<Self, MultiError> {
        let mut obj =
            aya_obj::Object::parse(object).map_err(|e| MultiError::Parse(e.to_string()))?;
        if obj.has_btf_relocations() {
            return Err(MultiError::CoRe);
        }
        let fds: HashMap<&str, RawFd> = ebpf
            .maps()
            .filter_map(|(name, m)| map_fd(m).map(|fd| (name, fd)))
            .collect();
        let defs = obj.maps.clone();
        let mut maps = Vec::new();
        for (name, def) in &defs {
            let fd = *fds
                .get(name.as_str())
                .ok_or_else(|| MultiError::MissingMap(name.clone()))?;
            maps.push((name.as_str(), fd, def));
        }
        let text_sections: HashSet<usize> = obj.functions.keys().map(|(s, _)| *s).collect();
        obj.relocate_maps(maps.into_iter(), &text_sections)
            .map_err(|e| MultiError::Relocate(e.to_string()))?;
        obj.relocate_calls(&text_sections)
            .map_err(|e| MultiError::Relocate(e.to_string()))?;
        // The object's BTF, for the function information a bpf_loop callback needs (the
        // stack walk's); programs without callbacks load without it.
        let btf = load_btf(&mut obj);
        let mut progs = HashMap::new();
        for name in names {
            let prog = obj
                .programs
                .get(*name)
                .ok_or_else(|| MultiError::MissingProgram(name.to_string()))?;
            let func = &obj.functions[&prog.function_key()];
            let info = btf.as_ref().map(|fd| FuncInfo {
                btf_fd: fd.as_raw_fd(),
                records: func.func_info.func_info_bytes(),
                count: func.func_info.func_info.len() as u32,
                rec_size: func.func_info_rec_size as u32,
            });
            let fd = load_one(name, &func.instructions, &obj.license, info.as_ref()).map_err(
                |source| MultiError::Load {
                    name: name.to_string(),
                    source,
                },
            )?;
            progs.insert(name.to_string(), fd);
        }
        Ok(MultiPrograms { progs })
    }

    /// The loaded programs, by name.
    pub fn programs(&self) -> impl Iterator<Item = (&str, std::os::fd::BorrowedFd<'_>)> {
        self.progs.iter().map(|(n, fd)| (n.as_str(), fd.as_fd()))
    }

    /// Puts program `name` on every `offsets` of `path` (at their returns with `ret`), each
    /// with the cookie of the same index. `pid` 0 means every process; otherwise the probes
    /// fire in that process's threads only. Closing the returned fd detaches them all.
    pub fn attach(
        &self,
        name: &str,
        path: &Path,
        offsets: &[u64],
        cookies: &[u64],
        ret: bool,
        pid: u32,
    ) -> Result<OwnedFd, MultiError> {
        let prog = self
            .progs
            .get(name)
            .ok_or_else(|| MultiError::MissingProgram(name.to_string()))?;
        assert_eq!(offsets.len(), cookies.len(), "one cookie per offset");
        let cpath = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| MultiError::Path(path.display().to_string()))?;
        // SAFETY: bpf_attr is plain data; all zeroes is its "unset" value.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: writing the link_create member of a zeroed union.
        unsafe {
            let lc = &mut attr.link_create;
            lc.__bindgen_anon_1.prog_fd = prog.as_raw_fd() as u32;
            lc.attach_type = BPF_TRACE_UPROBE_MULTI as u32;
            let um = &mut lc.__bindgen_anon_3.uprobe_multi;
            um.path = cpath.as_ptr() as u64;
            um.offsets = offsets.as_ptr() as u64;
            um.cookies = cookies.as_ptr() as u64;
            um.cnt = offsets.len() as u32;
            um.flags = if ret { BPF_F_UPROBE_MULTI_RETURN } else { 0 };
            um.pid = pid;
        }
        let fd = bpf(BPF_LINK_CREATE as u32, &mut attr).map_err(MultiError::Link)?;
        // SAFETY: the kernel returned a new fd that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
    }
}

/// The object's BTF, fixed up as aya does it for this kernel, loaded; None where the kernel
/// or the object has none, or refuses it.
fn load_btf(obj: &mut aya_obj::Object) -> Option<OwnedFd> {
    let features = aya::features().btf()?;
    let bytes = obj.fixup_and_sanitize_btf(features).ok()??.to_bytes();
    // SAFETY: as above.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: writing the BTF-load member of a zeroed union.
    unsafe {
        let u = &mut attr.__bindgen_anon_7;
        u.btf = bytes.as_ptr() as u64;
        u.btf_size = bytes.len() as u32;
    }
    let fd = bpf(aya_obj::generated::bpf_cmd::BPF_BTF_LOAD as u32, &mut attr)
        .inspect_err(|e| log::debug!("loading the object's BTF: {e}"))
        .ok()?;
    // SAFETY: the kernel returned a new fd that nothing else owns.
    Some(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// A program's BTF function information: its BTF and a record per function.
pub(crate) struct FuncInfo {
    btf_fd: RawFd,
    records: Vec<u8>,
    count: u32,
    rec_size: u32,
}

/// Loads (and verifies) one program for uprobe_multi links.
pub(crate) fn load_one(
    name: &str,
    insns: &[aya_obj::generated::bpf_insn],
    license: &CString,
    info: Option<&FuncInfo>,
) -> std::io::Result<OwnedFd> {
    // SAFETY: as above.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: writing the prog-load member of a zeroed union.
    unsafe {
        let u = &mut attr.__bindgen_anon_3;
        u.prog_type = BPF_PROG_TYPE_KPROBE as u32;
        u.expected_attach_type = BPF_TRACE_UPROBE_MULTI as u32;
        u.insns = insns.as_ptr() as u64;
        u.insn_cnt = insns.len() as u32;
        u.license = license.as_ptr() as u64;
        if let Some(info) = info.filter(|i| i.count > 0 && i.rec_size > 0) {
            u.prog_btf_fd = info.btf_fd as u32;
            u.func_info = info.records.as_ptr() as u64;
            u.func_info_cnt = info.count;
            u.func_info_rec_size = info.rec_size;
        }
        for (dst, src) in u.prog_name.iter_mut().zip(name.bytes().take(15)) {
            *dst = src as libc::c_char;
        }
    }
    let fd = bpf(BPF_PROG_LOAD as u32, &mut attr)?;
    // SAFETY: the kernel returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}
