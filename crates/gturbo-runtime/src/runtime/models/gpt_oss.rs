//! gpt-oss (`GptOssForCausalLM`, transformers 5.24's `modeling_gpt_oss.py`): the
//! decoder's numbers (`decoder::Config`) and its shared layers, with what gpt-oss adds:
//!
//! - **Attention**: q, k, v and o with biases; a learned logit per query head
//!   (`self_attn.sinks`) joins each softmax's denominator (`Backend::attention`'s
//!   `sinks`); `layer_types` alternates `sliding_attention` (a window of
//!   `sliding_window` positions, 128 in the real model) and `full_attention`
//!   (transformers' default when the config omits it: sliding on even layers).
//! - **RoPE**: YaRN with `truncate: false`, rotate-half over the whole head; its
//!   attention factor multiplies cos and sin, so q·k carries it squared.
//! - **Router**: `router(x) = W·x + b`, the top-k of the logits, a softmax over those
//!   k (`Order::TopKThenSoftmax`, the logit bias through `RouterBias::logits`).
//! - **Experts**: a bias on every projection and the clamped SwiGLU
//!   (`ElementwiseOps::clamped_swiglu`, α = `swiglu_alpha`, `swiglu_limit`); composed
//!   from the ops over the expert pool's matrices (`Backend::expert_weights`), so a
//!   pool at any scheme the backend multiplies (BF16, INT4, MXFP4) runs unchanged. The
//!   biases are resident under their source names, `gate_up_proj_bias` `[E, 2I]`
//!   interleaved (even columns gate, odd up: `GptOssExperts._apply_gate`) and
//!   `down_proj_bias` `[E, H]`, split per expert at load.

use super::decoder::{Config, Variant, check_input, expert_pool, layer_vec};
use crate::runtime::error::RunError;
use crate::runtime::generate::LanguageModel;
use crate::runtime::kernels::ops::ClampedGlu;
use crate::runtime::kernels::routing::{Order, RouterBias};
use crate::runtime::kernels::{AttentionSpec, Backend, Causal, NormGain, Ops};
use crate::runtime::layers::axes::{Axes, axis_err};
use crate::runtime::layers::head::OutputHead;
use crate::runtime::layers::linear::Linear;
use crate::runtime::layers::moe::{MoeStack, RoutedExperts, RouterSpec, expert_slots};
use crate::runtime::load::Install;

/// gpt-oss's names in the decoder's config reader: the router is `mlp.router`.
pub const GPT_OSS: Variant = Variant {
    router: "mlp.router.weight",
    renormalize: Some(false),
    sigmoid: None,
};

/// transformers' `GptOssConfig.swiglu_alpha` default.
const SWIGLU_ALPHA: f64 = 1.702;
/// transformers' `GptOssConfig.swiglu_limit` default.
const SWIGLU_LIMIT: f64 = 7.0;
/// A `layer_types` entry for a windowed layer (the other kind is `full_attention`).
const SLIDING: &str = "sliding_attention";

/// gpt-oss's numbers: the decoder's, each layer's window, and the experts' activation.
#[derive(Debug, Clone, PartialEq)]
pub struct GptOssConfig {
    /// Widths, heads, RoPE, the routed experts (routing top-k then softmax).
    pub base: Config,
    /// Layer `l`'s window (`sliding_window` on its sliding layers), `None` for full
    /// attention.
    pub windows: Vec<Option<usize>>,
    /// The clamped SwiGLU's constants.
    pub glu: ClampedGlu,
}

impl GptOssConfig {
    /// Read and check the install's axes.
    pub fn of(m: &crate::format::manifest::Manifest) -> Result<GptOssConfig, RunError> {
        let mut base = Config::of(m, &GPT_OSS)?;
        let Some(stack) = base.moe.as_mut() else {
            return Err(axis_err(m, "num_experts", "gpt-oss needs routed experts"));
        };
        stack.routing.order = Order::TopKThenSoftmax;
        let a = Axes::new(m, 1 << 32, "missing");
        let window = base.window.take();
        let windows = match a.value("layer_types").filter(|v| !v.is_null()) {
            Some(v) => {
                let kinds = v
                    .as_array()
                    .ok_or_else(|| a.err("layer_types", "not a list"))?;
                if kinds.len() != base.layers {
                    return Err(a.err(
                        "layer_types",
                        &format!("{} entries for {} layers", kinds.len(), base.layers),
                    ));
                }
                kinds
                    .iter()
                    .map(|k| (k.as_str() == Some(SLIDING)).then_some(window).flatten())
                    .collect()
            }
            // transformers' default: sliding on even layers.
            None => (0..base.layers)
                .map(|l| (l % 2 == 0).then_some(window).flatten())
                .collect(),
        };
        let real = |axis: &str, default: f64| -> Result<f32, RunError> {
            let v = a.opt_f64(axis)?.unwrap_or(default);
            if v.is_finite() && v > 0.0 && v <= f32::MAX as f64 {
                Ok(v as f32)
            } else {
                Err(a.err(axis, "must be a positive number"))
            }
        };
        let glu = ClampedGlu {
            alpha: real("swiglu_alpha", SWIGLU_ALPHA)?,
            limit: real("swiglu_limit", SWIGLU_LIMIT)?,
        };
        Ok(GptOssConfig { base, windows, glu })
    }

    fn moe(&self) -> &MoeStack {
        // `of` refuses a config without experts.
        self.base.moe.as_ref().expect("gpt-oss has routed experts")
    }
}

/// One expert's biases: gate `[I]`, up `[I]`, down `[H]`.
struct ExpertBias<B: Backend> {
    gate: B::Buf,
    up: B::Buf,
    down: B::Buf,
}

struct Layer<'a, B: Backend> {
    input_norm: B::Buf,
    post_norm: B::Buf,
    q: Linear<'a, B>,
    k: Linear<'a, B>,
    v: Linear<'a, B>,
    o: Linear<'a, B>,
    sinks: B::Buf,
    router: B::Weights<'a>,
    router_bias: Vec<f32>,
    experts: Vec<ExpertBias<B>>,
}

/// A loaded gpt-oss over an install's mapped weights, computing on `B`.
pub struct GptOss<'a, B: Backend> {
    /// Architecture numbers.
    pub cfg: GptOssConfig,
    install: &'a Install,
    backend: &'a B,
    embed: B::Weights<'a>,
    head: B::Weights<'a>,
    final_norm: B::Buf,
    layers: Vec<Layer<'a, B>>,
    rope: B::Rope,
    slots: B::Slots,
}

/// Per-sequence state: each layer's KV cache (a window's ring on the sliding layers).
pub struct Session<B: Backend> {
    kv: Vec<B::Kv>,
    /// Tokens already in the caches.
    pub pos: usize,
}

/// Binds tensors of one install on one backend.
struct Bind<'a, 'b, B: Backend> {
    install: &'a Install,
    b: &'b B,
}

impl<'a, B: Backend> Bind<'a, '_, B> {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<B::Weights<'a>, RunError> {
        Ok(self.b.weights(self.install.matrix(name, rows, cols)?)?)
    }

    fn vector(&self, name: &str, len: usize) -> Result<B::Buf, RunError> {
        Ok(self.b.upload(&self.install.vector(name, len)?)?)
    }

    fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Linear<'a, B>, RunError> {
        Ok(Linear {
            w: self.matrix(&format!("{name}.weight"), rows, cols)?,
            bias: Some(self.vector(&format!("{name}.bias"), rows)?),
        })
    }

    /// Every expert's biases of the layer under `p` (`gate_up_proj_bias`
    /// de-interleaved: even columns gate, odd up).
    fn expert_biases(
        &self,
        p: &str,
        e: usize,
        i: usize,
        h: usize,
    ) -> Result<Vec<ExpertBias<B>>, RunError> {
        let gu = self
            .install
            .floats(&format!("{p}mlp.experts.gate_up_proj_bias"), &[e, 2 * i])?;
        let down = self
            .install
            .floats(&format!("{p}mlp.experts.down_proj_bias"), &[e, h])?;
        (0..e)
            .map(|x| {
                let row = &gu[x * 2 * i..(x + 1) * 2 * i];
                let gate: Vec<f32> = row.iter().step_by(2).copied().collect();
                let up: Vec<f32> = row.iter().skip(1).step_by(2).copied().collect();
                Ok(ExpertBias {
                    gate: self.b.upload(&gate)?,
                    up: self.b.upload(&up)?,
                    down: self.b.upload(&down[x * h..(x + 1) * h])?,
                })
            })
            .collect()
    }

    fn layer(&self, cfg: &GptOssConfig, l: usize) -> Result<Layer<'a, B>, RunError> {
        let c = &cfg.base;
        let (h, hd) = (c.hidden, c.head_dim);
        let moe = &cfg.moe().moe;
        let p = format!("model.layers.{l}.");
        let attn = |n: &str| format!("{p}self_attn.{n}");
        Ok(Layer {
            input_norm: self.vector(&format!("{p}input_layernorm.weight"), h)?,
            post_norm: self.vector(&format!("{p}post_attention_layernorm.weight"), h)?,
            q: self.linear(&attn("q_proj"), c.heads * hd, h)?,
            k: self.linear(&attn("k_proj"), c.kv_heads * hd, h)?,
            v: self.linear(&attn("v_proj"), c.kv_heads * hd, h)?,
            o: self.linear(&attn("o_proj"), h, c.heads * hd)?,
            sinks: self.vector(&attn("sinks"), c.heads)?,
            router: self.matrix(&format!("{p}{}", GPT_OSS.router), moe.experts, h)?,
            router_bias: self
                .install
                .vector(&format!("{p}mlp.router.bias"), moe.experts)?,
            experts: self.expert_biases(&p, moe.experts, moe.intermediate, h)?,
        })
    }
}

impl<'a, B: Ops> GptOss<'a, B> {
    /// Bind the install's tensors on `backend`.
    pub fn new(install: &'a Install, backend: &'a B) -> Result<GptOss<'a, B>, RunError> {
        let cfg = GptOssConfig::of(&install.manifest)?;
        let c = &cfg.base;
        let bind = Bind {
            install,
            b: backend,
        };
        let mut layers = layer_vec(install, c)?;
        let mut pools = Vec::new();
        for l in 0..c.layers {
            pools.push(expert_pool(install, &cfg.moe().moe, c.hidden, l)?);
            layers.push(bind.layer(&cfg, l)?);
        }
        let slots = expert_slots(backend, &install.experts, &pools, c.layers)?;
        let inv_freq = c.rope.inv_freq(0);
        Ok(GptOss {
            embed: bind.matrix("model.embed_tokens.weight", c.vocab, c.hidden)?,
            head: bind.matrix("lm_head.weight", c.vocab, c.hidden)?,
            final_norm: bind.vector("model.norm.weight", c.hidden)?,
            rope: backend.rope_table(&inv_freq, 0..c.max_positions, c.rope.layout)?,
            slots,
            layers,
            cfg,
            install,
            backend,
        })
    }

    /// An empty session; its caches are made by the first forward pass.
    pub fn session(&self) -> Session<B> {
        Session {
            kv: Vec::new(),
            pos: 0,
        }
    }

    /// Run `tokens` after the session's cache: the logits of every position when
    /// `all`, else of the last one.
    pub fn forward(
        &self,
        s: &mut Session<B>,
        tokens: &[u32],
        all: bool,
    ) -> Result<Vec<f32>, RunError> {
        let c = &self.cfg.base;
        let b = self.backend;
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        check_input(c, s.pos, tokens)?;
        self.ensure_caches(s)?;
        let (h, hd) = (c.hidden, c.head_dim);
        let (qw, kvw) = (c.heads * hd, c.kv_heads * hd);
        let mut x = b.zeros(n * h)?;
        b.embed(&self.embed, tokens, &mut x)?;
        let mut xn = b.zeros(n * h)?;
        let (mut q, mut k, mut v) = (b.zeros(n * qw)?, b.zeros(n * kvw)?, b.zeros(n * kvw)?);
        let mut att = b.zeros(n * qw)?;
        let mut out = b.zeros(n * h)?;
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
            b.rope(&self.rope, &mut q, c.heads, hd, s.pos)?;
            b.rope(&self.rope, &mut k, c.kv_heads, hd, s.pos)?;
            b.attention(&mut s.kv[l], &q, &k, &v, at, Some(&layer.sinks), &mut att)?;
            layer.o.forward(b, &att, &mut out)?;
            b.add(&mut x, &out)?;
            b.rms_norm(&x, &layer.post_norm, c.eps, NormGain::Weight, &mut xn)?;
            self.experts(l, layer, &xn, &mut out)?;
            b.add(&mut x, &out)?;
        }
        s.pos += n;
        let head = OutputHead {
            norm: &self.final_norm,
            eps: c.eps,
            gain: NormGain::Weight,
            head: &self.head,
            hidden: h,
            vocab: c.vocab,
        };
        head.logits(b, x, n, all)
    }

    /// Layer `l`'s routed experts over the normed rows `xn` into `out`: each chosen
    /// expert over its tokens, `down(glu(gate·x + b_g, up·x + b_u)) + b_d`, weighted and
    /// added in ascending expert id (transformers' `index_add_` per expert).
    fn experts(
        &self,
        l: usize,
        layer: &Layer<'a, B>,
        xn: &B::Buf,
        out: &mut B::Buf,
    ) -> Result<(), RunError> {
        let (b, c) = (self.backend, &self.cfg.base);
        let stack = self.cfg.moe();
        let (h, inter) = (c.hidden, stack.moe.intermediate);
        let experts = RoutedExperts {
            b,
            store: &self.install.experts,
            slots: &self.slots,
            layer: l,
        };
        let spec = RouterSpec {
            experts: stack.moe.experts,
            routing: stack.routing,
            bias: RouterBias {
                logits: Some(&layer.router_bias),
                selection: None,
            },
        };
        experts.routed(&layer.router, spec, xn, out, |expert, e, routes, out| {
            let [gate, up, down] = b.expert_weights(expert);
            let bias = &layer.experts[e];
            let m = routes.len();
            let rows: Vec<usize> = routes.iter().map(|r| r.0).collect();
            let mut xs = b.zeros(m * h)?;
            b.gather_rows(xn, h, &rows, &mut xs)?;
            let (mut g, mut u) = (b.zeros(m * inter)?, b.zeros(m * inter)?);
            b.linear(gate, &xs, &mut g)?;
            b.add_bias(&mut g, &bias.gate)?;
            b.linear(up, &xs, &mut u)?;
            b.add_bias(&mut u, &bias.up)?;
            b.clamped_swiglu(&mut g, &u, self.cfg.glu)?;
            b.linear(down, &g, &mut xs)?;
            b.add_bias(&mut xs, &bias.down)?;
            b.scatter_add_rows(&xs, h, routes, out)?;
            Ok(())
        })?;
        Ok(())
    }

    /// The session's KV caches, made by its first forward pass: a sliding layer's
    /// holds its window.
    fn ensure_caches(&self, s: &mut Session<B>) -> Result<(), RunError> {
        let c = &self.cfg.base;
        if s.kv.len() != c.layers {
            s.kv = self
                .cfg
                .windows
                .iter()
                .map(|&window| {
                    let spec = AttentionSpec {
                        window,
                        ..AttentionSpec::dense(c.kv_heads, c.head_dim)
                    };
                    self.backend.kv_cache(spec, c.max_positions)
                })
                .collect::<Result<_, _>>()?;
        }
        Ok(())
    }
}

impl<B: Ops> LanguageModel for GptOss<'_, B> {
    type Session = Session<B>;
    fn new_session(&self) -> Session<B> {
        self.session()
    }
    fn run(&self, s: &mut Session<B>, tokens: &[u32], all: bool) -> Result<Vec<f32>, RunError> {
        self.forward(s, tokens, all)
    }
    fn copy_session(&self, s: &Session<B>) -> Result<Session<B>, RunError> {
        let kv =
            s.kv.iter()
                .map(|kv| self.backend.copy_kv(kv))
                .collect::<Result<Vec<_>, _>>()?;
        Ok(Session { kv, pos: s.pos })
    }
    fn session_bytes(&self, s: &Session<B>) -> u64 {
        s.kv.iter().map(|kv| self.backend.kv_bytes(kv)).sum()
    }
    fn vocab(&self) -> usize {
        self.cfg.base.vocab
    }
    fn backend_name(&self) -> String {
        self.backend.name().to_string()
    }
    fn device_memory_bytes(&self) -> Option<u64> {
        self.backend.device_memory_bytes()
    }
}
