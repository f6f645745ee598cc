//! One integration-test binary; each module covers one user-facing concern.

mod dry_run;
mod hostile_net;
mod hub_protocol;
mod install_e2e;
mod install_lock;
mod line_rate;
mod mlx_lm_parity;
mod progress;
mod quant_parity;
mod runtime;
mod source_http;
mod support;
mod text;
mod verify;
