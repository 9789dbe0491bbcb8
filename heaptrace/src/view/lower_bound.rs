//! Live and peak figures the live map could not hold whole. A block the live map (or the
//! in-process live table) had no room for is counted in `lost.live_map` and left out of the
//! live blocks and bytes and of the peak: with any such block, those are lower bounds, said
//! at each figure (`at least` in the text and the live view, `"lower_bound": true` and
//! `"estimated": true` in JSON) with the flag that would have avoided it.
use heaptrace_common::Loss;

use crate::profile::Profile;

/// Blocks of the processes shown (`pid`, or all) the live map had no room for.
pub fn untracked(profile: &Profile, pid: Option<u32>) -> u64 {
    if profile.calls {
        return 0;
    }
    profile.losses_of(pid)[Loss::LiveMap as usize]
}

/// "at least " before a live or peak figure that leaves out `untracked` blocks.
pub fn prefix(untracked: u64) -> &'static str {
    if untracked > 0 { "at least " } else { "" }
}

/// Why, after the figures: empty without untracked blocks.
pub fn why(untracked: u64) -> String {
    match untracked {
        0 => String::new(),
        _ => format!(" ({})", reason(untracked)),
    }
}

/// Why, inside parentheses already open: empty without untracked blocks.
pub fn why_within(untracked: u64) -> String {
    match untracked {
        0 => String::new(),
        _ => format!("; {}", reason(untracked)),
    }
}

fn reason(untracked: u64) -> String {
    format!("{untracked} blocks had no room in the live map: raise --live-map-size")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_untracked_blocks_make_a_lower_bound_and_name_the_flag() {
        assert_eq!(prefix(0), "");
        assert_eq!(why(0), "");
        assert_eq!(prefix(3), "at least ");
        assert!(why(3).contains("3 blocks") && why(3).contains("--live-map-size"));
        assert!(why_within(3).starts_with("; 3 blocks"));
        assert_eq!(why_within(0), "");
        let mut p = Profile::default();
        assert_eq!(untracked(&p, None), 0);
        p.losses[Loss::LiveMap as usize] = 7;
        assert_eq!(untracked(&p, None), 7);
        p.calls = true;
        assert_eq!(untracked(&p, None), 0);
    }
}
