//! Why a GPU operation could not run.

use crate::runtime::kernels::KernelError;

/// Why a GPU operation could not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuError {
    /// wgpu found no adapter on any backend.
    #[error(
        "no GPU adapter found (wgpu looked for Vulkan, Metal and DX12 devices; on Linux \
         install a Vulkan driver, e.g. Mesa's mesa-vulkan-drivers for a software device)"
    )]
    NoAdapter,
    /// The adapter asked for by name or index is not there.
    #[error("no GPU adapter matches {wanted:?}; wgpu sees: {available}")]
    AdapterNotFound {
        /// What was asked for.
        wanted: String,
        /// The adapters that exist, one `index: name (backend)` each.
        available: String,
    },
    /// The adapter refused to open a device.
    #[error("GPU adapter {adapter} could not open a device: {message}")]
    Device {
        /// Adapter name.
        adapter: String,
        /// wgpu's message.
        message: String,
    },
    /// A kernel failed to compile or a dispatch failed validation.
    #[error("GPU kernel {kernel}: {message}")]
    Kernel {
        /// `file:entry` of the kernel.
        kernel: String,
        /// wgpu's message.
        message: String,
    },
    /// The device reported an error while running recorded work.
    #[error("GPU device error: {0}")]
    Runtime(String),
    /// A buffer larger than the adapter allows.
    #[error("{what} needs {bytes} bytes; the adapter allows at most {limit} per buffer")]
    TooLarge {
        /// What the buffer holds.
        what: String,
        /// Bytes needed.
        bytes: u64,
        /// The adapter's limit.
        limit: u64,
    },
    /// Operands whose shapes do not fit the operation.
    #[error("{op}: {message}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// What does not fit.
        message: String,
    },
    /// A weight matrix whose bytes do not agree with its shape.
    #[error(transparent)]
    Matrix(#[from] KernelError),
}

/// Results of GPU operations.
pub type Result<T> = std::result::Result<T, GpuError>;
