//! The install plan.
