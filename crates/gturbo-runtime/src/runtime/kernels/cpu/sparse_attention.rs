//! The CPU's [`SparseAttentionOps`]: the indexed-attention cache, the indexer's block
//! scores and attention over the selected blocks plus the causal tail.

use super::rows_of;
use crate::runtime::kernels::ops::{AttnRows, IndexerDims, SparseAttentionOps};
use crate::runtime::kernels::{
    Backend, Causal, Cpu, CpuRope, NormGain, OpResult, axpy, dot, softmax_inplace,
};

/// The CPU's indexed-attention cache.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CpuAttnCache {
    /// Keys after norm and RoPE, `[len, nkv·d]`.
    pub k: Vec<f32>,
    /// Values `[len, nkv·d]`.
    pub v: Vec<f32>,
    /// The indexer's raw keys `[len, d_i]`.
    pub raw_keys: Vec<f32>,
    /// Pooled, normed and rotated keys of the complete blocks `[len / cr, d_i]`.
    pub block_keys: Vec<f32>,
    kv_width: usize,
    head_dim: usize,
    indexer: Option<IndexerDims>,
}

impl SparseAttentionOps for Cpu {
    type AttnCache = CpuAttnCache;

    fn copy_cache(&self, cache: &CpuAttnCache) -> OpResult<CpuAttnCache> {
        Ok(cache.clone())
    }

    fn cache_bytes(&self, c: &CpuAttnCache) -> u64 {
        super::f32_bytes(
            c.k.capacity() + c.v.capacity() + c.raw_keys.capacity() + c.block_keys.capacity(),
        )
    }

    fn read_cache(&self, c: &CpuAttnCache) -> OpResult<AttnRows> {
        Ok(AttnRows {
            k: c.k.clone(),
            v: c.v.clone(),
            raw: c.raw_keys.clone(),
            blocks: c.block_keys.clone(),
        })
    }

    fn load_cache(&self, c: &mut CpuAttnCache, rows: &AttnRows) -> OpResult {
        let checked = match &c.indexer {
            Some(ix) => rows.positions(c.kv_width, ix),
            None => Err("a cache not made by attn_cache".to_string()),
        };
        checked.map_err(|e| {
            crate::runtime::kernels::BackendError::new(self.name(), "load_cache", e)
        })?;
        c.k.clone_from(&rows.k);
        c.v.clone_from(&rows.v);
        c.raw_keys.clone_from(&rows.raw);
        c.block_keys.clone_from(&rows.blocks);
        Ok(())
    }

    fn attn_cache(
        &self,
        kv_heads: usize,
        head_dim: usize,
        indexer: IndexerDims,
    ) -> OpResult<CpuAttnCache> {
        assert!(kv_heads > 0 && head_dim > 0, "attn_cache: empty heads");
        Ok(CpuAttnCache {
            kv_width: kv_heads * head_dim,
            head_dim,
            indexer: Some(indexer),
            ..CpuAttnCache::default()
        })
    }

    fn indexer_scores(
        &self,
        cache: &mut CpuAttnCache,
        iq: &Vec<f32>,
        raw: &Vec<f32>,
        k_norm: &Vec<f32>,
        eps: f32,
        rope: &CpuRope,
        pos: usize,
    ) -> OpResult<Vec<Vec<f32>>> {
        let ix = cache
            .indexer
            .expect("indexer_scores: a cache made by attn_cache");
        let (di, cr, ni) = (ix.head_dim, ix.compress, ix.heads);
        let t = rows_of("indexer_scores", raw.len(), di);
        assert_eq!(iq.len(), t * ni * di, "indexer_scores: iq length");
        assert!(
            pos * di <= cache.raw_keys.len(),
            "indexer_scores: position past the cache"
        );
        cache.raw_keys.truncate(pos * di);
        cache.block_keys.truncate(pos / cr * di);
        cache.raw_keys.extend_from_slice(raw);
        let mut scores = Vec::with_capacity(t);
        for ti in 0..t {
            let p = pos + ti;
            // Blocks completed up to this query get their pooled keys.
            let n = (p + 1) / cr;
            while cache.block_keys.len() / di < n {
                let b = cache.block_keys.len() / di;
                let blk = &cache.raw_keys[b * cr * di..(b + 1) * cr * di];
                let mut mean = vec![0f32; di];
                for r in blk.chunks_exact(di) {
                    for (m, &x) in mean.iter_mut().zip(r) {
                        *m += x;
                    }
                }
                for m in &mut mean {
                    *m /= cr as f32;
                }
                let mut key = vec![0f32; di];
                self.rms_norm(&mean, k_norm, eps, NormGain::OnePlusWeight, &mut key)?;
                self.rope(rope, &mut key, 1, di, b * cr)?;
                cache.block_keys.extend_from_slice(&key);
            }
            scores.push(block_scores(
                &iq[ti * ni * di..(ti + 1) * ni * di],
                &cache.block_keys[..n * di],
                di,
            ));
        }
        Ok(scores)
    }

    fn indexed_attention(
        &self,
        cache: &mut CpuAttnCache,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        at: Causal,
        blocks: &[Vec<usize>],
        out: &mut Vec<f32>,
    ) -> OpResult {
        let ix = cache
            .indexer
            .expect("indexed_attention: a cache made by attn_cache");
        let (hd, kvw) = (cache.head_dim, cache.kv_width);
        let kv_heads = kvw / hd;
        let n = rows_of("indexed_attention", k.len(), kvw);
        let qw = at.heads * hd;
        assert!(
            at.heads.is_multiple_of(kv_heads) && at.heads > 0,
            "indexed_attention: {} query heads over {kv_heads} KV heads",
            at.heads
        );
        assert!(
            q.len() == n * qw && v.len() == k.len() && out.len() == q.len() && blocks.len() == n,
            "indexed_attention: lengths"
        );
        assert!(
            at.pos * kvw <= cache.k.len(),
            "indexed_attention: position past the cache"
        );
        cache.k.truncate(at.pos * kvw);
        cache.v.truncate(at.pos * kvw);
        cache.k.extend_from_slice(k);
        cache.v.extend_from_slice(v);
        let group = at.heads / kv_heads;
        for (i, sel) in blocks.iter().enumerate() {
            let p = at.pos + i;
            let allowed = allowed_positions(sel, ix.compress, p);
            let mut att = vec![0f32; allowed.len()];
            for h in 0..at.heads {
                let kvh = h / group;
                let qh = &q[i * qw + h * hd..i * qw + (h + 1) * hd];
                for (s, &j) in att.iter_mut().zip(&allowed) {
                    *s = dot(qh, &cache.k[j * kvw + kvh * hd..j * kvw + (kvh + 1) * hd]) * at.scale;
                }
                softmax_inplace(&mut att);
                let oh = &mut out[i * qw + h * hd..i * qw + (h + 1) * hd];
                oh.fill(0.0);
                for (&pr, &j) in att.iter().zip(&allowed) {
                    axpy(
                        pr,
                        &cache.v[j * kvw + kvh * hd..j * kvw + (kvh + 1) * hd],
                        oh,
                    );
                }
            }
        }
        Ok(())
    }
}

/// Relu-sum scores of one query's heads (`[n_i, d_i]`, normed and rotated) against
/// block keys (`[n, d_i]`): `s_b = Σ_h relu(q_h · key_b) / √d_i`.
pub fn block_scores(q: &[f32], keys: &[f32], head_dim: usize) -> Vec<f32> {
    let scale = (head_dim as f32).sqrt();
    keys.chunks_exact(head_dim)
        .map(|kb| {
            let s: f32 = q
                .chunks_exact(head_dim)
                .map(|qh| dot(qh, kb).max(0.0))
                .sum();
            s / scale
        })
        .collect()
}
/// The key positions a query at `pos` may read, ascending: the tokens of `blocks`
/// and the tail `n·cr ..= pos`.
pub fn allowed_positions(blocks: &[usize], compress: usize, pos: usize) -> Vec<usize> {
    let n = (pos + 1) / compress;
    let mut out: Vec<usize> = blocks
        .iter()
        .flat_map(|&b| b * compress..(b + 1) * compress)
        .collect();
    out.extend(n * compress..=pos);
    out
}
