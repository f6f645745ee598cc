//! Every environment variable gturbo reads, declared once with its meaning.

/// Base URL of the Hugging Face-compatible endpoint (`https://huggingface.co` when unset).
/// `--endpoint` takes precedence.
pub const HF_ENDPOINT: &str = "HF_ENDPOINT";
/// Access token for gated or private repos. Never printed.
pub const HF_TOKEN: &str = "HF_TOKEN";
/// Path of a file holding the token (the Python client's convention).
pub const HF_TOKEN_PATH: &str = "HF_TOKEN_PATH";
/// Hugging Face home directory; the token file is `$HF_HOME/token`.
pub const HF_HOME: &str = "HF_HOME";
/// Disable progress bars when set to anything but `0` or empty.
pub const GTURBO_NO_PROGRESS: &str = "GTURBO_NO_PROGRESS";
/// `gturbo install --low-speed-limit`: bytes a transfer attempt must receive in every
/// `--low-speed-time` window (0: no limit).
pub const GTURBO_LOW_SPEED_LIMIT: &str = "GTURBO_LOW_SPEED_LIMIT";
/// `gturbo install --low-speed-time`: the low-speed window, in seconds.
pub const GTURBO_LOW_SPEED_TIME: &str = "GTURBO_LOW_SPEED_TIME";
/// `gturbo install --range-timeout`: most seconds one attempt at a range may wait.
pub const GTURBO_RANGE_TIMEOUT: &str = "GTURBO_RANGE_TIMEOUT";
/// `gturbo install --max-attempts`: attempts per request, the first included.
pub const GTURBO_MAX_ATTEMPTS: &str = "GTURBO_MAX_ATTEMPTS";
/// `gturbo serve --api-key`: the key every request must carry (`Authorization: Bearer
/// KEY` or `x-api-key: KEY`). Required when the server listens beyond loopback. Never
/// printed.
pub const GTURBO_API_KEY: &str = "GTURBO_API_KEY";
/// The hub gturbo talks to when neither `--endpoint` nor `HF_ENDPOINT` is given.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// Test hook: the install exits (status 137, as if killed) right after this many reads
/// are durably journaled in one run. Used by the resume tests; never set it otherwise.
pub const GTURBO_TEST_ABORT_AFTER_READS: &str = "GTURBO_TEST_ABORT_AFTER_READS";
/// Test hook: the install exits (status 137, as if killed) right after the rename that
/// publishes the output, before its journal and lock are removed. Never set it otherwise.
pub const GTURBO_TEST_EXIT_AFTER_PUBLISH: &str = "GTURBO_TEST_EXIT_AFTER_PUBLISH";
/// Test hook: skip the free-space preflight, so the tests can reach a real ENOSPC in the
/// middle of an install. Never set it otherwise.
pub const GTURBO_TEST_SKIP_SPACE_CHECK: &str = "GTURBO_TEST_SKIP_SPACE_CHECK";
/// Test hook: the machine's RAM in bytes, as `--quant auto` and `gturbo doctor` see it,
/// instead of the OS's figure. Used by the tests of the auto rule; never set it otherwise.
pub const GTURBO_TEST_RAM_BYTES: &str = "GTURBO_TEST_RAM_BYTES";
/// Test hook: the free bytes `gturbo doctor` reports at the output location, instead of
/// the filesystem's figure. Used by the doctor tests; never set it otherwise.
pub const GTURBO_TEST_FREE_DISK_BYTES: &str = "GTURBO_TEST_FREE_DISK_BYTES";
/// GPU backend, benchmarks: `LANESxROWS` forces `qmatvec_fast`'s tiling (lanes a power of
/// two from 4 to 256, 1 to 4 rows per set) for every product; unset or malformed: chosen
/// per shape.
pub const GTURBO_GPU_TILING: &str = "GTURBO_GPU_TILING";
/// GPU backend, benchmarks: `qmatvec_x24`'s invocations per 4 rows (a power of two, 4 to
/// 256) for every product; unset or out of range: chosen per shape.
pub const GTURBO_GPU_X24_LANES: &str = "GTURBO_GPU_X24_LANES";
/// GPU backend: `0` never rounds x to 24 bits for the 4-bit decode product
/// (`qmatvec_x24`), `1` does for every eligible product (tests, figures); unset: on
/// Vulkan and DX12 from 8 M codes.
pub const GTURBO_GPU_PACKED_X: &str = "GTURBO_GPU_PACKED_X";
/// GPU backend, benchmarks: submit the recorded work after this many dispatches (1 to
/// 4096; default 48).
pub const GTURBO_GPU_SUBMIT_EVERY: &str = "GTURBO_GPU_SUBMIT_EVERY";
/// GPU backend: `0` turns the fused kernels off (gate/up/SwiGLU of one token as one
/// dispatch; a resident MoE layer routed on the device), for before/after figures.
pub const GTURBO_GPU_FUSE: &str = "GTURBO_GPU_FUSE";
/// GPU backend: `0` turns off the split of decode attention over a long context across
/// workgroups, for before/after figures.
pub const GTURBO_GPU_ATTN_SPLIT: &str = "GTURBO_GPU_ATTN_SPLIT";
/// GPU backend: set (and not `0`) to count dispatches, submits and waits and, on an
/// adapter with timestamp queries, time every dispatch on the device; printed when the
/// backend is dropped.
pub const GTURBO_GPU_STATS: &str = "GTURBO_GPU_STATS";
/// Set to a non-empty value to draw progress without colour (<https://no-color.org>).
pub const NO_COLOR: &str = "NO_COLOR";
