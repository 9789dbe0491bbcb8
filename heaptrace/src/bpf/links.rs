//! The links that hold heaptrace's uprobes on, and closing them all at once.
//!
//! Closing a link detaches its probes, and the kernel then waits for grace periods before the
//! close returns. Closing each link from a thread of its own lets those waits overlap.
use std::os::fd::OwnedFd;

use aya::programs::uprobe::UProbeLink;

/// Dropping either kind detaches it.
pub enum Link {
    Perf(UProbeLink),
    Multi(OwnedFd),
}

/// Upper bound on detaching threads: system-wide traces may probe several allocator files.
const DETACH_THREADS: usize = 32;

/// Closes the links from up to `DETACH_THREADS` threads. If a thread cannot be started, its
/// links are closed on this one: detaching must happen whatever else fails.
pub fn detach_all(links: Vec<Link>) {
    let threads = links.len().min(DETACH_THREADS);
    if threads <= 1 {
        drop(links);
        return;
    }
    let mut shares: Vec<Vec<Link>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, link) in links.into_iter().enumerate() {
        shares[i % threads].push(link);
    }
    std::thread::scope(|s| {
        for share in shares {
            let spawned = std::thread::Builder::new()
                .name("heaptrace-detach".into())
                .spawn_scoped(s, move || drop(share));
            // A failed spawn drops the closure, and with it the share, right here.
            drop(spawned);
        }
    });
}
