"""Paddle 2.5's public names in the namespaces Paddle scripts reach, and the error a name
fleetmpi lacks raises there.

Each fleetmpi package that stands for a Paddle namespace installs ``module_getattr`` as its
module ``__getattr__`` (Python calls it only for a name the module does not have). A name of
Paddle's then raises an ``AttributeError`` that says it is Paddle's and not implemented here,
and names the nearest fleetmpi name of that package, if one is close; any other name gets
Python's usual message, with the nearest name too. docs/paddle_compat.md lists what fleetmpi
has of each namespace.
"""
import difflib

# Paddle 2.5's ``__all__`` of each namespace (the names a script writes), as data.
_LISTED = {
    "paddle": """
        Tensor to_tensor zeros zeros_like ones ones_like full full_like empty empty_like
        arange linspace logspace eye diag diagflat meshgrid tril triu rand randn randint
        randint_like randperm uniform normal standard_normal poisson bernoulli multinomial
        seed get_rng_state set_rng_state get_cuda_rng_state set_cuda_rng_state
        concat stack split chunk unbind squeeze unsqueeze reshape reshape_ flatten transpose
        moveaxis expand expand_as broadcast_to broadcast_tensors broadcast_shape tile
        repeat_interleave
        gather gather_nd scatter scatter_ scatter_nd scatter_nd_add index_select index_sample
        index_add index_put masked_select masked_fill take_along_axis put_along_axis slice
        strided_slice crop flip rot90 roll where nonzero argsort sort topk unique
        unique_consecutive searchsorted bucketize argmax argmin max min amax amin maximum
        minimum fmax fmin sum nansum mean nanmean median nanmedian quantile nanquantile std
        var prod cumsum cumprod logcumsumexp logsumexp all any add subtract multiply divide
        floor_divide remainder mod floor_mod pow sqrt rsqrt square exp expm1 log log2 log10
        log1p abs sign neg reciprocal floor ceil round trunc frac sin cos tan asin acos atan
        atan2 sinh cosh tanh asinh acosh atanh erf erfinv sigmoid lerp clip scale stanh
        matmul mm bmm dot inner outer cross kron einsum mv t addmm baddbmm cholesky
        equal equal_all not_equal greater_than greater_equal less_than less_equal allclose
        isclose isfinite isinf isnan is_empty is_tensor is_complex is_integer
        is_floating_point logical_and logical_or logical_not logical_xor bitwise_and
        bitwise_or bitwise_not bitwise_xor cast astype numel rank shape real imag conj angle
        complex as_complex as_real clone assign tolist increment diff histogram bincount
        trace diagonal kthvalue mode count_nonzero heaviside gcd lcm renorm digamma lgamma
        no_grad enable_grad set_grad_enabled is_grad_enabled grad in_dynamic_mode
        enable_static disable_static set_device get_device set_default_dtype
        get_default_dtype set_flags get_flags set_printoptions save load summary flops Model
        ParamAttr LazyGuard DataParallel create_parameter CPUPlace CUDAPlace CUDAPinnedPlace
        XPUPlace NPUPlace IPUPlace CustomPlace is_compiled_with_cuda is_compiled_with_xpu
        is_compiled_with_rocm is_compiled_with_npu is_compiled_with_ipu
        is_compiled_with_cinn is_compiled_with_mlu is_compiled_with_custom_device
        batch check_shape dtype finfo iinfo float16 float32 float64 bfloat16 int8 int16 int32
        int64 uint8 bool complex64 complex128 nn optimizer io metric amp autograd device
        distributed vision text hub jit static incubate inference profiler utils sparse fft
        linalg signal geometric audio callbacks hapi framework regularizer onnx quantization
        version sysconfig tensor
    """,
    "paddle.nn": """
        Layer LayerList LayerDict ParameterList Sequential Linear Bilinear Identity Embedding
        Flatten Unflatten Dropout Dropout2D Dropout3D AlphaDropout Pad1D Pad2D Pad3D ZeroPad2D
        Upsample UpsamplingNearest2D UpsamplingBilinear2D Fold Unfold PixelShuffle
        PixelUnshuffle ChannelShuffle CosineSimilarity PairwiseDistance Conv1D Conv2D Conv3D
        Conv1DTranspose Conv2DTranspose Conv3DTranspose AvgPool1D AvgPool2D AvgPool3D
        MaxPool1D MaxPool2D MaxPool3D MaxUnPool1D MaxUnPool2D MaxUnPool3D AdaptiveAvgPool1D
        AdaptiveAvgPool2D AdaptiveAvgPool3D AdaptiveMaxPool1D AdaptiveMaxPool2D
        AdaptiveMaxPool3D BatchNorm BatchNorm1D BatchNorm2D BatchNorm3D SyncBatchNorm
        InstanceNorm1D InstanceNorm2D InstanceNorm3D LayerNorm GroupNorm LocalResponseNorm
        SpectralNorm ReLU ReLU6 LeakyReLU PReLU RReLU ELU CELU SELU GELU Sigmoid Hardsigmoid
        LogSigmoid Silu Swish Mish Hardswish Hardtanh Hardshrink Softshrink Tanhshrink
        ThresholdedReLU Softplus Softsign Tanh Softmax Softmax2D LogSoftmax Maxout
        CrossEntropyLoss MSELoss L1Loss SmoothL1Loss NLLLoss BCELoss BCEWithLogitsLoss KLDivLoss
        MarginRankingLoss CTCLoss RNNTLoss HingeEmbeddingLoss CosineEmbeddingLoss
        TripletMarginLoss TripletMarginWithDistanceLoss MultiLabelSoftMarginLoss
        MultiMarginLoss SoftMarginLoss HSigmoidLoss GaussianNLLLoss PoissonNLLLoss RNNCellBase
        SimpleRNNCell LSTMCell GRUCell RNN BiRNN SimpleRNN LSTM GRU MultiHeadAttention
        TransformerEncoderLayer TransformerEncoder TransformerDecoderLayer TransformerDecoder
        Transformer BeamSearchDecoder dynamic_decode ClipGradByGlobalNorm ClipGradByNorm
        ClipGradByValue functional initializer utils quant
    """,
    "paddle.nn.functional": """
        relu relu_ relu6 leaky_relu prelu rrelu elu elu_ celu selu gelu sigmoid hardsigmoid
        log_sigmoid silu swish mish hardswish hardtanh hardshrink softshrink tanhshrink
        thresholded_relu softplus softsign tanh tanh_ softmax softmax_ log_softmax maxout glu
        gumbel_softmax linear bilinear dropout dropout2d dropout3d alpha_dropout embedding
        one_hot pad zeropad2d interpolate upsample unfold fold pixel_shuffle pixel_unshuffle
        channel_shuffle cosine_similarity label_smooth class_center_sample sequence_mask
        conv1d conv2d conv3d conv1d_transpose conv2d_transpose conv3d_transpose avg_pool1d
        avg_pool2d avg_pool3d max_pool1d max_pool2d max_pool3d max_unpool1d max_unpool2d
        max_unpool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d
        adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d batch_norm instance_norm
        layer_norm group_norm local_response_norm normalize cross_entropy
        softmax_with_cross_entropy binary_cross_entropy binary_cross_entropy_with_logits
        mse_loss l1_loss smooth_l1_loss nll_loss kl_div margin_ranking_loss ctc_loss rnnt_loss
        hinge_embedding_loss cosine_embedding_loss triplet_margin_loss
        triplet_margin_with_distance_loss multi_label_soft_margin_loss multi_margin_loss
        soft_margin_loss hsigmoid_loss gaussian_nll_loss poisson_nll_loss sigmoid_focal_loss
        dice_loss log_loss npair_loss square_error_cost margin_cross_entropy affine_grid
        grid_sample temporal_shift diag_embed sparse_attention scaled_dot_product_attention
        flash_attention
    """,
    "paddle.nn.initializer": """
        Assign Bilinear Constant Dirac KaimingNormal KaimingUniform Normal Orthogonal
        TruncatedNormal Uniform XavierNormal XavierUniform calculate_gain set_global_initializer
    """,
    "paddle.optimizer": """
        Optimizer SGD Momentum Adam AdamW Adamax Adagrad Adadelta RMSProp Lamb LBFGS lr
    """,
    "paddle.optimizer.lr": """
        LRScheduler NoamDecay PiecewiseDecay NaturalExpDecay InverseTimeDecay PolynomialDecay
        LinearWarmup ExponentialDecay MultiStepDecay StepDecay LambdaDecay ReduceOnPlateau
        CosineAnnealingDecay MultiplicativeDecay OneCycleLR CyclicLR LinearLR
        CosineAnnealingWarmRestarts
    """,
    "paddle.io": """
        Dataset IterableDataset TensorDataset ComposeDataset ChainDataset Subset random_split
        DataLoader BatchSampler DistributedBatchSampler Sampler SequenceSampler RandomSampler
        WeightedRandomSampler SubsetRandomSampler get_worker_info default_collate_fn
        default_convert_fn
    """,
    "paddle.metric": "Metric Accuracy Precision Recall Auc accuracy",
    "paddle.autograd": "PyLayer PyLayerContext backward grad jacobian hessian saved_tensors_hooks",
    "paddle.amp": """
        auto_cast GradScaler AmpScaler decorate is_float16_supported is_bfloat16_supported
        debugging
    """,
    "paddle.device": """
        set_device get_device get_all_device_type get_all_custom_device_type
        get_available_device get_available_custom_device get_cudnn_version cuda xpu
        is_compiled_with_cuda is_compiled_with_rocm is_compiled_with_xpu Stream Event
        current_stream set_stream stream_guard synchronize
    """,
    "paddle.distributed": """
        init_parallel_env get_rank get_world_size ParallelEnv DataParallel spawn launch fleet
        new_group get_group wait barrier broadcast all_reduce reduce all_gather
        all_gather_object scatter alltoall alltoall_single send recv isend irecv reduce_scatter
        ReduceOp split shard_tensor shard_op sharding is_initialized destroy_process_group
        is_available gloo_init_parallel_env gloo_barrier gloo_release rpc utils communication
        stream auto_parallel ProcessMesh save_state_dict load_state_dict
    """,
}
PADDLE_NAMES = {namespace: frozenset(names.split()) for namespace, names in _LISTED.items()}


def _public(namespace):
    return sorted(n for n in namespace if not n.startswith("_"))


def nearest(name, namespace):
    """The name of ``namespace`` (a module's globals) closest to ``name``, or None: the same
    name in other letter case first, then the closest spelling."""
    public = _public(namespace)
    folded = {n.lower(): n for n in public}
    if name.lower() in folded:
        return folded[name.lower()]
    close = difflib.get_close_matches(name, public, n=1, cutoff=0.6)
    return close[0] if close else None


def missing(module_name, paddle_namespace, name, namespace):
    """The AttributeError for ``module_name.name``, which the module does not have."""
    near = nearest(name, namespace)
    hint = f"; the nearest fleetmpi name is {module_name}.{near}" if near else ""
    if name in PADDLE_NAMES[paddle_namespace]:
        return AttributeError(f"{module_name} has no {name!r}: Paddle's {paddle_namespace}."
                              f"{name} is not implemented in fleetmpi (docs/paddle_compat.md "
                              f"lists what is){hint}")
    return AttributeError(f"module {module_name!r} has no attribute {name!r}{hint}")


def module_getattr(module_name, paddle_namespace, namespace):
    """A module ``__getattr__`` for ``module_name``, which stands for Paddle's
    ``paddle_namespace``; ``namespace`` is the module's globals (read at each call, so names
    defined later count)."""
    if paddle_namespace not in PADDLE_NAMES:
        raise KeyError(f"no Paddle names are listed for {paddle_namespace!r}")

    def __getattr__(name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        raise missing(module_name, paddle_namespace, name, namespace)
    return __getattr__
