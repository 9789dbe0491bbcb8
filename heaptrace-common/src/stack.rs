//! Stored user stacks, as both sides see them: the programs walk a stack and store it under an
//! id drawn from its hash (`heaptrace-ebpf/src/stacks.rs`); user space reads it by that id.
//!
//! A stack's id is 30 bits of its 64-bit hash, or where another stack holds that id, 30 other
//! bits. The hash is stored with the frames and tells the two apart, so a stack never takes
//! another's id. A stack finds no id only when both of its ids are held by other stacks: with
//! 16,384 stacks held, about one new stack in 2^32.

/// Return addresses a stored stack holds (the kernel's PERF_MAX_STACK_DEPTH).
pub const STACK_FRAMES: usize = 127;

/// Not an address: the last "frame" of a stack cut at a file whose unwind rows found no room
/// in `--unwind-table-size` (the kernel stops there rather than follow frame pointers the
/// file does not keep, which would read junk into frames that make every stack new).
pub const NO_ROOM_FRAME: u64 = u64::MAX - 1;

/// Ids of stored stacks are below this; ids of one-frame stacks (the caller alone, where no
/// whole stack could be stored) are this plus their bucket in the callers' map.
pub const CALLER_ID_BASE: u32 = 1 << 30;

const ID_MASK: u64 = (CALLER_ID_BASE - 1) as u64;

/// A user stack as the programs store it (the `FRAMES` map, keyed by its id, until user space
/// reads it; `STACK_OWNERS` keeps which hash holds the id): its hash, and
/// its return addresses, innermost first, a zero after the last (unless all 127 are taken),
/// then whatever an earlier, deeper stack left there.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoredStack {
    pub hash: u64,
    pub ips: [u64; STACK_FRAMES],
}

const _: () = assert!(core::mem::size_of::<StoredStack>() == 8 * (1 + STACK_FRAMES));

impl StoredStack {
    /// The return addresses, up to the first zero.
    pub fn frames(&self) -> &[u64] {
        let n = self
            .ips
            .iter()
            .position(|&ip| ip == 0)
            .unwrap_or(STACK_FRAMES);
        &self.ips[..n]
    }
}

/// The hash before any frame.
pub const HASH_START: u64 = 0x9e37_79b9_7f4a_7c15;

/// The hash after one more return address (FNV's prime, and a rotation so that high address
/// bits reach the low ones).
#[inline(always)]
pub fn hash_step(h: u64, ip: u64) -> u64 {
    (h ^ ip).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(29)
}

/// The stack's hash from its frames' (`hash_step`) and its depth: splitmix64's finalizer, so
/// that every bit of both ids depends on every frame.
#[inline(always)]
pub fn hash_finish(h: u64, depth: u64) -> u64 {
    let mut h = h ^ depth;
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The two ids a stack of this hash may take, first choice first.
#[inline(always)]
pub fn ids(hash: u64) -> [u32; 2] {
    [(hash & ID_MASK) as u32, ((hash >> 32) & ID_MASK) as u32]
}

/// The stack cache: which of its two ids a stack recently found in STACK_OWNERS has, so that a
/// stack seen before costs no STACK_OWNERS lookup (about 70 ns of program time per allocation here,
/// BENCHMARKS.md). A row of words per CPU, each holding a stack's hash but its low 16 bits,
/// the cache's generation when it was written, and the id's choice (first or second).
///
/// User space frees stacks of processes gone (deletes STACK_OWNERS entries), and a word naming a
/// freed id must never be taken again: after deleting, user space moves the generation on, and
/// a word counts only in the generation it was written in. A program reads the generation
/// before it looks in STACK_OWNERS, so a word it writes after finding a stack that was deleted
/// meanwhile carries the generation before the move. User space also moves it on every round,
/// so that no word lives longer than a round whatever it names.
pub const CACHE_GEN_MASK: u64 = 0x7fff;

/// A cache word: the hash's high 48 bits, the generation, the choice.
#[inline(always)]
pub fn cache_word(hash: u64, generation: u64, choice: u32) -> u64 {
    (hash & !0xffff) | ((generation & CACHE_GEN_MASK) << 1) | u64::from(choice & 1)
}

/// The choice a cache word gives the stack of `hash` in this generation, if it is that
/// stack's. Two stacks alike in their hash's high 48 bits would take each other's words:
/// about one pair in 2^48.
#[inline(always)]
pub fn cache_choice(word: u64, hash: u64, generation: u64) -> Option<usize> {
    if word != 0 && word & !1 == cache_word(hash, generation, 0) {
        Some((word & 1) as usize)
    } else {
        None
    }
}

/// The word's generation.
pub fn cache_generation(word: u64) -> u64 {
    (word >> 1) & CACHE_GEN_MASK
}

/// The index of `hash`'s word on `cpu`, in a cache of `1 << shift` words a CPU.
#[inline(always)]
pub fn cache_index(cpu: u32, hash: u64, shift: u32) -> u32 {
    (cpu << shift) | ((hash >> 16) as u32 & ((1 << shift) - 1))
}

/// log2 of the cache words a CPU for a stack map of `stack_map_size` stacks: a quarter of
/// it, a power of two from 1 to 16,384.
pub fn cache_shift(stack_map_size: u32) -> u32 {
    let want = (stack_map_size / 4).clamp(1, 1 << 14);
    31 - want.leading_zeros()
}

#[cfg(test)]
mod tests {
    use super::*;
    extern crate std;

    /// The hash of a whole stack, as the programs compute it while walking.
    fn hash(frames: &[u64]) -> u64 {
        let h = frames.iter().fold(HASH_START, |h, &ip| hash_step(h, ip));
        hash_finish(h, frames.len() as u64)
    }

    #[test]
    fn frames_end_at_the_first_zero() {
        let mut s = StoredStack {
            hash: 1,
            ips: [0; STACK_FRAMES],
        };
        assert!(s.frames().is_empty());
        s.ips[..3].copy_from_slice(&[0x401000, 0x401234, 0x7f00_0000_1000]);
        assert_eq!(s.frames(), [0x401000, 0x401234, 0x7f00_0000_1000]);
        s.ips = [7; STACK_FRAMES];
        assert_eq!(s.frames().len(), STACK_FRAMES);
    }

    /// Ids stay below the callers' and the two choices differ; stacks that differ in one
    /// frame, in order or in depth (a prefix) get other hashes.
    #[test]
    fn ids_come_from_the_whole_stack() {
        let base = [0x5555_5555_5149u64, 0x5555_5555_51a0, 0x7f12_3456_7249];
        let variants: [&[u64]; 5] = [
            &base,
            &[base[0], base[1] + 5, base[2]],
            &[base[1], base[0], base[2]],
            &base[..2],
            &[base[0], base[1], base[2], 0x5555_5555_5000],
        ];
        let hashes: std::collections::HashSet<u64> = variants.iter().map(|v| hash(v)).collect();
        assert_eq!(hashes.len(), variants.len());
        for h in hashes {
            let [a, b] = ids(h);
            assert!(a < CALLER_ID_BASE && b < CALLER_ID_BASE);
            assert_ne!(a, b, "{h:#x}");
        }
    }

    /// Call sites a few bytes apart in one function, as an allocation loop's: 100,000 stacks
    /// of depth 3 take distinct ids with one choice at most a few times (2^30 ids).
    #[test]
    fn neighbouring_call_sites_spread_over_the_ids() {
        let mut first = std::collections::HashSet::new();
        let mut both = std::collections::HashSet::new();
        let (mut clashes, mut lost) = (0, 0);
        for i in 0..100_000u64 {
            let h = hash(&[0x5555_5555_0000 + 4 * i, 0x5555_5555_9000, 0x7fff_0000_1234]);
            let [a, b] = ids(h);
            if !first.insert(a) {
                clashes += 1;
            }
            if !both.insert(a) && !both.insert(b) {
                lost += 1;
            }
        }
        // 100,000 ids in 2^30: about 4.7 first-choice clashes are expected.
        assert!(clashes <= 20, "{clashes}");
        assert_eq!(lost, 0);
    }

    #[test]
    fn a_cache_word_holds_in_its_generation_only() {
        let h = 0x1234_5678_9abc_def0;
        let w = cache_word(h, 7, 1);
        assert_eq!(cache_choice(w, h, 7), Some(1));
        assert_eq!(cache_choice(cache_word(h, 7, 0), h, 7), Some(0));
        assert_eq!(cache_choice(w, h, 8), None, "another generation");
        assert_eq!(cache_choice(w, h ^ (1 << 40), 7), None, "another stack");
        // The hash's low 16 bits are not kept: a stack differing there alone takes the word.
        assert_eq!(cache_choice(w, h ^ 0xff, 7), Some(1));
        assert_eq!(cache_choice(0, 0, 0), None, "an empty word");
        assert_eq!(cache_generation(w), 7);
        assert_eq!(cache_generation(cache_word(h, CACHE_GEN_MASK + 3, 0)), 2);
    }

    #[test]
    fn cache_rows_are_a_quarter_of_the_stack_map() {
        assert_eq!(cache_shift(16384), 12);
        assert_eq!(cache_shift(1 << 20), 14);
        assert_eq!(cache_shift(2), 0);
        assert_eq!(cache_index(1, 0xabcd_0000, 4), 16 + 0xd);
    }
}
