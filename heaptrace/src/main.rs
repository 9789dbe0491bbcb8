use std::process::ExitCode;

// Not libc's malloc: under `--all` every call of the malloc heaptrace probes traps into its
// probes, heaptrace's own included (its programs return at once, the trap remains). Without
// transparent huge pages (`no_thp`), its peak RSS is the system allocator's.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

// mimalloc keeps freed pages a second before it returns them (its purge delay). Start-up
// (symbols, ELF files) is a burst whose pages would raise the peak RSS, so they are returned
// at once until the probes are attached; afterwards the delay is back to its default, or each
// round's maps would be given back and faulted in again (BENCHMARKS.md, *The daemon's own
// allocations*).
unsafe extern "C" {
    fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
}
/// `mi_option_purge_delay` in mimalloc v3's `enum mi_option_e` (libmimalloc-sys 0.1.49).
const MI_OPTION_PURGE_DELAY: std::ffi::c_int = 15;

fn main() -> ExitCode {
    // SAFETY: sets an option (a plain integer) before any other thread runs; the option
    // exists in the mimalloc built in (the lock file pins it).
    unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, 0) };
    fn started() {
        // SAFETY: as above; other threads may allocate meanwhile, and read either value.
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, 1000) };
    }
    let _ = heaptrace::cmd::trace::STARTED.set(started);
    let cli = match heaptrace::cli::suggest::parse(std::env::args_os().collect()) {
        Ok(cli) => cli,
        Err(heaptrace::cli::suggest::Stop::Clap(e)) => e.exit(),
        Err(heaptrace::cli::suggest::Stop::Said(code)) => return ExitCode::from(code),
    };
    if matches!(cli.subcommand, Some(heaptrace::cli::Command::Report(_))) {
        started(); // no start-up burst: reading a recording is the work itself
    }
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    use heaptrace::cli::Command;
    let result = match &cli.subcommand {
        Some(Command::Probes(args)) => heaptrace::cmd::probes::run(args),
        Some(Command::Heap(args)) => heaptrace::cmd::heap::run(args),
        Some(Command::Record(args)) => heaptrace::cmd::trace::run(&args.trace, Some(&args.output)),
        Some(Command::Report(args)) => heaptrace::cmd::report::run(args),
        Some(Command::Completions(args)) => heaptrace::cmd::help::completions(args),
        Some(Command::Man(args)) => heaptrace::cmd::help::man(args),
        None => heaptrace::cmd::trace::run(&cli.trace, None),
    };
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) if e.is_broken_pipe() => ExitCode::SUCCESS,
        Err(e) => {
            heaptrace::say!("heaptrace: error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
