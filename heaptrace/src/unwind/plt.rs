//! The lazy PLT's CFI, which gives its CFA as a DWARF expression: `rsp + 8`, plus 8 once the
//! 16-byte entry's `push` ran. binutils writes it for every `.plt` of 16-byte entries:
//! `DW_OP_breg7 8; DW_OP_breg16 0; DW_OP_lit15; DW_OP_and; DW_OP_litK; DW_OP_ge; DW_OP_lit3;
//! DW_OP_shl; DW_OP_plus` (K = 11 for `jmp; push; jmp`, 10 with IBT's `endbr64`). It is
//! turned into two plain rows per entry, which both walkers follow: a signal that lands in a
//! stub (a call to `malloc@plt`) then unwinds on through it.
use heaptrace_common::unwind::{Row, kind};

/// K, where `expr` is the PLT's expression.
pub fn pushed_at(expr: &[u8]) -> Option<u64> {
    const LIT0: u8 = 0x30;
    match *expr {
        [
            0x77,
            0x08,
            0x80,
            0x00,
            0x3f,
            0x1a,
            lit,
            0x2a,
            0x33,
            0x24,
            0x22,
        ] if (LIT0 + 1..LIT0 + 16).contains(&lit) => Some(u64::from(lit - LIT0)),
        _ => None,
    }
}

/// The rows for `[start, end)` of a PLT whose entries push at `k`: CFA = rsp + 8 from each
/// entry's start, rsp + 16 from `k` bytes in. `room`: how many rows may still be held; None
/// where more would be needed (a hostile FDE's range).
pub fn rows(start: u64, end: u64, k: u64, room: usize) -> Option<Vec<Row>> {
    let at = |pc: u64, words: u64| Row::new(u32::try_from(pc).ok()?, kind::RSP, words, 0);
    let words = |pc: u64| if pc & 15 >= k { 2 } else { 1 };
    if room == 0 {
        return None;
    }
    let mut out = vec![at(start, words(start))?];
    let mut block = start & !15;
    while block < end {
        for pc in [block, block + k] {
            if pc > start && pc < end {
                if out.len() >= room {
                    return None;
                }
                out.push(at(pc, words(pc))?);
            }
        }
        block += 16;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_binutils_expression_is_recognised_and_nothing_else() {
        let plt = [
            0x77, 0x08, 0x80, 0x00, 0x3f, 0x1a, 0x3b, 0x2a, 0x33, 0x24, 0x22,
        ];
        assert_eq!(pushed_at(&plt), Some(11));
        let mut ibt = plt;
        ibt[6] = 0x3a;
        assert_eq!(pushed_at(&ibt), Some(10));
        let mut other = plt;
        other[1] = 0x10;
        assert_eq!(pushed_at(&other), None);
        assert_eq!(pushed_at(&plt[..10]), None);
    }

    #[test]
    fn each_entry_is_rsp_plus_8_then_16_after_its_push() {
        let r = rows(0x1030, 0x1050, 11, 100).unwrap();
        let got: Vec<_> = r.iter().map(|r| (r.pc, r.cfa_words())).collect();
        assert_eq!(got, [(0x1030, 1), (0x103b, 2), (0x1040, 1), (0x104b, 2)]);
        // A range starting past an entry's push.
        let r = rows(0x103c, 0x1041, 11, 100).unwrap();
        let got: Vec<_> = r.iter().map(|r| (r.pc, r.cfa_words())).collect();
        assert_eq!(got, [(0x103c, 2), (0x1040, 1)]);
        // Bounded, the first row too.
        assert!(rows(0, 1 << 31, 11, 1000).is_none());
        assert!(rows(0x1030, 0x1031, 11, 0).is_none());
        assert_eq!(rows(0x1030, 0x1031, 11, 1).map(|r| r.len()), Some(1));
    }
}
