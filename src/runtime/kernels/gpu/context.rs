//! Adapter selection, the device, pipelines, buffers, and the batch of recorded work.

use std::collections::HashMap;
use std::fmt;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use wgpu::util::DeviceExt;

use super::shaders::{Kernel, KernelKey, PARAMS_SLOT, Shader};
use super::tensor::{DType, GpuTensor};
use super::{GpuError, Result};

/// The backends wgpu is asked for: Vulkan, Metal, DX12 (not GL, whose compute
/// support is partial).
const BACKENDS: wgpu::Backends = wgpu::Backends::PRIMARY;

/// Dispatches recorded before the batch is submitted on its own: one parameter slot
/// each in a 1 MiB uniform buffer. A SmolLM2 token records about 400.
const MAX_BATCH: usize = 4096;

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

impl GpuContext {
    /// Open the adapter `opts` picks. Errors name what was found.
    pub fn new(opts: &GpuOptions) -> Result<GpuContext> {
        let instance = instance();
        let all = adapters(&instance);
        if all.is_empty() {
            return Err(GpuError::NoAdapter);
        }
        let index = match &opts.adapter {
            None => 0,
            Some(want) => {
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
                    })?
            }
        };
        let adapter = &all[index];
        let summary = summary(index, adapter);
        // Everything the adapter allows: weights of real models exceed WebGPU's
        // default 128 MiB binding.
        let limits = adapter.limits();
        let desc = wgpu::DeviceDescriptor {
            label: Some("gturbo"),
            required_features: wgpu::Features::empty(),
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
        let error: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
        let sink = error.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut slot = lock(&sink);
            if slot.is_none() {
                *slot = Some(e.to_string());
            }
        }));
        let params_buf = Arc::new(device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("params"),
            size: (MAX_BATCH * PARAMS_SLOT) as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }));
        Ok(GpuContext {
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
        let mut batch = lock(&self.batch);
        self.encoder(&mut batch).clear_buffer(buf, 0, None);
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
        let mut batch = lock(&self.batch);
        self.encoder(&mut batch)
            .copy_buffer_to_buffer(&staging, 0, buf, offset, padded as u64);
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
        let mut batch = lock(&self.batch);
        self.encoder(&mut batch)
            .copy_buffer_to_buffer(src, src_off, dst, dst_off, bytes);
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

    /// An f32 tensor holding `data` (`data.len()` must equal the shape's product).
    pub fn upload_f32(&self, shape: &[usize], data: &[f32]) -> Result<GpuTensor> {
        check_len("upload", shape, data.len())?;
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        Ok(GpuTensor::new(
            self.upload_bytes("tensor", &bytes)?,
            shape,
            DType::F32,
        ))
    }

    /// A u32 tensor holding `data`.
    pub fn upload_u32(&self, shape: &[usize], data: &[u32]) -> Result<GpuTensor> {
        check_len("upload", shape, data.len())?;
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        Ok(GpuTensor::new(
            self.upload_bytes("tensor", &bytes)?,
            shape,
            DType::U32,
        ))
    }

    /// A zero-filled tensor.
    pub fn zeros(&self, shape: &[usize], dtype: DType) -> Result<GpuTensor> {
        let n: usize = shape.iter().product();
        Ok(GpuTensor::new(
            self.buffer("tensor", n as u64 * 4)?,
            shape,
            dtype,
        ))
    }

    /// Overwrite an f32 tensor with `data` (in order with the recorded work).
    pub fn write_f32(&self, t: &GpuTensor, data: &[f32]) -> Result<()> {
        check_len("write", t.shape(), data.len())?;
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.write_bytes(&t.buf, 0, &bytes)
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
        if let Some(enc) = batch.encoder.take() {
            self.queue.submit([enc.finish()]);
        }
    }

    fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: None,
                timeout: None,
            })
            .map_err(|e| GpuError::Runtime(e.to_string()))?;
        self.take_error()
    }

    fn take_error(&self) -> Result<()> {
        match lock(&self.error).take() {
            Some(msg) => Err(GpuError::Runtime(msg)),
            None => Ok(()),
        }
    }

    fn read_back(&self, t: &GpuTensor) -> Result<Vec<u8>> {
        let bytes = (t.len() * 4) as u64;
        if bytes == 0 {
            return Ok(Vec::new());
        }
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.copy(&t.buf, 0, &staging, 0, bytes);
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
        Ok(out)
    }

    /// Run the recorded work and read an f32 tensor back (for sampling).
    pub fn download_f32(&self, t: &GpuTensor) -> Result<Vec<f32>> {
        let bytes = self.read_back(t)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// Run the recorded work and read a u32 tensor back (expert ids).
    pub fn download_u32(&self, t: &GpuTensor) -> Result<Vec<u32>> {
        let bytes = self.read_back(t)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
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
        if groups == 0 {
            return Ok(());
        }
        let pipeline = self.pipeline(k)?;
        let (gx, gy) = self.grid(groups)?;
        let mut batch = lock(&self.batch);
        if batch.dispatches == MAX_BATCH {
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
        if batch.pass.is_none() {
            let pass = self
                .encoder(&mut batch)
                .begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: None,
                    timestamp_writes: None,
                })
                .forget_lifetime();
            batch.pass = Some(pass);
        }
        let Some(pass) = batch.pass.as_mut() else {
            unreachable!("the pass was just opened");
        };
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups(gx, gy, 1);
        Ok(())
    }
}

fn check_len(op: &'static str, shape: &[usize], len: usize) -> Result<()> {
    let n: usize = shape.iter().product();
    if n == len {
        Ok(())
    } else {
        Err(GpuError::Shape {
            op,
            message: format!("{len} values for shape {shape:?} ({n} elements)"),
        })
    }
}
