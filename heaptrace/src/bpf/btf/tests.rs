use super::*;

/// Or'd into a kind: sets the type's kind_flag.
const KFLAG: u32 = 0x80;

#[derive(Default)]
struct Builder {
    /// Each type's words; type id N is `types[N - 1]`.
    types: Vec<Vec<u32>>,
    strings: Vec<u8>,
}

fn le(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

impl Builder {
    fn name(&mut self, s: &str) -> u32 {
        if self.strings.is_empty() {
            self.strings.push(0); // offset 0 is the empty name
        }
        if s.is_empty() {
            return 0;
        }
        self.strings.extend(s.bytes().chain([0]));
        (self.strings.len() - s.len() - 1) as u32
    }

    /// Appends a type; returns its id.
    fn ty(&mut self, name: &str, kind: u32, vlen: u32, size_or_type: u32, rest: &[u32]) -> u32 {
        let words = [self.name(name), kind << 24 | vlen, size_or_type];
        self.types.push(words.iter().chain(rest).copied().collect());
        self.types.len() as u32
    }

    fn blob(&self) -> Vec<u8> {
        let types = le(&self.types.concat());
        let (t, s) = (types.len() as u32, self.strings.len() as u32);
        // Magic 0xEB9F, version 1, flags 0; then hdr_len and the sections, strings last.
        let mut blob = le(&[0x1_eb9f, 24, 0, t, t, s]);
        blob.extend(types);
        blob.extend(&self.strings);
        blob
    }
}

/// A task_struct with `group_leader` at byte 8 (in an anonymous union) and `comm` at 24,
/// after types of the other kinds the parser has to step over.
fn task(struct_name: &str, comm_len: u32, leader_is_ptr: bool) -> Vec<u8> {
    let mut b = Builder::default();
    let int = b.ty("int", INT, 0, 4, &[0x0100_0020]);
    let char = b.ty("char", INT, 0, 1, &[0x0100_0008]);
    let [a, z, x, y] = ["A", "Z", "x", "y"].map(|n| b.name(n));
    b.ty("letters", ENUM, 2, 4, &[a, 0, z, 25]);
    b.ty("", FUNC_PROTO, 2, int, &[x, int, y, char]);
    let var = b.ty("jiffies", VAR, 0, int, &[1]);
    let proto = b.ty("", FUNC_PROTO, 0, 0, &[]);
    b.ty("bpf_preempt_disable", FUNC, 0, proto, &[]);
    b.ty(".data", DATASEC, 1, 4, &[var, 0, 4]);
    b.ty("task_struct", FWD, 0, 0, &[]);
    let ptr = b.ty("", PTR, 0, 0, &[]); // to task_struct, once that has an id
    let const_ptr = b.ty("", CONST, 0, ptr, &[]);
    let leader = b.ty("task_ptr", TYPEDEF, 0, const_ptr, &[]);
    let leader = if leader_is_ptr { leader } else { int };
    let comm = b.ty("", ARRAY, 0, 0, &[char, int, comm_len]);
    let [cookie, gl, state, flags, cm] =
        ["cookie", "group_leader", "state", "flags", "comm"].map(|n| b.name(n));
    let union = b.ty("", UNION, 2, 8, &[cookie, int, 0, gl, leader, 0]);
    // kind_flag: `flags` is a 3-bit bitfield at bit 32.
    let members = [
        state, int, 0, flags, int, 0x300_0020, 0, union, 64, cm, comm, 192,
    ];
    let task = b.ty(struct_name, STRUCT | KFLAG, 4, 40, &members);
    b.types[ptr as usize - 1][2] = task;
    b.blob()
}

fn assert_err(data: &[u8], wanted: &str) {
    match parse_task_offsets(data) {
        Err(Error::Btf(e)) => assert!(e.contains(wanted), "{e:?} lacks {wanted:?}"),
        other => panic!("{other:?}, wanted an error about {wanted:?}"),
    }
}

/// vm_area_struct, file, inode and super_block with the members the mapping walk reads;
/// `split`: the inode's modification time as seconds and nanoseconds (6.11 on), else a
/// timespec64.
fn vma_structs(split: bool) -> Vec<u8> {
    let mut b = Builder::default();
    let long = b.ty("long", INT, 0, 8, &[0x0100_0040]);
    let int = b.ty("int", INT, 0, 4, &[0x0100_0020]);
    let ptr = b.ty("", PTR, 0, long, &[]);
    let strukt = |b: &mut Builder, name: &str, members: &[(&str, u32, u32)]| {
        let words: Vec<u32> = members
            .iter()
            .flat_map(|(n, ty, bytes)| [b.name(n), *ty, bytes * 8])
            .collect();
        b.ty(name, STRUCT, members.len() as u32, 256, &words)
    };
    let area = [
        ("vm_start", long, 0),
        ("vm_end", long, 8),
        ("vm_pgoff", long, 120),
        ("vm_file", ptr, 128),
    ];
    strukt(&mut b, "vm_area_struct", &area);
    strukt(&mut b, "file", &[("f_inode", ptr, 32)]);
    let times: &[(&str, u32, u32)] = if split {
        &[("i_mtime_sec", long, 104), ("i_mtime_nsec", int, 112)]
    } else {
        &[("i_mtime", long, 96)]
    };
    let mut inode = vec![("i_ino", long, 64), ("i_sb", ptr, 40), ("i_size", long, 80)];
    inode.extend_from_slice(times);
    strukt(&mut b, "inode", &inode);
    strukt(&mut b, "super_block", &[("s_dev", int, 16)]);
    b.blob()
}

#[test]
fn finds_where_the_mapping_walk_reads() {
    for (split, sec, nsec) in [(true, 104, 112), (false, 96, 104)] {
        let o = parse_vma_offsets(&vma_structs(split)).unwrap();
        assert_eq!(
            o,
            [0, 8, 120, 128, 32, 64, 40, 80, sec, nsec, 16],
            "split {split}"
        );
    }
    // A kernel without the structs (here a task_struct alone): none, said.
    let e = parse_vma_offsets(&task("task_struct", 16, true)).unwrap_err();
    assert!(e.to_string().contains("vm_area_struct"), "{e}");
}

#[test]
fn finds_members_inside_anonymous_unions() {
    let found = parse_task_offsets(&task("task_struct", 16, true)).unwrap();
    assert_eq!((found.group_leader, found.comm), (8, 24));
}

#[test]
fn finds_functions_by_name() {
    let blob = task("task_struct", 16, true);
    let ids = parse_func_ids(&blob, ["bpf_preempt_enable", "bpf_preempt_disable", "int"]);
    // The function is the 7th type (after int, char, the enum, a prototype, the variable
    // and its own prototype); `int` is no function, and enable is missing.
    assert_eq!(ids.unwrap(), [None, Some(7), None]);
}

#[test]
fn rejects_bad_magic_and_big_endian() {
    let mut blob = task("task_struct", 16, true);
    blob.swap(0, 1);
    assert_err(&blob, "big-endian");
    blob[0] = 0;
    assert_err(&blob, "bad magic");
}

#[test]
fn every_truncation_is_an_error() {
    let blob = task("task_struct", 16, true);
    for len in 0..blob.len() {
        assert!(parse_task_offsets(&blob[..len]).is_err(), "{len} bytes");
    }
}

#[test]
fn rejects_wrong_member_types() {
    assert_err(
        &task("task_struct", 8, true),
        "comm (an array of 8 elements",
    );
    assert_err(
        &task("task_struct", 16, false),
        "group_leader (kind 1, not a pointer",
    );
}

/// `typedef void (*btf_trace_mark_victim)(void *, FIRST, unsigned int)`.
fn mark_victim(first_is_task: bool) -> Vec<u8> {
    let mut b = Builder::default();
    let int = b.ty("int", INT, 0, 4, &[32]);
    let task = b.ty("task_struct", FWD, 0, 0, &[]);
    let task_ptr = b.ty("", PTR, 0, task, &[]);
    let void_ptr = b.ty("", PTR, 0, 0, &[]);
    let first = if first_is_task { task_ptr } else { int };
    let proto = b.ty("", FUNC_PROTO, 3, 0, &[0, void_ptr, 0, first, 0, int]);
    let ptr = b.ty("", PTR, 0, proto, &[]);
    b.ty("btf_trace_mark_victim", TYPEDEF, 0, ptr, &[]);
    b.blob()
}

#[test]
fn finds_what_mark_victim_passes() {
    assert_eq!(
        parse_oom_victim(&mark_victim(true)).unwrap(),
        heaptrace_common::OOM_TASK
    );
    assert_eq!(
        parse_oom_victim(&mark_victim(false)).unwrap(),
        heaptrace_common::OOM_PID
    );
    let none = parse_oom_victim(&task("task_struct", 16, true)).unwrap_err();
    assert!(none.to_string().contains("no such tracepoint"), "{none}");
}

#[test]
fn rejects_a_missing_task_struct() {
    assert_err(
        &task("task_struct2", 16, true),
        "no complete struct task_struct",
    );
}

#[test]
fn running_kernel() {
    if !std::path::Path::new(VMLINUX).exists() {
        assert!(std::env::var_os("CI").is_none(), "CI must have {VMLINUX}");
        println!("SKIPPED no {VMLINUX}");
        return;
    }
    let found = task_offsets().unwrap();
    println!("{found:?}");
    let [a, b] = func_ids(["schedule", "no_such_function_here"]).unwrap();
    assert!(a.is_some() && b.is_none(), "{a:?} {b:?}");
    let TaskOffsets { group_leader, comm } = found;
    assert!(group_leader != 0 && comm != 0 && group_leader != comm);
    assert!(!(group_leader..group_leader + 8).contains(&comm));
}
