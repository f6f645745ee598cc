//! `config.json` → architecture axes, on arbitrary bytes: what every built-in family's
//! planner stage makes of the config may be refused, but never panics, and what it
//! accepts obeys the shared axis rules the runtime and verify-install apply (so an
//! install can never carry axes that `run` refuses or sizes memory from unchecked).

#![no_main]

use gturbo::family::Family;
use gturbo::family::axes::{self, Rule};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(config) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    // The rules on their own, on any object (the manifest's `arch.axes` is one).
    if let Ok(map) = serde_json::from_value(config.clone()) {
        let _ = axes::check(&map);
    }
    for family in Family::all_builtin().expect("the built-in families parse") {
        let Ok(arch) = gturbo::plan::arch_from_config(&family, &config) else {
            continue;
        };
        axes::check(&arch.axes).expect("an accepted config passes the shared rules");
        for (axis, v) in &arch.axes {
            if let (Rule::Count { max }, Some(n)) = (axes::rule(axis), v.as_u64()) {
                assert!((1..=max).contains(&n), "{axis} = {n} accepted");
            }
            if let Rule::Count { .. } = axes::rule(axis) {
                assert!(v.is_null() || v.is_u64(), "{axis} = {v} accepted as a count");
            }
        }
    }
});
