//! Finding and starting targets: what heaptrace may look into, which object provides malloc to
//! a process, its ELF symbols, custom allocator names, /proc and cgroups, a command started
//! before its first instruction, how a process that is not our child ended, and the files of
//! a traced process, opened safely.
pub mod access;
pub mod allocator;
pub mod cgroups;
pub mod custom_symbols;
pub mod elf;
pub mod exit_watch;
pub mod inject;
pub mod launch;
pub mod maps;
pub mod preload;
pub mod procfs;
pub mod seized;
pub mod target_file;
