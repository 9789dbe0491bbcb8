//! Finding and starting targets: which object provides malloc to a process, its ELF symbols,
//! custom allocator names, /proc and cgroups, and a command started before its first
//! instruction.
pub mod allocator;
pub mod cgroups;
pub mod custom_symbols;
pub mod elf;
pub mod launch;
pub mod procfs;
