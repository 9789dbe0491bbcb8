//! pprof's profile.proto (`go tool pprof`, Parca, Pyroscope): a recording's export, and the
//! live profiles `--serve` answers with. One encoder for both: the tables (strings, mappings,
//! functions, locations) are built here, the caller says which sites and which values.
use std::collections::HashMap;

use crate::{
    drain::round::SiteId,
    profile::Profile,
    record::{Recording, format::ModuleRec},
    symbolize::Frame,
    view::names::Names,
};

use super::per_address;

// profile.proto (github.com/google/pprof/proto/profile.proto), the fields heaptrace fills.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PProfile {
    #[prost(message, repeated, tag = "1")]
    pub sample_type: Vec<ValueType>,
    #[prost(message, repeated, tag = "2")]
    pub sample: Vec<Sample>,
    #[prost(message, repeated, tag = "3")]
    pub mapping: Vec<Mapping>,
    #[prost(message, repeated, tag = "4")]
    pub location: Vec<Location>,
    #[prost(message, repeated, tag = "5")]
    pub function: Vec<Function>,
    #[prost(string, repeated, tag = "6")]
    pub string_table: Vec<String>,
    #[prost(int64, tag = "9")]
    pub time_nanos: i64,
    #[prost(int64, tag = "10")]
    pub duration_nanos: i64,
    #[prost(message, optional, tag = "11")]
    pub period_type: Option<ValueType>,
    #[prost(int64, tag = "12")]
    pub period: i64,
    #[prost(int64, repeated, tag = "13")]
    pub comment: Vec<i64>,
    #[prost(int64, tag = "14")]
    pub default_sample_type: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ValueType {
    #[prost(int64, tag = "1")]
    pub r#type: i64,
    #[prost(int64, tag = "2")]
    pub unit: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Sample {
    #[prost(uint64, repeated, tag = "1")]
    pub location_id: Vec<u64>,
    #[prost(int64, repeated, tag = "2")]
    pub value: Vec<i64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Mapping {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(uint64, tag = "2")]
    pub memory_start: u64,
    #[prost(uint64, tag = "3")]
    pub memory_limit: u64,
    #[prost(uint64, tag = "4")]
    pub file_offset: u64,
    #[prost(int64, tag = "5")]
    pub filename: i64,
    #[prost(int64, tag = "6")]
    pub build_id: i64,
    #[prost(bool, tag = "7")]
    pub has_functions: bool,
    #[prost(bool, tag = "8")]
    pub has_filenames: bool,
    #[prost(bool, tag = "9")]
    pub has_line_numbers: bool,
    #[prost(bool, tag = "10")]
    pub has_inline_frames: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Location {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(uint64, tag = "2")]
    pub mapping_id: u64,
    #[prost(uint64, tag = "3")]
    pub address: u64,
    #[prost(message, repeated, tag = "4")]
    pub line: Vec<Line>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Line {
    #[prost(uint64, tag = "1")]
    pub function_id: u64,
    #[prost(int64, tag = "2")]
    pub line: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Function {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(int64, tag = "2")]
    pub name: i64,
    #[prost(int64, tag = "3")]
    pub system_name: i64,
    #[prost(int64, tag = "4")]
    pub filename: i64,
}

#[derive(Default)]
struct Strings {
    table: Vec<String>,
    index: HashMap<String, i64>,
}

impl Strings {
    fn new() -> Strings {
        let mut s = Strings::default();
        s.id(""); // pprof requires string_table[0] == ""
        s
    }

    fn id(&mut self, s: &str) -> i64 {
        if let Some(i) = self.index.get(s) {
            return *i;
        }
        let i = self.table.len() as i64;
        self.table.push(s.to_string());
        self.index.insert(s.to_string(), i);
        i
    }
}

/// A module as a pprof mapping: its path (or name), build id in hex, and the name frames give
/// it (`Frame::module`).
pub struct ModuleInfo {
    pub path: String,
    pub build_id: String,
    pub key: String,
}

/// alloc_objects/count, alloc_space/bytes, inuse_objects/count, inuse_space/bytes (the default,
/// like Go heap profiles). "In use" is what was not freed at the end of the recording.
pub fn pprof(rec: &Recording, p: &Profile, names: &Names) -> PProfile {
    let mut b = Pprof::new(p, &recording_modules(rec));
    let mut ids: Vec<SiteId> = p.sites.keys().copied().collect();
    if let Some(l) = &p.leaks {
        ids.extend(l.keys().copied().filter(|k| !p.sites.contains_key(k)));
    }
    for id in ids {
        let site = p.sites.get(&id).cloned().unwrap_or_default();
        let leak = p
            .leaks
            .as_ref()
            .and_then(|l| l.get(&id))
            .copied()
            .unwrap_or_default();
        let values = [
            site.calls as i64,
            site.bytes as i64,
            leak.blocks as i64,
            leak.bytes as i64,
        ];
        b.sample(&p.frames(&id), names, values);
    }
    let duration_ms = rec.last_elapsed_ms.unwrap_or(0);
    b.finish(rec.header.start_unix_ms as i64, duration_ms as i64)
}

/// A recording's modules as mappings, the main binary first (pprof takes the first mapping
/// for it).
fn recording_modules(rec: &Recording) -> Vec<ModuleInfo> {
    let main = main_module(rec);
    let mut modules: Vec<&ModuleRec> = rec.modules.iter().collect();
    modules.sort_by_key(|m| Some(m.id) != main);
    modules
        .into_iter()
        .map(|m| ModuleInfo {
            path: m.path.clone(),
            build_id: m
                .build_id
                .as_ref()
                .map(|b| b.iter().map(|x| format!("{x:02x}")).collect::<String>())
                .unwrap_or_default(),
            key: m.path.rsplit('/').next().unwrap_or(&m.path).to_string(),
        })
        .collect()
}

/// A pprof profile being built: the tables its samples point into, each entry added once.
pub struct Pprof {
    out: PProfile,
    strings: Strings,
    /// A module's file name -> its mapping's id.
    module_ids: HashMap<String, u64>,
    /// (name, file) -> the function's id.
    functions: HashMap<(String, String), u64>,
    /// A location's lines -> its id.
    locations: HashMap<Vec<(u64, i64)>, u64>,
}

impl Pprof {
    /// The sample types, the sampling, and a mapping per module (the main binary first).
    pub fn new(p: &Profile, modules: &[ModuleInfo]) -> Pprof {
        let mut b = Pprof {
            out: PProfile::default(),
            strings: Strings::new(),
            module_ids: HashMap::new(),
            functions: HashMap::new(),
            locations: HashMap::new(),
        };
        b.sample_types(p);
        b.mappings(modules);
        b
    }

    fn sample_types(&mut self, p: &Profile) {
        let (out, strings) = (&mut self.out, &mut self.strings);
        for (t, u) in [
            ("alloc_objects", "count"),
            ("alloc_space", "bytes"),
            ("inuse_objects", "count"),
            ("inuse_space", "bytes"),
        ] {
            out.sample_type.push(ValueType {
                r#type: strings.id(t),
                unit: strings.id(u),
            });
        }
        out.default_sample_type = strings.id("inuse_space");
        // As Go heap profiles say their sampling: one sample per `period` bytes allocated, the
        // values already scaled to estimates (pprof does not scale them again).
        if p.sample_bytes > 0 {
            out.period_type = Some(ValueType {
                r#type: strings.id("space"),
                unit: strings.id("bytes"),
            });
            out.period = p.sample_bytes as i64;
            let note = format!(
                "heaptrace: sampled {}; values are unbiased estimates",
                crate::profile::sampling::describe(p.sample_bytes)
            );
            out.comment.push(strings.id(&note));
        }
    }

    fn mappings(&mut self, modules: &[ModuleInfo]) {
        for (i, m) in modules.iter().enumerate() {
            let id = i as u64 + 1;
            self.out.mapping.push(Mapping {
                id,
                memory_start: 0,
                memory_limit: u64::MAX,
                file_offset: 0,
                filename: self.strings.id(&m.path),
                build_id: self.strings.id(&m.build_id),
                has_functions: true,
                has_filenames: true,
                has_line_numbers: true,
                has_inline_frames: true,
            });
            self.module_ids.entry(m.key.clone()).or_insert(id);
        }
    }

    /// One sample: a stack (innermost frame first) as locations, and its four values.
    pub fn sample(&mut self, frames: &[Frame], names: &Names, value: [i64; 4]) {
        let location_id = per_address(frames)
            .into_iter()
            .map(|group| self.location(group, names))
            .collect();
        self.out.sample.push(Sample {
            location_id,
            value: value.to_vec(),
        });
    }

    /// The location of one return address's frames (inlined ones first), added if new.
    fn location(&mut self, group: &[Frame], names: &Names) -> u64 {
        // pprof: a location's lines run from the innermost inlined function to the caller.
        let lines: Vec<(u64, i64)> = group
            .iter()
            .map(|f| (self.function(f, names), i64::from(f.line.unwrap_or(0))))
            .collect();
        let mapping = group
            .last()
            .and_then(|f| self.module_ids.get(&*f.module))
            .copied()
            .unwrap_or(0);
        let address = group.last().map(|f| f.offset).unwrap_or(0);
        let next = self.locations.len() as u64 + 1;
        *self.locations.entry(lines.clone()).or_insert_with(|| {
            self.out.location.push(Location {
                id: next,
                mapping_id: mapping,
                address,
                line: lines
                    .iter()
                    .map(|(f, l)| Line {
                        function_id: *f,
                        line: *l,
                    })
                    .collect(),
            });
            next
        })
    }

    /// The function a frame is in, by name and file, added if new.
    fn function(&mut self, f: &Frame, names: &Names) -> u64 {
        let name = names.function(f);
        let file = f.file.as_deref().unwrap_or_default().to_string();
        let next = self.functions.len() as u64 + 1;
        let (out, strings) = (&mut self.out, &mut self.strings);
        *self
            .functions
            .entry((name.clone(), file.clone()))
            .or_insert_with(|| {
                let name_id = strings.id(&name);
                let system = strings.id(&f.function);
                let file_id = strings.id(&file);
                out.function.push(Function {
                    id: next,
                    name: name_id,
                    system_name: system,
                    filename: file_id,
                });
                next
            })
    }

    /// The profile's start (Unix milliseconds) and length, and the string table.
    pub fn finish(mut self, start_unix_ms: i64, duration_ms: i64) -> PProfile {
        self.out.time_nanos = start_unix_ms * 1_000_000;
        self.out.duration_nanos = duration_ms * 1_000_000;
        self.out.string_table = self.strings.table;
        self.out
    }
}

/// The traced executable among a recording's modules: the one that holds `main` in most
/// stacks; else the one named as the command (`python3` runs `python3.11`, not
/// `libpython3.11.so`); else none.
fn main_module(rec: &Recording) -> Option<u32> {
    let mut with_main: HashMap<u32, usize> = HashMap::new();
    for stack in rec.stacks.values() {
        for f in &stack.frames {
            let name = rec.strings.get(f.function as usize).map(|s| &**s);
            if let (Some("main"), Some(m)) = (name, f.module) {
                *with_main.entry(m).or_default() += 1;
            }
        }
    }
    if let Some((m, _)) = with_main
        .into_iter()
        .max_by_key(|&(m, n)| (n, std::cmp::Reverse(m)))
    {
        return Some(m);
    }
    let cmd = rec.header.command.first()?;
    let cmd = cmd.rsplit('/').next().unwrap_or(cmd);
    rec.modules
        .iter()
        .find(|m| {
            m.path
                .rsplit('/')
                .next()
                .unwrap_or(&m.path)
                .starts_with(cmd)
        })
        .map(|m| m.id)
}
