//! The `Examples:` section of each command's help: real command lines, at most 80 columns.

pub const TRACE: &str = "\
Examples:
  sudo heaptrace -- ./prog args            launch a command and trace it
  sudo heaptrace -p 1234                   attach to a running process
  sudo heaptrace --all --comm nginx        every process named nginx...
  sudo heaptrace --no-tui -q --json out.json -- python3 app.py
  sudo heaptrace --mode counts -p 1234     cheaper: no stacks
  sudo heaptrace record -o trace.bin -p 1234
  heaptrace report trace.bin --export html -o report.html
  heaptrace probes -p 1234                 where the probes would go";

pub const RECORD: &str = "\
Examples:
  sudo heaptrace record -o trace.bin -- ./prog args
  sudo heaptrace record -o trace.bin -p 1234 --interval 500ms
  sudo heaptrace record -o host.bin --all --cgroup nginx.service
  heaptrace report trace.bin --export html -o report.html";

pub const REPORT: &str = "\
Examples:
  heaptrace report trace.bin               functions, totals, leaks
  heaptrace report trace.bin hotspots --top 20
  heaptrace report trace.bin leaks --format json
  heaptrace report trace.bin timeline --from 2s --to 10s
  heaptrace report trace.bin filter --size 4096
  heaptrace report trace.bin tree --reverse
  heaptrace report trace.bin --export html -o report.html
  heaptrace report trace.bin --export svg -o flame.svg
  heaptrace report trace.bin --export pprof -o heap.pb.gz
  heaptrace report trace.bin --export massif -o massif.out
  heaptrace report before.bin hotspots --diff after.bin";

pub const PROBES: &str = "\
Examples:
  heaptrace probes                         the host's libc
  heaptrace probes -p 1234 --mode calls
  heaptrace probes -p 1234 --allocator-symbols prefix:je_";

pub const HEAP: &str = "\
Examples:
  sudo heaptrace heap -p 1234              the census of a running process
  sudo heaptrace heap -p 1234 --stop       held still: exact
  heaptrace heap --core core.1234 --json heap.json
  gcore -o core 1234 && heaptrace heap --core core.1234";

pub const COMPLETIONS: &str = "\
Examples:
  heaptrace completions bash > /etc/bash_completion.d/heaptrace
  heaptrace completions zsh > /usr/local/share/zsh/site-functions/_heaptrace
  heaptrace completions fish > ~/.config/fish/completions/heaptrace.fish";

pub const MAN: &str = "\
Examples:
  heaptrace man | man -l -
  heaptrace man > /usr/local/share/man/man1/heaptrace.1
  heaptrace man report > /usr/local/share/man/man1/heaptrace-report.1";
