//! Early retires: the site and size maps hold the keys created since the read before last
//! (`retire`), about two rounds' worth. When rounds run long (a host busy enough to starve the
//! daemon, seconds a round) or new keys come in a burst, that fills them: `--all` beside a
//! compile loop and three Rust builds lost millions of site updates. So the programs count the
//! entries they create (FILLS), and once the keys since the read before last reach a quarter
//! of a map, a read between rounds retires the past keys and moves the generation on, as a round's
//! read does. Its snapshot is dropped: the figures retired are in the archive, which the next
//! round's snapshot adds, so every round's figures are as if it had read them all itself.
use super::*;

/// The entries the programs created in the site and size maps (`heaptrace_common::fills`).
pub(super) struct Fills {
    map: PerCpuArray<MapData, u64>,
    /// Each map's capacity.
    capacity: [u64; 2],
    /// The entries created by the read before last and by the last read (`moved`).
    at_reads: [[u64; 2]; 2],
}

impl Fills {
    pub(super) fn take(ebpf: &mut Ebpf) -> Result<Fills> {
        let capacity = [maps::SITES, maps::SIZES].map(|name| {
            ebpf.map(name)
                .and_then(|m| match m {
                    aya::maps::Map::PerCpuHashMap(d) => d.info().ok(),
                    _ => None,
                })
                .map_or(u64::MAX, |i| u64::from(i.max_entries()))
        });
        Ok(Fills {
            map: take(ebpf, maps::FILLS)?,
            capacity,
            at_reads: [[0; 2]; 2],
        })
    }

    /// The entries created so far in each map, summed over the CPUs.
    fn created(&self) -> Result<[u64; 2]> {
        let mut n = [0u64; 2];
        for (i, n) in n.iter_mut().enumerate() {
            let per_cpu = self.map.get(&(i as u32), 0).map_err(map_err(maps::FILLS))?;
            *n = per_cpu.iter().fold(0u64, |a, b| a.wrapping_add(*b));
        }
        Ok(n)
    }

    /// A read moved the generation on: the keys created before the read before it are gone.
    pub(super) fn moved(&mut self) -> Result<()> {
        self.at_reads = [self.at_reads[1], self.created()?];
        Ok(())
    }

    /// Whether a map holds a quarter of its capacity in keys created since the read before
    /// last (an upper bound: keys of processes gone were deleted meanwhile). A quarter, not
    /// more: a read checks at most every 100 ms, and a round's own read can take seconds on a
    /// starved host; the entries each read copies are about as many whatever the threshold.
    pub(super) fn due(&self) -> Result<bool> {
        let now = self.created()?;
        Ok(quarter_full(now, self.at_reads[0], self.capacity))
    }
}

fn quarter_full(now: [u64; 2], since: [u64; 2], capacity: [u64; 2]) -> bool {
    (0..2).any(|i| now[i].wrapping_sub(since[i]) >= capacity[i] / 4)
}

impl KernelMaps {
    /// Retires the past keys of the site and size maps now if they are filling (`Fills::due`);
    /// returns whether it did.
    pub fn relieve(&mut self) -> Result<bool> {
        if !self.fills.due()? {
            return Ok(false);
        }
        let mut snap = Snapshot::default();
        let round = self.round_now();
        let epochs = self.read_procs(&mut snap)?;
        let peaks = self.read_peaks(&mut snap);
        self.read_sizes(&mut snap, &epochs, round)?;
        self.read_sites(&mut snap, &epochs, round, &peaks)?;
        next_stack_generation(&self.stack_cache, &self.stack_gen);
        self.fills.moved()?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::quarter_full;

    #[test]
    fn due_at_a_quarter_of_a_map_since_the_read_before_last() {
        let cap = [65536, 1024];
        assert!(!quarter_full([26_383, 100], [10_000, 0], cap));
        assert!(quarter_full([26_384, 100], [10_000, 0], cap));
        assert!(quarter_full([20_000, 356], [10_000, 100], cap));
        // Counters wrap as the kernel's do.
        assert!(!quarter_full([5, 0], [u64::MAX - 5, 0], cap));
    }
}
