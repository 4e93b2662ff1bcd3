//! `CUresult` codes of `cuda.h` that the simulated driver returns, with the names and
//! descriptions `cuGetErrorName` and `cuGetErrorString` give for them (the values and names
//! are CUDA's; the descriptions are shortened from `cuda.h`'s comments).

/// A `CUresult` (`cuda.h`: `typedef enum cudaError_enum CUresult`, an `int`-sized enum).
pub type CuResult = i32;

/// `CUDA_SUCCESS`.
pub const SUCCESS: CuResult = 0;
/// `CUDA_ERROR_INVALID_VALUE`.
pub const INVALID_VALUE: CuResult = 1;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const OUT_OF_MEMORY: CuResult = 2;
/// `CUDA_ERROR_NOT_INITIALIZED`.
pub const NOT_INITIALIZED: CuResult = 3;
/// `CUDA_ERROR_DEVICE_UNAVAILABLE`: the device is in `EXCLUSIVE_PROCESS` or `PROHIBITED`
/// compute mode and cannot take this context (the runtime's `cudaErrorDevicesUnavailable`,
/// also 46).
pub const DEVICE_UNAVAILABLE: CuResult = 46;
/// `CUDA_ERROR_NO_DEVICE`.
pub const NO_DEVICE: CuResult = 100;
/// `CUDA_ERROR_INVALID_DEVICE`.
pub const INVALID_DEVICE: CuResult = 101;
/// `CUDA_ERROR_INVALID_IMAGE`.
pub const INVALID_IMAGE: CuResult = 200;
/// `CUDA_ERROR_INVALID_CONTEXT`.
pub const INVALID_CONTEXT: CuResult = 201;
/// `CUDA_ERROR_INVALID_PTX`.
pub const INVALID_PTX: CuResult = 218;
/// `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`.
pub const UNSUPPORTED_PTX_VERSION: CuResult = 222;
/// `CUDA_ERROR_INVALID_HANDLE`.
pub const INVALID_HANDLE: CuResult = 400;
/// `CUDA_ERROR_NOT_FOUND`.
pub const NOT_FOUND: CuResult = 500;
/// `CUDA_ERROR_ILLEGAL_ADDRESS`.
pub const ILLEGAL_ADDRESS: CuResult = 700;
/// `CUDA_ERROR_LAUNCH_TIMEOUT`.
pub const LAUNCH_TIMEOUT: CuResult = 702;
/// `CUDA_ERROR_MISALIGNED_ADDRESS`.
pub const MISALIGNED_ADDRESS: CuResult = 716;
/// `CUDA_ERROR_NOT_SUPPORTED`.
pub const NOT_SUPPORTED: CuResult = 801;
/// `CUDA_ERROR_SYSTEM_DRIVER_MISMATCH`: the library's version is not the kernel module's.
pub const SYSTEM_DRIVER_MISMATCH: CuResult = 803;
/// `CUDA_ERROR_UNKNOWN`.
pub const UNKNOWN: CuResult = 999;

/// Every code above: (value, name, description).
const TABLE: &[(CuResult, &str, &str)] = &[
    (SUCCESS, "CUDA_SUCCESS", "no error"),
    (
        INVALID_VALUE,
        "CUDA_ERROR_INVALID_VALUE",
        "invalid argument",
    ),
    (OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"),
    (
        NOT_INITIALIZED,
        "CUDA_ERROR_NOT_INITIALIZED",
        "initialization error",
    ),
    (
        DEVICE_UNAVAILABLE,
        "CUDA_ERROR_DEVICE_UNAVAILABLE",
        "CUDA-capable device(s) is/are busy or unavailable",
    ),
    (
        NO_DEVICE,
        "CUDA_ERROR_NO_DEVICE",
        "no CUDA-capable device is detected",
    ),
    (
        INVALID_DEVICE,
        "CUDA_ERROR_INVALID_DEVICE",
        "invalid device ordinal",
    ),
    (
        INVALID_IMAGE,
        "CUDA_ERROR_INVALID_IMAGE",
        "device kernel image is invalid",
    ),
    (
        INVALID_CONTEXT,
        "CUDA_ERROR_INVALID_CONTEXT",
        "invalid device context",
    ),
    (
        INVALID_PTX,
        "CUDA_ERROR_INVALID_PTX",
        "a PTX JIT compilation failed",
    ),
    (
        UNSUPPORTED_PTX_VERSION,
        "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
        "the provided PTX was compiled with an unsupported toolchain.",
    ),
    (
        INVALID_HANDLE,
        "CUDA_ERROR_INVALID_HANDLE",
        "invalid resource handle",
    ),
    (NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"),
    (
        ILLEGAL_ADDRESS,
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "an illegal memory access was encountered",
    ),
    (
        LAUNCH_TIMEOUT,
        "CUDA_ERROR_LAUNCH_TIMEOUT",
        "the launch timed out and was terminated",
    ),
    (
        MISALIGNED_ADDRESS,
        "CUDA_ERROR_MISALIGNED_ADDRESS",
        "misaligned address",
    ),
    (
        NOT_SUPPORTED,
        "CUDA_ERROR_NOT_SUPPORTED",
        "operation not supported",
    ),
    (
        SYSTEM_DRIVER_MISMATCH,
        "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        "system has unsupported display driver / cuda driver combination",
    ),
    (UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"),
];

/// `cuGetErrorName`'s answer for `code` (`None`: not a code this driver knows, for which
/// the real one answers `CUDA_ERROR_INVALID_VALUE`).
pub fn name(code: CuResult) -> Option<&'static str> {
    TABLE
        .iter()
        .find(|(c, _, _)| *c == code)
        .map(|(_, n, _)| *n)
}

/// `cuGetErrorString`'s answer for `code`.
pub fn description(code: CuResult) -> Option<&'static str> {
    TABLE
        .iter()
        .find(|(c, _, _)| *c == code)
        .map(|(_, _, d)| *d)
}

/// The code named `name` (for tests and tools).
pub fn by_name(name: &str) -> Option<CuResult> {
    TABLE
        .iter()
        .find(|(_, n, _)| *n == name)
        .map(|(c, _, _)| *c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_values_are_cudas() {
        assert_eq!(
            name(DEVICE_UNAVAILABLE),
            Some("CUDA_ERROR_DEVICE_UNAVAILABLE")
        );
        assert_eq!(by_name("CUDA_ERROR_INVALID_PTX"), Some(218));
        assert_eq!(by_name("CUDA_ERROR_OUT_OF_MEMORY"), Some(2));
        assert_eq!(name(12345), None);
        let mut codes: Vec<_> = TABLE.iter().map(|(c, _, _)| *c).collect();
        codes.dedup();
        assert_eq!(codes.len(), TABLE.len(), "a code twice");
    }
}
