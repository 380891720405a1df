"""The op taxonomy shared by eager, the compiler, the profiler and the performance model: the
category of an aten op ("matmul", "elementwise", "gather", ...) from its name alone."""
from __future__ import annotations


def split_names(*words: str) -> tuple[str, ...]:
    """The op names of space-separated word lists, as one tuple."""
    return tuple(w for text in words for w in text.split())


_CATEGORY_NAMES: dict[str, tuple[str, ...]] = {
    "view": split_names(
        "view _unsafe_view as_strided reshape _reshape_alias expand expand_as permute transpose t",
        "squeeze unsqueeze select slice narrow split split_with_sizes chunk unbind alias detach",
        "resize resize_as set empty empty_strided empty_like new_empty new_empty_strided",
        "lift_fresh view_as_real view_as_complex real imag unfold diagonal movedim",
        "_neg_view _conj conj resolve_conj resolve_neg _nested_tensor_from_mask_left_aligned",
        "as_strided_scatter_view _indices _values"),
    "paged_attention": split_names("decode_attention"),
    # NKI-lib kernels with no aten counterpart, priced by simulating them (kernels/pricing_rope_ce.py)
    "nki_rope": split_names("rope"),
    "nki_linear_cross_entropy": split_names("linear_ce_fwd linear_ce_bwd ce_fwd ce_bwd"),
    "nki_norm_mlp": split_names("rmsnorm_linear_fwd rmsnorm_linear_bwd swiglu_fwd swiglu_bwd"),  # pricing_norm_mlp.py
    "matmul": split_names("mm addmm bmm baddbmm matmul linear _addmm_activation addbmm addmv mv dot",
                     "vdot outer ger _scaled_mm inner tensordot"),
    "conv": split_names("convolution convolution_overrideable _convolution conv1d conv2d conv3d",
                   "conv_transpose1d conv_transpose2d conv_transpose3d mkldnn_convolution",
                   "_slow_conv2d_forward slow_conv3d_forward _convolution_mode",
                   "convolution_backward convolution_backward_overrideable _slow_conv2d_backward"),
    "attention": split_names(
        "_scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention _scaled_dot_product_attention_math",
        "scaled_dot_product_attention _scaled_dot_product_fused_attention_overrideable",
        "_scaled_dot_product_cudnn_attention _flash_attention_forward _efficient_attention_forward",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_flash_attention_backward _scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_fused_attention_overrideable_backward _flash_attention_backward",
        "_efficient_attention_backward _scaled_dot_product_cudnn_attention_backward"),
    "transcendental": split_names(
        "exp exp2 expm1 log log2 log10 log1p sigmoid tanh gelu silu mish softplus elu selu celu",
        "erf erfc erfinv sin cos tan asin acos atan atan2 sinh cosh asinh acosh atanh rsqrt sqrt",
        "pow float_power logit logaddexp logaddexp2 sigmoid_backward tanh_backward gelu_backward",
        "silu_backward mish_backward softplus_backward elu_backward logit_backward lgamma digamma",
        "polygamma sinc xlogy special_xlog1py glu glu_backward log_sigmoid_forward",
        "log_sigmoid_backward silu_and_mul"),
    "reduction": split_names(
        "sum mean amax amin max min prod norm linalg_vector_norm argmax argmin all any aminmax",
        "nansum nanmean count_nonzero logsumexp var std var_mean std_mean _cdist_forward",
        "nll_loss nll_loss_forward nll_loss2d_forward mse_loss l1_loss smooth_l1_loss",
        "huber_loss binary_cross_entropy binary_cross_entropy_with_logits kl_div",
        "nll_loss_backward nll_loss2d_backward mse_loss_backward"),
    "scan": split_names("cumsum cumprod cummax cummin logcumsumexp _cumsum _cumprod"),
    "softmax": split_names("_softmax _log_softmax softmax log_softmax _safe_softmax"),
    "softmax_backward": split_names("_softmax_backward_data _log_softmax_backward_data"),
    "norm": split_names("native_layer_norm layer_norm native_batch_norm _native_batch_norm_legit",
                   "_native_batch_norm_legit_no_training _native_batch_norm_legit_functional",
                   "batch_norm native_group_norm group_norm rms_norm _fused_rms_norm fused_add_rms_norm",
                   "instance_norm _batch_norm_with_update _batch_norm_no_update"),
    "norm_backward": split_names("native_layer_norm_backward native_batch_norm_backward",
                            "native_group_norm_backward _fused_rms_norm_backward",
                            "batch_norm_backward"),
    "gather": split_names("index_select gather index take embedding masked_select nonzero",
                     "_embedding_bag embedding_bag take_along_dim _unsafe_index"),
    "scatter": split_names("scatter scatter_add scatter_reduce index_put _index_put_impl index_add",
                      "index_copy index_fill index_reduce put masked_scatter",
                      "embedding_dense_backward embedding_backward _embedding_bag_backward",
                      "_unsafe_index_put index_select_backward"),
    "sort": split_names("sort argsort topk unique _unique _unique2 unique_consecutive",
                   "unique_dim searchsorted bucketize kthvalue median nanmedian mode msort",
                   "randperm"),
    "copy": split_names("copy _copy_from _copy_from_and_resize clone contiguous _to_copy to cat",
                   "stack hstack vstack concat concatenate repeat tile expand_copy permute_copy",
                   "t_copy transpose_copy flip roll narrow_copy constant_pad_nd pad",
                   "split_with_sizes_copy unbind_copy _reshape_copy view_copy as_strided_copy",
                   "slice_scatter select_scatter diagonal_scatter as_strided_scatter repeat_interleave",
                   "_to_dtype unfold_copy col2im im2col select_backward slice_backward"),
    "fill": split_names("fill zero zeros ones full zeros_like ones_like full_like new_zeros new_ones",
                   "new_full scalar_tensor masked_fill_fill eye"),
    "random": split_names("uniform normal bernoulli random rand randn randint rand_like randn_like",
                     "randint_like exponential geometric log_normal cauchy multinomial poisson",
                     "native_dropout dropout"),
    "iota": split_names("arange linspace logspace range"),
    "optimizer": split_names("_fused_adam _fused_adamw _fused_sgd _fused_adagrad"),
    "pool": split_names("max_pool1d max_pool2d max_pool3d max_pool2d_with_indices",
                   "max_pool3d_with_indices avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d",
                   "adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool2d _adaptive_avg_pool2d",
                   "_adaptive_avg_pool3d max_pool2d_with_indices_backward avg_pool2d_backward",
                   "_adaptive_avg_pool2d_backward adaptive_max_pool2d_backward"),
    "scalar_read": split_names("_local_scalar_dense item"),
}
_CATEGORY: dict[str, str] = {name: cat for cat, names in _CATEGORY_NAMES.items() for name in names}


def base_name(op: str) -> str:
    """"aten::add_.Tensor" -> "add"; "aten::copy_" -> "copy"; "mylib::foo.out" -> "foo"."""
    name = op.rsplit("::", 1)[-1].split(".", 1)[0]
    if name.endswith("_") and not name.endswith("__"):
        name = name[:-1]
    return name


def op_category(op: str) -> str:
    """The model's category of an aten op name ("matmul", "elementwise", "gather", ...)."""
    name = base_name(op)
    if name in _CATEGORY:
        return _CATEGORY[name]
    if name.startswith("_foreach_"):
        inner = _CATEGORY.get(name.removeprefix("_foreach_"), "elementwise")
        return "foreach_transcendental" if inner == "transcendental" else "foreach"
    if name.endswith("_backward"):
        forward = _CATEGORY.get(name.removesuffix("_backward"))
        if forward in ("transcendental", "pool"):
            return forward
    return "elementwise"
