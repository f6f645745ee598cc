//! Embeds every `families/*.json` into the binary, so adding a family is adding a file.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    println!("cargo:rerun-if-changed=../../families");
    let dir = Path::new("../../families");
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("families/ folder")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".json"))
        .collect();
    names.sort();
    let mut out =
        String::from("/// Every family file shipped with gturbo: (file name, JSON text).\n");
    out.push_str("pub const EMBEDDED: &[(&str, &str)] = &[\n");
    for n in &names {
        println!("cargo:rerun-if-changed=../../families/{n}");
        let path = std::fs::canonicalize(dir.join(n)).expect("family path");
        writeln!(
            out,
            "    ({n:?}, include_str!({:?})),",
            path.display().to_string()
        )
        .unwrap();
    }
    out.push_str("];\n");
    let dest = Path::new(&std::env::var("OUT_DIR").unwrap()).join("families.rs");
    std::fs::write(dest, out).unwrap();
}
