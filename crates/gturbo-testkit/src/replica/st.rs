//! A hand-written safetensors writer and the shard-split rules, independent of
//! gturbo's own header parser so that the fixtures test that parser instead of
//! agreeing with it by construction.
//!
//! Each shard file is `[u64 LE n][n bytes of JSON header][data]`. The header holds
//! `__metadata__` first, then the tensors in data order; it is padded with spaces so
//! that `n` is a multiple of 8. Data regions are contiguous and follow the order the
//! `safetensors` Python/Rust writers use: dtype descending (I64 before BF16), then
//! name, compared as bytes.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufWriter, Seek, SeekFrom, Write};
use std::path::Path;

use half::bf16;

/// Element types the replicas use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum StDtype {
    // Declaration order is the safetensors writer's dtype order (ascending: the `Dtype`
    // enum of the safetensors crate lists U8, …, F8_E4M3, …, BF16, I32, …, F32, …,
    // I64); shards sort by it descending.
    U8,
    F8E4M3,
    Bf16,
    I32,
    F32,
    I64,
}

impl StDtype {
    pub(crate) fn size(self) -> u64 {
        match self {
            StDtype::U8 | StDtype::F8E4M3 => 1,
            StDtype::Bf16 => 2,
            StDtype::I32 | StDtype::F32 => 4,
            StDtype::I64 => 8,
        }
    }

    fn label(self) -> &'static str {
        match self {
            StDtype::U8 => "U8",
            StDtype::F8E4M3 => "F8_E4M3",
            StDtype::Bf16 => "BF16",
            StDtype::I32 => "I32",
            StDtype::F32 => "F32",
            StDtype::I64 => "I64",
        }
    }
}

/// How a tensor's values are made when data is written.
#[derive(Debug, Clone)]
pub(crate) enum Init {
    /// `center + N(0, 1) × std`, per element (approximately normal).
    Normal { center: f32, std: f32 },
    /// Exact integer values (I64 tables, I32 shape records) stored little-endian at
    /// the tensor's width; written even into hole-only replicas because they are tiny
    /// and a planner may want to read them.
    Ints(Vec<i64>),
    /// No values: the tensor exists only in hole-only replicas (FP8, packed codes).
    Holes,
}

/// One tensor of a checkpoint, in state-dict order.
#[derive(Debug, Clone)]
pub(crate) struct TensorDef {
    pub(crate) name: String,
    pub(crate) dtype: StDtype,
    pub(crate) shape: Vec<u64>,
    pub(crate) init: Init,
}

impl TensorDef {
    /// A BF16 tensor of N(0, 0.02) values (the usual init scale).
    pub(crate) fn bf16(name: impl Into<String>, shape: &[u64]) -> Self {
        TensorDef {
            name: name.into(),
            dtype: StDtype::Bf16,
            shape: shape.to_vec(),
            init: Init::Normal {
                center: 0.0,
                std: 0.02,
            },
        }
    }

    /// A BF16 tensor of values near `center` (norm weights that are not offsets).
    pub(crate) fn bf16_around(name: impl Into<String>, shape: &[u64], center: f32) -> Self {
        TensorDef {
            init: Init::Normal { center, std: 0.02 },
            ..TensorDef::bf16(name, shape)
        }
    }

    /// A 1-D I64 table.
    pub(crate) fn i64s(name: impl Into<String>, values: Vec<i64>) -> Self {
        TensorDef {
            name: name.into(),
            dtype: StDtype::I64,
            shape: vec![values.len() as u64],
            init: Init::Ints(values),
        }
    }

    /// A tensor of any dtype whose data is left as a hole (header-only replicas).
    pub(crate) fn hole(name: impl Into<String>, dtype: StDtype, shape: &[u64]) -> Self {
        TensorDef {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            init: Init::Holes,
        }
    }

    pub(crate) fn nbytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * self.dtype.size()
    }
}

/// Whether shard data regions hold values or are left as holes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataMode {
    /// Headers only: each file is extended with `set_len`, so the data region is a
    /// hole (sparse on every common filesystem). Small I64 tables are still written.
    Holes,
    /// Every byte written, from a PRNG seeded with `seed` (same seed, same bytes).
    Random {
        /// PRNG seed; each tensor's stream is derived from it and the tensor's name.
        seed: u64,
    },
}

/// How tensors are grouped into shard files, always in state-dict order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardRule {
    /// The Hugging Face rule (`huggingface_hub.split_torch_state_dict_into_shards`
    /// with `max_shard_size`): walk tensors in order; a tensor larger than the limit
    /// gets a shard of its own, listed at once (before the shard being filled);
    /// otherwise close the current shard when adding the tensor would exceed the limit.
    MaxBytes(u64),
    /// Exactly this many non-empty shards, cut where the running byte count crosses
    /// `k × total / count`. `1` writes a single `model.safetensors` and no index.
    Count(usize),
}

/// What [`write_checkpoint`] wrote.
#[derive(Debug, Clone)]
pub(crate) struct CheckpointFiles {
    /// File names of the weight files, in shard order.
    pub(crate) shards: Vec<String>,
    /// Index file name, if one was written.
    pub(crate) index: Option<String>,
    pub(crate) tensors: usize,
    pub(crate) total_size: u64,
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// Group tensor indices into shards per `rule`.
pub(crate) fn split(tensors: &[TensorDef], rule: ShardRule) -> io::Result<Vec<Vec<usize>>> {
    let mut shards: Vec<Vec<usize>> = Vec::new();
    match rule {
        ShardRule::MaxBytes(max) => {
            let mut current: Vec<usize> = Vec::new();
            let mut current_size = 0u64;
            for (i, t) in tensors.iter().enumerate() {
                let size = t.nbytes();
                if size > max {
                    shards.push(vec![i]);
                    continue;
                }
                if current_size + size > max && !current.is_empty() {
                    shards.push(std::mem::take(&mut current));
                    current_size = 0;
                }
                current.push(i);
                current_size += size;
            }
            if !current.is_empty() {
                shards.push(current);
            }
        }
        ShardRule::Count(count) => {
            if count == 0 || count > tensors.len() {
                return Err(invalid(format!(
                    "cannot split {} tensors into {count} non-empty shards",
                    tensors.len()
                )));
            }
            let total: u64 = tensors.iter().map(TensorDef::nbytes).sum();
            let mut seen = 0u64;
            let mut current: Vec<usize> = Vec::new();
            for (i, t) in tensors.iter().enumerate() {
                let k = shards.len() as u64 + 1;
                let left_after = tensors.len() - i;
                let shards_after = count - shards.len() - 1;
                let crossed = u128::from(seen) * count as u128 >= u128::from(total) * u128::from(k);
                if !current.is_empty()
                    && shards_after > 0
                    && (crossed || left_after == shards_after)
                {
                    shards.push(std::mem::take(&mut current));
                }
                current.push(i);
                seen += t.nbytes();
            }
            shards.push(current);
        }
    }
    if shards.is_empty() {
        return Err(invalid("a checkpoint needs at least one tensor".into()));
    }
    Ok(shards)
}

/// How shard files are numbered. The Hugging Face writers number from 1 with five
/// digits each side; some repos were written by other tools and differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ShardNaming {
    /// Number of the first shard (1, or 0 for gpt-oss and MiniMax-M2).
    pub(crate) first: usize,
    /// Digits of the total (5, or 6 for DeepSeek-V3 and Kimi-K2: `-of-000163`).
    pub(crate) total_width: usize,
    /// The total written in the names when it is not the shard count (MiniMax-M2 names
    /// 125 files `-of-00130`; gpt-oss names 15 files `-of-00014`).
    pub(crate) total: Option<usize>,
}

impl ShardNaming {
    /// `model-00001-of-00131.safetensors` (`model.safetensors` for a single file).
    pub(crate) const HF: ShardNaming = ShardNaming {
        first: 1,
        total_width: 5,
        total: None,
    };

    pub(crate) fn name(self, index: usize, count: usize) -> String {
        if count == 1 {
            return "model.safetensors".to_string();
        }
        format!(
            "model-{:05}-of-{:0w$}.safetensors",
            index + self.first,
            self.total.unwrap_or(count),
            w = self.total_width
        )
    }
}

/// Write the shards (and `model.safetensors.index.json` when there are several).
pub(crate) fn write_checkpoint(
    dir: &Path,
    tensors: &[TensorDef],
    rule: ShardRule,
    mode: DataMode,
) -> io::Result<CheckpointFiles> {
    let groups = split(tensors, rule)?;
    write_groups(dir, tensors, &groups, ShardNaming::HF, mode)
}

/// Write `groups` (tensor indices per shard, each in state-dict order) as shards named
/// by `naming`, and the index when there are several.
pub(crate) fn write_groups(
    dir: &Path,
    tensors: &[TensorDef],
    groups: &[Vec<usize>],
    naming: ShardNaming,
    mode: DataMode,
) -> io::Result<CheckpointFiles> {
    let count = groups.len();
    let mut names = Vec::with_capacity(count);
    let mut weight_map: BTreeMap<&str, String> = BTreeMap::new();
    for (s, group) in groups.iter().enumerate() {
        let name = naming.name(s, count);
        let mut members: Vec<&TensorDef> = group.iter().map(|&i| &tensors[i]).collect();
        members.sort_by(|a, b| b.dtype.cmp(&a.dtype).then_with(|| a.name.cmp(&b.name)));
        for t in &members {
            if weight_map.insert(&t.name, name.clone()).is_some() {
                return Err(invalid(format!("duplicate tensor name {}", t.name)));
            }
        }
        write_shard(&dir.join(&name), &members, mode)?;
        names.push(name);
    }
    let total_size: u64 = tensors.iter().map(TensorDef::nbytes).sum();
    let index = if count > 1 {
        let index = serde_json::json!({
            "metadata": { "total_size": total_size },
            "weight_map": weight_map,
        });
        let name = "model.safetensors.index.json".to_string();
        write_json(&dir.join(&name), &index)?;
        Some(name)
    } else {
        None
    };
    Ok(CheckpointFiles {
        shards: names,
        index,
        tensors: tensors.len(),
        total_size,
    })
}

/// Pretty JSON with a trailing newline, as `json.dumps(indent=2) + "\n"` writes it.
pub(crate) fn write_json(path: &Path, value: &serde_json::Value) -> io::Result<()> {
    let mut text = serde_json::to_string_pretty(value).map_err(io::Error::other)?;
    text.push('\n');
    std::fs::write(path, text)
}

/// The header bytes (length prefix included) for tensors already in data order.
pub(crate) fn header_bytes(members: &[&TensorDef]) -> Vec<u8> {
    let mut json = String::from(r#"{"__metadata__":{"format":"pt"}"#);
    let mut offset = 0u64;
    for t in members {
        let end = offset + t.nbytes();
        let shape: Vec<String> = t.shape.iter().map(u64::to_string).collect();
        // serde_json quotes and escapes the name; the rest is plain numbers.
        let quoted = serde_json::Value::String(t.name.clone()).to_string();
        json.push_str(&format!(
            r#",{quoted}:{{"dtype":"{}","shape":[{}],"data_offsets":[{offset},{end}]}}"#,
            t.dtype.label(),
            shape.join(",")
        ));
        offset = end;
    }
    json.push('}');
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out
}

fn write_shard(path: &Path, members: &[&TensorDef], mode: DataMode) -> io::Result<()> {
    let header = header_bytes(members);
    let data_len: u64 = members.iter().map(|t| t.nbytes()).sum();
    let file = File::create(path)?;
    match mode {
        DataMode::Holes => {
            let mut file = file;
            file.write_all(&header)?;
            let mut offset = header.len() as u64;
            for t in members {
                if let Init::Ints(values) = &t.init {
                    file.seek(SeekFrom::Start(offset))?;
                    file.write_all(&int_bytes(values, t.dtype))?;
                }
                offset += t.nbytes();
            }
            file.set_len(header.len() as u64 + data_len)?;
        }
        DataMode::Random { seed } => {
            let mut out = BufWriter::with_capacity(1 << 20, file);
            out.write_all(&header)?;
            for t in members {
                write_values(&mut out, t, seed)?;
            }
            out.flush()?;
        }
    }
    Ok(())
}

/// Little-endian integers at the dtype's width (I64, or I32 truncating, which the
/// small shape records never need).
fn int_bytes(values: &[i64], dtype: StDtype) -> Vec<u8> {
    match dtype {
        StDtype::I32 => values
            .iter()
            .flat_map(|&v| (v as i32).to_le_bytes())
            .collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

fn write_values(out: &mut impl Write, t: &TensorDef, seed: u64) -> io::Result<()> {
    let elements: u64 = t.shape.iter().product();
    match (&t.init, t.dtype) {
        (Init::Ints(values), StDtype::I64 | StDtype::I32) if values.len() as u64 == elements => {
            out.write_all(&int_bytes(values, t.dtype))
        }
        (Init::Normal { center, std }, StDtype::Bf16) => {
            let mut rng = SplitMix64::new(seed ^ fnv1a(t.name.as_bytes()));
            // A fixed buffer filled by index: the replica is mostly written from debug
            // test builds, where per-element Vec pushes cost more than the PRNG.
            let mut buf = [0u8; 32 * 1024];
            let mut left = elements;
            while left > 0 {
                let n = left.min(buf.len() as u64 / 2) as usize;
                for pair in buf[..2 * n].chunks_exact_mut(2) {
                    let v = center + rng.normal() * std;
                    pair.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
                }
                out.write_all(&buf[..2 * n])?;
                left -= n as u64;
            }
            Ok(())
        }
        _ => Err(invalid(format!(
            "tensor {}: init does not fit dtype {} and shape {:?}",
            t.name,
            t.dtype.label(),
            t.shape
        ))),
    }
}

/// FNV-1a, to give each tensor its own PRNG stream independent of write order.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// splitmix64 (Steele, Lea, Flood 2014): tiny, fast and fully determined by its seed.
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Approximately standard normal: the Irwin–Hall sum of four 16-bit uniforms,
    /// centred and scaled to unit variance. One PRNG step per value keeps the scaled
    /// replica fast in debug builds; fixtures need plausible weights, not exact tails.
    pub(crate) fn normal(&mut self) -> f32 {
        let r = self.next_u64();
        // Written out rather than as an iterator: debug builds run this per element.
        let sum = (r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48);
        // Each uniform has mean 32767.5 and variance 65536²/12; four of them sum to a
        // variance of 65536²/3.
        (sum as f32 - 131_070.0) * (3.0f32.sqrt() / 65_536.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, bytes: u64) -> TensorDef {
        TensorDef::bf16(name, &[bytes / 2])
    }

    #[test]
    fn hf_rule_isolates_oversized_tensors_before_the_open_shard() {
        let ts = [t("a", 4), t("b", 4), t("big", 20), t("c", 4), t("d", 4)];
        let groups = split(&ts, ShardRule::MaxBytes(10)).unwrap();
        assert_eq!(groups, vec![vec![2], vec![0, 1], vec![3, 4]]);
    }

    #[test]
    fn count_rule_gives_exactly_n_non_empty_shards() {
        let ts = [t("a", 100), t("b", 2), t("c", 2), t("d", 2)];
        assert_eq!(
            split(&ts, ShardRule::Count(3)).unwrap(),
            vec![vec![0], vec![1], vec![2, 3]]
        );
        assert_eq!(
            split(&ts, ShardRule::Count(4)).unwrap(),
            vec![vec![0], vec![1], vec![2], vec![3]]
        );
        let err = split(&ts, ShardRule::Count(5)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot split 4 tensors into 5 non-empty shards"
        );
    }

    #[test]
    fn header_is_padded_to_eight_bytes_with_spaces() {
        let a = TensorDef::bf16("x", &[3]);
        let h = header_bytes(&[&a]);
        let n = u64::from_le_bytes(h[..8].try_into().unwrap()) as usize;
        assert_eq!(n % 8, 0);
        assert_eq!(h.len(), 8 + n);
        let text = std::str::from_utf8(&h[8..]).unwrap();
        assert_eq!(
            text.trim_end(),
            r#"{"__metadata__":{"format":"pt"},"x":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]}}"#
        );
    }

    #[test]
    fn normal_has_roughly_unit_variance() {
        let mut rng = SplitMix64::new(7);
        let n = 100_000;
        let xs: Vec<f64> = (0..n).map(|_| f64::from(rng.normal())).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var - 1.0).abs() < 0.03, "variance {var}");
    }
}
