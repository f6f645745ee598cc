//! The seam between a runner and the device it computes on: [`Backend`].
//!
//! # Why whole operations on backend-owned tensors
//! A runner (the decoder in `runtime::model`) holds its weights, activations, KV cache
//! and expert slots as values of the backend's associated types: plain memory on the
//! CPU ([`Cpu`](super::Cpu): `Vec<f32>` and borrowed [`Matrix`] views of the mapped
//! install), device buffers on a GPU. It calls whole operations on them (a norm, a
//! product, RoPE, attention with its cache, the FFN, routing, an expert's FFN), so a
//! token's forward pass stays on the device. Two things cross back to the host, both
//! small: the router's choice of experts (the host reads their blobs with `pread`) and
//! the logits (the host samples).
//!
//! # Static dispatch
//! The associated types are what lets a GPU keep tensors in device memory, and they make
//! the trait unusable as `dyn`. So runners are generic (`Model<'a, B: Backend>`) and the
//! CLI matches on the chosen backend once, then calls one generic function. A runner
//! never names a backend.
//!
//! # Shapes
//! A [`Backend::Buf`] is a row-major f32 tensor `[rows, width]`: one row per token, or
//! per (token, head) for per-head ops. Buffers are allocated with the exact length an
//! op produces ([`Backend::zeros`]); an op derives the row count from the lengths and
//! the widths it is given or the weights imply, and outputs are `&mut`, so an output is
//! never also an input. Lengths that disagree are a runner bug: the CPU panics (never
//! reads out of bounds), a GPU may return [`BackendError`].
//!
//! # Arithmetic
//! Every op accumulates in f32. Each op's doc gives its formula; the CPU backend
//! computes exactly what the runner computed inline before the seam existed, in the same
//! order, so its tokens did not change. Another backend may differ by reduction order
//! (and `exp`/`sin` rounding) within the tolerances `kernels::conformance` holds every
//! backend to.
//!
//! # Operations beyond the core
//! Operations not every model needs (the gated delta rule, hyper-connections, the
//! n-gram gate, the indexer's block scores) go in op-family traits named by their math
//! (`kernels::ops`), each implemented by every backend (the CPU in `kernels/cpu/`, the
//! GPU in `kernels/gpu/ops/`), so the core trait does not grow per model and no kernel
//! knows a model. [`Ops`](super::ops::Ops) is all of them: what a model loader takes.

use std::ops::Range;

use super::Matrix;
pub use super::routing::Routing;
#[cfg(doc)]
use super::routing::route_logits;
use super::routing::{RouterBias, RoutingSpec};
use crate::format::pools::ExpertPool;

/// A backend operation that failed for a reason of the device (out of memory, device
/// lost, a limit of the adapter), not of the install or the input.
#[derive(Debug, thiserror::Error)]
#[error("{backend} backend: {op}: {source}")]
pub struct BackendError {
    /// The backend's name ([`Backend::name`]).
    pub backend: String,
    /// The operation that failed.
    pub op: &'static str,
    /// What the device reported.
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

impl BackendError {
    /// `op` of `backend` failed with `source` (an error, or a message).
    pub fn new(
        backend: &str,
        op: &'static str,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> BackendError {
        BackendError {
            backend: backend.to_string(),
            op,
            source: source.into(),
        }
    }
}

/// What an op returns.
pub type OpResult<T = ()> = Result<T, BackendError>;

/// What multiplies an RMSNorm's normalised input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormGain {
    /// `x̂ · w` (Llama, Qwen3).
    Weight,
    /// `x̂ · (1 + w)`: checkpoints that store the gain centred on zero (Qwen3-Next,
    /// Gemma).
    OnePlusWeight,
}

/// Positions a window cache keeps before the first one its last pass's first query
/// saw ([`AttentionSpec::slide_to`]): a pass that failed halfway runs again, and a
/// caller may rewind up to this many positions before it.
pub const WINDOW_REWIND: usize = 8;

/// What one layer's attention is, fixed when its KV cache is made
/// ([`Backend::kv_cache`]): the cache's head count and row widths, and which positions
/// a query sees. Llama, Qwen3 and Flash-Next are [`AttentionSpec::dense`]; MLA
/// (DeepSeek-V3, Kimi-K2) has `v_dim ≠ qk_dim`; gpt-oss and Mistral slide a `window`.
/// Partial rotary dims (GLM, Qwen3-Next) need nothing here: [`Backend::rope`] rotates
/// the first `rot` dims of each head and attention reads whole heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionSpec {
    /// KV heads; the query heads ([`Causal::heads`]) are a multiple of them.
    pub kv_heads: usize,
    /// Width of a query head and of a key head (`q·k` runs over it).
    pub qk_dim: usize,
    /// Width of a value head, so of each head's output.
    pub v_dim: usize,
    /// Sliding window: a query at position `p` sees positions `max(0, p + 1 − window)
    /// ..= p` (`window` of them at most); `None` sees every earlier position. At least 1.
    pub window: Option<usize>,
    /// Each KV head's value is the first `v_dim` dims of its key (`v_dim ≤ qk_dim`):
    /// the cache holds keys only and [`Backend::attention`] ignores its `v`. MLA's
    /// latent cache, whose keys are `[c | k_pe]` and values `c`.
    pub values_in_keys: bool,
}

impl AttentionSpec {
    /// `kv_heads` heads whose keys and values share one width `head_dim`, and no window.
    pub fn dense(kv_heads: usize, head_dim: usize) -> AttentionSpec {
        AttentionSpec {
            kv_heads,
            qk_dim: head_dim,
            v_dim: head_dim,
            window: None,
            values_in_keys: false,
        }
    }

    /// Width of a cache row of keys (`kv_heads·qk_dim`).
    pub fn k_width(&self) -> usize {
        self.kv_heads * self.qk_dim
    }

    /// Width of a row of values (`kv_heads·v_dim`).
    pub fn v_width(&self) -> usize {
        self.kv_heads * self.v_dim
    }

    /// Width of a cache row of values stored apart from the keys: [`Self::v_width`],
    /// or 0 with [`Self::values_in_keys`].
    pub fn stored_v_width(&self) -> usize {
        if self.values_in_keys {
            0
        } else {
            self.v_width()
        }
    }

    /// The first position a query at position `p` sees (`0` without a window).
    pub fn first_seen(&self, p: usize) -> usize {
        self.window.map_or(0, |w| (p + 1).saturating_sub(w))
    }

    /// A window cache holding positions `start..` after a pass whose first query was
    /// at `pos`: the new first position to hold when it is time to drop the ones no
    /// query sees again, else `None`. It keeps [`WINDOW_REWIND`] positions before the
    /// first one that pass saw (so the pass, had it failed halfway, runs again), and
    /// drops only once a window's worth (at least [`WINDOW_REWIND`]) piled up, so the
    /// copy is amortized over that many tokens. A cache then holds at most
    /// `window + WINDOW_REWIND + max(window, WINDOW_REWIND)` positions plus a pass's.
    pub fn slide_to(&self, pos: usize, start: usize) -> Option<usize> {
        let w = self.window?;
        let keep_from = self.first_seen(pos).saturating_sub(WINDOW_REWIND);
        (keep_from >= start + w.max(WINDOW_REWIND)).then_some(keep_from)
    }

    /// Whether the spec can be a cache's: heads, widths and window positive, values in
    /// the keys no wider than them.
    pub fn check(&self) -> Result<(), String> {
        if self.kv_heads == 0 || self.qk_dim == 0 || self.v_dim == 0 || self.window == Some(0) {
            return Err(format!(
                "{self:?}: heads, widths and window must be positive"
            ));
        }
        if self.values_in_keys && self.v_dim > self.qk_dim {
            return Err(format!(
                "{self:?}: values in the keys are at most qk_dim wide"
            ));
        }
        Ok(())
    }
}

/// Which dims of a head's rotary part form RoPE's rotated pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs `(j, j + rot/2)`: transformers' `rotate_half`, its default (Llama, Qwen).
    HalfSplit,
    /// Pairs `(2j, 2j + 1)`: GPT-J, GLM's original layout, DeepSeek-V3 checkpoints with
    /// `rope_interleave`.
    Interleaved,
}

/// A KV cache's positions on the host ([`Backend::read_kv`], [`Backend::load_kv`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KvRows {
    /// Key rows `[positions, k_width]`.
    pub k: Vec<f32>,
    /// Value rows `[positions, stored_v_width]` (none with values in the keys).
    pub v: Vec<f32>,
}

impl KvRows {
    /// The positions the rows hold for a cache of `spec`, or why they are not rows of
    /// it (within at most `max` positions).
    pub fn positions(&self, spec: &AttentionSpec, max: usize) -> Result<usize, String> {
        let (kw, vw) = (spec.k_width(), spec.stored_v_width());
        let n = self.k.len() / kw.max(1);
        if kw == 0 || n * kw != self.k.len() || self.v.len() != n * vw || n > max {
            return Err(format!(
                "{} key and {} value floats are not the same positions of rows {kw} and {vw} \
                 wide (at most {max})",
                self.k.len(),
                self.v.len()
            ));
        }
        Ok(n)
    }
}

/// One causal attention step: the new tokens' positions and the query heads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Causal {
    /// Position of the first new token (tokens already in the cache).
    pub pos: usize,
    /// Query heads; a multiple of the cache's KV heads.
    pub heads: usize,
    /// Factor on `q·k` before the softmax (`1/√head_dim` for the decoder).
    pub scale: f32,
}

/// One expert blob as the host holds it, handed to [`Backend::expert`].
#[derive(Debug, Clone, Copy)]
pub struct ExpertRef<'e> {
    /// The layer's pool geometry (where gate, up and down sit in the blob).
    pub pool: &'e ExpertPool,
    /// Layer and expert: the blob's identity.
    pub layer: usize,
    /// Expert index in the pool.
    pub expert: usize,
    /// The host slot-cache slot holding the blob (`None` when it is a slice of a
    /// mapped pool). A slot holds one blob at a time, and a slot's key changes only
    /// when it is refilled, so a device mirror of the slots may upload a blob when
    /// its slot's `(layer, expert)` differs from what the device slot last received.
    pub slot: Option<usize>,
    /// The blob bytes (gate, up, down as `pool.parts` lays them out).
    pub bytes: &'e [u8],
}

/// Every expert of one MoE layer, as mapped (resident experts), for
/// [`Backend::moe_resident`].
#[derive(Debug, Clone, Copy)]
pub struct LayerExperts<'e> {
    /// The layer's pool geometry.
    pub pool: &'e ExpertPool,
    /// The layer.
    pub layer: usize,
    /// The whole pool file: expert `e` at `e × pool.stride`.
    pub bytes: &'e [u8],
}

/// Operations a runner calls, over tensors the backend owns. See the module doc for
/// the contract shared by every op (shapes, arithmetic, errors).
pub trait Backend {
    /// A weight matrix ready for products: on the CPU the [`Matrix`] view of the
    /// install's bytes itself (zero copy from the map), on a GPU an upload made once.
    type Weights<'w>;
    /// An f32 activation tensor.
    type Buf;
    /// RoPE frequencies (a GPU may expand them into a cos/sin table).
    type Rope;
    /// One layer's KV cache.
    type Kv;
    /// Device-side storage for expert blobs (a GPU's mirror of the host slot cache;
    /// nothing on the CPU, which reads the host buffers in place).
    type Slots;
    /// One expert's gate, up and down, ready for [`Backend::expert_ffn`].
    type Expert<'e>
    where
        Self: 'e;

    /// Short name for logs and the footer (`"cpu-avx2"`, an adapter's name).
    fn name(&self) -> &str;

    /// Device memory the backend holds apart from the process's own (weights, caches,
    /// activations on a GPU), for the footer; `None` on the CPU.
    fn device_memory_bytes(&self) -> Option<u64> {
        None
    }

    // ---------------------------------------------------------------- data

    /// Make `m` computable. Called once per tensor when a runner loads.
    fn weights<'w>(&self, m: Matrix<'w>) -> OpResult<Self::Weights<'w>>;
    /// A tensor holding `data` (norm weights; test inputs).
    fn upload(&self, data: &[f32]) -> OpResult<Self::Buf>;
    /// A tensor of `len` zeros.
    fn zeros(&self, len: usize) -> OpResult<Self::Buf>;
    /// Set every element of `x` to zero.
    fn zero(&self, x: &mut Self::Buf) -> OpResult;
    /// Rows `rows` of the `width`-wide `x`, copied into a new tensor.
    fn copy_rows(&self, x: &Self::Buf, width: usize, rows: Range<usize>) -> OpResult<Self::Buf>;
    /// A copy of `x` (a session snapshot's states).
    fn copy(&self, x: &Self::Buf) -> OpResult<Self::Buf>;
    /// Bytes `x` holds (host or device): what a kept snapshot of it costs.
    fn buf_bytes(&self, x: &Self::Buf) -> u64;
    /// The elements of `x`, copied to the host (tests, diagnostics).
    fn read(&self, x: &Self::Buf) -> OpResult<Vec<f32>>;
    /// `x` handed to the host: the logits for sampling (no copy on the CPU).
    fn read_owned(&self, x: Self::Buf) -> OpResult<Vec<f32>> {
        self.read(&x)
    }

    // ---------------------------------------------------------------- dense ops

    /// Rows of `table` for `tokens` into `out` `[tokens.len(), cols]`, widened to f32
    /// exactly as [`Matrix::widen_row`] does (`s·q + b` per element for quantized
    /// rows). The runner has checked every token against the table's rows.
    fn embed(&self, table: &Self::Weights<'_>, tokens: &[u32], out: &mut Self::Buf) -> OpResult;
    /// `out[t] = W · x[t]` for each row of `x` `[n, cols]` into `out` `[n, rows]`; a
    /// matrix-vector product when `n` is 1.
    fn linear(&self, w: &Self::Weights<'_>, x: &Self::Buf, out: &mut Self::Buf) -> OpResult;
    /// RMSNorm of each `w.len()`-wide row of `x` into `out`: `x · (1/√(mean(x²) + eps))
    /// · gain`, the gain being `w` or `1 + w`. Per-head norms (QK-norm) are this with
    /// a head-wide `w` over `[n·heads, head_dim]`.
    fn rms_norm(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        eps: f32,
        gain: NormGain,
        out: &mut Self::Buf,
    ) -> OpResult;
    /// `x += y` (the residual connection).
    fn add(&self, x: &mut Self::Buf, y: &Self::Buf) -> OpResult;
    /// `x[t] += bias` for each `bias.len()`-wide row `x[t]` of `x`: a projection's bias
    /// after [`Backend::linear`] (gpt-oss's q, k, v, o and router, GLM's q, k, v), kept
    /// out of `linear` so the products of every other family stay as they are.
    fn add_bias(&self, x: &mut Self::Buf, bias: &Self::Buf) -> OpResult;
    /// SwiGLU's gating in place: `gate = silu(gate) · up`, `silu(g) = g / (1 + e^-g)`.
    fn swiglu(&self, gate: &mut Self::Buf, up: &Self::Buf) -> OpResult;
    /// The dense MLP `out = down(silu(gate·x) · up·x)` for each row of `x`.
    fn ffn_swiglu(
        &self,
        gate: &Self::Weights<'_>,
        up: &Self::Weights<'_>,
        down: &Self::Weights<'_>,
        x: &Self::Buf,
        out: &mut Self::Buf,
    ) -> OpResult;

    // ---------------------------------------------------------------- attention

    /// Frequencies `inv_freq` (`rot/2` of them: the first `rot` dims of each head
    /// rotate) for the absolute positions `positions`, rotating the pairs `layout`
    /// names. A model makes one table for `0..max` at load; a table for a later range
    /// alone serves one call whose frequencies are its own (dynamic NTK scaling changes
    /// them as the sequence grows), at the cost of that range only.
    fn rope_table(
        &self,
        inv_freq: &[f32],
        positions: Range<usize>,
        layout: RopeLayout,
    ) -> OpResult<Self::Rope>;
    /// RoPE in place on `x` `[n, heads, head_dim]`, token `i` at position `pos + i`
    /// (`pos..pos + n` within the table's positions): for
    /// `j < rot/2`, with the angle `θ = p·inv_freq_j` rounded to f32 (`p` the position
    /// as f32), `s = sin θ` and `c = cos θ`, the pair `(a, b)` becomes
    /// `(a·c − b·s, b·c + a·s)`, where the pair is `(x_j, x_{j+rot/2})` in the
    /// rotate-half layout and `(x_{2j}, x_{2j+1})` interleaved (the table's layout);
    /// dims from `rot` on are left alone.
    fn rope(
        &self,
        rope: &Self::Rope,
        x: &mut Self::Buf,
        heads: usize,
        head_dim: usize,
        pos: usize,
    ) -> OpResult;
    /// Whether [`Backend::attention`] runs over a cache of `spec` here: a device kernel
    /// may hold heads up to a width (the GPU's 256), which MLA's latent cache (keys
    /// `kv_lora + rope` wide: 576 for DeepSeek-V3) can exceed. The default: any spec.
    fn attends(&self, _spec: &AttentionSpec) -> bool {
        true
    }
    /// An empty KV cache of one layer for up to `max_positions` positions (the CPU's
    /// grows as tokens arrive), holding key rows of `spec.k_width()` and value rows of
    /// `spec.v_width()`; `spec` also fixes the window [`Backend::attention`] applies.
    fn kv_cache(&self, spec: AttentionSpec, max_positions: usize) -> OpResult<Self::Kv>;
    /// A copy of `kv` holding the same positions (a session snapshot).
    fn copy_kv(&self, kv: &Self::Kv) -> OpResult<Self::Kv>;
    /// Bytes `kv` holds (host or device, its reserved capacity included): what a kept
    /// snapshot of it costs.
    fn kv_bytes(&self, kv: &Self::Kv) -> u64;
    /// The positions `kv` holds as host rows: keys `[positions, k_width]` and values
    /// `[positions, stored_v_width]` (a session saved to disk).
    fn read_kv(&self, kv: &Self::Kv) -> OpResult<KvRows>;
    /// Fill `kv`, an empty cache from [`Backend::kv_cache`], with `rows` (as
    /// [`Backend::read_kv`] gives them). Rows that are not whole rows of its widths, keys
    /// and values of different positions, or more positions than it may hold: an error.
    fn load_kv(&self, kv: &mut Self::Kv, rows: &KvRows) -> OpResult;
    /// Store `k` `[n, kv_heads·qk_dim]` and `v` `[n, kv_heads·v_dim]` (not read with
    /// [`AttentionSpec::values_in_keys`]: each head's value is then its key's first
    /// `v_dim` dims, and callers pass `k` again) at positions
    /// `at.pos..at.pos + n` of `kv` (whose [`AttentionSpec`] gives the widths and the
    /// window), forgetting any positions after them (so a session whose last forward
    /// pass failed halfway continues cleanly), then causal attention of `q`
    /// `[n, at.heads·qk_dim]` into `out` `[n, at.heads·v_dim]`: query head `h` of token
    /// `i`, at position `p = at.pos + i`, attends over the positions `j` in
    /// `first..=p` (`first = max(0, p + 1 − window)` with a window, else 0) of KV head
    /// `h / (heads / kv_heads)`, with scores `s_j = at.scale · q·k_j`, `m = max_j s_j`
    /// and weights on `v_j`
    ///
    /// `w_j = e^(s_j − m) / (Σ_j e^(s_j − m) + e^(sink_h − m))`,
    ///
    /// where the sink term is there only with `sinks` (`[at.heads]` learned logits,
    /// gpt-oss): a logit that joins the softmax's denominator and carries no value, so
    /// the weights sum to less than 1. Without sinks this is `softmax(s)`. `at.pos` is
    /// at most the positions the cache holds. A window cache drops the positions no
    /// query sees again ([`AttentionSpec::slide_to`]), so a pass may start at most
    /// [`WINDOW_REWIND`] positions before the first one its last pass saw.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        kv: &mut Self::Kv,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        at: Causal,
        sinks: Option<&Self::Buf>,
        out: &mut Self::Buf,
    ) -> OpResult;

    // ---------------------------------------------------------------- routed experts

    /// MoE routing of each row of `x` by the `[experts, cols]` `router`: the router
    /// logits `router · x` plus `bias.logits` when there is one, routed as `spec` says
    /// ([`route_logits`] is the reference: softmax or sigmoid scores, the top-k with
    /// an optional selection bias `bias.selection` and group limit, the gathered
    /// weights renormalised and scaled). For
    /// [`RoutingSpec::softmax_top_k`]: `p = softmax(router · x)` over all experts, the
    /// `top_k` largest (ties to the lower id), and as weights `p` itself or, with
    /// `renormalize`, `p / Σ_topk p`.
    fn route(
        &self,
        router: &Self::Weights<'_>,
        x: &Self::Buf,
        spec: &RoutingSpec,
        bias: RouterBias<'_>,
    ) -> OpResult<Routing>;
    /// Storage for expert blobs of `pools` (every MoE layer's geometry), mirroring a
    /// host slot cache of `slots` slots, or `None` when the pools are mapped.
    fn expert_slots(&self, slots: Option<usize>, pools: &[&ExpertPool]) -> OpResult<Self::Slots>;
    /// The expert in `blob`, ready for [`Backend::expert_ffn`] (a GPU uploads it into
    /// its slot when that slot holds another blob). The host keeps `blob` pinned while
    /// the result lives.
    fn expert<'e>(
        &'e self,
        slots: &'e Self::Slots,
        blob: ExpertRef<'e>,
    ) -> OpResult<Self::Expert<'e>>;
    /// The gate, up and down matrices of `expert` as weights for [`Backend::linear`]:
    /// a runner whose experts are more than [`Backend::expert_ffn`]'s SwiGLU (gpt-oss:
    /// a bias on every projection, a clamped activation) composes them from the ops.
    fn expert_weights<'x, 'e>(&self, expert: &'x Self::Expert<'e>) -> &'x [Self::Weights<'e>; 3]
    where
        Self: 'e;
    /// Called once at load for each layer whose pool is mapped (resident experts), so
    /// a backend that keeps whole pools in its own memory (a GPU) uploads them before
    /// the first prompt instead of inside it. The default does nothing.
    fn load_experts(&self, _slots: &Self::Slots, _experts: LayerExperts<'_>) -> OpResult {
        Ok(())
    }
    /// Routing and the routed experts of one MoE layer in one call, with the
    /// routing never leaving the device: `out = Σ_j w_j · down_j(silu(gate_j x) ·
    /// up_j x)` over each row's chosen experts, routed as [`Backend::route`] routes.
    /// `Ok(false)` (nothing done) where the backend does not do this (the default)
    /// or not for these operands; the runner then routes and runs the experts itself.
    /// A GPU holding the whole pool needs no read-back of the choice per layer. A spec
    /// with a selection bias is never handed here.
    #[allow(clippy::too_many_arguments)]
    fn moe_resident(
        &self,
        _slots: &Self::Slots,
        _experts: LayerExperts<'_>,
        _router: &Self::Weights<'_>,
        _x: &Self::Buf,
        _spec: &RoutingSpec,
        _out: &mut Self::Buf,
    ) -> OpResult<bool> {
        Ok(false)
    }
    /// One routed expert over the tokens that chose it: for each `(t, weight)` of
    /// `routes` (distinct rows of `x` and `out`, ascending), `out[t] += weight ·
    /// down(silu(gate·x[t]) · up·x[t])`.
    fn expert_ffn(
        &self,
        expert: &Self::Expert<'_>,
        x: &Self::Buf,
        routes: &[(usize, f32)],
        out: &mut Self::Buf,
    ) -> OpResult;
}
