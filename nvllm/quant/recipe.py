"""What to quantize and how: ``QuantizeConfig``, validated once, built from defaults, a YAML recipe and the
command line (in that order of precedence, the command line last).

A recipe (a YAML file; those in recipes/ ship with the package and are named alone: ``--recipe gptq-w4g128``) uses
the same names as the flags, with the method's own knobs and the calibration
settings in sections::

    method: gptq            # awq | gptq | rtn | fp8 (e4m3 weights, no calibration)
    bits: 4                 # 4 | 8 (awq: 4; fp8: 8, its default)
    group_size: 128         # or -1: one group spanning each row (fp8: blocks of group_size², -1: see fp8_export)
    sym: true               # awq: false (zero point)
    desc_act: false         # gptq: act-order
    quantize_lm_head: false # gptq / rtn: the LM head too (GPTQModel's lm_head=True)
    format: gptq            # the checkpoint written: awq (AWQ-GEMM; method awq's default), gptq (v1; gptq's and
                            # rtn's default), compressed-tensors (llm-compressor's, any method) or fp8 (fp8's
                            # default: quant_method fp8, as Qwen3-*-FP8)
    gptq: {damp_percent: 0.01, block_size: 128, static_groups: true}
    awq: {n_grid: 20, duo_scaling: true, clip: true, max_shrink: 0.5}
    calibration: {dataset: c4, samples: 128, seqlen: 2048, seed: 0}

Unknown keys, wrong types and values out of range end in one ``RecipeError`` line naming the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvllm.config import first_line

METHODS = ("awq", "gptq", "rtn", "fp8")
FORMATS = ("awq", "gptq", "compressed-tensors", "fp8")


class RecipeError(ValueError):
    """A bad quantization setting (one clear line)."""


@dataclass
class QuantizeConfig:
    method: str | None = None
    bits: int | None = None            # None: 4, or 8 for fp8
    group_size: int = 128
    sym: bool | None = None            # None: the method's default (gptq/rtn symmetric, awq zero point)
    desc_act: bool = False
    quantize_lm_head: bool = False     # gptq/rtn: quantize the LM head too (written as "lm_head": true)
    damp_percent: float = 0.01
    block_size: int = 128
    static_groups: bool = True
    n_grid: int = 20
    duo_scaling: bool = True
    clip: bool = True
    max_shrink: float = 0.5
    calib_dataset: str = "c4"
    calib_split: str | None = None     # a dataset's split (None: its own, or train)
    calib_column: str | None = None    # a dataset's column (None: text, else messages)
    calib_config: str | None = None    # a Hub dataset's configuration (None: its only one, or the named set's)
    calib_samples: int = 128
    calib_seqlen: int = 2048
    seed: int = 0
    device: str = "auto"
    checkpoint_format: str | None = None  # None: the method's own (awq: AWQ-GEMM, gptq / rtn: GPTQ v1)
    max_shard_size: str = "5GB"        # larger weights go into numbered shards with an index (AutoAWQ's default)

    @property
    def writes(self) -> str:
        """The checkpoint format written: awq, gptq, compressed-tensors or fp8."""
        return self.checkpoint_format or {"awq": "awq", "fp8": "fp8"}.get(self.method, "gptq")

    @property
    def format(self) -> str:
        """The packing whose shape rules decide what is quantized: AWQ-GEMM's for an AWQ checkpoint, GPTQ's
        otherwise (compressed-tensors packs along the input as GPTQ does, and nvllm reads it as GPTQ)."""
        return "awq" if self.writes == "awq" else "gptq"

    def validate(self) -> "QuantizeConfig":
        if self.method is None:
            raise RecipeError("choose a method: --method awq|gptq|rtn|fp8 (or --recipe FILE)")
        self.method = self.method.lower()
        if self.method not in METHODS:
            raise RecipeError(f"unknown method {self.method!r}; choose awq, gptq, rtn or fp8")
        if self.bits is None:
            self.bits = 8 if self.method == "fp8" else 4
        if self.checkpoint_format is not None:
            self.checkpoint_format = self.checkpoint_format.lower()
        check_shard_size(self.max_shard_size)
        if self.method == "fp8":
            return _fp8_rules(self)
        if self.bits not in (4, 8):
            raise RecipeError(f"bits must be 4 or 8, got {self.bits}")
        if self.checkpoint_format is not None:
            if self.checkpoint_format not in FORMATS:
                raise RecipeError(f"unknown format {self.checkpoint_format!r}; choose {', '.join(FORMATS)}")
            if self.checkpoint_format == "awq" and self.method != "awq":
                raise RecipeError(f"the AWQ-GEMM format holds AWQ's zero-point weights; --method {self.method} "
                                  "writes gptq or compressed-tensors")
            if self.checkpoint_format == "gptq" and self.method == "awq":
                raise RecipeError("AWQ's zero points of 0 have no GPTQ v1 encoding; --method awq writes awq or "
                                  "compressed-tensors")
            if self.checkpoint_format == "fp8":
                raise RecipeError(f"the fp8 format holds FP8 weights: --method fp8 writes it, --method "
                                  f"{self.method} writes integer codes")
        if self.method == "awq" and self.bits != 4:
            raise RecipeError("AWQ quantizes to 4 bits only; use --method gptq or rtn for 8-bit")
        if self.group_size != -1 and self.group_size < 1:
            raise RecipeError(f"group size must be a positive integer or -1, got {self.group_size}")
        if self.sym is None:
            self.sym = self.method != "awq"
        if self.method == "awq" and self.sym:
            raise RecipeError("AWQ quantizes with a zero point (asymmetric); drop --sym")
        if self.desc_act and self.method != "gptq":
            raise RecipeError("--desc-act (act-order) applies to GPTQ only")
        if self.desc_act and not self.static_groups and self.writes == "compressed-tensors":
            raise RecipeError("compressed-tensors no longer stores act-order group indices (weight_g_idx): use "
                              "static groups (gptq.static_groups: true) with --desc-act")
        if self.quantize_lm_head and self.method == "awq":
            raise RecipeError("--quantize-lm-head applies to GPTQ and RTN only: AutoAWQ checkpoints keep the "
                              "lm_head in full precision; use --method gptq or rtn")
        if not 0 < self.damp_percent < 1:
            raise RecipeError(f"damp_percent must be in (0, 1), got {self.damp_percent}")
        if self.block_size < 1:
            raise RecipeError(f"block_size must be at least 1, got {self.block_size}")
        if self.n_grid < 1:
            raise RecipeError(f"n_grid must be at least 1, got {self.n_grid}")
        if not 0 <= self.max_shrink < 1:
            raise RecipeError(f"max_shrink must be in [0, 1), got {self.max_shrink}")
        if self.calib_samples < 1:
            raise RecipeError(f"--calib-samples must be at least 1, got {self.calib_samples}")
        if self.calib_seqlen < 2:
            raise RecipeError(f"--calib-seqlen must be at least 2, got {self.calib_seqlen}")
        if not 0 <= self.seed < 2 ** 63:
            raise RecipeError(f"the calibration seed must be in [0, 2^63), got {self.seed}")
        for method, section in (("gptq", _SECTIONS["gptq"]), ("awq", _SECTIONS["awq"])):
            changed = [key for key, (name, _) in section.items()
                       if self.method != method and getattr(self, name) != _DEFAULTS[name]]
            if changed:  # as --desc-act is refused for other methods: a setting that would do nothing
                raise RecipeError(f"{method}.{changed[0]} applies to --method {method}, not {self.method}")
        return self


# recipe key → (config field, type); sections flatten into the same fields
_TOP = {"method": ("method", str), "bits": ("bits", int), "group_size": ("group_size", int), "sym": ("sym", bool),
        "desc_act": ("desc_act", bool), "quantize_lm_head": ("quantize_lm_head", bool),
        "device": ("device", str), "format": ("checkpoint_format", str),
        "max_shard_size": ("max_shard_size", str)}
_SECTIONS = {
    "gptq": {"damp_percent": ("damp_percent", float), "block_size": ("block_size", int),
             "static_groups": ("static_groups", bool)},
    "awq": {"n_grid": ("n_grid", int), "duo_scaling": ("duo_scaling", bool), "clip": ("clip", bool),
            "max_shrink": ("max_shrink", float)},
    "calibration": {"dataset": ("calib_dataset", str), "split": ("calib_split", str), "column": ("calib_column", str),
                    "config": ("calib_config", str), "samples": ("calib_samples", int),
                    "seqlen": ("calib_seqlen", int), "seed": ("seed", int)},
}


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(QuantizeConfig)}


def check_shard_size(size: str) -> None:
    """A shard size as ``save_pretrained`` takes it: a number and a unit of KB, MB, GB or TB, or bytes; at least one
    byte."""
    from nvllm.quant.shard_writer import parse_size

    try:
        ok = parse_size(size) >= 1
    except (ValueError, OverflowError):       # a bad unit or number; inf
        ok = False
    if not ok:
        raise RecipeError(f"--max-shard-size must be a positive size such as 5GB or 500MB (or a number of bytes), "
                          f"got {size!r}")


def _fp8_rules(cfg: QuantizeConfig) -> QuantizeConfig:
    """FP8 (``nvllm.quant.fp8_export``): 8 bits, blocks of ``group_size``² (-1: a scale per tensor in the fp8
    format, per row in compressed-tensors), no integer settings, no calibration."""
    if cfg.bits != 8:
        raise RecipeError(f"FP8 weights have 8 bits, got --bits {cfg.bits}")
    fmt = cfg.writes
    if fmt not in ("fp8", "compressed-tensors"):
        raise RecipeError(f"--method fp8 writes the fp8 format (quant_method fp8) or compressed-tensors, not {fmt}")
    if cfg.group_size != -1 and (cfg.group_size < 16 or cfg.group_size % 16):
        raise RecipeError(f"fp8 blocks are group_size × group_size weights, group_size a multiple of 16 (or -1), "
                          f"got {cfg.group_size}")
    for flag, on in (("--desc-act", cfg.desc_act), ("--quantize-lm-head", cfg.quantize_lm_head),
                     ("--no-sym", cfg.sym is False)):
        if on:
            raise RecipeError(f"{flag} does not apply to --method fp8 (symmetric e4m3 codes; vLLM and nvllm keep "
                              f"the LM head of FP8 checkpoints in full precision)")
    cfg.sym = True
    for method, section in (("gptq", _SECTIONS["gptq"]), ("awq", _SECTIONS["awq"]),
                            ("calibration", _SECTIONS["calibration"])):
        changed = [key for key, (name, _) in section.items() if getattr(cfg, name) != _DEFAULTS[name]]
        if changed and method == "calibration":
            raise RecipeError(f"calibration.{changed[0]} (--calib-…/--seed) does not apply to --method fp8: FP8 "
                              f"needs no calibration data")
        if changed:
            raise RecipeError(f"{method}.{changed[0]} applies to --method {method}, not fp8")
    return cfg


def _typed(value: Any, typ: type, where: str) -> Any:
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typ is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
        raise RecipeError(f"{where} must be {names[typ]}, got {value!r}")
    return value


def parse_recipe(data: Any, where: str = "recipe") -> dict[str, Any]:
    """A recipe mapping → ``{config field: value}`` (validated types; unknown keys rejected)."""
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a mapping of settings at the top level")
    fields: dict[str, Any] = {}
    for key, value in data.items():
        if key in _TOP:
            name, typ = _TOP[key]
            fields[name] = _typed(value, typ, f"{where}: {key}")
        elif key in _SECTIONS:
            if not isinstance(value, dict):
                raise RecipeError(f"{where}: {key} must be a mapping, got {value!r}")
            for sub, subval in value.items():
                if sub not in _SECTIONS[key]:
                    raise RecipeError(f"{where}: unknown key {key}.{sub} (allowed: "
                                      f"{', '.join(_SECTIONS[key])})")
                name, typ = _SECTIONS[key][sub]
                fields[name] = _typed(subval, typ, f"{where}: {key}.{sub}")
        else:
            raise RecipeError(f"{where}: unknown key {key!r} (allowed: {', '.join([*_TOP, *_SECTIONS])})")
    return fields


RECIPES_DIR = Path(__file__).resolve().parents[1] / "assets" / "recipes"  # the repository's recipes/, in the package


def recipe_path(name: str) -> str:
    """A recipe file: ``name`` as a path, or else one of the shipped recipes by its name (``gptq-w4g128``, with or
    without ``.yaml``, or ``recipes/gptq-w4g128.yaml`` as the README writes it from a checkout)."""
    if Path(name).is_file():
        return name
    stem = Path(name).name.removesuffix(".yaml")
    shipped = RECIPES_DIR / f"{stem}.yaml"
    if shipped.is_file() and (Path(name).parent in (Path("."), Path("recipes"))):
        return str(shipped)
    return name


def shipped_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def load_recipe(path: str) -> dict[str, Any]:
    import yaml

    path = recipe_path(path)

    class UniqueKeys(yaml.SafeLoader):
        """YAML lets a later key replace an earlier one in silence; a recipe that names a setting twice is refused."""

    def mapping(loader, node, deep=False):
        keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
        twice = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
        if twice is not None:
            raise RecipeError(f"{path}: {twice!r} is set twice")
        return loader.construct_mapping(node, deep)

    UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=UniqueKeys)
    except FileNotFoundError:
        raise RecipeError(f"recipe not found: {path} (shipped recipes: {', '.join(shipped_recipes())})") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise RecipeError(f"cannot read recipe {path}: {first_line(e)}") from e
    return parse_recipe(data, path)


def build_config(recipe: str | None = None, **flags: Any) -> QuantizeConfig:
    """Defaults ← the recipe ← the flags that were given (None means not given); validated."""
    fields = load_recipe(recipe) if recipe else {}
    known = {f.name for f in dataclasses.fields(QuantizeConfig)}
    unknown = set(flags) - known
    if unknown:
        raise TypeError(f"unknown quantize settings {sorted(unknown)}")
    given = {k: v for k, v in flags.items() if v is not None}
    from_recipe = sorted(set(fields) - set(given))
    fields.update(given)
    try:
        return QuantizeConfig(**fields).validate()
    except RecipeError as e:
        if not from_recipe:
            raise
        raise RecipeError(f"{e} (recipe {recipe} sets {', '.join(from_recipe)})") from None
