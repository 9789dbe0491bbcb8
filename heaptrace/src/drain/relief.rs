//! Early reads: the site and size maps hold the keys created since the read before last
//! (`retire`), about two rounds' worth. When rounds run long (a host busy enough to starve the
//! daemon, seconds a round) or new keys come in a burst, that fills them: `--all` beside a
//! compile loop and three Rust builds lost millions of site updates. So the programs count the
//! entries they create (FILLS), and once the keys since the read before last reach a quarter
//! of a map, a read between rounds retires the past keys and moves the generation on, as a round's
//! read does. Its snapshot is dropped: the figures retired are in the archive, which the next
//! round's snapshot adds, so every round's figures are as if it had read them all itself.
//! FRAMES the same: it holds the stacks stored since its last read, and a round of seconds
//! beside two `rustc` stored more than it holds (87,199 in one 3.3 s round), so it is read
//! into the archive between rounds once a quarter full.
use super::*;

/// The entries the programs created in the site, size and frames maps
/// (`heaptrace_common::fills`).
pub(super) struct Fills {
    map: PerCpuArray<MapData, u64>,
    /// Each map's capacity.
    capacity: [u64; 3],
    /// The entries created by the read before last and by the last read (`moved`); only
    /// the site and size maps' are used, FRAMES being emptied by its own reads.
    at_reads: [[u64; 3]; 2],
    /// The stacks stored in FRAMES up to its last read.
    frames_at_read: u64,
}

/// What is filling (`Fills::due`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Due {
    /// The site or size map: their past keys to retire.
    pub keys: bool,
    /// FRAMES: the new stacks' frames to archive.
    pub frames: bool,
}

impl Fills {
    pub(super) fn take(ebpf: &mut Ebpf) -> Result<Fills> {
        let capacity = [maps::SITES, maps::SIZES, maps::FRAMES].map(|name| {
            ebpf.map(name)
                .and_then(|m| match m {
                    aya::maps::Map::PerCpuHashMap(d) | aya::maps::Map::HashMap(d) => d.info().ok(),
                    _ => None,
                })
                .map_or(u64::MAX, |i| u64::from(i.max_entries()))
        });
        Ok(Fills {
            map: take(ebpf, maps::FILLS)?,
            capacity,
            at_reads: [[0; 3]; 2],
            frames_at_read: 0,
        })
    }

    /// The entries created so far in each map, summed over the CPUs.
    fn created(&self) -> Result<[u64; 3]> {
        let mut n = [0u64; 3];
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

    /// The count to give `frames_read` once FRAMES is read: taken before the read, so that
    /// stacks stored during it count as unread.
    pub(super) fn frames_now(&self) -> Result<u64> {
        Ok(self.created()?[2])
    }

    /// FRAMES was read and emptied of what was stored up to `at` (`frames_now`).
    pub(super) fn frames_read(&mut self, at: u64) {
        self.frames_at_read = at;
    }

    /// Whether a map holds a quarter of its capacity in entries created since the read that
    /// empties it: the read before last for the keys (an upper bound: keys of processes gone
    /// were deleted meanwhile), the last for FRAMES. A quarter, not more: a read checks at
    /// most every 100 ms, and a round's own read can take seconds on a starved host; the
    /// entries each read copies are about as many whatever the threshold.
    pub(super) fn due(&self) -> Result<Due> {
        let now = self.created()?;
        let [sites, sizes, _] = self.at_reads[0];
        let since = [sites, sizes, self.frames_at_read];
        let full = quarter_full(now, since, self.capacity);
        Ok(Due {
            keys: full[0] || full[1],
            frames: full[2],
        })
    }
}

fn quarter_full(now: [u64; 3], since: [u64; 3], capacity: [u64; 3]) -> [bool; 3] {
    [0, 1, 2].map(|i| now[i].wrapping_sub(since[i]) >= capacity[i] / 4)
}

impl KernelMaps {
    /// Reads the maps now where they are filling (`Fills::due`): retires the past keys of
    /// the site and size maps, archives the new stacks' frames. Returns whether it did.
    pub fn relieve(&mut self) -> Result<bool> {
        let due = self.fills.due()?;
        if due.frames {
            self.read_frames()?;
        }
        if !due.keys {
            return Ok(due.frames);
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
        let cap = [65536, 1024, 400];
        let any = |f: [bool; 3]| f.iter().any(|b| *b);
        assert!(!any(quarter_full([26_383, 100, 0], [10_000, 0, 0], cap)));
        assert_eq!(
            quarter_full([26_384, 100, 0], [10_000, 0, 0], cap),
            [true, false, false]
        );
        assert_eq!(
            quarter_full([20_000, 356, 0], [10_000, 100, 0], cap),
            [false, true, false]
        );
        assert_eq!(
            quarter_full([0, 0, 150], [0, 0, 50], cap),
            [false, false, true]
        );
        // Counters wrap as the kernel's do.
        assert!(!any(quarter_full(
            [5, 0, 1],
            [u64::MAX - 5, 0, u64::MAX],
            cap
        )));
    }
}
