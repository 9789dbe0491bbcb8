//! A file's unwind rows, from its `.eh_frame` and `.debug_frame` (gimli): for each address
//! range, how to find the caller's frame (x86-64). Only the rules the kernel follows are
//! kept: CFA = rsp + N or rbp + N, the return address at CFA - 8, rbp unchanged or saved at
//! CFA - 8k. Anything else becomes a row with no rule (the stack is cut there, counted), and
//! is counted here too.
use gimli::{
    BaseAddresses, CfaRule, CieOrFde, EndianSlice, LittleEndian, RegisterRule, UnwindContext,
    UnwindSection, X86_64,
};
use heaptrace_common::unwind::{MAX_FILE_ROWS, Row, kind};

use super::plt;
use object::{Object as _, ObjectSection as _, ObjectSegment as _};

type Reader<'a> = EndianSlice<'a, LittleEndian>;

/// What was found building a table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Functions described (FDEs); those of 16 bytes or more whose CFA is never an expression
    /// (not PLT stubs, not even the lazy PLT's, made plain rows), and those of them whose CFA is rbp + 16 somewhere: built with a frame
    /// pointer.
    pub fdes: u32,
    pub fn_fdes: u32,
    pub fp_fdes: u32,
    /// FDEs that could not be parsed, or overlapped one taken before.
    pub bad_fdes: u32,
    /// CFI rows whose CFA is a DWARF expression (the PLT's, a signal frame's).
    pub expressions: u32,
    /// CFI rows of a lazy PLT, whose CFA expression is known and made plain rows.
    pub plt_rows: u32,
    /// CFI rows with another rule the kernel does not follow.
    pub other: u32,
}

/// A loadable segment: file offset and size, its virtual address, and whether it is code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub offset: u64,
    pub size: u64,
    pub vaddr: u64,
    pub exec: bool,
}

/// A file's table.
#[derive(Clone, Debug, Default)]
pub struct FileTable {
    /// Sorted by `pc`, one row where the rule changes; a row of `kind::NONE` closes a range
    /// no FDE covers.
    pub rows: Vec<Row>,
    pub stats: Stats,
    pub segments: Vec<Segment>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TableError {
    #[error("not an ELF file: {0}")]
    Elf(String),
    #[error("no .eh_frame or .debug_frame")]
    NoUnwindInfo,
    #[error("more than {MAX_FILE_ROWS} unwind rows")]
    TooBig,
    #[error("code above 4 GiB")]
    HighAddresses,
}

impl FileTable {
    /// Most of its functions keep a frame pointer (9 in 10): the frame-pointer walk, cheaper,
    /// serves its frames, and its table is not loaded.
    pub fn frame_pointers(&self) -> bool {
        let s = &self.stats;
        s.fn_fdes > 0 && u64::from(s.fp_fdes) * 10 >= u64::from(s.fn_fdes) * 9
    }

    /// The bias of a mapping of this file at `start`, from file offset `offset`: run-time
    /// address less the file's virtual address. None where no segment holds the offset.
    ///
    /// A mapping begins at a page boundary, which may lie before its segment's offset (a
    /// linker that does not align segments in the file, lld): the code segment whose pages
    /// hold the offset is taken before any other that holds it.
    pub fn bias(&self, start: u64, offset: u64) -> Option<u64> {
        const PAGE: u64 = 4096;
        let holds = |s: &&Segment| {
            let first = s.offset & !(PAGE - 1);
            offset >= first && offset < s.offset.saturating_add(s.size.max(1))
        };
        let s = self
            .segments
            .iter()
            .filter(|s| s.exec)
            .find(holds)
            .or_else(|| self.segments.iter().find(holds))?;
        // The virtual address of the mapping's first byte.
        let vaddr = s.vaddr.wrapping_add(offset).wrapping_sub(s.offset);
        Some(start.wrapping_sub(vaddr))
    }

    /// The row that holds `pc` (a virtual address of the file), as the kernel finds it.
    pub fn row_for(&self, pc: u64) -> Option<Row> {
        let pc = u32::try_from(pc).ok()?;
        let i = self.rows.partition_point(|r| r.pc <= pc);
        (i > 0).then(|| self.rows[i - 1])
    }
}

/// One FDE's range and rows.
struct Fde {
    start: u64,
    end: u64,
    rows: Vec<Row>,
    /// Counted in `Stats::fn_fdes`, and in `fp_fdes`.
    function: bool,
    fp: bool,
}

/// Unwind sections larger than this are not read (python3's `.eh_frame`: 400 KiB).
const MAX_SECTION_BYTES: u64 = 256 << 20;

/// Builds the table of the ELF file `data`: bytes in memory, or a file read through
/// `object::ReadCache`, of which only the headers and the unwind sections are then read.
pub fn build<'a, R: object::ReadRef<'a>>(data: R) -> Result<FileTable, TableError> {
    let file = object::File::parse(data).map_err(|e| TableError::Elf(e.to_string()))?;
    let bounded = |s: &object::Section<'a, '_, R>| s.size() <= MAX_SECTION_BYTES;
    let mut stats = Stats::default();
    let mut fdes = Vec::new();
    let addr = |name: &str| file.section_by_name(name).map_or(0, |s| s.address());
    let mut found = false;
    if let Some(eh) = file.section_by_name(".eh_frame").filter(bounded)
        && let Ok(bytes) = eh.data()
    {
        found = true;
        let mut section = gimli::EhFrame::new(bytes, LittleEndian);
        section.set_address_size(8);
        let bases = BaseAddresses::default()
            .set_eh_frame_hdr(addr(".eh_frame_hdr"))
            .set_eh_frame(eh.address())
            .set_text(addr(".text"))
            .set_got(addr(".got"));
        collect(&section, &bases, &mut fdes, &mut stats)?;
    }
    if let Some(debug) = file.section_by_name(".debug_frame").filter(bounded)
        && let Ok(bytes) = debug.data()
    {
        found = true;
        let mut section = gimli::DebugFrame::new(bytes, LittleEndian);
        section.set_address_size(8);
        collect(&section, &BaseAddresses::default(), &mut fdes, &mut stats)?;
    }
    if !found {
        return Err(TableError::NoUnwindInfo);
    }
    let segments = file
        .segments()
        .map(|s| {
            let (offset, size) = s.file_range();
            Segment {
                offset,
                size,
                vaddr: s.address(),
                exec: matches!(s.flags(), object::SegmentFlags::Elf { p_flags }
                    if p_flags & object::elf::PF_X != 0),
            }
        })
        .collect();
    let rows = merge(fdes, &mut stats)?;
    Ok(FileTable {
        rows,
        stats,
        segments,
    })
}

/// Every FDE of `section` with its rows.
/// Err where the rows so far are more than a file may have: hostile bytes cannot make it
/// hold more than that in memory.
fn collect<'a, S: UnwindSection<Reader<'a>>>(
    section: &S,
    bases: &BaseAddresses,
    out: &mut Vec<Fde>,
    stats: &mut Stats,
) -> Result<(), TableError> {
    let mut held: usize = out.iter().map(|f| f.rows.len()).sum();
    let mut ctx = UnwindContext::new();
    let mut entries = section.entries(bases);
    // An entry that cannot be read ends the section: its length is what finds the next.
    while let Ok(Some(entry)) = entries.next() {
        let CieOrFde::Fde(partial) = entry else {
            continue;
        };
        let Ok(fde) = partial.parse(S::cie_from_offset) else {
            stats.bad_fdes += 1;
            continue;
        };
        if fde.len() == 0 {
            continue;
        }
        if fde.cie().is_signal_trampoline() {
            // Its CFA is an expression reading the signal frame: one row the kernel follows.
            let Ok(pc) = u32::try_from(fde.initial_address()) else {
                continue;
            };
            let signal = Row {
                pc,
                kind: kind::SIGNAL,
                ..Row::default()
            };
            stats.fdes += 1;
            out.push(Fde {
                start: fde.initial_address(),
                end: fde.end_address(),
                rows: vec![signal],
                function: false,
                fp: false,
            });
            continue;
        }
        let Ok(mut table) = fde.rows(section, bases, &mut ctx) else {
            stats.bad_fdes += 1;
            continue;
        };
        let mut rows = Vec::new();
        let mut fp = false;
        let expressions = stats.expressions + stats.plt_rows;
        loop {
            match table.next_row() {
                Ok(Some(r)) => {
                    fp |= matches!(r.cfa(), CfaRule::RegisterAndOffset { register, offset: 16 }
                        if *register == X86_64::RBP);
                    let Ok(pc) = u32::try_from(r.start_address()) else {
                        break;
                    };
                    let room = (MAX_FILE_ROWS as usize).saturating_sub(held);
                    if let Some(plt) = plt_rows(section, r, room) {
                        held += plt.len();
                        rows.extend(plt);
                        stats.plt_rows += 1;
                        continue;
                    }
                    rows.push(row(pc, r, stats));
                    held += 1;
                    if held > MAX_FILE_ROWS as usize {
                        return Err(TableError::TooBig);
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    stats.bad_fdes += 1;
                    break;
                }
            }
        }
        let function = fde.len() >= 16 && stats.expressions + stats.plt_rows == expressions;
        let fp = fp && function;
        stats.fdes += 1;
        stats.fn_fdes += u32::from(function);
        stats.fp_fdes += u32::from(fp);
        out.push(Fde {
            start: fde.initial_address(),
            end: fde.end_address(),
            rows,
            function,
            fp,
        });
    }
    Ok(())
}

/// A lazy PLT's row, whose CFA expression [`plt`] knows, as plain rows; None where it is not
/// one, or would need more than `room` rows (counted then as an expression by `row`).
fn plt_rows<'a, S: UnwindSection<Reader<'a>>>(
    section: &S,
    r: &gimli::UnwindTableRow<usize>,
    room: usize,
) -> Option<Vec<Row>> {
    let CfaRule::Expression(e) = r.cfa() else {
        return None;
    };
    let k = plt::pushed_at(e.get(section).ok()?.0.slice())?;
    plt::rows(r.start_address(), r.end_address(), k, room)
}

/// One CFI row as the kernel follows it.
fn row(pc: u32, r: &gimli::UnwindTableRow<usize>, stats: &mut Stats) -> Row {
    let none = Row {
        pc,
        kind: kind::NONE,
        ..Row::default()
    };
    match r.register(X86_64::RA) {
        Some(RegisterRule::Undefined) => {
            return Row {
                pc,
                kind: kind::END,
                ..Row::default()
            };
        }
        Some(RegisterRule::Offset(-8)) | None => {}
        Some(_) => {
            stats.other += 1;
            return none;
        }
    }
    let (cfa_kind, offset) = match r.cfa() {
        CfaRule::RegisterAndOffset { register, offset } if *register == X86_64::RSP => {
            (kind::RSP, *offset)
        }
        CfaRule::RegisterAndOffset { register, offset } if *register == X86_64::RBP => {
            (kind::RBP, *offset)
        }
        CfaRule::RegisterAndOffset { .. } => {
            stats.other += 1;
            return none;
        }
        CfaRule::Expression(_) => {
            stats.expressions += 1;
            return none;
        }
    };
    let Some(cfa) = words(offset) else {
        stats.other += 1;
        return none;
    };
    let rbp = match r.register(X86_64::RBP) {
        None | Some(RegisterRule::SameValue) | Some(RegisterRule::Undefined) => Some(0),
        Some(RegisterRule::Offset(o)) => words(-o).and_then(|w| u8::try_from(w).ok()),
        Some(_) => None,
    };
    let Some(rbp) = rbp.filter(|k| *k != 1) else {
        stats.other += 1;
        return none;
    };
    Row::new(pc, cfa_kind, cfa, rbp).unwrap_or_else(|| {
        stats.other += 1;
        none
    })
}

/// A positive multiple of 8, in words.
fn words(bytes: i64) -> Option<u64> {
    (bytes > 0 && bytes % 8 == 0).then_some(bytes as u64 / 8)
}

/// The FDEs' rows in address order, a row of no rule where a gap between FDEs begins, one row
/// where the rule changes. An FDE that overlaps one taken before (`.debug_frame` after
/// `.eh_frame`) is dropped.
fn merge(mut fdes: Vec<Fde>, stats: &mut Stats) -> Result<Vec<Row>, TableError> {
    fdes.sort_by_key(|f| (f.start, std::cmp::Reverse(f.end)));
    let mut rows: Vec<Row> = Vec::new();
    let mut covered = 0u64;
    let same = |a: &Row, b: &Row| (a.kind, a.cfa, a.rbp) == (b.kind, b.cfa, b.rbp);
    let push = |rows: &mut Vec<Row>, r: Row| {
        if rows.last().is_some_and(|last| last.pc == r.pc) {
            rows.pop();
        }
        if !rows.last().is_some_and(|last| same(last, &r)) {
            rows.push(r);
        }
        if rows.len() > MAX_FILE_ROWS as usize {
            return Err(TableError::TooBig);
        }
        Ok(())
    };
    for f in fdes {
        if f.start < covered {
            stats.bad_fdes += 1;
            stats.fdes -= 1;
            stats.fn_fdes -= u32::from(f.function);
            stats.fp_fdes -= u32::from(f.fp);
            continue;
        }
        let end = u32::try_from(f.end).map_err(|_| TableError::HighAddresses)?;
        for r in f.rows {
            push(&mut rows, r)?;
        }
        push(
            &mut rows,
            Row {
                pc: end,
                kind: kind::NONE,
                ..Row::default()
            },
        )?;
        covered = f.end;
    }
    Ok(rows)
}
