//! Writes the GPU benchmark's models (`scripts/bench/bench_gpu.sh`) as Hugging Face BF16
//! snapshots with random weights, from the test kit's replica generators:
//!
//! - `smollm2`: SmolLM2-135M's shapes (Llama, 30 layers of width 576, 9 query heads
//!   over 3 KV heads of 64, MLP 1536, tied vocabulary of 49152; 0.27 GB). A forward
//!   pass costs the same whatever the weights hold, so this stands in for the real
//!   checkpoint, which the benchmark machine cannot download.
//! - `moe`: a qwen3_moe of 1.69 B parameters (3.4 GB): 14 layers of width 2048 (16
//!   query heads over 4 KV heads of 128), 64 experts of width 256 with 8 chosen per
//!   token, vocabulary 32768; about 0.39 B parameters are read per token.
//!
//! `cargo run --release --example bench_snapshots -- smollm2|moe OUT`

use std::path::PathBuf;
use std::process::ExitCode;

use gturbo_testkit::replica::{LlamaSpec, Qwen3MoeSpec, write_llama, write_qwen3_moe};

fn main() -> ExitCode {
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    let (Some(kind), Some(out)) = (args.first().and_then(|k| k.to_str()), args.get(1)) else {
        eprintln!("usage: bench_snapshots smollm2|moe OUT");
        return ExitCode::from(2);
    };
    let out = PathBuf::from(out);
    let written = match kind {
        "smollm2" => write_llama(
            &out,
            &LlamaSpec {
                hidden_size: 576,
                num_hidden_layers: 30,
                num_attention_heads: 9,
                num_key_value_heads: 3,
                intermediate_size: 1536,
                vocab_size: 49152,
                tie_word_embeddings: true,
                shards: 1,
                seed: 1,
            },
        ),
        "moe" => write_qwen3_moe(
            &out,
            &Qwen3MoeSpec {
                hidden_size: 2048,
                num_hidden_layers: 14,
                num_attention_heads: 16,
                num_key_value_heads: 4,
                head_dim: 128,
                num_experts: 64,
                num_experts_per_tok: 8,
                moe_intermediate_size: 256,
                vocab_size: 32768,
                shards: 4,
                seed: 1,
            },
        ),
        _ => {
            eprintln!("bench_snapshots: unknown model {kind:?} (smollm2 or moe)");
            return ExitCode::from(2);
        }
    };
    match written {
        Ok(summary) => {
            println!("{summary}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{}: {e}", out.display());
            ExitCode::from(2)
        }
    }
}
