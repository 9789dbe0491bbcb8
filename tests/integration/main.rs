//! Integration tests: the real heaptrace binary, real uprobes, C fixtures with known calls.
//! Those declared with `bpf_test!` need root, BTF and uprobes: built where they are missing
//! they are ignored, but in CI (`CI` set) a missing capability fails them.
mod arguments;
mod before_attach;
mod busy;
mod busy_attach;
mod containers;
mod counts;
mod custom;
mod exec;
mod expect;
mod faults;
mod filters;
mod forks;
mod heap;
mod in_process;
mod in_process_unwind;
mod live_map;
mod liveslots;
mod memory;
mod oom;
mod outputs;
mod peak;
mod placement;
mod recording;
mod sampling;
mod scale;
mod sighandler;
mod signals;
mod slots;
mod stacks;
mod support;
mod system;
mod temporaries;
mod threads;
mod tui;
mod unwinding;
