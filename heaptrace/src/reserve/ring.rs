//! The kernel side of reservation tracing: the event ring, and the syscall tracepoints where
//! the memory syscalls' wrappers are not probed.
use aya::{
    Btf,
    maps::{MapData, RingBuf},
    programs::BtfTracePoint,
};
use heaptrace_common::{MemEvent, maps};
use tokio::io::unix::AsyncFd;

use crate::{
    error::{Error, Result},
    probe::Probes,
};

pub struct MemRing {
    pub ring: AsyncFd<RingBuf<MapData>>,
}

impl MemRing {
    /// Opens the event ring. Unless `probes` has probed the wrappers of the memory syscalls,
    /// attaches the syscall tracepoints: they run on every syscall of the host (the one each
    /// uretprobe makes to return included) but return at once unless it is a memory syscall of
    /// a traced process; they detach with `probes`.
    pub fn start(probes: &mut Probes) -> Result<MemRing> {
        if !probes.syscalls_probed() {
            tracepoints(probes)?;
        }
        let ring = probes.take_ring(maps::MEMEVENTS)?;
        // SAFETY: the ring buffer owns its map fd and keeps it open while it is registered.
        let ring = unsafe { AsyncFd::register(ring) }.map_err(|e| e.into_parts().1)?;
        Ok(MemRing { ring })
    }

    /// The events waiting in the ring, in the order the kernel reserved them (per thread, the
    /// order they happened).
    pub fn drain(&mut self) -> Vec<MemEvent> {
        let mut out = Vec::new();
        let ring = self.ring.get_mut();
        while let Some(item) = ring.next() {
            if item.len() >= std::mem::size_of::<MemEvent>() {
                // SAFETY: the kernel wrote a MemEvent (repr(C), no padding); read unaligned.
                out.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<MemEvent>()) });
            }
        }
        out
    }
}

/// The two syscall tracepoints: every memory syscall of a traced process, whatever code made it.
fn tracepoints(probes: &mut Probes) -> Result<()> {
    let btf = Btf::from_sys_fs().map_err(|e| Error::Load(format!("kernel BTF: {e}")))?;
    for (prog, tp) in [("mem_sys_enter", "sys_enter"), ("mem_sys_exit", "sys_exit")] {
        let p: &mut BtfTracePoint = crate::probe::program(&mut probes.ebpf, prog)?;
        p.load(tp, &btf)
            .map_err(|e| Error::Load(format!("{prog}: {e}")))?;
        p.attach()
            .map_err(|e| Error::Load(format!("{prog} on {tp}: {e}")))?;
    }
    Ok(())
}
