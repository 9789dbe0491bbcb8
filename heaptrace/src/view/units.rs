//! Figures as people read them: bytes in binary units, times in the unit that fits.

/// `n` bytes: "512 B", "1.5 KiB", "-2.0 MiB".
pub fn bytes(n: i64) -> String {
    let neg = n < 0;
    let mut v = n.unsigned_abs() as f64;
    let mut unit = "B";
    for u in ["KiB", "MiB", "GiB", "TiB"] {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    let sign = if neg { "-" } else { "" };
    if unit == "B" {
        format!("{sign}{v} B")
    } else {
        format!("{sign}{v:.1} {unit}")
    }
}

/// `ns` nanoseconds: "812 ns", "1.5 us", "2.0 ms", "1.25 s".
pub fn nanos(ns: u64) -> String {
    match ns {
        0..1_000 => format!("{ns} ns"),
        1_000..1_000_000 => format!("{:.1} us", ns as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} ms", ns as f64 / 1e6),
        _ => format!("{:.2} s", ns as f64 / 1e9),
    }
}
