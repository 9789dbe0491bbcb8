//! `-p PID --in-process`: heaptrace's library loaded into a running process
//! (`targets::inject`) and counting into a region made there; from then on the trace is the
//! launched `--in-process` one's. At the end, before the last read, every GOT entry is
//! written back; the library stays loaded, inert.
use super::{
    in_process::{Started, capacities, count_as, mode_word, python_walk, unwind_tables},
    *,
};
use crate::{
    drain::{before_attach::BeforeAttach, in_process::Region},
    run_info::Collector,
    targets::{inject, preload},
};

pub(super) fn attach(cli: &TraceArgs, pid: u32) -> Result<Started> {
    let provider = allocator::for_pid(pid)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut made: Option<Region> = None;
    let mut python = None;
    let mut make = |file: std::fs::File| -> Result<(u64, [u64; 2])> {
        let mut region = Region::create_in(
            Some(file),
            capacities(cli),
            mode_word(cli.mode),
            count_as(&provider),
            cli.temporary_allocs,
        )?;
        region.set_pid(pid);
        // Its interpreter in the header before the GOT is written: the first call counted
        // has its Python frames.
        python = python_walk(cli, &region, pid)?;
        if let (Some(py), Ok(maps)) = (python.as_mut(), crate::targets::procfs::maps(pid)) {
            py.sync(pid, &maps);
        }
        // On before the GOT is written: the first call redirected is counted. With a census,
        // on once its blocks are in, the process stopped.
        region.set_counting(!cli.census);
        let out = region.size_and_token();
        made = Some(region);
        Ok(out)
    };
    let loaded = inject::load(pid, preload::library(), &mut make)?;
    let mut region = made.ok_or_else(|| Error::Inject {
        pid,
        reason: "no region was made".into(),
    })?;
    let detach = loaded.detach;
    region.on_stop(Box::new(move || {
        if !crate::targets::procfs::alive(pid) {
            return;
        }
        match inject::unload(pid, detach) {
            Ok(took) => crate::say!(
                "heaptrace: pid {pid}'s GOT entries written back in {:.1} ms; the library \
                 stays loaded, inert",
                took.as_secs_f64() * 1e3
            ),
            Err(e) => crate::say!("heaptrace: warning: {e}"),
        }
    }));
    let before = if cli.census {
        census(&mut region, pid)?
    } else {
        None
    };
    crate::say!(
        "heaptrace: attached in process to pid {pid} (loaded in {:.1} ms, {} GOT entries \
         redirected{}), {}{}",
        loaded.took.as_secs_f64() * 1e3,
        loaded.redirected,
        match loaded.lost {
            0 => String::new(),
            n => format!(", {n} could not be"),
        },
        provider.path.display(),
        match before {
            Some(b) => format!("; {} blocks live before now taken in", b.blocks),
            None =>
                "; blocks allocated before now and freed later count as untracked frees".to_string(),
        }
    );
    let unwind = {
        let _in_runtime = rt.enter();
        let exe = std::ffi::OsString::from(format!("/proc/{pid}/exe"));
        unwind_tables(&region, pid, &exe, &provider)?
    };
    Ok(Started {
        region,
        provider,
        pid,
        child: None,
        unwind,
        python,
        collector: Collector::InProcessAttached,
        before,
        rt,
    })
}

/// `--census`: the blocks the process holds now, read with every thread stopped, put in the
/// region's live table; counting on before the process runs again (it was off since the
/// region was made: calls through the GOT went straight through). None, with a line saying
/// why, where the heap cannot be read (another allocator, an unknown glibc).
fn census(region: &mut Region, pid: u32) -> Result<Option<BeforeAttach>> {
    let held = match crate::heap::blocks_of_process(pid, true) {
        Ok(h) => h,
        Err(e) => {
            region.set_counting(true);
            crate::say!("heaptrace: blocks live before attach not counted: {e}");
            return Ok(None);
        }
    };
    for w in &held.warnings {
        crate::say!("heaptrace: warning: heap of pid {pid} before attach: {w}");
    }
    let taken = region.take_in_before_attach(&held.blocks);
    region.set_counting(true);
    drop(held.frozen);
    let taken = taken?;
    if taken.lost_blocks > 0 {
        crate::say!(
            "heaptrace: warning: {} blocks live before attach did not fit in the live table \
             (--live-map-size): counted lost",
            taken.lost_blocks
        );
    }
    Ok(Some(taken))
}
