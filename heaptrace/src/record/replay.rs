//! Rounds of a recording replayed into a Profile as the live trace applied them: each round's
//! figures, then the processes it saw end, then those it folded into `[N exited processes]`
//! (see `fold`), so a report of a system-wide recording shows what the live trace showed and
//! keeps no more processes than it did.
use std::collections::{BTreeMap, HashMap, HashSet};

use super::Recording;
use crate::{aggregate::Profile, model::Round};

pub struct Replay<'a> {
    rec: &'a Recording,
    pub profile: Profile,
    /// Each process's stack ids, made at the first fold: a fold needs the frames of the
    /// process's stacks, which the Profile is otherwise given only at the end.
    by_proc: Option<HashMap<u32, Vec<i32>>>,
    folded: HashSet<u32>,
}

impl<'a> Replay<'a> {
    pub fn new(rec: &'a Recording) -> Replay<'a> {
        Replay {
            rec,
            profile: Profile::of_mode(&rec.header.mode, rec.header.sample_bytes),
            by_proc: None,
            folded: HashSet::new(),
        }
    }

    /// Applies a round; `fold`: fold the processes it folded too (not when one process is
    /// picked out of the recording: its figures are kept its own).
    pub fn round(&mut self, r: &Round, fold: bool) {
        self.profile.apply(r);
        for key in &r.ended {
            self.profile.end(*key);
        }
        if !fold {
            return;
        }
        for key in &r.folded {
            let rec = self.rec;
            let by_proc = self.by_proc.get_or_insert_with(|| {
                let mut m: HashMap<u32, Vec<i32>> = HashMap::new();
                for (pid, id) in rec.stacks.keys() {
                    m.entry(*pid).or_default().push(*id);
                }
                m
            });
            for id in by_proc.remove(key).unwrap_or_default() {
                if let Some(frames) = rec.frames_of(&(*key, id)) {
                    self.profile.stacks.insert((*key, id), frames);
                }
            }
            // Leaks are the recording's last record, already folded as the live trace did.
            self.profile.fold(*key, &mut BTreeMap::new());
            self.folded.insert(*key);
        }
    }

    /// The Profile with the frames of the stacks `want` keeps (those of folded processes are
    /// under the folded stacks the replay made, as the live trace made them).
    pub fn finish(mut self, want: impl Fn(&(u32, i32)) -> bool) -> Profile {
        let (folded, stacks) = (&self.folded, &self.profile.stacks);
        let rest = self
            .rec
            .stacks_frames(|k| want(k) && !folded.contains(&k.0) && !stacks.contains_key(k));
        self.profile.stacks.extend(rest);
        self.profile
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use crate::{
        aggregate::{Leak, Profile},
        fold::FOLDED,
        model::{NewStack, ProcRound, Round, SiteTotals},
        record::{Header, Recorder, Recording, format::EndRec},
        symbolize::test_frames,
    };

    /// Processes 10 and 11 allocate from the same code (their stacks 7 and 9); 12 from other
    /// code. In round 2 all three end, and 10 and 11 are folded.
    fn rounds() -> Vec<Round> {
        let mut one = Round {
            index: 1,
            elapsed_ms: 1000,
            ..Default::default()
        };
        for (pid, st, names) in [
            (10, 7, ["work", "main"]),
            (11, 9, ["work", "main"]),
            (12, 7, ["other", "main"]),
        ] {
            let mut pr = ProcRound {
                comm: format!("p{pid}"),
                ..Default::default()
            };
            pr.delta.funcs[0].calls = 5;
            pr.delta.funcs[0].bytes = 50;
            one.procs.insert(pid, pr);
            let t = SiteTotals {
                calls: 5,
                bytes: 50,
                ..Default::default()
            };
            one.sites.insert((pid, st, 0), t);
            one.sizes.insert((pid, 0, 10, st), 5);
            let stack = NewStack {
                frames: test_frames(&names),
                ..Default::default()
            };
            one.stacks.insert((pid, st), stack);
        }
        let two = Round {
            index: 2,
            elapsed_ms: 2000,
            ended: vec![10, 11, 12],
            folded: vec![10, 11],
            ..Default::default()
        };
        vec![one, two]
    }

    fn recording(dir: &std::path::Path, leaks: &BTreeMap<(u32, i32, u32), Leak>) -> Recording {
        let path = dir.join("fold.bin");
        let header = Header {
            mode: "stacks".into(),
            ..Default::default()
        };
        let mut w = Recorder::create(&path, &header).unwrap();
        for r in rounds() {
            w.round(&r).unwrap();
        }
        w.finish(Some(leaks), &EndRec::default()).unwrap();
        Recording::open(&path).unwrap()
    }

    /// A report folds what the live trace folded, into the same figures and the same folded
    /// stacks, and marks ended what it saw end.
    #[test]
    fn a_recording_replays_ends_and_folds_as_the_live_trace_did() {
        // The live trace: each round applied, then its ends, then its folds.
        let mut live = Profile::default();
        let mut leaks = BTreeMap::new();
        leaks.insert(
            (10, 7, 0),
            Leak {
                blocks: 1,
                bytes: 10,
            },
        );
        leaks.insert(
            (11, 9, 0),
            Leak {
                blocks: 1,
                bytes: 10,
            },
        );
        for mut r in rounds() {
            let (ended, folded) = (std::mem::take(&mut r.ended), std::mem::take(&mut r.folded));
            live.apply(&r);
            for k in ended {
                assert!(live.end(k));
            }
            for k in folded {
                live.fold(k, &mut leaks);
            }
        }
        live.set_leaks(leaks.clone());

        let dir = std::env::temp_dir().join(format!("heaptrace-replay-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = recording(&dir, &leaks).profile();
        let _ = std::fs::remove_dir_all(&dir);

        assert_eq!(p.procs.keys().collect::<Vec<_>>(), [&12, &FOLDED]);
        assert_eq!(p.procs[&FOLDED].comm, "[2 exited processes]");
        assert!(p.procs.values().all(|pp| pp.exited && pp.leaks_at_exit));
        assert_eq!(p.procs[&FOLDED].totals, live.procs[&FOLDED].totals);
        assert_eq!(p.sites, live.sites);
        assert_eq!(p.sizes, live.sizes);
        assert_eq!(p.leak_totals(None), live.leak_totals(None));
        let names = |p: &Profile, site| -> Vec<String> {
            p.frames(site)
                .iter()
                .map(|f| f.function.to_string())
                .collect()
        };
        assert_eq!(p.sites.len(), 2, "{:?}", p.sites);
        for site in live.sites.keys() {
            assert_eq!(names(&p, site), names(&live, site), "{site:?}");
        }
        assert_eq!(names(&p, &(FOLDED, 1, 0)), ["work", "main"]);
        assert_eq!(p.sites[&(FOLDED, 1, 0)].calls, 10);
        // Nothing of the folded processes is left on its own.
        assert!(p.stacks.keys().all(|k| k.0 == 12 || k.0 == FOLDED));
    }
}
