//! Timestamps as the protocols write them: the core keeps milliseconds since the epoch;
//! Tracker and Grid speak ISO-8601.

use std::sync::LazyLock;

use time::OffsetDateTime;
use time::format_description::BorrowedFormatItem;
use time::format_description::well_known::Rfc3339;

static MILLIS_UTC: LazyLock<Vec<BorrowedFormatItem<'static>>> = LazyLock::new(|| {
    time::format_description::parse(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z",
    )
    .expect("a valid format description")
});

/// The first and last millisecond of years 0000 to 9999, which `iso8601` writes itself.
const FOUR_DIGIT_YEARS: std::ops::RangeInclusive<i64> = -62_167_219_200_000..=253_402_300_799_999;
const MS_PER_DAY: i64 = 86_400_000;

/// Milliseconds since the epoch as RFC 3339 in UTC with milliseconds: `2026-01-24T16:30:00.000Z`.
pub fn iso8601(ms: i64) -> String {
    if !FOUR_DIGIT_YEARS.contains(&ms) {
        // `time` writes a sign before years under 0 and cannot reach 10000: rare enough for
        // its general formatter.
        return OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000)
            .ok()
            .and_then(|at| at.format(&*MILLIS_UTC).ok())
            .unwrap_or_else(|| "1970-01-01T00:00:00.000Z".to_owned());
    }
    // Every Tracker and Grid message carries one: written with plain integer arithmetic,
    // not through `time`'s 128-bit nanoseconds and a digit loop, in a sixth of the time
    // (27 ns against 169 ns, `cargo bench --bench hand_written`).
    let (year, month, day) = civil_from_days(ms.div_euclid(MS_PER_DAY));
    let of_day = ms.rem_euclid(MS_PER_DAY) as u32;
    let (hour, minute) = (of_day / 3_600_000, of_day / 60_000 % 60);
    let (second, milli) = (of_day / 1000 % 60, of_day % 1000);
    let mut out = *b"0000-00-00T00:00:00.000Z";
    let two = |out: &mut [u8; 24], at: usize, value: u32| {
        out[at] = b'0' + (value / 10) as u8;
        out[at + 1] = b'0' + (value % 10) as u8;
    };
    two(&mut out, 0, year / 100);
    two(&mut out, 2, year % 100);
    two(&mut out, 5, month);
    two(&mut out, 8, day);
    two(&mut out, 11, hour);
    two(&mut out, 14, minute);
    two(&mut out, 17, second);
    out[20] = b'0' + (milli / 100) as u8;
    two(&mut out, 21, milli % 100);
    std::str::from_utf8(&out)
        .expect("digits and separators are ASCII")
        .to_owned()
}

/// The proleptic Gregorian date `days` after 1970-01-01, for dates in years 0 to 9999
/// (Howard Hinnant's `civil_from_days`, with eras of 400 years).
fn civil_from_days(days: i64) -> (u32, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097) as u32; // [0, 146096]
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    // Months counted from March, so that February's leap day comes last.
    let march_month = (5 * day_of_year + 2) / 153; // [0, 11]
    let day = day_of_year - (153 * march_month + 2) / 5 + 1;
    let month = if march_month < 10 {
        march_month + 3
    } else {
        march_month - 9
    };
    let year = (era * 400) as i32 + year_of_era as i32 + i32::from(month <= 2);
    (year as u32, month, day)
}

/// An RFC 3339 / ISO-8601 date-time (any offset) as milliseconds since the epoch.
pub fn parse_iso8601(text: &str) -> Option<i64> {
    let at = OffsetDateTime::parse(text.trim(), &Rfc3339).ok()?;
    Some((at.unix_timestamp_nanos() / 1_000_000) as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_utc_with_milliseconds() {
        assert_eq!(iso8601(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(iso8601(1_767_225_600_123), "2026-01-01T00:00:00.123Z");
        assert_eq!(iso8601(-1), "1969-12-31T23:59:59.999Z");
        assert_eq!(iso8601(253_402_300_799_999), "9999-12-31T23:59:59.999Z");
        // Years before 0 go through `time`'s own formatter; both agree everywhere. The
        // instants step through years 0000 to 9999 by the golden ratio of their span, so
        // that they fall all over it (times of day and milliseconds too).
        let (first, last) = (*FOUR_DIGIT_YEARS.start(), *FOUR_DIGIT_YEARS.end());
        let span = last - first + 1;
        let step = (span as f64 * (5_f64.sqrt() - 1.0) / 2.0) as i64;
        let spread = (0..20_000_i64).map(|i| first + i * step % span);
        let edges = [
            -62_135_596_800_001,
            -62_167_219_200_000,
            -62_167_219_200_001,
            -62_198_755_200_001,
            0,
            951_782_400_042,
            951_868_799_999,
            4_107_542_399_999,
        ];
        for ms in edges.into_iter().chain(spread) {
            let at = OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000).unwrap();
            assert_eq!(iso8601(ms), at.format(&*MILLIS_UTC).unwrap());
        }
        assert!(iso8601(-62_198_755_200_001).starts_with('-'));
        assert_eq!(iso8601(253_402_300_800_000), "1970-01-01T00:00:00.000Z");
    }

    #[test]
    fn every_date_of_years_0000_to_9999_is_the_calendars() {
        let mut date = time::Date::from_calendar_date(0, time::Month::January, 1).unwrap();
        for days in -719_528..=2_932_896 {
            let expected = (
                date.year() as u32,
                u32::from(u8::from(date.month())),
                u32::from(date.day()),
            );
            assert_eq!(
                civil_from_days(days),
                expected,
                "{days} days after 1970-01-01"
            );
            date = date.next_day().unwrap_or(date);
        }
        assert_eq!(
            date,
            time::Date::from_calendar_date(9999, time::Month::December, 31).unwrap()
        );
    }

    #[test]
    fn parses_offsets_and_round_trips() {
        assert_eq!(
            parse_iso8601("2026-01-01T00:00:00Z"),
            Some(1_767_225_600_000)
        );
        assert_eq!(
            parse_iso8601("2026-01-01T02:00:00+02:00"),
            Some(1_767_225_600_000)
        );
        assert_eq!(
            parse_iso8601(&iso8601(1_767_225_600_123)),
            Some(1_767_225_600_123)
        );
        assert_eq!(parse_iso8601("yesterday"), None);
    }
}
