"""checkpoint.init_tiled: a smaller ModernBERT tiled "from the middle" into a larger one
(pretrain/checkpoint/tiling.py) equals ModernBERT's own tiling, tensor by tensor, and loads into a
tensor-parallel run through the trainer's real start (checkpoint.init_from + init_tiled).

The reference below is ported from AnswerDotAI/ModernBERT at commit
8c57a0f01c12c4953ead53d398a36f81a4ba9e38: src/bert_layers/initialization.py (TileMode,
tile_weight, _tile_1d, _tile_2d, tile_fused_qkv, tile_fused_glu, tile_linear, tile_norm,
tile_embedding: verbatim, less tile_linear's fused QKVFF branch, which ModernBERT's non-parallel
layers never take) and src/bert_layers/model.py (init_model_from_pretrained,
init_mlm_model_from_pretrained: the same calls on transformers' ModernBertForMaskedLM modules,
whose names are FlexBERT's, with `bert` -> `model`, `encoder.layers` -> `layers`; the FlexBERT
isinstance asserts dropped). It runs on transformers' models, so the test also proves that our
row-order conversions (modernbert_hf.py) put the tiling in transformers' layout.

Run as a script, this file is the rank entry point of the TP2 test (run_ranks).
"""
import copy
import os
import sys
from enum import StrEnum
from typing import Optional, Union

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- the reference (ported)
class TileMode(StrEnum):
    center_weights = "center_weights"
    tile_weights_from_edge = "tile_weights_from_edge"
    tile_weights_from_middle = "tile_weights_from_middle"


def tile_weight(
    pretrained_weights: torch.Tensor,
    new_weights: torch.Tensor,
    mode: Union[str, TileMode] = TileMode.tile_weights_from_middle,
) -> torch.Tensor:
    assert pretrained_weights.dim() in (1, 2), "Input tensor must be 1-dimensional or 2-dimensional"
    if isinstance(mode, str):
        mode = TileMode(mode)

    pretrained_weights = pretrained_weights.clone()

    if pretrained_weights.dim() == 1:
        return _tile_1d(pretrained_weights, new_weights, mode)
    else:
        return _tile_2d(pretrained_weights, new_weights, mode)


def _tile_1d(pretrained_weights: torch.Tensor, new_weights: torch.Tensor, mode: TileMode) -> torch.Tensor:
    assert pretrained_weights.dim() == 1, "Input tensor must be 1-dimensional"
    input_size = pretrained_weights.shape[0]
    new_size = new_weights.shape[0]
    assert new_size >= input_size, "Desired size must be greater than or equal to input size"

    if mode == TileMode.center_weights:
        offset = (new_size - input_size) // 2
        new_weights[offset : offset + input_size] = pretrained_weights
        return new_weights.clone()
    elif mode == TileMode.tile_weights_from_edge:
        repeat_count = (new_size + input_size - 1) // input_size
        tiled_tensor = pretrained_weights.repeat(repeat_count)
        return tiled_tensor[:new_size].clone()
    elif mode == TileMode.tile_weights_from_middle:
        # Calculate offsets to center the original tensor
        offset = (new_size - input_size) // 2

        # Create a new tensor with the desired size
        result = torch.zeros(new_size, dtype=pretrained_weights.dtype, device=pretrained_weights.device)

        # Place the original tensor in the center
        result[offset : offset + input_size] = pretrained_weights

        # Tile the left and right sides
        for i in range(offset):
            result[offset - 1 - i] = pretrained_weights[input_size - 1 - (i % input_size)]
        for i in range(offset + input_size, new_size):
            result[i] = pretrained_weights[(i - offset) % input_size]
        return result.clone()


def _tile_2d(pretrained_weights: torch.Tensor, new_weights: torch.Tensor, mode: TileMode) -> torch.Tensor:
    assert pretrained_weights.dim() == 2, "Input tensor must be 2-dimensional"
    input_height, input_width = pretrained_weights.shape
    new_height, new_width = new_weights.shape
    assert new_height >= input_height, "Desired height must be greater than or equal to input height"
    assert new_width >= input_width, "Desired width must be greater than or equal to input width"

    if mode == TileMode.center_weights:
        height_offset = (new_height - input_height) // 2
        width_offset = (new_width - input_width) // 2
        new_weights[height_offset : height_offset + input_height, width_offset : width_offset + input_width] = pretrained_weights  # fmt: skip
        return new_weights.clone()
    elif mode == TileMode.tile_weights_from_edge:
        repeat_height = (new_height + input_height - 1) // input_height
        repeat_width = (new_width + input_width - 1) // input_width
        tiled_tensor = pretrained_weights.repeat(repeat_height, repeat_width)
        return tiled_tensor[:new_height, :new_width].clone()
    elif mode == TileMode.tile_weights_from_middle:
        # Calculate offsets to center the original tensor
        height_offset = (new_height - input_height) // 2
        width_offset = (new_width - input_width) // 2

        # Create a new tensor with the desired width and input height
        horizontal_tiled = torch.zeros(
            input_height, new_width, dtype=pretrained_weights.dtype, device=pretrained_weights.device
        )

        # Place the original tensor in the center horizontally
        horizontal_tiled[:, width_offset : width_offset + input_width] = pretrained_weights

        # Tile the left and right sides
        for i in range(width_offset):
            horizontal_tiled[:, i] = horizontal_tiled[
                :, width_offset + input_width - 1 - (width_offset - i - 1) % input_width
            ]
        for i in range(width_offset + input_width, new_width):
            horizontal_tiled[:, i] = horizontal_tiled[:, width_offset + (i - width_offset) % input_width]

        # Now tile vertically
        result = torch.zeros(new_height, new_width, dtype=pretrained_weights.dtype, device=pretrained_weights.device)
        result[height_offset : height_offset + input_height, :] = horizontal_tiled

        # Tile top
        for i in range(height_offset):
            row_to_copy = (input_height - 1) - (i % input_height)
            result[height_offset - 1 - i, :] = horizontal_tiled[row_to_copy, :]

        # Tile bottom
        for i in range(height_offset + input_height, new_height):
            row_to_copy = (i - height_offset) % input_height
            result[i, :] = horizontal_tiled[row_to_copy, :]
        return result.clone()


def tile_fused_qkv(
    pretrained_qkv_weight: torch.Tensor,
    new_qkv_weight: torch.Tensor,
    mode: Union[str, TileMode] = TileMode.tile_weights_from_middle,
):
    # Split QKV, assume new_q, new_k, new_v are the same shape
    pretrained_q, pretrained_k, pretrained_v = pretrained_qkv_weight.chunk(3, dim=0)
    new_q, new_k, new_v = new_qkv_weight.chunk(3, dim=0)

    # Tile Q, K, V separately
    new_q = tile_weight(pretrained_q, new_q, mode=mode)
    new_k = tile_weight(pretrained_k, new_k, mode=mode)
    new_v = tile_weight(pretrained_v, new_v, mode=mode)

    # Concatenate tiled Q, K, V
    return torch.cat([new_q, new_k, new_v], dim=0)


def tile_fused_glu(
    pretrained_glu_weight: torch.Tensor,
    new_glu_weight: torch.Tensor,
    mode: Union[str, TileMode] = TileMode.tile_weights_from_middle,
):
    # Split GLU, assume new_glu_wi, new_glu_wg are the same shape
    pretrained_glu_wi, pretrained_glu_wg = pretrained_glu_weight.chunk(2, dim=0)
    new_glu_wi, new_glu_wg = new_glu_weight.chunk(2, dim=0)

    # Tile GLU separately
    new_glu_wi = tile_weight(pretrained_glu_wi, new_glu_wi, mode=mode)
    new_glu_wg = tile_weight(pretrained_glu_wg, new_glu_wg, mode=mode)

    # Concatenate tiled GLU
    return torch.cat([new_glu_wi, new_glu_wg], dim=0)


class TileLinear(StrEnum):
    wqkv = "wqkv"
    glu = "glu"
    wqkvff = "wqkvff"
    default = "default"


def tile_linear(
    pretrained_linear: nn.Linear,
    new_linear: nn.Linear,
    linear_type: Union[str, TileLinear] = TileLinear.default,
    mode: Union[str, TileMode] = TileMode.tile_weights_from_middle,
    bias_only: Optional[bool] = False,
):
    if isinstance(linear_type, str):
        linear_type = TileLinear(linear_type)
    if isinstance(mode, str):
        mode = TileMode(mode)

    with torch.no_grad():
        if linear_type == TileLinear.wqkv:
            if not bias_only:
                new_linear.weight = nn.Parameter(
                    tile_fused_qkv(pretrained_linear.weight, new_linear.weight, mode=mode),
                    requires_grad=new_linear.weight.requires_grad,
                )
            if pretrained_linear.bias is not None:
                new_linear.bias = nn.Parameter(
                    tile_fused_qkv(pretrained_linear.bias, new_linear.bias, mode=mode),
                    requires_grad=new_linear.bias.requires_grad,
                )
        elif linear_type == TileLinear.glu:
            if not bias_only:
                new_linear.weight = nn.Parameter(
                    tile_fused_glu(pretrained_linear.weight, new_linear.weight, mode=mode),
                    requires_grad=new_linear.weight.requires_grad,
                )
            if pretrained_linear.bias is not None:
                new_linear.bias = nn.Parameter(
                    tile_fused_glu(pretrained_linear.bias, new_linear.bias, mode=mode),
                    requires_grad=new_linear.bias.requires_grad,
                )
        elif linear_type == TileLinear.wqkvff:
            raise NotImplementedError("the parallel-attention QKVFF branch is not ported (ModernBERT does not use it)")
        else:
            if not bias_only:
                new_linear.weight = nn.Parameter(
                    tile_weight(pretrained_linear.weight, new_linear.weight, mode=mode),
                    requires_grad=new_linear.weight.requires_grad,
                )
            if pretrained_linear.bias is not None:
                new_linear.bias = nn.Parameter(
                    tile_weight(pretrained_linear.bias, new_linear.bias, mode=mode),
                    requires_grad=new_linear.bias.requires_grad,
                )


def tile_norm(pretrained_norm, new_norm, mode: Union[str, TileMode] = TileMode.tile_weights_from_middle):
    if isinstance(pretrained_norm, nn.Identity):
        return
    if isinstance(mode, str):
        mode = TileMode(mode)

    with torch.no_grad():
        new_norm.weight.data = nn.Parameter(
            tile_weight(pretrained_norm.weight, new_norm.weight, mode=mode),
            requires_grad=new_norm.weight.requires_grad,
        )
        if hasattr(pretrained_norm, "bias") and pretrained_norm.bias is not None:
            new_norm.bias.data = nn.Parameter(
                tile_weight(pretrained_norm.bias, new_norm.bias, mode=mode),
                requires_grad=new_norm.bias.requires_grad,
            )


def tile_embedding(pretrained_embedding: nn.Embedding, new_embedding: nn.Embedding,
                   mode: Union[str, TileMode] = TileMode.tile_weights_from_middle) -> nn.Embedding:
    with torch.no_grad():
        # Ensure vocabulary size remains the same
        if pretrained_embedding.num_embeddings != new_embedding.num_embeddings:
            raise ValueError("Vocabulary size (num_embeddings) must remain constant")

        # Ensure new embedding dimension is larger
        if new_embedding.embedding_dim <= pretrained_embedding.embedding_dim:
            raise ValueError("New embedding_dim must be larger than the old embedding_dim")

        # Tile the weights
        new_embedding.weight.data = nn.Parameter(
            tile_weight(pretrained_embedding.weight, new_embedding.weight, mode=mode),
            requires_grad=new_embedding.weight.requires_grad,
        )

        # Handle padding_idx if it exists
        if pretrained_embedding.padding_idx is not None:
            if new_embedding.padding_idx is None:
                new_embedding.padding_idx = pretrained_embedding.padding_idx
            else:
                assert new_embedding.padding_idx == pretrained_embedding.padding_idx, "padding_idx must remain the same"


def init_model_from_pretrained(pretrained_model, new_model, mode=TileMode.tile_weights_from_middle):
    """src/bert_layers/model.py's, on transformers' ModernBertModel."""
    tile_embedding(pretrained_model.embeddings.tok_embeddings, new_model.embeddings.tok_embeddings, mode=mode)
    if hasattr(pretrained_model.embeddings, "norm"):
        tile_norm(pretrained_model.embeddings.norm, new_model.embeddings.norm, mode=mode)

    # Calculate the layer mapping
    pretrained_layers = len(pretrained_model.layers)
    new_layers = len(new_model.layers)
    layer_mapping = [round(i * pretrained_layers / new_layers) for i in range(new_layers)]

    # Initialize layers
    for new_model_idx, pretrained_idx in enumerate(layer_mapping):
        new_model_layer = new_model.layers[new_model_idx]
        pretrained_layer = pretrained_model.layers[pretrained_idx]

        # First tile the normalization layers
        if hasattr(pretrained_layer, "attn_norm"):
            tile_norm(pretrained_layer.attn_norm, new_model_layer.attn_norm, mode=mode)
        if hasattr(pretrained_layer, "norm"):
            tile_norm(pretrained_layer.norm, new_model_layer.norm, mode=mode)
        if hasattr(pretrained_layer, "mlp_norm"):
            tile_norm(pretrained_layer.mlp_norm, new_model_layer.mlp_norm, mode=mode)

        # the fused attention layers
        tile_linear(pretrained_layer.attn.Wqkv, new_model_layer.attn.Wqkv, linear_type=TileLinear.wqkv, mode=mode)
        # finally, tile the attention output layer
        tile_linear(pretrained_layer.attn.Wo, new_model_layer.attn.Wo, linear_type=TileLinear.default, mode=mode)
        # GLU Wi, then the output
        tile_linear(pretrained_layer.mlp.Wi, new_model_layer.mlp.Wi, linear_type=TileLinear.glu, mode=mode)
        tile_linear(pretrained_layer.mlp.Wo, new_model_layer.mlp.Wo, linear_type=TileLinear.default, mode=mode)


def init_mlm_model_from_pretrained(config, pretrained_model, new_model, mode=TileMode.tile_weights_from_middle):
    """src/bert_layers/model.py's, on transformers' ModernBertForMaskedLM."""
    init_model_from_pretrained(pretrained_model.model, new_model.model, mode=mode)

    # tile the prediction head
    tile_linear(pretrained_model.head.dense, new_model.head.dense, linear_type=TileLinear.default, mode=mode)
    tile_norm(pretrained_model.head.norm, new_model.head.norm, mode=mode)

    # setup weight tying
    if config.tie_word_embeddings:
        new_model.decoder.weight = new_model.model.embeddings.tok_embeddings.weight
        tile_linear(
            pretrained_model.decoder, new_model.decoder, linear_type=TileLinear.default, mode=mode, bias_only=True
        )
    else:
        tile_linear(pretrained_model.decoder, new_model.decoder, linear_type=TileLinear.default, mode=mode)


# ----------------------------------------------------------------------------- tiny models
VOCAB = 200  # the tests' tiny run (tests/_train_worker.py TINY)
SMALL = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=48)
LARGE = dict(hidden_size=48, num_attention_heads=3, num_hidden_layers=3, intermediate_size=64)
# the TP2 x PP2 run's: 3 layers into 4 (divisible by PP 2; 2 into 4 the mapping cannot reach)
SMALL_3 = {**SMALL, "num_hidden_layers": 3}
LARGE_TP2 = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=4, intermediate_size=64)
BIASES = dict(norm_bias=True, attention_bias=True, mlp_bias=True, classifier_bias=True)


def hf_config(**shape):
    from transformers import ModernBertConfig

    return ModernBertConfig(**{**dict(vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, bos_token_id=2,
                                      eos_token_id=3, cls_token_id=2, sep_token_id=3, global_attn_every_n_layers=2,
                                      local_attention=8, attn_implementation="eager"), **shape})


def small_model(seed=0, **shape):
    """A ModernBertForMaskedLM with every tensor random and of order one (transformers initialises
    norms and biases to constants, which would hide a mix-up)."""
    from transformers import ModernBertForMaskedLM

    torch.manual_seed(seed)
    model = ModernBertForMaskedLM(hf_config(**{**SMALL, **shape})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p))
    return model


def reference_tiled(small, mode=TileMode.tile_weights_from_middle, **large_shape) -> dict:
    from transformers import ModernBertForMaskedLM

    large = ModernBertForMaskedLM(hf_config(**large_shape)).eval()
    init_mlm_model_from_pretrained(large.config, copy.deepcopy(small), large, mode=mode)
    return {name: t.detach() for name, t in large.state_dict().items()}


def assert_same(ours: dict, theirs: dict) -> None:
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name


# ----------------------------------------------------------------------------- against the reference
CASES = {
    "32x2x2-to-48x3x3": (SMALL, LARGE),
    "biases": ({**SMALL, **BIASES}, {**LARGE, **BIASES}),
    "tp2-shape": (SMALL_3, LARGE_TP2),  # a different head count per layer width: head_dim 16 both
    # 3 -> 6 layers: large layer 1 takes small layer 0, which has no attn_norm (left at 1)
    "3-to-6-layers": ({**SMALL, "num_hidden_layers": 3}, {**LARGE, "num_hidden_layers": 6}),
    "wider-heads": (SMALL, {**LARGE, "num_attention_heads": 2}),  # head_dim 16 -> 24: no rule against it
}


@pytest.mark.parametrize("case", list(CASES))
def test_tiled_weights_equal_modernberts_tiling(case):
    from pretrain.checkpoint.tiling import tile_from_middle

    small_shape, large_shape = CASES[case]
    small = small_model(**small_shape)
    theirs = reference_tiled(small, **large_shape)
    ours = tile_from_middle(small.state_dict(), small.config, hf_config(**large_shape))
    assert_same(ours, theirs)
    if case == "3-to-6-layers":
        assert torch.equal(ours["model.layers.1.attn_norm.weight"], torch.ones(48))
    assert torch.equal(ours["model.final_norm.weight"], torch.ones(large_shape["hidden_size"]))  # the reference's


def test_through_our_row_orders_and_logical_checkpoint(tmp_path):
    """A transformers directory read as our logical checkpoint (per-head Wqkv, interleaved Wi),
    tiled, and written back as transformers' layout: the reference's tensors. Tiling our row
    orders directly (the negative control) gives other Wqkv and Wi."""
    from pretrain.checkpoint.hf import read_hf
    from pretrain.checkpoint.logical import read_native, write_native
    from pretrain.checkpoint.modernbert_hf import to_hf
    from pretrain.checkpoint.tiling import tile_checkpoint, tile_from_middle
    from pretrain.config import load_config

    small = small_model(seed=1, **SMALL_3, **BIASES)
    small.save_pretrained(tmp_path / "small")
    large_shape = {**LARGE_TP2, **BIASES}
    theirs = reference_tiled(small, **large_shape)
    theirs.pop("decoder.weight")  # ours is tied, not stored

    cfg = load_config(None, ["model.architecture=modernbert", "data.segment_pairs=none", f"model.vocab_size={VOCAB}",
                             "model.hidden_size=64", "model.num_attention_heads=4", "model.num_layers=4",
                             "model.ffn_hidden_size=64", "model.max_position_embeddings=64",
                             "model.global_attn_every_n_layers=2", "model.local_attention=8",
                             *[f"model.{k}=true" for k in BIASES]])
    ckpt = read_hf(str(tmp_path / "small"))
    tiled = tile_checkpoint(ckpt, cfg)
    assert tiled.step == 0 and tiled.moments is None and tiled.config.model.hidden_size == 64
    assert_same({n: to_hf(n, t, cfg) for n, t in tiled.weights.items()}, theirs)

    # the same from a native checkpoint of another layout (TP2 x PP2)
    write_native(ckpt, str(tmp_path / "native"), tp=2, pp=2)
    native = tile_checkpoint(read_native(str(tmp_path / "native")), cfg)
    assert_same(native.weights, tiled.weights)

    naive = tile_from_middle(ckpt.weights, ckpt.config.model, cfg.model)  # our row orders, not converted
    for name in theirs:
        differs = not torch.equal(naive[name], theirs[name])
        assert differs == name.endswith(("attn.Wqkv.weight", "attn.Wqkv.bias", "mlp.Wi.weight", "mlp.Wi.bias")), name


@pytest.mark.parametrize("mode", [TileMode.tile_weights_from_edge, TileMode.center_weights])
def test_negative_control_edge_tiling_or_centring_differs(mode):
    """Tiling from the edge, or centring in zeros, is not what we compute: the comparison can fail."""
    from pretrain.checkpoint.tiling import tile_from_middle

    small = small_model()
    middle = reference_tiled(small, **LARGE)
    other = reference_tiled(small, mode=mode, **LARGE)
    ours = tile_from_middle(small.state_dict(), small.config, hf_config(**LARGE))
    differ = [n for n in middle if not torch.equal(other[n], ours[n])]
    assert "model.embeddings.tok_embeddings.weight" in differ and "model.layers.2.attn.Wqkv.weight" in differ
    with pytest.raises(AssertionError):
        assert_same(ours, other)


def test_vectorised_tile_equals_the_loops_on_odd_shapes():
    from pretrain.checkpoint.tiling import tile_from_middle_tensor

    torch.manual_seed(3)
    for old, new in [((3,), (3,)), ((3,), (10,)), ((2, 3), (6, 7)), ((5, 4), (13, 9)), ((4, 4), (5, 11))]:
        small = torch.randn(old)
        assert torch.equal(tile_from_middle_tensor(small, new), tile_weight(small, torch.empty(new))), (old, new)
    # the reference's own expectation (its tests/test_tiling.py, test 1)
    assert tile_from_middle_tensor(torch.tensor([[1, 2], [3, 4]]), (4, 4)).tolist() == \
        [[4, 3, 4, 3], [2, 1, 2, 1], [4, 3, 4, 3], [2, 1, 2, 1]]


def test_layer_mapping_base_to_large():
    from pretrain.checkpoint.tiling import layer_mapping

    mapping = layer_mapping(22, 28)  # ModernBERT-base's 22 layers into large's 28
    assert mapping == [round(i * 22 / 28) for i in range(28)]
    assert mapping == [0, 1, 2, 2, 3, 4, 5, 6, 6, 7, 8, 9, 9, 10, 11, 12, 13, 13, 14, 15, 16, 16, 17, 18, 19, 20, 20,
                       21]


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("change, key", [
    (dict(hidden_size=32, num_attention_heads=2), "model.hidden_size: this run's 32 must be larger"),  # equal
    (dict(hidden_size=24, num_attention_heads=2), "model.hidden_size: this run's 24 must be larger"),
    (dict(num_hidden_layers=1), "model.num_layers: this run's 1 is smaller"),
    (dict(intermediate_size=40), "model.ffn_hidden_size: this run's 40 is smaller"),
    (dict(vocab_size=VOCAB + 1), "model.vocab_size: the checkpoint's is 200, this run's 201"),
    (dict(mlp_bias=True), "model.mlp_bias: the checkpoint's is False, this run's True"),
    (dict(num_hidden_layers=4), "model.num_layers: 2 -> 4 layers: .* names layer 2, which the checkpoint lacks; "
                                "tile to at most 3 layers"),
])
def test_what_cannot_be_tiled_is_refused_naming_the_key(change, key):
    from pretrain.checkpoint.errors import CheckpointError
    from pretrain.checkpoint.tiling import tile_from_middle

    small = small_model()
    with pytest.raises(CheckpointError, match=key):
        tile_from_middle(small.state_dict(), small.config, hf_config(**{**LARGE, **change}))


def test_config_rules_and_the_pre_start_check(tmp_path):
    """init_tiled needs init_from and takes weights only; the run's shape keys are its own (not
    inherited from the smaller checkpoint) and are checked before any rank starts."""
    from pretrain.checkpoint.starting_point import load_run_config, starting_point_problems
    from pretrain.config import ConfigError

    small_model().save_pretrained(tmp_path / "small")
    init = [f"checkpoint.init_from={tmp_path / 'small'}", "checkpoint.init_tiled=true", "data.segment_pairs=none",
            "data.seq_length=32"]
    cfg = load_run_config(None, init + ["model.hidden_size=64", "model.num_attention_heads=4", "model.num_layers=3",
                                    "model.ffn_hidden_size=64"])
    assert cfg.model.modern and cfg.model.vocab_size == VOCAB and cfg.model.local_attention == 8  # inherited
    assert (cfg.model.hidden_size, cfg.model.num_layers) == (64, 3)
    assert starting_point_problems(cfg) == []
    cfg.validate(world_size=2)

    unset = load_run_config(None, init + ["model.num_layers=3"])  # hidden etc. not inherited: the defaults (768, ...)
    assert unset.model.hidden_size == 768
    bad = load_run_config(None, init + ["model.hidden_size=64", "model.num_attention_heads=4", "model.num_layers=5",
                                    "model.ffn_hidden_size=32", "model.local_attention=16"])
    problems = starting_point_problems(bad)
    assert any(p.startswith("checkpoint.init_tiled: model.ffn_hidden_size: this run's 32 is smaller") for p in problems)
    assert any(p.startswith("checkpoint.init_tiled: model.num_layers: 2 -> 5 layers") for p in problems)
    assert any("model.local_attention: run 16, checkpoint 8" in p for p in problems)  # the usual check

    bert = load_run_config(None, [f"checkpoint.init_from={tmp_path / 'small'}", "checkpoint.init_tiled=true",
                              "model.architecture=bert", "model.hidden_size=64", "model.num_attention_heads=4"])
    assert any("tiling grows ModernBERT models only; this run's is bert" in p for p in starting_point_problems(bert))

    for extra, line in [([], "checkpoint.init_tiled needs checkpoint.init_from"),
                        ([f"checkpoint.init_from={tmp_path / 'small'}", "checkpoint.init_optimizer_states=true"],
                         "remove checkpoint.init_optimizer_states")]:
        with pytest.raises(ConfigError, match=line):
            load_run_config(None, ["checkpoint.init_tiled=true", "model.architecture=modernbert",
                               "data.segment_pairs=none", *extra]).validate(world_size=1)


# ----------------------------------------------------------------------------- through the trainer, at TP2 x PP2
@pytest.mark.slow
def test_trainer_start_tiles_into_a_tp2_pp2_run(tmp_path):
    """One 4-process job: checkpoint.init_from (a transformers directory of a 3-layer small model) with
    checkpoint.init_tiled into a TP2 x PP2 run of the large one; the logical weights gathered back
    from every rank are the reference's, and the layout took effect (TP shard shapes, the layers
    split between the stages)."""
    from distributed import run_ranks
    from pretrain.checkpoint.tiling import tile_from_middle

    small = small_model(seed=2, **SMALL_3)
    small.save_pretrained(tmp_path / "small")
    out = tmp_path / "loaded.pt"
    done = run_ranks([__file__, str(out), str(tmp_path / "small")], 4, timeout=600)
    result = torch.load(out, weights_only=False)
    theirs = reference_tiled(small, **LARGE_TP2)
    theirs.pop("decoder.weight")  # tied to the token embedding
    assert_same(result["weights"], theirs)
    assert result["step"] == 0 and (result["tp"], result["pp"]) == (2, 2)
    # TP took effect: Wqkv, Wi, Wo and the embedding split over 2 ranks, the norms whole
    local = result["local_shapes"]
    assert local["model.layers.2.attn.Wqkv.weight"] == [3 * 64 // 2, 64]
    assert local["model.layers.2.mlp.Wi.weight"] == [2 * 64 // 2, 64]
    assert local["model.layers.2.attn.Wo.weight"] == [64, 64 // 2]
    assert local["model.embeddings.tok_embeddings.weight"] == [128 * 2 // 2, 64]  # 200 padded to 256, halved
    assert local["model.layers.2.mlp_norm.weight"] == [64]
    # PP took effect: each stage holds some of the 3 layers, none both
    stages = [set(layers) for layers in result["stage_layers"]]
    assert len(stages) == 2 and all(stages) and not stages[0] & stages[1] and stages[0] | stages[1] == {0, 1, 2, 3}
    log = "".join(p.stdout for p in done)
    assert "tiled from the middle: hidden 32, 3 layers, 2 heads, intermediate 48 -> hidden 64, 4 layers, 4 heads, " \
           "intermediate 64" in log, log[-3000:]
    # and the library's own result is what the run loaded
    assert_same(tile_from_middle(small.state_dict(), small.config, hf_config(**LARGE_TP2)),
                {**theirs, "decoder.weight": theirs["model.embeddings.tok_embeddings.weight"]})


def _rank_main(out_path: str, small_dir: str) -> None:
    """Rank entry point of the TP2 x PP2 test: start the run, gather what it loaded."""
    from pretrain.common.quiet import hide_library_warnings

    hide_library_warnings()
    import torch.distributed as dist

    from _train_worker import TINY
    from pretrain.checkpoint.modernbert_hf import to_hf
    from pretrain.checkpoint.sharding import unpad_vocab
    from pretrain.config import load_config
    from pretrain.distributed.parallel import discover_launch_env, init_parallel, shutdown_parallel
    from pretrain.model.names import logical_parameters
    from pretrain.observability.console import configure_logging
    from pretrain.training.trainer import Trainer

    launch = discover_launch_env()
    launch.export_to(os.environ)
    parallel = init_parallel(launch, 2, 2, timeout_minutes=3)
    configure_logging(parallel.rank, parallel.world_size, parallel.logging_rank)
    cfg = load_config(None, TINY + ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2",
                                    "model.architecture=modernbert", "data.segment_pairs=none",
                                    f"checkpoint.init_from={small_dir}", "checkpoint.init_tiled=true",
                                    "model.hidden_size=64", "model.num_attention_heads=4", "model.num_layers=4",
                                    "model.ffn_hidden_size=64"])
    cfg.validate(world_size=parallel.world_size)
    trainer = Trainer(cfg, parallel)
    trainer.resume()
    weights, local_shapes, layers = {}, {}, set()
    for lp in logical_parameters(trainer.model):
        local = lp.param.detach().float().contiguous()
        local_shapes[lp.hf_name] = list(local.shape)
        if lp.hf_name.startswith("model.layers."):
            layers.add(int(lp.hf_name.split(".")[2]))
        if lp.tp_partition_dim is not None:
            pieces = [torch.empty_like(local) for _ in range(parallel.tp_size)]
            dist.all_gather(pieces, local, group=parallel.tp_group)
            local = torch.cat(pieces, dim=lp.tp_partition_dim)
        weights[lp.hf_name] = to_hf(lp.hf_name, unpad_vocab(lp.hf_name, local, cfg.model.vocab_size), cfg).clone()
    everyone = [None] * parallel.world_size
    dist.all_gather_object(everyone, (parallel.pp_rank, parallel.tp_rank, weights, local_shapes, sorted(layers)))
    if parallel.rank == 0:
        merged, shapes, stage_layers = {}, {}, [[], []]
        for pp_rank, tp_rank, w, s, stage in everyone:
            if tp_rank == 0:
                merged.update(w)
                shapes.update(s)
                stage_layers[pp_rank] = stage
        torch.save({"weights": merged, "local_shapes": shapes, "stage_layers": stage_layers, "step": trainer.step,
                    "tp": parallel.tp_size, "pp": parallel.pp_size}, out_path)
    shutdown_parallel()


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2])
