//! Which probe goes where: each family function of the allocator's file, its entry placed on
//! a decoded instruction, and whether it needs a return probe.
use super::*;

/// Where one function's probes go.
#[derive(Clone, Debug)]
pub struct Planned {
    pub site: FuncSite,
    /// Allocating functions have one (their result and size meet there), except malloc in
    /// calls mode; free does not.
    pub uretprobe: bool,
    pub placement: Placement,
}

impl Planned {
    /// Where in the file the entry probe goes, and the uretprobe with it (`placement::choose`:
    /// a place where the return address is still at [rsp], the two sharing one trap).
    pub fn file_offset(&self) -> u64 {
        self.site.file_offset + self.placement.offset
    }

    /// The entry probe's cookie: the pushes before the probe point, and whether the call is
    /// counted at its entry (see heaptrace_common::COOKIE_NO_RETURN).
    pub fn cookie(&self) -> u64 {
        let at_entry = !self.uretprobe && self.site.func != Func::Free;
        u64::from(self.placement.pushes) | if at_entry { COOKIE_NO_RETURN } else { 0 }
    }
}

/// Whether a function needs a return probe. In calls mode malloc does without one: it is
/// counted at its entry. That takes a trap off every malloc, and is exact as long as malloc
/// runs no other family member inside it, which holds for the C allocators (glibc, jemalloc,
/// tcmalloc). Every other function keeps its return probe: it may run malloc or free inside
/// (realloc(NULL, n), small-alignment posix_memalign), and only its return closes the window
/// in which such a nested call is told apart. A custom allocator's malloc (`--allocator-symbols`)
/// may wrap anything, and keeps its return probe too.
fn needs_uretprobe(provider: &Provider, site: &FuncSite, calls: bool) -> bool {
    match site.func {
        Func::Free => false,
        Func::Malloc if calls => !(provider.abi == Abi::C && site.symbol == "malloc"),
        _ => true,
    }
}

/// Decides where each function's entry probe goes, from the provider file's code.
/// `at_entry` keeps every probe at its function's entry; `calls` is calls mode.
pub fn plan(provider: &Provider, at_entry: bool, calls: bool) -> Result<Vec<Planned>> {
    provider
        .sites
        .iter()
        .map(|site| {
            let uretprobe = needs_uretprobe(provider, site, calls);
            let code = elf::code(&provider.file, site, placement::WINDOW)?;
            let placement = if at_entry {
                placement::entry(&code, "entry: --probe-at-entry")
            } else {
                let reads = match (provider.abi, site.func) {
                    (Abi::Rust, Func::Realloc) => &[Register::RDI, Register::RCX][..],
                    (Abi::Rust, Func::Calloc) => &[Register::RDI][..],
                    _ => placement::reads(site.func),
                };
                placement::choose(&code, site.func, uretprobe, reads)
            };
            Ok(Planned {
                site: site.clone(),
                uretprobe,
                placement,
            })
        })
        .collect()
}

/// The order the entry probes of one file go on: the functions that release a block (free,
/// then realloc) before any that only allocate. Counting is already on when a file is
/// attached later (a new process's allocator under `--all`, a new image's after an exec), so
/// the file's probes start counting one link at a time; in this order every block counted
/// from the file has its release probed already. A free seen before the allocating functions
/// are is of a block not seen allocated, as a free of one allocated before the attach.
pub fn releasing_first(plan: &[Planned]) -> Vec<&Planned> {
    let mut order: Vec<&Planned> = plan.iter().collect();
    order.sort_by_key(|p| match p.site.func {
        Func::Free => 0,
        Func::Realloc => 1,
        _ => 2,
    });
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(func: Func) -> Planned {
        Planned {
            site: crate::targets::elf::FuncSite {
                func,
                symbol: func.name().into(),
                vaddr: 0x1000,
                file_offset: 0x1000,
                size: 16,
                aliases: Vec::new(),
            },
            uretprobe: func != Func::Free,
            placement: crate::probe::placement::entry(&[0xc3], "test"),
        }
    }

    #[test]
    fn free_and_realloc_go_on_before_the_allocating_functions() {
        let plan: Vec<Planned> = Func::ALL.into_iter().map(planned).collect();
        let order: Vec<Func> = releasing_first(&plan)
            .into_iter()
            .map(|p| p.site.func)
            .collect();
        assert_eq!(order[..2], [Func::Free, Func::Realloc]);
        assert_eq!(order.len(), Func::ALL.len());
        let mut rest = order[2..].to_vec();
        rest.sort_by_key(|f| *f as u32);
        let mut others: Vec<Func> = Func::ALL
            .into_iter()
            .filter(|f| !matches!(f, Func::Free | Func::Realloc))
            .collect();
        others.sort_by_key(|f| *f as u32);
        assert_eq!(rest, others);
    }

    /// The entry programs read the attach cookie only in calls mode (and free only with a
    /// call in flight): an allocating function with a return probe must have cookie 0, its
    /// probe past no push and counted at its return, whatever its prologue.
    #[test]
    fn a_function_with_a_return_probe_has_no_cookie() {
        let prologues: [&[u8]; 4] = [
            // push %rbx; test %rdi,%rdi; je +2; push %rbp; ...
            &[0x53, 0x48, 0x85, 0xff, 0x74, 0x02, 0x55, 0x5d, 0x5b, 0xc3],
            // push %rbp; mov %rsp,%rbp; push %rbx
            &[0x55, 0x48, 0x89, 0xe5, 0x53, 0xc3],
            // nop; push %r12; push %rbp
            &[0x90, 0x41, 0x54, 0x55, 0xc3],
            // cmpb $0x0,0x0(%rip); je +0; push %rbp
            &[0x80, 0x3d, 0, 0, 0, 0, 0, 0x74, 0x00, 0x55, 0xc3],
        ];
        for func in Func::ALL.into_iter().filter(|f| *f != Func::Free) {
            for code in prologues {
                let placement = crate::probe::placement::choose(
                    code,
                    func,
                    true,
                    crate::probe::placement::reads(func),
                );
                let planned = Planned {
                    site: crate::targets::elf::FuncSite {
                        func,
                        symbol: func.name().into(),
                        vaddr: 0x1000,
                        file_offset: 0x1000,
                        size: code.len() as u64,
                        aliases: Vec::new(),
                    },
                    uretprobe: true,
                    placement,
                };
                assert_eq!(
                    planned.cookie(),
                    0,
                    "{func:?} {code:x?}: {:?}",
                    planned.placement
                );
                // Without its return probe (calls mode's malloc) the same function has one.
                let at_entry = Planned {
                    uretprobe: false,
                    ..planned
                };
                assert_eq!(at_entry.cookie() & COOKIE_NO_RETURN, COOKIE_NO_RETURN);
            }
        }
        // And free, probed past a push before its NULL check, says how many.
        let code = [0x53, 0x48, 0x85, 0xff, 0x74, 0x02, 0x55, 0x5d, 0x5b, 0xc3];
        let reads = crate::probe::placement::reads(Func::Free);
        let placement = crate::probe::placement::choose(&code, Func::Free, false, reads);
        assert_eq!(placement.pushes, 1);
    }
}
