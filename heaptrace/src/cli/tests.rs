use super::*;

#[test]
fn parses_durations() {
    assert_eq!(parse_duration("1s"), Ok(Duration::from_secs(1)));
    assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
    assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
    assert_eq!(parse_duration("5ms"), Ok(Duration::from_millis(5)));
    assert!(parse_duration("0").is_err());
    assert!(parse_duration("fast").is_err());
}

#[test]
fn target_flags_conflict() {
    assert!(Cli::try_parse_from(["heaptrace", "-p", "1", "--all"]).is_err());
    assert!(Cli::try_parse_from(["heaptrace", "--all", "--", "ls"]).is_err());
    let c = Cli::try_parse_from(["heaptrace", "--", "ls", "-l"]).unwrap();
    assert_eq!(c.trace.command, vec!["ls", "-l"]);
}

#[test]
fn record_and_report_parse() {
    let c = Cli::try_parse_from(["heaptrace", "record", "-o", "t.bin", "-p", "7"]).unwrap();
    let Some(Command::Record(r)) = c.subcommand else {
        panic!("not record")
    };
    assert_eq!((r.output.to_str(), r.trace.pid), (Some("t.bin"), Some(7)));
    let c = Cli::try_parse_from(["heaptrace", "record", "-o", "t.bin", "--", "ls"]).unwrap();
    let Some(Command::Record(r)) = c.subcommand else {
        panic!("not record")
    };
    assert_eq!(r.trace.command, vec!["ls"]);
    let c = Cli::try_parse_from(["heaptrace", "report", "t.bin", "flame", "--by", "live"]).unwrap();
    let Some(Command::Report(r)) = c.subcommand else {
        panic!("not report")
    };
    assert_eq!((r.view, r.by), (View::Flame, FlameBy::Live));
    let c = Cli::try_parse_from(["heaptrace", "report", "t.bin"]).unwrap();
    let Some(Command::Report(r)) = c.subcommand else {
        panic!("not report")
    };
    assert_eq!(r.view, View::Overview);
    assert!(Cli::try_parse_from(["heaptrace", "report", "t.bin", "--export", "pprof"]).is_err());
}

#[test]
fn sample_bytes_parse_and_default_to_exact() {
    let c = Cli::try_parse_from(["heaptrace", "--sample-bytes", "65536", "-p", "1"]).unwrap();
    assert_eq!(c.trace.sample_bytes, 65536);
    let c = Cli::try_parse_from(["heaptrace", "-p", "1"]).unwrap();
    assert_eq!(c.trace.sample_bytes, 0);
    assert!(Cli::try_parse_from(["heaptrace", "--sample-bytes", "x", "-p", "1"]).is_err());
}

#[test]
fn subcommands_leave_the_tracing_flags_alone() {
    let c = Cli::try_parse_from(["heaptrace", "probes", "-p", "7"]).unwrap();
    assert!(matches!(
        c.subcommand,
        Some(Command::Probes(ProbesArgs { pid: Some(7), .. }))
    ));
    let c = Cli::try_parse_from(["heaptrace", "probes"]).unwrap();
    assert!(matches!(
        c.subcommand,
        Some(Command::Probes(ProbesArgs { pid: None, .. }))
    ));
    let c = Cli::try_parse_from(["heaptrace", "-p", "7"]).unwrap();
    assert!(c.subcommand.is_none());
    assert_eq!(c.trace.pid, Some(7));
    let c = Cli::try_parse_from(["heaptrace", "--all", "--probe-at-entry"]).unwrap();
    assert!(c.trace.all && c.trace.probe_at_entry && c.subcommand.is_none());
    // After --, "probes" is the command to launch.
    let c = Cli::try_parse_from(["heaptrace", "--", "probes", "x"]).unwrap();
    assert!(c.subcommand.is_none());
    assert_eq!(c.trace.command, vec!["probes", "x"]);
    let c = Cli::try_parse_from(["heaptrace", "-p", "7", "--allocator-symbols", "rust"]);
    assert!(c.unwrap().trace.allocator_symbols.is_some());
    assert!(Cli::try_parse_from(["heaptrace", "--all", "--allocator-symbols", "rust"]).is_err());
    assert!(
        Cli::try_parse_from(["heaptrace", "-p", "7", "--allocator-symbols", "x=y,free=z"]).is_err()
    );
    // Tracing flags do not mix with a subcommand.
    assert!(Cli::try_parse_from(["heaptrace", "-q", "probes"]).is_err());
}

/// Every help text: `heaptrace` and each command, short and long.
fn helps() -> Vec<(String, String)> {
    use clap::CommandFactory as _;
    let mut out = Vec::new();
    let mut names = vec![None];
    names.extend(
        Cli::command()
            .get_subcommands()
            .map(|c| Some(c.get_name().to_string())),
    );
    for name in names {
        for flag in ["-h", "--help"] {
            let mut args = vec!["heaptrace".to_string()];
            args.extend(name.clone());
            args.push(flag.into());
            let e = Cli::try_parse_from(&args).unwrap_err();
            out.push((args.join(" "), e.render().to_string()));
        }
    }
    out
}

#[test]
fn every_help_fits_in_80_columns_and_has_examples() {
    for (cmd, text) in helps() {
        for line in text.lines() {
            assert!(line.chars().count() <= 80, "{cmd}: {line:?}");
        }
        // clap's own `help` command has none to give.
        if !cmd.starts_with("heaptrace help") {
            assert!(text.contains("Examples:\n  "), "{cmd}:\n{text}");
        }
    }
}

#[test]
fn the_short_help_keeps_the_long_explanations_for_the_long_one() {
    let all = helps();
    let text = |c: &str| &all.iter().find(|(k, _)| k == c).unwrap().1;
    let (short, long) = (text("heaptrace -h"), text("heaptrace --help"));
    assert!(short.contains("sample one allocation per N bytes"));
    assert!(!short.contains("Poisson"));
    assert!(long.contains("Poisson"));
}

/// Whether `text` names the option `long` (not only a longer one it begins).
fn names(text: &str, long: &str) -> bool {
    text.match_indices(long).any(|(i, _)| {
        !text[i + long.len()..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '-')
    })
}

/// The README's option tables and `--help` name the same options: every option the README
/// names exists, and every visible option of tracing and of `report` is in the README.
#[test]
fn the_readme_and_the_help_name_the_same_options() {
    use clap::CommandFactory as _;
    let readme = include_str!("../../../README.md");
    let longs = |c: &clap::Command| -> Vec<String> {
        c.get_arguments()
            .filter(|a| !a.is_hide_set())
            .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
            .filter(|l| l != "--help" && l != "--version")
            .collect()
    };
    let top = Cli::command();
    let mut known: Vec<String> = longs(&top);
    known.extend(["--help".to_string(), "--version".to_string()]);
    for sub in top.get_subcommands() {
        known.extend(longs(sub));
        for l in longs(sub) {
            if ["report", "probes"].contains(&sub.get_name()) {
                assert!(
                    names(readme, &l),
                    "README does not name `{} {l}`",
                    sub.get_name()
                );
            }
        }
    }
    for l in longs(&top) {
        assert!(
            names(readme, &l),
            "README's options table does not name {l}"
        );
    }
    // The other way: every `--option` the README names in backquotes is one heaptrace has.
    for (i, _) in readme.match_indices("`--") {
        let name: String = readme[i + 1..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
            .collect();
        if name == "--" {
            continue; // `-- CMD ARGS`
        }
        assert!(
            known.contains(&name),
            "README names {name}, which heaptrace has not"
        );
    }
}

#[test]
fn a_command_name_where_a_target_was_expected_gets_the_line_that_traces_it() {
    let hint = |args: &[&str]| {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let e = Cli::try_parse_from(&args).unwrap_err();
        suggest::command_hint(&args, &e)
    };
    assert!(
        hint(&["heaptrace", "ls", "-l"])
            .unwrap()
            .contains("did you mean `heaptrace -- ls -l`?")
    );
    assert!(
        hint(&["heaptrace", "-q", "ls", "a b"])
            .unwrap()
            .contains("`heaptrace -q -- ls 'a b'`")
    );
    assert!(
        hint(&["heaptrace", "reprot", "t.bin"])
            .unwrap()
            .contains("did you mean `heaptrace report t.bin`?")
    );
    // An unknown option is clap's to explain.
    assert_eq!(hint(&["heaptrace", "--bogus"]), None);
}

#[test]
fn bare_usage_shows_the_usage_and_examples() {
    let text = suggest::bare_usage();
    assert!(text.starts_with("Usage: heaptrace"), "{text}");
    assert!(text.contains("Examples:\n  sudo heaptrace -- ./prog args"));
}

#[test]
fn completions_and_the_manual_page_come_from_the_same_definitions() {
    use clap::CommandFactory as _;
    for shell in [
        clap_complete::Shell::Bash,
        clap_complete::Shell::Zsh,
        clap_complete::Shell::Fish,
    ] {
        let mut buf = Vec::new();
        clap_complete::generate(shell, &mut Cli::command(), "heaptrace", &mut buf);
        let text = String::from_utf8(buf).unwrap();
        for word in ["sample-bytes", "report", "--export"] {
            assert!(
                text.contains(word.trim_start_matches('-')),
                "{shell:?} lacks {word}"
            );
        }
        // fish completes no positional values.
        if shell != clap_complete::Shell::Fish {
            assert!(text.contains("hotspots"), "{shell:?} lacks the views");
        }
    }
    let mut buf = Vec::new();
    clap_mangen::Man::new(Cli::command())
        .render(&mut buf)
        .unwrap();
    let page = String::from_utf8(buf).unwrap();
    assert!(page.contains(".TH heaptrace 1"));
    assert!(page.contains("sample\\-bytes"));
    assert!(page.contains("Examples:"));
}

/// Each kernel map's capacity is checked as it is parsed, naming the option and its range: a
/// size the kernel refuses used to fail at load as "failed to create map `LIVE`".
#[test]
fn map_sizes_out_of_range_name_the_option_and_the_range() {
    for (flag, max) in [
        ("--live-map-size", 1u64 << 26),
        ("--stack-map-size", 1 << 24),
        ("--site-map-size", 1 << 22),
        ("--size-map-size", 1 << 24),
        ("--inflight-map-size", 1 << 22),
    ] {
        for bad in ["0".to_string(), (max + 1).to_string(), u32::MAX.to_string()] {
            let e = Cli::try_parse_from(["heaptrace", flag, &bad, "--", "ls"]).unwrap_err();
            let line = e.to_string();
            let line = line.lines().next().unwrap();
            assert!(
                line.contains(flag) && line.contains(&format!("1..={max}")),
                "{flag} {bad}: {line}"
            );
        }
        let ok = Cli::try_parse_from(["heaptrace", flag, &max.to_string(), "--", "ls"]);
        assert!(ok.is_ok(), "{flag} {max}");
    }
}

/// `--comm` and `--cgroup` filter `--all` only: with -p or a command they were accepted and
/// ignored.
#[test]
fn process_filters_are_refused_with_one_target() {
    for (flag, value) in [("--comm", "x"), ("--cgroup", "/x")] {
        let e = Cli::try_parse_from(["heaptrace", "-p", "1", flag, value]).unwrap_err();
        assert!(e.to_string().contains(flag), "{e}");
        let e = Cli::try_parse_from(["heaptrace", flag, value, "--", "ls"]).unwrap_err();
        assert!(e.to_string().contains(flag), "{e}");
        assert!(Cli::try_parse_from(["heaptrace", "--all", flag, value]).is_ok());
    }
}

/// The command and its arguments are bytes: one that is not UTF-8 is taken as given.
#[test]
fn a_command_argument_need_not_be_utf8() {
    use std::{ffi::OsString, os::unix::ffi::OsStringExt as _};
    let odd = OsString::from_vec(vec![b'a', 0xff, 0xfe]);
    let args: Vec<OsString> = ["heaptrace", "--", "./prog"]
        .into_iter()
        .map(OsString::from)
        .chain([odd.clone()])
        .collect();
    let c = Cli::try_parse_from(args).unwrap();
    assert_eq!(c.trace.command, vec![OsString::from("./prog"), odd]);
}
