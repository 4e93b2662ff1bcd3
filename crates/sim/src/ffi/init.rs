//! Exports: initialisation, shutdown, error strings and system queries (driver, NVML and
//! CUDA versions).

// Exports of the C ABI: `no_mangle` and caller-owned memory behind raw pointers.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int, c_uint};

use super::NvmlReturn;
use super::library::{guard, init, shutdown, state};
use super::pointers::{put, put_str};

/// `nvmlInit_v2`: initialise (reference counted).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    guard(init)
}

/// `nvmlInit` (legacy name of `nvmlInit_v2`).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit() -> NvmlReturn {
    nvmlInit_v2()
}

/// `nvmlInitWithFlags`: flags are accepted and ignored.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> NvmlReturn {
    nvmlInit_v2()
}

/// `nvmlShutdown`: drops one reference.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    guard(shutdown)
}

/// `nvmlErrorString`: static description of a return code (works without init).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: NvmlReturn) -> *const c_char {
    let s: &'static CStr = match result {
        0 => c"Success",
        1 => c"Uninitialized",
        2 => c"Invalid Argument",
        3 => c"Not Supported",
        4 => c"Insufficient Permissions",
        5 => c"Already Initialized",
        6 => c"Not Found",
        7 => c"Insufficient Size",
        8 => c"Insufficient External Power",
        9 => c"Driver Not Loaded",
        10 => c"Timeout",
        11 => c"Interrupt request issue",
        12 => c"NVML Shared Library Not Found",
        13 => c"Function Not Found",
        14 => c"Corrupted infoROM",
        15 => c"GPU is lost",
        16 => c"GPU requires restart",
        17 => c"The operating system has blocked the request.",
        18 => c"RM has detected an NVML/RM version mismatch.",
        19 => c"In use by another client",
        20 => c"Insufficient Memory",
        21 => c"No data",
        22 => c"The requested vgpu operation is not available on target device, because ECC is enabled",
        23 => c"Insufficient Resources",
        24 => c"Frequency not supported",
        25 => c"Argument version mismatch",
        26 => c"Deprecated",
        27 => c"Not Ready",
        28 => c"GPU not found",
        29 => c"Invalid state",
        _ => c"Unknown Error",
    };
    s.as_ptr()
}

/// `nvmlSystemGetDriverVersion`.
///
/// # Safety
/// `version` must be valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        // SAFETY: caller contract (buffer of `length` bytes).
        unsafe { put_str(version, length, &st.profile.driver_version) }
    })
}

/// `nvmlSystemGetNVMLVersion`: `13.<driver version>`.
///
/// # Safety
/// `version` must be valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(
    version: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        let v = format!(
            "{}.{}",
            st.profile.cuda_driver_version / 1000,
            st.profile.driver_version
        );
        // SAFETY: caller contract (buffer of `length` bytes).
        unsafe { put_str(version, length, &v) }
    })
}

/// `nvmlSystemGetCudaDriverVersion`.
///
/// # Safety
/// `version` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) -> NvmlReturn {
    guard(|| {
        let st = state()?;
        // SAFETY: caller contract (out-parameter).
        unsafe { put(version, st.profile.cuda_driver_version as c_int) }
    })
}

/// `nvmlSystemGetCudaDriverVersion_v2`.
///
/// # Safety
/// `version` must be null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> NvmlReturn {
    // SAFETY: same contract.
    unsafe { nvmlSystemGetCudaDriverVersion(version) }
}

#[cfg(test)]
mod tests {
    use super::super::ret;
    use super::*;

    #[test]
    fn calls_before_init_are_uninitialized() {
        let mut n: c_uint = 0;
        // SAFETY: valid out-pointer.
        let r = unsafe { super::super::device::nvmlDeviceGetCount_v2(&mut n) };
        // The unit-test process never calls nvmlInit.
        assert_eq!(r, ret::UNINITIALIZED);
        assert_eq!(nvmlShutdown(), ret::UNINITIALIZED);
    }

    #[test]
    fn error_strings_are_static_c_strings() {
        // SAFETY: nvmlErrorString returns a static NUL-terminated string.
        let s = unsafe { CStr::from_ptr(nvmlErrorString(ret::INSUFFICIENT_SIZE)) };
        assert_eq!(s.to_str(), Ok("Insufficient Size"));
    }
}
