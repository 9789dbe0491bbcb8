//! The processes' state slots as user space sees them (`heaptrace_common::proc_state`): the
//! kernel's array mapped into memory. Peaks are read from a process's slot where it owns one
//! (else from PEAKS), unwind words written there beside UNWIND_PROCS, and the slots of
//! processes gone freed: marked busy, zeroed, then freed.
use std::sync::atomic::{AtomicU64, Ordering};

use aya::Ebpf;
use heaptrace_common::{
    ProcPeak, maps,
    proc_state::{BUSY, FREE, ProcState},
};

use crate::{bpf::mmap_array::MappedArray, error::Result};

/// `ProcState::peak`'s first word, and its words.
const PEAK_WORD: usize = 8;
const PEAK_WORDS: usize = size_of::<ProcPeak>() / 8;
const _: () = assert!(core::mem::offset_of!(ProcState, peak) == PEAK_WORD * 8);
const _: () = assert!(size_of::<ProcPeak>().is_multiple_of(8));
/// A peak as a claim leaves it: `ProcPeak::ZERO`, word by word.
// SAFETY: ProcPeak is plain integers, a multiple of 8 bytes (asserted above).
const PEAK_ZERO: [u64; PEAK_WORDS] = unsafe { core::mem::transmute(ProcPeak::ZERO) };

pub struct ProcStates(MappedArray<ProcState>);

impl ProcStates {
    /// Maps the loaded object's slot array.
    pub fn map(ebpf: &Ebpf) -> Result<ProcStates> {
        MappedArray::map(ebpf, maps::PROC_STATE).map(ProcStates)
    }

    #[cfg(test)]
    pub fn over(slots: &mut [ProcState]) -> std::mem::ManuallyDrop<ProcStates> {
        std::mem::ManuallyDrop::new(ProcStates(std::mem::ManuallyDrop::into_inner(
            MappedArray::over(slots),
        )))
    }

    /// Word `k` of slot `i`.
    fn word(&self, i: usize, k: usize) -> &AtomicU64 {
        &self.0.first_words(i)[k]
    }

    /// `tgid`'s slot index, where it owns it.
    fn owned(&self, tgid: u32) -> Option<usize> {
        let i = tgid as usize & (self.0.len() - 1);
        (self.word(i, 0).load(Ordering::Acquire) == u64::from(tgid)).then_some(i)
    }

    /// `tgid`'s peak, where it owns a slot (its owner the same before and after the read).
    pub fn peak(&self, tgid: u32) -> Option<ProcPeak> {
        let i = self.owned(tgid)?;
        let slot = self.0.read(i);
        (slot.owner == u64::from(tgid) && self.owned(tgid) == Some(i)).then_some(slot.peak)
    }

    /// Writes `tgid`'s peak where it owns a slot; false where it has none (the map holds it).
    /// Only while no program counts for it.
    pub fn set_peak(&self, tgid: u32, peak: &ProcPeak) -> bool {
        let Some(i) = self.owned(tgid) else {
            return false;
        };
        // SAFETY: ProcPeak is plain integers, a multiple of 8 bytes (asserted above).
        let words: [u64; PEAK_WORDS] = unsafe { core::mem::transmute_copy(peak) };
        for (k, w) in words.iter().enumerate() {
            self.word(i, PEAK_WORD + k).store(*w, Ordering::Relaxed);
        }
        true
    }

    /// Gives `tgid` its slot where it is free (or its own already), from no peak; false where
    /// another owns it (its peak stays in the map). Only before the programs count for it (as
    /// the kernel claims at an exec or a fork): its peak must be in one place for its life.
    pub fn claim(&self, tgid: u32) -> bool {
        if tgid == 0 || self.0.is_empty() {
            return false;
        }
        let i = tgid as usize & (self.0.len() - 1);
        let owner = self.word(i, 0);
        if owner
            .compare_exchange(FREE, u64::from(tgid), Ordering::AcqRel, Ordering::Acquire)
            .is_err()
            && owner.load(Ordering::Acquire) != u64::from(tgid)
        {
            return false;
        }
        self.set_peak(tgid, &ProcPeak::ZERO)
    }

    /// Writes `tgid`'s unwind word (`heaptrace_common::proc_state::unwind_word`; 0: none)
    /// where it owns a slot.
    pub fn set_unwind(&self, tgid: u32, word: u64) {
        if let Some(i) = self.owned(tgid) {
            self.word(i, 1).store(word, Ordering::Release);
        }
    }

    /// Frees the slots of the processes `gone` accepts; returns how many.
    pub fn free_where(&self, gone: impl Fn(u32) -> bool) -> usize {
        self.free_if(|_, owner| gone(owner))
    }

    /// Frees the slots of processes that ended without a block ever counted (a followed fork
    /// that only exec'ed or exited): user space never hears of them, so `free_where` never
    /// would, and their slots would stay taken until their pids came back. Where a block was
    /// counted, the slot waits for `free_where`, after the peak's last read.
    pub fn free_unused(&self, alive: impl Fn(u32) -> bool) -> usize {
        self.free_if(|i, owner| {
            let peak = (PEAK_WORD..PEAK_WORD + PEAK_WORDS)
                .map(|k| self.word(i, k).load(Ordering::Acquire));
            let untouched = peak.zip(PEAK_ZERO).all(|(w, z)| w == z);
            untouched && !alive(owner)
        })
    }

    fn free_if(&self, gone: impl Fn(usize, u32) -> bool) -> usize {
        let mut freed = 0;
        for i in 0..self.0.len() {
            let word = self.word(i, 0);
            let owner = word.load(Ordering::Acquire);
            if owner == FREE || owner == BUSY || owner >> 32 != 0 || !gone(i, owner as u32) {
                continue;
            }
            if word
                .compare_exchange(owner, BUSY, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            for k in 1..size_of::<ProcState>() / 8 {
                self.word(i, k).store(0, Ordering::Relaxed);
            }
            word.store(FREE, Ordering::Release);
            freed += 1;
        }
        freed
    }
}

#[cfg(test)]
mod tests {
    use heaptrace_common::proc_state::unwind_word;

    use super::*;

    #[test]
    fn a_process_reads_and_frees_only_its_own_slot() {
        let mut slots = [ProcState::ZERO; 4];
        slots[1].owner = 5;
        slots[1].peak.max = 100;
        slots[2].owner = 6;
        let s = ProcStates::over(&mut slots);
        assert_eq!(s.peak(5).map(|p| p.max), Some(100));
        assert_eq!(s.peak(9), None, "slot 1 is 5's");
        assert_eq!(s.peak(7), None, "a free slot");
        let p = ProcPeak {
            max: 64,
            live: 32,
            ..ProcPeak::ZERO
        };
        assert!(s.set_peak(6, &p));
        assert!(!s.set_peak(10, &p), "slot 2 is 6's");
        assert_eq!(s.peak(6), Some(p));
        s.set_unwind(6, unwind_word(6, 3, 2));
        s.set_unwind(10, unwind_word(10, 4, 2));
        assert_eq!(s.free_where(|t| t == 6), 1);
        assert_eq!(s.peak(6), None);
        assert_eq!(s.peak(5).map(|p| p.max), Some(100));
        assert_eq!(slots[2], ProcState::ZERO, "freed slots are zeroed");
        assert_eq!(slots[1].unwind, 0);
    }

    #[test]
    fn slots_of_processes_gone_without_a_block_are_freed_alone() {
        let mut slots = [ProcState::ZERO; 4];
        let s = ProcStates::over(&mut slots);
        for p in [4, 5, 6] {
            assert!(s.claim(p));
        }
        let counted = ProcPeak {
            live: 64,
            max: 64,
            blocks: 1,
            max_blocks: 1,
            ..ProcPeak::ZERO
        };
        assert!(s.set_peak(5, &counted));
        // 4 and 5 ended; 6 lives. 5 counted a block: its peak is still to be read.
        assert_eq!(s.free_unused(|p| p == 6), 1);
        assert_eq!(s.peak(4), None);
        assert_eq!(s.peak(5), Some(counted));
        assert_eq!(s.peak(6), Some(ProcPeak::ZERO));
    }

    #[test]
    fn a_claim_takes_a_free_slot_from_no_peak_and_never_anothers() {
        let mut slots = [ProcState::ZERO; 4];
        slots[1].owner = 5;
        slots[3].peak.max = 77; // left by no one: a claim starts from no peak
        let s = ProcStates::over(&mut slots);
        assert!(!s.claim(9), "slot 1 is 5's");
        assert!(s.claim(5), "its own");
        assert!(s.claim(7));
        assert_eq!(s.peak(7), Some(ProcPeak::ZERO));
        assert!(!s.claim(11), "slot 3 is 7's now");
        assert!(!s.claim(0));
    }
}
