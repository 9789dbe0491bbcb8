//! Snapshots of known processes and sites, for the serve tests.
use std::sync::Arc;

use heaptrace_common::Func;

use super::Snapshot;
use crate::{
    drain::round::SiteTotals,
    profile::ProcProfile,
    symbolize::{Frame, FrameInfo},
};

/// Process `pid` named `comm` in `cgroup`, that made `n` mallocs of `size` bytes at one site
/// (stack `pid`: `leaf` in `module`, called from main), freeing `freed` of them.
pub fn add_process(
    s: &mut Snapshot,
    pid: u32,
    comm: &str,
    cgroup: &str,
    n: u64,
    size: u64,
    freed: u64,
) {
    let mut pp = ProcProfile {
        comm: comm.into(),
        cgroup: cgroup.into(),
        ..Default::default()
    };
    let f = &mut pp.totals.funcs[Func::Malloc as usize];
    f.calls = n;
    f.bytes = n * size;
    pp.totals.funcs[Func::Free as usize].calls = freed;
    pp.totals.live_blocks = (n - freed) as i64;
    pp.totals.live_bytes = ((n - freed) * size) as i64;
    s.profile.procs.insert(pid, pp);
    let frames: Arc<[Frame]> = [
        FrameInfo::named(&format!("leaf_{comm}"))
            .at("/src/a.c", 7)
            .in_module("prog", 0x1100)
            .into(),
        FrameInfo::named("main")
            .at("/src/a.c", 20)
            .in_module("prog", 0x1200)
            .into(),
    ]
    .into();
    s.profile.stacks.insert((pid, pid as i32), frames);
    s.profile.sites.insert(
        (pid, pid as i32, Func::Malloc as u32),
        SiteTotals {
            calls: n,
            bytes: n * size,
            live_blocks: (n - freed) as i64,
            live_bytes: ((n - freed) * size) as i64,
            ..Default::default()
        },
    );
}
