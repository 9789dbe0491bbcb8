//! CPython's location table (`co_linetable`, 3.11 and later; `Objects/locations.md` in its
//! source): the line of each instruction of a code object. Bytes come from the traced
//! process, so every read is bounded and a malformed table gives no line rather than a wrong
//! one past its end.

/// The line of code unit `unit` (an instruction index: 2-byte units from the start of the
/// code) in `table`, whose first line is `first_line`. None: the instruction has no line
/// (code 15), or the table ends before it or is malformed.
pub fn line_of(table: &[u8], first_line: i32, unit: u32) -> Option<i32> {
    let mut r = Reader { table, at: 0 };
    let (mut addr, mut line) = (0u32, first_line);
    while let Some(head) = r.byte() {
        if head & 0x80 == 0 {
            return None; // not an entry's first byte
        }
        let code = (head >> 3) & 0x0f;
        let len = u32::from(head & 0x07) + 1;
        let known = match code {
            15 => false,
            14 => {
                line = line.checked_add(r.svarint()?)?;
                r.varint()?; // end line
                r.varint()?; // column
                r.varint()?; // end column
                true
            }
            13 => {
                line = line.checked_add(r.svarint()?)?;
                true
            }
            10..=12 => {
                line = line.checked_add(i32::from(code) - 10)?;
                r.byte()?;
                r.byte()?;
                true
            }
            _ => {
                r.byte()?;
                true
            }
        };
        if unit < addr + len {
            return known.then_some(line);
        }
        addr += len;
    }
    None
}

struct Reader<'a> {
    table: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn byte(&mut self) -> Option<u8> {
        let b = *self.table.get(self.at)?;
        self.at += 1;
        Some(b)
    }

    /// Six bits a byte, least significant first, 0x40 for more.
    fn varint(&mut self) -> Option<u32> {
        let mut b = self.byte()?;
        let mut v = u32::from(b & 0x3f);
        let mut shift = 6;
        while b & 0x40 != 0 {
            b = self.byte()?;
            if shift > 30 {
                return None;
            }
            v |= u32::from(b & 0x3f).checked_shl(shift)?;
            shift += 6;
        }
        Some(v)
    }

    /// A varint whose lowest bit is the sign.
    fn svarint(&mut self) -> Option<i32> {
        let v = self.varint()?;
        let magnitude = (v >> 1) as i32;
        Some(if v & 1 != 0 { -magnitude } else { magnitude })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// `co_lines()` of the same function as each version printed it: (start byte, end byte,
    /// line), checked one code unit at a time.
    fn check(table: &str, lines: &[(u32, u32, Option<i32>)]) {
        let t = hex(table);
        for &(start, end, line) in lines {
            for unit in start / 2..end / 2 {
                assert_eq!(line_of(&t, 2, unit), line, "unit {unit}");
            }
        }
        let past = lines.last().unwrap().1 / 2;
        assert_eq!(line_of(&t, 2, past), None, "past the end");
    }

    // tests/fixtures/python/linetable.py's `sample`, from pyenv's 3.11.7, 3.12.1 and 3.13.0.
    #[test]
    fn lines_match_cpython_3_11() {
        check(
            "8000d80c0d8045dd0d12903189588c58f000060517f0000605178801d80b0c8871893590418a3a883ad8\
             0c119051894a88458845f008000d129051894a88458845d80b2ed00b2ea555a831a158a458d00b2ed1\
             0b2ed40b2e8044d80c11dd0c0f900489498c49f003010c17f000010517",
            &[
                (0, 2, Some(2)),
                (2, 6, Some(3)),
                (6, 40, Some(4)),
                (40, 58, Some(5)),
                (58, 70, Some(6)),
                (70, 82, Some(10)),
                (82, 132, Some(11)),
                (132, 134, Some(12)),
                (134, 162, Some(13)),
                (162, 166, Some(12)),
            ],
        );
    }

    #[test]
    fn lines_match_cpython_3_12() {
        check(
            "8000d80c0d8045dc0d1290318b58f2000605178801d80b0c8871893590418a3ad80c119051894a8945\
             f008000d129051894a8945f00d060517f40e00262ba831a358d60b2ea0018c4990648d4fd00b2e8044\
             d00b2ed80c11dc0c0f90048b49f003010c17f000010517f9f203000c2f",
            &[
                (0, 2, Some(2)),
                (2, 6, Some(3)),
                (6, 34, Some(4)),
                (34, 50, Some(5)),
                (50, 62, Some(6)),
                (62, 74, Some(10)),
                (74, 76, Some(4)),
                (76, 142, Some(11)),
                (142, 144, Some(12)),
                (144, 164, Some(13)),
                (164, 168, Some(12)),
                (168, 172, None),
                (172, 178, Some(11)),
            ],
        );
    }

    #[test]
    fn lines_match_cpython_3_13() {
        check(
            "8000d80c0d8045dc0d1290318e588801d80b0c8871893590418b3ad80c11894a8a45f008000d129051\
             894a8a45f10d000e16f40e00262ba831a458d30b2ea158a0018c4990648e4fa1588044d00b2ed80c11\
             dc0c0f90048b49f003010c17f000010517f9f203000c2f",
            &[
                (0, 2, Some(2)),
                (2, 6, Some(3)),
                (6, 34, Some(4)),
                (34, 52, Some(5)),
                (52, 64, Some(6)),
                (64, 78, Some(10)),
                (78, 82, Some(4)),
                (82, 152, Some(11)),
                (152, 154, Some(12)),
                (154, 174, Some(13)),
                (174, 178, Some(12)),
                (178, 182, None),
                (182, 188, Some(11)),
            ],
        );
    }

    #[test]
    fn malformed_tables_give_no_line() {
        assert_eq!(line_of(&[], 1, 0), None);
        assert_eq!(line_of(&[0x00, 0x01], 1, 0), None, "no entry flag");
        assert_eq!(line_of(&[0xf0], 1, 0), None, "long form cut short");
        // A varint that never ends.
        assert_eq!(
            line_of(&[0xe8, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f], 1, 0),
            None
        );
        // Lines that overflow.
        let mut t = vec![];
        for _ in 0..200 {
            t.extend([0xe8, 0x7e, 0x7f, 0x7f, 0x7f, 0x1f]);
        }
        assert_eq!(line_of(&t, i32::MAX - 5, 0), None);
    }
}
