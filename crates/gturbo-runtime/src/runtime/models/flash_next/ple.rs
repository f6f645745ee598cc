//! The PLE n-gram embedding (`Qwen4ExpTextNGramEmbedding`, `Qwen4ExpTextPLELayer`),
//! added to the residual before the attention block of the layers in `ple_layer_ids`.
//!
//! # Row ids (exact integer arithmetic)
//! With `t_s` the token `s` places back (or `eos` where that crosses the start or the
//! token right after an EOS: an EOS ends its segment), `m = layer_multipliers`, head
//! vocabularies `V_h` and offsets `O_h` read from the install's I64 tables (never
//! recomputed):
//! ```text
//! bigram heads  h < hpn:      id_h = ((t0·m0) ^ (t1·m1)) mod V_h + O_h
//! trigram heads hpn ≤ h < 2hpn: id_h = ((t0·m0) ^ (t1·m1) ^ (t2·m2)) mod V_h + O_h
//! ```
//! in int64 as the reference computes it: wrapping products, XOR, and a floor `mod`
//! (`torch.remainder`, non-negative for `V_h > 0`). The reference's multipliers are
//! bounded so that the products never wrap for valid ids, but this is exact either way.
//! The history is the last `ngram_size − 1` raw ids (EOS before the prompt), and the
//! segment rule is applied inside that window, as the reference's cache does.
//!
//! # The layer
//! Per token, with `x` the `[S·H]` residual entering the layer:
//! ```text
//! E     = concat_h rows[id_h]                       [ple_embed_dim]
//! key   = norm_key(key_proj · E)                    [S, H] per-stream offset norm
//! value = value_proj · E                            [H]    (no norm)
//! qry   = norm_query(x)                             [S, H]
//! g_j   = Σ key_j ⊙ qry_j / √H;  g_j = sign(g_j) · √max(|g_j|, 1e-6)
//! gv_j  = sigmoid(g_j) · value                      [S·H]
//! c[t]  = silu(Σ_i conv1d[ch, i] · norm_conv(gv)[t − (K−1−i)·D])   dilation D = ngram_size
//! x    += gv + c
//! ```
//! The conv state is the last `(K−1)·D` columns of `norm_conv(gv)` (zeros before the
//! prompt).

use crate::runtime::RunError;
use crate::runtime::kernels::Backend;
use crate::runtime::kernels::ops::{HcDims, Ops};
use crate::runtime::models::state::{Part, Parts, import_buf};
use crate::runtime::rows::RowCache;

/// The I64 tables of one PLE layer, as installed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PleTables {
    /// `layer_multipliers` `[ngram_size]`.
    pub multipliers: Vec<i64>,
    /// `ngram_heads_vocab_sizes` `[heads]`.
    pub vocab_sizes: Vec<i64>,
    /// `ngram_heads_offsets` `[heads]`.
    pub offsets: Vec<i64>,
}

/// PLE geometry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PleDims {
    /// `ngram_size` (3): orders 2 ..= ngram_size, and the conv dilation.
    pub ngram: usize,
    /// Heads per order (`heads_per_ngram`).
    pub heads_per_ngram: usize,
    /// Elements per row (`ple_embed_dim / heads`).
    pub row_width: usize,
    /// Conv taps `K` (`ple_conv_kernel_size`).
    pub conv_kernel: usize,
    /// Streams `S`.
    pub streams: usize,
    /// Stream width `H`.
    pub hidden: usize,
    /// Norm epsilon.
    pub eps: f32,
    /// `eos_token_id`.
    pub eos: i64,
}

impl PleDims {
    /// Heads: `(ngram_size − 1) · heads_per_ngram`.
    pub fn heads(&self) -> usize {
        self.ngram.saturating_sub(1) * self.heads_per_ngram
    }

    /// `ple_embed_dim`.
    pub fn embed_dim(&self) -> usize {
        self.heads() * self.row_width
    }

    /// Conv state columns: `(K − 1) · D`.
    pub fn conv_len(&self) -> usize {
        self.conv_kernel.saturating_sub(1) * self.ngram
    }
}

/// One PLE layer's resident weights (its rows live in the row cache).
pub struct PleWeights<'a, B: Backend> {
    /// `key_proj` `[S·H, E]`.
    pub key: B::Weights<'a>,
    /// `value_proj` `[H, E]`.
    pub value: B::Weights<'a>,
    /// `norm_key.weight` `[S·H]` (offset, per stream).
    pub norm_key: B::Buf,
    /// `norm_query.weight` `[S·H]`.
    pub norm_query: B::Buf,
    /// `norm_conv.weight` `[S·H]`.
    pub norm_conv: B::Buf,
    /// `conv1d.weight` `[S·H, 1, K]` flattened (`ch·K + i`).
    pub conv: B::Buf,
    /// The I64 tables.
    pub tables: PleTables,
}

/// Per-sequence PLE state of one layer.
pub struct PleState<B: Backend> {
    /// The last `ngram_size − 1` token ids, oldest first (EOS before the prompt).
    pub history: Vec<i64>,
    /// The last `(K−1)·D` rows of `norm_conv(gv)` (`[(K−1)·D, S·H]`, oldest first).
    pub conv: B::Buf,
}

impl<B: Backend> PleState<B> {
    /// The state before the first token.
    pub fn new(b: &B, d: &PleDims) -> Result<PleState<B>, RunError> {
        Ok(PleState {
            history: d.start_history(),
            conv: b.zeros(d.conv_len() * d.streams * d.hidden)?,
        })
    }

    /// Append the token history and the conv state (two parts).
    pub fn export(&self, b: &B, parts: &mut Vec<Part>) -> Result<(), RunError> {
        parts.push(Part::I64(self.history.clone()));
        parts.push(Part::F32(b.read(&self.conv)?));
        Ok(())
    }

    /// The state held by the next two parts, of `d`'s sizes (history ids are token
    /// ids: u32).
    pub fn import(b: &B, d: &PleDims, r: &mut Parts<'_>) -> Result<PleState<B>, RunError> {
        let ids = 0..i64::from(u32::MAX) + 1;
        Ok(PleState {
            history: r
                .i64("PLE history", d.ngram.saturating_sub(1), ids)?
                .to_vec(),
            conv: import_buf(b, r, "PLE conv state", d.conv_len() * d.streams * d.hidden)?,
        })
    }
}

impl PleDims {
    /// The token history before the first token: `ngram_size − 1` EOS ids.
    pub fn start_history(&self) -> Vec<i64> {
        vec![self.eos; self.ngram.saturating_sub(1)]
    }

    /// Bytes of one layer's state (history ids and conv columns).
    pub fn state_bytes(&self) -> usize {
        self.ngram.saturating_sub(1) * 8 + self.conv_len() * self.streams * self.hidden * 4
    }
}

/// The row ids of `tokens` (`[T, heads]`, global rows of the concatenated table),
/// advancing `history`.
pub fn ngram_ids(tables: &PleTables, d: &PleDims, history: &mut [i64], tokens: &[i64]) -> Vec<u64> {
    let (n, hpn) = (d.ngram, d.heads_per_ngram);
    let ctx = n.saturating_sub(1);
    assert!(
        history.len() == ctx
            && tables.multipliers.len() == n
            && tables.vocab_sizes.len() == d.heads(),
        "ngram_ids: table lengths (validated at load)"
    );
    let mut hist = history.to_vec();
    hist.extend_from_slice(tokens);
    let mut out = Vec::with_capacity(tokens.len() * d.heads());
    // The segment start for a position: one past the last EOS strictly before it.
    let mut seg_start = 0usize;
    for (p, _) in hist.iter().enumerate().take(ctx) {
        if hist[p] == d.eos {
            seg_start = p + 1;
        }
    }
    for p in ctx..hist.len() {
        let t = |s: usize| {
            if p >= seg_start + s {
                hist[p - s]
            } else {
                d.eos
            }
        };
        let mut mix = t(0).wrapping_mul(tables.multipliers[0]);
        for order in 2..=n {
            mix ^= t(order - 1).wrapping_mul(tables.multipliers[order - 1]);
            let base = (order - 2) * hpn;
            for h in base..base + hpn {
                // Sizes are validated positive at load; rem_euclid is torch.remainder.
                let id = mix.rem_euclid(tables.vocab_sizes[h]) + tables.offsets[h];
                out.push(id as u64);
            }
        }
        if hist[p] == d.eos {
            seg_start = p + 1;
        }
    }
    history.copy_from_slice(&hist[hist.len() - ctx..]);
    out
}

/// What one PLE call computes for `T` tokens.
pub struct PleOut<B: Backend> {
    /// Row ids `[T, heads]`.
    pub ids: Vec<u64>,
    /// The concatenated rows `E` `[T, ple_embed_dim]`.
    pub emb: B::Buf,
    /// What the layer adds to the residual, `gv + c` `[T, S·H]`.
    pub out: B::Buf,
}

/// Run `T` tokens through one PLE layer: `x` is the residual entering the layer
/// (`[T, S·H]`), `tokens` their ids. The rows are read on the host (the row cache)
/// and uploaded; everything else is backend ops. Advances `state`.
pub fn ple_forward<B: Ops>(
    b: &B,
    w: &PleWeights<'_, B>,
    d: &PleDims,
    rows: &RowCache,
    state: &mut PleState<B>,
    x: &B::Buf,
    tokens: &[i64],
) -> Result<PleOut<B>, RunError> {
    let t = tokens.len();
    let (h, wide) = (d.hidden, d.streams * d.hidden);
    let (rw, e) = (d.row_width, d.embed_dim());
    let ids = ngram_ids(&w.tables, d, &mut state.history, tokens);
    let mut host = vec![0f32; t * e];
    for (row, dst) in ids.iter().zip(host.chunks_exact_mut(rw)) {
        rows.fetch(*row, dst)?;
    }
    let emb = b.upload(&host)?;
    let hd = HcDims {
        streams: d.streams,
        hidden: h,
        lowrank: 0,
        eps: d.eps,
    };
    let mut key_raw = b.zeros(t * wide)?;
    b.linear(&w.key, &emb, &mut key_raw)?;
    let mut key = b.zeros(t * wide)?;
    b.norm_grouped(&key_raw, &w.norm_key, h, d.eps, &mut key)?;
    let mut value = b.zeros(t * h)?;
    b.linear(&w.value, &emb, &mut value)?;
    let mut qry = b.zeros(t * wide)?;
    b.norm_grouped(x, &w.norm_query, h, d.eps, &mut qry)?;
    let mut out = b.zeros(t * wide)?;
    b.ple_gate(&key, &qry, &value, hd, &mut out)?;
    let mut gvn = b.zeros(t * wide)?;
    b.norm_grouped(&out, &w.norm_conv, h, d.eps, &mut gvn)?;
    // The dilated depthwise conv reads the normed gate output; the raw one is added.
    let mut c = b.zeros(t * wide)?;
    b.causal_conv_silu(
        &gvn,
        &w.conv,
        d.conv_kernel,
        d.ngram,
        &mut state.conv,
        &mut c,
    )?;
    b.add(&mut out, &c)?;
    Ok(PleOut { ids, emb, out })
}
