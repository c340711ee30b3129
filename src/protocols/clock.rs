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

/// Milliseconds since the epoch as RFC 3339 in UTC with milliseconds: `2026-01-24T16:30:00.000Z`.
pub fn iso8601(ms: i64) -> String {
    let Ok(at) = OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000) else {
        return "1970-01-01T00:00:00.000Z".to_owned();
    };
    let (year, month, day) = at.to_calendar_date();
    if year < 0 {
        // `time` writes the sign and four digits; rare enough for the general formatter.
        return at
            .format(&*MILLIS_UTC)
            .unwrap_or_else(|_| "1970-01-01T00:00:00.000Z".to_owned());
    }
    // Every Tracker and Grid message carries one: written directly, not through a format
    // description (a third of the Tracker's encoding).
    let (hour, minute, second, milli) = at.to_hms_milli();
    format!(
        "{year:04}-{:02}-{day:02}T{hour:02}:{minute:02}:{second:02}.{milli:03}Z",
        u8::from(month)
    )
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
        // Years before 1 go through `time`'s own formatter; both agree everywhere.
        for ms in [-62_135_596_800_001, -62_198_755_200_001, 0, 951_782_400_042] {
            let at = OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000).unwrap();
            assert_eq!(iso8601(ms), at.format(&*MILLIS_UTC).unwrap());
        }
        assert!(iso8601(-62_198_755_200_001).starts_with('-'));
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
