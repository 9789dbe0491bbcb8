//! Room in the kernel's row array (`--unwind-table-size`): each file's rows take one range,
//! found first-fit, given back when no traced process maps the file.

/// The free ranges (first row, rows), sorted and coalesced.
#[derive(Debug)]
pub struct RowSpace {
    free: Vec<(u32, u32)>,
}

impl RowSpace {
    pub fn new(rows: u32) -> RowSpace {
        RowSpace {
            free: if rows > 0 { vec![(0, rows)] } else { vec![] },
        }
    }

    /// The first row of a range of `n`, taken; None where no range is that long.
    pub fn take(&mut self, n: u32) -> Option<u32> {
        let i = self.free.iter().position(|&(_, len)| len >= n)?;
        let (first, len) = self.free[i];
        if len == n {
            self.free.remove(i);
        } else {
            self.free[i] = (first + n, len - n);
        }
        Some(first)
    }

    /// Gives back the `n` rows from `first`.
    pub fn give(&mut self, first: u32, n: u32) {
        let i = self.free.partition_point(|&(f, _)| f < first);
        self.free.insert(i, (first, n));
        // Coalesce with the next, then with the previous.
        if i + 1 < self.free.len() && first + n == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == first {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
    }

    /// Rows free in all.
    pub fn free_rows(&self) -> u64 {
        self.free.iter().map(|&(_, n)| u64::from(n)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_taken_first_fit_and_coalesce_when_given_back() {
        let mut s = RowSpace::new(100);
        assert_eq!(s.take(30), Some(0));
        assert_eq!(s.take(30), Some(30));
        assert_eq!(s.take(30), Some(60));
        assert_eq!(s.take(30), None, "10 left");
        s.give(30, 30);
        assert_eq!(s.take(40), None, "30 + 10, not together");
        s.give(0, 30);
        assert_eq!(s.take(50), Some(0), "0..60 coalesced");
        s.give(60, 30);
        s.give(0, 50);
        assert_eq!(s.free_rows(), 100);
        assert_eq!(s.take(100), Some(0), "all one range again");
        assert_eq!(RowSpace::new(0).take(1), None);
    }
}
