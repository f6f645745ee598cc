//! A projection with an optional bias: `out = W·x + bias`. gpt-oss's q, k, v, o and
//! router and GLM's q, k, v carry biases; Llama, Qwen3 and Mixtral do not, so their
//! projections stay one [`Backend::linear`].

use crate::runtime::kernels::{Backend, OpResult};

/// One projection's weights.
pub struct Linear<'a, B: Backend> {
    /// The matrix `[rows, cols]`.
    pub w: B::Weights<'a>,
    /// The bias `[rows]`, added to every output row when present.
    pub bias: Option<B::Buf>,
}

impl<B: Backend> Linear<'_, B> {
    /// `out[t] = W · x[t] (+ bias)` for each row of `x` `[n, cols]` into `out` `[n, rows]`.
    pub fn forward(&self, b: &B, x: &B::Buf, out: &mut B::Buf) -> OpResult {
        b.linear(&self.w, x, out)?;
        if let Some(bias) = &self.bias {
            b.add_bias(out, bias)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::kernels::{Cpu, FloatDtype, Matrix};

    /// `[[1, 2], [3, 4], [5, 6]]` as f32 bytes.
    fn matrix_bytes() -> Vec<u8> {
        [1f32, 2., 3., 4., 5., 6.]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect()
    }

    fn linear<'a>(data: &'a [u8], bias: Option<Vec<f32>>) -> Linear<'a, Cpu> {
        Linear {
            w: Matrix::Float {
                dtype: FloatDtype::F32,
                data,
                rows: 3,
                cols: 2,
            },
            bias,
        }
    }

    #[test]
    fn forward_adds_the_bias_to_every_row_when_there_is_one() {
        let (cpu, data) = (Cpu::new(1), matrix_bytes());
        let x = vec![1f32, 1., 2., -1.];
        let mut out = vec![0f32; 6];
        linear(&data, None).forward(&cpu, &x, &mut out).unwrap();
        assert_eq!(out, [3., 7., 11., 0., 2., 4.]);
        let with = linear(&data, Some(vec![0.5, -1., 2.]));
        with.forward(&cpu, &x, &mut out).unwrap();
        assert_eq!(out, [3.5, 6., 13., 0.5, 1., 6.]);
    }

    #[test]
    #[should_panic(expected = "add_bias")]
    fn a_bias_that_is_not_whole_rows_is_a_cpu_panic() {
        Cpu::new(1)
            .add_bias(&mut vec![0f32; 6], &vec![1f32; 4])
            .unwrap();
    }
}
