//! The kernel the probe runs: `saxpy` (`y[i] = a * x[i] + y[i]` for `i < n`) as PTX text the
//! driver JIT-compiles, and the host side that fills its inputs and checks its output.
//!
//! The PTX is what `nvcc -ptx` emits for the obvious CUDA C kernel, written for PTX ISA 6.0
//! and `sm_50`, so every driver of the last years and every GPU since Maxwell accepts it.
//! The inputs are small integers, so the fused multiply-add is exact and the expected value
//! is computed on the host with the same operation: a result that differs in any bit is a
//! mismatch.

/// The kernel's entry name.
pub const ENTRY: &str = "saxpy";

/// Threads per block of the launch.
pub const BLOCK: u32 = 256;

/// The multiplier `a`.
pub const A: f32 = 3.0;

/// `saxpy(const float *x, float *y, float a, unsigned n)`, NUL-terminated for
/// `cuModuleLoadData`.
pub const PTX: &str = concat!(
    r#"//
// saxpy: y[i] = a * x[i] + y[i] for i < n
//
.version 6.0
.target sm_50
.address_size 64

.visible .entry saxpy(
	.param .u64 saxpy_param_0,
	.param .u64 saxpy_param_1,
	.param .f32 saxpy_param_2,
	.param .u32 saxpy_param_3
)
{
	.reg .pred 	%p<2>;
	.reg .f32 	%f<5>;
	.reg .b32 	%r<6>;
	.reg .b64 	%rd<8>;

	ld.param.u64 	%rd1, [saxpy_param_0];
	ld.param.u64 	%rd2, [saxpy_param_1];
	ld.param.f32 	%f1, [saxpy_param_2];
	ld.param.u32 	%r2, [saxpy_param_3];
	mov.u32 	%r3, %ctaid.x;
	mov.u32 	%r4, %ntid.x;
	mov.u32 	%r5, %tid.x;
	mad.lo.s32 	%r1, %r3, %r4, %r5;
	setp.ge.u32 	%p1, %r1, %r2;
	@%p1 bra 	$L__BB0_2;

	cvta.to.global.u64 	%rd3, %rd1;
	cvta.to.global.u64 	%rd4, %rd2;
	mul.wide.u32 	%rd5, %r1, 4;
	add.s64 	%rd6, %rd3, %rd5;
	ld.global.f32 	%f2, [%rd6];
	add.s64 	%rd7, %rd4, %rd5;
	ld.global.f32 	%f3, [%rd7];
	fma.rn.f32 	%f4, %f1, %f2, %f3;
	st.global.f32 	[%rd7], %f4;

$L__BB0_2:
	ret;
}
"#,
    "\0"
);

/// The inputs `x` and `y` for `n` elements: small integers, exact in `f32`.
pub fn inputs(n: u32) -> (Vec<f32>, Vec<f32>) {
    let x = (0..n).map(|i| (i % 1024) as f32).collect();
    let y = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
    (x, y)
}

/// How many elements of `out` differ from `a * x + y` (as one fused operation).
pub fn mismatches(x: &[f32], y: &[f32], out: &[f32]) -> u64 {
    let wrong = x
        .iter()
        .zip(y)
        .zip(out)
        .filter(|((x, y), o)| A.mul_add(**x, **y).to_bits() != o.to_bits())
        .count();
    (wrong + x.len().abs_diff(out.len())) as u64
}

/// Blocks of [`BLOCK`] threads covering `n` elements.
pub fn grid(n: u32) -> u32 {
    n.div_ceil(BLOCK).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_correct_result_has_no_mismatch_and_a_wrong_one_is_counted() {
        let (x, y) = inputs(1000);
        let good: Vec<f32> = x.iter().zip(&y).map(|(x, y)| A * x + y).collect();
        assert_eq!(mismatches(&x, &y, &good), 0);
        let mut bad = good.clone();
        bad[999] += 1.0;
        bad[0] = f32::from_bits(bad[0].to_bits() ^ 1);
        assert_eq!(mismatches(&x, &y, &bad), 2);
        // Untouched output matches only where x is 0 (element 0).
        assert_eq!(mismatches(&x, &y, &y), 999);
        assert_eq!(grid(1000), 4);
        assert_eq!(grid(1024), 4);
        assert!(PTX.ends_with("}\n\0"));
    }
}
