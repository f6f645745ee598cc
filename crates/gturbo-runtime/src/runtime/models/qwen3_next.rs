//! Qwen3-Next (`Qwen3NextForCausalLM`, transformers 5.24
//! `models/qwen3_next/modeling_qwen3_next.py`): a hybrid of gated DeltaNet and gated
//! full attention over softmax-routed experts with a gated shared expert.
//!
//! ```text
//! x = embed_tokens[ids]
//! for each layer l:
//!     u = rms₁(x)                                   rms₁(x) = x̂ · (1 + w)  (Qwen3NextRMSNorm)
//!     x += (l+1) % full_attention_interval == 0 ? gated_attention(u) : gdn(u)
//!     x += moe(rms₁(x))
//! logits = lm_head · rms₁(x)
//! ```
//! - gated attention: `[query | gate] = q_proj · u` per head (query first);
//!   `q = rope(rms₁(query))`, `k = rope(rms₁(k_proj · u))` over the first
//!   `int(head_dim · partial_rotary_factor)` dims (rotate-half), causal softmax
//!   attention scaled by `1/√head_dim`, `out = o_proj · (o ⊙ σ(gate))`;
//! - gdn: [`layers::gdn`](crate::runtime::layers::gdn) with the grouped
//!   `in_proj_qkvz` / `in_proj_ba` projections and a silu output gate; its norm is the
//!   one plain-weight RMSNorm (`Qwen3NextRMSNormGated`: `x̂ · w · silu(z)`);
//! - moe: [`layers::sparse_moe`](crate::runtime::layers::sparse_moe): softmax over
//!   all experts, top-k, renormalised (`norm_topk_prob`, true by default), plus the
//!   shared expert scaled by `σ(shared_expert_gate · u)`.
//!
//! The session holds, per DeltaNet layer, its conv columns and recurrent state (fixed
//! size) and, per attention layer, a K/V cache; [`Qwen3NextModel::copy_session`]
//! copies all of them, so a snapshot continues exactly as the original would.
//! MTP (`mtp.*`) is a sidecar the install drops; nothing here reads it.

use crate::format::manifest::{self, Manifest};
use crate::format::pools::ExpertPool;
use crate::runtime::error::{InputError, RunError};
use crate::runtime::generate::{LanguageModel, Stat};
use crate::runtime::kernels::ops::{GateAct, GdnDims, Ops};
use crate::runtime::kernels::{AttentionSpec, Backend, Causal, NormGain, OpResult};
use crate::runtime::layers::axes::{Axes, axis_err};
use crate::runtime::layers::gdn::{GdnProj, GdnState, GdnWeights, gdn_forward};
use crate::runtime::layers::head::OutputHead;
use crate::runtime::layers::mlp::{SharedExpert, SwiGlu};
use crate::runtime::layers::moe::expert_slots;
use crate::runtime::layers::rope::{RopeSpec, Scaling};
use crate::runtime::layers::sparse_moe::{MoeDims, MoeWeights, moe_forward};
use crate::runtime::load::Install;
use crate::runtime::models::decoder::{MoeConfig, expert_pool};
use crate::runtime::models::state::{self, SessionData};

/// The model type this runner implements.
pub const MODEL_TYPE: &str = "qwen3_next";

/// `full_attention_interval` when the config leaves it out (transformers' default).
const DEFAULT_FULL_ATTENTION_INTERVAL: usize = 4;

/// `partial_rotary_factor` when the config leaves it out (transformers' default for
/// this model, where other models default to 1).
const DEFAULT_PARTIAL_ROTARY_FACTOR: f64 = 0.25;

/// The runner reads integer axes below 2^40.
const AXIS_BELOW: u64 = 1 << 40;

/// Every number the forward pass needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Model width `H`.
    pub hidden: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// `rms_norm_eps`.
    pub eps: f32,
    /// Every `interval`-th layer (1-based) is full attention.
    pub full_attention_interval: usize,
    /// Longest sequence.
    pub max_positions: usize,
    /// Rotary embedding (partial: `rotary_dim < head_dim`).
    pub rope: RopeSpec,
    /// DeltaNet geometry (silu output gate).
    pub gdn: GdnDims,
    /// Routing.
    pub moe: MoeDims,
    /// Routed expert width.
    pub moe_intermediate: usize,
    /// Shared expert width.
    pub shared_intermediate: usize,
}

impl Config {
    /// Read and cross-check the axes.
    pub fn from_manifest(m: &Manifest) -> Result<Config, RunError> {
        let a = Axes::new(m, AXIS_BELOW, "missing (the qwen3_next runner needs it)");
        crate::format::axes::check(&m.arch.axes).map_err(|e| a.err(&e.axis, &e.detail))?;
        let hidden = a.usize("hidden_size")?;
        let heads = a.usize("num_attention_heads")?;
        let kv_heads = a.usize("num_key_value_heads")?;
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(a.err(
                "num_key_value_heads",
                &format!("{kv_heads} does not divide num_attention_heads {heads}"),
            ));
        }
        let head_dim = a.usize("head_dim")?;
        let rope = rope_of(m, &a, head_dim)?;
        let nk = a.usize("linear_num_key_heads")?;
        let nv = a.usize("linear_num_value_heads")?;
        if nk == 0 || !nv.is_multiple_of(nk) {
            return Err(a.err(
                "linear_num_value_heads",
                &format!("{nv} is not a multiple of linear_num_key_heads {nk}"),
            ));
        }
        let experts = a.usize("num_experts")?;
        let top_k = a.usize("num_experts_per_tok")?;
        if top_k == 0 || top_k > experts {
            return Err(a.err(
                "num_experts_per_tok",
                &format!("{top_k}; between 1 and num_experts {experts}"),
            ));
        }
        // Every layer routed: `decoder_sparse_step` 1 (dense layers are not run here).
        if let Some(step) = a.opt_usize("decoder_sparse_step")?
            && step != 1
        {
            return Err(a.err(
                "decoder_sparse_step",
                &format!("{step}; the qwen3_next runner runs models whose every layer is MoE (1)"),
            ));
        }
        let interval = a
            .opt_usize("full_attention_interval")?
            .unwrap_or(DEFAULT_FULL_ATTENTION_INTERVAL);
        if interval == 0 {
            return Err(a.err("full_attention_interval", "0"));
        }
        let eps = a.f64("rms_norm_eps")? as f32;
        let (kd, vd) = (
            a.usize("linear_key_head_dim")?,
            a.usize("linear_value_head_dim")?,
        );
        let vocab = a.usize("vocab_size")?;
        let sizes: [(&str, &[usize]); 4] = [
            ("num_attention_heads", &[heads, head_dim, 2]),
            ("linear_num_value_heads", &[nv, kd, vd]),
            ("linear_num_key_heads", &[nk, 2 * kd + 2 * vd * (nv / nk)]),
            ("vocab_size", &[vocab, hidden]),
        ];
        for (axis, factors) in sizes {
            let n = factors
                .iter()
                .try_fold(1usize, |acc, &f| acc.checked_mul(f));
            if n.is_none_or(|n| n > 1 << 40) {
                return Err(a.err(axis, &format!("the product {factors:?} is too large")));
            }
        }
        let trained = a.opt_usize("max_position_embeddings")?.unwrap_or(1 << 16);
        Ok(Config {
            hidden,
            layers: a.usize("num_layers")?,
            heads,
            kv_heads,
            head_dim,
            vocab,
            eps,
            full_attention_interval: interval,
            max_positions: trained,
            rope,
            gdn: GdnDims {
                hidden,
                key_heads: nk,
                key_dim: kd,
                value_heads: nv,
                value_dim: vd,
                conv_kernel: a.usize("linear_conv_kernel_dim")?,
                eps,
                gate: GateAct::Silu,
            },
            moe: MoeDims {
                hidden,
                experts,
                top_k,
                norm_topk_prob: a.opt_bool("norm_topk_prob")?.unwrap_or(true),
            },
            moe_intermediate: a.usize("moe_intermediate_size")?,
            shared_intermediate: a.usize("shared_expert_intermediate_size")?,
        })
    }

    /// Whether layer `l` is full attention (transformers' `layer_types` default).
    pub fn is_full_attention(&self, l: usize) -> bool {
        (l + 1).is_multiple_of(self.full_attention_interval)
    }
}

/// The rotary embedding: the config's, with this model's default partial factor
/// (0.25) where the config gives none. Scalings whose frequencies depend on the call
/// (dynamic NTK) or that scale the softmax (YaRN's attention factor) are refused: the
/// published configs use plain RoPE.
fn rope_of(m: &Manifest, a: &Axes, head_dim: usize) -> Result<RopeSpec, RunError> {
    let mut rope = RopeSpec::from_manifest(m, head_dim)?;
    let in_scaling = a
        .value("rope_scaling")
        .and_then(|v| v.get("partial_rotary_factor"))
        .is_some();
    if a.value("partial_rotary_factor").is_none() && !in_scaling {
        rope.rotary_dim = (head_dim as f64 * DEFAULT_PARTIAL_ROTARY_FACTOR) as usize;
    }
    if rope.rotary_dim == 0 || !rope.rotary_dim.is_multiple_of(2) {
        return Err(a.err(
            "partial_rotary_factor",
            &format!(
                "{} rotated dimensions of head_dim {head_dim}; RoPE needs a positive even number",
                rope.rotary_dim
            ),
        ));
    }
    if matches!(rope.scaling, Scaling::Dynamic { .. }) || rope.attention_scaling() != 1.0 {
        return Err(axis_err(
            m,
            "rope_scaling",
            "dynamic NTK and YaRN's attention factor are not implemented for qwen3_next",
        ));
    }
    Ok(rope)
}

/// One gated full-attention layer's weights.
struct AttnWeights<'a, B: Backend> {
    /// `q_proj` `[nh·2d, H]`: per head `d` query rows then `d` gate rows.
    q: B::Weights<'a>,
    k: B::Weights<'a>,
    v: B::Weights<'a>,
    o: B::Weights<'a>,
    /// `q_norm.weight` `[d]` (offset).
    q_norm: B::Buf,
    /// `k_norm.weight` `[d]` (offset).
    k_norm: B::Buf,
}

enum Mixer<'a, B: Ops> {
    Gdn(GdnWeights<'a, B>),
    Attn(AttnWeights<'a, B>),
}

struct Layer<'a, B: Ops> {
    input_norm: B::Buf,
    post_norm: B::Buf,
    mixer: Mixer<'a, B>,
    moe: MoeWeights<'a, B>,
}

/// One layer's per-sequence state.
pub enum MixerState<B: Ops> {
    /// DeltaNet conv columns and recurrent state.
    Gdn(GdnState<B>),
    /// Full attention's K/V cache.
    Attn(B::Kv),
}

/// Per-sequence state; made by the first forward pass.
pub struct Session<B: Ops> {
    /// Per layer, its mixer's state (empty until the first forward pass).
    pub mixers: Vec<MixerState<B>>,
    /// Tokens seen.
    pub pos: usize,
}

/// The loaded model, computing on `B`.
pub struct Qwen3NextModel<'a, B: Ops> {
    /// The numbers.
    pub cfg: Config,
    install: &'a Install,
    backend: &'a B,
    embed: B::Weights<'a>,
    /// `None` when the head is tied to the embedding.
    head: Option<B::Weights<'a>>,
    final_norm: B::Buf,
    layers: Vec<Layer<'a, B>>,
    rope: B::Rope,
    slots: B::Slots,
}

/// The install and the backend its tensors are bound on.
struct Bind<'a, 'b, B: Ops> {
    inst: &'a Install,
    b: &'b B,
}

impl<'a, B: Ops> Bind<'a, '_, B> {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<B::Weights<'a>, RunError> {
        Ok(self.b.weights(self.inst.matrix(name, rows, cols)?)?)
    }

    fn floats(&self, name: &str, shape: &[usize]) -> Result<B::Buf, RunError> {
        Ok(self.b.upload(&self.inst.floats(name, shape)?)?)
    }

    /// Layer `l`'s token mixer, of the kind the config says, checked against the
    /// tensors the install holds.
    fn mixer(&self, c: &Config, l: usize) -> Result<Mixer<'a, B>, RunError> {
        let p = format!("model.layers.{l}.");
        let h = c.hidden;
        let linear = self
            .inst
            .has(&format!("{p}linear_attn.in_proj_qkvz.weight"));
        let full = self.inst.has(&format!("{p}self_attn.q_proj.weight"));
        let want_full = c.is_full_attention(l);
        if (linear, full) != (!want_full, want_full) {
            return Err(RunError::invalid(
                &self.inst.manifest.resident.file,
                format!(
                    "layer {l} should be {} (full_attention_interval {}), but the install holds {} linear_attn.in_proj_qkvz and {} self_attn.q_proj",
                    if want_full {
                        "full attention"
                    } else {
                        "linear attention"
                    },
                    c.full_attention_interval,
                    if linear { "a" } else { "no" },
                    if full { "a" } else { "no" },
                ),
            ));
        }
        Ok(if want_full {
            let (qw, kvw, d) = (c.heads * c.head_dim, c.kv_heads * c.head_dim, c.head_dim);
            let q = |n: &str| format!("{p}self_attn.{n}");
            Mixer::Attn(AttnWeights {
                q: self.matrix(&q("q_proj.weight"), 2 * qw, h)?,
                k: self.matrix(&q("k_proj.weight"), kvw, h)?,
                v: self.matrix(&q("v_proj.weight"), kvw, h)?,
                o: self.matrix(&q("o_proj.weight"), h, qw)?,
                q_norm: self.floats(&q("q_norm.weight"), &[d])?,
                k_norm: self.floats(&q("k_norm.weight"), &[d])?,
            })
        } else {
            let g = &c.gdn;
            let r = g.value_heads / g.key_heads;
            let (vd, ch) = (g.value_heads * g.value_dim, g.channels());
            let q = |n: &str| format!("{p}linear_attn.{n}");
            Mixer::Gdn(GdnWeights {
                proj: GdnProj::Grouped {
                    qkvz: self.matrix(
                        &q("in_proj_qkvz.weight"),
                        g.key_heads * (2 * g.key_dim + 2 * r * g.value_dim),
                        h,
                    )?,
                    ba: self.matrix(&q("in_proj_ba.weight"), 2 * g.value_heads, h)?,
                },
                conv: self.floats(&q("conv1d.weight"), &[ch, 1, g.conv_kernel])?,
                a_log: self.floats(&q("A_log"), &[g.value_heads])?,
                dt_bias: self.floats(&q("dt_bias"), &[g.value_heads])?,
                norm: self.floats(&q("norm.weight"), &[g.value_dim])?,
                out: self.matrix(&q("out_proj.weight"), h, vd)?,
            })
        })
    }

    /// Layer `l`'s router and gated shared expert.
    fn moe(&self, c: &Config, l: usize) -> Result<MoeWeights<'a, B>, RunError> {
        let t = |n: &str| format!("model.layers.{l}.mlp.{n}");
        let (h, si) = (c.hidden, c.shared_intermediate);
        Ok(MoeWeights {
            router: self.matrix(&t("gate.weight"), c.moe.experts, h)?,
            shared: SharedExpert {
                mlp: SwiGlu {
                    gate: self.matrix(&t("shared_expert.gate_proj.weight"), si, h)?,
                    up: self.matrix(&t("shared_expert.up_proj.weight"), si, h)?,
                    down: self.matrix(&t("shared_expert.down_proj.weight"), h, si)?,
                },
                gate: Some(self.matrix(&t("shared_expert_gate.weight"), 1, h)?),
            },
        })
    }
}

impl<'a, B: Ops> Qwen3NextModel<'a, B> {
    /// Bind the install's tensors on `backend`, every shape checked against the config.
    pub fn new(install: &'a Install, backend: &'a B) -> Result<Qwen3NextModel<'a, B>, RunError> {
        let m = &install.manifest;
        if m.arch.model_type != MODEL_TYPE {
            return Err(RunError::invalid(
                manifest::FILE_NAME,
                format!(
                    "arch.model_type is {:?}; the qwen3_next runner runs {MODEL_TYPE:?}",
                    m.arch.model_type
                ),
            ));
        }
        let cfg = Config::from_manifest(m)?;
        if install.has(&format!(
            "model.layers.{}.input_layernorm.weight",
            cfg.layers
        )) {
            return Err(axis_err(
                m,
                "num_layers",
                &format!(
                    "{}, but the install holds tensors of layer {}",
                    cfg.layers, cfg.layers
                ),
            ));
        }
        let b = backend;
        let bind = Bind { inst: install, b };
        let h = cfg.hidden;
        let moe_cfg = MoeConfig {
            experts: cfg.moe.experts,
            top_k: cfg.moe.top_k,
            intermediate: cfg.moe_intermediate,
            norm_topk_prob: cfg.moe.norm_topk_prob,
        };
        let mut layers = Vec::new();
        let mut pools: Vec<&ExpertPool> = Vec::new();
        for l in 0..cfg.layers {
            let t = |n: &str| format!("model.layers.{l}.{n}");
            pools.push(expert_pool(install, &moe_cfg, h, l)?);
            layers.push(Layer {
                input_norm: bind.floats(&t("input_layernorm.weight"), &[h])?,
                post_norm: bind.floats(&t("post_attention_layernorm.weight"), &[h])?,
                mixer: bind.mixer(&cfg, l)?,
                moe: bind.moe(&cfg, l)?,
            });
        }
        let head = if install.has("lm_head.weight") {
            Some(bind.matrix("lm_head.weight", cfg.vocab, h)?)
        } else {
            None
        };
        let slots = expert_slots(b, &install.experts, &pools, cfg.layers)?;
        Ok(Qwen3NextModel {
            embed: bind.matrix("model.embed_tokens.weight", cfg.vocab, h)?,
            head,
            final_norm: bind.floats("model.norm.weight", &[h])?,
            rope: b.rope_table(&cfg.rope.inv_freq(0), 0..cfg.max_positions, cfg.rope.layout)?,
            slots,
            layers,
            install,
            backend,
            cfg,
        })
    }

    /// An empty session.
    pub fn session(&self) -> Session<B> {
        Session {
            mixers: Vec::new(),
            pos: 0,
        }
    }

    fn init_session(&self, s: &mut Session<B>) -> OpResult {
        if s.mixers.len() == self.cfg.layers {
            return Ok(());
        }
        let (b, c) = (self.backend, &self.cfg);
        s.mixers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match l.mixer {
                    Mixer::Gdn(_) => MixerState::Gdn(GdnState::new(b, &c.gdn)?),
                    Mixer::Attn(_) => MixerState::Attn(b.kv_cache(
                        AttentionSpec::dense(c.kv_heads, c.head_dim),
                        c.max_positions,
                    )?),
                })
            })
            .collect::<OpResult<_>>()?;
        s.pos = 0;
        Ok(())
    }

    /// A copy of `s` that continues independently: every DeltaNet layer's conv and
    /// recurrent state and every attention layer's K/V cache, copied on the backend.
    pub fn copy_session(&self, s: &Session<B>) -> Result<Session<B>, RunError> {
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
                    MixerState::Attn(kv) => MixerState::Attn(b.copy_kv(kv)?),
                })
            })
            .collect::<OpResult<Vec<_>>>()?;
        Ok(Session { mixers, pos: s.pos })
    }

    /// Bytes of per-sequence state after `positions` tokens: the attention layers'
    /// K/V caches (f32, growing with the sequence) and the DeltaNet layers' conv and
    /// recurrent state (fixed).
    pub fn state_bytes(&self, positions: usize) -> usize {
        let c = &self.cfg;
        self.layers
            .iter()
            .map(|l| match l.mixer {
                Mixer::Gdn(_) => c.gdn.state_bytes(),
                Mixer::Attn(_) => positions * 2 * c.kv_heads * c.head_dim * 4,
            })
            .sum()
    }

    /// Refuse a token outside the vocabulary or a sequence past the context, before
    /// anything changes.
    fn check_input(&self, s: &Session<B>, tokens: &[u32]) -> Result<(), RunError> {
        let c = &self.cfg;
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= c.vocab) {
            return Err(InputError::TokenOutsideVocabulary {
                token: bad,
                vocab: c.vocab,
            }
            .into());
        }
        if s.pos + tokens.len() > c.max_positions {
            return Err(InputError::SequenceTooLong {
                tokens: s.pos + tokens.len(),
                max: c.max_positions,
            }
            .into());
        }
        Ok(())
    }

    /// Run `tokens` after the session's state: the logits of every position when
    /// `all`, else of the last one.
    pub fn forward(
        &self,
        s: &mut Session<B>,
        tokens: &[u32],
        all: bool,
    ) -> Result<Vec<f32>, RunError> {
        let (c, b) = (&self.cfg, self.backend);
        let t = tokens.len();
        if t == 0 {
            return Ok(Vec::new());
        }
        self.check_input(s, tokens)?;
        self.init_session(s)?;
        let h = c.hidden;
        let mut x = b.zeros(t * h)?;
        b.embed(&self.embed, tokens, &mut x)?;
        let mut u = b.zeros(t * h)?;
        for (l, layer) in self.layers.iter().enumerate() {
            b.rms_norm(
                &x,
                &layer.input_norm,
                c.eps,
                NormGain::OnePlusWeight,
                &mut u,
            )?;
            let y = match (&layer.mixer, &mut s.mixers[l]) {
                (Mixer::Gdn(w), MixerState::Gdn(st)) => gdn_forward(b, w, &c.gdn, st, &u, t)?.out,
                (Mixer::Attn(w), MixerState::Attn(kv)) => self.attention(w, kv, s.pos, &u, t)?,
                _ => unreachable!("init_session made layer {l}'s state for its kind"),
            };
            b.add(&mut x, &y)?;
            b.rms_norm(&x, &layer.post_norm, c.eps, NormGain::OnePlusWeight, &mut u)?;
            let o = moe_forward(
                b,
                &layer.moe,
                &c.moe,
                &self.install.experts,
                &self.slots,
                l,
                &u,
                t,
                false,
            )?;
            b.add(&mut x, &o.out)?;
        }
        let out = OutputHead {
            norm: &self.final_norm,
            eps: c.eps,
            gain: NormGain::OnePlusWeight,
            head: self.head.as_ref().unwrap_or(&self.embed),
            hidden: h,
            vocab: c.vocab,
        };
        let logits = out.logits(b, x, t, all)?;
        s.pos += t;
        Ok(logits)
    }

    /// Gated full attention of the `t` rows of `u` at positions `pos ..`, appending to
    /// `kv`.
    fn attention(
        &self,
        w: &AttnWeights<'a, B>,
        kv: &mut B::Kv,
        pos: usize,
        u: &B::Buf,
        t: usize,
    ) -> OpResult<B::Buf> {
        let (c, b) = (&self.cfg, self.backend);
        let (nh, nkv, hd) = (c.heads, c.kv_heads, c.head_dim);
        let (qw, kvw) = (nh * hd, nkv * hd);
        let mut qg = b.zeros(t * 2 * qw)?;
        b.linear(&w.q, u, &mut qg)?;
        let mut query = b.zeros(t * qw)?;
        b.gather_cols(&qg, 2 * hd, 0..hd, &mut query)?;
        let mut gate = b.zeros(t * qw)?;
        b.gather_cols(&qg, 2 * hd, hd..2 * hd, &mut gate)?;
        let mut kp = b.zeros(t * kvw)?;
        b.linear(&w.k, u, &mut kp)?;
        let mut v = b.zeros(t * kvw)?;
        b.linear(&w.v, u, &mut v)?;
        let mut q = b.zeros(t * qw)?;
        b.rms_norm(&query, &w.q_norm, c.eps, NormGain::OnePlusWeight, &mut q)?;
        b.rope(&self.rope, &mut q, nh, hd, pos)?;
        let mut k = b.zeros(t * kvw)?;
        b.rms_norm(&kp, &w.k_norm, c.eps, NormGain::OnePlusWeight, &mut k)?;
        b.rope(&self.rope, &mut k, nkv, hd, pos)?;
        let at = Causal {
            pos,
            heads: nh,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        let mut o = b.zeros(t * qw)?;
        b.attention(kv, &q, &k, &v, at, None, &mut o)?;
        b.sigmoid_mul(&mut o, &gate)?;
        let mut out = b.zeros(t * c.hidden)?;
        b.linear(&w.o, &o, &mut out)?;
        Ok(out)
    }
}

impl<B: Ops> LanguageModel for Qwen3NextModel<'_, B> {
    type Session = Session<B>;
    fn new_session(&self) -> Session<B> {
        self.session()
    }
    fn run(&self, s: &mut Session<B>, tokens: &[u32], all: bool) -> Result<Vec<f32>, RunError> {
        self.forward(s, tokens, all)
    }
    fn copy_session(&self, s: &Session<B>) -> Result<Session<B>, RunError> {
        Qwen3NextModel::copy_session(self, s)
    }
    fn export_session(&self, s: &Session<B>) -> Result<SessionData, RunError> {
        let mut parts = Vec::new();
        for m in &s.mixers {
            match m {
                MixerState::Gdn(g) => g.export(self.backend, &mut parts)?,
                MixerState::Attn(kv) => state::export_kv(self.backend, kv, &mut parts)?,
            }
        }
        Ok(SessionData { pos: s.pos, parts })
    }
    fn import_session(&self, d: &SessionData) -> Result<Session<B>, RunError> {
        let mut s = self.session();
        if d.parts.is_empty() && d.pos == 0 {
            return Ok(s);
        }
        self.init_session(&mut s)?;
        let (b, c) = (self.backend, &self.cfg);
        let geometry = (
            AttentionSpec::dense(c.kv_heads, c.head_dim),
            c.max_positions,
        );
        let mut r = d.reader();
        for m in &mut s.mixers {
            match m {
                MixerState::Gdn(g) => *g = GdnState::import(b, &c.gdn, &mut r)?,
                MixerState::Attn(kv) => state::import_kv(b, kv, geometry, &mut r, d.pos)?,
            }
        }
        r.finish()?;
        s.pos = d.pos;
        Ok(s)
    }
    fn session_bytes(&self, s: &Session<B>) -> u64 {
        let b = self.backend;
        s.mixers
            .iter()
            .map(|m| match m {
                MixerState::Gdn(g) => b.buf_bytes(&g.conv) + b.buf_bytes(&g.recurrent),
                MixerState::Attn(kv) => b.kv_bytes(kv),
            })
            .sum()
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
        let state = self.state_bytes(positions);
        vec![Stat {
            text: format!(
                "KV cache + GDN state {:.1} KiB at {positions} positions",
                state as f64 / 1024.0
            ),
            key: "state_bytes",
            value: serde_json::json!(state),
        }]
    }
}
