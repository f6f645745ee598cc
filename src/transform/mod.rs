//! What happens to bytes between the source and the output: INT4/INT8 affine
//! quantization bit-exact with MLX, in bounded scratch.

pub mod quant;
