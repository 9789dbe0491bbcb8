//! A launched Python held at its finalization (heaptrace-ebpf's `py_hold.rs`): a uprobe on
//! `Py_FinalizeEx`, bound to the process, that sends its thread a signal the command's tracer
//! stops it on, while its code objects still exist.
use aya::{
    maps::HashMap,
    programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope},
};
use heaptrace_common::maps;

use super::{Probes, own, uprobe};
use crate::{
    bpf::links::Link,
    error::{Error, Result},
    targets::target_file::TargetFile,
};

const PROGRAM: &str = "py_finalize";

impl Probes {
    /// Holds process `pid` at its next call of `Py_FinalizeEx` (at `offset` in `file`): the
    /// program sends the calling thread `sig`, once. A link made before for the process and
    /// file, bound to the pid, serves a new image of the same file.
    pub fn hold_python_finalize(
        &mut self,
        file: &TargetFile,
        offset: u64,
        pid: u32,
        sig: i32,
    ) -> Result<()> {
        let err = |reason: String| Error::Map {
            map: maps::PY_HOLD,
            reason,
        };
        let map = self
            .ebpf
            .map_mut(maps::PY_HOLD)
            .ok_or_else(|| err("missing from the object".into()))?;
        let mut held: HashMap<_, u32, u32> =
            HashMap::try_from(map).map_err(|e| err(e.to_string()))?;
        held.insert(pid, sig as u32, 0)
            .map_err(|e| err(e.to_string()))?;
        if self.python_holds.contains_key(&(pid, file.id())) {
            return Ok(());
        }
        let point = UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(offset),
            cookie: None,
        };
        let scope =
            UProbeScope::OneProcess(std::num::NonZeroU32::new(pid).ok_or(Error::NoSuchProcess(0))?);
        let prog = uprobe(&mut self.ebpf, PROGRAM)?;
        let id = prog
            .attach(point, file.attach_path(), scope)
            .map_err(|e| Error::Load(format!("{PROGRAM}: {e}")))?;
        let link = Link::Perf(own(prog, id)?);
        self.python_holds.insert((pid, file.id()), link);
        Ok(())
    }

    /// Process `pid` is no longer held at its finalization: it exec'ed (its link stays,
    /// for a new image of the same file) or, with `ended`, it is gone (its links closed).
    pub fn unhold_python_finalize(&mut self, pid: u32, ended: bool) {
        // Every process gone passes here: only one held ever has an entry (a map syscall).
        if !self.python_holds.keys().any(|(p, _)| *p == pid) {
            return;
        }
        if let Some(map) = self.ebpf.map_mut(maps::PY_HOLD)
            && let Ok(mut held) = HashMap::<_, u32, u32>::try_from(map)
        {
            let _ = held.remove(&pid);
        }
        if ended {
            self.python_holds.retain(|(p, _), _| *p != pid);
        }
    }
}
