//! The bound on what one chat-template render may produce.
//!
//! A template's output is not bounded by its input: `tojson(indent=4)` over a
//! request's deeply nested tool schema writes a newline and the whole
//! indentation before every item, about 500 bytes of output per input byte
//! at 250 levels. So the render in progress on a thread has a budget of
//! output bytes (see [`ChatTemplate::render_limited`](super::template::ChatTemplate::render_limited)):
//! the output writer refuses to go past it, and so does `tojson`, which
//! builds its text in memory before writing it. Past the budget the render
//! stops with [`TemplateError::OutputTooLong`](super::template::TemplateError::OutputTooLong).

use std::cell::Cell;

thread_local! {
    /// Output bytes the render in progress on this thread may produce.
    static BUDGET: Cell<usize> = const { Cell::new(usize::MAX) };
    /// The render in progress went past its budget.
    static EXCEEDED: Cell<bool> = const { Cell::new(false) };
}

/// The budget of the render in progress on this thread (`usize::MAX` outside one).
pub(crate) fn remaining() -> usize {
    BUDGET.with(Cell::get)
}

/// Records that the render in progress went past its budget.
pub(crate) fn exceed() {
    EXCEEDED.with(|e| e.set(true));
}

/// A render's budget, in force until dropped (which restores the one before:
/// a template helper may render another template).
pub(crate) struct Scope {
    budget: usize,
    exceeded: bool,
}

impl Scope {
    pub(crate) fn enter(bytes: usize) -> Self {
        Self {
            budget: BUDGET.with(|b| b.replace(bytes)),
            exceeded: EXCEEDED.with(|e| e.replace(false)),
        }
    }

    /// Whether this render went past its budget.
    pub(crate) fn exceeded(&self) -> bool {
        EXCEEDED.with(Cell::get)
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        BUDGET.with(|b| b.set(self.budget));
        EXCEEDED.with(|e| e.set(self.exceeded));
    }
}

/// The render's output, refusing any write past `cap` bytes.
pub(crate) struct CappedOutput {
    pub(crate) bytes: Vec<u8>,
    cap: usize,
}

impl CappedOutput {
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            bytes: Vec::new(),
            cap,
        }
    }
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len().saturating_add(buf.len()) > self.cap {
            exceed();
            return Err(std::io::Error::other(
                "chat template output over its budget",
            ));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
