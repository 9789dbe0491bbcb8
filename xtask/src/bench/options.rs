//! `cargo xtask bench`'s options.
use super::*;

#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    pub workloads: Vec<String>,
    pub threads: Vec<u32>,
    pub reps: usize,
    pub scale: f64,
    pub kinds: Vec<Kind>,
    /// The recording-size runs instead of the timing batches.
    pub sizes: bool,
    /// For `--sizes`: how long the looped recording runs.
    pub seconds: f64,
}

pub const USAGE: &str = "\
usage: cargo xtask bench [--quick] [--workloads a,b] [--threads 1,2,4] [--reps N] [--scale F]
                         [--only calls,counts,sizes,stacks,attach-calls,attach-counts,
                                 attach-sizes,attach,record,heaptrack,inproc-counts,
                                 inproc-stacks]
       cargo xtask bench --sizes [--workloads a,b] [--threads 8] [--seconds 60] [--scale F]
  --quick    P = 1 only, scale 0.2 (a few minutes)
  --sizes    recording sizes: each workload once under heaptrace record and heaptrack, then
             under heaptrace record looping for --seconds (see BENCHMARKS.md)";

impl Options {
    pub fn parse(args: &[String]) -> Result<Options> {
        let mut o = Options {
            workloads: WORKLOADS.iter().map(|s| s.to_string()).collect(),
            threads: vec![1, 2, 4],
            reps: 1,
            scale: 1.0,
            kinds: Kind::TRACED.to_vec(),
            sizes: false,
            seconds: 60.0,
        };
        let (mut quick, mut threads, mut scale) = (false, None, None);
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let mut value = || {
                it.next()
                    .cloned()
                    .with_context(|| format!("{a} needs a value"))
            };
            match a.as_str() {
                "--quick" => quick = true,
                "--sizes" => o.sizes = true,
                "--workloads" => {
                    o.workloads = list(&value()?);
                    if let Some(w) = o
                        .workloads
                        .iter()
                        .find(|w| !WORKLOADS.contains(&w.as_str()))
                    {
                        bail!("unknown workload {w} (known: {})", WORKLOADS.join(","));
                    }
                }
                "--threads" | "-P" => {
                    threads = Some(
                        list(&value()?)
                            .iter()
                            .map(|p| p.parse::<u32>().ok().filter(|p| *p >= 1))
                            .collect::<Option<Vec<_>>>()
                            .context("--threads takes numbers >= 1")?,
                    )
                }
                "--reps" => {
                    o.reps = value()?
                        .parse()
                        .ok()
                        .filter(|r| *r >= 1)
                        .context("--reps takes a number >= 1")?
                }
                "--scale" => {
                    scale = Some(
                        value()?
                            .parse::<f64>()
                            .ok()
                            .filter(|s| *s > 0.0)
                            .context("--scale takes a number > 0")?,
                    )
                }
                "--seconds" => {
                    o.seconds = value()?
                        .parse::<f64>()
                        .ok()
                        .filter(|s| *s > 0.0)
                        .context("--seconds takes a number > 0")?
                }
                "--only" => {
                    o.kinds = list(&value()?)
                        .iter()
                        .map(|k| Kind::parse(k))
                        .collect::<Option<Vec<_>>>()
                        .context(
                            "--only takes calls,counts,sizes,stacks,attach-calls,attach-counts,attach-sizes,\
                             attach,record,heaptrack,inproc-counts,inproc-stacks",
                        )?;
                    o.kinds.sort();
                    o.kinds.dedup();
                }
                _ => bail!("unknown argument {a}\n{USAGE}"),
            }
        }
        if quick {
            o.threads = vec![1];
            o.scale = 0.2;
        }
        if o.sizes {
            o.threads = vec![8];
        }
        if let Some(t) = threads {
            o.threads = t;
        }
        if let Some(s) = scale {
            o.scale = s;
        }
        Ok(o)
    }
}

pub(super) fn list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}
