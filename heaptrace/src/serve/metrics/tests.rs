use super::*;
use crate::serve::tests_support::add_process;

fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
}

#[test]
fn each_process_has_exact_series() {
    let mut s = Snapshot::default();
    add_process(&mut s, 42, "oracle", "/a.slice", 100, 64, 30);
    let text = render(&s, 10, false);
    let l = r#"{pid="42",command="oracle",cgroup="/a.slice"}"#;
    assert_eq!(
        value(&text, &format!("heaptrace_process_allocations_total{l}")),
        Some(100.0),
        "{text}"
    );
    assert_eq!(
        value(&text, &format!("heaptrace_process_frees_total{l}")),
        Some(30.0)
    );
    assert_eq!(
        value(
            &text,
            &format!("heaptrace_process_allocated_bytes_total{l}")
        ),
        Some(6400.0)
    );
    assert_eq!(
        value(&text, &format!("heaptrace_process_live_blocks{l}")),
        Some(70.0)
    );
    assert_eq!(
        value(&text, &format!("heaptrace_process_live_bytes{l}")),
        Some(4480.0)
    );
    assert_eq!(value(&text, "heaptrace_serve_folded_processes"), Some(0.0));
    // Prometheus's classic format: a counter's TYPE names its _total series, no EOF.
    assert!(
        text.contains("# TYPE heaptrace_process_allocations_total counter"),
        "{text}"
    );
    assert!(!text.contains("# EOF"));
    let om = render(&s, 10, true);
    assert!(
        om.contains("# TYPE heaptrace_process_allocations counter"),
        "{om}"
    );
    assert!(om.ends_with("# EOF\n"));
}

#[test]
fn past_the_cap_the_smallest_processes_fold_into_one_series() {
    let mut s = Snapshot::default();
    for pid in 1..=5u32 {
        add_process(
            &mut s,
            pid,
            &format!("p{pid}"),
            "",
            u64::from(pid) * 10,
            8,
            0,
        );
    }
    let text = render(&s, 2, false);
    // The two that allocated the most keep their own series.
    assert!(
        text.contains(r#"pid="5""#) && text.contains(r#"pid="4""#),
        "{text}"
    );
    assert!(!text.contains(r#"pid="3""#), "{text}");
    let other = r#"{pid="other",command="[3 other processes]",cgroup=""}"#;
    assert_eq!(
        value(
            &text,
            &format!("heaptrace_process_allocations_total{other}")
        ),
        Some(60.0),
        "{text}"
    );
    assert_eq!(value(&text, "heaptrace_serve_folded_processes"), Some(3.0));
}

#[test]
fn exited_processes_have_no_series() {
    let mut s = Snapshot::default();
    add_process(&mut s, 7, "gone", "", 1, 8, 0);
    s.profile.procs.get_mut(&7).unwrap().exited = true;
    let text = render(&s, 10, false);
    assert!(!text.contains(r#"pid="7""#), "{text}");
    assert_eq!(value(&text, "heaptrace_traced_processes"), Some(0.0));
}
