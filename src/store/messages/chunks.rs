//! Journaled rows put in the database many to a statement.
//!
//! A statement opens a cursor on `messages` and on each of its six indexes, seeks every
//! index from its root, and closes them all again; one statement of sixteen rows does that
//! once, and its cursors stay where the last row went, which is where the next one goes
//! when ids and times count up (as the bridge's own ids do). Sixteen messages to an
//! `INSERT`, and their recipients to another, cost the writer's thread about a quarter
//! fewer instructions than two statements a message.

use std::collections::HashSet;
use std::sync::LazyLock;

use super::row::{COLUMN_COUNT, COLUMNS, Row, Text};
use crate::store::{Batch, StoreError};

/// Statements hold 1, 2, 4, 8 or 16 rows: a round's rows are written by the largest that
/// fit, so that five statements of each kind are ever prepared.
const SIZES: usize = 5;
/// The most rows one statement puts in.
pub(in crate::store) const ROWS_PER_STATEMENT: usize = 1 << (SIZES - 1);

/// `INSERT`s of 1, 2, 4, 8 and 16 messages. A message whose id is stored already is left
/// for `put_piece` to find.
///
/// `OR IGNORE`, not `ON CONFLICT (id) DO NOTHING`: a statement of many rows that could
/// fail half-way (a `NOT NULL` column's default is to abort) keeps a statement journal,
/// a copy of every page it changes first, to undo what its first rows did: in the bridge
/// that cost 5.7k instructions a message, as much as sixteen rows to a statement saved. A
/// `Row` has no NULL where the schema forbids one (its types), so the only row ignored is
/// one whose id is stored.
static INSERT_MESSAGES: LazyLock<[String; SIZES]> = LazyLock::new(|| {
    std::array::from_fn(|size| {
        format!(
            "INSERT OR IGNORE INTO messages ({COLUMNS}) VALUES {}",
            placeholders(1 << size, COLUMN_COUNT)
        )
    })
});

/// `INSERT`s of 1, 2, 4, 8 and 16 recipients.
static INSERT_RECIPIENTS: LazyLock<[String; SIZES]> = LazyLock::new(|| {
    std::array::from_fn(|size| {
        format!(
            "INSERT OR IGNORE INTO message_recipients (name, seq) VALUES {}",
            placeholders(1 << size, 2)
        )
    })
});

/// `(?, ?), (?, ?)` for `rows` rows of `columns` values.
fn placeholders(rows: usize, columns: usize) -> String {
    let row = format!("({})", vec!["?"; columns].join(", "));
    vec![row; rows].join(", ")
}

/// `rows` in pieces of 16, 8, 4, 2 and 1: the largest that fits first.
fn pieces<T>(mut rows: &[T]) -> impl Iterator<Item = &[T]> {
    std::iter::from_fn(move || {
        let size = ROWS_PER_STATEMENT.min(1 << rows.len().checked_ilog2()?);
        let (piece, rest) = rows.split_at(size);
        rows = rest;
        Some(piece)
    })
}

/// The statement of `size` rows (a power of two up to `ROWS_PER_STATEMENT`) of `statements`.
fn of_size(statements: &'static [String; SIZES], size: usize) -> &'static str {
    &statements[size.trailing_zeros() as usize]
}

/// Puts a journal round's `rows` in the database, in order, as one `Row::insert` after
/// another would (a row with an id already stored replaces that message). They must not
/// be lost to a passing failure nor hold up every message after them (`Row::put_in`):
/// pieces that fail on their data are put in a row at a time, leaving out only the rows
/// that fail.
pub(in crate::store) fn put_journaled_in(
    rows: &[Row<'_>],
    batch: &mut Batch<'_>,
) -> Result<(), StoreError> {
    let mut recipients = Vec::new();
    for piece in pieces(rows) {
        batch.pace(piece.len());
        match put_piece(piece, batch, &mut recipients) {
            Ok(()) => {}
            // A row's own failure: the rows are put in again one at a time, those that
            // went in before replacing themselves, and only the failing one is left out.
            // (SQLite undid the failing statement; what came before it stays.)
            Err(e) if !e.is_passing(batch) => {
                for row in piece {
                    row.put_in(batch)?;
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Inserts `rows` (a power of two of them, at most `ROWS_PER_STATEMENT`) and their recipients;
/// `recipients` is room to gather them in. A row with an id already stored replaces that
/// message.
pub(super) fn put_piece<'r>(
    rows: &[Row<'r>],
    batch: &mut Batch<'_>,
    recipients: &mut Vec<(Text<'r>, i64)>,
) -> Result<(), StoreError> {
    let insert = batch.statement(of_size(&INSERT_MESSAGES, rows.len()))?;
    for (at, row) in rows.iter().enumerate() {
        for (column, value) in row.values().into_iter().enumerate() {
            insert.raw_bind_parameter(at * COLUMN_COUNT + column + 1, value)?;
        }
    }
    let inserted = insert.raw_execute()?;
    let last = batch.conn().last_insert_rowid();
    if inserted == rows.len() {
        // Each new row took the rowid after the largest (SQLite does so until one is
        // 2^63 - 1), in the order written: the last is `last`.
        let first = last - inserted as i64 + 1;
        debug_assert_eq!(
            seq_of(rows.last().expect("a piece has rows"), batch).ok(),
            Some(last),
            "rows numbered in the order written"
        );
        recipients.clear();
        for (row, seq) in rows.iter().zip(first..) {
            recipients.extend(row.recipients().map(|name| (name, seq)));
        }
        return insert_recipients(recipients, batch);
    }
    // Some ids were stored already: a client resending, or twice among these rows.
    // The rows inserted took the rowids after every stored one; the others replace the
    // message with their id, in order, as they would have one statement at a time.
    let first_new = (inserted > 0).then(|| last - inserted as i64 + 1);
    let mut seen = HashSet::new();
    for row in rows {
        let seq = seq_of(row, batch)?;
        let new = first_new.is_some_and(|first| seq >= first);
        let seq = if new && seen.insert(row.id.0) {
            seq
        } else {
            row.replace(batch.conn())?
        };
        recipients.clear();
        recipients.extend(row.recipients().map(|name| (name, seq)));
        insert_recipients(recipients, batch)?;
    }
    Ok(())
}

/// The stored message with `row`'s id: its number.
fn seq_of(row: &Row<'_>, batch: &mut Batch<'_>) -> Result<i64, StoreError> {
    Ok(batch
        .statement("SELECT seq FROM messages WHERE id = ?1")?
        .query_row([row.id], |r| r.get(0))?)
}

fn insert_recipients(
    recipients: &[(Text<'_>, i64)],
    batch: &mut Batch<'_>,
) -> Result<(), StoreError> {
    for piece in pieces(recipients) {
        let insert = batch.statement(of_size(&INSERT_RECIPIENTS, piece.len()))?;
        for (at, (name, seq)) in piece.iter().enumerate() {
            insert.raw_bind_parameter(2 * at + 1, name)?;
            insert.raw_bind_parameter(2 * at + 2, seq)?;
        }
        insert.raw_execute()?;
    }
    Ok(())
}

impl Row<'_> {
    /// Runs without a savepoint (`Store::write_unguarded`): the insert cannot fail on the
    /// data (`OR IGNORE`, and a `Row` has no NULL where the schema forbids one); any later
    /// failure fails the whole batch. (A replacement's DELETE parses the stored body, which
    /// the store itself wrote: a body it cannot parse means a damaged database.)
    pub(in crate::store) fn insert(&self, batch: &mut Batch<'_>) -> Result<(), StoreError> {
        put_piece(std::slice::from_ref(self), batch, &mut Vec::new())
    }

    /// `insert` for a message the journal acknowledged, which must not be lost to a
    /// passing failure nor hold up every message after it: an error of the disk's or the
    /// database's (full, unwritable, busy) is returned, to be tried again; one of this
    /// message's own (say, a stored body it replaces that does not parse) is logged, and
    /// the message left out of the database.
    pub(super) fn put_in(&self, batch: &mut Batch<'_>) -> Result<(), StoreError> {
        let Err(e) = self.insert(batch) else {
            return Ok(());
        };
        if e.is_passing(batch) {
            tracing::error!(error = %e, message_id = %self.id, "store: cannot put a journaled message in the database; trying again");
            return Err(e);
        }
        tracing::error!(error = %e, message_id = %self.id, "store: a journaled message cannot be put in the database; it is left out");
        Ok(())
    }
}

impl StoreError {
    /// Whether the error is the disk's or the database's (full, unwritable, busy) and the
    /// write is to be tried again, rather than one of the message's own; or it ended the
    /// transaction, taking the batch's other writes with it.
    fn is_passing(&self, batch: &Batch<'_>) -> bool {
        use rusqlite::ErrorCode::*;
        let passing = match self {
            StoreError::Sqlite(e) => matches!(
                e.sqlite_error_code(),
                Some(
                    DatabaseBusy
                        | DatabaseLocked
                        | OutOfMemory
                        | SystemIoFailure
                        | DiskFull
                        | ReadOnly
                        | CannotOpen
                )
            ),
            _ => false,
        };
        passing || batch.conn().is_autocommit()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_go_in_pieces_of_powers_of_two_largest_first() {
        let sizes = |n: usize| {
            let rows = vec![0; n];
            pieces(&rows).map(<[_]>::len).collect::<Vec<_>>()
        };
        assert_eq!(sizes(0), Vec::<usize>::new());
        assert_eq!(sizes(1), [1]);
        assert_eq!(sizes(13), [8, 4, 1]);
        assert_eq!(sizes(16), [16]);
        assert_eq!(sizes(40), [16, 16, 8]);
    }

    #[test]
    fn each_statement_has_a_placeholder_per_value() {
        for size in 0..SIZES {
            let rows = 1 << size;
            assert_eq!(
                INSERT_MESSAGES[size].matches('?').count(),
                rows * COLUMN_COUNT
            );
            assert_eq!(INSERT_RECIPIENTS[size].matches('?').count(), rows * 2);
        }
        assert_eq!(COLUMNS.split(',').count(), COLUMN_COUNT);
    }
}
