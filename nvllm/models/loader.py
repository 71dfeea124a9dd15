"""Build a model from a HF directory: config, (sharded) safetensors, pickled checkpoints only on request,
or random weights from config.json alone (`load_format="dummy"`)."""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator

import torch

from nvllm.config import ConfigError, EngineConfig, first_line
from nvllm.layers.rotary import context_length, rope_parameters
from nvllm.models.registry import resolve_architecture

logger = logging.getLogger("nvllm")


def load_hf_config(model_dir: str, overrides: dict | None = None):
    """The directory's config.json as a transformers config, with ``overrides`` (``--hf-overrides``) set on it."""
    from transformers import AutoConfig

    if not os.path.isdir(model_dir):
        raise ConfigError(f"model directory not found: {model_dir}")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ConfigError(f"no config.json in {model_dir}")
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as e:  # transformers raises many kinds for a bad config
        raise ConfigError(f"cannot read {model_dir}/config.json: {first_line(e)}") from e
    if overrides:
        logger.info("config.json overridden: %s", ", ".join(f"{k}={v!r}" for k, v in overrides.items()))
        rope = {k: v for k, v in overrides.items() if k in _ROPE_FIELDS}
        fields = {k: v for k, v in overrides.items() if k not in _ROPE_FIELDS}
        try:
            if fields:  # built again from the edited fields, as from an edited config.json: transformers derives
                # some fields only when it builds a config (Qwen2's sliding_window from use_sliding_window, the
                # layer_types from max_window_layers), which update() would leave stale
                raw, _ = type(config).get_config_dict(model_dir)
                config = type(config).from_dict({**raw, **fields})
            config.update(_rope_folded(config, rope))
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - transformers checks field types (a string for a size)
            raise ConfigError(f"--hf-overrides: {first_line(e)}") from None
    return config


_ROPE_FIELDS = ("rope_theta", "rope_scaling", "rope_parameters")


def _rope_folded(config, overrides: dict) -> dict:
    """Transformers 5 keeps rope_theta and the scaling in one dict, ``rope_parameters``, and reads only that: an
    override of rope_theta, rope_scaling or part of rope_parameters is folded into it (as editing config.json
    would be), keeping what it does not name. Returns the other overrides."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not set(_ROPE_FIELDS) & set(overrides):
        return overrides
    params = dict(params)
    for key in ("rope_parameters", "rope_scaling"):
        if key not in overrides:
            continue
        value = overrides.pop(key)
        if value is None and key == "rope_scaling":
            value = {"rope_type": "default"}
        if not isinstance(value, dict):
            raise ConfigError(f"--hf-overrides: {key} must be an object, got {value!r}")
        if key == "rope_scaling":  # a new scaling replaces the old one; the theta stays
            params = {"rope_theta": params.get("rope_theta")}
        if "type" in value and "rope_type" not in value:
            value = {("rope_type" if k == "type" else k): v for k, v in value.items()}
        params.update(value)
    if "rope_theta" in overrides:
        params["rope_theta"] = overrides.pop("rope_theta")
    config.rope_parameters = params
    return overrides


def model_len_limit(hf_config, requested: int | None = None, warn: bool = True) -> int:
    """The longest sequence the engine serves: max_position_embeddings (as far as a rope scaling stretches it, see
    ``context_length``), or ``requested`` (--max-model-len) within it; capped to a sliding window where some layer
    slides (nvllm has no windowed attention: within the window, sliding attention equals full attention), and a
    ``requested`` length past that window is a ConfigError, as one past the other limits is."""
    c = hf_config
    limit = context_length(c.max_position_embeddings, rope_parameters(c)[1])
    window = getattr(c, "sliding_window", None)
    layer_types = getattr(c, "layer_types", None)
    if layer_types:  # the layers' kinds, as transformers derives them (Qwen2/3: from max_window_layers)
        uses_window = window and "sliding_attention" in layer_types
    else:            # Mistral, Mixtral; Qwen2 configs of older transformers: layers from max_window_layers on
        # slide; every Qwen3-MoE layer slides when use_sliding_window is set (transformers ignores max_window_layers).
        # Only the Qwen configs have use_sliding_window: a Mistral's window holds whatever stray field a converter
        # left beside it
        qwen = getattr(c, "model_type", "").startswith("qwen")
        first = (0 if c.model_type == "qwen3_moe" else getattr(c, "max_window_layers", None) or 0) if qwen else 0
        uses_window = window and (not qwen or getattr(c, "use_sliding_window", True) is not False) \
            and first < c.num_hidden_layers
    if requested is not None:
        if requested > limit:
            what = ("max_position_embeddings" if limit == c.max_position_embeddings
                    else "context length under its rope_scaling")
            raise ConfigError(f"max_model_len {requested} exceeds the model's {what} {limit}")
        limit = requested
    if uses_window and window < limit:
        if requested is not None:
            raise ConfigError(f"max_model_len {requested} exceeds the model's sliding window {window}: nvllm serves "
                              f"sliding-window models within their window, where sliding attention equals full "
                              f"attention (it has no windowed attention); use --max-model-len {window} or less")
        if warn:
            logger.warning("the model uses sliding-window attention (%d); max_model_len capped to %d, within "
                           "which it equals full attention", window, window)
        limit = window
    return limit


def config_model_len(config) -> int:
    """The max_model_len an engine built from ``config`` (an EngineConfig) will have, read from config.json without
    loading weights."""
    return model_len_limit(load_hf_config(config.model, config.hf_overrides), config.max_model_len, warn=False)


def checkpoint_dtype(hf_config) -> torch.dtype | None:
    d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else None


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's weight files, chosen as transformers chooses them: the shards its
    model.safetensors.index.json lists, else model.safetensors, else (a directory another tool wrote) every
    *.safetensors. Other files beside an index or model.safetensors are not read: Mistral's repositories carry
    consolidated.safetensors, the same weights under Mistral's own names, next to the Hugging Face ones."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, s) for s in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ConfigError(f"weight shard listed in model.safetensors.index.json is missing: {missing[0]}")
        return files
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if len(files) > 1:
        _refuse_overlap(files)
    return files


def _tensor_names(path: str) -> list[str]:
    """The tensor names in a safetensors file's header."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except Exception as e:
        raise ConfigError(f"cannot read weight file {path} (truncated or corrupt?): {e}") from e


def _refuse_overlap(files: list[str]) -> None:
    """Without an index nothing says which of two files holding the same tensor name is meant: refuse."""
    owner: dict[str, str] = {}
    for path in files:
        for name in _tensor_names(path):
            if name in owner:
                raise ConfigError(
                    f"tensor {name} is in both {os.path.basename(owner[name])} and {os.path.basename(path)}; with "
                    "no model.safetensors.index.json to say which is meant, remove one of the files")
            owner[name] = path


def pickle_files(model_dir: str) -> list[str]:
    """The checkpoint's pickle weight files (*.bin, *.pt), read only where no safetensors file is."""
    return sorted(glob.glob(os.path.join(model_dir, "*.bin")) + glob.glob(os.path.join(model_dir, "*.pt")))


def iterate_weights(model_dir: str, load_format: str, allow_pickle: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = safetensors_files(model_dir) if load_format in ("auto", "safetensors") else []
    if files:
        for path in files:
            try:
                with safe_open(path, framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            except ConfigError:
                raise
            except Exception as e:
                raise ConfigError(f"cannot read weight file {path} (truncated or corrupt?): {e}") from e
        return
    pickles = pickle_files(model_dir)
    if not pickles:
        kinds = "*.bin, *.pt" if load_format == "pt" else "*.safetensors"
        raise ConfigError(f"no weight files ({kinds}) in {model_dir}")
    if not allow_pickle:
        raise ConfigError(f"{model_dir} holds only pickle checkpoints ({os.path.basename(pickles[0])}); "
                          "loading pickles can run arbitrary code — pass --allow-pickle to load them anyway")
    for path in pickles:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ConfigError(f"cannot read weight file {path}: {e}") from e
        yield from state.items()


def checkpoint_keys(model_dir: str) -> set[str] | None:
    """Tensor names of a safetensors checkpoint (headers only); None when there is none to read."""
    files = safetensors_files(model_dir)
    return {name for path in files for name in _tensor_names(path)} if files else None


def quantization_plan(config: EngineConfig, hf_config, arch: str, log: bool = True):
    """``{"layers.{i}.{linear}": QuantScheme}`` (and ``"lm_head"`` when the head is quantized) for a quantized
    checkpoint (see nvllm.quant.plan), else None. A quantized head with tensor parallelism is a ConfigError."""
    from nvllm.models.llama import ModelShape
    from nvllm.quant.fp8 import ONLINE
    from nvllm.quant.plan import LINEARS, LM_HEAD, quantizable_units, read_quantization_config, serving_plan
    from nvllm.quant.quant_config import parse_quantization_config

    keys = None if config.load_format == "dummy" else checkpoint_keys(config.model)
    try:
        if keys is not None and _compressed_tensors_view(config.model, hf_config) is not None:
            from nvllm.quant.compressed_tensors import gptq_keys

            keys = gptq_keys(keys)
        shape = ModelShape(hf_config, arch)
        raw = read_quantization_config(config.model, hf_config)
        parsed = None if raw is None else parse_quantization_config(raw)
        fp8 = "--quantization fp8" if config.quantization == "fp8" and raw is None else \
            "an FP8 checkpoint" if parsed is not None and parsed.fp8 is not None else None
        if shape.moe is not None and fp8:
            raise ValueError(f"{arch} is a mixture of experts, whose experts nvllm serves in full precision or packed "
                             f"4/8-bit (GPTQ, AWQ), not in FP8 ({fp8} was given)")
        found = serving_plan(config.model, hf_config, shape, keys)
        if found is not None and found[0].desc_act and config.tensor_parallel_size > 1 and any(
                k.endswith(".experts") for k in found[1]):   # refused here, before any rank starts
            raise ValueError("act-order (desc_act) experts cannot be split over tensor-parallel ranks: their down "
                             "projections' inputs point to every rank's groups")
    except ValueError as e:
        raise ConfigError(f"{config.model}: {e}") from e
    total = len(quantizable_units(shape))
    linears = "decoder linears" if shape.moe is None else "decoder linears and expert stacks"
    if config.quantization == "fp8" and found is None:   # quantized while it loads (nvllm.quant.fp8)
        if log:
            logger.info("--quantization fp8: the %d decoder linears are quantized to FP8 (e4m3, a scale per output "
                        "row) while they load; embeddings and lm_head stay in %s", total,
                        str(config.dtype).removeprefix("torch."))
        return {f"layers.{i}.{fused}": ONLINE for i in range(hf_config.num_hidden_layers) for fused in LINEARS}
    if config.quantization is not None and config.quantization != (found[0].method if found else None):
        raise ConfigError(f"quantization {config.quantization!r} was asked for, but {config.model} is "
                          + (f"a {found[0].method} checkpoint" if found else "not quantized (`nvllm quantize` "
                             "makes a quantized copy; --quantization fp8 quantizes it to FP8 while it loads)"))
    if found is None:
        return None
    qcfg, plan = found
    head = LM_HEAD in plan
    if log and qcfg.fp8 is not None:
        from nvllm.kernels.fp8_gemm import W8A8_MIN_M

        w8a8 = f", W8A8 from {W8A8_MIN_M} rows with bf16 activations on Hopper GPUs" if W8A8_MIN_M else ""
        logger.info("quantized checkpoint: %s, %s (served W8A16%s%s); %d of %d decoder linears quantized (the "
                    "rest, embeddings and lm_head in full precision)", qcfg.method, qcfg.fp8.describe(), w8a8,
                    ": the checkpoint's activation scales are not applied" if any(
                        s.static_inputs for s in plan.values()) else "", len(plan), total)
    elif log:
        logger.info("quantized checkpoint: %s %d-bit, group size %d; %d of %d %s quantized (the "
                    "rest and embeddings in full precision); lm_head %s%s", qcfg.method, qcfg.bits,
                    qcfg.group_size, len(plan) - head, total, linears, "quantized" if head else "in full precision",
                    f"; served W8A16: the checkpoint's int8 activations ({qcfg.activations}) are not quantized"
                    if qcfg.activations else "")
    return plan


def load_model(config: EngineConfig, hf_config, dtype: torch.dtype, device: torch.device, tp=None):
    """The model with its weights on ``device``. ``tp`` (a TPGroup): build and load only this rank's shard;
    each checkpoint tensor is read whole and narrowed to the rank's piece before it reaches the device."""
    arch, cls = resolve_architecture(hf_config)
    from nvllm.quant.plan import LM_HEAD

    plan = quantization_plan(config, hf_config, arch)
    head = plan.pop(LM_HEAD, None) if plan is not None else None
    extra = {"tp": tp} if tp is not None and tp.size > 1 else {}
    with torch.device(device):
        model = cls(hf_config, arch, dtype, quant_plan=plan, **extra) if plan is not None else \
            cls(hf_config, arch, dtype, **extra)
        if head is not None:    # a quantized LM head (column-parallel under tensor parallelism)
            from nvllm.layers.embed_head import QuantLMHead

            model.lm_head = QuantLMHead(model.shape.vocab_size, model.shape.hidden_size, head, dtype, **extra)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
        logger.info("loaded %s with random weights (load_format=dummy)", arch)
    else:
        weights = _without_attention_scales(iterate_weights(config.model, config.load_format, config.allow_pickle))
        with torch.no_grad():
            try:
                view = _compressed_tensors_view(config.model, hf_config) or _gptq_v2_view(config.model, hf_config)
                model.load_weights(weights if view is None else view(weights))
            except ValueError as e:  # a compressed-tensors module that cannot be translated
                raise ConfigError(f"{config.model}: {e}") from e
            if view is not None and getattr(view, "dropped", 0):
                logger.info("the checkpoint's %d static activation tensors (input_scale, input_zero_point) are "
                            "not used: its linears run W8A16", view.dropped)
        logger.info("loaded %s from %s", arch, config.model)
    for m in model.modules():   # quantized layers: validate and cache their packed weights now, not mid-capture
        if hasattr(m, "quant_weight"):
            m.quant_weight()
        if hasattr(m, "prepare_w8a8"):
            m.prepare_w8a8()
    return model.eval()


ATTENTION_SCALES = (".k_scale", ".v_scale", ".q_scale", ".prob_scale", ".kv_scale", "k_proj.output_scale",
                    "v_proj.output_scale")
"""Tensors of FP8 checkpoints that scale a quantized KV cache or attention (AutoFP8, llm-compressor, ModelOpt)."""


def _without_attention_scales(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors less its KV-cache / attention scales: nvllm's quantized KV cache
    (``--kv-cache-dtype``) computes its own scales per token and head. Said once when there were any."""
    skipped = 0
    for name, tensor in weights:
        if name.endswith(ATTENTION_SCALES):
            skipped += 1
            continue
        yield name, tensor
    if skipped:
        logger.warning("the checkpoint's %d KV-cache / attention scales (k_scale, v_scale, …) are not used: "
                       "--kv-cache-dtype int8/fp8 computes its own scales per token and head", skipped)


def _gptq_v2_view(model_dir: str, hf_config):
    """A GPTQ v2 checkpoint's tensors are read translated into v1's (nvllm.quant.gptq_v2); None for any other."""
    from nvllm.quant.gptq_v2 import GPTQv2View
    from nvllm.quant.plan import read_quantization_config
    from nvllm.quant.quant_config import parse_quantization_config

    raw = read_quantization_config(model_dir, hf_config)
    if raw is None or parse_quantization_config(raw).packing != "gptq_v2":
        return None
    return GPTQv2View(parse_quantization_config(raw).bits, checkpoint_keys(model_dir) or set())


def _compressed_tensors_view(model_dir: str, hf_config):
    """A llm-compressor INT checkpoint's tensors are read translated into GPTQ v1's (nvllm.quant.compressed_tensors);
    None for any other checkpoint."""
    from nvllm.quant import compressed_tensors as ct
    from nvllm.quant.fp8 import Fp8Scheme
    from nvllm.quant.plan import read_quantization_config

    raw = read_quantization_config(model_dir, hf_config)
    if not ct.is_compressed_tensors(raw):
        return None
    scheme = ct.weight_scheme(raw)
    if isinstance(scheme, Fp8Scheme):   # FP8 tensors load as they are stored
        return None
    return ct.GPTQView(scheme, checkpoint_keys(model_dir) or set())


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Small uniform weights (norms at 1), so activations stay finite at any depth. Quantized layers draw
    random packed codes with small scales (``QuantLinear.init_dummy``)."""
    gens: dict[torch.device, torch.Generator] = {}
    own_init = set()
    for mname, m in model.named_modules():
        if hasattr(m, "init_dummy"):
            p0 = next(m.parameters())
            m.init_dummy(gens.setdefault(p0.device, torch.Generator(device=p0.device).manual_seed(seed)))
            own_init.update(f"{mname}.{n}" for n, _ in m.named_parameters())
    for name, p in model.named_parameters():
        if name in own_init:
            continue
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        p.uniform_(-1e-2, 1e-2, generator=gen)
