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
    OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000)
        .ok()
        .and_then(|at| at.format(&*MILLIS_UTC).ok())
        .unwrap_or_else(|| "1970-01-01T00:00:00.000Z".to_owned())
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
