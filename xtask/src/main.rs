//! `cargo xtask setup|run|test|bench`: the README's commands, and the benchmark suite. Each installs what is missing first, so a
//! fresh machine needs nothing else; when everything is there, setup takes well under a second.
use std::{
    env,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

use anyhow::{Context as _, Result, bail};

mod bench;

const BPF_LINKER_VERSION: &str = "0.13.0";
/// The LLVM majors bpf-linker 0.13.0 can be built for (its `llvm-N` features).
const BPF_LINKER_LLVM: std::ops::RangeInclusive<u32> = 21..=23;
/// Debian packages running needs: a C compiler and libc's headers for the demo workload.
const RUN_APT_PACKAGES: &[&str] = &["gcc", "libc6-dev"];
/// And what the tests need besides: the fixtures' compilers and runtimes, gdb for `gcore` (the
/// heap census of a core), tmux for the live view, and the tools the exports are checked with
/// (go tool pprof, ms_print, a headless chromium for the HTML report, heaptrack for the
/// temporaries' rule), the real services the tests trace (Redis, PostgreSQL, nginx), and
/// Prometheus, which scrapes `--serve` in its tests.
const TEST_APT_PACKAGES: &[&str] = &[
    "g++",
    "libjemalloc2",
    "gdb",
    "tmux",
    "golang-go",
    "valgrind",
    "chromium",
    "heaptrack",
    "redis-server",
    "postgresql",
    "nginx",
    "prometheus",
];

/// What a task installs when it is missing.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Needs {
    /// Building and running heaptrace on the demo workload.
    Run,
    /// Everything the tests and benchmarks use too.
    Test,
}

fn main() -> ExitCode {
    match real_main() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn real_main() -> Result<ExitCode> {
    let mut args = env::args().skip(1);
    let task = args.next().unwrap_or_default();
    let rest: Vec<String> = args.collect();
    match task.as_str() {
        "setup" => setup(Needs::Test).map(|()| ExitCode::SUCCESS),
        "run" => {
            setup(Needs::Run)?;
            run(&rest)
        }
        "test" => {
            setup(Needs::Test)?;
            test(&rest)
        }
        "bench" if rest.iter().any(|a| a == "-h" || a == "--help") => {
            println!("{}", bench::USAGE);
            Ok(ExitCode::SUCCESS)
        }
        "bench" => {
            setup(Needs::Test)?;
            bench::bench(&rest)
        }
        _ => {
            eprintln!(
                "usage: cargo xtask setup              install what building and testing need\n       \
                 cargo xtask run [-- ARGS]      trace the demo workload, or run heaptrace ARGS\n       \
                 cargo xtask test [ARGS]        build and run every test (real probes need root)\n       \
                 cargo xtask bench [OPTIONS]    the benchmark suite (BENCHMARKS.md; --help)"
            );
            Ok(ExitCode::from(2))
        }
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn status(cmd: &mut Command) -> Result<()> {
    let s = cmd
        .status()
        .with_context(|| format!("cannot run {cmd:?}"))?;
    if !s.success() {
        bail!("{cmd:?} failed: {s}");
    }
    Ok(())
}

fn output_ok(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn dpkg_installed(pkg: &str) -> bool {
    output_ok(Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg]))
        .is_some_and(|s| s.contains("install ok installed"))
}

fn cargo_bin(name: &str) -> PathBuf {
    let home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env::var_os("HOME").unwrap_or_default()).join(".cargo"));
    home.join("bin").join(name)
}

/// Installs the Debian packages of `packages` that are missing (none: no apt call at all).
fn apt_install(packages: &[&str]) -> Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| !dpkg_installed(p))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: installing Debian packages: {}", missing.join(" "));
    status(Command::new("apt-get").args(["update", "-qq"]))?;
    status(
        Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

/// Installs, only when missing: Debian packages, nightly with rust-src, bpf-linker.
fn setup(needs: Needs) -> Result<()> {
    apt_install(RUN_APT_PACKAGES)?;
    if needs == Needs::Test {
        apt_install(TEST_APT_PACKAGES)?;
    }

    let nightly_ok = output_ok(Command::new("rustup").args([
        "component",
        "list",
        "--installed",
        "--toolchain",
        "nightly",
    ]))
    .is_some_and(|s| s.lines().any(|l| l.starts_with("rust-src")));
    if !nightly_ok {
        eprintln!("xtask: installing the nightly toolchain with rust-src (for the eBPF target)");
        status(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
            "--component",
            "rust-src",
        ]))?;
    }

    bpf_linker()
}

/// The nightly toolchain's LLVM: its version and the shared library rustc itself loads.
struct NightlyLlvm {
    major: u32,
    /// Names one nightly build: release, commit and LLVM version.
    id: String,
    /// A file-name-safe form of `id`.
    dir: String,
    /// The nightly's libLLVM shared library.
    lib: PathBuf,
}

fn nightly_llvm() -> Result<NightlyLlvm> {
    let rustc = |args: &[&str]| {
        output_ok(
            Command::new("rustup")
                .args(["run", "nightly", "rustc"])
                .args(args),
        )
        .with_context(|| format!("cannot run the nightly rustc {}", args.join(" ")))
    };
    let vv = rustc(&["-vV"])?;
    let field = |key: &str| {
        vv.lines()
            .find_map(|l| l.strip_prefix(key))
            .map(str::trim)
            .unwrap_or_default()
            .to_string()
    };
    let (release, commit, llvm) = (
        field("release:"),
        field("commit-hash:"),
        field("LLVM version:"),
    );
    let major: u32 = llvm
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .with_context(|| format!("no LLVM version in the nightly rustc's -vV:\n{vv}"))?;
    let libdir = PathBuf::from(rustc(&["--print", "sysroot"])?.trim()).join("lib");
    let lib = std::fs::read_dir(&libdir)
        .with_context(|| format!("cannot read {}", libdir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libLLVM") && n.contains(".so"))
        })
        // The library itself, not the linker script beside it that names it.
        .find(|p| {
            std::fs::read(p)
                .ok()
                .is_some_and(|b| b.starts_with(b"\x7fELF"))
        })
        .with_context(|| {
            format!(
                "the nightly toolchain has no libLLVM in {}",
                libdir.display()
            )
        })?;
    let id = format!("{release} {commit} LLVM {llvm}");
    let dir = format!("{release}-{}", commit.get(..12).unwrap_or(&commit));
    Ok(NightlyLlvm {
        major,
        id,
        dir,
        lib,
    })
}

/// bpf-linker reads the bitcode the nightly's rustc writes, and LLVM's bitcode reader rejects
/// records of a newer LLVM ("Invalid record"). A system LLVM drifts from the nightly's (Debian
/// ships 22 while the nightly moved to 23), so bpf-linker is built against the nightly's own
/// libLLVM: a prefix whose lib/ links to it, which bpf-linker's build links and records as its
/// rpath. A stamp names the nightly it was built for; another nightly rebuilds it (~1 min).
fn bpf_linker() -> Result<()> {
    let llvm = nightly_llvm()?;
    let home = cargo_bin("").parent().expect("cargo home").to_path_buf();
    let base = home.join("heaptrace-llvm");
    let stamp = base.join("bpf-linker.stamp");
    let want = format!("bpf-linker {BPF_LINKER_VERSION} for {}\n", llvm.id);
    let linker = cargo_bin("bpf-linker");
    let runs = output_ok(Command::new(&linker).arg("--version"))
        .is_some_and(|v| v.contains(BPF_LINKER_VERSION));
    if runs && std::fs::read_to_string(&stamp).is_ok_and(|s| s == want) {
        return Ok(());
    }
    if !BPF_LINKER_LLVM.contains(&llvm.major) {
        bail!(
            "the nightly toolchain's LLVM ({}) is not one bpf-linker {BPF_LINKER_VERSION} can be \
             built for ({}-{})",
            llvm.id,
            BPF_LINKER_LLVM.start(),
            BPF_LINKER_LLVM.end()
        );
    }
    let prefix = base.join(&llvm.dir);
    let lib = prefix.join("lib");
    std::fs::create_dir_all(&lib).with_context(|| format!("cannot create {}", lib.display()))?;
    let name = llvm.lib.file_name().expect("a file");
    // The build links -lLLVM; the loader then looks for the library's soname, its file name.
    for link in [lib.join("libLLVM.so"), lib.join(name)] {
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&llvm.lib, &link)
            .with_context(|| format!("cannot link {}", link.display()))?;
    }
    eprintln!(
        "xtask: building bpf-linker {BPF_LINKER_VERSION} against the nightly's LLVM ({}, ~1 min)",
        llvm.id
    );
    status(
        Command::new("cargo")
            .args([
                "install",
                &format!("bpf-linker@{BPF_LINKER_VERSION}"),
                "--locked",
                "--force",
                "--no-default-features",
                "--features",
                &format!("llvm-{}", llvm.major),
            ])
            .env("LLVM_PREFIX", &prefix),
    )?;
    std::fs::write(&stamp, want).with_context(|| format!("cannot write {}", stamp.display()))?;
    Ok(())
}

fn cargo() -> Command {
    let mut c = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    c.current_dir(root());
    // aya-build finds bpf-linker on PATH.
    let path = env::var_os("PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = env::split_paths(&path).collect();
    dirs.insert(0, cargo_bin(""));
    c.env("PATH", env::join_paths(dirs).expect("PATH"));
    c
}

fn run(args: &[String]) -> Result<ExitCode> {
    status(cargo().args(["build", "--release", "-p", "heaptrace"]))?;
    let bin = root().join("target/release/heaptrace");
    let args: Vec<String> = if args.is_empty() {
        let demo = build_demo()?;
        eprintln!(
            "xtask: no arguments: tracing the demo workload ({})",
            demo.display()
        );
        vec!["--".into(), demo.display().to_string(), "4".into()]
    } else {
        args.iter().skip_while(|a| *a == "--").cloned().collect()
    };
    let s = Command::new(&bin)
        .args(&args)
        .status()
        .with_context(|| format!("cannot run {}", bin.display()))?;
    Ok(ExitCode::from(s.code().unwrap_or(1).clamp(0, 255) as u8))
}

/// The demo: a small multithreaded program with a known mix of calls and a few leaks.
fn build_demo() -> Result<PathBuf> {
    let out = root().join("target/fixtures");
    std::fs::create_dir_all(&out)?;
    let bin = out.join("demo");
    status(
        Command::new("gcc")
            .args(["-O1", "-g", "-fno-builtin", "-pthread", "-o"])
            .arg(&bin)
            .arg(root().join("tests/fixtures/demo.c")),
    )?;
    Ok(bin)
}

fn test(args: &[String]) -> Result<ExitCode> {
    // The integration tests run target/debug/heaptrace; build it with the tests.
    let s = cargo()
        .args(["test", "--workspace", "--exclude", "heaptrace-ebpf"])
        .args(args)
        .status()?;
    Ok(ExitCode::from(s.code().unwrap_or(1).clamp(0, 255) as u8))
}
