use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

fn main() -> anyhow::Result<()> {
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
