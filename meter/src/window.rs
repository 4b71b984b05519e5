//! Window arithmetic.
//!
//! Rolling windows (`rolling_1m`, `rolling_1h`, `rolling_24h`) are fixed
//! windows keyed by the UTC timestamp truncated to their length: they reset,
//! they do not decay. `day` and `calendar_month` are calendar periods in a
//! time zone, so a day in Asia/Kathmandu starts at 18:15 UTC and a day in
//! New York across a DST change lasts 23 or 25 hours. `current` is the
//! windowless "right now" of a stock metric.
//!
//! Guarantee (property-tested): for every instant `at`, the window returned
//! contains it (`start <= at < resets_at`), and two instants get the same key
//! exactly when they fall in the same window.

use crate::error::named;
use chrono::{DateTime, Datelike, Duration, LocalResult, NaiveDate, TimeZone, Timelike, Utc};
use chrono_tz::Tz;
use serde::{Deserialize, Serialize};

/// The kinds of window a quota can count over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WindowKind {
    #[serde(rename = "rolling_1m")]
    Rolling1m,
    #[serde(rename = "rolling_1h")]
    Rolling1h,
    #[serde(rename = "rolling_24h")]
    Rolling24h,
    Day,
    CalendarMonth,
    Current,
}

impl WindowKind {
    pub const ALL: [WindowKind; 6] = [
        WindowKind::Rolling1m,
        WindowKind::Rolling1h,
        WindowKind::Rolling24h,
        WindowKind::Day,
        WindowKind::CalendarMonth,
        WindowKind::Current,
    ];
    /// The windows a flow metric (requests, calls, rows, …) is counted in.
    pub const FLOW: [WindowKind; 5] = [
        WindowKind::Rolling1m,
        WindowKind::Rolling1h,
        WindowKind::Rolling24h,
        WindowKind::Day,
        WindowKind::CalendarMonth,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            WindowKind::Rolling1m => "rolling_1m",
            WindowKind::Rolling1h => "rolling_1h",
            WindowKind::Rolling24h => "rolling_24h",
            WindowKind::Day => "day",
            WindowKind::CalendarMonth => "calendar_month",
            WindowKind::Current => "current",
        }
    }
}

named!(WindowKind, "window", WindowKind::ALL);

/// One concrete window: its key and its bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    pub kind: WindowKind,
    /// `2026-07-07T12:31Z` for rolling windows (the truncated start),
    /// `2026-07-07` for `day`, `2026-07` for `calendar_month`, `current`.
    pub key: String,
    pub start: DateTime<Utc>,
    /// When the next window begins; `None` for `current`, which never resets.
    pub resets_at: Option<DateTime<Utc>>,
}

impl Window {
    /// Whole seconds until the window resets, at least 1 (for `Retry-After`).
    pub fn retry_after_secs(&self, at: DateTime<Utc>) -> Option<u64> {
        let resets = self.resets_at?;
        let ms = (resets - at).num_milliseconds().max(0);
        Some(((ms + 999) / 1000).max(1) as u64)
    }
}

/// The window of `kind` that contains `at`; calendar kinds use `tz`.
///
/// Finding a window costs microseconds (a calendar one asks the time zone
/// database, and every key is written through a `strftime` format), and
/// every check, settle and fold asks for the same few again and again, so
/// the last ones found are kept per thread and given again while `at` falls
/// inside them (`start <= at < resets_at`: the window that contains an
/// instant is unique, so the answer is the same). Rolling windows do not
/// depend on the zone, so they are kept once whatever `tz` is.
pub fn window_at(kind: WindowKind, tz: Tz, at: DateTime<Utc>) -> Window {
    let tz_kept = match kind {
        WindowKind::Day | WindowKind::CalendarMonth => tz,
        WindowKind::Rolling1m | WindowKind::Rolling1h | WindowKind::Rolling24h => Tz::UTC,
        WindowKind::Current => return compute_window(kind, tz, at),
    };
    RECENT.with(|recent| {
        let Ok(mut recent) = recent.try_borrow_mut() else { return compute_window(kind, tz, at) };
        let found = recent
            .iter()
            .find(|(k, z, w)| *k == kind && *z == tz_kept && w.start <= at && w.resets_at.is_some_and(|r| at < r));
        if let Some((_, _, w)) = found {
            return w.clone();
        }
        let w = compute_window(kind, tz, at);
        match recent.iter_mut().find(|(k, z, _)| *k == kind && *z == tz_kept) {
            Some(slot) => slot.2 = w.clone(),
            None => {
                if recent.len() >= RECENT_WINDOWS {
                    recent.remove(0);
                }
                recent.push((kind, tz_kept, w.clone()));
            }
        }
        w
    })
}

/// How many windows (one per calendar kind and zone, one per rolling kind)
/// a thread keeps.
const RECENT_WINDOWS: usize = 16;

thread_local! {
    static RECENT: std::cell::RefCell<Vec<(WindowKind, Tz, Window)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`window_at`] computed afresh.
fn compute_window(kind: WindowKind, tz: Tz, at: DateTime<Utc>) -> Window {
    match kind {
        WindowKind::Rolling1m => fixed(kind, at, 60),
        WindowKind::Rolling1h => fixed(kind, at, 3600),
        WindowKind::Rolling24h => fixed(kind, at, 86_400),
        WindowKind::Day => {
            let date = at.with_timezone(&tz).date_naive();
            let next = date.succ_opt().unwrap_or(date);
            Window {
                kind,
                key: date.format("%Y-%m-%d").to_string(),
                start: local_midnight(tz, date),
                resets_at: Some(local_midnight(tz, next)),
            }
        }
        WindowKind::CalendarMonth => {
            let local = at.with_timezone(&tz).date_naive();
            let first = first_of_month(local.year(), local.month());
            let next = if local.month() == 12 {
                first_of_month(local.year() + 1, 1)
            } else {
                first_of_month(local.year(), local.month() + 1)
            };
            Window {
                kind,
                key: first.format("%Y-%m").to_string(),
                start: local_midnight(tz, first),
                resets_at: Some(local_midnight(tz, next)),
            }
        }
        WindowKind::Current => {
            Window { kind, key: "current".to_owned(), start: DateTime::<Utc>::UNIX_EPOCH, resets_at: None }
        }
    }
}

fn fixed(kind: WindowKind, at: DateTime<Utc>, secs: i64) -> Window {
    let ts = at.timestamp();
    let start_ts = ts - ts.rem_euclid(secs);
    let start = DateTime::<Utc>::from_timestamp(start_ts, 0).unwrap_or(at);
    Window {
        kind,
        key: start.format("%Y-%m-%dT%H:%MZ").to_string(),
        start,
        resets_at: Some(start + Duration::seconds(secs)),
    }
}

fn first_of_month(year: i32, month: u32) -> NaiveDate {
    // Invariant: day 1 exists in every month of every representable year.
    NaiveDate::from_ymd_opt(year, month, 1).unwrap_or(NaiveDate::MIN)
}

/// The first instant of local `date` in `tz`. Where midnight falls in a DST
/// gap (it does in a few zones), the day starts when the clocks resume.
fn local_midnight(tz: Tz, date: NaiveDate) -> DateTime<Utc> {
    let midnight = date.and_time(chrono::NaiveTime::MIN);
    for minute in 0..(24 * 60) {
        let local = midnight + Duration::minutes(minute);
        match tz.from_local_datetime(&local) {
            LocalResult::Single(t) => return t.with_timezone(&Utc),
            LocalResult::Ambiguous(earliest, _) => return earliest.with_timezone(&Utc),
            LocalResult::None => continue,
        }
    }
    // Unreachable for real zones: no gap lasts a whole day.
    Utc.from_utc_datetime(&midnight)
}

/// Truncates to whole seconds; event times are kept at microsecond precision
/// but windows never need more than seconds.
pub fn truncate_secs(at: DateTime<Utc>) -> DateTime<Utc> {
    at.with_nanosecond(0).unwrap_or(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).expect("test timestamp").with_timezone(&Utc)
    }

    #[test]
    fn rolling_windows_truncate_in_utc() {
        let at = utc("2026-07-07T12:31:45Z");
        let w = window_at(WindowKind::Rolling1m, Tz::UTC, at);
        assert_eq!(w.key, "2026-07-07T12:31Z");
        assert_eq!(w.resets_at, Some(utc("2026-07-07T12:32:00Z")));
        let w = window_at(WindowKind::Rolling1h, chrono_tz::Asia::Kathmandu, at);
        assert_eq!(w.key, "2026-07-07T12:00Z");
        let w = window_at(WindowKind::Rolling24h, Tz::UTC, at);
        assert_eq!(w.key, "2026-07-07T00:00Z");
        assert_eq!(w.resets_at, Some(utc("2026-07-08T00:00:00Z")));
    }

    proptest::proptest! {
        /// The windows kept per thread are the windows computed afresh,
        /// whatever the order of the instants and kinds asked about (back
        /// and forth across minutes, days, months and daylight-saving
        /// changes, in zones with odd offsets and midnights that do not
        /// exist; a rolling window kept for one zone given for another).
        #[test]
        fn kept_windows_are_the_computed_ones(
            steps in proptest::collection::vec(
                (0usize..5, proptest::prop_oneof![-90_000_000i64..90_000_000, -200i64..200], 0usize..6),
                1..60,
            )
        ) {
            let zones = [Tz::UTC, chrono_tz::America::Sao_Paulo, chrono_tz::Asia::Kathmandu,
                chrono_tz::America::Havana, chrono_tz::Australia::Lord_Howe];
            let base = utc("2026-03-08T06:59:59Z").timestamp();
            for (z, offset, kind) in steps {
                let at = DateTime::<Utc>::from_timestamp(base + offset, 0).expect("instant");
                let kind = WindowKind::ALL[kind];
                proptest::prop_assert_eq!(window_at(kind, zones[z], at), compute_window(kind, zones[z], at));
            }
        }
    }

    #[test]
    fn kathmandu_day_starts_at_1815_utc() {
        let tz = chrono_tz::Asia::Kathmandu;
        let w = window_at(WindowKind::Day, tz, utc("2026-07-07T18:14:59Z"));
        assert_eq!(w.key, "2026-07-07");
        let w = window_at(WindowKind::Day, tz, utc("2026-07-07T18:15:00Z"));
        assert_eq!(w.key, "2026-07-08");
        assert_eq!(w.start, utc("2026-07-07T18:15:00Z"));
        assert_eq!(w.resets_at, Some(utc("2026-07-08T18:15:00Z")));
    }

    #[test]
    fn new_york_month_spans_the_dst_change() {
        let tz = chrono_tz::America::New_York;
        let w = window_at(WindowKind::CalendarMonth, tz, utc("2026-03-20T12:00:00Z"));
        assert_eq!(w.key, "2026-03");
        assert_eq!(w.start, utc("2026-03-01T05:00:00Z"));
        assert_eq!(w.resets_at, Some(utc("2026-04-01T04:00:00Z")));
        let w = window_at(WindowKind::Day, tz, utc("2026-03-08T12:00:00Z"));
        assert_eq!((w.resets_at.expect("day resets") - w.start).num_hours(), 23);
        let w = window_at(WindowKind::Day, tz, utc("2026-11-01T12:00:00Z"));
        assert_eq!((w.resets_at.expect("day resets") - w.start).num_hours(), 25);
    }

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one() {
        let w = window_at(WindowKind::Rolling1m, Tz::UTC, utc("2026-07-07T12:31:59.200Z"));
        assert_eq!(w.retry_after_secs(utc("2026-07-07T12:31:59.200Z")), Some(1));
        assert_eq!(w.retry_after_secs(utc("2026-07-07T12:31:00Z")), Some(60));
        assert_eq!(w.retry_after_secs(utc("2026-07-07T12:31:00.5Z")), Some(60));
    }
}
