//! `--sizes`: the recording sizes of the workloads at P = 8, once and looped for a while.
use super::*;

/// The recording-size runs: each workload once (its natural work) under `heaptrace record` and
/// heaptrack, then under `heaptrace record` looping for `--seconds`.
pub(super) fn sizes(b: &Bench, o: &Options, out: &Path) -> Result<ExitCode> {
    let mut meta = machine();
    meta["scale"] = json!(o.scale);
    meta["seconds"] = json!(o.seconds);
    meta["loadavg_start"] = json!(loadavg());
    let mut rows = Vec::new();
    let mut waited = Duration::ZERO;
    for w in &o.workloads {
        for &p in &o.threads {
            let _lock = quiet_host(&mut waited)?;
            let once = b.run(w, p, Kind::Record, 0, None)?;
            let htk = if b.heaptrack {
                Some(b.run(w, p, Kind::Heaptrack, 0, None)?)
            } else {
                None
            };
            let looped = b.run(w, p, Kind::Record, 0, Some(o.seconds))?;
            eprintln!(
                "xtask: sizes {w} P={p}: record {} B, heaptrack {} B, {:.0} s loop {} B",
                once.file_bytes.unwrap_or(0),
                htk.as_ref().and_then(|h| h.file_bytes).unwrap_or(0),
                looped.elapsed,
                looped.file_bytes.unwrap_or(0)
            );
            rows.push((once, htk, looped));
        }
    }
    meta["loadavg_end"] = json!(loadavg());
    let mut t = String::new();
    let _ = writeln!(
        t,
        "Recording sizes, stacks mode, scale {}; {}\n",
        o.scale,
        describe(&meta)
    );
    let _ = writeln!(
        t,
        "| workload | P | calls | heaptrace recording | its HTML page | heaptrack (.zst) | heaptrace, {:.0} s loop: calls | rounds | recording | its HTML page | stacks | lost stacks |",
        o.seconds
    );
    let _ = writeln!(t, "|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (once, htk, looped) in &rows {
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            once.workload,
            once.threads,
            count(once.calls),
            bytes(once.file_bytes),
            bytes(once.html_bytes),
            htk.as_ref().map_or("-".into(), |h| bytes(h.file_bytes)),
            count(looped.calls),
            count(looped.rounds),
            bytes(looped.file_bytes),
            bytes(looped.html_bytes),
            count(looped.stacks),
            count(looped.lost_stack),
        );
    }
    println!("{t}");
    fs::write(out.join("sizes.md"), &t)?;
    let all: Vec<Value> = rows
        .iter()
        .flat_map(|(a, h, l)| {
            [Some(a), h.as_ref(), Some(l)]
                .into_iter()
                .flatten()
                .map(Run::to_json)
        })
        .collect();
    fs::write(
        out.join("sizes.json"),
        serde_json::to_string_pretty(&json!({ "machine": meta, "runs": all }))?,
    )?;
    Ok(ExitCode::SUCCESS)
}
