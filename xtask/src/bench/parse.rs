//! Reading what the runs print and write: summaries, the JSON document, /proc stat times.
use super::*;

/// The workload's summary line: `bench: NAME P=.. scale=.. reps=.. elapsed=S cpu=S`.
pub fn parse_summary(out: &str) -> Option<(f64, f64)> {
    let line = out.lines().rev().find(|l| l.starts_with("bench: "))?;
    let field = |key: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .and_then(|v| v.parse::<f64>().ok())
    };
    Some((field("elapsed=")?, field("cpu=")?))
}

/// The parts of heaptrace's `--json` the tables use. The document can be large (binary-trees'
/// is over 100 MB), so it is read as a stream into these alone.
#[derive(Deserialize, Default)]
pub(super) struct HeaptraceDoc {
    #[serde(default)]
    pub(super) rounds: u64,
    #[serde(default)]
    pub(super) functions: BTreeMap<String, FunctionDoc>,
    #[serde(default)]
    pub(super) lost: BTreeMap<String, u64>,
    #[serde(default)]
    pub(super) stacks: Vec<IgnoredAny>,
}

#[derive(Deserialize)]
pub(super) struct FunctionDoc {
    #[serde(default)]
    pub(super) calls: u64,
}

/// From heaptrace's `--json`: (calls of every function, rounds, all lost, lost stacks, stacks).
pub fn parse_heaptrace_json(r: impl std::io::Read) -> Result<(u64, u64, u64, u64, u64)> {
    let d: HeaptraceDoc = serde_json::from_reader(std::io::BufReader::new(r))?;
    Ok((
        d.functions.values().map(|f| f.calls).sum(),
        d.rounds,
        d.lost.values().sum(),
        d.lost.get("stack").copied().unwrap_or(0),
        d.stacks.len() as u64,
    ))
}

/// `utime stime cutime cstime` of /proc/PID/stat, in seconds.
pub fn parse_stat_times(stat: &str, ticks_per_s: f64) -> Option<[f64; 4]> {
    // Fields after the command name, which may hold spaces and parentheses: state is field 3,
    // utime 14, stime 15, cutime 16, cstime 17.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let t = |i: usize| f.get(i)?.parse::<f64>().ok().map(|v| v / ticks_per_s);
    Some([t(11)?, t(12)?, t(13)?, t(14)?])
}

pub fn median(v: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}
