//! `-p PID --in-process --census`: the blocks live before the attach (a census of the heap,
//! `heap::walk`) put into the region's live table while the process is stopped and counting
//! is off, as `drain::before_attach` puts them into the kernel's live map: each under
//! `BEFORE_ATTACH`, its size known, no site. Their count goes to the shared slot's live
//! counters (the daemon sums the slots) and the header's live heap and peak, so that a free
//! of one is the free of a known block and those left at the end are leaks of their own.
use std::os::unix::fs::FileExt as _;

use heaptrace_common::{
    BEFORE_ATTACH, BEFORE_ATTACH_FUNC, Loss, ProcCounters,
    inproc::{self, LIVE_RETRIES, LIVE_RETRY_PROBES, LiveEntry, PROBES, SHARED_OWNER, ThreadHead},
};

use super::{Region, io_err};
use crate::{drain::before_attach::BeforeAttach, error::Result, heap::walk::Block};

/// Bytes of a plain `#[repr(C)]` value of integers.
fn bytes_of<T: Copy>(v: &T) -> &[u8] {
    // SAFETY: any initialised plain value can be read as its bytes.
    unsafe { std::slice::from_raw_parts((v as *const T).cast(), std::mem::size_of::<T>()) }
}

impl Region {
    /// Puts `blocks` in the live table, as many as it has room for, and counts them live.
    /// Call with the process stopped and counting off: nothing else writes the table then.
    pub fn take_in_before_attach(&mut self, blocks: &[Block]) -> Result<BeforeAttach> {
        let mut t = BeforeAttach {
            pid: self.pid,
            ..Default::default()
        };
        for b in blocks {
            if self.insert_before_attach(b)? {
                t.blocks += 1;
                t.bytes += b.size;
            } else {
                t.lost_blocks += 1;
                t.lost_bytes += b.size;
            }
        }
        self.count_before_attach(&t)?;
        Ok(t)
    }

    /// One block in the first empty slot of its runs (`live::insert`'s order); false when
    /// they have none.
    fn insert_before_attach(&self, b: &Block) -> Result<bool> {
        let slots = self.caps.live;
        let size = std::mem::size_of::<LiveEntry>();
        let own = (inproc::live_slot(b.ptr, slots), PROBES as usize);
        let retries = (1..=LIVE_RETRIES).map(|n| {
            let first = inproc::live_retry_slot(b.ptr, n, slots);
            (first, LIVE_RETRY_PROBES as usize)
        });
        for (first, len) in std::iter::once(own).chain(retries) {
            for p in 0..len {
                let at = self.layout.live + ((first + p) & (slots as usize - 1)) * size;
                let key = self.read::<u64>(at, 1)?[0];
                if key != inproc::EMPTY && key != inproc::GONE {
                    continue;
                }
                let e = LiveEntry {
                    key: b.ptr,
                    size: b.size,
                    stack_id: BEFORE_ATTACH,
                    func: BEFORE_ATTACH_FUNC,
                    tid: 0,
                    seq: 0,
                    ts_ns: 0,
                };
                self.file
                    .write_all_at(bytes_of(&e), at as u64)
                    .map_err(io_err("writing the region"))?;
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The blocks taken in as live in the shared slot's counters, the header's live heap
    /// and peak (as the kernel path's `ProcPeak` starts), and those left out as losses.
    fn count_before_attach(&mut self, t: &BeforeAttach) -> Result<()> {
        let slot = self.layout.shared();
        let counters = slot + std::mem::offset_of!(ThreadHead, counters);
        let live = counters + std::mem::offset_of!(ProcCounters, live_blocks);
        let write = |at: usize, v: u64| {
            self.file
                .write_all_at(&v.to_ne_bytes(), at as u64)
                .map_err(io_err("writing the region"))
        };
        write(live, t.blocks)?;
        write(live + 8, t.bytes)?;
        self.file
            .write_all_at(&SHARED_OWNER.to_ne_bytes(), slot as u64)
            .map_err(io_err("writing the region"))?;
        // SAFETY: the mapped header; no call writes it while counting is off.
        unsafe {
            let h = self.header;
            (*h).peak_live = t.bytes;
            (*h).peak_max = t.bytes;
            (*h).peak_size = 0;
            (*h).peak_stack = BEFORE_ATTACH as i64;
            (*h).peak_pending = 1;
            (*h).losses[Loss::LiveMap as usize] += t.lost_blocks;
        }
        Ok(())
    }
}
