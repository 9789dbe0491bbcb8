//! What a busy host needs: a loss that names the option giving its map room, and processes of
//! one command run many times as one row (`--group-by command`).
use crate::support::*;

bpf_test!(
    shared,
    /// `recurse 8`'s 511 stacks in a stack map of 16: the summary's lost line names the flag.
    fn a_full_stack_map_names_the_flag_that_gives_it_room() {
        let out = run_ok(
            heaptrace()
                .args([
                    "--no-tui",
                    "-q",
                    "--mode",
                    "stacks",
                    "--stack-map-size",
                    "16",
                ])
                .arg("--")
                .arg(fixture("recurse", "", &[]))
                .arg("8"),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lost = stderr
            .lines()
            .find(|l| l.starts_with("lost: "))
            .unwrap_or_else(|| panic!("no lost line: {stderr}"));
        assert!(
            lost.contains("stack ") && lost.contains("(raise --stack-map-size)"),
            "{lost}"
        );
        assert!(
            stderr
                .contains("[more frames lost: no room in the stack maps; raise --stack-map-size]"),
            "{stderr}"
        );
    }
);

/// A shell script that runs `sites 10` three times at once: four processes, three of one
/// command.
fn three_sites() -> String {
    format!(
        "for i in 1 2 3; do {} 10 & done; wait",
        fixture("sites", "", &[]).display()
    )
}

bpf_test!(
    shared,
    /// The summary's processes and sites, and a report's hotspots: the three `sites` as one
    /// row, their sites merged by frames (10 calls each at alloc_a: 30).
    fn processes_of_one_command_are_one_row_grouped_by_command() {
        // Frame pointers only (the fixture has them): a process exec'ed in a followed tree
        // gets its unwind tables at the daemon's next read of its mappings, so its first calls
        // can take a longer or shorter stack than its later ones, one site then reading as two
        // (docs/unwinding.md, timing). This test is about grouping, not unwinding.
        let out = run_ok(heaptrace().args([
            "--no-tui",
            "-q",
            "--unwind-table-size",
            "0",
            "--follow-forks",
            "--group-by",
            "command",
            "--",
            "sh",
            "-c",
            &three_sites(),
        ]));
        let stderr = String::from_utf8_lossy(&out.stderr);
        let rows: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains("sites (3 processes)") && l.trim_start().starts_with("group"))
            .collect();
        assert_eq!(rows.len(), 1, "{stderr}");
        // 33 calls each (sites.c: 10 + 10 + 10 + 3), summed.
        assert!(
            rows[0].split_whitespace().nth(4) == Some("99"),
            "{}",
            rows[0]
        );
        // Each site once, for the three: no per-pid copies.
        let at_a: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains("alloc_a (sites.c:") && l.contains("calls"))
            .collect();
        assert!(!at_a.is_empty(), "{stderr}");
        for l in &at_a {
            assert!(
                l.contains("[sites (3 processes)]") && l.contains(" 30 calls"),
                "{l}\n{stderr}"
            );
        }

        let rec = workspace().join(format!(
            "target/test-out/grouped-{}.bin",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&rec);
        run_ok(heaptrace().args(["record", "-o"]).arg(&rec).args([
            "-q",
            "--unwind-table-size",
            "0",
            "--follow-forks",
            "--",
            "sh",
            "-c",
            &three_sites(),
        ]));
        let out =
            run_ok(
                heaptrace()
                    .arg("report")
                    .arg(&rec)
                    .args(["hotspots", "--group-by", "command"]),
            );
        let text = String::from_utf8_lossy(&out.stdout);
        let a: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("alloc_a (sites.c:"))
            .collect();
        assert!(!a.is_empty(), "{text}");
        assert!(
            a.iter().all(|l| l.contains("[sites (3 processes)]")),
            "{text}"
        );
        let _ = std::fs::remove_file(&rec);
    }
);

bpf_test!(
    shared,
    /// A pre-fork server's processes all have one command: grouped, they are one process of the
    /// summary, whose figures are the whole tree's (100 blocks in the parent, 10 in each of
    /// three workers), not those of the root's pid alone.
    fn a_tree_of_one_command_grouped_is_summed_whole() {
        let out = run_ok(
            heaptrace()
                .args(["--no-tui", "-q", "--follow-forks", "--group-by", "command"])
                .arg("--")
                .arg(fixture("forkers", "", &[]))
                .arg("10"),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        let total = stderr
            .lines()
            .find(|l| l.starts_with("total: "))
            .unwrap_or_else(|| panic!("no total: {stderr}"));
        assert!(total.starts_with("total: 130 allocations"), "{total}");
        let rows: Vec<&str> = stderr
            .lines()
            .filter(|l| l.trim_start().starts_with("group forkers (4 processes)"))
            .collect();
        assert_eq!(rows.len(), 1, "{stderr}");
        assert!(
            rows[0].split_whitespace().nth(4) == Some("130"),
            "{}",
            rows[0]
        );
    }
);
