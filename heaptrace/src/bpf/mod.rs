//! The kernel interface: bpf(2) commands aya does not issue, links, mappable arrays, BTF, the
//! kfunc calls patched into the programs, and the programs' own run-time statistics.
pub mod batch;
pub mod btf;
pub mod kfunc;
pub mod links;
pub mod mmap_array;
pub mod proc_states;
pub mod prog_stats;
pub mod sys;
pub mod uprobe_multi;
