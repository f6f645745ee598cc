//! A read's bytes written through the transforms: each tensor segment the read covers
//! is cut into bounded tiles of source rows, transformed, and written at its planned
//! offsets, and the read's digest is taken of the bytes it wrote.
//!
//! A read's digest is derived from the bytes it wrote, per tensor segment and per
//! output stream (weights, scales, biases) in row order, so [`digest_on_disk`]
//! recomputes it from the files alone: that is how the *resume* stage tells an intact
//! journaled read from a damaged one.
//!
//! A module of a pre-quantized source installed with `--requantize` streams its packed
//! weights like any tensor; the scales and biases of the rows a read covers are fetched
//! first ([`stage`]), so each tile is dequantized and quantized again on its own. What
//! a read writes still depends on the source alone, so a resumed read rewrites the
//! same bytes.
//!
//! An FP8 weight streams its e4m3 codes the same way, its `weight_scale_inv` rows for
//! the read's rows staged first; each tile is dequantized to BF16 on its own
//! ([`crate::transform::fp8`]) and then quantized or written like a BF16 source's.
//! Memory stays bounded by the read and the tile, never the tensor: a read (at most
//! [`crate::plan::COALESCE_MAX`] of codes) stages one F32 scale row per 128 of its
//! rows (4 bytes per 16,384 codes: 16 KiB for a 64 MiB read, plus the partial bands at
//! its two ends), and a tile of `tile_bytes` of codes becomes twice that in BF16
//! scratch, reused from tile to tile. A tile need not be a whole 128-row band: each
//! row picks its scale row.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use sha2::{Digest, Sha256};

use crate::format::Scheme;
use crate::plan::placement::TensorPlacement;
use crate::plan::{Plan, RangeRead};

use crate::format::mxfp4;
use crate::source::{RangeSource, SourceError};
use crate::transform::fp8::{self, Fp8Error};
use crate::transform::int4_ct;
use crate::transform::quant::{self, Spec};
use crate::transform::transpose;

use super::stage::OutputFiles;
use super::{InstallError, io_err};

/// One tensor's rows inside one read.
#[derive(Debug, Clone)]
pub(super) struct Segment {
    tensor: usize,
    /// Absolute source offset of the first byte.
    src_start: u64,
    row0: u64,
    row1: u64,
}

pub(super) fn segments(
    plan: &Plan,
    placements: &[Option<TensorPlacement>],
    read: &RangeRead,
) -> Vec<Segment> {
    let mut out = Vec::new();
    for (ti, t) in plan.tensors.iter().enumerate() {
        if t.shard != read.shard {
            continue;
        }
        let Some(p) = &placements[ti] else { continue };
        let s = t.src[0].max(read.start);
        let e = t.src[1].min(read.end);
        if s >= e {
            continue;
        }
        let row0 = (s - t.src[0]) / p.src_row_bytes * p.rows_per_src_row;
        let row1 = (e - t.src[0]).div_ceil(p.src_row_bytes) * p.rows_per_src_row;
        out.push(Segment {
            tensor: ti,
            src_start: s,
            row0,
            row1,
        });
    }
    out
}

/// Contiguous output runs `(file, offset, len, first_row)` of one stream (0 weights,
/// 1 scales, 2 biases) for rows `row0..row1`.
fn runs(p: &TensorPlacement, row0: u64, row1: u64, stream: usize) -> Vec<(usize, u64, u64, u64)> {
    let len = [p.out_row.0, p.out_row.1, p.out_row.2][stream];
    let mut v: Vec<(usize, u64, u64, u64)> = Vec::new();
    if len == 0 {
        return v;
    }
    for r in row0..row1 {
        let d = p.row(r);
        let off = [d.weights, d.scales, d.biases][stream];
        match v.last_mut() {
            Some(last) if last.0 == d.file && last.1 + last.2 == off => last.2 += len,
            _ => v.push((d.file, off, len, r)),
        }
    }
    v
}

/// Streams one read's bytes through the transforms into the output files.
pub(super) struct ReadWriter<'a> {
    plan: &'a Plan,
    placements: &'a [Option<TensorPlacement>],
    files: &'a [File],
    paths: &'a [PathBuf],
    segs: Vec<Segment>,
    seg: usize,
    /// Absolute source position of the next byte.
    pub(super) pos: u64,
    tile: Vec<u8>,
    tile_row0: u64,
    tile_rows: u64,
    out: [Vec<u8>; 3],
    hashers: [Sha256; 3],
    /// The read's digest: each segment's stream digests, in order.
    pub(super) digest: Sha256,
    /// The output files written into.
    pub(super) touched: BTreeSet<usize>,
    /// Output bytes written.
    pub(super) written: u64,
    /// Scales and biases of the requantized modules, and block scales of the FP8
    /// weights, this read covers ([`stage`]).
    staged: std::collections::BTreeMap<usize, Staged>,
    /// Scratch: a requantized or FP8 tile dequantized to BF16 (little-endian bytes).
    deq: Vec<u8>,
    /// Scratch: the same as BF16 bit patterns.
    vals: Vec<u16>,
}

/// What one read stages for one tensor before its bytes stream through.
pub(super) enum Staged {
    /// A requantized module's scales and biases for the rows `row0..` the read
    /// covers, as the source stores them (BF16, one per group).
    Affine {
        row0: u64,
        scales: bytes::Bytes,
        biases: bytes::Bytes,
    },
    /// An FP8 weight's `weight_scale_inv` rows `row0 / 128 ..` covering the rows
    /// `row0..` the read covers (little-endian F32, `ceil(cols / 128)` per row).
    Fp8 { row0: u64, scale_inv: bytes::Bytes },
}

/// Fetch the scales and biases of every requantized module, and the block scales of
/// every FP8 weight, among `segs` (their rows only), before the read's packed weights
/// or FP8 codes stream through. They are small next to the weights (4 bytes per group
/// against `group·bits/8`; 4 bytes per 128×128 block of FP8), so a read stages at
/// most half its own size (2-bit g32), an eighth at 4-bit g64. Returns them and the
/// source bytes fetched.
pub(super) async fn stage(
    source: &dyn RangeSource,
    plan: &Plan,
    placements: &[Option<TensorPlacement>],
    segs: &[Segment],
) -> Result<(std::collections::BTreeMap<usize, Staged>, u64), InstallError> {
    let mut out = std::collections::BTreeMap::new();
    let mut fetched = 0u64;
    for seg in segs {
        let t = &plan.tensors[seg.tensor];
        if let (Some(f), Some(Some(p))) = (&t.fp8, placements.get(seg.tensor)) {
            let per = fp8::blocks(p.cols) * 4;
            // The scale rows of rows row0..row1 (row1 > row0: a segment holds a byte).
            let bands = seg.row0 / fp8::BLOCK..(seg.row1 - 1) / fp8::BLOCK + 1;
            fetched += (bands.end - bands.start) * per;
            let scale_inv = stage_rows(source, plan, &f.scale_inv, bands, per).await?;
            out.insert(
                seg.tensor,
                Staged::Fp8 {
                    row0: seg.row0,
                    scale_inv,
                },
            );
            continue;
        }
        let (Some(r), Some(Some(p))) = (&t.requant, placements.get(seg.tensor)) else {
            continue;
        };
        let per = p
            .requant
            .and_then(|a| a.row_sizes(p.cols, t.dtype.size()))
            .map(|s| s.scales)
            .ok_or_else(|| InstallError::Internal(format!("{}: requant layout", t.name)))?;
        let rows = seg.row0..seg.row1;
        let scales = stage_rows(source, plan, &r.scales, rows.clone(), per).await?;
        fetched += (seg.row1 - seg.row0) * per;
        // A compressed-tensors or MXFP4 module has no biases to read.
        let biases = if r.biases_from_scales || r.from == Scheme::Mxfp4 {
            bytes::Bytes::new()
        } else {
            fetched += (seg.row1 - seg.row0) * per;
            stage_rows(source, plan, &r.biases, rows, per).await?
        };
        out.insert(
            seg.tensor,
            Staged::Affine {
                row0: seg.row0,
                scales,
                biases,
            },
        );
    }
    Ok((out, fetched))
}

/// Rows `rows` (of `per` bytes each) of a staged source tensor, checked to lie inside
/// it and to come back whole.
async fn stage_rows(
    source: &dyn RangeSource,
    plan: &Plan,
    part: &crate::plan::SourcePart,
    rows: std::ops::Range<u64>,
    per: u64,
) -> Result<bytes::Bytes, InstallError> {
    let range = part.src[0] + rows.start * per..part.src[0] + rows.end * per;
    let path = &plan.shards[part.shard].path;
    if range.end > part.src[1] {
        return Err(InstallError::Internal(format!(
            "{}: staged rows past the tensor",
            part.name
        )));
    }
    let want = range.end - range.start;
    let bytes = source.read_range(path, range.clone()).await?;
    if bytes.len() as u64 != want {
        return Err(SourceError::BadRange {
            path: path.clone(),
            range,
            detail: format!("{} bytes for `{}`, not {want}", bytes.len(), part.name),
        }
        .into());
    }
    Ok(bytes)
}

impl<'a> ReadWriter<'a> {
    /// A writer of the read that starts at source byte `start` and covers `segs`, with
    /// the scales and biases [`stage`] fetched for it.
    pub(super) fn new(
        plan: &'a Plan,
        placements: &'a [Option<TensorPlacement>],
        files: &'a [File],
        paths: &'a [PathBuf],
        segs: Vec<Segment>,
        start: u64,
        staged: std::collections::BTreeMap<usize, Staged>,
    ) -> ReadWriter<'a> {
        ReadWriter {
            plan,
            placements,
            files,
            paths,
            segs,
            seg: 0,
            pos: start,
            tile: Vec::new(),
            tile_row0: 0,
            tile_rows: 0,
            out: [Vec::new(), Vec::new(), Vec::new()],
            hashers: Default::default(),
            digest: Sha256::new(),
            touched: BTreeSet::new(),
            written: 0,
            staged,
            deq: Vec::new(),
            vals: Vec::new(),
        }
    }

    /// Feed the read's next source bytes, `chunk`, cut into tiles of about
    /// `tile_bytes`.
    pub(super) fn feed(&mut self, mut chunk: &[u8], tile_bytes: usize) -> Result<(), InstallError> {
        while !chunk.is_empty() {
            let Some(seg) = self.segs.get(self.seg).cloned() else {
                // Bytes after the last segment (excluded tensors read for the hash).
                self.pos += chunk.len() as u64;
                return Ok(());
            };
            if self.pos < seg.src_start {
                let skip = ((seg.src_start - self.pos) as usize).min(chunk.len());
                chunk = &chunk[skip..];
                self.pos += skip as u64;
                continue;
            }
            let p = self.placements[seg.tensor]
                .as_ref()
                .ok_or_else(|| InstallError::Internal("segment without placement".into()))?;
            // A tile is whole source rows (whole experts for transposed ones), counted
            // in placed rows.
            let unit = p.rows_per_src_row;
            if self.tile.is_empty() && self.tile_rows == 0 {
                self.tile_row0 =
                    (self.pos - self.plan.tensors[seg.tensor].src[0]) / p.src_row_bytes * unit;
                self.tile_rows = ((tile_bytes as u64 / p.src_row_bytes).max(1) * unit)
                    .min(seg.row1 - self.tile_row0);
            }
            let tile_len = (self.tile_rows / unit * p.src_row_bytes) as usize;
            if self.tile.is_empty() && chunk.len() >= tile_len {
                // The whole tile is in this piece: transform it where it lies.
                let (whole, rest) = chunk.split_at(tile_len);
                chunk = rest;
                self.pos += tile_len as u64;
                self.flush_tile(&seg, whole)?;
            } else {
                // A tile across two pieces is gathered first.
                let take = (tile_len - self.tile.len()).min(chunk.len());
                self.tile.extend_from_slice(&chunk[..take]);
                chunk = &chunk[take..];
                self.pos += take as u64;
                if self.tile.len() < tile_len {
                    continue;
                }
                let tile = std::mem::take(&mut self.tile);
                let flushed = self.flush_tile(&seg, &tile);
                self.tile = tile;
                self.tile.clear();
                flushed?;
            }
            if self.tile_row0 >= seg.row1 {
                self.finish_segment();
            }
        }
        Ok(())
    }

    /// Transform and write one tile of source rows, `src` (the tile's bytes, from the
    /// piece or gathered in `tile`).
    fn flush_tile(&mut self, seg: &Segment, src: &[u8]) -> Result<(), InstallError> {
        let t = &self.plan.tensors[seg.tensor];
        let p = self.placements[seg.tensor]
            .as_ref()
            .ok_or_else(|| InstallError::Internal("segment without placement".into()))?;
        let n = self.tile_rows;
        let (ow, os, ob) = p.out_row;
        let mut deq = std::mem::take(&mut self.deq);
        let rewritten = self.rewrite_tile(seg, p, src, &mut deq)?;
        let input: &[u8] = if rewritten { &deq } else { src };
        // A stream written straight from the input (no copy): a pre-quantized part's
        // bytes are its stream's, a passthrough tensor's its weights'.
        let mut direct: Option<(usize, &[u8])> = None;
        match (p.stream, p.scheme) {
            (Some(k), _) if p.biases_from_scales => {
                // A compressed-tensors module's scales: copied, and its biases
                // (`−8 × scale`) derived from them.
                let out = &mut self.out[2];
                out.clear();
                out.resize(src.len(), 0);
                crate::transform::int4_ct::mlx_biases(src, out).map_err(|e| {
                    InstallError::Transform {
                        tensor: t.name.clone(),
                        detail: e.to_string(),
                    }
                })?;
                direct = Some((k, src));
            }
            (Some(k), Scheme::Mxfp4) => {
                if k == 1 {
                    self.check_mxfp4_scales((&t.name, t.shard), p.cols, src)?;
                }
                direct = Some((k, src));
            }
            (Some(k), _) => direct = Some((k, src)),
            (None, Scheme::Mxfp4) => {
                // The planner keeps MXFP4 sources as they are; it never quantizes to it.
                return Err(InstallError::Internal(format!(
                    "{}: quantizing to MXFP4 is not planned",
                    t.name
                )));
            }
            (None, Scheme::Passthrough) => {
                if let Some(i) = crate::transform::first_non_finite(input, t.dtype) {
                    return Err(InstallError::NonFinite {
                        shard: self.plan.shards[t.shard].path.clone(),
                        tensor: t.name.clone(),
                        element: self.tile_row0 * p.cols + i as u64,
                    });
                }
                direct = Some((0, input));
            }
            (None, Scheme::Affine(affine)) => self.quantize_tile(seg, affine, input)?,
        }
        for stream in (0..3).filter(|&k| p.writes(k)) {
            let per = [ow, os, ob][stream];
            for (file, off, len, first) in runs(p, self.tile_row0, self.tile_row0 + n, stream) {
                let at = ((first - self.tile_row0) * per) as usize;
                let produced = match direct {
                    Some((k, bytes)) if k == stream => bytes,
                    _ => &self.out[stream][..],
                };
                let bytes = &produced[at..at + len as usize];
                self.files[file]
                    .write_all_at(bytes, off)
                    .map_err(|e| io_err(&self.paths[file], e))?;
                self.hashers[stream].update(bytes);
                self.touched.insert(file);
                self.written += len;
            }
        }
        self.deq = deq;
        self.tile_row0 += n;
        self.tile_rows = 0;
        Ok(())
    }

    /// Quantize one tile of BF16 rows, `input`, at `affine` into the three output
    /// buffers (bit-exact with `mx.quantize`); a non-finite weight names its element.
    fn quantize_tile(
        &mut self,
        seg: &Segment,
        affine: crate::format::Affine,
        input: &[u8],
    ) -> Result<(), InstallError> {
        let t = &self.plan.tensors[seg.tensor];
        let p = self.placements[seg.tensor]
            .as_ref()
            .ok_or_else(|| InstallError::Internal("segment without placement".into()))?;
        let (ow, os, ob) = p.out_row;
        let n = self.tile_rows;
        for (buf, per) in self.out.iter_mut().zip([ow, os, ob]) {
            buf.clear();
            buf.resize((per * n) as usize, 0);
        }
        let [w, s, b] = &mut self.out;
        let spec = Spec::from_affine(affine);
        quant::quantize_rows_le_bytes(input, p.cols as usize, spec, w, s, b).map_err(|e| match e {
            quant::QuantError::NonFinite { index } => InstallError::NonFinite {
                shard: self.plan.shards[t.shard].path.clone(),
                tensor: t.name.clone(),
                element: self.tile_row0 * p.cols + index as u64,
            },
            other => InstallError::Transform {
                tensor: t.name.clone(),
                detail: other.to_string(),
            },
        })
    }

    /// A tile of an MXFP4 module's scales, `src` (rows `tile_row0..` of `p.cols / 32`
    /// bytes): a `0xFF` byte (E8M0's NaN) is an input error naming the tensor, the
    /// shard and the scale's row and group.
    fn check_mxfp4_scales(
        &self,
        (tensor, shard): (&str, usize),
        cols: u64,
        src: &[u8],
    ) -> Result<(), InstallError> {
        let per = (cols / mxfp4::GROUP as u64).max(1);
        mxfp4::check_scales(src).map_err(|e| InstallError::Transform {
            tensor: tensor.to_string(),
            detail: format!(
                "scale of row {} group {} is 0xFF, E8M0's NaN (in {}); an MXFP4 scale is \
                 a finite power of two",
                self.tile_row0 + e.index as u64 / per,
                e.index as u64 % per,
                self.plan.shards[shard].path
            ),
        })
    }

    /// The tile's rows as the profile takes them, written into `deq` when they are not
    /// `src` itself (returns whether they are in `deq`): a requantized module's packed
    /// words dequantized to the BF16 matrix `mx.dequantize` gives, an FP8 tile
    /// dequantized, transposed experts transposed (whole experts per tile).
    fn rewrite_tile(
        &mut self,
        seg: &Segment,
        p: &TensorPlacement,
        src: &[u8],
        deq: &mut Vec<u8>,
    ) -> Result<bool, InstallError> {
        if p.fp8 {
            self.dequantize_fp8(seg, src, deq)?;
        } else if let Some(from) = p.requant {
            self.dequantize_affine(seg, from, src, deq)?;
        } else if let Some(interleaved) = p.transposed {
            let t = &self.plan.tensors[seg.tensor];
            let expert = transpose::Expert {
                cols: p.cols as usize,
                rows: p.rows_per_src_row as usize,
                elem: t.dtype.size() as usize,
                interleaved,
            };
            expert
                .transpose(src, deq)
                .map_err(|e| InstallError::Internal(format!("{}: {e}", t.name)))?;
        } else {
            return Ok(false);
        }
        Ok(true)
    }

    /// Dequantize one tile of a requantized module's packed words, `src` (rows
    /// `tile_row0..`, the source's layout `from`), into `deq` (little-endian BF16), with
    /// the scales and biases [`stage`] fetched for it.
    fn dequantize_affine(
        &self,
        seg: &Segment,
        from: Scheme,
        src: &[u8],
        deq: &mut Vec<u8>,
    ) -> Result<(), InstallError> {
        let t = &self.plan.tensors[seg.tensor];
        let Some(Staged::Affine {
            row0,
            scales,
            biases,
        }) = self.staged.get(&seg.tensor)
        else {
            return Err(InstallError::Internal(format!("{}: not staged", t.name)));
        };
        let cols = self.placements[seg.tensor].as_ref().map_or(0, |p| p.cols);
        let per = from.row_sizes(cols, 2).map_or(0, |s| s.scales) as usize;
        let at = (self.tile_row0 - row0) as usize * per;
        let len = self.tile_rows as usize * per;
        let Some(affine) = from.affine() else {
            return self.dequantize_mxfp4(seg, &scales[at..at + len], src, deq);
        };
        if t.requant.as_ref().is_some_and(|r| r.biases_from_scales) {
            deq.clear();
            deq.resize((self.tile_rows * cols * 2) as usize, 0);
            int4_ct::dequantize_rows(src, &scales[at..at + len], cols as usize, deq);
            return Ok(());
        }
        let (s, b) = (&scales[at..at + len], &biases[at..at + len]);
        let mut vals = vec![0u16; (self.tile_rows * cols) as usize];
        quant::dequantize_rows_bf16(
            src,
            s,
            b,
            cols as usize,
            Spec::from_affine(affine),
            &mut vals,
        )
        .map_err(|e| InstallError::Transform {
            tensor: t.name.clone(),
            detail: format!("dequantizing: {e}"),
        })?;
        deq.clear();
        deq.extend(vals.iter().flat_map(|v| v.to_le_bytes()));
        Ok(())
    }

    /// Dequantize one tile of an MXFP4 module's codes, `src`, with its staged scales
    /// `scales` (the tile's rows), into `deq` (little-endian BF16): E2M1 × 2^(e − 127)
    /// ([`mxfp4::dequantize_rows_bf16`]), which the profile then applies to.
    fn dequantize_mxfp4(
        &self,
        seg: &Segment,
        scales: &[u8],
        src: &[u8],
        deq: &mut Vec<u8>,
    ) -> Result<(), InstallError> {
        let t = &self.plan.tensors[seg.tensor];
        let (Some(Some(p)), Some(r)) = (self.placements.get(seg.tensor), &t.requant) else {
            return Err(InstallError::Internal(format!("{}: MXFP4 layout", t.name)));
        };
        self.check_mxfp4_scales((&r.scales.name, r.scales.shard), p.cols, scales)?;
        let mut vals = vec![0u16; (self.tile_rows * p.cols) as usize];
        mxfp4::dequantize_rows_bf16(src, scales, p.cols as usize, &mut vals)
            .map_err(|e| InstallError::Internal(format!("{}: {e}", t.name)))?;
        deq.clear();
        deq.extend(vals.iter().flat_map(|v| v.to_le_bytes()));
        Ok(())
    }

    /// Dequantize one tile of an FP8 weight's codes, `src` (rows `tile_row0..`), into
    /// `deq` (little-endian BF16), with the block scales [`stage`] fetched for it: the
    /// BF16 matrix MLX-LM's `sanitize` gives, which is then quantized (or kept) like a
    /// BF16 source's. An e4m3 NaN is a non-finite weight; a non-finite scale is an
    /// error naming the scale tensor and its block.
    fn dequantize_fp8(
        &mut self,
        seg: &Segment,
        src: &[u8],
        deq: &mut Vec<u8>,
    ) -> Result<(), InstallError> {
        let t = &self.plan.tensors[seg.tensor];
        let (Some(Some(p)), Some(f)) = (self.placements.get(seg.tensor), &t.fp8) else {
            return Err(InstallError::Internal(format!("{}: FP8 layout", t.name)));
        };
        let Some(Staged::Fp8 { row0, scale_inv }) = self.staged.get(&seg.tensor) else {
            return Err(InstallError::Internal(format!("{}: not staged", t.name)));
        };
        let per = (fp8::blocks(p.cols) * 4) as usize;
        let at = (self.tile_row0 / fp8::BLOCK - row0 / fp8::BLOCK) as usize * per;
        let scales = scale_inv.get(at..).unwrap_or_default();
        self.vals.clear();
        self.vals.resize(src.len(), 0);
        fp8::dequantize_rows(src, self.tile_row0, p.cols as usize, scales, &mut self.vals)
            .map_err(|e| match e {
                Fp8Error::Nan { element, .. } => InstallError::NonFinite {
                    shard: self.plan.shards[t.shard].path.clone(),
                    tensor: t.name.clone(),
                    element,
                },
                Fp8Error::NonFiniteScale { row, col, value } => InstallError::Transform {
                    tensor: f.scale_inv.name.clone(),
                    detail: format!(
                        "block [{row}, {col}] is {value} (in {}); the block scales of \
                         `{}` must be finite",
                        self.plan.shards[f.scale_inv.shard].path, t.name
                    ),
                },
                Fp8Error::Shape(d) => InstallError::Internal(format!("{}: {d}", t.name)),
            })?;
        deq.clear();
        deq.extend(self.vals.iter().flat_map(|v| v.to_le_bytes()));
        Ok(())
    }

    fn finish_segment(&mut self) {
        for h in &mut self.hashers {
            let d = std::mem::take(h).finalize();
            self.digest.update(d);
        }
        self.seg += 1;
        self.tile_rows = 0;
    }
}

/// Every tensor's placement, in plan order (`None` for excluded tensors).
pub(super) fn placements(plan: &Plan) -> Vec<Option<TensorPlacement>> {
    plan.tensors
        .iter()
        .map(|t| TensorPlacement::new(plan, t))
        .collect()
}

/// The digest a read's bytes on disk should have, recomputed from the files.
pub(super) fn digest_on_disk(
    plan: &Plan,
    placements: &[Option<TensorPlacement>],
    out: &OutputFiles,
    read: &RangeRead,
) -> Result<String, InstallError> {
    let (files, paths) = (&out.files, &out.paths);
    let mut digest = Sha256::new();
    let mut buf = Vec::new();
    for seg in segments(plan, placements, read) {
        let Some(p) = &placements[seg.tensor] else {
            continue;
        };
        for stream in 0..3 {
            let mut h = Sha256::new();
            // A stream the tensor does not write hashes as empty, as the writer's does.
            let runs = if p.writes(stream) {
                runs(p, seg.row0, seg.row1, stream)
            } else {
                Vec::new()
            };
            for (file, off, len, _) in runs {
                buf.resize(len as usize, 0);
                files[file]
                    .read_exact_at(&mut buf, off)
                    .map_err(|e| io_err(&paths[file], e))?;
                h.update(&buf);
            }
            digest.update(h.finalize());
        }
    }
    Ok(hex::encode(digest.finalize()))
}
