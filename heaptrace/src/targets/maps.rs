//! The file mappings of /proc/PID/maps: where each file is mapped, and which file it is.
use std::path::PathBuf;

use crate::targets::target_file::FileId;

/// One file-backed mapping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapsEntry {
    pub start: u64,
    pub end: u64,
    /// File offset of `start`.
    pub offset: u64,
    pub exec: bool,
    /// The file mapped: what an open of its path must find.
    pub id: FileId,
    /// Its path as the process sees it, without " (deleted)".
    pub path: PathBuf,
    /// The file was deleted (or renamed over) since it was mapped.
    pub deleted: bool,
}

/// The file mappings of a maps file (anonymous ones and [vdso]-like ones left out); a line
/// that does not parse is skipped.
pub fn parse(maps: &str) -> Vec<MapsEntry> {
    maps.lines().filter_map(entry).collect()
}

fn entry(line: &str) -> Option<MapsEntry> {
    let mut cols = line.splitn(6, ' ');
    let range = cols.next()?;
    let perms = cols.next()?;
    let offset = cols.next()?;
    let dev = cols.next()?;
    let ino = cols.next()?;
    let path = cols.next()?.trim_start();
    if !path.starts_with('/') {
        return None;
    }
    let (lo, hi) = range.split_once('-')?;
    let (major, minor) = dev.split_once(':')?;
    let (path, deleted) = match path.strip_suffix(" (deleted)") {
        Some(p) => (p, true),
        None => (path, false),
    };
    Some(MapsEntry {
        start: u64::from_str_radix(lo, 16).ok()?,
        end: u64::from_str_radix(hi, 16).ok()?,
        offset: u64::from_str_radix(offset, 16).ok()?,
        exec: perms.contains('x'),
        id: FileId {
            major: u32::from_str_radix(major, 16).ok()?,
            minor: u32::from_str_radix(minor, 16).ok()?,
            ino: ino.parse().ok()?,
        },
        path: PathBuf::from(path),
        deleted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn parses_file_mappings_with_their_identity() {
        let maps = "\
55d0c0000000-55d0c0001000 r--p 00000000 fe:01 123 /usr/bin/prog
55d0c0001000-55d0c0002000 r-xp 00001000 fe:01 123 /usr/bin/prog
7f0000400000-7f0000500000 r-xp 00000000 103:1a 790                        /tmp/my lib.so
7f0000600000-7f0000700000 r-xp 00002000 00:2f 791 /tmp/old.so (deleted)
7f0000800000-7f0000900000 rw-p 00000000 00:00 0 
7ffd00000000-7ffd00001000 r-xp 00000000 00:00 0                          [vdso]
";
        let e = parse(maps);
        assert_eq!(e.len(), 4);
        assert!(!e[0].exec && e[1].exec);
        assert_eq!(e[1].offset, 0x1000);
        assert_eq!(
            e[2].id,
            FileId {
                major: 0x103,
                minor: 0x1a,
                ino: 790
            }
        );
        assert_eq!(e[2].path, PathBuf::from("/tmp/my lib.so"));
        assert!(e[3].deleted && e[3].path == Path::new("/tmp/old.so"));
        assert_eq!((e[3].start, e[3].end), (0x7f0000600000, 0x7f0000700000));
    }
}
