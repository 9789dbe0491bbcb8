//! Which frame of a stack names its site: the innermost one that is neither the allocator's
//! own (libc's `strdup` calling malloc) nor an allocation wrapper (`operator new`, a service's
//! `zmalloc`, `xmalloc`, `ngx_alloc`). Every view asks [`Wrappers::site`], so the summary, the
//! JSON document, the live view, the HTML page and the reports name a site alike. Only the
//! naming moves: a stack keeps all its frames, the wrappers' too.
//!
//! Wrappers are found three ways: known by name ([`known`]: a few every program shares, and
//! well-known services' allocation layers), those the user names (`--hide REGEX`), and those
//! the profile shows (detection, see [`detect`] and docs/site-names.md). The names are
//! detection's first pass: a function calling a service's or a `--hide` wrapper names a site.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::Arc,
};

use serde::Serialize;

use crate::{profile::Profile, symbolize::Frame};

pub mod known;

/// Detection: a function is a wrapper when it is only ever seen right above the allocator,
/// called from at least this many distinct functions...
pub const MIN_CALLERS: usize = 4;
/// ...and calling the allocator from at most this many places (return addresses) in it.
pub const MAX_CALL_SITES: usize = 4;
/// Passes through functions inlined into one another (`ztrymalloc_usable` into `zmalloc`).
const PASSES: usize = 4;
/// Callers and call sites kept per function while detecting: enough to decide.
const KEEP: usize = MAX_CALL_SITES + MIN_CALLERS + 1;

/// How wrappers are chosen: set once from the command line (`--hide`,
/// `--no-wrapper-detection`) and the allocator's file, and kept with the Profile.
#[derive(Clone, Debug, Default)]
pub struct WrapperRule {
    /// `--hide`: functions matching any of these are wrappers.
    pub hide: Vec<regex::Regex>,
    /// `--no-wrapper-detection`: neither services' known wrappers nor detection.
    pub no_detection: bool,
    /// The allocator's file's base name: frames in it are the allocator's own.
    pub allocator_module: String,
}

impl WrapperRule {
    /// The rule of `--hide` and `--no-wrapper-detection`, with the allocator's file `provider`.
    pub fn new(hide: &[regex::Regex], no_detection: bool, provider: &str) -> WrapperRule {
        WrapperRule {
            hide: hide.to_vec(),
            no_detection,
            allocator_module: provider.rsplit('/').next().unwrap_or(provider).to_string(),
        }
    }
}

/// Why a frame was passed over in naming a site.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Skipped {
    /// In the allocator's own file.
    Allocator,
    /// A wrapper known by name ([`known`]).
    Known,
    /// Named by `--hide`.
    Hidden,
    /// Found by detection.
    Detected,
}

/// The frame that names a site, as an index into the stack's frames (innermost first); the
/// frames before it are the allocator's and its wrappers'.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SiteFrame(pub usize);

impl SiteFrame {
    /// The frames passed over: the allocator's and the wrappers'.
    pub fn wrappers(self, frames: &[Frame]) -> &[Frame] {
        &frames[..self.0.min(frames.len())]
    }

    /// The frames from the site's outward.
    pub fn from_site(self, frames: &[Frame]) -> &[Frame] {
        &frames[self.0.min(frames.len())..]
    }

    /// The frame that names the site (None for an empty stack).
    pub fn frame(self, frames: &[Frame]) -> Option<&Frame> {
        frames.get(self.0)
    }
}

/// A function, by its file's base name and its name.
type Key = (Arc<str>, Arc<str>);

fn key(f: &Frame) -> Key {
    (f.module.clone(), f.function.clone())
}

/// The wrappers of one Profile: its rule, and the functions detection found in its stacks.
#[derive(Clone, Debug, Default)]
pub struct Wrappers {
    rule: Arc<WrapperRule>,
    detected: HashSet<Key>,
}

impl Wrappers {
    /// The wrappers of `profile`, by its rule (detection reads every stack once a pass).
    pub fn of(profile: &Profile) -> Wrappers {
        let rule = profile.wrapper_rule.clone();
        let stacks = profile.stacks.values().map(|s| &s[..]);
        Wrappers::with_rule(rule, stacks)
    }

    /// The wrappers of these stacks by `rule`.
    pub fn with_rule<'a>(
        rule: Arc<WrapperRule>,
        stacks: impl Iterator<Item = &'a [Frame]> + Clone,
    ) -> Wrappers {
        let mut w = Wrappers {
            rule,
            detected: HashSet::new(),
        };
        if !w.rule.no_detection {
            w.detected = detect(&w, stacks);
        }
        w
    }

    /// Why `f` is passed over in naming a site, or None: it can name one (though it may be
    /// inside a service's wrapper, see [`Wrappers::site`]).
    pub fn skipped(&self, f: &Frame) -> Option<Skipped> {
        self.by_name(f)
            .or_else(|| self.detected.contains(&key(f)).then_some(Skipped::Detected))
    }

    /// Why `f` is passed over without detection: the allocator's, known or `--hide`.
    fn by_name(&self, f: &Frame) -> Option<Skipped> {
        if self.is_base(f) {
            Some(if known::is_base(&f.function) {
                Skipped::Known
            } else {
                Skipped::Allocator
            })
        } else if self.is_service(f) {
            Some(Skipped::Known)
        } else if self.rule.hide.iter().any(|r| r.is_match(&f.function)) {
            Some(Skipped::Hidden)
        } else {
            None
        }
    }

    /// The allocator's own frames and [`known::BASE`]: their callers may be wrappers.
    fn is_base(&self, f: &Frame) -> bool {
        let rule = &self.rule;
        (!rule.allocator_module.is_empty() && *f.module == *rule.allocator_module)
            || known::is_base(&f.function)
    }

    /// A service's known wrapper (off with `--no-wrapper-detection`).
    fn is_service(&self, f: &Frame) -> bool {
        !self.rule.no_detection && known::is_service(&f.function)
    }

    /// How many innermost frames are passed over, by `skipped` (or by name only). A frame
    /// passed over by none is still a wrapper's own when a service's wrapper of its file
    /// follows within [`known::INSIDE`] frames of that file (`palloc` calling `AllocSetAlloc`
    /// through a pointer), or when it has no name and a service's wrapper of its file that
    /// calls the allocator itself is right below it: a static helper the wrapper's caller
    /// jumped to (nginx's `ngx_palloc` ends in a jump to `ngx_palloc_large`, which calls
    /// `ngx_alloc`: `ngx_palloc`'s frame is gone and the helper's caller is the site).
    fn passed(&self, frames: &[Frame], by_name_only: bool) -> usize {
        let over = |f: &Frame| {
            if by_name_only {
                self.by_name(f).is_some()
            } else {
                self.skipped(f).is_some()
            }
        };
        let mut i = 0;
        loop {
            while i < frames.len() && over(&frames[i]) {
                i += 1;
            }
            let Some(at) = frames.get(i) else {
                return i;
            };
            let inside = frames[i + 1..]
                .iter()
                .take(known::INSIDE)
                .take_while(|f| f.module == at.module)
                .position(|f| self.is_service(f));
            let jumped_to = i > 0
                && i + 1 < frames.len()
                && is_unnamed(at)
                && frames[i - 1].module == at.module
                && self.is_service(&frames[i - 1])
                && frames[..i - 1].iter().all(|f| self.is_base(f));
            match inside {
                Some(n) => i += n + 1,
                None if jumped_to => i += 1,
                None => return i,
            }
        }
    }

    /// The frame that names a stack's site: the innermost one not passed over, or the
    /// innermost one when every frame is.
    pub fn site(&self, frames: &[Frame]) -> SiteFrame {
        match self.passed(frames, false) {
            n if n >= frames.len() => SiteFrame(0),
            n => SiteFrame(n),
        }
    }

    /// The wrappers passed over at the sites of `stacks`, by name, each with why (the
    /// allocator's own frames and a service wrapper's unnamed insides left out).
    pub fn passed_over<'a>(
        &self,
        stacks: impl Iterator<Item = &'a [Frame]>,
    ) -> BTreeMap<Arc<str>, Skipped> {
        let mut out = BTreeMap::new();
        for frames in stacks {
            for f in self.site(frames).wrappers(frames) {
                match self.skipped(f) {
                    Some(Skipped::Allocator) | None => {}
                    Some(why) => {
                        out.insert(f.function.clone(), why);
                    }
                }
            }
        }
        out
    }

    /// The functions detection found, sorted.
    pub fn detected(&self) -> Vec<String> {
        let mut v: Vec<String> = self.detected.iter().map(|k| k.1.to_string()).collect();
        v.sort();
        v
    }

    pub fn rule(&self) -> &WrapperRule {
        &self.rule
    }
}

/// The Profile's wrappers, found once for the stacks it has: views ask per list, the live
/// view per refresh. A copy of the Profile starts without.
#[derive(Default)]
pub struct Cache(std::sync::Mutex<Option<(u64, Arc<Wrappers>)>>);

impl Clone for Cache {
    fn clone(&self) -> Cache {
        Cache::default()
    }
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Cache")
    }
}

impl Profile {
    /// The wrappers of this Profile's stacks by its rule; found again when its stacks or its
    /// rule changed (each stack is a shared handle: a changed one is a new handle).
    pub fn wrappers(&self) -> Arc<Wrappers> {
        let mut print = Arc::as_ptr(&self.wrapper_rule) as u64;
        for (k, s) in &self.stacks {
            let h = (u64::from(k.0) << 32 | u64::from(k.1 as u32)) ^ (s.as_ptr() as u64);
            print = print.rotate_left(5) ^ h;
        }
        print ^= self.stacks.len() as u64;
        let mut cache = self
            .wrappers_cache
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match &*cache {
            Some((p, w)) if *p == print => w.clone(),
            _ => {
                let w = Arc::new(Wrappers::of(self));
                *cache = Some((print, w.clone()));
                w
            }
        }
    }
}

/// What one pass saw of a function: the functions that called it, the places in it that called
/// the allocator, and whether it was seen anywhere but right above the allocator.
#[derive(Default)]
struct Seen {
    callers: HashSet<Arc<str>>,
    call_sites: HashSet<u64>,
    elsewhere: bool,
}

/// The functions the stacks show to be wrappers. A function is one when, in every stack it
/// is in, it is the innermost frame the allocator's own, the known and the hidden wrappers
/// leave (so it calls no other code that allocates), at least [`MIN_CALLERS`] distinct
/// functions call it, and it calls the allocator from at most [`MAX_CALL_SITES`] places.
/// `main` calling malloc from five places has one caller and five call sites: not one.
/// A later pass takes the frame a found wrapper was inlined into as right above the
/// allocator too (`zmalloc`, into which `ztrymalloc_usable` was inlined); a function
/// calling a wrapper that is a call of its own (`dictCreate` calling `zmalloc`) never is.
fn detect<'a>(w: &Wrappers, stacks: impl Iterator<Item = &'a [Frame]> + Clone) -> HashSet<Key> {
    let mut found: HashSet<Key> = HashSet::new();
    for _ in 0..PASSES {
        let mut seen: HashMap<Key, Seen> = HashMap::new();
        for frames in stacks.clone() {
            see(w, &found, frames, &mut seen);
        }
        let new: Vec<Key> = seen
            .into_iter()
            .filter(|(k, s)| is_wrapper(k, s) && !found.contains(k))
            .map(|(k, _)| k)
            .collect();
        if new.is_empty() {
            break;
        }
        found.extend(new);
    }
    found
}

/// One stack's part in a pass: the frame right above the allocator (past the wrappers found
/// so far, through inlined frames only), and every other frame as seen elsewhere. A stack
/// through a service's or a `--hide` wrapper has none: its wrappers are named, and the
/// function calling them is a site.
fn see(w: &Wrappers, found: &HashSet<Key>, frames: &[Frame], seen: &mut HashMap<Key, Seen>) {
    let mut at = frames
        .iter()
        .position(|f| !w.is_base(f))
        .unwrap_or(frames.len());
    let named = w.passed(frames, true);
    if named > at {
        for f in &frames[named.min(frames.len())..] {
            seen.entry(key(f)).or_default().elsewhere = true;
        }
        return;
    }
    // Past found wrappers inlined into their caller: the caller is right above the
    // allocator too, at the same return address.
    while at + 1 < frames.len() && frames[at].inlined && found.contains(&key(&frames[at])) {
        at += 1;
    }
    for (i, f) in frames.iter().enumerate().skip(at) {
        let s = seen.entry(key(f)).or_default();
        if i != at {
            s.elsewhere = true;
            continue;
        }
        if let Some(caller) = frames.get(i + 1)
            && s.callers.len() < KEEP
        {
            s.callers.insert(caller.function.clone());
        }
        if s.call_sites.len() < KEEP {
            s.call_sites.insert(f.offset);
        }
    }
}

/// A frame no symbol names: it reads `file+0x...`.
fn is_unnamed(f: &Frame) -> bool {
    f.function
        .strip_prefix(&*f.module)
        .is_some_and(|rest| rest.starts_with("+0x"))
}

fn is_wrapper((_, function): &Key, s: &Seen) -> bool {
    !s.elsewhere
        && s.callers.len() >= MIN_CALLERS
        && s.call_sites.len() <= MAX_CALL_SITES
        && !function.starts_with('[')
        // Where a stack ends: never a wrapper, however it calls malloc.
        && !crate::view::names::is_stack_bottom(function)
}

/// The line saying which wrappers the sites were named past, or None when none was.
pub fn note(skipped: &BTreeMap<Arc<str>, Skipped>, rule: &WrapperRule) -> Option<String> {
    if skipped.is_empty() {
        return None;
    }
    let mut by_why: BTreeMap<Skipped, Vec<&str>> = BTreeMap::new();
    for (name, why) in skipped {
        by_why.entry(*why).or_default().push(name);
    }
    let parts: Vec<String> = by_why
        .iter()
        .map(|(why, names)| {
            let shown: Vec<String> = names
                .iter()
                .take(8)
                .map(|n| crate::view::names::qualified_name(n))
                .collect();
            let more = match names.len().saturating_sub(8) {
                0 => String::new(),
                n => format!(" and {n} more"),
            };
            let how = match why {
                Skipped::Known => "known",
                Skipped::Hidden => "--hide",
                _ => "detected",
            };
            format!("{}{more} ({how})", shown.join(", "))
        })
        .collect();
    let off = if rule.no_detection {
        "detection off"
    } else {
        "--no-wrapper-detection turns detection off"
    };
    Some(format!(
        "sites named past allocator wrappers: {}; --hide REGEX names more, {off}\n",
        parts.join(", ")
    ))
}

/// Which functions were wrappers in `stacks`, for the JSON document: `known` (by name,
/// passed over at a site), `detected` (by the stacks' shape) and `hide` (the user's).
pub fn summary<'a>(w: &Wrappers, stacks: impl Iterator<Item = &'a [Frame]>) -> serde_json::Value {
    let known: Vec<Arc<str>> = w
        .passed_over(stacks)
        .into_iter()
        .filter(|(_, why)| *why == Skipped::Known)
        .map(|(name, _)| name)
        .collect();
    serde_json::json!({
        "detection": !w.rule.no_detection,
        "known": known,
        "detected": w.detected(),
        "hide": w.rule.hide.iter().map(|r| r.as_str()).collect::<Vec<_>>(),
    })
}

/// `--hide`'s value: a regular expression, said wrong before anything is attached.
pub fn parse_hide(s: &str) -> Result<regex::Regex, String> {
    regex::Regex::new(s).map_err(|e| format!("not a regular expression: {e}"))
}

/// The detected set of these stacks, for tests elsewhere.
#[cfg(test)]
pub fn detected_in(rule: WrapperRule, stacks: &[Vec<Frame>]) -> std::collections::BTreeSet<String> {
    Wrappers::with_rule(Arc::new(rule), stacks.iter().map(|s| &s[..]))
        .detected()
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests;
