//! One batch's runs: each kind of run's command, launched, waited for and read back.
use super::*;

pub(super) struct Bench {
    pub(super) heaptrace: PathBuf,
    pub(super) bin: PathBuf,
    pub(super) logs: PathBuf,
    pub(super) heaptrack: bool,
    pub(super) scale: f64,
}

impl Bench {
    pub(super) fn workload(&self, w: &str) -> PathBuf {
        self.bin.join(w)
    }

    pub(super) fn log(&self, w: &str, p: u32, kind: &str, rep: usize, ext: &str) -> PathBuf {
        self.logs.join(format!("{w}-P{p}-{kind}-{rep}.{ext}"))
    }

    /// The timing runs scale each workload by `base_scale` as well; the looped size runs do not
    /// (their length is their time).
    pub(super) fn args(&self, w: &str, p: u32, seconds: Option<f64>) -> Vec<String> {
        let scale = match seconds {
            None => self.scale * base_scale(w),
            Some(_) => self.scale,
        };
        let mut a = vec![p.to_string(), scale.to_string()];
        if let Some(s) = seconds {
            a.push(s.to_string());
        }
        a
    }

    /// One run of `kind`; `seconds` loops the workload (the size runs).
    pub(super) fn run(
        &self,
        w: &str,
        p: u32,
        kind: Kind,
        rep: usize,
        seconds: Option<f64>,
    ) -> Result<Run> {
        let files = self.files(w, p, kind, rep, seconds);
        let _ = fs::remove_file(&files.json);
        let mut run = Run {
            workload: w.to_string(),
            threads: p,
            kind: (kind != Kind::Native).then_some(kind),
            rep,
            ..Run::default()
        };
        let exited = self.launch(w, p, kind, seconds, &files, &mut run)?;
        let stdout = fs::read_to_string(&files.out).unwrap_or_default();
        if exited.code != 0 {
            bail!(
                "{w} P={p} {} exited with {} (see {} and {})",
                files.name,
                exited.code,
                files.out.display(),
                files.err.display()
            );
        }
        let (elapsed, cpu) = parse_summary(&stdout)
            .with_context(|| format!("no summary line in {}", files.out.display()))?;
        run.elapsed = elapsed;
        run.cpu = cpu;
        run.wall = exited.wall;
        if kind == Kind::Heaptrack {
            // The whole command's CPU (workload, heaptrack_interpret, compression) minus the
            // workload's own.
            run.daemon_cpu = run.daemon_cpu.map(|c| (c - cpu).max(0.0));
        }
        if kind == Kind::Record {
            self.report(&files)?;
        }
        if kind.counted() {
            read_counts(&files.json, &mut run)?;
        }
        if kind == Kind::Record {
            run.file_bytes = Some(fs::metadata(&files.rec)?.len());
            run.html_bytes = Some(self.html(&files)?);
        }
        Ok(run)
    }

    /// Where one run's output goes.
    pub(super) fn files(
        &self,
        w: &str,
        p: u32,
        kind: Kind,
        rep: usize,
        seconds: Option<f64>,
    ) -> RunFiles {
        let name = if seconds.is_some() {
            format!("{}-loop", kind.name())
        } else {
            kind.name().to_string()
        };
        RunFiles {
            out: self.log(w, p, &name, rep, "out"),
            err: self.log(w, p, &name, rep, "err"),
            json: self.log(w, p, &name, rep, "json"),
            rec: self.logs.join(format!("{w}-P{p}-{name}.rec")),
            name,
        }
    }

    /// Runs the workload as `kind` runs it, to its end; heaptrace's (or heaptrack's) own cost
    /// goes into `run`.
    pub(super) fn launch(
        &self,
        w: &str,
        p: u32,
        kind: Kind,
        seconds: Option<f64>,
        files: &RunFiles,
        run: &mut Run,
    ) -> Result<Exited> {
        let exe = self.workload(w);
        let args = self.args(w, p, seconds);
        let (out, err) = (&files.out, &files.err);
        Ok(match kind {
            Kind::Native => finish(spawn(
                Command::new(&exe)
                    .args(&args)
                    .stdout(file_out(out)?)
                    .stderr(file_out(err)?),
            )?)?,
            Kind::Calls | Kind::Counts | Kind::Sizes | Kind::Stacks | Kind::Record => {
                let mut c = Command::new(&self.heaptrace);
                if kind == Kind::Record {
                    let _ = fs::remove_file(&files.rec);
                    c.arg("record")
                        .arg("-o")
                        .arg(&files.rec)
                        .args(files.ht_flags("stacks"));
                } else {
                    c.args(files.ht_flags(kind.name()));
                }
                c.arg("--").arg(&exe).args(&args);
                let e = finish(spawn(c.stdout(file_out(out)?).stderr(file_out(err)?))?)?;
                run.daemon_cpu = Some(e.self_cpu);
                run.daemon_rss_kb = Some(e.hwm_kb);
                e
            }
            Kind::AttachCalls | Kind::AttachCounts | Kind::AttachSizes | Kind::Attach => {
                let mode = kind.attach_mode().expect("an attached kind");
                let (e, wl) = self.attach(&exe, &args, out, err, files.ht_flags(mode))?;
                if wl != 0 {
                    bail!("{w} exited with {wl} under attach (see {})", out.display());
                }
                run.daemon_cpu = Some(e.self_cpu);
                run.daemon_rss_kb = Some(e.hwm_kb);
                e
            }
            Kind::Heaptrack => self.heaptrack(w, p, &exe, &args, files, run)?,
            Kind::InCounts | Kind::InStacks => {
                let mode = kind.in_process_mode().expect("an in-process kind");
                let mut c = Command::new(&self.heaptrace);
                c.arg("--in-process")
                    .args(files.ht_flags(mode))
                    .arg("--")
                    .arg(&exe)
                    .args(&args);
                let e = finish(spawn(c.stdout(file_out(out)?).stderr(file_out(err)?))?)?;
                run.daemon_cpu = Some(e.self_cpu);
                run.daemon_rss_kb = Some(e.hwm_kb);
                e
            }
        })
    }

    /// The workload under heaptrack; its file's size goes into `run`, and the whole command's
    /// CPU time (the workload's is taken off once known).
    pub(super) fn heaptrack(
        &self,
        w: &str,
        p: u32,
        exe: &Path,
        args: &[String],
        files: &RunFiles,
        run: &mut Run,
    ) -> Result<Exited> {
        let base = self.logs.join(format!("{w}-P{p}-heaptrack"));
        for ext in ["zst", "gz", ""] {
            let _ = fs::remove_file(with_ext(&base, ext));
        }
        let e = finish(spawn(
            Command::new("heaptrack")
                .arg("-o")
                .arg(&base)
                .arg(exe)
                .args(args)
                .stdout(file_out(&files.out)?)
                .stderr(file_out(&files.err)?),
        )?)?;
        run.file_bytes = ["zst", "gz", ""]
            .iter()
            .find_map(|ext| fs::metadata(with_ext(&base, ext)).ok())
            .map(|m| m.len());
        run.daemon_cpu = Some(e.self_cpu + e.children_cpu);
        Ok(e)
    }

    /// A record run's figures: `heaptrace report` of its recording, as JSON.
    pub(super) fn report(&self, files: &RunFiles) -> Result<()> {
        let rep = Command::new(&self.heaptrace)
            .arg("report")
            .arg(&files.rec)
            .args(["--format", "json"])
            .stdout(file_out(&files.json)?)
            .status()?;
        if !rep.success() {
            bail!("heaptrace report {} failed: {rep}", files.rec.display());
        }
        Ok(())
    }

    /// The recording's HTML page; its size.
    pub(super) fn html(&self, files: &RunFiles) -> Result<u64> {
        let page = files.rec.with_extension("html");
        let rep = Command::new(&self.heaptrace)
            .arg("report")
            .arg(&files.rec)
            .args(["--export", "html", "--force", "-o"])
            .arg(&page)
            .stderr(std::process::Stdio::null())
            .status()?;
        if !rep.success() {
            bail!(
                "heaptrace report {} --export html failed: {rep}",
                files.rec.display()
            );
        }
        Ok(fs::metadata(&page)?.len())
    }

    /// The workload starts with HEAPTRACE_BENCH_STOP and stops itself before its timer; once
    /// heaptrace says it attached, SIGCONT. Returns heaptrace's exit and the workload's code.
    pub(super) fn attach(
        &self,
        exe: &Path,
        args: &[String],
        out: &Path,
        err: &Path,
        flags: Vec<String>,
    ) -> Result<(Exited, i32)> {
        let mut target = Command::new(exe)
            .args(args)
            .env("HEAPTRACE_BENCH_STOP", "1")
            .stdout(file_out(out)?)
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("cannot run {}", exe.display()))?;
        let pid = target.id() as i32;
        let stopped = wait_until("the workload to stop", Duration::from_secs(10), || {
            Ok(proc_state(pid) == Some('T'))
        });
        if let Err(e) = stopped {
            let _ = target.kill();
            let _ = target.wait();
            return Err(e);
        }
        let ht = spawn(
            Command::new(&self.heaptrace)
                .args(flags)
                .arg("-p")
                .arg(pid.to_string())
                .stdout(Stdio::null())
                .stderr(file_out(err)?),
        )?;
        let attached = wait_until("heaptrace to attach", Duration::from_secs(60), || {
            if fs::read_to_string(err).is_ok_and(|s| s.contains("heaptrace: attached")) {
                return Ok(true);
            }
            if exited_nowait(ht.pid, false)? {
                bail!(
                    "heaptrace -p exited before attaching (see {})",
                    err.display()
                );
            }
            Ok(false)
        });
        if let Err(e) = attached {
            let _ = target.kill();
            let _ = target.wait();
            return Err(e);
        }
        // SAFETY: signals our own child.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        let code = target.wait()?.code().unwrap_or(128);
        Ok((finish(ht)?, code))
    }
}

/// The files of one run.
pub(super) struct RunFiles {
    /// The kind's name, with `-loop` for a looped run.
    pub(super) name: String,
    /// The command's stdout and stderr.
    pub(super) out: PathBuf,
    pub(super) err: PathBuf,
    /// heaptrace's JSON document.
    pub(super) json: PathBuf,
    /// A record run's recording.
    pub(super) rec: PathBuf,
}

impl RunFiles {
    /// heaptrace's flags in `mode`. The JSON document is asked for in calls, counts and sizes
    /// modes only, where it is small. In stacks mode it holds every stack with its frames
    /// (over 100 MB for binary-trees), and writing it would count in the daemon's cost; the
    /// record run's figures come from `heaptrace report` on the recording after the run
    /// instead.
    pub(super) fn ht_flags(&self, mode: &str) -> Vec<String> {
        let mut f = vec!["-q".into(), "--mode".into(), mode.into()];
        if mode != "stacks" {
            // A rerun writes over the last run's logs.
            f.extend([
                "--force".into(),
                "--json".into(),
                self.json.display().to_string(),
            ]);
        }
        f
    }
}

/// A counted run's figures, from heaptrace's JSON document at `path`.
pub(super) fn read_counts(path: &Path, run: &mut Run) -> Result<()> {
    let f = File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let (calls, rounds, lost, lost_stack, stacks) =
        parse_heaptrace_json(f).with_context(|| format!("bad JSON in {}", path.display()))?;
    // Keep the logs small: binary-trees' documents are over 100 MB each.
    if fs::metadata(path).is_ok_and(|m| m.len() > 16 << 20) {
        let _ = fs::remove_file(path);
    }
    run.calls = Some(calls);
    run.rounds = Some(rounds);
    run.lost = Some(lost);
    run.lost_stack = Some(lost_stack);
    run.stacks = Some(stacks);
    Ok(())
}

pub(super) fn with_ext(base: &Path, ext: &str) -> PathBuf {
    if ext.is_empty() {
        base.to_path_buf()
    } else {
        PathBuf::from(format!("{}.{ext}", base.display()))
    }
}
