//! [`Backend`] for [`Gpu`]: the runner's tensors are device buffers, weights are
//! uploaded once from the install's mapped bytes, the KV cache and the expert slots
//! live on the device, and every op records dispatches into the context's batch. Two
//! things come back to the host per forward pass: each MoE layer's routing (the host
//! reads the chosen blobs) and the logits.
//!
//! Activation buffers are reused: a dropped [`GpuBuf`] goes back to a free list keyed
//! by its size, and the next [`Backend::zeros`] of that size takes it (clearing it in
//! order with the batch), so a decode step allocates nothing after the first.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use super::context::{AdapterSummary, GpuContext, GpuOptions};
use super::error::{GpuError, Result};
use super::ops::{MAX_HEAD_DIM, MAX_V_DIM};
use super::tensor::{DType, ExpertSlots, GpuMatrix, GpuTensor, KvCache, RopeTable, Scratch};
use crate::format::pools::ExpertPool;
use crate::runtime::kernels::Matrix;
use crate::runtime::kernels::backend::{
    AttentionSpec, Backend, BackendError, Causal, ExpertRef, KvRows, LayerExperts, NormGain,
    OpResult, RopeLayout, Routing,
};
use crate::runtime::kernels::routing::{RouterBias, RoutingSpec, route_logits};

/// An expert's gate, up and down on the device, shared by the uses of one blob.
type ExpertMats = Arc<[GpuMatrix; 3]>;

/// Free buffers of each byte size a [`GpuBuf`] had.
type FreeList = Arc<Mutex<HashMap<u64, Vec<Arc<wgpu::Buffer>>>>>;

/// Buffers of one size kept for reuse; more are dropped (a forward pass holds about
/// a dozen activation tensors, some of the same size).
const FREE_PER_SIZE: usize = 16;

/// Positions a KV cache holds before it first grows (it doubles, up to the model's
/// longest sequence), so a short run does not reserve the whole context window.
const KV_START: usize = 256;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The wgpu backend: one adapter's device, and the buffers the runner's tensors reuse.
pub struct Gpu {
    ctx: GpuContext,
    name: String,
    free: FreeList,
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // The "where the time goes" figures of a run (docs/GPU.md), on request.
        if self.ctx.profiling() {
            eprintln!("gturbo gpu stats: {}", self.ctx.stats());
            let per: Vec<String> = self
                .ctx
                .kernel_times()
                .iter()
                .map(|(k, n, ns)| format!("{k} {n}× {:.3} ms", ns / 1e6))
                .collect();
            if !per.is_empty() {
                eprintln!("gturbo gpu kernels: {}", per.join(", "));
            }
        }
    }
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").field("adapter", &self.name).finish()
    }
}

/// An f32 activation tensor in device memory; its buffer is reused once dropped.
pub struct GpuBuf {
    t: GpuTensor,
    free: FreeList,
}

impl Drop for GpuBuf {
    fn drop(&mut self) {
        // Only the last holder returns the buffer (a copy of it may be in a KV cache).
        if Arc::strong_count(&self.t.buf) == 1 {
            let mut free = lock(&self.free);
            let list = free.entry(self.t.buf.size()).or_default();
            if list.len() < FREE_PER_SIZE {
                list.push(self.t.buf.clone());
            }
        }
    }
}

impl GpuBuf {
    /// Elements.
    pub fn len(&self) -> usize {
        self.t.len()
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.t.is_empty()
    }

    /// The device tensor (for the Flash-Next ops in `flash.rs`).
    pub(crate) fn tensor(&self) -> &GpuTensor {
        &self.t
    }
}

/// The RoPE table on the device.
pub struct GpuRope(RopeTable);

impl GpuRope {
    /// The cos/sin table (for the Flash-Next ops in `flash.rs`).
    pub(crate) fn table(&self) -> &RopeTable {
        &self.0
    }
}

/// One layer's KV cache on the device, grown by doubling as positions arrive.
pub struct GpuKv {
    cache: KvCache,
    /// Positions it may grow to.
    max: usize,
    /// Positions held.
    len: usize,
}

/// The expert blobs on the device.
pub struct GpuSlots {
    /// Device mirrors of the host slot cache, one per blob geometry (one in practice:
    /// every layer's pool has the same layout), each with the host's slot count and
    /// the `(layer, expert)` each slot last received.
    slots: Option<usize>,
    mirrors: Mutex<Vec<Mirror>>,
    /// Blobs of mapped pools (`slot` is `None`), uploaded on first use and kept: the
    /// map's bytes of a `(layer, expert)` never change.
    mapped: Mutex<HashMap<(usize, usize), ExpertMats>>,
    /// Whole pools of mapped layers, uploaded on first use ([`Backend::moe_resident`]);
    /// `None` marks a layer whose pool the fused kernels cannot take.
    pools: Mutex<HashMap<usize, Option<Arc<ExpertSlots>>>>,
}

struct Mirror {
    geometry: String,
    slots: ExpertSlots,
    held: Vec<Option<(usize, usize)>>,
}

/// One expert's gate, up and down on the device.
pub struct GpuExpert {
    mats: ExpertMats,
}

/// The blob layout that decides whether two pools can share a slot buffer.
fn geometry(pool: &ExpertPool) -> String {
    format!(
        "{:?} {:?} {} {:?}",
        pool.scheme, pool.dtype, pool.blob_bytes, pool.parts
    )
}

impl Gpu {
    /// Open the adapter `opts` picks.
    pub fn new(opts: &GpuOptions) -> Result<Gpu> {
        let ctx = GpuContext::new(opts)?;
        let a = ctx.adapter();
        let name = format!("gpu {} ({})", a.name, a.backend);
        Ok(Gpu {
            ctx,
            name,
            free: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    /// The adapter it runs on.
    pub fn adapter(&self) -> &AdapterSummary {
        self.ctx.adapter()
    }

    /// The kernels' context (products and ops on raw device tensors).
    pub fn context(&self) -> &GpuContext {
        &self.ctx
    }

    /// Run everything recorded and report any device error since the last check (an
    /// upload that ran out of memory, a lost device).
    pub fn finish(&self) -> Result<()> {
        self.ctx.flush()
    }

    fn err(&self, op: &'static str, e: GpuError) -> BackendError {
        BackendError::new(&self.name, op, e)
    }

    fn wrap(&self, t: GpuTensor) -> GpuBuf {
        GpuBuf {
            t,
            free: self.free.clone(),
        }
    }

    /// A tensor of `len` elements whose contents are unspecified (reused or new).
    pub(crate) fn scratch(&self, len: usize) -> Result<GpuBuf> {
        let size = ((len * 4) as u64).max(16).next_multiple_of(4);
        let reused = lock(&self.free).get_mut(&size).and_then(Vec::pop);
        let t = match reused {
            Some(buf) => GpuTensor::new(buf, &[len], DType::F32),
            None => self.ctx.zeros(&[len], DType::F32)?,
        };
        Ok(self.wrap(t))
    }

    /// A window cache after a pass whose first query was at `pos`: when
    /// [`AttentionSpec::slide_to`] says so, its rows from the new start move to row 0
    /// of a cache sized for what it holds (a copy recorded in order; the old buffer is
    /// freed once the recorded work is done), so a sliding layer holds about a window,
    /// not the context, and a long prefill's capacity is given back.
    fn slide(&self, kv: &mut GpuKv, pos: usize) -> Result<()> {
        let Some(keep_from) = kv.cache.spec.slide_to(pos, kv.cache.start) else {
            return Ok(());
        };
        let held = kv.len - keep_from;
        let cap = (2 * held).max(KV_START.min(kv.max)).min(kv.max);
        let mut moved = KvCache::new(&self.ctx, cap, kv.cache.spec)?;
        kv.cache.copy_into(&self.ctx, &mut moved, keep_from, kv.len);
        kv.cache = moved;
        Ok(())
    }

    fn zeroed(&self, len: usize) -> Result<GpuBuf> {
        let b = self.scratch(len)?;
        self.ctx.clear(&b.t.buf);
        Ok(b)
    }

    fn upload_expert(&self, blob: &ExpertRef<'_>) -> Result<[GpuMatrix; 3]> {
        let [g, u, d] = crate::runtime::kernels::expert_matrices(blob.pool, blob.bytes);
        let label = "expert";
        Ok([
            GpuMatrix::upload(&self.ctx, &g, label)?,
            GpuMatrix::upload(&self.ctx, &u, label)?,
            GpuMatrix::upload(&self.ctx, &d, label)?,
        ])
    }

    /// The layer's whole pool on the device, uploaded on first use (at load, through
    /// [`Backend::load_experts`]) and kept; `None` for a pool the fused kernels cannot
    /// take (float experts), remembered as such.
    fn whole_pool(
        &self,
        slots: &GpuSlots,
        experts: &LayerExperts<'_>,
    ) -> Result<Option<Arc<ExpertSlots>>> {
        let mut pools = lock(&slots.pools);
        if let Some(p) = pools.get(&experts.layer) {
            return Ok(p.clone());
        }
        let p = match ExpertSlots::whole_pool(&self.ctx, experts.pool, experts.bytes) {
            Ok(p) => Some(Arc::new(p)),
            Err(GpuError::Shape { .. }) => None,
            Err(e) => return Err(e),
        };
        pools.insert(experts.layer, p.clone());
        Ok(p)
    }

    fn expert_in_slot(
        &self,
        slots: &GpuSlots,
        blob: &ExpertRef<'_>,
        slot: usize,
    ) -> Result<[GpuMatrix; 3]> {
        let Some(count) = slots.slots else {
            // No device mirror (the runner said the pools are mapped): a one-off upload.
            return self.upload_expert(blob);
        };
        let geo = geometry(blob.pool);
        let mut mirrors = lock(&slots.mirrors);
        let i = match mirrors.iter().position(|m| m.geometry == geo) {
            Some(i) => i,
            None => {
                mirrors.push(Mirror {
                    geometry: geo,
                    slots: ExpertSlots::new(&self.ctx, blob.pool, count)?,
                    held: vec![None; count],
                });
                mirrors.len() - 1
            }
        };
        let m = &mut mirrors[i];
        if slot >= count {
            return Err(GpuError::Shape {
                op: "expert",
                message: format!("host slot {slot} of a {count}-slot mirror"),
            });
        }
        let key = (blob.layer, blob.expert);
        if m.held[slot] != Some(key) {
            // Recorded in order: products already recorded read the old blob.
            m.slots.fill(&self.ctx, slot, blob.bytes)?;
            m.held[slot] = Some(key);
        }
        m.slots.matrices(slot)
    }
}

impl Backend for Gpu {
    type Weights<'w> = GpuMatrix;
    type Buf = GpuBuf;
    type Rope = GpuRope;
    type Kv = GpuKv;
    type Slots = GpuSlots;
    type Expert<'e> = GpuExpert;

    fn name(&self) -> &str {
        &self.name
    }

    fn device_memory_bytes(&self) -> Option<u64> {
        Some(self.ctx.allocated_bytes())
    }

    fn weights<'w>(&self, m: Matrix<'w>) -> OpResult<GpuMatrix> {
        GpuMatrix::upload(&self.ctx, &m, "weight").map_err(|e| self.err("weights", e))
    }

    fn upload(&self, data: &[f32]) -> OpResult<GpuBuf> {
        let t = self
            .ctx
            .upload_f32(&[data.len()], data)
            .map_err(|e| self.err("upload", e))?;
        Ok(self.wrap(t))
    }

    fn zeros(&self, len: usize) -> OpResult<GpuBuf> {
        self.zeroed(len).map_err(|e| self.err("zeros", e))
    }

    fn zero(&self, x: &mut GpuBuf) -> OpResult {
        self.ctx.clear(&x.t.buf);
        Ok(())
    }

    fn copy_rows(&self, x: &GpuBuf, width: usize, rows: Range<usize>) -> OpResult<GpuBuf> {
        let len = rows.len() * width;
        if rows.end * width > x.len() {
            return Err(self.err(
                "copy_rows",
                GpuError::Shape {
                    op: "copy_rows",
                    message: format!("rows {rows:?} of width {width} in {} elements", x.len()),
                },
            ));
        }
        let out = self.scratch(len).map_err(|e| self.err("copy_rows", e))?;
        if len > 0 {
            self.ctx.copy(
                &x.t.buf,
                (rows.start * width * 4) as u64,
                &out.t.buf,
                0,
                (len * 4) as u64,
            );
        }
        Ok(out)
    }

    fn copy(&self, x: &GpuBuf) -> OpResult<GpuBuf> {
        self.copy_rows(x, x.len(), 0..1)
    }

    fn buf_bytes(&self, x: &GpuBuf) -> u64 {
        x.t.device_bytes()
    }

    fn read(&self, x: &GpuBuf) -> OpResult<Vec<f32>> {
        self.ctx.download_f32(&x.t).map_err(|e| self.err("read", e))
    }

    fn embed(&self, table: &GpuMatrix, tokens: &[u32], out: &mut GpuBuf) -> OpResult {
        self.ctx
            .embed(table, tokens, &out.t)
            .map_err(|e| self.err("embed", e))
    }

    fn linear(&self, w: &GpuMatrix, x: &GpuBuf, out: &mut GpuBuf) -> OpResult {
        self.ctx
            .matmul(w, &x.t, &out.t)
            .map_err(|e| self.err("linear", e))
    }

    fn rms_norm(
        &self,
        x: &GpuBuf,
        w: &GpuBuf,
        eps: f32,
        gain: NormGain,
        out: &mut GpuBuf,
    ) -> OpResult {
        let plus_one = gain == NormGain::OnePlusWeight;
        self.ctx
            .rms_norm(&x.t, &w.t, eps, plus_one, &out.t)
            .map_err(|e| self.err("rms_norm", e))
    }

    fn add(&self, x: &mut GpuBuf, y: &GpuBuf) -> OpResult {
        self.ctx.add(&x.t, &y.t).map_err(|e| self.err("add", e))
    }

    fn add_bias(&self, x: &mut GpuBuf, bias: &GpuBuf) -> OpResult {
        self.ctx
            .add_bias(&x.t, &bias.t)
            .map_err(|e| self.err("add_bias", e))
    }

    fn swiglu(&self, gate: &mut GpuBuf, up: &GpuBuf) -> OpResult {
        self.ctx
            .swiglu(&gate.t, &up.t)
            .map_err(|e| self.err("swiglu", e))
    }

    fn ffn_swiglu(
        &self,
        gate: &GpuMatrix,
        up: &GpuMatrix,
        down: &GpuMatrix,
        x: &GpuBuf,
        out: &mut GpuBuf,
    ) -> OpResult {
        let run = || -> Result<()> {
            let n = x.len() / gate.cols().max(1);
            let g = self.scratch(n * gate.rows())?;
            // One token: gate, up and SwiGLU as one dispatch where the kernel allows.
            if n == 1 && x.len() == gate.cols() && self.ctx.glu_raw(gate, up, &x.t.buf, &g.t.buf)? {
                return self.ctx.matmul(down, &g.t, &out.t);
            }
            let u = self.scratch(n * up.rows())?;
            self.ctx.matmul(gate, &x.t, &g.t)?;
            self.ctx.matmul(up, &x.t, &u.t)?;
            self.ctx.swiglu(&g.t, &u.t)?;
            self.ctx.matmul(down, &g.t, &out.t)
        };
        run().map_err(|e| self.err("ffn_swiglu", e))
    }

    fn rope_table(
        &self,
        inv_freq: &[f32],
        positions: Range<usize>,
        layout: RopeLayout,
    ) -> OpResult<GpuRope> {
        RopeTable::from_inv_freq(&self.ctx, inv_freq, positions)
            .map(|t| GpuRope(t.with_layout(layout)))
            .map_err(|e| self.err("rope_table", e))
    }

    fn rope(
        &self,
        rope: &GpuRope,
        x: &mut GpuBuf,
        heads: usize,
        head_dim: usize,
        pos: usize,
    ) -> OpResult {
        self.ctx
            .rope(&rope.0, &x.t, heads, head_dim, pos)
            .map_err(|e| self.err("rope", e))
    }

    fn attends(&self, spec: &AttentionSpec) -> bool {
        (1..=MAX_HEAD_DIM).contains(&spec.qk_dim) && (1..=MAX_V_DIM).contains(&spec.v_dim)
    }

    fn kv_cache(&self, spec: AttentionSpec, max_positions: usize) -> OpResult<GpuKv> {
        let cap = max_positions.clamp(1, KV_START);
        let cache = KvCache::new(&self.ctx, cap, spec).map_err(|e| self.err("kv_cache", e))?;
        Ok(GpuKv {
            cache,
            max: max_positions.max(1),
            len: 0,
        })
    }

    fn kv_bytes(&self, kv: &GpuKv) -> u64 {
        kv.cache.k.device_bytes() + kv.cache.v.device_bytes()
    }

    fn read_kv(&self, kv: &GpuKv) -> OpResult<KvRows> {
        let c = &kv.cache;
        let read = |t, width: usize| self.ctx.download_f32_prefix(t, kv.len * width);
        let rows = KvRows {
            k: read(&c.k, c.spec.k_width()).map_err(|e| self.err("read_kv", e))?,
            v: read(&c.v, c.spec.stored_v_width()).map_err(|e| self.err("read_kv", e))?,
        };
        Ok(rows)
    }

    fn load_kv(&self, kv: &mut GpuKv, rows: &KvRows) -> OpResult {
        let spec = kv.cache.spec;
        let n = rows
            .positions(&spec, kv.max)
            .map_err(|e| BackendError::new(&self.name, "load_kv", e))?;
        let run = |kv: &mut GpuKv| -> Result<()> {
            if n > kv.cache.capacity() {
                kv.cache = KvCache::new(&self.ctx, n, spec)?;
            }
            self.ctx.write_f32_prefix(&kv.cache.k, &rows.k)?;
            self.ctx.write_f32_prefix(&kv.cache.v, &rows.v)?;
            kv.len = n;
            Ok(())
        };
        run(kv).map_err(|e| self.err("load_kv", e))
    }

    fn copy_kv(&self, kv: &GpuKv) -> OpResult<GpuKv> {
        let c = &kv.cache;
        let mut cache =
            KvCache::new(&self.ctx, c.capacity(), c.spec).map_err(|e| self.err("copy_kv", e))?;
        c.copy_into(&self.ctx, &mut cache, c.start, kv.len);
        Ok(GpuKv {
            cache,
            max: kv.max,
            len: kv.len,
        })
    }

    fn attention(
        &self,
        kv: &mut GpuKv,
        q: &GpuBuf,
        k: &GpuBuf,
        v: &GpuBuf,
        at: Causal,
        sinks: Option<&GpuBuf>,
        out: &mut GpuBuf,
    ) -> OpResult {
        let run = |kv: &mut GpuKv| -> Result<()> {
            let n = k.len() / kv.cache.spec.k_width();
            if at.pos > kv.len || at.pos + n > kv.max {
                return Err(GpuError::Shape {
                    op: "attention",
                    message: format!(
                        "{n} tokens at position {} of a cache holding {} of at most {}",
                        at.pos, kv.len, kv.max
                    ),
                });
            }
            let start = kv.cache.start;
            if at.pos < start || kv.cache.spec.first_seen(at.pos) < start {
                return Err(GpuError::Shape {
                    op: "attention",
                    message: format!(
                        "position {at_pos} sees from {}, but the window cache holds from \
                         {start}",
                        kv.cache.spec.first_seen(at.pos),
                        at_pos = at.pos
                    ),
                });
            }
            if at.pos - start + n > kv.cache.capacity() {
                let cap = (2 * kv.cache.capacity())
                    .max(at.pos - start + n)
                    .min(kv.max);
                let mut grown = KvCache::new(&self.ctx, cap, kv.cache.spec)?;
                kv.cache.copy_into(&self.ctx, &mut grown, start, at.pos);
                kv.cache = grown;
            }
            self.ctx.kv_append(&kv.cache, &k.t, &v.t, at.pos)?;
            kv.len = at.pos + n;
            self.ctx
                .attention(&q.t, &kv.cache, at, sinks.map(|s| &s.t), &out.t)?;
            self.slide(kv, at.pos)
        };
        run(kv).map_err(|e| self.err("attention", e))
    }

    fn route(
        &self,
        router: &GpuMatrix,
        x: &GpuBuf,
        spec: &RoutingSpec,
        bias: RouterBias<'_>,
    ) -> OpResult<Routing> {
        let top_k = spec.top_k;
        let run = || -> Result<Routing> {
            let experts = router.rows();
            let n = x.len() / router.cols().max(1);
            let logits = self.scratch(n * experts)?;
            self.ctx.matmul(router, &x.t, &logits.t)?;
            let plain = spec.plain_softmax().filter(|_| bias.logits.is_none());
            let Some(renormalize) = plain else {
                // Other routers choose on the host from the logits (`n × experts`
                // floats, read back as the choice would be): the reference itself.
                let mut l = self.ctx.download_f32(&logits.t)?;
                return bias
                    .add_to_logits(&mut l, experts)
                    .and_then(|()| route_logits(spec, &l, bias.selection, experts))
                    .map_err(|e| GpuError::Shape {
                        op: "route",
                        message: e.to_string(),
                    });
            };
            let r = self
                .ctx
                .router_topk(&logits.t, experts, top_k, renormalize)?;
            let ids = self.ctx.download_u32(&r.ids)?;
            let weights = self.ctx.download_f32(&r.weights)?;
            Ok(Routing {
                top_k,
                experts: ids,
                weights,
            })
        };
        run().map_err(|e| self.err("route", e))
    }

    fn expert_slots(&self, slots: Option<usize>, _pools: &[&ExpertPool]) -> OpResult<GpuSlots> {
        // Slot buffers are made on first use, per blob geometry.
        Ok(GpuSlots {
            slots,
            mirrors: Mutex::new(Vec::new()),
            mapped: Mutex::new(HashMap::new()),
            pools: Mutex::new(HashMap::new()),
        })
    }

    fn load_experts(&self, slots: &GpuSlots, experts: LayerExperts<'_>) -> OpResult {
        if !self.ctx.fuse_moe {
            return Ok(());
        }
        self.whole_pool(slots, &experts)
            .map(drop)
            .map_err(|e| self.err("load experts", e))
    }

    fn moe_resident(
        &self,
        slots: &GpuSlots,
        experts: LayerExperts<'_>,
        router: &GpuMatrix,
        x: &GpuBuf,
        spec: &RoutingSpec,
        out: &mut GpuBuf,
    ) -> OpResult<bool> {
        let (top_k, Some(renormalize)) = (spec.top_k, spec.plain_softmax()) else {
            // The fused kernel routes by softmax top-k only.
            return Ok(false);
        };
        let run = || -> Result<bool> {
            if !self.ctx.fuse_moe {
                return Ok(false);
            }
            let pool = self.whole_pool(slots, &experts)?;
            // Decode only: a prompt's tokens share experts, which the host path runs
            // once per expert over all its tokens (from this pool: see `expert`).
            let Some(pool) = pool.filter(|_| x.len() == router.cols()) else {
                return Ok(false);
            };
            let mut held = Vec::new();
            let mut scratch = |len: usize| -> Result<Arc<wgpu::Buffer>> {
                let b = self.scratch(len)?;
                let buf = b.t.buf.clone();
                held.push(b);
                Ok(buf)
            };
            let r = self.ctx.moe_resident(
                &pool,
                router,
                &x.t,
                top_k,
                renormalize,
                &out.t,
                &mut scratch,
            );
            // `held` drops after `scratch`'s last use, so its buffers return to the list.
            r
        };
        run().map_err(|e| self.err("moe", e))
    }

    fn expert<'e>(&'e self, slots: &'e GpuSlots, blob: ExpertRef<'e>) -> OpResult<GpuExpert> {
        let run = || -> Result<GpuExpert> {
            let mats = match blob.slot {
                Some(slot) => Arc::new(self.expert_in_slot(slots, &blob, slot)?),
                None => {
                    // The layer's whole pool, where `moe_resident` uploaded it.
                    let whole = lock(&slots.pools).get(&blob.layer).cloned().flatten();
                    if let Some(pool) = whole.filter(|p| blob.expert < p.slots()) {
                        return Ok(GpuExpert {
                            mats: Arc::new(pool.matrices(blob.expert)?),
                        });
                    }
                    let key = (blob.layer, blob.expert);
                    if let Some(m) = lock(&slots.mapped).get(&key) {
                        return Ok(GpuExpert { mats: m.clone() });
                    }
                    let m = Arc::new(self.upload_expert(&blob)?);
                    lock(&slots.mapped).insert(key, m.clone());
                    m
                }
            };
            Ok(GpuExpert { mats })
        };
        run().map_err(|e| self.err("expert", e))
    }

    fn expert_weights<'x, 'e>(&self, expert: &'x GpuExpert) -> &'x [GpuMatrix; 3]
    where
        Self: 'e,
    {
        &expert.mats
    }

    fn expert_ffn(
        &self,
        expert: &GpuExpert,
        x: &GpuBuf,
        routes: &[(usize, f32)],
        out: &mut GpuBuf,
    ) -> OpResult {
        let run = || -> Result<()> {
            let [gate, _, _] = &*expert.mats;
            let (h, inter) = (gate.cols(), gate.rows());
            let n = x.len() / h.max(1);
            let m = routes.len();
            if m == 0 {
                return Ok(());
            }
            let mut seen = vec![false; n];
            for &(t, _) in routes {
                if t >= n || std::mem::replace(&mut seen[t], true) || out.len() != x.len() {
                    return Err(GpuError::Shape {
                        op: "expert_ffn",
                        message: format!(
                            "routes to rows {:?} of {n}; out of {} for x of {}",
                            routes.iter().map(|r| r.0).collect::<Vec<_>>(),
                            out.len(),
                            x.len()
                        ),
                    });
                }
            }
            let bufs = [
                self.scratch(m * h)?,
                self.scratch(m * inter)?,
                self.scratch(m * inter)?,
                self.scratch(m * h)?,
            ];
            let scratch = Scratch {
                tokens: m,
                xs: bufs[0].t.buf.clone(),
                g: bufs[1].t.buf.clone(),
                u: bufs[2].t.buf.clone(),
                d: bufs[3].t.buf.clone(),
            };
            let tokens: Vec<u32> = routes.iter().map(|r| r.0 as u32).collect();
            let weights: Vec<f32> = routes.iter().map(|r| r.1).collect();
            let r =
                self.ctx
                    .expert_ffn_with(&expert.mats, &scratch, &x.t, &tokens, &weights, &out.t);
            // The scratch's own references go first, so the buffers return to the list.
            drop(scratch);
            r
        };
        run().map_err(|e| self.err("expert_ffn", e))
    }
}
