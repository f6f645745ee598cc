//! The decoder runner: one transformer decoder parametrised by the install's axes,
//! covering `llama` (tied head), `qwen3` (QK-norm) and `qwen3_moe` (routed experts),
//! and through their [`Variant`]s Mixtral and GLM-4.5 (q/k/v biases, partial rotary,
//! sigmoid routing with dense first layers and a shared expert).
//!
//! Numerics follow mlx-lm's models with f32 activations: RMSNorm
//! `x · rsqrt(mean(x²) + ε) · w`; RoPE in the rotate-half (Hugging Face) layout,
//! `inv_freq_i = θ^(-2i/d)`; softmax attention scaled by `1/√head_dim`; SwiGLU
//! `down(silu(gate x) · up x)`; MoE routing `softmax(router x)` over all experts,
//! top-k, optionally renormalised to sum 1 (`norm_topk_prob`).
//!
//! The runner is written once against [`Backend`]: weights, norms, activations and the
//! KV cache are the backend's tensors, and each step is one of its operations, so the
//! same code runs on the CPU and on a device. The host keeps what only it can do: the
//! input checks, the expert store (blobs pinned in the slot cache while an expert
//! runs) and the logits handed back for sampling.

use crate::format::manifest::{self, Manifest};
use crate::format::pools::ExpertPool;
use crate::runtime::error::{InputError, RunError};
use crate::runtime::gate::{QK_NORM, ROUTED_MOE};
use crate::runtime::generate::LanguageModel;
use crate::runtime::kernels::{AttentionSpec, Backend, Causal, NormGain, Ops};
use crate::runtime::layers::axes::{Axes, axis_err};
use crate::runtime::layers::head::OutputHead;
use crate::runtime::layers::linear::Linear;
use crate::runtime::layers::mlp::{SharedExpert, SwiGlu};
pub use crate::runtime::layers::moe::MoeConfig;
use crate::runtime::layers::moe::{
    Ffn, MoeBlock, MoeStack, RoutedExperts, SigmoidDefaults, expert_slots,
};
use crate::runtime::layers::rope::{RopeSpec, Scaling};
use crate::runtime::load::Install;
use crate::runtime::models::state::{self, SessionData};

/// What differs between the families the decoder runs beyond their axes: names and
/// routing rules that are not in the config.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Variant {
    /// The router's tensor under `model.layers.{l}.`.
    pub router: &'static str,
    /// Renormalise the chosen experts' probabilities whatever the config says, or
    /// (`None`) as its `norm_topk_prob` says.
    pub renormalize: Option<bool>,
    /// DeepSeek-style routing (sigmoid scores chosen with `e_score_correction_bias`,
    /// dense first layers, a shared expert) with these defaults for what the config
    /// omits, or (`None`) softmax top-k.
    pub sigmoid: Option<&'static SigmoidDefaults>,
}

/// llama, qwen3 and qwen3_moe.
pub const QWEN: Variant = Variant {
    router: "mlp.gate.weight",
    renormalize: None,
    sigmoid: None,
};

/// Architecture numbers read from the manifest's `arch.axes`.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Model width.
    pub hidden: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Dense MLP width (0 for MoE models without dense layers).
    pub intermediate: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Per-head RMSNorm of q and k (the `qkNorm` axis, or GLM's `use_qk_norm`).
    pub qk_norm: bool,
    /// Biases on the q, k and v projections (GLM's `attention_bias`).
    pub qkv_bias: bool,
    /// Routed experts, when the install has them.
    pub moe: Option<MoeStack>,
    /// Longest sequence (prompt + generated): `max_position_embeddings`, or for
    /// dynamic NTK RoPE that times its factor ([`context_length`]).
    pub max_positions: usize,
    /// Sliding window of every layer's attention (`sliding_window`), when shorter than
    /// the context.
    pub window: Option<usize>,
    /// Rotary embeddings as the config describes them (`layers::rope`): partial rotary
    /// dims and RoPE scaling (linear, YaRN, llama3).
    pub rope: RopeSpec,
}

/// The decoder runner reads integer axes below 2^32.
const AXIS_BELOW: u64 = 1 << 32;

impl Config {
    /// Read the decoder's numbers from the manifest. Defaults follow the Hugging Face
    /// configs: `head_dim = hidden / heads`, `norm_topk_prob = false`,
    /// `rms_norm_eps = 1e-6`, `rope_theta = 10000`.
    pub fn from_manifest(m: &Manifest) -> Result<Config, RunError> {
        Config::of(m, &QWEN)
    }

    /// [`Config::from_manifest`] for `variant`.
    pub fn of(m: &Manifest, variant: &Variant) -> Result<Config, RunError> {
        let a = Axes::new(m, AXIS_BELOW, "missing");
        // The install's own rules first (the planner checked the config with them).
        crate::format::axes::check(&m.arch.axes).map_err(|e| a.err(&e.axis, &e.detail))?;
        let trained = a.opt_usize("max_position_embeddings")?.unwrap_or(1 << 16);
        let hidden = a.usize("hidden_size")?;
        let heads = a.usize("num_attention_heads")?;
        let kv_heads = a.opt_usize("num_key_value_heads")?.unwrap_or(heads);
        if heads % kv_heads != 0 {
            return Err(a.err(
                "num_key_value_heads",
                &format!("{kv_heads} does not divide num_attention_heads {heads}"),
            ));
        }
        let head_dim = a.opt_usize("head_dim")?.unwrap_or(hidden / heads);
        if head_dim % 2 != 0 || head_dim == 0 {
            return Err(a.err("head_dim", "RoPE needs an even head width"));
        }
        let rope = decoder_rope(m, head_dim)?;
        let max_positions = context_length(&rope, trained);
        // Mistral and Mixtral slide every layer's window (`sliding_window`, null for
        // none); a window as long as the context changes nothing.
        let window = match a.opt_usize("sliding_window")? {
            Some(0) => {
                return Err(a.err("sliding_window", "0: a window sees at least one position"));
            }
            Some(w) if w < max_positions => Some(w),
            _ => None,
        };
        let layers = a.usize("num_layers")?;
        let moe = match (
            m.arch.required_axes.iter().any(|a| a == ROUTED_MOE),
            variant.sigmoid,
        ) {
            (false, _) => None,
            (true, Some(d)) => Some(MoeStack::sigmoid(&a, layers, d)?),
            (true, None) => Some(MoeStack::softmax(MoeConfig {
                experts: a.usize("num_experts")?,
                top_k: a.usize("num_experts_per_tok")?,
                intermediate: a.usize("moe_intermediate_size")?,
                norm_topk_prob: match variant.renormalize {
                    Some(r) => r,
                    None => a.opt_bool("norm_topk_prob")?.unwrap_or(false),
                },
            })),
        };
        if let Some(s) = &moe
            && s.moe.top_k > s.moe.experts
        {
            return Err(a.err("num_experts_per_tok", "more than num_experts"));
        }
        Ok(Config {
            hidden,
            layers,
            heads,
            kv_heads,
            head_dim,
            intermediate: match &moe {
                Some(s) if s.dense_layers == 0 => 0,
                _ => a.usize("intermediate_size")?,
            },
            vocab: a.usize("vocab_size")?,
            rope_theta: a.opt_f64("rope_theta")?.unwrap_or(10_000.0),
            eps: a.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            qk_norm: m.arch.required_axes.iter().any(|a| a == QK_NORM)
                || a.opt_bool("use_qk_norm")?.unwrap_or(false),
            qkv_bias: a.opt_bool("attention_bias")?.unwrap_or(false),
            moe,
            max_positions,
            window,
            rope,
        })
    }
}

/// The RoPE the decoder can run. YaRN's attention factor scales q and k alike, so
/// with every dim rotating it is a factor² on the softmax scale.
fn decoder_rope(m: &Manifest, head_dim: usize) -> Result<RopeSpec, RunError> {
    let rope = RopeSpec::from_manifest(m, head_dim)?;
    let refuse = |why: &str| Err(axis_err(m, "rope_scaling", why));
    if rope.attention_scaling() != 1.0 && rope.rotary_dim != head_dim {
        return refuse("YaRN's attention factor with partial rotary dims is not implemented");
    }
    Ok(rope)
}

/// How long a sequence the model runs. Dynamic NTK scaling exists to run past the
/// pretraining context (`max_position_embeddings`) and has no end of its own; the
/// config's factor says how far it was meant to stretch, so the decoder runs to
/// `factor × max_position_embeddings` and refuses longer sequences as it refuses
/// them past `max_position_embeddings` for every other scaling.
pub fn context_length(rope: &RopeSpec, trained: usize) -> usize {
    match rope.scaling {
        Scaling::Dynamic { factor, .. } if factor > 1.0 => {
            // `factor` is a checked positive real below the axis bound; the product
            // saturates rather than overflows.
            (trained as f64 * factor).min(usize::MAX as f64) as usize
        }
        _ => trained,
    }
}

struct Layer<'a, B: Backend> {
    input_norm: B::Buf,
    post_norm: B::Buf,
    q: Linear<'a, B>,
    k: Linear<'a, B>,
    v: Linear<'a, B>,
    o: B::Weights<'a>,
    q_norm: Option<B::Buf>,
    k_norm: Option<B::Buf>,
    mlp: Ffn<'a, B>,
}

/// A loaded decoder over an install's mapped weights, computing on `B`.
pub struct Model<'a, B: Backend> {
    /// Architecture numbers.
    pub cfg: Config,
    install: &'a Install,
    backend: &'a B,
    embed: B::Weights<'a>,
    /// `None` when the head is tied to the embedding (no second upload).
    head: Option<B::Weights<'a>>,
    final_norm: B::Buf,
    layers: Vec<Layer<'a, B>>,
    rope: B::Rope,
    slots: B::Slots,
}

/// Per-sequence state: the KV cache of every layer.
pub struct Session<B: Backend> {
    kv: Vec<B::Kv>,
    /// Tokens already in the cache.
    pub pos: usize,
}

/// The install and the backend its tensors are bound on.
struct Bind<'a, 'b, B: Backend> {
    install: &'a Install,
    b: &'b B,
    variant: &'b Variant,
}

impl<'a, B: Backend> Bind<'a, '_, B> {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<B::Weights<'a>, RunError> {
        Ok(self.b.weights(self.install.matrix(name, rows, cols)?)?)
    }

    fn vector(&self, name: &str, len: usize) -> Result<B::Buf, RunError> {
        Ok(self.b.upload(&self.install.vector(name, len)?)?)
    }

    /// Layer `l`'s weights; its expert pool (checked against the config) goes to
    /// `pools`.
    fn layer(
        &self,
        cfg: &Config,
        l: usize,
        pools: &mut Vec<&'a ExpertPool>,
    ) -> Result<Layer<'a, B>, RunError> {
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let p = format!("model.layers.{l}.");
        let t = |n: &str| format!("{p}{n}");
        let swiglu = |part: &str, i: usize| SwiGlu::bind(self.install, self.b, &t(part), i, h);
        let mlp = match &cfg.moe {
            Some(s) if l >= s.dense_layers => {
                let e = s.moe.experts;
                pools.push(expert_pool(self.install, &s.moe, h, l)?);
                Ffn::Moe(MoeBlock {
                    router: self.matrix(&t(self.variant.router), e, h)?,
                    bias: s
                        .routing
                        .selection_bias
                        .then(|| {
                            self.install
                                .vector(&t("mlp.gate.e_score_correction_bias"), e)
                        })
                        .transpose()?,
                    shared: (s.shared_intermediate > 0)
                        .then(|| {
                            Ok::<_, RunError>(SharedExpert {
                                mlp: swiglu("mlp.shared_experts", s.shared_intermediate)?,
                                gate: None,
                            })
                        })
                        .transpose()?,
                })
            }
            _ => Ffn::Dense(swiglu("mlp", cfg.intermediate)?),
        };
        let proj = |name: &str, rows: usize| -> Result<Linear<'a, B>, RunError> {
            Ok(Linear {
                w: self.matrix(&t(&format!("self_attn.{name}.weight")), rows, h)?,
                bias: cfg
                    .qkv_bias
                    .then(|| self.vector(&t(&format!("self_attn.{name}.bias")), rows))
                    .transpose()?,
            })
        };
        Ok(Layer {
            input_norm: self.vector(&t("input_layernorm.weight"), h)?,
            post_norm: self.vector(&t("post_attention_layernorm.weight"), h)?,
            q: proj("q_proj", cfg.heads * hd)?,
            k: proj("k_proj", cfg.kv_heads * hd)?,
            v: proj("v_proj", cfg.kv_heads * hd)?,
            o: self.matrix(&t("self_attn.o_proj.weight"), h, cfg.heads * hd)?,
            q_norm: cfg
                .qk_norm
                .then(|| self.vector(&t("self_attn.q_norm.weight"), hd))
                .transpose()?,
            k_norm: cfg
                .qk_norm
                .then(|| self.vector(&t("self_attn.k_norm.weight"), hd))
                .transpose()?,
            mlp,
        })
    }
}

/// Layer `l`'s expert pool, checked against the config's count and shapes.
pub(crate) fn expert_pool<'a>(
    install: &'a Install,
    moe: &MoeConfig,
    h: usize,
    l: usize,
) -> Result<&'a ExpertPool, RunError> {
    let pool = install.experts.pool(l).ok_or_else(|| {
        RunError::invalid(manifest::FILE_NAME, format!("no expert pool for layer {l}"))
    })?;
    let i = moe.intermediate as u64;
    let want = [(i, h as u64), (i, h as u64), (h as u64, i)];
    let got: Vec<(u64, u64)> = pool.parts.iter().map(|b| (b.rows, b.cols)).collect();
    if pool.experts != moe.experts as u64 || got != want {
        return Err(RunError::invalid(
            &pool.file,
            format!(
                "{} experts of shapes {got:?}, the config implies {} of {want:?}",
                pool.experts, moe.experts
            ),
        ));
    }
    Ok(pool)
}

/// The input a forward pass of `cfg`'s model refuses after `pos` tokens: a sequence
/// past `max_position_embeddings` or a token id outside the vocabulary.
pub(crate) fn check_input(c: &Config, pos: usize, tokens: &[u32]) -> Result<(), RunError> {
    if pos + tokens.len() > c.max_positions {
        return Err(InputError::SequenceTooLong {
            tokens: pos + tokens.len(),
            max: c.max_positions,
        }
        .into());
    }
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= c.vocab) {
        return Err(InputError::TokenOutsideVocabulary {
            token: t,
            vocab: c.vocab,
        }
        .into());
    }
    Ok(())
}

/// The `num_layers` axis against the tensors present (a layer past the last is a
/// manifest that lies about its depth), and room for that many layers.
pub(crate) fn layer_vec<T>(install: &Install, cfg: &Config) -> Result<Vec<T>, RunError> {
    if install.has(&format!(
        "model.layers.{}.input_layernorm.weight",
        cfg.layers
    )) {
        return Err(axis_err(
            &install.manifest,
            "num_layers",
            &format!(
                "{}, but the install holds tensors of layer {}",
                cfg.layers, cfg.layers
            ),
        ));
    }
    let mut layers = Vec::new();
    layers.try_reserve_exact(cfg.layers).map_err(|_| {
        axis_err(
            &install.manifest,
            "num_layers",
            &format!("{} layers do not fit in memory", cfg.layers),
        )
    })?;
    Ok(layers)
}

impl<'a, B: Ops> Model<'a, B> {
    /// Bind the install's tensors (no weight bytes are read here beyond norms; a
    /// device backend uploads them).
    pub fn new(install: &'a Install, backend: &'a B) -> Result<Model<'a, B>, RunError> {
        Model::with(install, backend, &QWEN)
    }

    /// Bind the install's tensors for `variant`'s names and routing.
    pub fn with(
        install: &'a Install,
        backend: &'a B,
        variant: &Variant,
    ) -> Result<Model<'a, B>, RunError> {
        let cfg = Config::of(&install.manifest, variant)?;
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let b = backend;
        let bind = Bind {
            install,
            b,
            variant,
        };
        let embed = bind.matrix("model.embed_tokens.weight", cfg.vocab, h)?;
        // A checkpoint without `lm_head.weight` ties the head to the embedding.
        let head = if install.has("lm_head.weight") {
            Some(bind.matrix("lm_head.weight", cfg.vocab, h)?)
        } else {
            None
        };
        let mut layers = layer_vec(install, &cfg)?;
        let mut pools = Vec::new();
        for l in 0..cfg.layers {
            layers.push(bind.layer(&cfg, l, &mut pools)?);
        }
        let inv_freq: Vec<f32> = match cfg.rope.scaling {
            // Plain RoPE over the whole head keeps the f64 formula the goldens were made
            // against (`RopeSpec::inv_freq` follows torch's f32 steps: 1 ulp apart).
            Scaling::None if cfg.rope.rotary_dim == hd => (0..hd / 2)
                .map(|i| (1.0 / cfg.rope_theta.powf(2.0 * i as f64 / hd as f64)) as f32)
                .collect(),
            // Dynamic NTK's frequencies up to its pretraining context (`call_rope`
            // makes the later ones); the other scalings do not depend on the length.
            _ => cfg.rope.inv_freq(0),
        };
        let expert_slots = expert_slots(b, &install.experts, &pools, cfg.layers)?;
        Ok(Model {
            final_norm: bind.vector("model.norm.weight", h)?,
            rope: b.rope_table(&inv_freq, 0..cfg.max_positions, cfg.rope.layout)?,
            slots: expert_slots,
            cfg,
            install,
            backend,
            embed,
            head,
            layers,
        })
    }

    /// An empty session; its KV caches are made by the first forward pass (which can
    /// report a device's allocation failure).
    pub fn session(&self) -> Session<B> {
        Session {
            kv: Vec::new(),
            pos: 0,
        }
    }

    /// The backend the model computes on.
    pub fn backend(&self) -> &'a B {
        self.backend
    }

    /// A copy of `s` that continues independently (its KV caches copied on the
    /// backend).
    pub fn copy_session(&self, s: &Session<B>) -> Result<Session<B>, RunError> {
        let kv =
            s.kv.iter()
                .map(|kv| self.backend.copy_kv(kv))
                .collect::<Result<Vec<_>, _>>()?;
        Ok(Session { kv, pos: s.pos })
    }

    /// Run `tokens` (appended after the session's cache) through the model. Returns
    /// the logits of every position (`tokens.len() × vocab`) when `all` is true, else
    /// those of the last position only.
    pub fn forward(
        &self,
        s: &mut Session<B>,
        tokens: &[u32],
        all: bool,
    ) -> Result<Vec<f32>, RunError> {
        let c = &self.cfg;
        let b = self.backend;
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        self.check_input(s, tokens)?;
        self.ensure_caches(s)?;
        let (h, hd) = (c.hidden, c.head_dim);
        let (qw, kvw) = (c.heads * hd, c.kv_heads * hd);
        let mut x = b.zeros(n * h)?;
        b.embed(&self.embed, tokens, &mut x)?;
        let mut xn = b.zeros(n * h)?;
        let mut q = b.zeros(n * qw)?;
        let mut k = b.zeros(n * kvw)?;
        let mut v = b.zeros(n * kvw)?;
        // QK-norm writes into these, then they trade places with q and k.
        let (mut qn, mut kn) = if c.qk_norm {
            (b.zeros(n * qw)?, b.zeros(n * kvw)?)
        } else {
            (b.zeros(0)?, b.zeros(0)?)
        };
        let mut att = b.zeros(n * qw)?;
        let mut out = b.zeros(n * h)?;
        let call_rope = self.call_rope(s.pos, n)?;
        let rope = call_rope.as_ref().unwrap_or(&self.rope);
        let at = Causal {
            pos: s.pos,
            heads: c.heads,
            scale: c.rope.attention_scaling().powi(2) / (hd as f32).sqrt(),
        };
        for (l, layer) in self.layers.iter().enumerate() {
            b.rms_norm(&x, &layer.input_norm, c.eps, NormGain::Weight, &mut xn)?;
            layer.q.forward(b, &xn, &mut q)?;
            layer.k.forward(b, &xn, &mut k)?;
            layer.v.forward(b, &xn, &mut v)?;
            if let (Some(qnw), Some(knw)) = (&layer.q_norm, &layer.k_norm) {
                b.rms_norm(&q, qnw, c.eps, NormGain::Weight, &mut qn)?;
                b.rms_norm(&k, knw, c.eps, NormGain::Weight, &mut kn)?;
                std::mem::swap(&mut q, &mut qn);
                std::mem::swap(&mut k, &mut kn);
            }
            b.rope(rope, &mut q, c.heads, hd, s.pos)?;
            b.rope(rope, &mut k, c.kv_heads, hd, s.pos)?;
            b.attention(&mut s.kv[l], &q, &k, &v, at, None, &mut att)?;
            b.linear(&layer.o, &att, &mut out)?;
            b.add(&mut x, &out)?;
            b.rms_norm(&x, &layer.post_norm, c.eps, NormGain::Weight, &mut xn)?;
            let experts = RoutedExperts {
                b,
                store: &self.install.experts,
                slots: &self.slots,
                layer: l,
            };
            layer
                .mlp
                .forward(&experts, c.moe.as_ref(), &xn, n, h, &mut out)?;
            b.add(&mut x, &out)?;
        }
        s.pos += n;
        let out = OutputHead {
            norm: &self.final_norm,
            eps: c.eps,
            gain: NormGain::Weight,
            head: self.head.as_ref().unwrap_or(&self.embed),
            hidden: h,
            vocab: c.vocab,
        };
        out.logits(b, x, n, all)
    }

    /// The input a forward pass refuses: a sequence past `max_position_embeddings` (the
    /// install is fine, the prompt plus what was generated is too long) or a token id
    /// outside the vocabulary.
    fn check_input(&self, s: &Session<B>, tokens: &[u32]) -> Result<(), RunError> {
        check_input(&self.cfg, s.pos, tokens)
    }

    /// The RoPE table of a call whose frequencies are not the load-time table's:
    /// with dynamic NTK scaling, a call reaching past the pretraining context rotates
    /// its new tokens by the frequencies of its own length, as transformers'
    /// `dynamic_rope_update` does (`seq_len = max(position_ids) + 1`; the cached keys
    /// keep the frequencies they were rotated with). `None`: the load-time table.
    fn call_rope(&self, pos: usize, n: usize) -> Result<Option<B::Rope>, RunError> {
        let c = &self.cfg;
        match c.rope.scaling {
            Scaling::Dynamic { original_max, .. } if pos + n > original_max => Ok(Some(
                self.backend
                    .rope_table(&c.rope.inv_freq(pos + n), pos..pos + n, c.rope.layout)?,
            )),
            _ => Ok(None),
        }
    }

    /// What every layer's KV cache holds.
    fn cache_spec(&self) -> AttentionSpec {
        let c = &self.cfg;
        AttentionSpec {
            window: c.window,
            ..AttentionSpec::dense(c.kv_heads, c.head_dim)
        }
    }

    /// The session's KV caches, made by its first forward pass.
    fn ensure_caches(&self, s: &mut Session<B>) -> Result<(), RunError> {
        let c = &self.cfg;
        if s.kv.len() != c.layers {
            let spec = self.cache_spec();
            s.kv = (0..c.layers)
                .map(|_| self.backend.kv_cache(spec, c.max_positions))
                .collect::<Result<_, _>>()?;
        }
        Ok(())
    }
}

impl<B: Ops> LanguageModel for Model<'_, B> {
    type Session = Session<B>;
    fn new_session(&self) -> Session<B> {
        self.session()
    }
    fn run(&self, s: &mut Session<B>, tokens: &[u32], all: bool) -> Result<Vec<f32>, RunError> {
        self.forward(s, tokens, all)
    }
    fn copy_session(&self, s: &Session<B>) -> Result<Session<B>, RunError> {
        self.copy_session(s)
    }
    fn session_bytes(&self, s: &Session<B>) -> u64 {
        s.kv.iter().map(|kv| self.backend.kv_bytes(kv)).sum()
    }
    fn export_session(&self, s: &Session<B>) -> Result<SessionData, RunError> {
        let mut parts = Vec::new();
        for kv in &s.kv {
            state::export_kv(self.backend, kv, &mut parts)?;
        }
        Ok(SessionData { pos: s.pos, parts })
    }
    fn import_session(&self, d: &SessionData) -> Result<Session<B>, RunError> {
        let mut s = self.session();
        if d.parts.is_empty() && d.pos == 0 {
            return Ok(s); // before the first forward pass: no caches yet
        }
        self.ensure_caches(&mut s)?;
        let geometry = (self.cache_spec(), self.cfg.max_positions);
        let mut r = d.reader();
        for kv in &mut s.kv {
            state::import_kv(self.backend, kv, geometry, &mut r, d.pos)?;
        }
        r.finish()?;
        s.pos = d.pos;
        Ok(s)
    }
    fn vocab(&self) -> usize {
        self.cfg.vocab
    }
    fn backend_name(&self) -> String {
        self.backend().name().to_string()
    }
    fn device_memory_bytes(&self) -> Option<u64> {
        self.backend().device_memory_bytes()
    }
}
