//! How a runner reads the manifest's `arch.axes`: each value checked for its kind and
//! bound, each error naming the axis and the family
//! (`arch.axes.NAME (family F): what is wrong`). Each runner says its own integer
//! bound and how it words a missing axis.

use crate::format::manifest::{self, Manifest};
use crate::runtime::error::RunError;

/// The error for `axis` of `m`: `msg` after the axis and the family.
pub(crate) fn axis_err(m: &Manifest, axis: &str, msg: &str) -> RunError {
    RunError::invalid(
        manifest::FILE_NAME,
        format!("arch.axes.{axis} (family {}): {msg}", m.family),
    )
}

/// The axes of one manifest, as one runner reads them.
pub(crate) struct Axes<'a> {
    manifest: &'a Manifest,
    /// Integer axes must be below this.
    below: u64,
    /// What the error says of a required axis that is absent.
    missing: &'static str,
}

impl<'a> Axes<'a> {
    /// `m`'s axes, integers below `below`, a missing required axis reported as
    /// `missing`.
    pub(crate) fn new(m: &'a Manifest, below: u64, missing: &'static str) -> Axes<'a> {
        Axes {
            manifest: m,
            below,
            missing,
        }
    }

    /// The error for `axis`: `msg` after the axis and the family.
    pub(crate) fn err(&self, axis: &str, msg: &str) -> RunError {
        axis_err(self.manifest, axis, msg)
    }

    /// The raw value, absent or null being `None`.
    pub(crate) fn value(&self, axis: &str) -> Option<&'a serde_json::Value> {
        self.manifest.arch.axes.get(axis).filter(|v| !v.is_null())
    }

    fn need<T>(&self, axis: &str, v: Option<T>) -> Result<T, RunError> {
        v.ok_or_else(|| self.err(axis, self.missing))
    }

    /// A positive integer below the bound, when present.
    pub(crate) fn opt_usize(&self, axis: &str) -> Result<Option<usize>, RunError> {
        match self.value(axis) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .filter(|&n| n > 0 && n < self.below)
                .map(|n| Some(n as usize))
                .ok_or_else(|| self.err(axis, &format!("{v} is not a positive integer"))),
        }
    }

    /// A positive integer below the bound.
    pub(crate) fn usize(&self, axis: &str) -> Result<usize, RunError> {
        let v = self.opt_usize(axis)?;
        self.need(axis, v)
    }

    /// A positive finite number, when present.
    pub(crate) fn opt_f64(&self, axis: &str) -> Result<Option<f64>, RunError> {
        match self.value(axis) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|f| f.is_finite() && *f > 0.0)
                .map(Some)
                .ok_or_else(|| self.err(axis, &format!("{v} is not a positive number"))),
        }
    }

    /// A positive finite number.
    pub(crate) fn f64(&self, axis: &str) -> Result<f64, RunError> {
        let v = self.opt_f64(axis)?;
        self.need(axis, v)
    }

    /// A boolean, when present.
    pub(crate) fn opt_bool(&self, axis: &str) -> Result<Option<bool>, RunError> {
        match self.value(axis) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(axis, &format!("{v} is not a boolean"))),
        }
    }

    /// A boolean.
    pub(crate) fn bool(&self, axis: &str) -> Result<bool, RunError> {
        let v = self.opt_bool(axis)?;
        self.need(axis, v)
    }
}
