//! The writing connection as one batch's writes see it.

use rusqlite::Connection;

/// The writing connection as a batch's writes see it, with the statements they (and the
/// batch's own `BEGIN`, savepoints and `COMMIT`) asked for held prepared until the batch
/// ends. Taking a statement from rusqlite's cache and putting it back copies and hashes its
/// SQL text both ways and clears its bindings, for every statement of every message;
/// here that happens once per batch.
pub(crate) struct Batch<'c> {
    conn: &'c Connection,
    pub(super) held: Vec<(&'static str, rusqlite::CachedStatement<'c>)>,
    /// While the writer keeps up: the rows between its turns given to other threads
    /// (`pace`).
    yield_every: Option<usize>,
    paced: usize,
}

impl<'c> Batch<'c> {
    /// `yield_every`: while the writer keeps up, the rows between its turns given to
    /// other threads (`pace`).
    pub(super) fn new(conn: &'c Connection, yield_every: Option<usize>) -> Self {
        Batch {
            conn,
            held: Vec::new(),
            yield_every,
            paced: 0,
        }
    }

    /// Called before a job writes `rows` rows: gives way to other threads once every
    /// `yield_every` rows or so (`Backlog::keeping_up`).
    pub(super) fn pace(&mut self, rows: usize) {
        if let Some(every) = self.yield_every {
            let before = self.paced / every;
            self.paced += rows;
            if self.paced / every != before {
                std::thread::yield_now();
            }
        }
    }

    pub(crate) fn conn(&self) -> &'c Connection {
        self.conn
    }

    /// `sql` prepared, from the second use in a batch on without going to the cache. Its
    /// parameters keep the values the last write bound (the cache would have cleared
    /// them): bind every one, as positional `params!` does.
    pub(crate) fn statement(
        &mut self,
        sql: &'static str,
    ) -> rusqlite::Result<&mut rusqlite::CachedStatement<'c>> {
        // The same literal is the same pointer; equal text from elsewhere still matches.
        let same = |held: &&str| std::ptr::eq(*held, sql) || *held == sql;
        let at = match self.held.iter().position(|(held, _)| same(held)) {
            Some(at) => at,
            None => {
                self.held.push((sql, self.conn.prepare_cached(sql)?));
                self.held.len() - 1
            }
        };
        Ok(&mut self.held[at].1)
    }

    /// Runs `sql`, a statement without parameters or rows (`SAVEPOINT job`, `COMMIT`).
    pub(super) fn exec(&mut self, sql: &'static str) -> rusqlite::Result<()> {
        self.statement(sql)?.execute([]).map(|_| ())
    }
}
