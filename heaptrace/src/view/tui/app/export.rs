//! The view written out (`w`): the screen's rows and the JSON document of what it shows.
use super::*;

impl App {
    /// What is on screen as JSON: the view's settings, the current screen's rows (all of them,
    /// filtered and sorted as shown), and the whole `--json` document of the figures on screen
    /// (since the reset, for the focused process).
    pub fn export(&self) -> doc::Node<'_> {
        let frames_json = |id: &SiteId| serde_json::to_value(self.view().frames(id)).ok();
        let rows: Vec<Value> = match (self.screen, self.detail) {
            (Screen::Sites, Some(id)) => vec![doc::with_pid(
                json!({
                    "stack_id": id.1,
                    "function": Func::from_u32(id.2).map(|f| f.name()),
                    "frames": frames_json(&id),
                    "site": self.view().sites.get(&id),
                }),
                id.0,
            )],
            (Screen::Sites, None) => self
                .site_rows()
                .iter()
                .map(|r| {
                    doc::with_pid(json!({
                        "stack_id": r.id.1, "function": r.func(),
                        "frame": r.frame(),
                        "calls": r.totals.calls, "bytes": r.totals.bytes,
                        "live_blocks": r.totals.live_blocks, "live_bytes": r.totals.live_bytes,
                        "temporary": { "blocks": r.totals.temp_blocks, "bytes": r.totals.temp_bytes },
                        "leaked": r.leak,
                    }), r.id.0)
                })
                .collect(),
            (Screen::Functions, _) => self
                .func_rows()
                .iter()
                .map(|r| {
                    json!({
                        "function": r.name, "calls": r.calls, "bytes": r.bytes, "failed": r.failed,
                        "latency": r.latency.map(|p| json!({
                            "count": p.count, "p50_ns": p.p50, "p99_ns": p.p99, "max_ns": p.max,
                            "timed_one_in": self.view().latency_every.max(1) })),
                    })
                })
                .collect(),
            (Screen::Sizes, _) => self
                .size_rows()
                .iter()
                .map(|r| json!({ "function": r.func, "size": r.size, "count": r.count }))
                .collect(),
            (Screen::Processes, _) => self
                .proc_rows()
                .iter()
                .map(|r| {
                    doc::with_pid(json!({
                        "comm": r.comm,
                        "allocations": r.totals.allocations(), "frees": r.totals.frees(),
                        "bytes_allocated": r.totals.bytes_allocated(),
                        "live_blocks": r.totals.live_blocks, "live_bytes": r.totals.live_bytes,
                        "rss_kb": r.rss_kb, "virt_kb": r.virt_kb,
                        "reserved_bytes": r.reserved,
                    }), r.pid)
                })
                .collect(),
            (Screen::Timeline, _) => self
                .timeline()
                .iter()
                .map(|r| serde_json::to_value(r).unwrap_or(Value::Null))
                .collect(),
        };
        let run = doc::Run {
            probes: &self.info.attached,
            ..doc::Run::described(&self.info.run, self.shown.exit_code)
        };
        let view = json!({
            "screen": self.screen.title().to_lowercase(),
            "sort": self.sort_name(),
            "filter": self.filter,
            "focus_pid": self.focus,
            "paused": self.paused,
            "since_round": self.baseline_round(),
            "round": self.shown.round(),
            "elapsed_ms": self.shown.elapsed_ms,
            "ended": self.shown.ended,
        });
        doc::Node::object([
            ("view", view.into()),
            ("rows", Value::Array(rows).into()),
            ("document", doc::document(self.view(), &run)),
        ])
    }
}
