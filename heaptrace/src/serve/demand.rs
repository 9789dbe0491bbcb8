//! Whether anyone reads the snapshots: the daemon builds one a round only while a client has
//! asked within `WANTED_FOR`, and the first request after a quiet spell waits for the next
//! round rather than reading the last one built, which may be minutes old.
use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

/// How long after a request the rounds keep building snapshots: longer than any usual scrape
/// interval, so a steady scraper never waits.
pub const WANTED_FOR: Duration = Duration::from_secs(120);

pub struct Demand {
    start: Instant,
    /// Until when (milliseconds since `start`) snapshots are wanted; 0 until the first request.
    until_ms: AtomicU64,
}

impl Demand {
    pub fn new() -> Demand {
        Demand {
            start: Instant::now(),
            until_ms: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// A request that reads snapshots for `extra` beyond now (a delta profile's seconds).
    /// Returns whether snapshots were already wanted, that is whether the latest is fresh.
    pub fn ask(&self, extra: Duration) -> bool {
        let now = self.now_ms();
        let until = now + (WANTED_FOR + extra).as_millis() as u64;
        let before = self.until_ms.fetch_max(until, Ordering::Relaxed);
        before != 0 && before >= now
    }

    pub fn wanted(&self) -> bool {
        let until = self.until_ms.load(Ordering::Relaxed);
        until != 0 && until >= self.now_ms()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wanted_only_after_a_request_and_until_it_lapses() {
        let d = Demand::new();
        assert!(!d.wanted());
        assert!(
            !d.ask(Duration::ZERO),
            "the first request finds nothing fresh"
        );
        assert!(d.wanted());
        assert!(d.ask(Duration::ZERO), "the next one finds rounds building");
        // Lapsed: as if the last request were longer ago than WANTED_FOR.
        d.until_ms.store(1, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(5));
        assert!(!d.wanted());
        assert!(!d.ask(Duration::from_secs(300)));
        let until = d.until_ms.load(Ordering::Relaxed);
        assert!(until >= (WANTED_FOR + Duration::from_secs(300)).as_millis() as u64);
    }
}
