//! Why a plan cannot be made.

/// Why a plan cannot be made. Each names the tensor, file or field.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// No family rule matches a tensor.
    #[error(
        "{shard}: tensor `{tensor}` matches no rule of {family_file}; refusing to drop it silently (add a rule, or `excluded` with a reason)"
    )]
    Unmatched {
        /// Shard.
        shard: String,
        /// Tensor.
        tensor: String,
        /// Family file.
        family_file: String,
    },
    /// A tensor's dtype or shape does not fit its role.
    #[error("{shard}: tensor `{tensor}`: field `{field}`: {detail}")]
    Tensor {
        /// Shard.
        shard: String,
        /// Tensor.
        tensor: String,
        /// Field (`shape`, `dtype`).
        field: String,
        /// What is wrong.
        detail: String,
    },
    /// The same name in two shards.
    #[error("tensor `{tensor}` appears in both {first} and {second}")]
    Duplicate {
        /// Tensor.
        tensor: String,
        /// First shard.
        first: String,
        /// Second shard.
        second: String,
    },
    /// An expert or row pool is incomplete or inconsistent.
    #[error("{pool}: {detail}")]
    Pool {
        /// Pool file.
        pool: String,
        /// What is wrong.
        detail: String,
    },
    /// A config value is missing or absurd.
    #[error("config.json: field `{field}`: {detail}")]
    Config {
        /// Field path.
        field: String,
        /// What is wrong.
        detail: String,
    },
    /// A tokenizer or config file to copy is larger than any real one.
    #[error(
        "{file}: {bytes} bytes, more than the {max} {what} may have; refusing before any weight is read"
    )]
    CopiedTooLarge {
        /// Path in the repo.
        file: String,
        /// Size from the listing.
        bytes: u64,
        /// The bound ([`copied_max_bytes`](super::copied_max_bytes)).
        max: u64,
        /// What the bound is for.
        what: &'static str,
    },
    /// Sizes overflow.
    #[error("{what}: sizes overflow 64 bits")]
    Overflow {
        /// What was being sized.
        what: String,
    },
}
