//! Layers the models compose, written once over the backend's ops: the reader of the
//! manifest's architecture axes.

pub mod axes;
