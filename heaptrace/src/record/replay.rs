//! Rounds of a recording replayed into a Profile as the live trace applied them: each round's
//! figures, then the processes it saw end, then those it folded into `[N exited processes]`
//! (see `profile::exited`), so a report of a system-wide recording shows what the live trace showed and
//! keeps no more processes than it did.
use std::collections::{BTreeMap, HashSet};

use super::Recording;
use crate::{drain::round::Round, profile::Profile};

pub struct Replay {
    pub profile: Profile,
    folded: HashSet<u32>,
}

impl Replay {
    /// A replay of `rec`, whose header is read.
    pub fn new(rec: &Recording) -> Replay {
        let mut profile = Profile::of_mode(rec.header.mode, rec.header.sample_bytes)
            .with_latency_every(rec.header.latency_every);
        profile.collector = rec.header.run_info().collector;
        Replay {
            profile,
            folded: HashSet::new(),
        }
    }

    /// Applies a round; `profile::exited`: fold the processes it folded too (not when one process is
    /// picked out of the recording: its figures are kept its own).
    pub fn round(&mut self, rec: &Recording, r: &Round, fold: bool) {
        // It ends the round's ended processes too.
        self.profile.apply(r);
        if !fold {
            return;
        }
        for key in &r.folded {
            // The fold needs the frames of the process's stacks, which the Profile is
            // otherwise given at the end (every one of them was read before this round).
            self.profile.stacks.extend(rec.stacks_of(*key));
            // Leaks are the recording's last record, already folded as the live trace did.
            self.profile.fold(*key, &mut BTreeMap::new());
            self.folded.insert(*key);
        }
    }

    /// The Profile with the frames of the stacks `want` keeps (those of folded processes are
    /// under the folded stacks the replay made, as the live trace made them).
    pub fn finish(mut self, rec: &Recording, want: impl Fn(&(u32, i32)) -> bool) -> Profile {
        let (folded, stacks) = (&self.folded, &self.profile.stacks);
        let rest =
            rec.stacks_frames(|k| want(k) && !folded.contains(&k.0) && !stacks.contains_key(k));
        self.profile.stacks.extend(rest);
        self.profile
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use crate::{
        drain::round::Leak,
        drain::round::{NewStack, ProcRound, Round, SiteTotals},
        profile::Profile,
        profile::exited::FOLDED,
        record::{Header, Recorder, Recording, Replay, format::EndRec},
        symbolize::test_frames,
    };

    /// Processes 10 and 11 allocate from the same code (their stacks 7 and 9); 12 from other
    /// code. 10 ends and is folded in round 2, before 11 starts (its stack is read after the
    /// first fold); 11 and 12 end in round 4, and 11 is folded.
    fn rounds() -> Vec<Round> {
        let mut out: Vec<Round> = (1..=4)
            .map(|i| Round {
                index: i,
                elapsed_ms: i * 1000,
                ..Default::default()
            })
            .collect();
        for (round, pid, st, names) in [
            (0, 10, 7, ["work", "main"]),
            (0, 12, 7, ["other", "main"]),
            (2, 11, 9, ["work", "main"]),
        ] {
            let r = &mut out[round];
            let mut pr = ProcRound {
                comm: format!("p{pid}"),
                ..Default::default()
            };
            pr.delta.funcs[0].calls = 5;
            pr.delta.funcs[0].bytes = 50;
            r.procs.insert(pid, pr);
            let t = SiteTotals {
                calls: 5,
                bytes: 50,
                ..Default::default()
            };
            r.sites.insert((pid, st, 0), t);
            r.sizes.insert((pid, 0, 10, st), 5);
            let stack = NewStack {
                frames: test_frames(&names),
                ..Default::default()
            };
            r.stacks.insert((pid, st), stack);
        }
        (out[1].ended, out[1].folded) = (vec![10], vec![10]);
        (out[3].ended, out[3].folded) = (vec![11, 12], vec![11]);
        out
    }

    fn recording(
        dir: &std::path::Path,
        leaks: &BTreeMap<(u32, i32, u32), Leak>,
    ) -> std::path::PathBuf {
        let path = dir.join("fold.bin");
        let header = Header {
            mode: crate::run_info::Mode::Stacks,
            ..Default::default()
        };
        let mut w = Recorder::create_at(&path, &header).unwrap();
        for r in rounds() {
            w.round(&r).unwrap();
        }
        w.finish(Some(leaks), &EndRec::default()).unwrap();
        path
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
        let path = recording(&dir, &leaks);
        let whole = Recording::open(&path).unwrap().profile();
        // As `report` reads it: each round replayed as it is read.
        let mut replay: Option<Replay> = None;
        let file = std::fs::File::open(&path).unwrap();
        let rec = Recording::read_with(file, |rec, r| {
            replay
                .get_or_insert_with(|| Replay::new(rec))
                .round(rec, r, true)
        })
        .unwrap();
        assert!(rec.rounds.is_empty());
        assert_eq!(rec.round_count, 4);
        let mut streamed = replay.unwrap().finish(&rec, |_| true);
        streamed.set_leaks(rec.leaks.clone().unwrap().into_iter().collect());
        let _ = std::fs::remove_dir_all(&dir);
        for p in [whole, streamed] {
            check(&p, &live);
        }
    }

    fn check(p: &Profile, live: &Profile) {
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
            assert_eq!(names(p, site), names(live, site), "{site:?}");
        }
        assert_eq!(names(p, &(FOLDED, 1, 0)), ["work", "main"]);
        assert_eq!(p.sites[&(FOLDED, 1, 0)].calls, 10);
        // Nothing of the folded processes is left on its own.
        assert!(p.stacks.keys().all(|k| k.0 == 12 || k.0 == FOLDED));
    }
}
