//! Stored user stacks, as both sides see them: the programs walk a stack and store it under an
//! id drawn from its hash (`heaptrace-ebpf/src/stacks.rs`); user space reads it by that id.
//!
//! A stack's id is 30 bits of its 64-bit hash, or where another stack holds that id, 30 other
//! bits. The hash is stored with the frames and tells the two apart, so a stack never takes
//! another's id. A stack finds no id only when both of its ids are held by other stacks: with
//! 16,384 stacks held, about one new stack in 2^32.

/// Return addresses a stored stack holds (the kernel's PERF_MAX_STACK_DEPTH).
pub const STACK_FRAMES: usize = 127;

/// Ids of stored stacks are below this; ids of one-frame stacks (the caller alone, where no
/// whole stack could be stored) are this plus their bucket in the callers' map.
pub const CALLER_ID_BASE: u32 = 1 << 30;

const ID_MASK: u64 = (CALLER_ID_BASE - 1) as u64;

/// A user stack as the programs store it (the `FRAMES` map, keyed by its id): its hash, and
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
}
