//! Fuzz target: arbitrary bytes -> JSON and YAML -> decode -> validate, plus the object
//! walker and the quantity parser. Nothing may panic; decoded configs must validate and
//! their canonical form must decode to the same config.
#![no_main]

use gpu_dra_api::{ClaimDevice, decode, decode_yaml, objects, quantity::Quantity, validate_for_devices};
use libfuzzer_sys::fuzz_target;

fn check(config: &gpu_dra_api::Config) {
    assert!(config.validate().is_ok(), "decoded config fails validate: {config:?}");
    assert_eq!(
        decode(&config.to_parameters()).as_ref(),
        Ok(config),
        "canonical form does not round-trip"
    );
    let devices = [
        ClaimDevice::gpu("GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c"),
        ClaimDevice::mig("MIG-cd8ad1b9-d0c3-5bbc-9a4b-93c2e5c9b0f1"),
    ];
    let _ = validate_for_devices(config, &devices);
    let _ = validate_for_devices(config, &devices[..1]);
    let _ = validate_for_devices(config, &[]);
}

fuzz_target!(|data: &[u8]| {
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) {
        if let Ok(config) = decode(&value) {
            check(&config);
        }
        let _ = objects::check_object(&value, "gpu.nvidia.com");
        let _ = objects::object_label(&value);
    }
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(config) = decode_yaml(text) {
            check(&config);
        }
        if let Ok(q) = Quantity::parse(text) {
            let _ = q.to_bytes_ceil();
            let shown = q.to_string();
            let again = Quantity::parse(&shown).expect("canonical display parses");
            assert_eq!(again.to_bytes_ceil(), q.to_bytes_ceil(), "{text} -> {shown}");
        }
    }
});
