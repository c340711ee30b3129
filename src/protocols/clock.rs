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
    // Every Tracker and Grid message carries one: its digits are written directly, not
    // through a format description or `format!`'s padding (a third of the Tracker's
    // encoding, either way).
    let (hour, minute, second, milli) = at.to_hms_milli();
    let mut out = String::with_capacity(24);
    let fields = [
        (year.unsigned_abs(), 4, '-'),
        (u8::from(month).into(), 2, '-'),
        (day.into(), 2, 'T'),
        (hour.into(), 2, ':'),
        (minute.into(), 2, ':'),
        (second.into(), 2, '.'),
        (milli.into(), 3, 'Z'),
    ];
    for (value, width, then) in fields {
        push_digits(&mut out, value, width);
        out.push(then);
    }
    out
}

/// `value`'s last `width` decimal digits, zero-padded.
fn push_digits(out: &mut String, value: u32, width: u32) {
    for place in (0..width).rev() {
        let digit = value / 10u32.pow(place) % 10;
        out.push(char::from(b'0' + digit as u8));
    }
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
        let spread = (0..2_000_i64).map(|i| i * 126_701_150_399_999 % 253_402_300_800_000);
        for ms in [-62_135_596_800_001, -62_198_755_200_001, 0, 951_782_400_042]
            .into_iter()
            .chain(spread)
        {
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
