//! Reads and writes through caller pointers. Callers must pass pointers that are null or
//! valid for the access, which is the NVML contract for every parameter; each helper
//! null-checks (`INVALID_ARGUMENT`) before touching memory.

// Raw pointer reads and writes of caller-owned memory.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_uint};

use super::{NvmlReturn, Placement, ret};

/// Writes `v` through `p`.
///
/// # Safety
/// `p` must be null or valid for a write of `T`.
pub(super) unsafe fn put<T>(p: *mut T, v: T) -> Result<(), NvmlReturn> {
    if p.is_null() {
        return Err(ret::INVALID_ARGUMENT);
    }
    // SAFETY: non-null and valid for writes per this function's contract.
    unsafe { p.write_unaligned(v) };
    Ok(())
}

/// Copies `s` NUL-terminated into the caller's `len`-byte buffer.
///
/// # Safety
/// `buf` must be null or valid for writes of `len` bytes.
pub(super) unsafe fn put_str(buf: *mut c_char, len: c_uint, s: &str) -> Result<(), NvmlReturn> {
    if buf.is_null() {
        return Err(ret::INVALID_ARGUMENT);
    }
    let bytes = s.as_bytes();
    if (len as usize) < bytes.len() + 1 {
        return Err(ret::INSUFFICIENT_SIZE);
    }
    // SAFETY: `buf` has room for `len >= bytes.len() + 1` bytes per the contract, and the
    // source is a distinct Rust allocation.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buf, bytes.len());
        buf.add(bytes.len()).write(0);
    }
    Ok(())
}

/// Reads a NUL-terminated string.
///
/// # Safety
/// `p` must be null or point to a NUL-terminated string.
pub(super) unsafe fn get_str(p: *const c_char) -> Result<String, NvmlReturn> {
    if p.is_null() {
        return Err(ret::INVALID_ARGUMENT);
    }
    // SAFETY: non-null and NUL-terminated per this function's contract.
    let s = unsafe { CStr::from_ptr(p) };
    Ok(s.to_string_lossy().into_owned())
}

/// Reads the `version` field (first `unsigned int`) of a versioned struct.
///
/// # Safety
/// `p` must be null or valid for a read of a `c_uint`.
pub(super) unsafe fn get_version(p: *const c_uint) -> Result<c_uint, NvmlReturn> {
    if p.is_null() {
        return Err(ret::INVALID_ARGUMENT);
    }
    // SAFETY: non-null and readable per this function's contract.
    Ok(unsafe { p.read_unaligned() })
}

/// Reads a caller's placement struct.
///
/// # Safety
/// `p` must be null or valid for a read of `Placement`.
pub(super) unsafe fn get_placement(p: *const Placement) -> Result<Placement, NvmlReturn> {
    if p.is_null() {
        return Err(ret::INVALID_ARGUMENT);
    }
    // SAFETY: non-null and readable per this function's contract.
    Ok(unsafe { p.read_unaligned() })
}

/// `s` as a NUL-terminated fixed-size C string, cut to fit.
pub(super) fn fixed<const N: usize>(s: &str) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    for (o, b) in out.iter_mut().zip(s.bytes().take(N - 1)) {
        *o = b as c_char;
    }
    out
}
