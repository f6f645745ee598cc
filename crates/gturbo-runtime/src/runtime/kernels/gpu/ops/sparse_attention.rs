//! The GPU's [`SparseAttentionOps`] (`shaders/flash_indexer.wgsl`, `flash_attn.wgsl`): the
//! indexed-attention cache on the device, the indexer's block scores, attention over
//! the selection.

use super::launch::*;
use crate::runtime::kernels::backend::Causal;
use crate::runtime::kernels::backend::OpResult;
use crate::runtime::kernels::gpu::backend::GpuRope;
use crate::runtime::kernels::gpu::backend::{Gpu, GpuBuf};
use crate::runtime::kernels::gpu::context::GpuContext;
use crate::runtime::kernels::gpu::error::Result;
use crate::runtime::kernels::gpu::shaders::FlashShader;
use crate::runtime::kernels::gpu::shaders::{FlashAttnParams, IndexerParams};
use crate::runtime::kernels::gpu::tensor::{DType, GpuTensor};
use crate::runtime::kernels::ops::{AttnRows, IndexerDims, SparseAttentionOps};

/// One indexed-attention layer's cache on the device: keys (after norm and RoPE) and
/// values `[capacity, kv_heads·head_dim]`, the indexer's raw keys `[capacity, d_i]`
/// and the pooled block keys `[capacity / cr + 1, d_i]`. It doubles as positions
/// arrive.
pub struct GpuAttnCache {
    k: GpuTensor,
    v: GpuTensor,
    raw: GpuTensor,
    blocks: GpuTensor,
    capacity: usize,
    /// Positions of keys and values held.
    kv_len: usize,
    /// Positions of raw indexer keys held.
    raw_len: usize,
    /// Blocks pooled.
    pooled: usize,
    kv_heads: usize,
    head_dim: usize,
    indexer: IndexerDims,
}

impl GpuAttnCache {
    fn new(
        ctx: &GpuContext,
        capacity: usize,
        kv_heads: usize,
        head_dim: usize,
        indexer: IndexerDims,
    ) -> Result<GpuAttnCache> {
        let kvw = kv_heads * head_dim;
        let di = indexer.head_dim;
        Ok(GpuAttnCache {
            k: ctx.zeros(&[capacity, kvw], DType::F32)?,
            v: ctx.zeros(&[capacity, kvw], DType::F32)?,
            raw: ctx.zeros(&[capacity, di], DType::F32)?,
            blocks: ctx.zeros(&[capacity / indexer.compress + 1, di], DType::F32)?,
            capacity,
            kv_len: 0,
            raw_len: 0,
            pooled: 0,
            kv_heads,
            head_dim,
            indexer,
        })
    }

    /// Room for `positions`, growing (by doubling) and copying what is held.
    fn reserve(&mut self, ctx: &GpuContext, positions: usize) -> Result<()> {
        if positions <= self.capacity {
            return Ok(());
        }
        let cap = (2 * self.capacity).max(positions);
        *self = self.copy_to(ctx, cap)?;
        Ok(())
    }

    /// A cache of `cap` positions (at least those held) holding what this one holds.
    fn copy_to(&self, ctx: &GpuContext, cap: usize) -> Result<GpuAttnCache> {
        let mut grown = GpuAttnCache::new(ctx, cap, self.kv_heads, self.head_dim, self.indexer)?;
        let (kvw, di) = (self.kv_heads * self.head_dim, self.indexer.head_dim);
        let copy = |from: &GpuTensor, to: &GpuTensor, elems: usize| {
            if elems > 0 {
                ctx.copy(&from.buf, 0, &to.buf, 0, (elems * 4) as u64);
            }
        };
        copy(&self.k, &grown.k, self.kv_len * kvw);
        copy(&self.v, &grown.v, self.kv_len * kvw);
        copy(&self.raw, &grown.raw, self.raw_len * di);
        copy(&self.blocks, &grown.blocks, self.pooled * di);
        (grown.kv_len, grown.raw_len, grown.pooled) = (self.kv_len, self.raw_len, self.pooled);
        Ok(grown)
    }

    /// Pool the blocks up to `nb` not pooled yet, with `p`'s indexer geometry.
    fn pool_blocks(
        &mut self,
        ctx: &GpuContext,
        p: &mut IndexerParams,
        k_norm: &GpuBuf,
        table: &wgpu::Buffer,
        nb: usize,
    ) -> Result<()> {
        const OP: &str = "indexer_scores";
        if nb > self.pooled {
            p.n = u32_of(OP, nb - self.pooled)?;
            p.first = u32_of(OP, self.pooled)?;
            ctx.dispatch_at(
                &kernel(FlashShader::Indexer, "pool"),
                &p.bytes(),
                &[
                    (1, &*self.raw.buf),
                    (2, buf(k_norm)),
                    (3, table),
                    (4, &*self.blocks.buf),
                ],
                nb - self.pooled,
            )?;
            self.pooled = nb;
        }
        Ok(())
    }
}

/// The tokens of an `indexer_scores` call (`raw`'s rows), its inputs checked
/// against the cache's indexer geometry, the cached length and the rotary table
/// (`rot` wide, `positions` long).
fn indexer_tokens(
    cache: &GpuAttnCache,
    iq: &GpuBuf,
    raw: &GpuBuf,
    k_norm: &GpuBuf,
    (rot, positions): (usize, usize),
    pos: usize,
) -> Result<usize> {
    const OP: &str = "indexer_scores";
    let ix = cache.indexer;
    let (di, ni) = (ix.head_dim, ix.heads);
    let t = rows(OP, "raw", raw.len(), di)?;
    need(OP, iq.len() == t * ni * di && k_norm.len() == di, || {
        format!(
            "iq of {}, k_norm of {} for {t} tokens of {ni} heads of {di}",
            iq.len(),
            k_norm.len()
        )
    })?;
    need(OP, pos <= cache.raw_len, || {
        format!("position {pos} past the {} cached", cache.raw_len)
    })?;
    need(OP, rot <= di && pos + t <= positions, || {
        format!(
            "rotary width {rot} on heads of {di}, positions up to {} of {positions}",
            pos + t,
        )
    })?;
    Ok(t)
}

impl SparseAttentionOps for Gpu {
    type AttnCache = GpuAttnCache;

    fn cache_bytes(&self, c: &GpuAttnCache) -> u64 {
        [&c.k, &c.v, &c.raw, &c.blocks]
            .iter()
            .map(|t| t.device_bytes())
            .sum()
    }

    fn copy_cache(&self, cache: &GpuAttnCache) -> OpResult<GpuAttnCache> {
        self.flash("copy_cache", cache.copy_to(self.context(), cache.capacity))
    }

    fn read_cache(&self, c: &GpuAttnCache) -> OpResult<AttnRows> {
        let ctx = self.context();
        let (kvw, di) = (c.kv_heads * c.head_dim, c.indexer.head_dim);
        let run = || -> Result<AttnRows> {
            Ok(AttnRows {
                k: ctx.download_f32_prefix(&c.k, c.kv_len * kvw)?,
                v: ctx.download_f32_prefix(&c.v, c.kv_len * kvw)?,
                raw: ctx.download_f32_prefix(&c.raw, c.raw_len * di)?,
                blocks: ctx.download_f32_prefix(&c.blocks, c.pooled * di)?,
            })
        };
        self.flash("read_cache", run())
    }

    fn load_cache(&self, c: &mut GpuAttnCache, rows: &AttnRows) -> OpResult {
        const OP: &str = "load_cache";
        let n = rows
            .positions(c.kv_heads * c.head_dim, &c.indexer)
            .map_err(|e| shape(OP, e));
        let run = |c: &mut GpuAttnCache| -> Result<()> {
            let n = n?;
            let ctx = self.context();
            *c = GpuAttnCache::new(ctx, n.max(CACHE_START), c.kv_heads, c.head_dim, c.indexer)?;
            ctx.write_f32_prefix(&c.k, &rows.k)?;
            ctx.write_f32_prefix(&c.v, &rows.v)?;
            ctx.write_f32_prefix(&c.raw, &rows.raw)?;
            ctx.write_f32_prefix(&c.blocks, &rows.blocks)?;
            (c.kv_len, c.raw_len, c.pooled) = (n, n, n / c.indexer.compress);
            Ok(())
        };
        self.flash(OP, run(c))
    }

    fn attn_cache(
        &self,
        kv_heads: usize,
        head_dim: usize,
        indexer: IndexerDims,
    ) -> OpResult<GpuAttnCache> {
        const OP: &str = "attn_cache";
        let run = || -> Result<GpuAttnCache> {
            need(
                OP,
                kv_heads > 0
                    && (1..=MAX_WIDTH).contains(&head_dim)
                    && (1..=MAX_WIDTH).contains(&indexer.head_dim)
                    && indexer.compress > 0,
                || {
                    format!(
                        "{kv_heads} KV heads of {head_dim}, indexer heads of {} in blocks of {} \
                         (heads at most {MAX_WIDTH} wide)",
                        indexer.head_dim, indexer.compress
                    )
                },
            )?;
            GpuAttnCache::new(self.context(), CACHE_START, kv_heads, head_dim, indexer)
        };
        self.flash(OP, run())
    }

    fn indexer_scores(
        &self,
        cache: &mut GpuAttnCache,
        iq: &GpuBuf,
        raw: &GpuBuf,
        k_norm: &GpuBuf,
        eps: f32,
        rope: &GpuRope,
        pos: usize,
    ) -> OpResult<Vec<Vec<f32>>> {
        const OP: &str = "indexer_scores";
        let run = |cache: &mut GpuAttnCache| -> Result<Vec<Vec<f32>>> {
            let ctx = self.context();
            let ix = cache.indexer;
            let (di, cr, ni) = (ix.head_dim, ix.compress, ix.heads);
            let table = rope.table();
            if table.first() != 0 {
                // The block pooling reads the table at absolute positions.
                return Err(shape(
                    OP,
                    format!("a RoPE table from position {}", table.first()),
                ));
            }
            let (rot, positions) = (table.rot(), table.positions());
            let t = indexer_tokens(cache, iq, raw, k_norm, (rot, positions), pos)?;
            // Forget what was cached after `pos` (a failed pass leaves a clean state).
            cache.raw_len = pos;
            cache.pooled = cache.pooled.min(pos / cr);
            cache.reserve(ctx, pos + t)?;
            if t == 0 {
                return Ok(Vec::new());
            }
            ctx.copy(
                buf(raw),
                0,
                &cache.raw.buf,
                (pos * di * 4) as u64,
                (t * di * 4) as u64,
            );
            cache.raw_len = pos + t;
            let nb = (pos + t) / cr;
            let mut p = IndexerParams {
                di: u32_of(OP, di)?,
                ni: u32_of(OP, ni)?,
                cr: u32_of(OP, cr)?,
                half: u32_of(OP, table.rot() / 2)?,
                eps,
                scale: (di as f32).sqrt(),
                ..IndexerParams::default()
            };
            cache.pool_blocks(ctx, &mut p, k_norm, &table.table.buf, nb)?;
            if nb == 0 {
                return Ok(vec![Vec::new(); t]);
            }
            p.n = u32_of(OP, t)?;
            p.pos0 = u32_of(OP, pos)?;
            p.nb = u32_of(OP, nb)?;
            // Every entry is written by the kernel.
            let scores = self.scratch(t * nb)?;
            ctx.dispatch_at(
                &kernel(FlashShader::Indexer, "scores"),
                &p.bytes(),
                &[(4, &*cache.blocks.buf), (5, buf(iq)), (6, buf(&scores))],
                (t * nb).div_ceil(WG_SCORES),
            )?;
            let host = ctx.download_f32(scores.tensor())?;
            Ok(host
                .chunks_exact(nb)
                .enumerate()
                .map(|(i, row)| row[..(pos + i + 1) / cr].to_vec())
                .collect())
        };
        self.flash(OP, run(cache))
    }

    fn indexed_attention(
        &self,
        cache: &mut GpuAttnCache,
        q: &GpuBuf,
        k: &GpuBuf,
        v: &GpuBuf,
        at: Causal,
        blocks: &[Vec<usize>],
        out: &mut GpuBuf,
    ) -> OpResult {
        const OP: &str = "indexed_attention";
        let run = |cache: &mut GpuAttnCache| -> Result<()> {
            let ctx = self.context();
            let (hd, nkv, cr) = (cache.head_dim, cache.kv_heads, cache.indexer.compress);
            let kvw = nkv * hd;
            let n = rows(OP, "k", k.len(), kvw)?;
            need(OP, at.heads > 0 && at.heads.is_multiple_of(nkv), || {
                format!("{} query heads over {nkv} KV heads", at.heads)
            })?;
            need(
                OP,
                q.len() == n * at.heads * hd
                    && v.len() == k.len()
                    && out.len() == q.len()
                    && blocks.len() == n,
                || {
                    format!(
                        "q {}, v {}, out {}, {} selections for {n} tokens",
                        q.len(),
                        v.len(),
                        out.len(),
                        blocks.len()
                    )
                },
            )?;
            need(OP, at.pos <= cache.kv_len, || {
                format!("position {} past the {} cached", at.pos, cache.kv_len)
            })?;
            // The selection as an index list, each block one the query can see.
            let mut sel = Vec::new();
            let mut offs = Vec::with_capacity(n + 1);
            offs.push(0);
            for (i, bs) in blocks.iter().enumerate() {
                let visible = (at.pos + i + 1) / cr;
                if let Some(&b) = bs.iter().find(|&&b| b >= visible) {
                    return Err(shape(
                        OP,
                        format!(
                            "the query at {} selects block {b} of the {visible} it sees",
                            at.pos + i
                        ),
                    ));
                }
                sel.extend(bs.iter().map(|&b| b as u32));
                offs.push(u32_of(OP, sel.len())?);
            }
            cache.kv_len = at.pos;
            cache.reserve(ctx, at.pos + n)?;
            if n == 0 {
                return Ok(());
            }
            let (off, bytes) = ((at.pos * kvw * 4) as u64, (n * kvw * 4) as u64);
            ctx.copy(buf(k), 0, &cache.k.buf, off, bytes);
            ctx.copy(buf(v), 0, &cache.v.buf, off, bytes);
            cache.kv_len = at.pos + n;
            let p = FlashAttnParams {
                n: u32_of(OP, n)?,
                heads: u32_of(OP, at.heads)?,
                kv_heads: u32_of(OP, nkv)?,
                head_dim: u32_of(OP, hd)?,
                pos0: u32_of(OP, at.pos)?,
                cr: u32_of(OP, cr)?,
                scale: at.scale,
            };
            let (sel, offs) = (indices(ctx, &sel), indices(ctx, &offs));
            ctx.dispatch_at(
                &kernel(FlashShader::Attn, "indexed_attention"),
                &p.bytes(),
                &[
                    (1, buf(q)),
                    (2, &*cache.k.buf),
                    (3, &*cache.v.buf),
                    (4, buf(out)),
                    (5, &sel),
                    (6, &offs),
                ],
                n * at.heads,
            )
        };
        self.flash(OP, run(cache))
    }
}
