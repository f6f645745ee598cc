//! One integration-test binary; each module covers one user-facing concern.

mod decoder_variants;
mod deepseek;
mod deepseek_stored;
mod dequantized_twin;
mod doctor;
mod dry_run;
mod flagships;
mod flash_next;
mod flash_next_run;
mod fp8_source;
mod glm;
mod gptoss;
mod gptoss_mxfp4;
#[cfg(feature = "gpu")]
mod gpu;
#[cfg(feature = "gpu")]
mod gpu_flash;
mod hostile_bounds;
mod hostile_copied;
mod hostile_install;
mod hostile_net;
mod hub_protocol;
mod install_e2e;
mod install_lock;
mod kimi;
mod line_rate;
mod mixtral;
mod mlx_lm_parity;
mod mlx_source;
mod models;
mod mxfp4;
mod progress;
mod quant_parity;
mod quant_profiles;
mod qwen3next;
mod runtime;
mod serve;
mod source_http;
mod sources2;
mod support;
mod text;
mod verify;
