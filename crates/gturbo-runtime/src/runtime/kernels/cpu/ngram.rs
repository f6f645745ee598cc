//! The CPU's [`NgramOps`].

use super::math::sigmoid;
use super::rows_of;
use crate::runtime::kernels::ops::{HcDims, NgramOps};
use crate::runtime::kernels::{Cpu, OpResult};

impl NgramOps for Cpu {
    fn ple_gate(
        &self,
        key: &Vec<f32>,
        qry: &Vec<f32>,
        value: &Vec<f32>,
        d: HcDims,
        out: &mut Vec<f32>,
    ) -> OpResult {
        let (streams, h, wide) = (d.streams, d.hidden, d.width());
        let t = rows_of("ple_gate", value.len(), h);
        assert!(
            key.len() == t * wide && qry.len() == key.len() && out.len() == key.len(),
            "ple_gate: lengths"
        );
        let scale = (h as f32).sqrt();
        for ti in 0..t {
            let v = &value[ti * h..(ti + 1) * h];
            for j in 0..streams {
                let a = ti * wide + j * h;
                let mut g: f32 = key[a..a + h]
                    .iter()
                    .zip(&qry[a..a + h])
                    .map(|(k, q)| k * q)
                    .sum();
                g /= scale;
                let mag = g.abs().max(1e-6).sqrt();
                // sign(0) = 0, as torch.sign.
                let g = if g > 0.0 {
                    mag
                } else if g < 0.0 {
                    -mag
                } else {
                    0.0
                };
                let gate = sigmoid(g);
                for (o, &vv) in out[a..a + h].iter_mut().zip(v) {
                    *o = gate * vv;
                }
            }
        }
        Ok(())
    }
}
