//! The address ranges an allocator mapped, each remembering the call that made it.
use std::collections::BTreeMap;

use super::Area;

/// One mapping (or what is left of it): its end, what it is, and who made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub end: u64,
    pub kind: Area,
    pub stack_id: i32,
    pub func: u32,
    /// The allocator call that made it (`Tracker::serial`).
    pub serial: u64,
}

impl Region {
    /// A region an allocator call just made; its site is set when the call ends.
    pub fn made(end: u64, kind: Area, func: u32, serial: u64) -> Region {
        Region {
            end,
            kind,
            stack_id: heaptrace_common::NO_SITE,
            func,
            serial,
        }
    }
}

/// A process can hold at most this many mappings (vm.max_map_count's default is 65530).
const MAX_REGIONS: usize = 1 << 16;

/// Non-overlapping regions by start address.
#[derive(Default)]
pub struct Regions(BTreeMap<u64, Region>);

impl Regions {
    /// Adds a region; false (and nothing kept) when the process already has too many.
    pub fn insert(&mut self, start: u64, r: Region) -> bool {
        if r.end <= start {
            return true;
        }
        if self.0.len() >= MAX_REGIONS {
            return false;
        }
        self.unmap(start, r.end, u64::MAX);
        self.0.insert(start, r);
        true
    }

    /// Removes [start, end) from every region it overlaps. Returns the pieces removed from
    /// regions made by another call than `serial`, with their sizes: memory given back. (What
    /// a call unmaps of its own new regions only trims what it reserves.)
    pub fn unmap(&mut self, start: u64, end: u64, serial: u64) -> Vec<(Region, u64)> {
        given_back(&self.take(start, end), serial)
    }

    /// Removes [start, end) from every region it overlaps; returns the pieces removed, each
    /// with its start, to be given back (`given_back`) or put back (`insert`).
    pub fn take(&mut self, start: u64, end: u64) -> Vec<(u64, Region)> {
        let hit: Vec<(u64, Region)> = self
            .0
            .range(..end)
            .rev()
            .take_while(|(_, r)| r.end > start)
            .map(|(s, r)| (*s, *r))
            .collect();
        let mut out = Vec::new();
        for (s, r) in hit {
            self.0.remove(&s);
            if s < start {
                self.0.insert(s, Region { end: start, ..r });
            }
            if r.end > end {
                self.0.insert(end, r);
            }
            out.push((
                s.max(start),
                Region {
                    end: r.end.min(end),
                    ..r
                },
            ));
        }
        out
    }

    /// Whether [start, end) lies inside known regions entirely.
    pub fn covers(&self, start: u64, end: u64) -> bool {
        let mut at = start;
        while at < end {
            match self.get_at(at) {
                Some(r) => at = r.end,
                None => return false,
            }
        }
        true
    }

    /// The region holding `addr`.
    pub fn get_at(&self, addr: u64) -> Option<Region> {
        self.0
            .range(..=addr)
            .next_back()
            .filter(|(_, r)| r.end > addr)
            .map(|(_, r)| *r)
    }

    /// The regions call `serial` made, all within [lo, hi).
    pub fn of_serial_mut(
        &mut self,
        serial: u64,
        lo: u64,
        hi: u64,
    ) -> impl Iterator<Item = (u64, &mut Region)> {
        self.0
            .range_mut(lo..hi.max(lo))
            .map(|(s, r)| (*s, r))
            .filter(move |(_, r)| r.serial == serial)
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, &Region)> {
        self.0.iter().map(|(s, r)| (*s, r))
    }
}

/// The pieces of `taken` that regions of another call than `serial` lose, with their sizes.
pub fn given_back(taken: &[(u64, Region)], serial: u64) -> Vec<(Region, u64)> {
    taken
        .iter()
        .filter(|(_, r)| r.serial != serial)
        .map(|(s, r)| (*r, r.end - s))
        .collect()
}
