//! The programs' placeholder calls (`heaptrace_common::preempt`) made real: calls of the
//! running kernel's `bpf_preempt_disable` and `bpf_preempt_enable`, so that the return and
//! free programs count on their CPU with plain adds (the eBPF side's `preempt.rs` says why).
//! aya cannot call kfuncs, so the object's bytes are patched before aya or `multi` parse them:
//! both copies of the programs then carry the same calls.
//!
//! Where the kernel lacks the kfuncs (before 6.10), or refuses them in a kprobe program, or
//! `--atomic-counters` asks, the placeholders become no-ops and the PREEMPT_OFF global stays 0:
//! every add is atomic, as before.
use std::os::fd::OwnedFd;

use aya_obj::generated::bpf_insn;
use heaptrace_common::preempt::{PREEMPT_DISABLE, PREEMPT_ENABLE};
use object::{Object as _, ObjectSection as _, SectionKind};

/// BPF_JMP | BPF_CALL.
const CALL: u8 = 0x85;
/// BPF_JMP | BPF_JA: with offset 0, a no-op.
const JA: u8 = 0x05;
/// src_reg of a call of a kernel function by BTF id.
const PSEUDO_KFUNC_CALL: u8 = 2;

/// The kfuncs' BTF ids in vmlinux: (disable, enable).
pub type Kfuncs = (u32, u32);

/// The program object with its placeholders rewritten, in 8-byte words (aya and the `object`
/// crate read ELF structures in place, which needs the alignment).
pub struct Patched {
    words: Vec<u64>,
    len: usize,
    /// The kfuncs are called: PREEMPT_OFF is 1.
    pub preempt_off: bool,
}

impl Patched {
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` <= the words' byte length; u8 has no alignment or validity needs.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }
}

/// `object` patched for this kernel: with the kfuncs where `allow` and the kernel takes them.
pub fn patched(object: &[u8], allow: bool) -> Result<Patched, String> {
    let kfuncs = if allow { usable_kfuncs() } else { None };
    let mut words = vec![0u64; object.len().div_ceil(8)];
    // SAFETY: as in `bytes`, over the words' whole length.
    let bytes =
        unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), object.len()) };
    bytes.copy_from_slice(object);
    let sites = patch(bytes, kfuncs)?;
    log::debug!(
        "{sites} placeholder calls made {}",
        if kfuncs.is_some() {
            "kfunc calls"
        } else {
            "no-ops"
        }
    );
    Ok(Patched {
        words,
        len: object.len(),
        preempt_off: kfuncs.is_some(),
    })
}

/// The kfuncs' ids, if the kernel has both and lets a kprobe program call them.
fn usable_kfuncs() -> Option<Kfuncs> {
    let ids = crate::bpf::btf::func_ids(["bpf_preempt_disable", "bpf_preempt_enable"]);
    let kfuncs = match ids {
        Ok([Some(d), Some(e)]) => (d, e),
        Ok(_) => {
            log::debug!("no bpf_preempt_disable/enable in this kernel: atomic counters");
            return None;
        }
        Err(e) => {
            log::debug!("kfuncs not looked up ({e}): atomic counters");
            return None;
        }
    };
    match probe(kfuncs) {
        Ok(_) => Some(kfuncs),
        Err(e) => {
            log::debug!("a kprobe program may not call bpf_preempt_disable ({e}): atomic counters");
            None
        }
    }
}

/// Loads (and verifies) a program of the kind that carries the kfunc calls (uprobe_multi's)
/// that only disables and enables preemption.
fn probe((disable, enable): Kfuncs) -> std::io::Result<OwnedFd> {
    let insns = [
        insn(CALL, PSEUDO_KFUNC_CALL << 4, disable as i32),
        insn(CALL, PSEUDO_KFUNC_CALL << 4, enable as i32),
        insn(0xb7, 0, 0), // r0 = 0
        insn(0x95, 0, 0), // exit
    ]
    // SAFETY: bpf_insn is an instruction's 8 bytes (repr(C), no padding), any value valid.
    .map(|i| unsafe { std::mem::transmute::<[u8; 8], bpf_insn>(i) });
    crate::bpf::uprobe_multi::load_one("heaptrace_kfunc", &insns, &c"Dual MIT/GPL".into(), None)
}

fn insn(code: u8, regs: u8, imm: i32) -> [u8; 8] {
    let mut i = [code, regs, 0, 0, 0, 0, 0, 0];
    i[4..].copy_from_slice(&imm.to_le_bytes());
    i
}

/// Rewrites every placeholder call in the object's code sections: into a call of its kfunc,
/// or into a no-op where `kfuncs` is None. Returns how many it rewrote; an object whose code
/// has none is an error (its programs would count with atomic adds under PREEMPT_OFF, unguarded).
pub fn patch(elf: &mut [u8], kfuncs: Option<Kfuncs>) -> Result<usize, String> {
    let ranges: Vec<(usize, usize)> = {
        let file = object::File::parse(&*elf).map_err(|e| format!("parsing the object: {e}"))?;
        file.sections()
            .filter(|s| s.kind() == SectionKind::Text)
            .filter_map(|s| s.file_range())
            .map(|(off, len)| (off as usize, len as usize))
            .collect()
    };
    let mut sites = 0;
    for (off, len) in ranges {
        let code = elf
            .get_mut(off..off + len)
            .ok_or("a code section past the end of the object")?;
        for i in code.chunks_exact_mut(8) {
            // A helper call (src_reg 0, offset 0) of a placeholder's number.
            if i[0] != CALL || i[1] & 0xf0 != 0 || i[2..4] != [0, 0] {
                continue;
            }
            let id = i32::from_le_bytes([i[4], i[5], i[6], i[7]]);
            let kfunc = match (id, kfuncs) {
                (PREEMPT_DISABLE, Some((d, _))) => Some(d),
                (PREEMPT_ENABLE, Some((_, e))) => Some(e),
                (PREEMPT_DISABLE | PREEMPT_ENABLE, None) => None,
                _ => continue,
            };
            let dst = i[1] & 0x0f;
            i.copy_from_slice(&match kfunc {
                Some(k) => insn(CALL, PSEUDO_KFUNC_CALL << 4 | dst, k as i32),
                None => insn(JA, 0, 0),
            });
            sites += 1;
        }
    }
    if sites == 0 {
        return Err("the object has no placeholder calls to rewrite".into());
    }
    Ok(sites)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The placeholder calls in the built object, by number.
    fn placeholders(elf: &[u8]) -> (usize, usize) {
        let count = |id: i32| {
            let want = insn(CALL, 0, id);
            elf.chunks_exact(8).filter(|i| *i == want).count()
        };
        (count(PREEMPT_DISABLE), count(PREEMPT_ENABLE))
    }

    #[test]
    fn every_placeholder_becomes_its_kfunc_call_or_a_no_op() {
        let object = crate::probe::EBPF_OBJECT;
        let (disables, enables) = placeholders(object);
        // The return and free programs each turn preemption off once, and back on at every
        // exit after that.
        assert!(disables >= 2 && enables >= disables, "{disables} {enables}");

        let mut elf = object.to_vec();
        let n = patch(&mut elf, Some((1111, 2222))).unwrap();
        assert_eq!(n, disables + enables);
        assert_eq!(placeholders(&elf), (0, 0));
        let calls = |id: u32| {
            let want = insn(CALL, PSEUDO_KFUNC_CALL << 4, id as i32);
            elf.chunks_exact(8).filter(|i| *i == want).count()
        };
        assert_eq!((calls(1111), calls(2222)), (disables, enables));
        // Nothing else moved.
        let changed = object.iter().zip(&elf).filter(|(a, b)| a != b).count();
        assert!(changed <= 8 * n, "{changed} bytes changed for {n} calls");

        let mut elf = object.to_vec();
        assert_eq!(patch(&mut elf, None).unwrap(), n);
        assert_eq!(placeholders(&elf), (0, 0));
        let nops = elf.chunks_exact(8).filter(|i| *i == insn(JA, 0, 0)).count();
        let before = object
            .chunks_exact(8)
            .filter(|i| *i == insn(JA, 0, 0))
            .count();
        assert_eq!(nops - before, n);
    }

    #[test]
    fn an_object_without_placeholders_is_refused() {
        let mut elf = crate::probe::EBPF_OBJECT.to_vec();
        patch(&mut elf, None).unwrap();
        assert!(patch(&mut elf, None).is_err());
    }
}
