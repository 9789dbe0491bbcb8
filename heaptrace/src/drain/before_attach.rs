//! The blocks live before `heaptrace -p` attached (a census of the heap, `heap::walk`), put
//! into the kernel's maps before counting is turned on: the live map holds each under
//! `BEFORE_ATTACH` (its size known, no site), the process's counters hold them as live, and
//! its peak starts from them. A free of one is then the free of a known block, and the ones
//! left at the end are leaks of their own site.
use heaptrace_common::{BEFORE_ATTACH, BEFORE_ATTACH_FUNC, ProcPeak};

use super::*;
use crate::heap::walk::Block;

/// What was taken in: blocks and their usable bytes, and those the live map had no room for
/// (counted lost, as an allocation the map cannot take).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BeforeAttach {
    pub pid: u32,
    pub blocks: u64,
    pub bytes: u64,
    pub lost_blocks: u64,
    pub lost_bytes: u64,
}

impl KernelMaps {
    /// Puts `blocks` of process `tgid` (its current image) in the live map, as many as it
    /// holds, and their count into the process's live counters and peak. Call while counting
    /// is off, the process stopped: no program writes these entries meanwhile.
    pub fn take_in_before_attach(&mut self, tgid: u32, blocks: &[Block]) -> Result<BeforeAttach> {
        let epoch = self.epoch(tgid);
        let keys: Vec<LiveKey> = blocks
            .iter()
            .map(|b| LiveKey {
                tgid,
                epoch,
                ptr: b.ptr,
            })
            .collect();
        let values: Vec<LiveBlock> = blocks
            .iter()
            .map(|b| LiveBlock {
                size: b.size,
                ts_ns: 0,
                tid: 0,
                func: BEFORE_ATTACH_FUNC,
                stack_id: BEFORE_ATTACH,
                seq: 0,
            })
            .collect();
        let fit =
            batch::update(self.live_fd.as_fd(), &keys, &values, 1).map_err(|e| Error::Map {
                map: maps::LIVE,
                reason: e.to_string(),
            })?;
        let (taken, left) = blocks.split_at(fit);
        let t = BeforeAttach {
            pid: tgid,
            blocks: taken.len() as u64,
            bytes: taken.iter().map(|b| b.size).sum(),
            lost_blocks: left.len() as u64,
            lost_bytes: left.iter().map(|b| b.size).sum(),
        };
        self.count_before_attach(tgid, epoch, &t)?;
        Ok(t)
    }

    /// The process's counters (its live blocks and bytes on the first CPU's copy: user space
    /// sums the CPUs), its peak, and the live map's losses.
    fn count_before_attach(&mut self, tgid: u32, epoch: u32, t: &BeforeAttach) -> Result<()> {
        let comm = std::fs::read(format!("/proc/{tgid}/comm")).unwrap_or_default();
        let mut zero = ProcCounters::ZERO;
        zero.epoch = u64::from(epoch);
        for (d, s) in zero.comm[..15].iter_mut().zip(comm.iter()) {
            if *s == b'\n' {
                break;
            }
            *d = *s;
        }
        let mut per_cpu = vec![zero; self.cpus];
        per_cpu[0].live_blocks = t.blocks;
        per_cpu[0].live_bytes = t.bytes;
        batch::update(self.procs_fd.as_fd(), &[tgid], &per_cpu, self.cpus)
            .map_err(read_err(maps::PROCS))?;
        let peak = ProcPeak {
            live: t.bytes,
            max: t.bytes,
            max_size: 0,
            max_stack: BEFORE_ATTACH,
            epoch,
            // What is live now is the peak so far: no site's figures to fold until a release.
            pending: 1,
            blocks: t.blocks,
            max_blocks: t.blocks,
            ..ProcPeak::ZERO
        };
        if !self.proc_states.set_peak(tgid, &peak) {
            self.peaks
                .insert(tgid, peak, 0)
                .map_err(map_err(maps::PEAKS))?;
        }
        if t.lost_blocks > 0 {
            let i = Loss::LiveMap as u32;
            let mut per_cpu: Vec<u64> = self
                .losses
                .get(&i, 0)
                .map_err(map_err(maps::LOSSES))?
                .iter()
                .copied()
                .collect();
            per_cpu[0] += t.lost_blocks;
            let values = aya::maps::PerCpuValues::try_from(per_cpu).map_err(|e| Error::Map {
                map: maps::LOSSES,
                reason: e.to_string(),
            })?;
            self.losses
                .set(i, values, 0)
                .map_err(map_err(maps::LOSSES))?;
        }
        Ok(())
    }
}
