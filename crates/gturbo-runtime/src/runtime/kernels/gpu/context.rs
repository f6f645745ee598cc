//! Adapter selection, the device, pipelines, buffers, and the batch of recorded work.

use std::collections::HashMap;
use std::fmt;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use wgpu::util::DeviceExt;

use super::error::{GpuError, Result};
use super::shaders::{Kernel, KernelKey, PARAMS_SLOT, Shader};
use super::tuning;

/// The backends wgpu is asked for: Vulkan, Metal, DX12 (not GL, whose compute
/// support is partial).
const BACKENDS: wgpu::Backends = wgpu::Backends::PRIMARY;

/// Dispatches recorded before the batch is submitted on its own: one parameter slot
/// each in a 1 MiB uniform buffer. A SmolLM2 token records about 400.
const MAX_BATCH: usize = 4096;

/// Dispatches after which the batch is submitted without waiting, so the device runs
/// the first layers of a token while the host records the rest (without it the host
/// records the whole token, then the device runs it: their times add up).
/// `GTURBO_GPU_SUBMIT_EVERY` overrides it (benchmarks; `4096` gives one submit per
/// token).
const SUBMIT_EVERY: usize = 48;

/// Timestamp queries of one profiling batch (two per compute pass).
const MAX_QUERIES: u32 = 4096;

/// What the context did since it was made: the "where the time goes" figures
/// (`GTURBO_GPU_STATS=1` prints them when the [`super::Gpu`] is dropped).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GpuStats {
    /// Kernel dispatches recorded.
    pub dispatches: u64,
    /// Compute passes opened (a copy or clear between two dispatches ends one).
    pub passes: u64,
    /// Queue submits.
    pub submits: u64,
    /// Host waits for the device to go idle (flushes and read-backs).
    pub waits: u64,
    /// Read-backs (device to host copies the host waited for) and their bytes.
    pub readbacks: u64,
    pub readback_bytes: u64,
    /// Host-to-device writes recorded into the batch (expert slot fills, tensor
    /// writes) and their bytes.
    pub writes: u64,
    pub write_bytes: u64,
    /// Buffer copies and clears recorded.
    pub copies: u64,
    pub clears: u64,
    /// Host time spent recording dispatches (binding, encoding), in ns.
    pub record_ns: u64,
    /// Host time blocked waiting for the device, in ns.
    pub wait_ns: u64,
    /// Device time inside compute passes, from timestamp queries (ns; 0 without the
    /// adapter's `TIMESTAMP_QUERY` feature or when not profiling).
    pub gpu_ns: u64,
    /// Compute passes that had timestamps.
    pub timed_passes: u64,
}

impl fmt::Display for GpuStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} dispatches in {} passes, {} submits, {} waits ({:.2} ms), {} read-backs \
             ({} B), {} writes ({} B), {} copies, {} clears, recording {:.2} ms, device \
             time in passes {:.2} ms ({} timed passes)",
            self.dispatches,
            self.passes,
            self.submits,
            self.waits,
            self.wait_ns as f64 / 1e6,
            self.readbacks,
            self.readback_bytes,
            self.writes,
            self.write_bytes,
            self.copies,
            self.clears,
            self.record_ns as f64 / 1e6,
            self.gpu_ns as f64 / 1e6,
            self.timed_passes
        )
    }
}

/// Timestamp queries around every compute pass (profiling only: reading them back
/// makes each submit wait).
struct Profiler {
    queries: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    readback: wgpu::Buffer,
    /// Nanoseconds per timestamp tick.
    period: f64,
}

/// What wgpu reports about one adapter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterSummary {
    /// Position in [`list_adapters`]'s order (what `GpuOptions::adapter` takes).
    pub index: usize,
    /// Device name, e.g. `llvmpipe (LLVM 15.0.6, 256 bits)`.
    pub name: String,
    /// `Vulkan`, `Metal`, `Dx12`.
    pub backend: String,
    /// `DiscreteGpu`, `IntegratedGpu`, `VirtualGpu`, `Cpu`, `Other`.
    pub device_type: String,
    /// Driver name and version, where the backend reports them.
    pub driver: String,
    /// Largest buffer the adapter allows, in bytes. wgpu does not report the
    /// device's memory size; this and the binding limit are the memory facts it has.
    pub max_buffer_bytes: u64,
    /// Largest storage-buffer binding (the largest tensor a kernel can read).
    pub max_storage_binding_bytes: u64,
}

impl fmt::Display for AdapterSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} ({}, {}{}; buffers up to {} MiB, bindings up to {} MiB)",
            self.index,
            self.name,
            self.backend,
            self.device_type,
            if self.driver.is_empty() {
                String::new()
            } else {
                format!(", {}", self.driver)
            },
            self.max_buffer_bytes >> 20,
            self.max_storage_binding_bytes >> 20
        )
    }
}

fn summary(index: usize, a: &wgpu::Adapter) -> AdapterSummary {
    let info = a.get_info();
    let limits = a.limits();
    let driver = [info.driver.as_str(), info.driver_info.as_str()]
        .iter()
        .filter(|s| !s.is_empty())
        .copied()
        .collect::<Vec<_>>()
        .join(" ");
    AdapterSummary {
        index,
        name: info.name,
        backend: format!("{:?}", info.backend),
        device_type: format!("{:?}", info.device_type),
        driver,
        max_buffer_bytes: limits.max_buffer_size,
        max_storage_binding_bytes: limits.max_storage_buffer_binding_size,
    }
}

fn instance() -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = BACKENDS;
    wgpu::Instance::new(desc)
}

fn adapters(instance: &wgpu::Instance) -> Vec<wgpu::Adapter> {
    let mut all = pollster::block_on(instance.enumerate_adapters(BACKENDS));
    // Best first: discrete, integrated, virtual, other, then software (llvmpipe).
    all.sort_by_key(|a| match a.get_info().device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    });
    all
}

/// Every adapter wgpu sees on the Vulkan, Metal and DX12 backends, best first (the
/// order [`GpuContext::new`] picks from). Empty when there is none.
pub fn list_adapters() -> Vec<AdapterSummary> {
    adapters(&instance())
        .iter()
        .enumerate()
        .map(|(i, a)| summary(i, a))
        .collect()
}

/// How to pick the adapter.
#[derive(Debug, Clone, Default)]
pub struct GpuOptions {
    /// An index from [`list_adapters`], or a case-insensitive part of the adapter's
    /// name; `None` takes the first (best) one.
    pub adapter: Option<String>,
    /// Ask for timestamp queries (where the adapter has them) so that
    /// [`GpuContext::set_pass_timestamps`] can time whole compute passes (benchmarks).
    pub pass_timestamps: bool,
}

/// Work recorded but not yet submitted.
struct Batch {
    /// The open compute pass: consecutive dispatches share one (each dispatch is its
    /// own usage scope, so wgpu still orders one's writes before the next one's
    /// reads); a copy, a clear or the submit ends it first.
    pass: Option<wgpu::ComputePass<'static>>,
    encoder: Option<wgpu::CommandEncoder>,
    /// Parameter bytes of each recorded dispatch, `PARAMS_SLOT` apart.
    params: Vec<u8>,
    /// The uniform buffer this batch's parameter slots live in.
    params_buf: Arc<wgpu::Buffer>,
    dispatches: usize,
    /// Timestamp queries written in this batch, and the kernel of each pair
    /// (profiling gives every dispatch a pass of its own).
    queries: u32,
    timed: Vec<&'static str>,
}

/// One GPU: its device and queue, the compiled pipelines and the recording batch.
/// Shareable between threads; recording is serialised by a lock.
pub struct GpuContext {
    pub(crate) device: wgpu::Device,
    queue: wgpu::Queue,
    summary: AdapterSummary,
    limits: wgpu::Limits,
    pipelines: Mutex<HashMap<KernelKey, Arc<wgpu::ComputePipeline>>>,
    modules: Mutex<HashMap<Shader, Arc<wgpu::ShaderModule>>>,
    batch: Mutex<Batch>,
    /// The first error the device raised outside an error scope, reported by the
    /// next flush.
    error: Arc<Mutex<Option<String>>>,
    /// Bytes of the storage buffers made so far (weights, caches, activations; the
    /// backend reuses activation buffers, so this is close to what is held).
    allocated: AtomicU64,
    stats: Mutex<GpuStats>,
    /// Device time per kernel entry point (profiling): dispatches and ns.
    per_kernel: Mutex<HashMap<&'static str, (u64, f64)>>,
    profiler: Option<Profiler>,
    submit_every: std::sync::atomic::AtomicUsize,
    /// `qmatvec_fast`'s lanes and rows per set when set (benchmarks), else
    /// [`tuning::matvec_tiling`].
    tiling: Mutex<Option<(u32, u32)>>,
    /// Whether gate/up/SwiGLU of one token run as one dispatch
    /// (`GTURBO_GPU_FUSE=0` turns it off, for before/after figures).
    pub(crate) fuse_glu: bool,
    /// Whether a resident MoE layer routes and runs its experts on the device with
    /// no read-back (`GTURBO_GPU_FUSE=0` turns it off too).
    pub(crate) fuse_moe: bool,
    /// Whether decode attention over a long context splits its positions across
    /// workgroups (`GTURBO_GPU_ATTN_SPLIT=0` turns it off, for before/after figures).
    pub(crate) attn_split: bool,
    /// The split attention's partial results, grown by doubling and reused.
    attn_part: Mutex<Option<Arc<wgpu::Buffer>>>,
    /// The smallest `rows · cols` whose 4-bit decode product takes the packed 24-bit
    /// x kernel (`qmatvec_x24`); `None`: never.
    pub(crate) packed_x_min: Mutex<Option<usize>>,
    /// x as `qmatvec_x24` reads it, and which x that is.
    pub(crate) packed_x: Mutex<PackedX>,
    /// `qmatvec_x24`'s lanes per 4 rows when set (`GTURBO_GPU_X24_LANES`, tests),
    /// else [`tuning::x24_lanes`].
    pub(crate) x24_lanes: Mutex<Option<u32>>,
    /// Profiling (`GTURBO_GPU_STATS`): every dispatch gets a pass of its own, timed.
    time_each_dispatch: bool,
    /// Whether passes opened now get timestamps (profiling, or a benchmark's
    /// [`GpuContext::set_pass_timestamps`]).
    time_passes: AtomicBool,
}

/// The packed-x buffer (grown, reused) and the x it holds now: `(x's buffer, cols)`,
/// valid until anything else is recorded (every other dispatch, copy, clear or write
/// forgets it, so a later write to that x can never be missed).
#[derive(Default)]
pub(crate) struct PackedX {
    pub(crate) buf: Option<Arc<wgpu::Buffer>>,
    pub(crate) holds: Option<(wgpu::Buffer, usize)>,
}

impl fmt::Debug for GpuContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuContext")
            .field("adapter", &self.summary)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The index of the adapter `opts.adapter` names (an index or part of a name;
/// the first when it names none).
fn pick_adapter(all: &[wgpu::Adapter], opts: &GpuOptions) -> Result<usize> {
    let Some(want) = &opts.adapter else {
        return Ok(0);
    };
    let by_index = want.parse::<usize>().ok().filter(|&i| i < all.len());
    let lower = want.to_lowercase();
    by_index
        .or_else(|| {
            all.iter()
                .position(|a| a.get_info().name.to_lowercase().contains(&lower))
        })
        .ok_or_else(|| GpuError::AdapterNotFound {
            wanted: want.clone(),
            available: all
                .iter()
                .enumerate()
                .map(|(i, a)| {
                    let info = a.get_info();
                    format!("{i}: {} ({:?})", info.name, info.backend)
                })
                .collect::<Vec<_>>()
                .join("; "),
        })
}

/// The device with everything the adapter allows (weights of real models exceed
/// WebGPU's default 128 MiB binding), and timestamps only when `timestamps` and
/// only where the adapter has them.
fn open_device(
    adapter: &wgpu::Adapter,
    summary: &AdapterSummary,
    limits: &wgpu::Limits,
    timestamps: bool,
) -> Result<(wgpu::Device, wgpu::Queue, wgpu::Features)> {
    let features = if timestamps {
        adapter.features() & wgpu::Features::TIMESTAMP_QUERY
    } else {
        wgpu::Features::empty()
    };
    let desc = wgpu::DeviceDescriptor {
        label: Some("gturbo"),
        required_features: features,
        required_limits: limits.clone(),
        experimental_features: wgpu::ExperimentalFeatures::disabled(),
        memory_hints: wgpu::MemoryHints::Performance,
        trace: wgpu::Trace::Off,
    };
    let (device, queue) =
        pollster::block_on(adapter.request_device(&desc)).map_err(|e| GpuError::Device {
            adapter: summary.name.clone(),
            message: e.to_string(),
        })?;
    Ok((device, queue, features))
}

/// The slot the device's first uncaptured error is kept in.
fn error_sink(device: &wgpu::Device) -> Arc<Mutex<Option<String>>> {
    let error: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
    let sink = error.clone();
    device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
        let mut slot = lock(&sink);
        if slot.is_none() {
            *slot = Some(e.to_string());
        }
    }));
    error
}

/// The pass-timestamp query set and its buffers, where the device has timestamps.
fn profiler(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    features: wgpu::Features,
) -> Option<Profiler> {
    features.contains(wgpu::Features::TIMESTAMP_QUERY).then(|| {
        let bytes = u64::from(MAX_QUERIES) * 8;
        let buf = |usage| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("timestamps"),
                size: bytes,
                usage,
                mapped_at_creation: false,
            })
        };
        Profiler {
            queries: device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("pass timestamps"),
                ty: wgpu::QueryType::Timestamp,
                count: MAX_QUERIES,
            }),
            resolve: buf(wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC),
            readback: buf(wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST),
            period: f64::from(queue.get_timestamp_period()),
        }
    })
}

impl GpuContext {
    /// Open the adapter `opts` picks. Errors name what was found.
    pub fn new(opts: &GpuOptions) -> Result<GpuContext> {
        let instance = instance();
        let all = adapters(&instance);
        if all.is_empty() {
            return Err(GpuError::NoAdapter);
        }
        let index = pick_adapter(&all, opts)?;
        let adapter = &all[index];
        let summary = summary(index, adapter);
        let limits = adapter.limits();
        let profile = tuning::profiling();
        let (device, queue, features) =
            open_device(adapter, &summary, &limits, profile || opts.pass_timestamps)?;
        let error = error_sink(&device);
        let params_buf = Arc::new(device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("params"),
            size: (MAX_BATCH * PARAMS_SLOT) as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }));
        let profiler = profiler(&device, &queue, features);
        let submit_every = tuning::submit_every()
            .unwrap_or(SUBMIT_EVERY)
            .clamp(1, MAX_BATCH);
        Ok(GpuContext {
            stats: Mutex::new(GpuStats::default()),
            per_kernel: Mutex::new(HashMap::new()),
            profiler,
            submit_every: std::sync::atomic::AtomicUsize::new(submit_every),
            tiling: Mutex::new(tuning::forced_tiling()),
            fuse_glu: tuning::fuse(),
            fuse_moe: tuning::fuse(),
            attn_split: tuning::attn_split(),
            attn_part: Mutex::new(None),
            packed_x_min: Mutex::new(tuning::packed_x_min(adapter.get_info().backend)),
            packed_x: Mutex::new(PackedX::default()),
            x24_lanes: Mutex::new(tuning::forced_x24_lanes()),
            time_each_dispatch: profile,
            time_passes: AtomicBool::new(profile),
            device,
            queue,
            summary,
            limits,
            pipelines: Mutex::new(HashMap::new()),
            modules: Mutex::new(HashMap::new()),
            batch: Mutex::new(Batch {
                pass: None,
                encoder: None,
                params: Vec::new(),
                params_buf,
                dispatches: 0,
                queries: 0,
                timed: Vec::new(),
            }),
            error,
            allocated: AtomicU64::new(0),
        })
    }

    /// The adapter this context runs on.
    pub fn adapter(&self) -> &AdapterSummary {
        &self.summary
    }

    /// Bytes of the device buffers this context made (weights, caches, activations).
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated.load(Ordering::Relaxed)
    }

    /// Submit the batch on its own after `n` dispatches (1 to 4096; the default 48,
    /// or `GTURBO_GPU_SUBMIT_EVERY`). A benchmark timing one batch from submit to
    /// idle sets 4096, so nothing runs before its clock starts.
    pub fn set_submit_every(&self, n: usize) {
        self.submit_every
            .store(n.clamp(1, MAX_BATCH), Ordering::Relaxed);
    }

    /// Force `qmatvec_fast`'s tiling: `lanes` invocations (a power of two, 4 to 256)
    /// over each set of `rows` rows (1 to 4); `None` restores the shape-based choice.
    /// For benchmarks.
    pub fn set_matvec_tiling(&self, tiling: Option<(u32, u32)>) -> Result<()> {
        if let Some((lanes, rows)) = tiling
            && !tuning::valid_tiling(lanes, rows)
        {
            return Err(GpuError::Shape {
                op: "matvec tiling",
                message: format!(
                    "{lanes} lanes × {rows} rows (want 4..=256 lanes, a power of two, and 1..=4 rows)"
                ),
            });
        }
        *lock(&self.tiling) = tiling;
        Ok(())
    }

    /// Which 4-bit decode products take the packed 24-bit x kernel: those of at least
    /// `min_codes` codes (`Some(0)`: every eligible one), or none. For tests and
    /// benchmarks; the default depends on the backend (`GTURBO_GPU_PACKED_X`).
    pub fn set_packed_x(&self, min_codes: Option<usize>) {
        *lock(&self.packed_x_min) = min_codes;
    }

    /// Run `f` on the packed-x state, with nothing else recorded meanwhile.
    pub(crate) fn with_packed_x<R>(&self, f: impl FnOnce(&mut PackedX) -> R) -> R {
        f(&mut lock(&self.packed_x))
    }

    /// Time each compute pass opened from now on on the device (where the context
    /// was made with [`GpuOptions::pass_timestamps`] and the adapter has timestamps;
    /// otherwise nothing is timed): [`GpuStats::gpu_ns`] then adds each pass's device
    /// time, gaps between its dispatches included. Reading the timestamps back makes
    /// each submit wait, so a benchmark times the wall clock with this off.
    pub fn set_pass_timestamps(&self, on: bool) {
        self.time_passes.store(on, Ordering::Relaxed);
    }

    /// The smallest product (in codes) that takes the packed 24-bit x kernel, or
    /// `None`: see [`GpuContext::set_packed_x`].
    pub fn packed_x_min(&self) -> Option<usize> {
        *lock(&self.packed_x_min)
    }

    /// Force `qmatvec_x24`'s invocations per 4 rows (a power of two, 4 to 256; other
    /// values are refused); `None` restores the shape-based choice. For tests and
    /// benchmarks.
    pub fn set_x24_lanes(&self, lanes: Option<u32>) -> Result<()> {
        if let Some(l) = lanes
            && !tuning::valid_x24_lanes(l)
        {
            return Err(GpuError::Shape {
                op: "x24 lanes",
                message: format!("{l} lanes (want a power of two, 4 to 256)"),
            });
        }
        *lock(&self.x24_lanes) = lanes;
        Ok(())
    }

    /// `qmatvec_x24`'s invocations per 4 rows for `rows` rows of `row_v` code words.
    pub(crate) fn x24_lanes_for(&self, row_v: usize, rows: usize) -> u32 {
        lock(&self.x24_lanes).unwrap_or_else(|| tuning::x24_lanes(row_v, rows))
    }

    /// Record `f`, something other than a packed-x product: the packed x may no longer
    /// be what its buffer holds. It is forgotten under the same lock that
    /// [`GpuContext::with_packed_x`] holds while it records, so no packed-x product of
    /// another thread can come between the forgetting and the recording.
    fn forgetting_packed_x<R>(&self, f: impl FnOnce() -> R) -> R {
        let mut held = lock(&self.packed_x);
        held.holds = None;
        f()
    }

    /// A buffer of at least `floats` f32s for the split attention's partials (one
    /// buffer, reused: wgpu orders each dispatch's writes before the next one's reads).
    pub(crate) fn attn_partials(&self, floats: usize) -> Result<Arc<wgpu::Buffer>> {
        let bytes = (floats as u64 * 4).next_power_of_two().max(1 << 16);
        let mut held = lock(&self.attn_part);
        if let Some(b) = held.as_ref().filter(|b| b.size() >= bytes) {
            return Ok(b.clone());
        }
        let b = self.buffer("attention partials", bytes)?;
        *held = Some(b.clone());
        Ok(b)
    }

    /// `qmatvec_fast`'s tiling when forced ([`GpuContext::set_matvec_tiling`],
    /// `GTURBO_GPU_TILING`), else `None`: chosen per shape.
    pub(crate) fn forced_tiling(&self) -> Option<(u32, u32)> {
        *lock(&self.tiling)
    }

    /// What the context has done so far (dispatches, submits, waits, times).
    pub fn stats(&self) -> GpuStats {
        *lock(&self.stats)
    }

    /// Device time per kernel entry point (profiling with timestamps): `(entry,
    /// dispatches, ns)`, most time first.
    pub fn kernel_times(&self) -> Vec<(&'static str, u64, f64)> {
        let mut v: Vec<_> = lock(&self.per_kernel)
            .iter()
            .map(|(&k, &(n, ns))| (k, n, ns))
            .collect();
        v.sort_by(|a, b| b.2.total_cmp(&a.2));
        v
    }

    /// Whether `GTURBO_GPU_STATS` asked for the figures.
    pub fn profiling(&self) -> bool {
        tuning::profiling()
    }

    fn count(&self, f: impl FnOnce(&mut GpuStats)) {
        f(&mut lock(&self.stats));
    }

    /// The size a buffer of `bytes` is given (at least 16: WebGPU binds no empty
    /// buffer; a whole number of words), checked against the adapter's limits.
    pub(crate) fn buffer_size(&self, what: &str, bytes: u64) -> Result<u64> {
        let size = bytes.max(16).next_multiple_of(4);
        let limit = self
            .limits
            .max_buffer_size
            .min(self.limits.max_storage_buffer_binding_size);
        if size > limit {
            return Err(GpuError::TooLarge {
                what: what.to_string(),
                bytes,
                limit,
            });
        }
        self.allocated.fetch_add(size, Ordering::Relaxed);
        Ok(size)
    }

    /// A zero-filled device buffer of `bytes` (at least 16: WebGPU binds no empty
    /// buffer), usable as storage and as copy source and destination.
    pub(crate) fn buffer(&self, what: &str, bytes: u64) -> Result<Arc<wgpu::Buffer>> {
        let size = self.buffer_size(what, bytes)?;
        Ok(Arc::new(self.device.create_buffer(
            &wgpu::BufferDescriptor {
                label: Some(what),
                size,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            },
        )))
    }

    /// A new device buffer holding `bytes` (padded with zeros to a whole word). Made
    /// with its contents, so no staging copy waits in the batch (weights of a large
    /// model would otherwise be held twice until the first flush); nothing recorded
    /// can read a buffer that did not exist, so this is in order with the batch.
    pub(crate) fn upload_bytes(&self, what: &str, bytes: &[u8]) -> Result<Arc<wgpu::Buffer>> {
        let size = self.buffer_size(what, bytes.len() as u64)?;
        let mut data = bytes.to_vec();
        data.resize(size as usize, 0);
        Ok(Arc::new(self.device.create_buffer_init(
            &wgpu::util::BufferInitDescriptor {
                label: Some(what),
                contents: &data,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
            },
        )))
    }

    /// Record setting every byte of `buf` to zero (in order with the batch).
    pub(crate) fn clear(&self, buf: &wgpu::Buffer) {
        self.count(|s| s.clears += 1);
        self.forgetting_packed_x(|| {
            let mut batch = lock(&self.batch);
            self.encoder(&mut batch).clear_buffer(buf, 0, None);
        });
    }

    /// Write `bytes` at `offset` of `buf`, in order with the recorded dispatches
    /// (a staging copy recorded into the batch, not a queue write that would land
    /// before all of it).
    pub(crate) fn write_bytes(&self, buf: &wgpu::Buffer, offset: u64, bytes: &[u8]) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        let padded = bytes.len().next_multiple_of(4);
        if !offset.is_multiple_of(4) || offset + padded as u64 > buf.size() {
            return Err(GpuError::Shape {
                op: "write",
                message: format!(
                    "{} bytes at {offset} into a buffer of {}",
                    bytes.len(),
                    buf.size()
                ),
            });
        }
        let mut data = bytes.to_vec();
        data.resize(padded, 0);
        let staging = self
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("staging"),
                contents: &data,
                usage: wgpu::BufferUsages::COPY_SRC,
            });
        self.count(|s| {
            s.writes += 1;
            s.write_bytes += padded as u64;
        });
        self.forgetting_packed_x(|| {
            let mut batch = lock(&self.batch);
            self.encoder(&mut batch)
                .copy_buffer_to_buffer(&staging, 0, buf, offset, padded as u64);
        });
        Ok(())
    }

    /// Record a buffer-to-buffer copy (sizes and offsets in bytes, multiples of 4).
    pub(crate) fn copy(
        &self,
        src: &wgpu::Buffer,
        src_off: u64,
        dst: &wgpu::Buffer,
        dst_off: u64,
        bytes: u64,
    ) {
        self.count(|s| s.copies += 1);
        self.forgetting_packed_x(|| {
            let mut batch = lock(&self.batch);
            self.encoder(&mut batch)
                .copy_buffer_to_buffer(src, src_off, dst, dst_off, bytes);
        });
    }

    /// The batch's encoder, outside any compute pass (for copies and clears).
    fn encoder<'b>(&self, batch: &'b mut Batch) -> &'b mut wgpu::CommandEncoder {
        // The pass holds the encoder until it ends.
        drop(batch.pass.take());
        batch.encoder.get_or_insert_with(|| {
            self.device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None })
        })
    }

    /// Submit the recorded work and wait for it; reports any device error raised
    /// since the last flush.
    pub fn flush(&self) -> Result<()> {
        self.submit()?;
        self.wait()
    }

    fn submit(&self) -> Result<()> {
        let mut batch = lock(&self.batch);
        self.submit_locked(&mut batch);
        drop(batch);
        self.take_error()
    }

    fn submit_locked(&self, batch: &mut Batch) {
        if !batch.params.is_empty() {
            self.queue.write_buffer(&batch.params_buf, 0, &batch.params);
            batch.params.clear();
        }
        batch.dispatches = 0;
        drop(batch.pass.take());
        let queries = std::mem::take(&mut batch.queries);
        let timed = std::mem::take(&mut batch.timed);
        if let Some(mut enc) = batch.encoder.take() {
            if let (Some(p), true) = (&self.profiler, queries > 0) {
                enc.resolve_query_set(&p.queries, 0..queries, &p.resolve, 0);
                enc.copy_buffer_to_buffer(&p.resolve, 0, &p.readback, 0, u64::from(queries) * 8);
            }
            self.queue.submit([enc.finish()]);
            self.count(|s| s.submits += 1);
            if let (Some(p), true) = (&self.profiler, queries > 0) {
                self.read_timestamps(p, queries, &timed);
            }
        }
    }

    /// Wait for the batch just submitted and add its passes' device time (profiling).
    fn read_timestamps(&self, p: &Profiler, queries: u32, timed: &[&'static str]) {
        let slice = p.readback.slice(..u64::from(queries) * 8);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| drop(tx.send(r)));
        let waited = self.device.poll(wgpu::PollType::Wait {
            submission_index: None,
            timeout: None,
        });
        if waited.is_err() || !matches!(rx.recv(), Ok(Ok(()))) {
            return;
        }
        if let Ok(view) = slice.get_mapped_range() {
            let ticks: Vec<u64> = view
                .chunks_exact(8)
                .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                .collect();
            let mut ns = 0.0;
            let mut per = lock(&self.per_kernel);
            for (t, entry) in ticks.chunks_exact(2).zip(timed) {
                let d = t[1].saturating_sub(t[0]) as f64 * p.period;
                ns += d;
                let e = per.entry(entry).or_default();
                e.0 += 1;
                e.1 += d;
            }
            drop(per);
            self.count(|s| {
                s.gpu_ns += ns as u64;
                s.timed_passes += u64::from(queries / 2);
            });
        }
        p.readback.unmap();
    }

    fn wait(&self) -> Result<()> {
        let t = std::time::Instant::now();
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: None,
                timeout: None,
            })
            .map_err(|e| GpuError::Runtime(e.to_string()))?;
        let ns = t.elapsed().as_nanos() as u64;
        self.count(|s| {
            s.waits += 1;
            s.wait_ns += ns;
        });
        self.take_error()
    }

    fn take_error(&self) -> Result<()> {
        match lock(&self.error).take() {
            Some(msg) => Err(GpuError::Runtime(msg)),
            None => Ok(()),
        }
    }

    /// Run the recorded work and read the first `bytes` of `buf` back.
    pub(crate) fn read_back(&self, buf: &wgpu::Buffer, bytes: u64) -> Result<Vec<u8>> {
        if bytes == 0 {
            return Ok(Vec::new());
        }
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.copy(buf, 0, &staging, 0, bytes);
        self.submit()?;
        let (tx, rx) = std::sync::mpsc::channel();
        staging
            .slice(..)
            .map_async(wgpu::MapMode::Read, move |r| drop(tx.send(r)));
        self.wait()?;
        rx.recv()
            .map_err(|e| GpuError::Runtime(format!("readback: {e}")))?
            .map_err(|e| GpuError::Runtime(format!("readback: {e}")))?;
        let out = staging
            .slice(..)
            .get_mapped_range()
            .map_err(|e| GpuError::Runtime(format!("readback: {e}")))?
            .to_vec();
        staging.unmap();
        self.count(|s| {
            s.readbacks += 1;
            s.readback_bytes += bytes;
        });
        Ok(out)
    }

    fn module(&self, shader: Shader) -> Result<Arc<wgpu::ShaderModule>> {
        if let Some(m) = lock(&self.modules).get(&shader) {
            return Ok(m.clone());
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(shader.file()),
                source: wgpu::ShaderSource::Wgsl(shader.source().into()),
            });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Kernel {
                kernel: shader.file().to_string(),
                message: e.to_string(),
            });
        }
        let module = Arc::new(module);
        lock(&self.modules).insert(shader, module.clone());
        Ok(module)
    }

    /// The compiled pipeline of `k`, built on first use.
    pub(crate) fn pipeline(&self, k: &Kernel) -> Result<Arc<wgpu::ComputePipeline>> {
        let key = k.key();
        if let Some(p) = lock(&self.pipelines).get(&key) {
            return Ok(p.clone());
        }
        let module = self.module(k.shader)?;
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(k.entry),
                layout: None,
                module: &module,
                entry_point: Some(k.entry),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants: &k.constants,
                    // Every kernel writes workgroup memory before reading it.
                    zero_initialize_workgroup_memory: false,
                },
                cache: None,
            });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Kernel {
                kernel: k.label(),
                message: e.to_string(),
            });
        }
        let pipeline = Arc::new(pipeline);
        lock(&self.pipelines).insert(key, pipeline.clone());
        Ok(pipeline)
    }

    /// Workgroup counts `(x, y)` covering `groups` workgroups within the adapter's
    /// per-dimension limit; kernels linearise them as `x + y·num_workgroups.x`.
    pub(crate) fn grid(&self, groups: usize) -> Result<(u32, u32)> {
        let max = self.limits.max_compute_workgroups_per_dimension.max(1) as usize;
        let x = groups.clamp(1, max);
        let y = groups.div_ceil(x).max(1);
        if y > max {
            return Err(GpuError::Shape {
                op: "dispatch",
                message: format!("{groups} workgroups exceed the adapter's {max}²"),
            });
        }
        Ok((x as u32, y as u32))
    }

    /// Record one dispatch of `k` with `params` at binding 0 and `buffers` at
    /// bindings 1, 2, … (in order), over `groups` workgroups. The buffers must be
    /// exactly the bindings the entry point uses (wgpu derives its layout from them).
    pub(crate) fn dispatch(
        &self,
        k: &Kernel,
        params: &[u8],
        buffers: &[&wgpu::Buffer],
        groups: usize,
    ) -> Result<()> {
        let at: Vec<(u32, &wgpu::Buffer)> = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| (i as u32 + 1, *b))
            .collect();
        self.dispatch_at(k, params, &at, groups)
    }

    /// [`GpuContext::dispatch`] with each buffer's binding number given.
    pub(crate) fn dispatch_at(
        &self,
        k: &Kernel,
        params: &[u8],
        buffers: &[(u32, &wgpu::Buffer)],
        groups: usize,
    ) -> Result<()> {
        self.forgetting_packed_x(|| self.record_dispatch(k, params, buffers, groups))
    }

    /// [`GpuContext::dispatch_at`] that keeps the packed x: only for the packed-x
    /// kernels, whose caller keeps it right.
    pub(crate) fn record_dispatch(
        &self,
        k: &Kernel,
        params: &[u8],
        buffers: &[(u32, &wgpu::Buffer)],
        groups: usize,
    ) -> Result<()> {
        if groups == 0 {
            return Ok(());
        }
        let t = std::time::Instant::now();
        let pipeline = self.pipeline(k)?;
        let (gx, gy) = self.grid(groups)?;
        let mut batch = lock(&self.batch);
        if batch.dispatches >= self.submit_every.load(Ordering::Relaxed) {
            self.submit_locked(&mut batch);
        }
        let offset = batch.params.len();
        batch.params.extend_from_slice(params);
        batch.params.resize(offset + PARAMS_SLOT, 0);
        batch.dispatches += 1;
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &batch.params_buf,
                offset: offset as u64,
                size: NonZeroU64::new(PARAMS_SLOT as u64),
            }),
        }];
        for &(binding, b) in buffers {
            entries.push(wgpu::BindGroupEntry {
                binding,
                resource: b.as_entire_binding(),
            });
        }
        let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        });
        let mut opened = false;
        if batch.pass.is_none() {
            let at = batch.queries;
            let timestamps = self
                .profiler
                .as_ref()
                .filter(|_| at + 2 <= MAX_QUERIES && self.time_passes.load(Ordering::Relaxed))
                .map(|p| wgpu::ComputePassTimestampWrites {
                    query_set: &p.queries,
                    beginning_of_pass_write_index: Some(at),
                    end_of_pass_write_index: Some(at + 1),
                });
            if timestamps.is_some() {
                batch.queries += 2;
            }
            let pass = self
                .encoder(&mut batch)
                .begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: None,
                    timestamp_writes: timestamps,
                })
                .forget_lifetime();
            batch.pass = Some(pass);
            opened = true;
        }
        let Some(pass) = batch.pass.as_mut() else {
            unreachable!("the pass was just opened");
        };
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups(gx, gy, 1);
        if opened && self.time_passes.load(Ordering::Relaxed) && self.profiler.is_some() {
            if self.time_each_dispatch {
                // One pass per dispatch, so its timestamps time this kernel alone.
                batch.timed.push(k.entry);
                drop(batch.pass.take());
            } else {
                batch.timed.push("pass");
            }
        }
        drop(batch);
        let ns = t.elapsed().as_nanos() as u64;
        self.count(|s| {
            s.dispatches += 1;
            s.passes += u64::from(opened);
            s.record_ns += ns;
        });
        Ok(())
    }
}
