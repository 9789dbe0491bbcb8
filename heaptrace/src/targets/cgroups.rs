//! Cgroup v2 ids, as the kernel reports them, to the paths /proc/PID/cgroup shows: a process
//! can be gone before user space reads /proc, but its exec event carries its cgroup's id.
use std::{
    collections::HashMap,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

/// A miss walks the hierarchy again, at most this often (ids of cgroups made since the last
/// walk; a host without cgroup v2 never matches).
const RESCAN_EVERY: Duration = Duration::from_millis(200);

pub struct CgroupNames {
    /// Where the cgroup2 hierarchy is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified on a
    /// hybrid host); None without one.
    root: Option<PathBuf>,
    /// A cgroup's id is its directory's inode number in the cgroup2 file system.
    known: HashMap<u64, String>,
    last_scan: Option<Instant>,
}

impl Default for CgroupNames {
    fn default() -> Self {
        CgroupNames {
            root: cgroup2_mount(),
            known: HashMap::new(),
            last_scan: None,
        }
    }
}

/// The first cgroup2 mount in /proc/mounts.
fn cgroup2_mount() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    mounts.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        let (_, dir, fstype) = (f.next()?, f.next()?, f.next()?);
        (fstype == "cgroup2").then(|| PathBuf::from(dir))
    })
}

/// On a host with a v1 memory hierarchy: whether a cgroup of it (not its root) has a path
/// that contains `pattern`. None without one. Bounded: at most [`V1_DIRS`] directories.
pub fn v1_memory_matches(pattern: &str) -> Option<bool> {
    let root = v1_memory_mount()?;
    let mut todo = vec![root.clone()];
    let mut seen = 0;
    while let Some(dir) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            seen += 1;
            if seen > V1_DIRS {
                return Some(false);
            }
            let path = e.path();
            let rel = path.strip_prefix(&root).unwrap_or(&path);
            if format!("/{}", rel.display()).contains(pattern) {
                return Some(true);
            }
            todo.push(path);
        }
    }
    Some(false)
}

/// Where the v1 memory hierarchy is mounted (a v1-only or hybrid host), from /proc/mounts.
pub fn v1_memory_mount() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    mounts.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        let (_, dir, fstype, opts) = (f.next()?, f.next()?, f.next()?, f.next()?);
        (fstype == "cgroup" && opts.split(',').any(|o| o == "memory")).then(|| PathBuf::from(dir))
    })
}

/// The most directories of a v1 memory hierarchy looked at.
const V1_DIRS: usize = 100_000;

impl CgroupNames {
    /// The path of cgroup `id` ("/" for the root), if it can be found.
    pub fn path(&mut self, id: u64) -> Option<String> {
        if let Some(p) = self.known.get(&id) {
            return Some(p.clone());
        }
        if self.last_scan.is_none_or(|t| t.elapsed() >= RESCAN_EVERY) {
            self.rescan();
        }
        self.known.get(&id).cloned()
    }

    /// Walks the hierarchy again now.
    pub fn rescan(&mut self) {
        self.last_scan = Some(Instant::now());
        self.known.clear();
        if let Some(root) = self.root.clone()
            && let Ok(meta) = std::fs::metadata(&root)
        {
            self.walk(&root, &root, meta.dev());
        }
    }

    /// The cgroups found by the last walk: id and path.
    pub fn known(&self) -> impl Iterator<Item = (u64, &str)> {
        self.known.iter().map(|(id, p)| (*id, p.as_str()))
    }

    /// The root's `cgroup.stat` (counts of descendants, live and dying): it changes when a
    /// cgroup is made or removed anywhere below.
    pub fn root_stat(&self) -> Option<String> {
        std::fs::read_to_string(self.root.as_ref()?.join("cgroup.stat")).ok()
    }

    /// Whether the host has a cgroup2 hierarchy (else no cgroup has a path).
    pub fn has_hierarchy(&self) -> bool {
        self.root.is_some()
    }

    /// Every directory under `root` on its file system (`dev`): inode -> path.
    fn walk(&mut self, root: &Path, dir: &Path, dev: u64) {
        let Ok(meta) = std::fs::metadata(dir) else {
            return;
        };
        if meta.dev() != dev {
            return;
        }
        let rel = dir.strip_prefix(root).unwrap_or(Path::new(""));
        self.known
            .insert(meta.ino(), format!("/{}", rel.to_string_lossy()));
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                self.walk(root, &e.path(), dev);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_this_processs_cgroup_by_its_directorys_inode() {
        // The unified line itself: `procfs::cgroup` may give a v1 path on a hybrid host.
        let text = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        let Some(mine) = text
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .map(str::to_string)
        else {
            crate::say!("SKIPPED no cgroup v2 line in /proc/self/cgroup");
            return;
        };
        let Some(root) = cgroup2_mount() else {
            crate::say!("SKIPPED no cgroup2 mount");
            return;
        };
        let dir = root.join(mine.trim_start_matches('/'));
        let Ok(meta) = std::fs::metadata(&dir) else {
            crate::say!("SKIPPED {} not mounted", dir.display());
            return;
        };
        let mut names = CgroupNames::default();
        assert_eq!(names.path(meta.ino()), Some(mine));
        assert_eq!(names.path(u64::MAX), None);
    }

    /// What `probe::cgroup_filter` walks the hierarchy again on.
    #[test]
    fn the_roots_stat_changes_when_a_cgroup_is_made_and_removed() {
        let mut names = CgroupNames::default();
        // CI runs as root on a host with a cgroup2 hierarchy (the --cgroup tests need one).
        let ci = std::env::var_os("CI").is_some();
        let (Some(root), Some(before)) = (names.root.clone(), names.root_stat()) else {
            assert!(!ci, "no cgroup2 mount");
            crate::say!("SKIPPED no cgroup2 mount");
            return;
        };
        let dir = root.join(format!("heaptrace-unit-{}", std::process::id()));
        if let Err(e) = std::fs::create_dir(&dir) {
            assert!(!ci, "cannot make a cgroup: {e}");
            crate::say!("SKIPPED cannot make a cgroup ({e})");
            return;
        }
        let made = names.root_stat();
        names.rescan();
        let id = std::fs::metadata(&dir).unwrap().ino();
        let found = names.known().any(|(i, _)| i == id);
        std::fs::remove_dir(&dir).unwrap();
        assert!(found);
        assert_ne!(made.as_ref(), Some(&before));
        assert_ne!(names.root_stat(), made);
    }
}
