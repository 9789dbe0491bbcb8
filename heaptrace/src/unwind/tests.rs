use heaptrace_common::unwind::{Row, kind};
use object::{Object as _, ObjectSection as _, ObjectSymbol as _};

use super::table::{FileTable, TableError, build};

/// The file virtual address of `name` in `data`'s symbol tables.
fn symbol(data: &[u8], name: &str) -> u64 {
    let file = object::File::parse(data).unwrap();
    file.symbols()
        .chain(file.dynamic_symbols())
        .find(|s| s.name() == Ok(name))
        .unwrap_or_else(|| panic!("no symbol {name}"))
        .address()
}

/// tests/fixtures/unwindlib.c built -O2 as a shared library with `flags`.
fn fixture_lib(flags: &[&str], variant: &str) -> Vec<u8> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    let dir =
        std::env::temp_dir().join(format!("heaptrace-unwind-{}-{variant}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join(format!("libunwind{variant}.so"));
    let status = std::process::Command::new("gcc")
        .args(["-O2", "-shared", "-fPIC", "-fno-builtin"])
        .args(flags)
        .arg("-o")
        .arg(&out)
        .arg(root.join("tests/fixtures/unwindlib.c"))
        .status()
        .expect("gcc");
    assert!(status.success());
    let data = std::fs::read(&out).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    data
}

fn rsp(cfa: u16) -> (u8, u16, u8) {
    (kind::RSP, cfa, 0)
}

fn rule(r: Row) -> (u8, u16, u8) {
    (r.kind, r.cfa, r.rbp)
}

#[test]
fn without_frame_pointers_the_cfa_follows_rsp_through_the_function() {
    let data = fixture_lib(&["-fomit-frame-pointer"], "nofp");
    let t = build(&data[..]).unwrap();
    assert!(!t.frame_pointers(), "{:?}", t.stats);
    let f = symbol(&data, "lib_alloc");
    // sub $0x38,%rsp; the call; add $0x38,%rsp; ret.
    assert_eq!(rule(t.row_for(f).unwrap()), rsp(1));
    assert_eq!(rule(t.row_for(f + 4).unwrap()), rsp(8));
    assert_eq!(
        rule(t.row_for(f + 0xc).unwrap()),
        rsp(8),
        "at the return address"
    );
    assert_eq!(rule(t.row_for(f + 0x10).unwrap()), rsp(1));
    // Past the function's last byte, before the next FDE (if any): no rule, not its rule.
    let end = t.rows.iter().find(|r| u64::from(r.pc) > f + 0x10).unwrap();
    assert!(u64::from(end.pc) <= f + 0x20);
    assert_eq!(t.stats.bad_fdes, 0);
    // The lazy PLT's CFA expression is made plain rows: rsp + 8 at an entry's start, rsp + 16
    // once its push ran; its stubs are not functions.
    assert!(t.stats.plt_rows >= 1, "{:?}", t.stats);
    assert_eq!(t.stats.expressions, 0, "{:?}", t.stats);
    let plt = {
        let file = object::File::parse(&data[..]).unwrap();
        file.section_by_name(".plt").unwrap().address()
    };
    let entry = plt + 16;
    assert_eq!(rule(t.row_for(entry).unwrap()), rsp(1));
    assert_eq!(rule(t.row_for(entry + 10).unwrap()), rsp(1));
    assert_eq!(
        rule(t.row_for(entry + 11).unwrap()),
        rsp(2),
        "after the push"
    );
}

#[test]
fn with_frame_pointers_the_cfa_is_rbp_and_the_module_walks_by_frame_pointer() {
    let data = fixture_lib(&["-fno-omit-frame-pointer"], "fp");
    let t = build(&data[..]).unwrap();
    assert!(t.frame_pointers(), "{:?}", t.stats);
    let f = symbol(&data, "lib_down");
    assert_eq!(rule(t.row_for(f).unwrap()), rsp(1));
    assert_eq!(
        rule(t.row_for(f + 1).unwrap()),
        (kind::RSP, 2, 2),
        "push %rbp"
    );
    // After mov %rsp,%rbp: CFA = rbp + 16, the caller's rbp at CFA - 16.
    let body = t
        .rows
        .iter()
        .find(|r| u64::from(r.pc) > f + 1)
        .copied()
        .unwrap();
    assert_eq!(rule(body), (kind::RBP, 2, 2));
}

#[test]
fn libc_rows_start_each_function_at_rsp_plus_8_and_end_at_start() {
    let path = [
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
    .expect("the host's libc");
    let data = std::fs::read(path).unwrap();
    let t = build(&data[..]).unwrap();
    assert!(!t.frame_pointers(), "{:?}", t.stats);
    for f in ["malloc", "free", "qsort", "fopen"] {
        assert_eq!(rule(t.row_for(symbol(&data, f)).unwrap()), rsp(1), "{f}");
    }
    // Rows sorted, one per change of rule.
    assert!(t.rows.windows(2).all(|w| w[0].pc < w[1].pc));
    assert!(t.rows.windows(2).all(|w| rule(w[0]) != rule(w[1])));
    // clone3's child marks its return address undefined: the end of a thread's stack.
    assert!(t.rows.iter().any(|r| r.kind == kind::END), "{:?}", t.stats);
    // __restore_rt's FDE is marked a signal trampoline: one row, read from the signal frame.
    assert_eq!(
        t.rows.iter().filter(|r| r.kind == kind::SIGNAL).count(),
        1,
        "{:?}",
        t.stats
    );
    // Read through a cache (headers and unwind sections only), as the daemon reads files.
    let cache = object::ReadCache::new(std::fs::File::open(path).unwrap());
    assert_eq!(build(&cache).unwrap().rows, t.rows);
    // Mostly rules the kernel follows.
    let followed = t.rows.iter().filter(|r| r.kind != kind::NONE).count();
    assert!(
        followed * 10 > t.rows.len() * 8,
        "{followed} of {}",
        t.rows.len()
    );
}

#[test]
fn the_bias_comes_from_the_segment_that_holds_the_mapping() {
    let seg = |offset, size, vaddr, exec| super::table::Segment {
        offset,
        size,
        vaddr,
        exec,
    };
    let t = FileTable {
        segments: vec![seg(0x1000, 0x5000, 0x401000, true)],
        ..FileTable::default()
    };
    assert_eq!(t.bias(0x401000, 0x1000), Some(0));
    let start = 0x7f00_0000_2000;
    assert_eq!(t.bias(start, 0x2000), Some(start - 0x402000));
    assert_eq!(t.bias(0x1000, 0x9000), None);
    // lld: segments not aligned in the file, code a page above its file offset. The code
    // mapping begins at its page (0x12000), which the read-only segment holds too.
    let t = FileTable {
        segments: vec![
            seg(0, 0x1298c, 0, false),
            seg(0x12990, 0x3cbe0, 0x13990, true),
        ],
        ..FileTable::default()
    };
    let start = 0x5555_5556_6000;
    assert_eq!(t.bias(start, 0x12000), Some(start - 0x13000));
    assert_eq!(t.bias(0x5555_5555_4000, 0), Some(0x5555_5555_4000));
}

#[test]
fn bytes_that_are_not_elf_are_an_error_not_a_panic() {
    assert!(matches!(
        build(&b"\x7fELF garbage"[..]),
        Err(TableError::Elf(_))
    ));
    assert!(matches!(build(&[][..]), Err(TableError::Elf(_))));
    // An ELF header whose sections lie beyond the file.
    let mut data = std::fs::read("/proc/self/exe").unwrap();
    data.truncate(4096);
    let _ = build(&data[..]);
}

/// A CFA offset past 16 bits of words (a frame over 512 KiB) keeps its high bits in the kind
/// byte; past 2 MiB there is no row.
#[test]
fn cfa_offsets_past_16_bits_of_words_keep_their_high_bits() {
    let r = Row::new(0x10, kind::RSP, 67_510, 2).unwrap();
    assert_eq!((r.rule(), r.cfa_words(), r.rbp), (kind::RSP, 67_510, 2));
    let top = (1 << 18) - 1;
    assert_eq!(Row::new(0, kind::RBP, top, 0).unwrap().cfa_words(), top);
    assert_eq!(Row::new(0, kind::RBP, top, 0).unwrap().rule(), kind::RBP);
    assert_eq!(Row::new(0, kind::RSP, 1 << 18, 0), None);
    assert_eq!(
        Row::new(0, kind::SIGNAL, 0, 0).unwrap().rule(),
        kind::SIGNAL
    );
    assert_eq!(Row::new(0, kind::RSP, 2, 0).unwrap().kind, kind::RSP);
}
