//! Sparse attention: an indexer that scores blocks of pooled keys, and attention over
//! the chosen blocks plus the causal tail (Flash-Next's QSA).

use crate::runtime::kernels::{Backend, Causal, OpResult};

/// Indexer geometry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IndexerDims {
    /// Query heads `n_i`.
    pub heads: usize,
    /// Head width `d_i` (at least the rotary width).
    pub head_dim: usize,
    /// Token budget (a multiple of `cr`).
    pub budget: usize,
    /// Tokens per block `cr`.
    pub compress: usize,
}

impl IndexerDims {
    /// Blocks selected at most: `budget / cr`.
    pub fn block_topk(&self) -> usize {
        self.budget / self.compress
    }
}

/// An indexed-attention cache on the host ([`SparseAttentionOps::read_cache`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AttnRows {
    /// Keys after norm and RoPE `[len, kv_heads·head_dim]`.
    pub k: Vec<f32>,
    /// Values `[len, kv_heads·head_dim]`.
    pub v: Vec<f32>,
    /// The indexer's raw keys `[len, d_i]`.
    pub raw: Vec<f32>,
    /// Pooled keys of the complete blocks `[len / cr, d_i]`.
    pub blocks: Vec<f32>,
}

impl AttnRows {
    /// The positions held by a cache of `kv_width`-wide rows and `ix`'s indexer, or
    /// why the rows are not such a cache's.
    pub fn positions(&self, kv_width: usize, ix: &IndexerDims) -> Result<usize, String> {
        let di = ix.head_dim;
        let n = self.k.len() / kv_width.max(1);
        let ok = kv_width > 0
            && di > 0
            && ix.compress > 0
            && n * kv_width == self.k.len()
            && self.v.len() == self.k.len()
            && self.raw.len() == n * di
            && self.blocks.len() == n / ix.compress * di;
        if !ok {
            return Err(format!(
                "{} key, {} value, {} raw and {} block floats are not one cache's positions \
                 (rows {kv_width} and {di} wide, blocks of {})",
                self.k.len(),
                self.v.len(),
                self.raw.len(),
                self.blocks.len(),
                ix.compress
            ));
        }
        Ok(n)
    }
}

/// Sparse-attention operations over a backend's tensors. `Self::AttnCache` is one
/// indexed attention layer's cache: keys after norm and RoPE, values, the indexer's raw
/// keys and the pooled block keys.
pub trait SparseAttentionOps: Backend {
    /// One indexed-attention layer's cache.
    type AttnCache;

    /// A copy of `cache` holding the same positions (a session snapshot).
    fn copy_cache(&self, cache: &Self::AttnCache) -> OpResult<Self::AttnCache>;
    /// Bytes `cache` holds (host or device, reserved capacity included).
    fn cache_bytes(&self, cache: &Self::AttnCache) -> u64;
    /// What `cache` holds on the host (a session saved to disk).
    fn read_cache(&self, cache: &Self::AttnCache) -> OpResult<AttnRows>;
    /// Fill `cache`, an empty one from [`SparseAttentionOps::attn_cache`], with `rows`
    /// (as [`SparseAttentionOps::read_cache`] gives them); rows that do not fit its
    /// geometry are an error.
    fn load_cache(&self, cache: &mut Self::AttnCache, rows: &AttnRows) -> OpResult;
    /// An empty indexed-attention cache for `kv_heads` heads of `head_dim` and the
    /// indexer's geometry.
    fn attn_cache(
        &self,
        kv_heads: usize,
        head_dim: usize,
        indexer: IndexerDims,
    ) -> OpResult<Self::AttnCache>;
    /// Append the indexer's raw keys `raw` (`[n, d_i]`, no norm, no RoPE) of tokens
    /// `pos..pos + n` (forgetting any cached after `pos`), pool every block they
    /// complete (`rope(k_norm_offset(mean_f32(raw keys of the block)), block start)`),
    /// and return for each new token at `p` the relu-sum scores of its query heads
    /// `iq` (`[n, n_i·d_i]`, normed and rotated) against the `(p + 1) / cr` complete
    /// blocks: `Σ_h relu(q_h · key_b) / √d_i`.
    #[allow(clippy::too_many_arguments)]
    fn indexer_scores(
        &self,
        cache: &mut Self::AttnCache,
        iq: &Self::Buf,
        raw: &Self::Buf,
        k_norm: &Self::Buf,
        eps: f32,
        rope: &Self::Rope,
        pos: usize,
    ) -> OpResult<Vec<Vec<f32>>>;
    /// Store `k`, `v` (`[n, kv_heads·head_dim]`) at positions `at.pos..` of `cache`
    /// (forgetting any after), then attention of `q` (`[n, heads·head_dim]`) where the
    /// query at `p = at.pos + i` reads the tokens of the complete blocks `blocks[i]`
    /// and its incomplete tail block (`n_b·cr ..= p`, `n_b = (p + 1) / cr`), in
    /// ascending block order then the tail: `softmax(at.scale · q·k)` over exactly
    /// those keys, on their values.
    #[allow(clippy::too_many_arguments)]
    fn indexed_attention(
        &self,
        cache: &mut Self::AttnCache,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        at: Causal,
        blocks: &[Vec<usize>],
        out: &mut Self::Buf,
    ) -> OpResult;
}
