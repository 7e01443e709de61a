//! The seeded generator every choice of a run is drawn from.

use crate::common::XorShift;

pub struct Rng(XorShift);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(XorShift::new(seed))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0.below(n)
    }

    /// Uniform in `lo..hi` (lo < hi).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo)
    }

    pub fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }

    pub fn pick<'a, T>(&mut self, of: &'a [T]) -> &'a T {
        &of[self.below(of.len() as u64) as usize]
    }
}
