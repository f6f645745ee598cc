//! `parse_header` on arbitrary bytes: it may refuse anything, but must never panic.
//!
//! Input layout: the first 8 bytes (little-endian, zero-padded when short) are the
//! claimed file size; the rest is what the source returned from offset 0.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (size, bytes) = data.split_at(data.len().min(8));
    let mut le = [0u8; 8];
    le[..size.len()].copy_from_slice(size);
    let file_size = u64::from_le_bytes(le);
    if let Ok(header) = gturbo::header::parse_header("fuzz.safetensors", file_size, bytes) {
        // What the parser accepted must hold together: contiguous spans from 0 that
        // end exactly at the end of the file.
        let mut cursor = 0u64;
        for t in &header.tensors {
            assert_eq!(t.data.start, cursor, "tensor {} not contiguous", t.name);
            cursor = t.data.end;
        }
        assert_eq!(header.data_start() + cursor, header.file_size);
    }
});
