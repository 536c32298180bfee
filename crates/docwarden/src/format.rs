//! The stored formats, typed: every field name and state docwarden writes, so tools (the
//! CLI, the checkers, a worker in another language) never spell one as a string literal.
//!
//! This module is a leaf: it depends on nothing else in the crate, so `check` can use it
//! without reaching the modules. [`crate::queue::format`] and [`crate::lock::format`]
//! re-export its parts next to the handles that write them.

pub mod job;
pub mod lock;
pub mod schedule;
