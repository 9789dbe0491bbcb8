use super::*;

/// Rows and entries in memory.
struct Memory {
    rows: Vec<Row>,
    entries: HashMap<u32, ProcModules>,
}

impl Store for Memory {
    fn capacity(&self) -> u32 {
        self.rows.len() as u32
    }
    fn write_rows(&mut self, first: u32, rows: &[Row]) -> bool {
        self.rows[first as usize..][..rows.len()].copy_from_slice(rows);
        true
    }
    fn set_entry(&mut self, pid: u32, entry: &ProcModules) {
        self.entries.insert(pid, *entry);
    }
    fn remove_entry(&mut self, pid: u32) {
        self.entries.remove(&pid);
    }
}

fn tables(rows: usize) -> Tables {
    Tables::new(Box::new(Memory {
        rows: vec![Row::default(); rows],
        entries: HashMap::new(),
    }))
}

/// This process's mappings, as the daemon reads a traced one's.
fn own_maps() -> (u32, String) {
    let pid = std::process::id();
    (pid, std::fs::read_to_string("/proc/self/maps").unwrap())
}

/// A process that ends leaves its files' rows in place: the next one that maps them
/// (a compile loop's next compiler) gets them without reading them again.
#[test]
fn files_no_process_maps_keep_their_rows_for_the_next() {
    let (pid, maps) = own_maps();
    let mut t = tables(1 << 22);
    t.sync(pid, &maps);
    let (read, rows) = (t.stats.read, t.stats.rows);
    assert!(rows > 0, "{:?}", t.stats);
    t.forget(pid);
    assert_eq!(t.stats.rows, rows, "idle files keep their rows");
    t.sync(pid, &maps);
    assert_eq!(t.stats.read, read, "nothing read again: {:?}", t.stats);
    assert!(t.stats.reused > 0);
    assert_eq!(t.free_rows(), (1 << 22) - rows);
}

/// Idle files give their rows back, the longest idle first, when a new table needs them:
/// this test binary's rows go idle, then the libraries' need more room than is left free.
#[test]
fn idle_rows_are_given_back_when_a_new_table_needs_them() {
    let (pid, maps) = own_maps();
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    let exe = exe.to_str().unwrap();
    let (own, libs): (Vec<&str>, Vec<&str>) = maps.lines().partition(|l| l.ends_with(exe));
    let (own, libs) = (own.join("\n") + "\n", libs.join("\n") + "\n");
    let rows_of = |m: &str| {
        let mut t = tables(1 << 24);
        t.sync(pid, m);
        t.stats.rows as usize
    };
    let (a, b) = (rows_of(&own), rows_of(&libs));
    assert!(a > b && b > 0, "this binary {a} rows, its libraries {b}");
    // Room for either set alone, not both.
    let mut t = tables(a + b / 2);
    t.sync(pid, &own);
    assert_eq!((t.stats.no_room, t.stats.rows as usize), (0, a));
    t.forget(pid);
    t.sync(pid, &libs);
    assert_eq!(t.stats.no_room, 0, "{:?}", t.stats);
    assert_eq!(
        t.stats.rows as usize, b,
        "the idle binary's rows given back"
    );
    assert_eq!(t.stats.reused, 0);
}

#[test]
fn code_mappings_are_the_executable_file_mappings() {
    let maps = "55d0c0000000-55d0c0001000 r--p 00000000 fe:01 11 /bin/prog\n\
                55d0c0001000-55d0c0003000 r-xp 00001000 fe:01 11 /bin/prog\n\
                7f0000000000-7f0000001000 r-xp 00000000 00:00 0 \n\
                7f1000000000-7f1000020000 r-xp 00028000 103:02 2 /lib/libc.so.6 (deleted)\n\
                7ffd00000000-7ffd00021000 r-xp 00000000 00:00 0 [vdso]\n";
    let code = code_mappings(maps);
    assert_eq!(code.len(), 2, "{code:?}");
    assert_eq!(code[0].start, 0x55d0c0001000);
    assert_eq!(code[0].offset, 0x1000);
    assert_eq!(
        code[1].file,
        FileKey {
            dev: 0x103 << 32 | 2,
            inode: 2
        }
    );
}

/// The exec watch's reader writes an entry only where no file needs reading: a process
/// mapping a file never read is left to the daemon; once its files are known, the next
/// process mapping them gets its entry at once, nothing read.
#[test]
fn sync_known_reads_no_file() {
    let (pid, maps) = own_maps();
    let mut t = tables(1 << 22);
    assert!(!t.sync_known(pid, &maps));
    assert_eq!(t.stats.read, 0, "{:?}", t.stats);
    t.sync(pid, &maps);
    let read = t.stats.read;
    t.forget(pid);
    assert!(t.sync_known(pid + 1, &maps));
    assert_eq!(t.stats.read, read, "nothing read again: {:?}", t.stats);
}

/// A read between an exec and its loader's mapping of the libraries writes no entry (one
/// without them would walk their frames by frame pointer, uncounted); static and musl
/// programs have no glibc loader to wait for.
#[test]
fn no_entry_before_the_loader_has_mapped_libc() {
    let exe = "00400000-00401000 r-xp 00001000 08:01 11 /usr/bin/cc1plus\n";
    let ld = "7f0000001000-7f0000002000 r-xp 00001000 08:01 12 /usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2\n";
    let libc =
        "7f0000101000-7f0000102000 r-xp 00028000 08:01 13 /usr/lib/x86_64-linux-gnu/libc.so.6\n";
    assert!(!loader_done(&format!("{exe}{ld}")));
    assert!(loader_done(&format!("{exe}{ld}{libc}")));
    assert!(loader_done(exe), "static");
    let musl = "7f0000001000-7f0000002000 r-xp 00001000 08:01 14 /lib/ld-musl-x86_64.so.1\n";
    assert!(loader_done(&format!("{exe}{musl}")));
    let mut t = tables(1 << 10);
    t.sync(1, &format!("{exe}{ld}"));
    assert_eq!(t.stats.read, 0, "{:?}", t.stats);
}

type Shared<T> = std::sync::Arc<std::sync::Mutex<T>>;

/// Entries and files' rows by identity, kept where the test reads them.
#[derive(Default)]
struct Recorder {
    entries: Shared<HashMap<u32, ProcModules>>,
    files: Shared<HashMap<FileRowsKey, FileRows>>,
}

impl Store for Recorder {
    fn capacity(&self) -> u32 {
        1 << 22
    }
    fn write_rows(&mut self, _first: u32, _rows: &[Row]) -> bool {
        true
    }
    fn set_entry(&mut self, pid: u32, entry: &ProcModules) {
        self.entries.lock().unwrap().insert(pid, *entry);
    }
    fn remove_entry(&mut self, pid: u32) {
        self.entries.lock().unwrap().remove(&pid);
    }
    fn set_file(&mut self, key: FileRowsKey, rows: Option<FileRows>) {
        let mut files = self.files.lock().unwrap();
        match rows {
            Some(r) => files.insert(key, r),
            None => files.remove(&key),
        };
    }
}

/// Each file with rows is found by its identity too, and a mapping's bias worked out the
/// kernel's way from it (start less file offset less `delta`, `vma.rs`) is the entry's.
#[test]
fn a_file_s_rows_by_identity_give_the_entry_s_bias() {
    let (pid, maps) = own_maps();
    let store = Recorder::default();
    let (entries, shared) = (store.entries.clone(), store.files.clone());
    let mut t = Tables::new(Box::new(store));
    t.sync(pid, &maps);
    let entry = entries.lock().unwrap()[&pid];
    let files = shared.lock().unwrap();
    let mut checked = 0;
    for m in code_mappings(&maps) {
        let Some(module) = entry.modules[..entry.count as usize]
            .iter()
            .find(|e| e.start == m.start && e.rows > 0)
        else {
            continue;
        };
        let rows = files[&file_rows_key(m.file)];
        assert_eq!((rows.first, rows.rows), (module.first, module.rows));
        let bias = m.start.wrapping_sub(m.offset).wrapping_sub(rows.delta);
        assert_eq!(bias, module.bias, "{m:?}");
        checked += 1;
    }
    assert!(checked > 0, "{maps}");
    // Given back (evicted), a file's rows are no longer found by identity.
    let some = *t
        .files
        .keys()
        .find(|k| files.contains_key(&file_rows_key(**k)))
        .unwrap();
    drop(files);
    t.evict(some);
    assert!(!shared.lock().unwrap().contains_key(&file_rows_key(some)));
}

/// A pid no process has: its `/proc/PID/map_files` is not there, as for a process gone.
const GONE: u32 = u32::MAX - 1;

/// The files of `maps`, opened here, as a caller that holds them passes them.
fn opened_files(maps: &str) -> (Vec<std::fs::File>, Vec<Opened>) {
    use std::os::fd::AsRawFd as _;
    let mut held = Vec::new();
    let mut opened = Vec::new();
    for line in maps.lines().filter(|l| l.contains(" r-xp ")) {
        let Some(path) = line
            .split_whitespace()
            .nth(5)
            .filter(|p| p.starts_with('/'))
        else {
            continue;
        };
        let f = std::fs::File::open(path).unwrap();
        let meta = f.metadata().unwrap();
        opened.push(Opened {
            dev: u64::from(libc::major(meta.dev())) << 32 | u64::from(libc::minor(meta.dev())),
            inode: meta.ino(),
            path: format!("/proc/self/fd/{}", f.as_raw_fd()).into(),
        });
        held.push(f);
    }
    (held, opened)
}

/// A process gone before its files were read: read through the descriptors the caller holds
/// (the exec watch opened them at the exec), where `map_files` has nothing any more.
#[test]
fn a_gone_process_s_files_are_read_through_those_held() {
    let (_, maps) = own_maps();
    let mut t = tables(1 << 22);
    t.sync(GONE, &maps);
    assert_eq!(t.stats.rows, 0, "{:?}", t.stats);
    assert!(t.stats.unusable > 0, "{:?}", t.stats);
    let (_held, opened) = opened_files(&maps);
    let mut t = tables(1 << 22);
    t.sync_with(GONE, &maps, &opened);
    assert!(t.stats.rows > 0, "{:?}", t.stats);
    assert_eq!(t.stats.unusable, 0, "{:?}", t.stats);
}

/// An idle file is not given back because a process gone cannot show it is the same file:
/// the loader thread syncs processes of a few milliseconds (`as`) after their end, and each
/// of them read their libraries again.
#[test]
fn an_idle_file_stays_where_a_gone_process_cannot_tell() {
    let (pid, maps) = own_maps();
    let mut t = tables(1 << 22);
    t.sync(pid, &maps);
    t.forget(pid);
    let (read, rows) = (t.stats.read, t.stats.rows);
    t.sync(GONE, &maps);
    assert_eq!((t.stats.read, t.stats.rows), (read, rows), "{:?}", t.stats);
}

/// Tables read away from the lock (`to_read`, then `admit`): each file once, whichever
/// read comes second is dropped, and the process's entry then takes no reading.
#[test]
fn tables_read_away_from_the_lock_go_in_once() {
    let (pid, maps) = own_maps();
    let mut t = tables(1 << 22);
    let first: Vec<Built> = t
        .to_read(pid, &maps, &[])
        .into_iter()
        .map(ToRead::read)
        .collect();
    let again: Vec<Built> = t
        .to_read(pid, &maps, &[])
        .into_iter()
        .map(ToRead::read)
        .collect();
    assert!(!first.is_empty());
    let n = first.len() as u32;
    for b in first.into_iter().chain(again) {
        t.admit(b);
    }
    assert_eq!(t.stats.read, n, "{:?}", t.stats);
    assert!(t.to_read(pid, &maps, &[]).is_empty());
    assert!(t.sync_known(pid, &maps));
    assert_eq!(t.stats.read, n, "{:?}", t.stats);
    assert!(t.to_read(pid, "", &[]).is_empty());
}
