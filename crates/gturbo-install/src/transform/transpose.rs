//! Experts stored transposed, as transformers keeps gpt-oss's (`GptOssExperts`:
//! `gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`, each expert's matrix `[in, out]`
//! so that `x @ W` is the projection), written as the pool's `[out, in]` rows. A
//! `gate_up_proj`'s out axis interleaves the two projections (`gate_up[..., ::2]` is
//! the gate, `[..., 1::2]` the up: `GptOssExperts._apply_gate`), so its placed rows are
//! the even columns (the gate's `I` rows) then the odd ones (the up's). Elements move
//! as bytes: the source's dtype is kept, the profile quantizes the placed rows.
//!
//! Memory: one tile of whole experts in, the same bytes out (the executor's scratch,
//! reused from tile to tile).

/// One expert's geometry as placed: `rows × cols` (`out × in`) elements of `elem`
/// bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expert {
    /// Placed row width (the source's rows: `in`).
    pub cols: usize,
    /// Placed rows (the source's row width: `out`).
    pub rows: usize,
    /// Bytes per element.
    pub elem: usize,
    /// Gate and up interleaved on the source's out axis.
    pub interleaved: bool,
}

impl Expert {
    /// Bytes of one expert.
    pub fn bytes(&self) -> usize {
        self.rows * self.cols * self.elem
    }

    /// The source row (placed column) order's inverse: placed row `r` is source
    /// column `column(r)`.
    fn column(&self, r: usize) -> usize {
        if !self.interleaved {
            return r;
        }
        let half = self.rows / 2;
        if r < half { 2 * r } else { 2 * (r - half) + 1 }
    }

    /// Every expert of `src` (whole experts, `[in, out]` each) into `dst` as `[out, in]`.
    pub fn transpose(&self, src: &[u8], dst: &mut Vec<u8>) -> Result<(), String> {
        let per = self.bytes();
        if per == 0
            || !src.len().is_multiple_of(per)
            || (self.interleaved && !self.rows.is_multiple_of(2))
        {
            return Err(format!(
                "{} bytes are not whole experts of {} × {} elements of {} bytes{}",
                src.len(),
                self.cols,
                self.rows,
                self.elem,
                if self.interleaved {
                    " (gate and up: an even row count)"
                } else {
                    ""
                }
            ));
        }
        dst.clear();
        dst.resize(src.len(), 0);
        let (e, rows, cols) = (self.elem, self.rows, self.cols);
        for (s, d) in src.chunks_exact(per).zip(dst.chunks_exact_mut(per)) {
            for r in 0..rows {
                let c = self.column(r);
                let out = &mut d[r * cols * e..(r + 1) * cols * e];
                for (i, o) in out.chunks_exact_mut(e).enumerate() {
                    let at = (i * rows + c) * e;
                    o.copy_from_slice(&s[at..at + e]);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// u16 elements as little-endian bytes.
    fn bytes(v: &[u16]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn gate_up_rows_are_the_even_then_odd_columns_of_each_expert_transposed() {
        // Two experts of [in 2, out 4]: element (i, j) of expert x is 100x + 10i + j.
        let src: Vec<u16> = (0..2)
            .flat_map(|x| (0..2).flat_map(move |i| (0..4).map(move |j| 100 * x + 10 * i + j)))
            .collect();
        let mut dst = Vec::new();
        let gu = Expert {
            cols: 2,
            rows: 4,
            elem: 2,
            interleaved: true,
        };
        gu.transpose(&bytes(&src), &mut dst).unwrap();
        // Placed row r, column i: source (i, column(r)); gate = columns 0, 2; up = 1, 3.
        let want: Vec<u16> = (0..2)
            .flat_map(|x| {
                [0u16, 2, 1, 3]
                    .into_iter()
                    .flat_map(move |j| (0..2).map(move |i| 100 * x + 10 * i + j))
            })
            .collect();
        assert_eq!(dst, bytes(&want));
        let down = Expert {
            interleaved: false,
            ..gu
        };
        down.transpose(&bytes(&src), &mut dst).unwrap();
        let want: Vec<u16> = (0..2)
            .flat_map(|x| (0..4).flat_map(move |j| (0..2).map(move |i| 100 * x + 10 * i + j)))
            .collect();
        assert_eq!(dst, bytes(&want));
        let e = gu.transpose(&bytes(&src[..5]), &mut dst).unwrap_err();
        assert!(e.contains("not whole experts"), "{e}");
    }
}
