use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

fn main() -> anyhow::Result<()> {
    bpf_tests();
    preload()?;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or_else(|| anyhow!("no workspace root"))?
        .join("heaptrace-ebpf");
    let root_dir = root.to_str().context("non-UTF-8 path")?;
    let ebpf = Package {
        name: "heaptrace-ebpf",
        root_dir,
        ..Default::default()
    };
    aya_build::build_ebpf([ebpf], Toolchain::default())
}

/// Sets `heaptrace_no_bpf` where the integration tests could not load BPF programs (not
/// root, no kernel BTF, or no uprobe PMU), so that `bpf_test!` builds them ignored: libtest
/// cannot ignore a test once it runs, and a skipped test would count as passed. Never under
/// CI (`CI` set), where such a machine must fail them. HEAPTRACE_ASSUME_NO_BPF=1 sets it
/// anyway, to see the ignored tests on a machine that has BPF.
fn bpf_tests() {
    println!("cargo::rustc-check-cfg=cfg(heaptrace_no_bpf)");
    println!("cargo::rerun-if-env-changed=HEAPTRACE_ASSUME_NO_BPF");
    // sudo changes it, and whoever builds the tests runs them.
    println!("cargo::rerun-if-env-changed=USER");
    let forced = std::env::var_os("HEAPTRACE_ASSUME_NO_BPF").is_some_and(|v| v == "1");
    let root = effective_uid() == Some(0);
    let btf = std::path::Path::new("/sys/kernel/btf/vmlinux").exists();
    let uprobe = std::path::Path::new("/sys/bus/event_source/devices/uprobe").exists();
    if !forced && root && btf && uprobe {
        // CI cannot change the answer here; not watching it spares a rebuild when it toggles.
        return;
    }
    println!("cargo::rerun-if-env-changed=CI");
    if std::env::var_os("CI").is_none() {
        println!("cargo::rustc-cfg=heaptrace_no_bpf");
    }
}

/// From /proc/self/status (`Uid: real effective saved fs`): no libc in the build script.
fn effective_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let uids = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    uids.split_whitespace().nth(1)?.parse().ok()
}

/// Builds heaptrace-preload (its own workspace: a no_std cdylib needs panic = "abort") into
/// OUT_DIR and tells the code where the library is (`HEAPTRACE_PRELOAD_SO`, embedded with
/// include_bytes!). Run with the preload crate as its current directory, so that its
/// `.cargo/config.toml` (frame pointers) applies, and none of our own build's flags.
fn preload() -> anyhow::Result<()> {
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = manifest
        .parent()
        .ok_or_else(|| anyhow!("no workspace root"))?
        .join("heaptrace-preload");
    for f in [
        "Cargo.toml",
        "Cargo.lock",
        "src",
        ".cargo/config.toml",
        "../heaptrace-common/src",
    ] {
        println!("cargo::rerun-if-changed={}", dir.join(f).display());
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("preload");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = std::process::Command::new(cargo);
    cmd.current_dir(&dir)
        .args(["build", "--release", "--locked", "--target-dir"])
        .arg(&out);
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if k.starts_with("CARGO_") && k != "CARGO_HOME" || k == "RUSTFLAGS" || k == "RUSTC_WRAPPER"
        {
            cmd.env_remove(&k);
        }
    }
    let status = cmd
        .status()
        .context("running cargo for heaptrace-preload")?;
    if !status.success() {
        return Err(anyhow!("building heaptrace-preload failed ({status})"));
    }
    let so = out.join("release/libheaptrace_preload.so");
    println!("cargo::rustc-env=HEAPTRACE_PRELOAD_SO={}", so.display());
    Ok(())
}
