//! The WGSL sources, their parameter blocks and the kernel variants the host builds.
//!
//! A source that reduces over its workgroup is compiled with
//! `shaders/common/reduce.wgsl` (the tree max and sum) in front of it (`with_reduce!`),
//! so the reductions are written once.
//!
//! Each shader file declares one `struct Params` of 4-byte scalars, bound as the
//! uniform at `@group(0) @binding(0)`. Its host twin is declared once here with
//! [`params!`], which records the field names; the shader check in `tests.rs` reads
//! the WGSL struct with naga and fails unless names, order and offsets agree.

/// The source `file` (under `shaders/`) with the workgroup reductions in front of it.
macro_rules! with_reduce {
    ($file:literal) => {
        concat!(
            include_str!("shaders/common/reduce.wgsl"),
            "\n",
            include_str!(concat!("shaders/", $file))
        )
    };
}

/// One WGSL source file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Shader {
    Qmatvec,
    /// The 4-bit decode product against x rounded to 24 bits (`qmatvec_x24.wgsl`).
    QmatvecX24,
    Fmatvec,
    Norm,
    Rope,
    Attn,
    Softmax,
    Elementwise,
    Embed,
    /// Flash-Next's kernels.
    Flash(FlashShader),
}

impl Shader {
    #[cfg(test)]
    pub(crate) const ALL: [Shader; 15] = [
        Shader::Qmatvec,
        Shader::QmatvecX24,
        Shader::Fmatvec,
        Shader::Norm,
        Shader::Rope,
        Shader::Attn,
        Shader::Softmax,
        Shader::Elementwise,
        Shader::Embed,
        Shader::Flash(FlashShader::ALL[0]),
        Shader::Flash(FlashShader::ALL[1]),
        Shader::Flash(FlashShader::ALL[2]),
        Shader::Flash(FlashShader::ALL[3]),
        Shader::Flash(FlashShader::ALL[4]),
        Shader::Flash(FlashShader::ALL[5]),
    ];

    pub(crate) fn file(self) -> &'static str {
        match self {
            Shader::Qmatvec => "qmatvec.wgsl",
            Shader::QmatvecX24 => "qmatvec_x24.wgsl",
            Shader::Fmatvec => "fmatvec.wgsl",
            Shader::Norm => "norm.wgsl",
            Shader::Rope => "rope.wgsl",
            Shader::Attn => "attn.wgsl",
            Shader::Softmax => "softmax.wgsl",
            Shader::Elementwise => "elementwise.wgsl",
            Shader::Embed => "embed.wgsl",
            Shader::Flash(f) => f.file(),
        }
    }

    pub(crate) fn source(self) -> &'static str {
        match self {
            Shader::Qmatvec => include_str!("shaders/qmatvec.wgsl"),
            Shader::QmatvecX24 => include_str!("shaders/qmatvec_x24.wgsl"),
            Shader::Fmatvec => include_str!("shaders/fmatvec.wgsl"),
            Shader::Norm => include_str!("shaders/norm.wgsl"),
            Shader::Rope => include_str!("shaders/rope.wgsl"),
            Shader::Attn => with_reduce!("attn.wgsl"),
            Shader::Softmax => with_reduce!("softmax.wgsl"),
            Shader::Elementwise => include_str!("shaders/elementwise.wgsl"),
            Shader::Embed => include_str!("shaders/embed.wgsl"),
            Shader::Flash(f) => f.source(),
        }
    }

    /// The field names of the shader's `Params`, in order.
    #[cfg(test)]
    pub(crate) fn params_fields(self) -> &'static [&'static str] {
        match self {
            Shader::Qmatvec => QmatvecParams::FIELDS,
            Shader::QmatvecX24 => QmatvecX24Params::FIELDS,
            Shader::Fmatvec => FmatvecParams::FIELDS,
            Shader::Norm => NormParams::FIELDS,
            Shader::Rope => RopeParams::FIELDS,
            Shader::Attn => AttnParams::FIELDS,
            Shader::Softmax => SoftmaxParams::FIELDS,
            Shader::Elementwise => ElementwiseParams::FIELDS,
            Shader::Embed => EmbedParams::FIELDS,
            Shader::Flash(f) => f.params_fields(),
        }
    }
}

/// One pipeline: a shader's entry point with its `override` constants.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Kernel {
    pub(crate) shader: Shader,
    pub(crate) entry: &'static str,
    pub(crate) constants: Vec<(&'static str, f64)>,
}

/// The key a compiled pipeline is cached under.
pub(crate) type KernelKey = (Shader, &'static str, Vec<(&'static str, u64)>);

impl Kernel {
    fn new(shader: Shader, entry: &'static str) -> Kernel {
        Kernel {
            shader,
            entry,
            constants: Vec::new(),
        }
    }

    fn with(mut self, name: &'static str, v: u32) -> Kernel {
        self.constants.push((name, f64::from(v)));
        self
    }

    pub(crate) fn key(&self) -> KernelKey {
        (
            self.shader,
            self.entry,
            self.constants
                .iter()
                .map(|&(n, v)| (n, v.to_bits()))
                .collect(),
        )
    }

    /// `file:entry[NAME=v,…]`, for errors.
    pub(crate) fn label(&self) -> String {
        let mut s = format!("{}:{}", self.shader.file(), self.entry);
        if !self.constants.is_empty() {
            let c: Vec<String> = self
                .constants
                .iter()
                .map(|(n, v)| format!("{n}={v}"))
                .collect();
            s.push_str(&format!("[{}]", c.join(",")));
        }
        s
    }

    /// Quantized matrix-vector product of any width (`qmatvec`), or the tiled
    /// matrix-matrix product when `tiled`.
    pub(crate) fn qmat(bits: u32, group: u32, tiled: bool) -> Kernel {
        let entry = if tiled { "qmatmul" } else { "qmatvec" };
        Kernel::new(Shader::Qmatvec, entry)
            .with("BITS", bits)
            .with("GROUP", group)
    }

    /// The 16-byte-load matrix-vector product (`qmatvec_fast`): `lanes` invocations
    /// per set of `rps` rows; `glu` fuses SwiGLU over a gate and an up matrix.
    pub(crate) fn qmat_fast(bits: u32, group: u32, lanes: u32, rps: u32, glu: bool) -> Kernel {
        Kernel::qmat_moe(bits, group, lanes, rps, glu, 0)
    }

    /// [`Kernel::qmat_fast`] over routed experts (`moe` 1: gate/up, 2: down; see
    /// `MOE` in the shader).
    pub(crate) fn qmat_moe(
        bits: u32,
        group: u32,
        lanes: u32,
        rps: u32,
        glu: bool,
        moe: u32,
    ) -> Kernel {
        Kernel::new(Shader::Qmatvec, "qmatvec_fast")
            .with("BITS", bits)
            .with("GROUP", group)
            .with("LANES", lanes)
            .with("RPS", if glu { 2 } else { rps })
            .with("GLU", u32::from(glu))
            .with("MOE", moe)
    }

    /// The 4-bit matrix-vector product against packed 24-bit x (`qmatvec_x24`), 4
    /// rows per set of `lanes` invocations.
    pub(crate) fn qmat_x24(group: u32, lanes: u32) -> Kernel {
        Kernel::new(Shader::QmatvecX24, "qmatvec_x24")
            .with("GROUP", group)
            .with("LANES", lanes)
    }

    /// Float matrix product; `dtype` 0 f32, 1 BF16, 2 F16.
    pub(crate) fn fmat(dtype: u32, tiled: bool) -> Kernel {
        let entry = if tiled { "fmatmul" } else { "fmatvec" };
        Kernel::new(Shader::Fmatvec, entry).with("DTYPE", dtype)
    }

    /// Embedding gather; `encoding` 0 f32, 1 BF16, 2 F16, 3 affine.
    pub(crate) fn embed(encoding: u32, bits: u32, group: u32) -> Kernel {
        Kernel::new(Shader::Embed, "embed")
            .with("ENCODING", encoding)
            .with("BITS", bits)
            .with("GROUP", group)
    }

    pub(crate) fn plain(shader: Shader, entry: &'static str) -> Kernel {
        Kernel::new(shader, entry)
    }

    /// Every variant the shader check translates: what the host builds, plus the
    /// widths and groups the sources are written for but the host does not yet accept.
    #[cfg(test)]
    pub(crate) fn all_variants() -> Vec<Kernel> {
        let mut v = Vec::new();
        for bits in [2, 3, 4, 5, 6, 8] {
            for group in [32, 64, 128] {
                v.push(Kernel::qmat(bits, group, false));
                v.push(Kernel::qmat(bits, group, true));
                v.push(Kernel::embed(3, bits, group));
            }
        }
        for bits in [2, 4, 8] {
            for group in [64, 128] {
                for (lanes, rps) in [(32, 1), (16, 2), (8, 4), (64, 3), (256, 4)] {
                    v.push(Kernel::qmat_fast(bits, group, lanes, rps, false));
                }
                v.push(Kernel::qmat_fast(bits, group, 32, 2, true));
                v.push(Kernel::qmat_moe(bits, group, 32, 2, true, 1));
                v.push(Kernel::qmat_moe(bits, group, 4, 2, false, 2));
            }
        }
        v.push(Kernel::plain(Shader::Qmatvec, "moe_combine"));
        v.push(Kernel::plain(Shader::Qmatvec, "mxfp4_matvec"));
        v.push(Kernel::plain(Shader::QmatvecX24, "pack_x24"));
        for group in [32, 64, 128] {
            for lanes in [4, 32, 64, 256] {
                v.push(Kernel::qmat_x24(group, lanes));
            }
        }
        for dtype in 0..3 {
            v.push(Kernel::fmat(dtype, false));
            v.push(Kernel::fmat(dtype, true));
            v.push(Kernel::embed(dtype, 4, 64));
        }
        v.push(Kernel::plain(Shader::Norm, "rms_norm"));
        v.push(Kernel::plain(Shader::Rope, "rope"));
        v.push(Kernel::plain(Shader::Attn, "attention"));
        v.push(Kernel::plain(Shader::Attn, "attention_part"));
        v.push(Kernel::plain(Shader::Attn, "attention_combine"));
        v.push(Kernel::plain(Shader::Softmax, "softmax"));
        v.push(Kernel::plain(Shader::Softmax, "router_topk"));
        for e in ["swiglu", "add", "add_bias", "gather_rows", "scatter_add"] {
            v.push(Kernel::plain(Shader::Elementwise, e));
        }
        v.extend(FlashShader::variants());
        v
    }
}

/// A value of a `Params` field: every field is one 4-byte word.
pub(crate) trait Word {
    fn word(self) -> u32;
}

impl Word for u32 {
    fn word(self) -> u32 {
        self
    }
}

impl Word for f32 {
    fn word(self) -> u32 {
        self.to_bits()
    }
}

/// Bytes reserved per dispatch for its parameters: the largest uniform-offset
/// alignment WebGPU allows an adapter to require.
pub(crate) const PARAMS_SLOT: usize = 256;

/// Declare a shader's parameter block: the struct, its field names in order, and
/// its bytes (one little-endian word per field).
macro_rules! params {
    ($(#[$m:meta])* $name:ident { $($field:ident : $ty:ty),* $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, Default)]
        pub(crate) struct $name {
            $(pub(crate) $field: $ty),*
        }

        impl $name {
            #[cfg(test)]
            pub(crate) const FIELDS: &'static [&'static str] = &[$(stringify!($field)),*];

            pub(crate) fn bytes(&self) -> Vec<u8> {
                let words: &[u32] = &[$(Word::word(self.$field)),*];
                words.iter().flat_map(|w| w.to_le_bytes()).collect()
            }
        }
    };
}

params! {
    /// `qmatvec.wgsl`: offsets are words (`w_off`, `w2_off`), half-words (`s_off`,
    /// `b_off`, `s2_off`, `b2_off`) and f32 elements (`x_off`, `y_off`); the `*2`
    /// fields are the up projection of the fused SwiGLU.
    QmatvecParams { rows: u32, cols: u32, n: u32, w_off: u32, s_off: u32, b_off: u32, x_off: u32, y_off: u32, w2_off: u32, s2_off: u32, b2_off: u32, moe_k: u32, e_stride: u32 }
}
params! {
    /// `qmatvec_x24.wgsl`: `w_off` in words, `s_off`, `b_off` in half-words, `x_off`,
    /// `y_off` in f32 elements.
    QmatvecX24Params { rows: u32, cols: u32, w_off: u32, s_off: u32, b_off: u32, x_off: u32, y_off: u32 }
}
params! {
    /// `fmatvec.wgsl`: `d_off` counts matrix elements.
    FmatvecParams { rows: u32, cols: u32, n: u32, d_off: u32, x_off: u32, y_off: u32 }
}
params! {
    /// `norm.wgsl`.
    NormParams { n: u32, d: u32, x_off: u32, out_off: u32, eps: f32, add_one: u32 }
}
params! {
    /// `rope.wgsl`.
    RopeParams { n: u32, heads: u32, head_dim: u32, rot: u32, pos0: u32, x_off: u32, interleaved: u32 }
}
params! {
    /// `attn.wgsl`: `window` 0 for none, `sinks` 1 when bound.
    AttnParams { n: u32, heads: u32, kv_heads: u32, qk_dim: u32, v_dim: u32, pos0: u32, q_off: u32, out_off: u32, scale: f32, chunk: u32, chunks: u32, window: u32, sinks: u32, v_in_k: u32, kv_start: u32 }
}
params! {
    /// `softmax.wgsl`.
    SoftmaxParams { n: u32, d: u32, off: u32, k: u32, renorm: u32 }
}
params! {
    /// `elementwise.wgsl`.
    ElementwiseParams { n: u32, d: u32, a_off: u32, b_off: u32 }
}
params! {
    /// `embed.wgsl`.
    EmbedParams { n: u32, cols: u32, w_off: u32, s_off: u32, b_off: u32, out_off: u32 }
}

/// Flash-Next's WGSL sources (one [`Shader`] variant, so the core list stays short;
/// their host side is `flash.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum FlashShader {
    Elementwise,
    Norm,
    Conv,
    Gdn,
    Indexer,
    Attn,
}

impl FlashShader {
    /// Every source, for the shader checks.
    #[cfg(test)]
    pub(crate) const ALL: [FlashShader; 6] = [
        FlashShader::Elementwise,
        FlashShader::Norm,
        FlashShader::Conv,
        FlashShader::Gdn,
        FlashShader::Indexer,
        FlashShader::Attn,
    ];

    pub(crate) fn file(self) -> &'static str {
        match self {
            FlashShader::Elementwise => "flash_elementwise.wgsl",
            FlashShader::Norm => "flash_norm.wgsl",
            FlashShader::Conv => "flash_conv.wgsl",
            FlashShader::Gdn => "flash_gdn.wgsl",
            FlashShader::Indexer => "flash_indexer.wgsl",
            FlashShader::Attn => "flash_attn.wgsl",
        }
    }

    pub(crate) fn source(self) -> &'static str {
        match self {
            FlashShader::Elementwise => include_str!("shaders/flash_elementwise.wgsl"),
            FlashShader::Norm => with_reduce!("flash_norm.wgsl"),
            FlashShader::Conv => include_str!("shaders/flash_conv.wgsl"),
            FlashShader::Gdn => with_reduce!("flash_gdn.wgsl"),
            FlashShader::Indexer => include_str!("shaders/flash_indexer.wgsl"),
            FlashShader::Attn => with_reduce!("flash_attn.wgsl"),
        }
    }

    /// The field names of the shader's `Params`, in order.
    #[cfg(test)]
    pub(crate) fn params_fields(self) -> &'static [&'static str] {
        match self {
            FlashShader::Elementwise => FlashElementwiseParams::FIELDS,
            FlashShader::Norm => FlashNormParams::FIELDS,
            FlashShader::Conv => ConvParams::FIELDS,
            FlashShader::Gdn => GdnParams::FIELDS,
            FlashShader::Indexer => IndexerParams::FIELDS,
            FlashShader::Attn => FlashAttnParams::FIELDS,
        }
    }

    /// Every entry point the host builds (none has override constants).
    #[cfg(test)]
    pub(crate) fn variants() -> Vec<Kernel> {
        use FlashShader as F;
        [
            (F::Elementwise, "act"),
            (F::Elementwise, "sigmoid_mul"),
            (F::Elementwise, "scale_rows"),
            (F::Elementwise, "gather_cols"),
            (F::Elementwise, "scatter_cols"),
            (F::Elementwise, "hc_expand"),
            (F::Elementwise, "hc_mix"),
            (F::Elementwise, "hc_inject"),
            (F::Elementwise, "clamped_swiglu"),
            (F::Norm, "norm_grouped"),
            (F::Norm, "gated_norm"),
            (F::Norm, "ple_gate"),
            (F::Conv, "conv_silu"),
            (F::Conv, "conv_state"),
            (F::Gdn, "gdn"),
            (F::Indexer, "pool"),
            (F::Indexer, "scores"),
            (F::Attn, "indexed_attention"),
        ]
        .into_iter()
        .map(|(s, e)| Kernel::plain(Shader::Flash(s), e))
        .collect()
    }
}

params! {
    /// `flash_elementwise.wgsl`.
    FlashElementwiseParams { n: u32, d: u32, s: u32, mode: u32, c: f32 }
}
params! {
    /// `flash_norm.wgsl`.
    FlashNormParams { n: u32, d: u32, wd: u32, mode: u32, eps: f32, scale: f32 }
}
params! {
    /// `flash_conv.wgsl`.
    ConvParams { n: u32, ch: u32, taps: u32, dilation: u32, past: u32 }
}
params! {
    /// `flash_gdn.wgsl`.
    GdnParams { n: u32, nk: u32, dk: u32, nv: u32, dv: u32, scale: f32 }
}
params! {
    /// `flash_indexer.wgsl`.
    IndexerParams {
        n: u32, di: u32, ni: u32, cr: u32, first: u32, pos0: u32, nb: u32, half: u32,
        eps: f32, scale: f32,
    }
}
params! {
    /// `flash_attn.wgsl`.
    FlashAttnParams { n: u32, heads: u32, kv_heads: u32, head_dim: u32, pos0: u32, cr: u32, scale: f32 }
}
