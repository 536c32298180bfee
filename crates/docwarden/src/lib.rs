#![doc = include_str!("../README.md")]

pub mod backoff;
mod bulk;
pub mod capabilities;
pub mod check;
pub mod clock;
pub mod error;
pub mod format;
pub mod guard;
mod listener;
pub mod lock;
pub mod observe;
pub mod preflight;
pub mod queue;
pub mod sequence;
pub mod token;
pub mod validate;

pub use error::{Error, Result};
