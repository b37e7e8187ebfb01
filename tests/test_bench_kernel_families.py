"""bench/profile_step.py sorts a step's kernels into families by name (run 14's profile of the one-row step as the
example): inductor's fused Triton kernels by the ops they contain, library kernels by their own names."""

from __future__ import annotations

import pytest

from bench.profile_step import kernel_family


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("triton_red_fused__unsafe_view_add_mm_mul_silu_split_t_view_10", "gemm"),
        ("triton_per_fused__fused_rms_norm__to_copy__unsafe_view_add_mm_mul_t_view_9", "gemm"),
        ("triton_red_fused__softmax__to_copy_bitwise_not_exp_expand_masked_fill_mul_sub_sum_unsqueez", "softmax (attention, sampling)"),
        ("triton_per_fused__fused_rms_norm__to_copy_0", "rms norm"),
        ("triton_poi_fused__unsafe_view_arange_index_put_slice_unsqueeze_view_4", "cache write"),
        ("triton_poi_fused__unsafe_view_add_8", "other triton"),
        ("void at::native::radixSortKVInPlace<-2, -1, 32, 32, c10::BFloat16, long, unsigned int>(at:", "sort"),
        ("void at_cuda_detail::cub::detail::scan::DeviceScanKernel<at_cuda_detail::cub::detail::scan", "scan (top-p cumsum)"),
        ("nvjet_sm90_tst_8x64_64x16_2x1_v_bz_TNN", "gemm"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16", "gemm"),
        ("void at::native::_scatter_gather_elementwise_kernel<128, 8, at::native::_cuda_scatter_gath", "gather/scatter/index"),
        ("Memcpy DtoD (Device -> Device)", "copy"),
        ("_length_attention_split", "attention"),  # model.decode_attention's Triton kernels (not inductor's)
        ("_length_attention_merge", "attention"),
        ("_sort_rows", "sort"),  # model.small_sort's
        ("_gemv", "gemm"),  # model.gemv's
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>", "other"),
    ],
)  # fmt: skip
def test_kernel_families(name: str, family: str) -> None:
    assert kernel_family(name) == family
