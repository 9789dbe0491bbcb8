//! Running a benchmark's processes: spawn, poll peak RSS, wait without blocking.
use super::*;

/// What the kernel says about a finished process.
pub(super) struct Exited {
    pub(super) wall: f64,
    pub(super) code: i32,
    /// Its own user+system time, and its reaped children's.
    pub(super) self_cpu: f64,
    pub(super) children_cpu: f64,
    /// The largest VmHWM seen while polling it every 10 ms. (wait4's ru_maxrss would not do:
    /// it includes the children's, and the pre-exec image's, which is a fork of this process.)
    pub(super) hwm_kb: u64,
}

pub(super) struct Running {
    pub(super) pid: i32,
    pub(super) start: Instant,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) poller: thread::JoinHandle<u64>,
}

pub(super) fn spawn(cmd: &mut Command) -> Result<Running> {
    let start = Instant::now();
    let child = cmd.spawn().with_context(|| format!("cannot run {cmd:?}"))?;
    let pid = child.id() as i32;
    // The Child is not waited for through std: finish() reaps it with wait4.
    drop(child);
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let poller = thread::spawn(move || {
        let mut max = 0;
        while !s.load(Ordering::Relaxed) {
            if let Some(kb) = vm_hwm_kb(pid) {
                max = max.max(kb);
            }
            thread::sleep(Duration::from_millis(10));
        }
        max
    });
    Ok(Running {
        pid,
        start,
        stop,
        poller,
    })
}

pub(super) fn vm_hwm_kb(pid: i32) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

pub(super) fn exited_nowait(pid: i32, block: bool) -> Result<bool> {
    // SAFETY: waitid on our own child with a zeroed siginfo it fills in.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let flags = libc::WEXITED | libc::WNOWAIT | if block { 0 } else { libc::WNOHANG };
    loop {
        // SAFETY: as above.
        let r = unsafe { libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, flags) };
        if r == 0 {
            // SAFETY: si_pid is set when a child was found, 0 otherwise (WNOHANG).
            return Ok(unsafe { info.si_pid() } != 0);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e).context("waitid");
        }
    }
}

/// Waits for the exit without reaping first, so /proc/PID/stat still holds the process's own
/// times apart from its children's (a launched workload is heaptrace's child); then reaps it.
pub(super) fn finish(r: Running) -> Result<Exited> {
    exited_nowait(r.pid, true)?;
    let wall = r.start.elapsed().as_secs_f64();
    r.stop.store(true, Ordering::Relaxed);
    let hwm_kb = r.poller.join().unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let times = fs::read_to_string(format!("/proc/{}/stat", r.pid))
        .ok()
        .and_then(|s| parse_stat_times(&s, ticks))
        .unwrap_or_default();
    let mut st = 0;
    // SAFETY: reaps our own child.
    if unsafe { libc::waitpid(r.pid, &mut st, 0) } != r.pid {
        bail!("waitpid: {}", std::io::Error::last_os_error());
    }
    let code = if libc::WIFEXITED(st) {
        libc::WEXITSTATUS(st)
    } else {
        128 + libc::WTERMSIG(st)
    };
    Ok(Exited {
        wall,
        code,
        self_cpu: times[0] + times[1],
        children_cpu: times[2] + times[3],
        hwm_kb,
    })
}

pub(super) fn file_out(path: &Path) -> Result<Stdio> {
    Ok(File::create(path)
        .with_context(|| format!("cannot create {}", path.display()))?
        .into())
}

/// Waits until `pred` holds, checking every 10 ms.
pub(super) fn wait_until(
    what: &str,
    timeout: Duration,
    mut pred: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let t0 = Instant::now();
    while !pred()? {
        if t0.elapsed() > timeout {
            bail!("timed out waiting for {what}");
        }
        thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

pub(super) fn proc_state(pid: i32) -> Option<char> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s[s.rfind(')')? + 1..]
        .split_whitespace()
        .next()?
        .chars()
        .next()
}
