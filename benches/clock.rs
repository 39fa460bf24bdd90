//! UTC dates for benchmark reports, from the system clock (no calendar crate needed).

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch now.
fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// `YYYY-MM-DD` of a day count since 1970-01-01 (civil-from-days over 400-year eras,
/// proleptic Gregorian calendar).
fn civil(days: i64) -> String {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

/// Today's date (UTC), `YYYY-MM-DD`.
#[allow(dead_code)]
pub fn today() -> String {
    civil((now_secs() / 86_400) as i64)
}

/// `YYYY-MM-DD HH:MM UTC` now.
#[allow(dead_code)]
pub fn now_utc() -> String {
    let secs = now_secs();
    let rem = secs % 86_400;
    format!("{} {:02}:{:02} UTC", civil((secs / 86_400) as i64), rem / 3600, rem % 3600 / 60)
}
