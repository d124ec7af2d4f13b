"""The kvlib command line: output, --json, and one-line errors with non-zero exit."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from kvlib.cli import gpu_memory_gib, main, parse_memory, parse_size
from kvlib.plan import engines


def test_parse_size():
    assert parse_size("32k") == 32768 and parse_size("128K") == 131072
    assert parse_size("1m") == 1 << 20 and parse_size("4096") == 4096
    for bad in ("0", "-5", "abc", "1.0001k", "", "80GB"):  # memory is not a token count
        with pytest.raises(ValueError):
            parse_size(bad)


def test_parse_memory_is_gib_with_or_without_gb():
    """A bare number is GiB; "GB" is read as GiB too, as GPUs and RAM are labelled."""
    assert parse_memory("24") == parse_memory("24GB") == parse_memory("24 GiB") == 24.0
    assert parse_memory("13.5g") == 13.5 and parse_memory("0") == 0.0
    for bad in ("-1", "abc", "80TB", "80 MB", "nan", "inf", "", "GB"):
        with pytest.raises(ValueError):
            parse_memory(bad)


def test_gpu_names_and_gpu_memory_give_the_same_gib(capsys):
    # as the driver reports: nvidia-smi's MiB over 1024
    assert gpu_memory_gib("H100") == gpu_memory_gib("h100 80gb") == 81_559 / 1024
    assert gpu_memory_gib("rtx_4090") == 24_564 / 1024 and gpu_memory_gib("T4") == 15.0
    argv = ["plan", "--model", "llama-3.1-8b", "--context", "32k", "--concurrency", "4", "--json"]
    outs = []
    for where in (["--gpu", "A100 80GB"], ["--gpu-memory", "80"], ["--gpu-memory", "80GB"]):
        assert main([*argv, *where]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    # a named GPU also gives its compute capability (an A100: 8.0, which runs every type here)
    assert outs[0]["budget"].pop("compute_capability") == [8, 0]
    assert [o["budget"].pop("compute_capability") for o in outs[1:]] == [None, None]
    assert outs[0] == outs[1] == outs[2]
    assert outs[0]["gpu_memory_gb"] == 80 and outs[0]["budget"]["device_bytes"] == 80 * 2**30


def test_memory_table(capsys):
    assert main(["memory", "--model", "llama-3.1-8b", "--context", "32k", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "128 KiB" in out and "32 GiB" in out  # per token, batch of 8 at fp16


def test_memory_json_bits(capsys):
    argv = ["memory", "--model", "llama-3.1-8b", "--context", "32k", "--bits", "4", "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["bits"] for r in rows] == [16, 4]
    assert rows[0]["bytes_per_sequence"] == 4 * 1024**3


def test_plan_text_and_json(capsys):
    from kvlib import memory, specs

    argv = ["plan", "--model", "llama-3.1-8b", "--gpu-memory", "24", "--context", "32k"]
    assert main([*argv, "--concurrency", "16"]) == 0
    out = capsys.readouterr().out
    assert "vllm serve meta-llama/Llama-3.1-8B --kv-cache-dtype fp8" in out
    # llama.cpp's 4.5-bit type that measured best (kvlib/results.json, run "llama.cpp")
    # (of those the default CUDA build runs natively: iq4_nl would run attention on the CPU)
    assert "llama-server -m Llama-3.1-8B-F16.gguf" in out and "--cache-type-k q4_0" in out
    assert engines.measured_llama_cpp()["iq4_nl"] < engines.measured_llama_cpp()["q4_0"]
    assert "on 1 × 24 GiB GPU" in out and not re.search(r"\bGB\b", out)  # one unit: GiB
    # transformers: kvlib's int4 cache (groups of 32, fp16 scale + zero point), as many as fit
    assert main([*argv, "--concurrency", "16", "--json"]) == 0
    budget = json.loads(capsys.readouterr().out)["budget"]["kv_budget_bytes"]
    int4 = memory.kv_cache_bytes(specs.get_spec("llama-3.1-8b"), 32768, 1, 4, group_size=32)
    assert (
        "transformers: cache = kvlib.compat.prefill_cache(model, prompt_ids[:, :-1], "
        "chunk_size=2048, cache=kvlib.caches.registry.make_cache('kvlib-int4', model.config)); "
        f"model.generate(prompt_ids, past_key_values=cache, ...), batch of {min(16, budget // int4)}"
    ) in out
    assert main([*argv, "--concurrency", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["kv"], d["engine"]) == ("int4", "llama.cpp")
    # the best-measured of llama.cpp's int4-level types that holds the request
    assert d["kv_type"] in {t.name for t in engines.candidates("llama.cpp", "int4")}
    assert d["llama_cpp"]["--cache-type-k"] == d["kv_type"].split("/")[0]
    assert d["llama_cpp"]["-np"] == 4 and d["llama_cpp"]["-c"] == 4 * 32768
    assert d["vllm"]["max_model_len"] == 32768 and d["vllm"]["kv_cache_dtype"] == "fp8"
    assert d["transformers"]["cache"] == "kvlib-int4"


def test_models(capsys):
    assert main(["models", "--json"]) == 0
    names = [m["name"] for m in json.loads(capsys.readouterr().out)]
    assert "llama-3.1-8b" in names and "deepseek-v3" in names


def test_caches_lists_the_one_registry(capsys):
    """`kvlib caches` lists every registry name, eviction caches with their budget in the name,
    and each listed name builds a cache (make_cache), checked on a tiny config."""
    from kvlib.caches import registry
    from kvlib.eval.model_choice import random_config

    assert main(["caches", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in listed] == list(registry.CACHE_NAMES)
    assert {c["family"] for c in listed} == set(registry.FAMILIES)
    assert all(c["budgeted"] == (c["family"] in ("evict", "kvtc")) for c in listed)
    assert main(["caches", "--family", "evict"]) == 0
    text = capsys.readouterr().out
    assert "evict-h2o-int4@<share>" in text and "kvlib-int4" not in text
    assert [c["requires"] for c in listed if c["family"] == "paged"] == [["num_blocks"]]
    assert main(["caches", "--family", "paged"]) == 0
    assert "paged num_blocks=<n>" in capsys.readouterr().out
    assert main(["caches", "--family", "kvtc"]) == 0
    assert "kvtc@<share> basis=<KVPCABasis>" in capsys.readouterr().out
    from _synthetic_kv import correlated_layers

    from kvlib import compat
    from kvlib.kvtc import pca

    config = random_config("smollm2-135m", num_layers=2, vocab_size=512, intermediate_size=256)
    basis = pca.fit_basis(correlated_layers(24, 64), cross_layer=False)
    for c in listed:
        name = f"{c['name']}@1/4" if c["budgeted"] else c["name"]
        if c["family"] == "kvtc":  # a stored cache's codec, not a live cache
            codec = registry.make_cache(name, config, basis=basis, tokens=1024)
            stored = codec.encode(compat.dynamic_cache_from(correlated_layers(1, 64)))
            assert codec.decode(stored).get_seq_length() == 64
            continue
        options = {"tokens": 64} if c["budgeted"] else {k: 8 for k in c["requires"]}
        assert registry.make_cache(name, config, **options).get_seq_length() == 0


@pytest.mark.parametrize(
    "argv, code, needle",
    [
        (["caches", "--family", "int4"], 1, "unknown cache family 'int4'"),
        (
            ["plan", "--model", "llama-3-8", "--gpu-memory", "24", "--context", "8k"],
            1,
            "did you mean llama-3.1-8b",
        ),
        (
            ["plan", "--model", "llama-3.1-8b", "--gpu-memory", "24", "--context", "32q"],
            2,
            "invalid size",
        ),
        (
            ["plan", "--model", "llama-3.1-8b", "--gpu-memory", "-3", "--context", "8k"],
            2,
            "--gpu-memory",
        ),
        (
            ["plan", "--model", "llama-3.1-8b", "--gpu-memory", "1TB", "--context", "8k"],
            2,
            "invalid memory",
        ),
        (
            [
                "plan",
                "--model",
                "llama-3.1-8b",
                "--gpu",
                "T4",
                "--context",
                "8k",
                "--num-gpus",
                "0",
            ],
            2,
            "--num-gpus",
        ),
        (
            ["memory", "--model", "llama-3.1-8b", "--context", "8k", "--bits", "7"],
            1,
            "bits must be one of",
        ),
        (["plan", "--model", "llama-3.1-8b", "--gpu", "nope", "--context", "8k"], 1, "unknown GPU"),
        ([], 2, "required"),
    ],
)
def test_bad_input_one_line(capsys, argv, code, needle):
    assert main(argv) == code
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_python_m_kvlib_help():
    r = subprocess.run(
        [sys.executable, "-m", "kvlib", "plan", "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "--concurrency" in r.stdout


def test_every_subcommand_has_help(capsys):
    for argv in (["--help"], *([c, "--help"] for c in ("memory", "plan", "models", "caches"))):
        assert main(argv) == 0
        assert "--json" in capsys.readouterr().out or argv == ["--help"]


def test_console_script_declared():
    import importlib
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    entry = tomllib.loads(pyproject.read_text())["project"]["scripts"]["kvlib"]
    module, func = entry.split(":")
    assert getattr(importlib.import_module(module), func) is main


def test_plan_cites_a_results_file(tmp_path, capsys, monkeypatch):
    path = tmp_path / "m.json"
    run = {"source": "bench", "command": "bench", "machine": "test", "model": "TinyTest-1M"}
    rows = {"kvlib-int4": {"perplexity_delta_pct": 2.25}, "hf-fp8": {"perplexity_delta_pct": 0.5}}
    run |= {"date": "2031-01-02", "rows": rows}
    path.write_text(json.dumps({"schema_version": 1, "runs": {"cache": run}}))
    argv = ["plan", "--model", "llama-3.1-8b", "--gpu-memory", "24", "--context", "32k"]
    argv += ["--concurrency", "4"]  # llama.cpp's q4_0: not measured, kvlib's int4 cited
    assert main([*argv, "--results", str(path)]) == 0
    out = capsys.readouterr().out
    assert "why: q4_0 (llama.cpp) is not measured" in out
    assert "(kvlib-int4): +2.25 % perplexity on TinyTest-1M on a CPU (test)" in out
    assert "measured 2031-01-02" in out
    fp8 = ["plan", "--model", "llama-3.1-8b", "--gpu-memory", "24", "--context", "16k"]
    assert main([*fp8, "--concurrency", "4", "--results", str(path)]) == 0  # vLLM's fp8
    assert "why: fp8 (hf-fp8): +0.5 % perplexity on TinyTest-1M" in capsys.readouterr().out
    monkeypatch.setenv("KVLIB_RESULTS", str(path))
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert any("+2.25 %" in r for r in d["reasons"]) and d["buys"].startswith("q4_0 fits")
    assert main([*argv, "--results", str(tmp_path / "nope.json")]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and len(err.strip().splitlines()) == 1


def test_impossible_plan_says_what_would_fit(capsys):
    argv = ["plan", "--model", "llama-3.1-70b", "--gpu", "RTX 4090", "--context", "8k"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "status: impossible" in out and "vllm serve" not in out
    # 4-bit weights alone (32.9 GiB) do not fit one 24 GiB card; with two cards they do
    assert "would fit: weight_bits=4" not in out
    assert "would fit: num_gpus=2 with weight_bits=4" in out


def test_plan_takes_the_engines_a_reader_runs(capsys):
    argv = ["plan", "--model", "gemma-3-27b", "--gpu-memory", "40", "--context", "128k"]
    argv += ["--weight-bits", "8", "--engine", "transformers"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "engines transformers only" in out and "KV cache: kvlib-int8 on transformers" in out
    assert main(argv[:-2] + ["--engine", "tgi"]) == 2
    assert "invalid choice: 'tgi'" in capsys.readouterr().err


def test_plan_on_a_named_gpu_knows_its_compute_capability(capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                "qwen2.5-7b",
                "--gpu",
                "T4",
                "--context",
                "8k",
                "--weight-bits",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "compute capability 7.5" in out.splitlines()[0] and "vllm serve" not in out
    assert "llama-server -m Qwen2.5-7B-Q8_0.gguf" in out
