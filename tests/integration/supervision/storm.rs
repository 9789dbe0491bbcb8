//! A command that takes SIGALRM every 50 us (20 kHz): each signal used to stop it in its
//! tracer, and it livelocked once a stop's round trip took longer than the period. Its tracer
//! lets it go once signals come that fast; it finishes, its counts stay exact, and the JSON
//! says it was let go of.
use super::*;

/// Rounds of work: about 0.2 s alone here.
const ROUNDS: &str = "300000";
/// One malloc(48) every 16 rounds.
const MALLOCS: u64 = 300_000 / 16;

/// The fixture's own measure of its run, in microseconds, from its stdout.
fn elapsed_us(stdout: &str) -> u64 {
    stdout
        .split_whitespace()
        .find_map(|w| w.strip_prefix("elapsed_us="))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no elapsed_us in {stdout:?}"))
}

fn storm(flags: &[&str]) {
    let alone = Command::new(supervise())
        .args(["timer", ROUNDS])
        .output()
        .expect("run the fixture");
    let alone = elapsed_us(&String::from_utf8_lossy(&alone.stdout));
    let json = json_path("sup-storm");
    let started = Instant::now();
    let mut child = heaptrace()
        .args(["--no-tui", "--mode", "counts", "--json"])
        .arg(&json)
        .args(flags)
        .arg("--")
        .arg(supervise())
        .args(["timer", ROUNDS])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn heaptrace");
    // Generous: "did not livelock", not a measure of speed.
    let bound = HANG.max(Duration::from_micros(alone * 20));
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > bound {
            let _ = child.kill();
            panic!("still running after {bound:?} (alone: {alone} us): livelocked");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let traced = elapsed_us(&String::from_utf8_lossy(&out.stdout));
    println!(
        "{flags:?}: alone {alone} us, under heaptrace {traced} us ({:.2}x)",
        traced as f64 / alone.max(1) as f64
    );
    let doc = read_json(&json);
    assert_eq!(doc["target"]["exit_code"], 0);
    assert_eq!(
        function(&doc, "malloc"),
        (MALLOCS, MALLOCS * 48),
        "{stderr}"
    );
    assert_eq!(function(&doc, "free"), (MALLOCS, MALLOCS * 48), "{stderr}");
    let released = &doc["target"]["released"];
    assert!(
        released["signals_per_second"].as_u64().unwrap_or(0) > 1000,
        "{released}: {stderr}"
    );
    assert!(stderr.contains("let go of"), "{stderr}");
}

bpf_test!(
    shared,
    fn a_launched_command_taking_20_khz_of_signals_runs_on() {
        storm(&[]);
    }
);

#[test]
fn an_in_process_command_taking_20_khz_of_signals_runs_on() {
    let _g = shared();
    storm(&[IN_PROCESS]);
}
