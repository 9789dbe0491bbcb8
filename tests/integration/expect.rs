//! What tests/fixtures/allocs.c calls, computed from its arguments: the oracle the traced
//! numbers must equal.
use std::collections::BTreeMap;

use serde_json::Value;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fn {
    pub calls: u64,
    pub bytes: u64,
    pub failed: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Expected {
    pub funcs: BTreeMap<&'static str, Fn>,
    pub free_calls: u64,
    pub free_bytes: u64,
    pub realloc_freed: u64,
    pub realloc_moved_or_in_place: u64,
    pub realloc_released_bytes: u64,
    /// (function, size) -> count.
    pub sizes: BTreeMap<(String, u64), u64>,
    pub live_blocks: u64,
    pub live_bytes: u64,
}

pub struct Fixture {
    /// Threads created with pthread_create (0: the work runs on the main thread).
    pub threads: u64,
    pub iterations: u64,
    pub leaks: u64,
    /// memalign probed apart from aligned_alloc (not one address in this allocator).
    pub memalign_apart: bool,
    /// pvalloc replaced by malloc(1081) ("nopvalloc").
    pub no_pvalloc: bool,
}

impl Fixture {
    /// The work on the main thread of a glibc process: no thread, memalign at aligned_alloc's
    /// address, pvalloc called.
    pub fn main_thread(iterations: u64, leaks: u64) -> Fixture {
        Fixture {
            threads: 0,
            iterations,
            leaks,
            memalign_apart: false,
            no_pvalloc: false,
        }
    }
}

impl Expected {
    fn add(&mut self, f: &'static str, calls: u64, bytes: u64, failed: u64) {
        let e = self.funcs.entry(f).or_default();
        e.calls += calls;
        e.bytes += bytes;
        e.failed += failed;
    }

    fn size(&mut self, f: &str, size: u64, n: u64) {
        if n > 0 {
            *self.sizes.entry((f.to_string(), size)).or_default() += n;
        }
    }

    /// The calls the fixture's own code makes (not libc's thread set-up).
    pub fn of(fx: &Fixture) -> Expected {
        let mut e = Expected::default();
        for f in [
            "malloc",
            "calloc",
            "realloc",
            "posix_memalign",
            "aligned_alloc",
            "valloc",
        ] {
            e.funcs.insert(f, Fn::default());
        }
        if fx.memalign_apart {
            e.funcs.insert("memalign", Fn::default());
        }
        if !fx.no_pvalloc {
            e.funcs.insert("pvalloc", Fn::default());
        }
        let n = fx.iterations * fx.threads.max(1);
        let workers = fx.threads.max(1);
        e.add("malloc", 2 * n, 1001 * n, n);
        e.size("malloc", 1001, n);
        e.add("calloc", n, 1011 * n, 0);
        e.size("calloc", 1011, n);
        e.add("realloc", 4 * n, (1021 + 4099) * n, n);
        e.size("realloc", 1021, n);
        e.size("realloc", 4099, n);
        e.realloc_freed = n;
        e.realloc_moved_or_in_place = n;
        e.realloc_released_bytes = (1021 + 1011) * n;
        e.add("posix_memalign", 2 * n, (1031 + 1033) * n, 0);
        e.size("posix_memalign", 1031, n);
        e.size("posix_memalign", 1033, n);
        if fx.memalign_apart {
            e.add("aligned_alloc", n, 1056 * n, 0);
            e.add("memalign", n, 1061 * n, 0);
            e.size("memalign", 1061, n);
        } else {
            e.add("aligned_alloc", 2 * n, (1056 + 1061) * n, 0);
            e.size("aligned_alloc", 1061, n);
        }
        e.size("aligned_alloc", 1056, n);
        e.add("valloc", n, 1071 * n, 0);
        e.size("valloc", 1071, n);
        if fx.no_pvalloc {
            e.add("malloc", n, 1081 * n, 0);
            e.size("malloc", 1081, n);
        } else {
            e.add("pvalloc", n, 1081 * n, 0);
            e.size("pvalloc", 1081, n);
        }
        e.free_calls = 8 * n;
        e.free_bytes = (1001 + 4099 + 1031 + 1033 + 1056 + 1061 + 1071 + 1081) * n;
        // Leaks: LEAKS x malloc(777) and one calloc(5, 111) per worker.
        e.add("malloc", fx.leaks * workers, 777 * fx.leaks * workers, 0);
        e.size("malloc", 777, fx.leaks * workers);
        e.add("calloc", workers, 555 * workers, 0);
        e.size("calloc", 555, workers);
        e.live_blocks = (fx.leaks + 1) * workers;
        e.live_bytes = (777 * fx.leaks + 555) * workers;
        e
    }

    /// glibc 2.36's pthread_create allocates the new thread's DTV with one calloc of
    /// (modules + 2) * 16 bytes: 272 for this fixture with only libc's TLS. The threads never
    /// exit, so those blocks stay live.
    pub fn with_glibc_threads(mut self, threads: u64, dtv: u64) -> Expected {
        self.add("calloc", threads, dtv * threads, 0);
        self.size("calloc", dtv, threads);
        self.live_blocks += threads;
        self.live_bytes += dtv * threads;
        self
    }

    /// What a JSON object (the document, or one of its processes) says, in the same shape.
    pub fn observed(doc: &Value, sizes: &Value, shape: &Expected) -> Expected {
        let f = &doc["functions"];
        let mut o = Expected::default();
        for name in shape.funcs.keys() {
            let v = &f[*name];
            o.funcs.insert(
                name,
                Fn {
                    calls: v["calls"].as_u64().unwrap_or_else(|| panic!("{name}: {v}")),
                    bytes: v["bytes"].as_u64().unwrap(),
                    failed: v["failed"].as_u64().unwrap(),
                },
            );
        }
        o.free_calls = f["free"]["calls"].as_u64().unwrap();
        o.free_bytes = f["free"]["bytes"].as_u64().unwrap();
        o.realloc_freed = f["realloc"]["freed"].as_u64().unwrap();
        o.realloc_moved_or_in_place =
            f["realloc"]["moved"].as_u64().unwrap() + f["realloc"]["in_place"].as_u64().unwrap();
        o.realloc_released_bytes = f["realloc"]["released_bytes"].as_u64().unwrap();
        o.sizes = Self::observed_sizes(sizes);
        o.live_blocks = doc["live"]["blocks"].as_u64().unwrap();
        o.live_bytes = doc["live"]["bytes"].as_u64().unwrap();
        o
    }

    /// What calls mode shows, in the same shape: what needs the live map (free's bytes,
    /// realloc's released bytes, live blocks and bytes) stays 0, as in [`Expected::calls_only`].
    pub fn observed_calls(doc: &Value, sizes: &Value, shape: &Expected) -> Expected {
        let f = &doc["functions"];
        let mut o = Expected::default();
        for name in shape.funcs.keys() {
            let v = &f[*name];
            let n = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{name}.{k}: {v}"));
            o.funcs.insert(
                name,
                Fn {
                    calls: n("calls"),
                    bytes: n("bytes"),
                    failed: n("failed"),
                },
            );
        }
        let r = &f["realloc"];
        o.free_calls = f["free"]["calls"].as_u64().unwrap();
        o.realloc_freed = r["freed"].as_u64().unwrap();
        o.realloc_moved_or_in_place =
            r["moved"].as_u64().unwrap() + r["in_place"].as_u64().unwrap();
        o.sizes = Self::observed_sizes(sizes);
        o
    }

    /// `self` without what calls mode cannot know (it keeps no live map).
    pub fn calls_only(&self) -> Expected {
        Expected {
            free_bytes: 0,
            realloc_released_bytes: 0,
            live_blocks: 0,
            live_bytes: 0,
            ..self.clone()
        }
    }

    /// A JSON size histogram (`sizes`) as (function, size) -> count.
    pub fn observed_sizes(sizes: &Value) -> BTreeMap<(String, u64), u64> {
        sizes
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                let key = (
                    s["function"].as_str().unwrap().to_string(),
                    s["size"].as_u64().unwrap(),
                );
                (key, s["count"].as_u64().unwrap())
            })
            .collect()
    }

    /// `self - base`, for runs whose runtime adds start-up allocations of its own.
    pub fn minus(&self, base: &Expected) -> Expected {
        let mut d = self.clone();
        for (k, v) in d.funcs.iter_mut() {
            let b = base.funcs.get(k).copied().unwrap_or_default();
            v.calls -= b.calls;
            v.bytes -= b.bytes;
            v.failed -= b.failed;
        }
        d.free_calls -= base.free_calls;
        d.free_bytes -= base.free_bytes;
        d.realloc_freed -= base.realloc_freed;
        d.realloc_moved_or_in_place -= base.realloc_moved_or_in_place;
        d.realloc_released_bytes -= base.realloc_released_bytes;
        for (k, v) in &base.sizes {
            let e = d.sizes.entry(k.clone()).or_default();
            *e -= v;
        }
        d.sizes.retain(|_, v| *v != 0);
        d.live_blocks -= base.live_blocks;
        d.live_bytes -= base.live_bytes;
        d
    }
}
