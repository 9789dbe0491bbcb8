//! A site's power-of-two histogram (its sizes, its blocks' lifetimes) kept sparse: only the
//! buckets that are not zero. A trace of a busy host holds hundreds of thousands of sites, each
//! in the last snapshot, the new one and the Profile; dense, their two histograms were 512 of
//! a site's 576 bytes. Serialized as the dense array was: recordings do not change.
use heaptrace_common::LOG2_BUCKETS;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::round::Log2;

const _: () = assert!(LOG2_BUCKETS <= 32);

#[derive(Clone, Default, PartialEq, Eq)]
pub struct Buckets {
    /// Bit b: bucket b is not zero, its count at `counts[b's rank among the bits]`.
    mask: u32,
    counts: Box<[u64]>,
}

static ZERO: u64 = 0;

impl Buckets {
    pub fn from_dense(d: &Log2) -> Buckets {
        let mask = d
            .iter()
            .enumerate()
            .filter(|(_, n)| **n != 0)
            .fold(0u32, |m, (b, _)| m | 1 << b);
        let counts = d.iter().copied().filter(|n| *n != 0).collect();
        Buckets { mask, counts }
    }

    pub fn dense(&self) -> Log2 {
        std::array::from_fn(|b| self.get(b))
    }

    pub fn get(&self, b: usize) -> u64 {
        self.slot(b).map_or(0, |i| self.counts[i])
    }

    /// Where bucket `b`'s count is, if it is not zero.
    fn slot(&self, b: usize) -> Option<usize> {
        let bit = 1u32.checked_shl(u32::try_from(b).ok()?)?;
        (self.mask & bit != 0).then(|| (self.mask & (bit - 1)).count_ones() as usize)
    }

    /// The buckets that are not zero, lowest first: (bucket, count).
    pub fn iter(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        bits(self.mask).zip(self.counts.iter().copied())
    }

    pub fn is_empty(&self) -> bool {
        self.mask == 0
    }

    pub fn sum(&self) -> u64 {
        self.counts.iter().fold(0u64, |a, n| a.wrapping_add(*n))
    }

    /// Bucket by bucket `op(self's, other's)`, over the buckets either has; `op(0, 0)` must
    /// be 0 (wrapping add and subtract, as `SiteTotals` uses it).
    pub fn zip(&self, other: &Buckets, op: impl Fn(u64, u64) -> u64) -> Buckets {
        // Adding or taking away nothing: no new allocation.
        if other.mask == 0 && op(1, 0) == 1 {
            return self.clone();
        }
        let (mut mask, mut counts) = (0u32, Vec::new());
        for b in bits(self.mask | other.mask) {
            let n = op(self.get(b), other.get(b));
            if n != 0 {
                mask |= 1 << b;
                counts.push(n);
            }
        }
        Buckets {
            mask,
            counts: counts.into_boxed_slice(),
        }
    }

    /// `zip` in place, with no new allocation where `other`'s buckets are among `self`'s;
    /// `op(n, 0)` must be `n` too.
    pub fn combine(&mut self, other: &Buckets, op: impl Fn(u64, u64) -> u64) {
        if other.mask & !self.mask != 0 {
            *self = self.zip(other, op);
            return;
        }
        let mut emptied = false;
        for (b, n) in other.iter() {
            let i = (self.mask & ((1u32 << b) - 1)).count_ones() as usize;
            self.counts[i] = op(self.counts[i], n);
            emptied |= self.counts[i] == 0;
        }
        if emptied {
            *self = Buckets::from_dense(&self.dense());
        }
    }

    /// Sets bucket `b` to `n`; nothing past the last bucket.
    pub fn set(&mut self, b: usize, n: u64) {
        if b >= LOG2_BUCKETS {
            return;
        }
        let bit = 1u32 << b;
        let i = (self.mask & (bit - 1)).count_ones() as usize;
        match (self.mask & bit != 0, n != 0) {
            (true, true) => self.counts[i] = n,
            (false, false) => {}
            (had, _) => {
                let mut v = std::mem::take(&mut self.counts).into_vec();
                if had {
                    v.remove(i);
                } else {
                    v.insert(i, n);
                }
                self.counts = v.into_boxed_slice();
                self.mask ^= bit;
            }
        }
    }
}

fn bits(mask: u32) -> impl Iterator<Item = usize> {
    (0..LOG2_BUCKETS).filter(move |b| mask & 1 << b != 0)
}

impl std::ops::Index<usize> for Buckets {
    type Output = u64;

    fn index(&self, b: usize) -> &u64 {
        self.slot(b).map_or(&ZERO, |i| &self.counts[i])
    }
}

impl std::fmt::Debug for Buckets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl Serialize for Buckets {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.dense().serialize(s)
    }
}

impl<'de> Deserialize<'de> for Buckets {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Buckets, D::Error> {
        Ok(Buckets::from_dense(&Log2::deserialize(d)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_buckets_not_zero_are_kept_and_read_back_as_dense() {
        let mut d = [0u64; LOG2_BUCKETS];
        d[3] = 7;
        d[31] = 1;
        let b = Buckets::from_dense(&d);
        assert_eq!(b.counts.len(), 2);
        assert_eq!((b[3], b[4], b[31], b.get(40)), (7, 0, 1, 0));
        assert_eq!(b.dense(), d);
        assert_eq!(b.iter().collect::<Vec<_>>(), [(3, 7), (31, 1)]);
        assert_eq!(b.sum(), 8);
    }

    #[test]
    fn zip_goes_over_either_s_buckets_and_drops_zeros() {
        let mut a = Buckets::default();
        a.set(2, 5);
        a.set(9, 1);
        let mut b = Buckets::default();
        b.set(9, 1);
        b.set(12, 4);
        let sum = a.zip(&b, u64::wrapping_add);
        assert_eq!(sum.iter().collect::<Vec<_>>(), [(2, 5), (9, 2), (12, 4)]);
        let diff = sum.zip(&a, u64::wrapping_sub);
        assert_eq!(diff, b);
        assert!(a.zip(&a, u64::wrapping_sub).is_empty());
        assert_eq!(a.zip(&Buckets::default(), u64::wrapping_add), a);
    }

    #[test]
    fn combine_is_zip_in_place() {
        let a = Buckets::from_dense(&std::array::from_fn(|b| [0, 3, 5].contains(&b) as u64 * 7));
        let some = Buckets::from_dense(&std::array::from_fn(|b| (b == 3) as u64 * 2));
        let more = Buckets::from_dense(&std::array::from_fn(|b| (b == 4) as u64));
        // Bucket 3 wraps to zero when added: gone.
        let wraps = Buckets::from_dense(&std::array::from_fn(|b| (b == 3) as u64 * (u64::MAX - 6)));
        let mut c = a.clone();
        c.combine(&wraps, u64::wrapping_add);
        assert_eq!(
            c.iter().collect::<Vec<_>>(),
            [(0, 7), (5, 7)],
            "wrapped to zero: gone"
        );
        for other in [&some, &more, &a, &wraps, &Buckets::default()] {
            for op in [u64::wrapping_add, u64::wrapping_sub] {
                let mut c = a.clone();
                c.combine(other, op);
                assert_eq!(c, a.zip(other, op));
            }
        }
    }

    #[test]
    fn set_keeps_the_buckets_not_zero_in_order() {
        let mut a = Buckets::default();
        a.set(9, 1);
        a.set(2, 5);
        a.set(40, 1);
        assert_eq!(a.iter().collect::<Vec<_>>(), [(2, 5), (9, 1)]);
        a.set(2, 0);
        assert_eq!(a.iter().collect::<Vec<_>>(), [(9, 1)], "zero: gone");
        a.set(9, 0);
        assert_eq!(a, Buckets::default());
    }

    #[test]
    fn serialized_as_the_dense_array() {
        let mut d = [0u64; LOG2_BUCKETS];
        d[5] = 300;
        let b = Buckets::from_dense(&d);
        let bytes = postcard::to_allocvec(&b).unwrap();
        assert_eq!(bytes, postcard::to_allocvec(&d).unwrap());
        assert_eq!(postcard::from_bytes::<Buckets>(&bytes).unwrap(), b);
        let json = serde_json::to_string(&b).unwrap();
        assert_eq!(json, serde_json::to_string(&d).unwrap());
    }
}
