//! The qwen4_exp text model: weights bound from the install, the per-sequence state,
//! and the forward pass as a plain sequence of the module's op calls.
//!
//! ```text
//! x = [e, e, …, e]                          e = embed_tokens[id]; S copies
//! for each layer:
//!     if PLE layer: x += ple(x, ids)
//!     u, inj = attn_hc(x);  x += inj ⊗ (GDN or attention)(u)
//!     u, inj = mlp_hc(x);   x += inj ⊗ MoE(u)
//! logits = lm_head · mixer(x)               (no final norm)
//! ```
//! The same call runs a prompt and a cached decode step: every op continues from the
//! session's state (KV cache and block keys, GDN conv and recurrent state, PLE
//! history and conv state), so decoding token by token equals re-running the prefix.
//! It is generic over the backend (`B: Ops`) and never names one.

use std::collections::BTreeMap;

use super::attention::{AttnWeights, IndexerWeights, attention_forward};
use super::config::{FlashConfig, LayerKind};
use super::hc::{HcRead, HyperConnection, hc_read};
use super::install::FlashInstall;
use super::ple::{PleState, PleTables, PleWeights, ple_forward};
use crate::format::manifest;
use crate::format::pools::ExpertPool;
use crate::runtime::RunError;
use crate::runtime::error::InputError;
use crate::runtime::experts::CacheStats;
use crate::runtime::generate::{LanguageModel, Stat};
use crate::runtime::kernels::ops::Ops;
use crate::runtime::kernels::rope::inv_freq;
use crate::runtime::kernels::{Backend, OpResult, RopeLayout};
use crate::runtime::layers::gdn::{GdnProj, GdnState, GdnWeights, gdn_forward};
use crate::runtime::layers::mlp::{SharedExpert, SwiGlu};
use crate::runtime::layers::moe::expert_slots;
use crate::runtime::layers::sparse_moe::{MoeWeights, moe_forward};
use crate::runtime::models::state::{self, SessionData};

/// Prefix of the text model's tensors.
const LM: &str = "model.language_model.";

/// A layer's token mixer.
pub enum Mixer<'a, B: Ops> {
    /// Gated DeltaNet.
    Gdn(GdnWeights<'a, B>),
    /// Gated attention with the indexer.
    Attn(AttnWeights<'a, B>),
}

/// One decoder layer's weights.
pub struct FlashLayer<'a, B: Ops> {
    /// The PLE block, on the layers that have one.
    pub ple: Option<PleWeights<'a, B>>,
    /// The hyper-connection around the mixer.
    pub attn_hc: HyperConnection<'a, B>,
    /// GDN or attention.
    pub mixer: Mixer<'a, B>,
    /// The hyper-connection around the MoE.
    pub mlp_hc: HyperConnection<'a, B>,
    /// The MoE's resident weights.
    pub moe: MoeWeights<'a, B>,
}

/// The loaded model, computing on `B`.
pub struct FlashModel<'a, B: Ops> {
    /// The numbers.
    pub cfg: FlashConfig,
    /// Per layer: its kind.
    pub kinds: Vec<LayerKind>,
    install: &'a FlashInstall,
    backend: &'a B,
    embed: B::Weights<'a>,
    head: B::Weights<'a>,
    mixer: HyperConnection<'a, B>,
    layers: Vec<FlashLayer<'a, B>>,
    rope: B::Rope,
    slots: B::Slots,
}

/// One layer's mixer state.
pub enum MixerState<B: Ops> {
    /// GDN conv and recurrent state.
    Gdn(GdnState<B>),
    /// KV cache, raw indexer keys and block keys.
    Attn(B::AttnCache),
}

/// Per-sequence state; the backend's buffers are made by the first forward pass.
pub struct FlashSession<B: Ops> {
    /// Per layer: the mixer's state (empty until the first forward pass).
    pub mixers: Vec<MixerState<B>>,
    /// Per layer: the PLE state, on PLE layers.
    pub ple: Vec<Option<PleState<B>>>,
    /// Tokens seen.
    pub pos: usize,
}

/// Intermediate values of a forward pass, named as the goldens name them
/// (`layers.{i}.gdn.core`, `layers.{i}.moe.topk_idx`, …). Every call appends, so a
/// prefill followed by decode steps accumulates rows.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    /// f32 tensors, rows concatenated.
    pub f32s: BTreeMap<String, Vec<f32>>,
    /// Integer tensors (PLE row ids, router indices).
    pub ints: BTreeMap<String, Vec<i64>>,
    /// Per query: the indexer's selected blocks, per indexed layer.
    pub blocks: BTreeMap<String, Vec<Vec<usize>>>,
    /// Per query: the indexer's block scores, per indexed layer.
    pub scores: BTreeMap<String, Vec<Vec<f32>>>,
}

impl Trace {
    fn put<B: Backend>(&mut self, b: &B, key: String, v: &B::Buf) -> OpResult {
        let v = b.read(v)?;
        self.f32s.entry(key).or_default().extend_from_slice(&v);
        Ok(())
    }

    fn put_ints(&mut self, key: String, v: impl IntoIterator<Item = i64>) {
        self.ints.entry(key).or_default().extend(v);
    }

    fn put_hc<B: Backend>(&mut self, b: &B, p: &str, r: &HcRead<B>) -> OpResult {
        self.put(b, format!("{p}.mix"), &r.mix)?;
        self.put(b, format!("{p}.mixed"), &r.mixed)?;
        self.put(b, format!("{p}.inject"), &r.inject)
    }
}

fn hc<'a, B: Ops>(
    b: &B,
    inst: &'a FlashInstall,
    cfg: &FlashConfig,
    p: &str,
    inject: bool,
) -> Result<HyperConnection<'a, B>, RunError> {
    let w = cfg.hc.width();
    let m = |name: &str, rows, cols| -> Result<B::Weights<'a>, RunError> {
        Ok(b.weights(inst.matrix(&format!("{p}{name}"), rows, cols)?)?)
    };
    Ok(HyperConnection {
        norm: b.upload(&inst.floats(&format!("{p}hc_norm.weight"), &[w])?)?,
        down: m("input_mix_weight_down.weight", cfg.hc_lowrank, w)?,
        up: m("input_mix_weight_up.weight", w, cfg.hc_lowrank)?,
        inject: if inject {
            Some(m("block_inject_weight.weight", cfg.hc.streams, w)?)
        } else {
            None
        },
    })
}

/// The layer's kind, from which mixer's tensors the install holds.
fn layer_kind(inst: &FlashInstall, l: usize) -> Result<LayerKind, RunError> {
    let linear = inst.has(&format!("{LM}layers.{l}.linear_attn.in_proj_qkv.weight"));
    let indexed = inst.has(&format!("{LM}layers.{l}.self_attn.q_proj.weight"));
    match (linear, indexed) {
        (true, false) => Ok(LayerKind::Linear),
        (false, true) => Ok(LayerKind::Indexed),
        _ => Err(RunError::invalid(
            &inst.manifest.resident.file,
            format!(
                "layer {l} has {} linear_attn.in_proj_qkv and {} self_attn.q_proj; a qwen4_exp layer has exactly one",
                if linear { "a" } else { "no" },
                if indexed { "a" } else { "no" }
            ),
        )),
    }
}

/// The first `count` primes ≥ `from` (trial division: the bases are small).
fn primes_from(from: u64, count: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(count);
    let mut v = from;
    while out.len() < count {
        if is_prime(v) {
            out.push(v);
        }
        v += 1;
    }
    out
}

fn is_prime(v: u64) -> bool {
    if v < 2 {
        return false;
    }
    if v.is_multiple_of(2) {
        return v == 2;
    }
    let mut d = 3u64;
    while d.saturating_mul(d) <= v {
        if v.is_multiple_of(d) {
            return false;
        }
        d += 2;
    }
    true
}

/// Read layer `l`'s PLE tables and check them against the config and its row pool;
/// `rank` is the layer's place among the PLE layers (its `ple_layer_index`). Every
/// error names the tensor (or pool) that disagrees.
pub fn load_ple_tables(
    inst: &FlashInstall,
    cfg: &FlashConfig,
    l: usize,
    rank: usize,
) -> Result<PleTables, RunError> {
    let p = format!("{LM}layers.{l}.ple.ple_embedding.");
    let (mn, vn, on) = (
        format!("{p}layer_multipliers"),
        format!("{p}ngram_heads_vocab_sizes"),
        format!("{p}ngram_heads_offsets"),
    );
    let heads = cfg.ple.heads();
    let file = &inst.manifest.resident.file;
    let bad = |name: &str, msg: String| RunError::invalid(file, format!("tensor {name}: {msg}"));
    let multipliers = inst.i64s(&mn, cfg.ple.ngram)?;
    let vocab_sizes = inst.i64s(&vn, heads)?;
    let offsets = inst.i64s(&on, heads)?;
    // The reference draws odd multipliers below (2^63 − 1) / vocab_size, so that a
    // token id times a multiplier never overflows.
    let bound = i64::MAX / cfg.vocab as i64;
    for (i, &m) in multipliers.iter().enumerate() {
        if m <= 0 || m % 2 == 0 || m > bound {
            return Err(bad(
                &mn,
                format!(
                    "multiplier {i} is {m}; the reference's are odd and in 1..={bound} for vocab_size {}",
                    cfg.vocab
                ),
            ));
        }
    }
    for (h, &v) in vocab_sizes.iter().enumerate() {
        if v <= 0 {
            return Err(bad(&vn, format!("head {h} has vocabulary {v}")));
        }
    }
    // What the config implies: head h of the PLE layer ranked `rank` among the PLE
    // layers has the (rank·heads + h + 1)-th prime ≥ ngram_vocab_size_base.
    if let Some(base) = cfg.ngram_vocab_size_base {
        let want = primes_from(base, (rank + 1) * heads);
        for (h, (&v, &w)) in vocab_sizes.iter().zip(&want[rank * heads..]).enumerate() {
            if v as u64 != w {
                return Err(bad(
                    &vn,
                    format!(
                        "head {h} has vocabulary {v}; the config implies {w} (prime {} from ngram_vocab_size_base {base}, PLE layer {rank})",
                        rank * heads + h + 1
                    ),
                ));
            }
        }
    }
    let mut total = 0i64;
    for (h, (&o, &v)) in offsets.iter().zip(&vocab_sizes).enumerate() {
        if o != total {
            return Err(bad(
                &on,
                format!("head {h} starts at row {o}; the vocabularies before it end at {total}"),
            ));
        }
        total += v;
    }
    let rows = inst.row_cache(l).ok_or_else(|| {
        RunError::invalid(
            manifest::FILE_NAME,
            format!("layer {l} has PLE tensors but no row pool"),
        )
    })?;
    let pool = rows.pool();
    if rows.width() * heads != cfg.ple_embed_dim {
        return Err(RunError::invalid(
            &pool.file,
            format!(
                "rows are {} wide; ple_embed_dim {} over {heads} heads needs {}",
                rows.width(),
                cfg.ple_embed_dim,
                cfg.ple_embed_dim / heads
            ),
        ));
    }
    let want = match cfg.ngram_vocab_divisor {
        Some(d) => (total as u64).div_ceil(d) * d,
        None => total as u64,
    };
    if (cfg.ngram_vocab_divisor.is_some() && rows.rows() != want) || rows.rows() < total as u64 {
        return Err(RunError::invalid(
            &pool.file,
            format!(
                "the table has {} rows; {vn} sums to {total}, padded to {want}",
                rows.rows()
            ),
        ));
    }
    Ok(PleTables {
        multipliers,
        vocab_sizes,
        offsets,
    })
}

/// The install and the backend its tensors are bound on.
struct Bind<'a, 'b, B: Ops> {
    inst: &'a FlashInstall,
    b: &'b B,
}

impl<'a, B: Ops> Bind<'a, '_, B> {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<B::Weights<'a>, RunError> {
        Ok(self.b.weights(self.inst.matrix(name, rows, cols)?)?)
    }

    fn floats(&self, name: &str, shape: &[usize]) -> Result<B::Buf, RunError> {
        Ok(self.b.upload(&self.inst.floats(name, shape)?)?)
    }

    /// The PLE block of layer `l`, the `rank`-th layer with PLE rows.
    fn ple(&self, cfg: &FlashConfig, l: usize, rank: usize) -> Result<PleWeights<'a, B>, RunError> {
        let t = |n: &str| format!("{LM}layers.{l}.{n}");
        let (h, w) = (cfg.hidden, cfg.hc.width());
        let e = cfg.ple_embed_dim;
        let k = cfg.ple.conv_kernel;
        Ok(PleWeights {
            key: self.matrix(&t("ple.key_proj.weight"), w, e)?,
            value: self.matrix(&t("ple.value_proj.weight"), h, e)?,
            norm_key: self.floats(&t("ple.norm_key.weight"), &[w])?,
            norm_query: self.floats(&t("ple.norm_query.weight"), &[w])?,
            norm_conv: self.floats(&t("ple.norm_conv.weight"), &[w])?,
            conv: self.floats(&t("ple.conv1d.weight"), &[w, 1, k])?,
            tables: load_ple_tables(self.inst, cfg, l, rank)?,
        })
    }

    /// Layer `l`'s GDN or attention weights.
    fn mixer(
        &self,
        cfg: &FlashConfig,
        l: usize,
        kind: LayerKind,
    ) -> Result<Mixer<'a, B>, RunError> {
        let p = format!("{LM}layers.{l}.");
        let h = cfg.hidden;
        Ok(match kind {
            LayerKind::Linear => {
                let g = &cfg.gdn;
                let (vd, ch) = (g.value_heads * g.value_dim, g.channels());
                let q = |n: &str| format!("{p}linear_attn.{n}");
                Mixer::Gdn(GdnWeights {
                    proj: GdnProj::Split {
                        qkv: self.matrix(&q("in_proj_qkv.weight"), ch, h)?,
                        z: self.matrix(&q("in_proj_z.weight"), vd, h)?,
                        b: self.matrix(&q("in_proj_b.weight"), g.value_heads, h)?,
                        a: self.matrix(&q("in_proj_a.weight"), g.value_heads, h)?,
                    },
                    conv: self.floats(&q("conv1d.weight"), &[ch, 1, g.conv_kernel])?,
                    a_log: self.floats(&q("A_log"), &[g.value_heads])?,
                    dt_bias: self.floats(&q("dt_bias"), &[g.value_heads])?,
                    norm: self.floats(&q("norm.weight"), &[g.value_dim])?,
                    out: self.matrix(&q("out_proj.weight"), h, vd)?,
                })
            }
            LayerKind::Indexed => {
                let a = &cfg.attn;
                let (qw, kvw) = (a.heads * a.head_dim, a.kv_heads * a.head_dim);
                let ix = &a.indexer;
                let q = |n: &str| format!("{p}self_attn.{n}");
                Mixer::Attn(AttnWeights {
                    q: self.matrix(&q("q_proj.weight"), 2 * qw, h)?,
                    k: self.matrix(&q("k_proj.weight"), kvw, h)?,
                    v: self.matrix(&q("v_proj.weight"), kvw, h)?,
                    o: self.matrix(&q("o_proj.weight"), h, qw)?,
                    q_norm: self.floats(&q("q_norm.weight"), &[a.head_dim])?,
                    k_norm: self.floats(&q("k_norm.weight"), &[a.head_dim])?,
                    indexer: IndexerWeights {
                        qk: self.matrix(
                            &q("indexer.index_qk_proj.weight"),
                            (ix.heads + 1) * ix.head_dim,
                            h,
                        )?,
                        q_norm: self.floats(&q("indexer.q_layernorm.weight"), &[ix.head_dim])?,
                        k_norm: self.floats(&q("indexer.k_layernorm.weight"), &[ix.head_dim])?,
                    },
                })
            }
        })
    }

    /// Layer `l`'s MoE resident weights (router and shared expert).
    fn moe(&self, cfg: &FlashConfig, l: usize) -> Result<MoeWeights<'a, B>, RunError> {
        let t = |n: &str| format!("{LM}layers.{l}.{n}");
        let (h, si) = (cfg.hidden, cfg.shared_intermediate);
        Ok(MoeWeights {
            router: self.matrix(&t("mlp.gate.weight"), cfg.moe.experts, h)?,
            shared: SharedExpert {
                mlp: SwiGlu {
                    gate: self.matrix(&t("mlp.shared_expert.gate_proj.weight"), si, h)?,
                    up: self.matrix(&t("mlp.shared_expert.up_proj.weight"), si, h)?,
                    down: self.matrix(&t("mlp.shared_expert.down_proj.weight"), h, si)?,
                },
                gate: Some(self.matrix(&t("mlp.shared_expert_gate.weight"), 1, h)?),
            },
        })
    }
}

/// The layers with PLE row pools, in order; each below the layer count.
fn ple_layer_ids(inst: &FlashInstall, cfg: &FlashConfig) -> Result<Vec<usize>, RunError> {
    let mut ple_layers: Vec<usize> = inst.rows.iter().map(|(l, _)| *l).collect();
    ple_layers.sort_unstable();
    for &l in &ple_layers {
        if l >= cfg.layers {
            return Err(RunError::invalid(
                manifest::FILE_NAME,
                format!("a row pool for layer {l}, past the {} layers", cfg.layers),
            ));
        }
    }
    Ok(ple_layers)
}

/// Layer `l`'s expert pool, checked against the config's count and shapes.
fn expert_pool<'a>(
    inst: &'a FlashInstall,
    cfg: &FlashConfig,
    l: usize,
) -> Result<&'a ExpertPool, RunError> {
    let pool = inst.experts.pool(l).ok_or_else(|| {
        RunError::invalid(manifest::FILE_NAME, format!("no expert pool for layer {l}"))
    })?;
    let (i, hh) = (cfg.moe_intermediate as u64, cfg.hidden as u64);
    let shapes: Vec<(u64, u64)> = pool.parts.iter().map(|b| (b.rows, b.cols)).collect();
    let want = [(i, hh), (i, hh), (hh, i)];
    if pool.experts != cfg.moe.experts as u64 || shapes != want {
        return Err(RunError::invalid(
            &pool.file,
            format!(
                "{} experts of shapes {shapes:?}, the config implies {} of {want:?}",
                pool.experts, cfg.moe.experts
            ),
        ));
    }
    Ok(pool)
}

impl<'a, B: Ops> FlashModel<'a, B> {
    /// Bind the install's tensors on `backend`, checking every shape against the
    /// config and the PLE tables against what the config implies.
    pub fn new(install: &'a FlashInstall, backend: &'a B) -> Result<FlashModel<'a, B>, RunError> {
        super::install::check_model_type(install)?;
        let cfg = FlashConfig::from_manifest(&install.manifest)?;
        let (inst, b) = (install, backend);
        let bind = Bind { inst, b };
        let h = cfg.hidden;
        let ple_layers = ple_layer_ids(inst, &cfg)?;
        let mut kinds = Vec::with_capacity(cfg.layers);
        let mut layers = Vec::with_capacity(cfg.layers);
        let mut pools = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let t = |n: &str| format!("{LM}layers.{l}.{n}");
            let kind = layer_kind(inst, l)?;
            let ple = if let Some(rank) = ple_layers.iter().position(|&p| p == l) {
                if kind != LayerKind::Linear {
                    return Err(RunError::invalid(
                        manifest::FILE_NAME,
                        format!("layer {l} has PLE rows but is not a linear_attention layer"),
                    ));
                }
                Some(bind.ple(&cfg, l, rank)?)
            } else {
                None
            };
            let mixer = bind.mixer(&cfg, l, kind)?;
            pools.push(expert_pool(inst, &cfg, l)?);
            layers.push(FlashLayer {
                ple,
                attn_hc: hc(b, inst, &cfg, &t("attn_hyper_connection."), true)?,
                mixer,
                mlp_hc: hc(b, inst, &cfg, &t("mlp_hyper_connection."), true)?,
                moe: bind.moe(&cfg, l)?,
            });
            kinds.push(kind);
        }
        let slots = expert_slots(b, &inst.experts, &pools, cfg.layers)?;
        Ok(FlashModel {
            embed: bind.matrix(&format!("{LM}embed_tokens.weight"), cfg.vocab, h)?,
            head: bind.matrix("lm_head.weight", cfg.vocab, h)?,
            mixer: hc(
                b,
                inst,
                &cfg,
                &format!("{LM}hyper_connection_mixer."),
                false,
            )?,
            rope: b.rope_table(
                &inv_freq(cfg.rope_theta, cfg.rotary_dim),
                0..cfg.max_positions,
                RopeLayout::HalfSplit,
            )?,
            slots,
            cfg,
            kinds,
            install,
            backend,
            layers,
        })
    }

    /// The layers' weights (each op can be run on its own, as the tests do).
    pub fn layers(&self) -> &[FlashLayer<'a, B>] {
        &self.layers
    }

    /// The final hyper-connection mixer.
    pub fn mixer(&self) -> &HyperConnection<'a, B> {
        &self.mixer
    }

    /// The RoPE table the attention and the indexer rotate with.
    pub fn rope(&self) -> &B::Rope {
        &self.rope
    }

    /// The backend's expert storage (what [`moe_forward`] is handed).
    pub fn slots(&self) -> &B::Slots {
        &self.slots
    }

    /// The backend the model computes on.
    pub fn backend(&self) -> &'a B {
        self.backend
    }

    /// The install.
    pub fn install(&self) -> &'a FlashInstall {
        self.install
    }

    /// An empty session; its buffers are made by the first forward pass (which can
    /// report a device's allocation failure).
    pub fn session(&self) -> FlashSession<B> {
        FlashSession {
            mixers: Vec::new(),
            ple: Vec::new(),
            pos: 0,
        }
    }

    /// Bytes of per-sequence state a session holds after `positions` tokens: the
    /// attention layers' KV caches with the indexer's raw and block keys (growing with
    /// the sequence), the GDN layers' conv and recurrent state and the PLE layers'
    /// history and conv state (fixed).
    pub fn state_bytes(&self, positions: usize) -> usize {
        let c = &self.cfg;
        let mixers: usize = self
            .kinds
            .iter()
            .map(|k| match k {
                LayerKind::Linear => c.gdn.state_bytes(),
                LayerKind::Indexed => c.attn.cache_bytes(positions),
            })
            .sum();
        let ple = self.layers.iter().filter(|l| l.ple.is_some()).count() * c.ple.state_bytes();
        mixers + ple
    }

    fn init_session(&self, s: &mut FlashSession<B>) -> Result<(), RunError> {
        if s.mixers.len() == self.cfg.layers {
            return Ok(());
        }
        let (b, c) = (self.backend, &self.cfg);
        s.mixers = self
            .kinds
            .iter()
            .map(|k| {
                Ok(match k {
                    LayerKind::Linear => MixerState::Gdn(GdnState::new(b, &c.gdn)?),
                    LayerKind::Indexed => MixerState::Attn(b.attn_cache(
                        c.attn.kv_heads,
                        c.attn.head_dim,
                        c.attn.indexer,
                    )?),
                })
            })
            .collect::<Result<_, RunError>>()?;
        s.ple = self
            .layers
            .iter()
            .map(|l| l.ple.as_ref().map(|_| PleState::new(b, &c.ple)).transpose())
            .collect::<Result<_, _>>()?;
        s.pos = 0;
        Ok(())
    }

    /// Run `tokens` after the session's state. Returns the logits of every position
    /// (`[T, vocab]`) when `all` is true, else those of the last one.
    pub fn forward(
        &self,
        s: &mut FlashSession<B>,
        tokens: &[u32],
        all: bool,
    ) -> Result<Vec<f32>, RunError> {
        self.forward_traced(s, tokens, all, None)
    }

    /// [`FlashModel::forward`], recording the intermediate values into `trace`. Bad
    /// input (a token outside the vocabulary, a sequence past
    /// `max_position_embeddings`) is refused before anything changes; after an I/O
    /// or device error part-way the session is part-way too and should be dropped.
    pub fn forward_traced(
        &self,
        s: &mut FlashSession<B>,
        tokens: &[u32],
        all: bool,
        mut trace: Option<&mut Trace>,
    ) -> Result<Vec<f32>, RunError> {
        let c = &self.cfg;
        let b = self.backend;
        let t = tokens.len();
        if t == 0 {
            return Ok(Vec::new());
        }
        self.check_input(s, tokens)?;
        self.init_session(s)?;
        let (h, w) = (c.hidden, c.hc.width());
        let ids: Vec<i64> = tokens.iter().map(|&id| i64::from(id)).collect();
        let mut e = b.zeros(t * h)?;
        b.embed(&self.embed, tokens, &mut e)?;
        let mut x = b.zeros(t * w)?;
        b.hc_expand(&e, c.hc, &mut x)?;
        if let Some(tr) = trace.as_deref_mut() {
            tr.put(b, "embed".into(), &e)?;
        }
        for (l, layer) in self.layers.iter().enumerate() {
            if let Some(tr) = trace.as_deref_mut() {
                tr.put(b, format!("layers.{l}.in"), &x)?;
            }
            self.ple_step(l, layer, s, &mut x, &ids, trace.as_deref_mut())?;
            self.mixer_step(l, layer, s, &mut x, t, trace.as_deref_mut())?;
            self.moe_step(l, layer, &mut x, t, trace.as_deref_mut())?;
        }
        let r = hc_read(b, &self.mixer, c.hc, &x, t)?;
        let (rows, m) = if all {
            (r.mixed, t)
        } else {
            (b.copy_rows(&r.mixed, h, t - 1..t)?, 1)
        };
        let mut logits = b.zeros(m * c.vocab)?;
        b.linear(&self.head, &rows, &mut logits)?;
        if let Some(tr) = trace {
            tr.put(b, "mixer.out".into(), &rows)?;
            tr.put(b, "logits".into(), &logits)?;
        }
        s.pos += t;
        Ok(b.read_owned(logits)?)
    }

    /// Refuse a token outside the vocabulary or a sequence past
    /// `max_position_embeddings`, before anything changes.
    fn check_input(&self, s: &FlashSession<B>, tokens: &[u32]) -> Result<(), RunError> {
        let c = &self.cfg;
        let t = tokens.len();
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= c.vocab) {
            return Err(InputError::TokenOutsideVocabulary {
                token: bad,
                vocab: c.vocab,
            }
            .into());
        }
        if s.pos + t > c.max_positions {
            return Err(InputError::SequenceTooLong {
                tokens: s.pos + t,
                max: c.max_positions,
            }
            .into());
        }
        Ok(())
    }

    /// Layer `l`'s PLE block, on the layers that have one: `x += ple(x, ids)`.
    fn ple_step(
        &self,
        l: usize,
        layer: &FlashLayer<'a, B>,
        s: &mut FlashSession<B>,
        x: &mut B::Buf,
        ids: &[i64],
        trace: Option<&mut Trace>,
    ) -> Result<(), RunError> {
        let (c, b) = (&self.cfg, self.backend);
        let p = format!("layers.{l}");
        if let (Some(pw), Some(ps)) = (&layer.ple, s.ple[l].as_mut()) {
            let rows = self.install.row_cache(l).ok_or_else(|| {
                RunError::invalid(manifest::FILE_NAME, format!("no row pool for layer {l}"))
            })?;
            let o = ple_forward(b, pw, &c.ple, rows, ps, x, ids)?;
            b.add(x, &o.out)?;
            if let Some(tr) = trace {
                tr.put_ints(format!("{p}.ple.ids"), o.ids.iter().map(|&i| i as i64));
                tr.put(b, format!("{p}.ple.emb"), &o.emb)?;
                tr.put(b, format!("{p}.ple.out"), &o.out)?;
            }
        }
        Ok(())
    }

    /// Layer `l`'s token mixer: `u, inj = attn_hc(x); x += inj ⊗ (GDN or attention)(u)`.
    fn mixer_step(
        &self,
        l: usize,
        layer: &FlashLayer<'a, B>,
        s: &mut FlashSession<B>,
        x: &mut B::Buf,
        t: usize,
        mut trace: Option<&mut Trace>,
    ) -> Result<(), RunError> {
        let (c, b) = (&self.cfg, self.backend);
        let p = format!("layers.{l}");
        let r = hc_read(b, &layer.attn_hc, c.hc, x, t)?;
        let y = match (&layer.mixer, &mut s.mixers[l]) {
            (Mixer::Gdn(gw), MixerState::Gdn(gs)) => {
                let o = gdn_forward(b, gw, &c.gdn, gs, &r.mixed, t)?;
                if let Some(tr) = trace.as_deref_mut() {
                    tr.put(b, format!("{p}.gdn.qkv"), &o.qkv)?;
                    tr.put(b, format!("{p}.gdn.core"), &o.core)?;
                    tr.put(b, format!("{p}.gdn.gated"), &o.gated)?;
                    tr.put(b, format!("{p}.gdn.out"), &o.out)?;
                }
                o.out
            }
            (Mixer::Attn(aw), MixerState::Attn(ac)) => {
                let o = attention_forward(b, aw, &c.attn, &self.rope, ac, s.pos, &r.mixed, t)?;
                if let Some(tr) = trace.as_deref_mut() {
                    tr.put(b, format!("{p}.attn.gated"), &o.gated)?;
                    tr.put(b, format!("{p}.attn.out"), &o.out)?;
                    tr.blocks.entry(p.clone()).or_default().extend(o.blocks);
                    tr.scores.entry(p.clone()).or_default().extend(o.scores);
                }
                o.out
            }
            _ => unreachable!("init_session made layer {l}'s state for its kind"),
        };
        if let Some(tr) = trace.as_deref_mut() {
            tr.put_hc(b, &format!("{p}.attn_hc"), &r)?;
        }
        b.hc_inject(x, &r.inject, &y, c.hc)?;
        if let Some(tr) = trace {
            tr.put(b, format!("{p}.after_attn"), x)?;
        }
        Ok(())
    }

    /// Layer `l`'s MoE: `u, inj = mlp_hc(x); x += inj ⊗ MoE(u)`.
    fn moe_step(
        &self,
        l: usize,
        layer: &FlashLayer<'a, B>,
        x: &mut B::Buf,
        t: usize,
        trace: Option<&mut Trace>,
    ) -> Result<(), RunError> {
        let (c, b) = (&self.cfg, self.backend);
        let p = format!("layers.{l}");
        let r = hc_read(b, &layer.mlp_hc, c.hc, x, t)?;
        let o = moe_forward(
            b,
            &layer.moe,
            &c.moe,
            &self.install.experts,
            &self.slots,
            l,
            &r.mixed,
            t,
            trace.is_some(),
        )?;
        b.hc_inject(x, &r.inject, &o.out, c.hc)?;
        if let Some(tr) = trace {
            tr.put_hc(b, &format!("{p}.mlp_hc"), &r)?;
            if let Some(rl) = &o.router_logits {
                tr.put(b, format!("{p}.moe.router_logits"), rl)?;
            }
            for rt in &o.routes {
                tr.put_ints(
                    format!("{p}.moe.topk_idx"),
                    rt.experts.iter().map(|&e| e as i64),
                );
                tr.f32s
                    .entry(format!("{p}.moe.topk_w"))
                    .or_default()
                    .extend_from_slice(&rt.weights);
            }
            tr.put(b, format!("{p}.moe.shared"), &o.shared)?;
            tr.put(b, format!("{p}.moe.out"), &o.out)?;
            tr.put(b, format!("{p}.out"), x)?;
        }
        Ok(())
    }
}

impl<B: Ops> FlashModel<'_, B> {
    /// A copy of `s` that continues independently (every layer's state copied on the
    /// backend).
    pub fn copy_session(&self, s: &FlashSession<B>) -> Result<FlashSession<B>, RunError> {
        let b = self.backend;
        let mixers = s
            .mixers
            .iter()
            .map(|m| {
                Ok(match m {
                    MixerState::Gdn(g) => MixerState::Gdn(GdnState {
                        conv: b.copy(&g.conv)?,
                        recurrent: b.copy(&g.recurrent)?,
                    }),
                    MixerState::Attn(c) => MixerState::Attn(b.copy_cache(c)?),
                })
            })
            .collect::<OpResult<Vec<_>>>()?;
        let ple = s
            .ple
            .iter()
            .map(|p| {
                p.as_ref()
                    .map(|p| {
                        Ok(PleState {
                            history: p.history.clone(),
                            conv: b.copy(&p.conv)?,
                        })
                    })
                    .transpose()
            })
            .collect::<OpResult<Vec<_>>>()?;
        Ok(FlashSession {
            mixers,
            ple,
            pos: s.pos,
        })
    }

    /// The footer's figures: the PLE row caches and the per-sequence state.
    fn footer_stats(&self, positions: usize) -> Vec<Stat> {
        let mut rows = CacheStats::default();
        let mut cap = 0u64;
        for (_, r) in &self.install.rows {
            let s = r.stats();
            rows.hits += s.hits;
            rows.misses += s.misses;
            cap += r.capacity_bytes();
        }
        let state = self.state_bytes(positions);
        vec![
            Stat {
                text: format!("row cache {}", rows.text()),
                key: "row_cache",
                value: serde_json::json!({
                    "hits": rows.hits, "misses": rows.misses, "hit_rate": rows.hit_rate(),
                    "capacity_bytes": cap,
                }),
            },
            Stat {
                text: format!(
                    "KV cache + GDN/PLE state {:.1} KiB at {positions} positions",
                    state as f64 / 1024.0
                ),
                key: "state_bytes",
                value: serde_json::json!(state),
            },
        ]
    }
}

impl<B: Ops> LanguageModel for FlashModel<'_, B> {
    type Session = FlashSession<B>;
    fn new_session(&self) -> FlashSession<B> {
        self.session()
    }
    fn run(
        &self,
        s: &mut FlashSession<B>,
        tokens: &[u32],
        all: bool,
    ) -> Result<Vec<f32>, RunError> {
        self.forward(s, tokens, all)
    }
    fn copy_session(&self, s: &FlashSession<B>) -> Result<FlashSession<B>, RunError> {
        FlashModel::copy_session(self, s)
    }
    fn export_session(&self, s: &FlashSession<B>) -> Result<SessionData, RunError> {
        let b = self.backend;
        let mut parts = Vec::new();
        for m in &s.mixers {
            match m {
                MixerState::Gdn(g) => g.export(b, &mut parts)?,
                MixerState::Attn(c) => state::export_attn(b, c, &mut parts)?,
            }
        }
        for p in s.ple.iter().flatten() {
            p.export(b, &mut parts)?;
        }
        Ok(SessionData { pos: s.pos, parts })
    }
    fn import_session(&self, d: &SessionData) -> Result<FlashSession<B>, RunError> {
        let mut s = self.session();
        if d.parts.is_empty() && d.pos == 0 {
            return Ok(s);
        }
        self.init_session(&mut s)?;
        let (b, c) = (self.backend, &self.cfg);
        let geometry = (c.attn.kv_heads * c.attn.head_dim, &c.attn.indexer);
        let mut r = d.reader();
        for m in &mut s.mixers {
            match m {
                MixerState::Gdn(g) => *g = GdnState::import(b, &c.gdn, &mut r)?,
                MixerState::Attn(a) => state::import_attn(b, a, geometry, &mut r, d.pos)?,
            }
        }
        for p in s.ple.iter_mut().flatten() {
            *p = PleState::import(b, &c.ple, &mut r)?;
        }
        r.finish()?;
        s.pos = d.pos;
        Ok(s)
    }
    fn session_bytes(&self, s: &FlashSession<B>) -> u64 {
        let b = self.backend;
        let mixers: u64 = s
            .mixers
            .iter()
            .map(|m| match m {
                MixerState::Gdn(g) => b.buf_bytes(&g.conv) + b.buf_bytes(&g.recurrent),
                MixerState::Attn(c) => b.cache_bytes(c),
            })
            .sum();
        let ple: u64 = s.ple.iter().flatten().map(|p| b.buf_bytes(&p.conv)).sum();
        mixers + ple
    }
    fn vocab(&self) -> usize {
        self.cfg.vocab
    }
    fn backend_name(&self) -> String {
        self.backend.name().to_string()
    }
    fn device_memory_bytes(&self) -> Option<u64> {
        self.backend.device_memory_bytes()
    }
    fn stats(&self, positions: usize) -> Vec<Stat> {
        self.footer_stats(positions)
    }
}
