//! Family files.
