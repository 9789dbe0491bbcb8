//! A request's query string, bounded and typed: unknown keys and bad values are refused, so a
//! typo never silently widens what is shown.

/// The longest query taken (the request line as a whole is bounded by `limits`).
const QUERY_MAX: usize = 1024;
/// `?seconds=`: the longest delta profile a request may wait for.
pub const SECONDS_MAX: u64 = 300;

/// What a profile request narrows to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Query {
    pub pid: Option<u32>,
    /// Processes whose command name contains this.
    pub comm: Option<String>,
    /// Processes whose cgroup path contains this.
    pub cgroup: Option<String>,
    /// A delta profile: the allocations of the next N seconds, as Go's `?seconds=N`.
    pub seconds: Option<u64>,
}

impl Query {
    pub fn parse(q: Option<&str>) -> Result<Query, String> {
        let mut out = Query::default();
        let Some(q) = q.filter(|q| !q.is_empty()) else {
            return Ok(out);
        };
        if q.len() > QUERY_MAX {
            return Err(format!("query longer than {QUERY_MAX} bytes"));
        }
        for pair in q.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = decode(v).ok_or_else(|| format!("{k}: bad percent-encoding"))?;
            match k {
                "pid" => out.pid = Some(v.parse().map_err(|_| format!("pid={v:?}: not a pid"))?),
                "comm" => out.comm = Some(v),
                "cgroup" => out.cgroup = Some(v),
                "seconds" => {
                    let s: u64 = v
                        .parse()
                        .map_err(|_| format!("seconds={v:?}: not a number"))?;
                    if !(1..=SECONDS_MAX).contains(&s) {
                        return Err(format!("seconds={s}: from 1 to {SECONDS_MAX}"));
                    }
                    out.seconds = Some(s);
                }
                // Go's pprof handlers take these; they change nothing here.
                "debug" | "gc" if v == "0" || v.is_empty() => {}
                _ => {
                    return Err(format!(
                        "unknown parameter {k:?} (pid, comm, cgroup, seconds)"
                    ));
                }
            }
        }
        Ok(out)
    }

    /// Whether a process with this real pid, command and cgroup is in.
    pub fn admits(&self, pid: u32, comm: &str, cgroup: &str) -> bool {
        self.pid.is_none_or(|p| p == pid)
            && self.comm.as_deref().is_none_or(|c| comm.contains(c))
            && self.cgroup.as_deref().is_none_or(|c| cgroup.contains(c))
    }
}

/// `%XX` and `+` decoded; None for a bad escape or bytes that are not UTF-8.
fn decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_and_seconds_are_parsed() {
        let q = Query::parse(Some("pid=42&comm=my%20prog&cgroup=/a.slice&seconds=5")).unwrap();
        assert_eq!(q.pid, Some(42));
        assert_eq!(q.comm.as_deref(), Some("my prog"));
        assert_eq!(q.cgroup.as_deref(), Some("/a.slice"));
        assert_eq!(q.seconds, Some(5));
        assert!(q.admits(42, "my prog", "/a.slice/x"));
        assert!(!q.admits(43, "my prog", "/a.slice/x"));
        assert_eq!(Query::parse(None).unwrap(), Query::default());
        assert_eq!(
            Query::parse(Some("gc=0&debug=0")).unwrap(),
            Query::default()
        );
    }

    #[test]
    fn bad_queries_are_refused() {
        for q in [
            "pid=x",
            "pid=-1",
            "seconds=0",
            "seconds=301",
            "seconds=1e3",
            "sites=all",
            "comm=%zz",
            "comm=%",
            "comm=%ff",
            "debug=1",
        ] {
            assert!(Query::parse(Some(q)).is_err(), "{q}");
        }
        assert!(Query::parse(Some(&"a".repeat(2000))).is_err());
    }
}
